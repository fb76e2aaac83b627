"""How results show themselves: every public result type's repr is one line of at most 200
characters (a summary, never a dump), and its _repr_html_ a compact table of the right numbers,
every text escaped; a CheckReport's repr is its verdict."""

from html.parser import HTMLParser

import keras
import numpy as np
import pytest
import tensorflow as tf
from models import batches, keras_model

import hostavg
import hostavg.keras
from hostavg.cli import models
from hostavg.core import display
from hostavg.hooks import Drop, Record

v1 = tf.compat.v1


class Table(HTMLParser):
    """The tables of an HTML block: each a list of rows, each row a list of its cells' text;
    ``text`` everything outside them."""

    def __init__(self, markup: str):
        super().__init__()
        self.tables, self.text, self._row, self._cell = [], [], None, None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr":
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        (self._cell if self._cell is not None else self.text).append(data)


class DropWith:
    """Drops micro-batch ``index`` with a reason that holds markup."""

    def __init__(self, index):
        self.index = index

    def on_micro_batch(self, micro):
        return Drop("<b>odd</b> & loud") if micro.index == self.index else None


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """An MLP of 8 hidden layers (18 variables) stepped in "stack" mode over 64 micro-batches,
    micro-batch 5 dropped, recorded; then fitted: (trainer, session, result, history, record)."""
    folder = tmp_path_factory.mktemp("display") / "record"
    model = models.mlp(6, [8] * 8, 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), accumulate="stack",
                                  hooks=[DropWith(5), Record(folder, micro=False)],
                                  micro_batch_size=4, update_ratios_every=1)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(256, 6)).astype(np.float32)
    data = {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}
    result = trainer.step(sess, hostavg.split(data, 4))
    history = trainer.fit(sess, data, batch_size=32, epochs=2, seed=0, progress=False)
    return trainer, sess, result, history, hostavg.load_record(folder), data


def one_line(obj) -> str:
    text = repr(obj)
    assert "\n" not in text and len(text) <= display.REPR_LIMIT, (len(text), text)
    return text


def test_every_result_types_repr_is_one_short_line(deep):
    trainer, sess, result, history, record, data = deep
    assert len(result.micro) == 64 and len(result.grads) == 18
    for obj in (trainer, result, result.micro[5], result.micro[0], result.stats, result.grads,
                history, history.steps[-1], record, record[record.steps[-1]]):
        one_line(obj)
    assert one_line(result) == (f"StepResult(step=1, loss={display.number(result.loss)}, "
                                f"size=252, micro_batches=64, grad_norm="
                                f"{display.number(result.stats.grad_norm)}, dropped=(5,))")
    assert one_line(result.micro[5]).startswith("MicroBatch(index=5, size=4, loss=")
    assert "dropped='<b>odd</b> & loud'" in repr(result.micro[5])
    assert one_line(result.grads).startswith("Gradients({'hidden0/kernel': (6, 8) float32, ")
    assert "more}, loss=" in repr(result.grads)  # 18 variables do not fit: counted
    assert one_line(trainer) == ("hostavg.Trainer(variables=18, micro_batch_size=4, "
                                 "accumulate='stack', average='host', "
                                 "hooks='DropWith, Record, WatchOutliers, Diagnose')")
    sparse = hostavg.SparseGradient(np.arange(1000), np.ones((1000, 4)), (5000, 4))
    assert one_line(sparse) == "SparseGradient(1000 rows of (5000, 4) float64)"


def test_a_check_reports_repr_is_its_verdict(deep):
    trainer, sess, result, history, record, data = deep
    feed = {k: v[:64] for k, v in data.items()}
    report = trainer.check(sess, feed, micro_batch_size=16)
    assert report.ok and one_line(report) == str(report)
    assert repr(report).startswith("self-check passed: 4 micro-batches give the whole batch's")
    failed = hostavg.core.check.CheckReport(False, {"w": 0.75}, 4, 4.0, 0.0, "a long cause " * 30)
    assert one_line(failed).endswith("…") and str(failed).startswith(repr(failed)[:-1])
    markup = Table(failed._repr_html_())
    assert "self-check FAILED" in "".join(markup.text) and "cause: a long cause" in "".join(
        markup.text)
    assert markup.tables[0] == [["variable", "relative difference"], ["w", "0.75"]]


def test_a_steps_table_holds_its_micro_batches_the_mean_and_what_went_wrong(deep):
    trainer, sess, result, history, record, data = deep
    markup = Table(result._repr_html_())
    (rows,) = markup.tables
    assert rows[0] == ["micro-batch", "start", "size", "loss", "norm", "cosine", "dropped"]
    shown = rows[1:]
    assert len(shown) == display.ROWS + 1 and shown[10][0] == "… 45 more rows …"  # 64 + mean
    for row, m in zip(shown[:10], result.micro):
        assert row[:3] == [str(m.index), str(m.start), str(m.size)]
        assert row[3] == display.number(m.loss)
        assert row[4] == display.number(result.stats.micro_norms[m.index])
    assert shown[5][5] == "nan" and shown[5][6] == "<b>odd</b> & loud"  # escaped, read back
    assert shown[0][5] == display.number(result.stats.cosines[0])
    assert shown[-1][:5] == ["mean", "", "252", display.number(result.loss),
                             display.number(result.stats.grad_norm)]
    text = "".join(markup.text)
    assert text.startswith(f"Step 1: loss {display.number(result.loss)} over 252 samples in 64 "
                           f"micro-batches; B_simple")
    assert "micro-batch 5 dropped: <b>odd</b> & loud" in text
    assert "<b>odd</b>" not in result._repr_html_()  # escaped


def test_every_result_types_html_is_a_table(deep):
    trainer, sess, result, history, record, data = deep
    stats = Table(result.stats._repr_html_())
    assert stats.tables[0][0] == ["micro-batch", "loss", "norm"]  # cosines skip the dropped one
    assert "gsnr" in "".join(stats.text)
    grads = Table(result.grads._repr_html_()).tables[0]
    assert grads[0] == ["variable", "shape and dtype", "norm"] and len(grads) == 1 + 18
    assert grads[1] == ["hidden0/kernel", "(6, 8) float32",
                        display.number(np.linalg.norm(result.grads["hidden0/kernel"]))]
    epochs = Table(history._repr_html_())
    assert epochs.tables[0][0] == ["epoch", "loss", "samples", "steps"]
    assert [r[0] for r in epochs.tables[0][1:]] == ["0", "1"]
    assert epochs.tables[0][2][1] == display.number(history.epochs[1]["loss"])
    assert "micro-batches dropped" in "".join(epochs.text)
    steps = Table(record._repr_html_()).tables[0]
    assert steps[0][:4] == ["step", "loss", "size", "grad_norm"] and len(steps) == 1 + 17
    assert steps[1][:3] == ["1", display.number(result.loss), "252"]
    settings = dict(Table(trainer._repr_html_()).tables[0][1:])
    assert settings["accumulate"] == "stack" and settings["variables"] == "18"
    assert settings["hooks"] == "DropWith, Record, WatchOutliers, Diagnose"
    assert settings["update_ratios_every"] == "1"


def test_the_keras_trainer_shows_its_model_and_settings():
    model = keras_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = hostavg.keras.Trainer(model, micro_batches=2)
    assert one_line(trainer) == (f"hostavg.keras.Trainer(model={model.name!r}, variables='unknown "
                                 f"until the first batch', micro_batches=2, accumulate='sum', "
                                 f"batch_norm='micro', hooks='WatchOutliers, Diagnose')")
    data = batches(0, 1, 8)[0]
    trainer.step([(data["x"], data["y"])])
    assert "variables=4" in one_line(trainer)
    settings = dict(Table(trainer._repr_html_()).tables[0][1:])
    assert settings["model"] == model.name and settings["batch_norm"] == "micro"
