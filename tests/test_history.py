"""History (hostavg.train.history): rows derived from the step schema, JSON by name with a format
number, version 0.1.0's positional checkpoints read and resumed bit for bit."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from models import FIT, assert_bitwise, v1, variables

import hostavg
from hostavg.cli import models
from hostavg.core import schema
from hostavg.train import history as history_module
from hostavg.train.checkpoint import CheckpointDir

#: A checkpoint hostavg 0.1.0 wrote at global step 7 of 10 (tests/data/checkpoint-0.1.0/make.py).
OLD = Path(__file__).parent / "data" / "checkpoint-0.1.0"


def old_setup(*hooks):
    """The trainer, session and data of tests/data/checkpoint-0.1.0/make.py (``hooks`` after
    its clip hooks)."""
    model = models.mlp(10, [16], 3, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), accumulate="stack",
                                  update_ratios_every=1, distributions_every=2,
                                  hooks=[hostavg.hooks.ClipMicroBatchNorm(1.0),
                                         hostavg.hooks.ClipGlobalNorm(0.5), *hooks])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(250, 10)).astype(np.float32)
    return trainer, sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}


def saved_history(path) -> str:
    """The History's JSON a checkpoint file holds."""
    return json.loads(str(np.load(path)["meta"]))["fit"]["history"]


def old_history() -> tuple[dict, history_module.History]:
    """The 0.1.0 checkpoint's History as JSON data and as read."""
    text = saved_history(next(OLD.glob("ckpt-*.npz")))
    return json.loads(text), hostavg.History.from_json(text)


def test_a_0_1_0_history_reads_each_positional_field_by_its_name():
    data, history = old_history()
    assert "format" not in data and len(data["steps"]) == 7
    for row, log in zip(data["steps"], history.steps):
        assert len(row) == len(history_module.FORMAT_1)
        for name, value in zip(history_module.FORMAT_1, row):
            assert json.dumps(value) == json.dumps(getattr(log, name)), name
    assert history.steps[1].distributions is not None and history.steps[0].distributions is None
    assert history.steps[0].gsnr is None  # not kept by 0.1.0: missing, not shifted


def test_a_0_1_0_checkpoint_resumes_bit_for_bit_as_the_steps_it_lacks_taken_by_hand(tmp_path):
    shutil.copytree(OLD, tmp_path / "ckpt")
    trainer, sess, data = old_setup()
    resumed = trainer.fit(sess, data, checkpoint_dir=tmp_path / "ckpt", keep_checkpoints=1, **FIT)
    assert [s.step for s in resumed.steps] == list(range(1, 11))
    _, old = old_history()
    assert repr(resumed.steps[:7]) == repr(old.steps)  # the rows 0.1.0 wrote, kept
    assert resumed.steps[-1].gsnr is not None  # the rows this version wrote have every quantity

    by_hand, hand_sess, hand_data = old_setup()  # from the same checkpoint, the last 3 batches
    by_hand.restore(hand_sess, next(OLD.glob("ckpt-*.npz")))
    order = np.random.default_rng([FIT["seed"], 1]).permutation(250)
    for lo in (100, 150, 200):
        batch = {k: v[order[lo:lo + 50]] for k, v in hand_data.items()}
        by_hand.step(hand_sess, hostavg.split(batch, FIT["micro_batch_size"]))
    assert_bitwise(variables(trainer, sess), variables(by_hand, hand_sess))

    text = saved_history(CheckpointDir(tmp_path / "ckpt").latest())
    assert json.loads(text)["format"] == 2 and text == resumed.to_json()


def test_the_json_names_every_field_and_carries_the_format():
    trainer, sess, data = old_setup()
    history = trainer.fit(sess, data, **dict(FIT, epochs=1))
    written = json.loads(history.to_json())
    assert written["format"] == history_module.FORMAT == 2
    assert set(written["steps"][0]) == set(hostavg.StepLog._fields)
    # a field inserted anywhere (here: the rows reversed) still reads by its name
    written["steps"] = [dict(reversed(list(s.items()))) for s in written["steps"]]
    assert repr(hostavg.History.from_json(json.dumps(written)).steps) == repr(history.steps)
    # a field a later version added is left out; a later format is refused by its number
    written["steps"][0]["from_the_future"] = 1.0
    assert len(hostavg.History.from_json(json.dumps(written)).steps) == len(history.steps)
    with pytest.raises(hostavg.HostavgError, match=r"format 3; this version reads formats 1 and 2"):
        hostavg.History.from_json(json.dumps(dict(written, format=3)))


def test_the_norm_before_clipping_reaches_every_view_from_its_one_declaration(tmp_path):
    """grad_norm_before_clip was in the Record only; its Quantity brings it everywhere."""
    import matplotlib
    matplotlib.use("Agg")
    from tensorboard.backend.event_processing import event_accumulator as ea
    trainer, sess, data = old_setup(hostavg.hooks.Record(tmp_path / "rec"),  # ClipGlobalNorm(0.5)
                                    hostavg.hooks.TensorBoard(tmp_path / "tb"))
    history = trainer.fit(sess, data, **dict(FIT, epochs=1))
    want = [s.grad_norm_before_clip for s in history.steps]
    assert all(w > 0.5 for w in want) and [s.grad_norm for s in history.steps] == \
        pytest.approx([0.5] * 5)
    assert list(history.to_pandas()["grad_norm_before_clip"]) == want
    assert list(hostavg.load_record(tmp_path / "rec").to_pandas()["grad_norm_before_clip"]) == want
    board = ea.EventAccumulator(str(tmp_path / "tb")).Reload()
    np.testing.assert_allclose([e.value for e in board.Scalars("hostavg/grad_norm_before_clip")],
                               want, rtol=1e-6)
    line = hostavg.plot.statistic(history, "grad_norm_before_clip").lines[0]
    assert list(line.get_ydata()) == want


def test_every_history_quantity_is_a_steplog_field_and_a_table_column_by_its_kind():
    assert hostavg.StepLog._fields == ("epoch", "samples", *(q.name for q in schema.HISTORY),
                                       "statistics")
    trainer, sess, data = old_setup()
    history = trainer.fit(sess, data, **dict(FIT, epochs=1))
    table = history.to_pandas()
    for q in schema.HISTORY:
        assert (q.name in table.columns) == (q.kind in (schema.Kind.STEP, schema.Kind.MICRO,
                                                        schema.Kind.INDICES)), q.name
    assert history.statistic("micro_norms").shape == (5, 3)
    assert list(history.statistic("update_ratios").columns) == list(history.variables)
    with pytest.raises(hostavg.HostavgError, match=r"no quantity or statistic 'nope'"):
        history.statistic("nope")
    with pytest.raises(hostavg.HostavgError, match=r"'distributions' is percentiles per "
                                                   r"variable, which has no table"):
        history.statistic("distributions")
