"""User statistics (``Trainer(statistics={name: fn})``): one of each kind reaches History, the
Record, TensorBoard, the plot and a resumed checkpoint, equal to what a hook computing the same
function reads itself; one that raises or returns the wrong kind fails the step, nothing applied."""

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import FailAt, batches

import hostavg
from hostavg.hooks import Record, TensorBoard

FIT = {"batch_size": 32, "micro_batch_size": 8, "epochs": 2, "seed": 3, "progress": False}


def spread(result) -> float:
    """Per step: how far apart the micro-batches' norms are."""
    norms = result.stats.micro_norms
    return float(max(norms) - min(norms))


def weighted_losses(result) -> tuple:
    """Per micro-batch: its samples times its loss."""
    return tuple(m.size * m.loss for m in result.micro)


def largest(result) -> dict:
    """Per variable: the largest magnitude in the applied mean gradient."""
    return {name: float(np.max(np.abs(value))) for name, value in result.grads.items()}


STATISTICS = {"spread": spread, "weighted_losses": weighted_losses, "largest": largest}


class Seen:
    """A hook that computes the statistics itself from each applied step's result."""

    def __init__(self):
        self.steps = []

    def on_applied(self, result):
        self.steps.append((result.step, {n: fn(result) for n, fn in STATISTICS.items()}))


def padded(rows: list) -> np.ndarray:
    """Rows of different lengths (a short last batch has fewer micro-batches) NaN-padded."""
    width = max(map(len, rows))
    return np.array([list(r) + [np.nan] * (width - len(r)) for r in rows])


def test_a_statistic_of_each_kind_reaches_every_view_as_a_hook_computes_it(backend, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from tensorboard.backend.event_processing import event_accumulator as ea
    data = batches(4, 1, 100)[0]
    seen = Seen()
    face = backend.make(statistics=STATISTICS, hooks=[seen, Record(tmp_path / "rec"),
                                                      TensorBoard(tmp_path / "tb")])
    history = face.fit(data, **FIT)
    steps = [step for step, _ in seen.steps]
    assert steps == list(range(1, 9))
    want = {name: [values[name] for _, values in seen.steps] for name in STATISTICS}
    record = hostavg.load_record(tmp_path / "rec")
    for view in (history, record):
        got = view.statistic("spread")
        assert list(got.index) == steps and list(got["spread"]) == want["spread"]
        got = view.statistic("weighted_losses")
        assert got.shape == (8, 4) and list(got.columns) == [0, 1, 2, 3]
        np.testing.assert_array_equal(got.to_numpy(), padded(want["weighted_losses"]))
        got = view.statistic("largest")
        assert list(got.columns) == list(face.trainer.spec)
        np.testing.assert_array_equal(got.to_numpy(), [[w[n] for n in face.trainer.spec]
                                                       for w in want["largest"]])
    assert list(history.to_pandas()["spread"]) == want["spread"]
    assert list(record.to_pandas()["spread"]) == want["spread"]

    reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0,
                                                                      ea.HISTOGRAMS: 0}).Reload()
    board = [e.value for e in reader.Scalars("statistics/spread")]
    np.testing.assert_allclose(board, want["spread"], rtol=1e-6)  # TensorBoard keeps float32
    name = next(iter(face.trainer.spec))
    np.testing.assert_allclose([e.value for e in reader.Scalars(f"statistics/largest/{name}")],
                               [w[name] for w in want["largest"]], rtol=1e-6)
    sums = [h.histogram_value.sum for h in reader.Histograms("statistics/weighted_losses")]
    np.testing.assert_allclose(sums, [sum(w) for w in want["weighted_losses"]], rtol=1e-6)

    line = hostavg.plot.statistic(history, "spread").lines[0]
    assert list(line.get_xdata()) == steps and list(line.get_ydata()) == want["spread"]
    ax = hostavg.plot.statistic({"fit": history, "record": record}, "weighted_losses")
    np.testing.assert_array_equal(ax.collections[0].get_offsets()[:, 1],
                                  [v for w in want["weighted_losses"] for v in w])
    ax = hostavg.plot.statistic(history, "largest")
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), [w[name] for w in want["largest"]])


def test_a_resumed_fit_continues_the_statistics_of_the_history_it_resumes(backend, tmp_path):
    data = batches(5, 1, 100)[0]
    straight = backend.make(statistics=STATISTICS).fit(data, **FIT)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        backend.make(statistics=STATISTICS).fit(data, checkpoint_dir=tmp_path,
                                                callbacks=[FailAt(5)], **FIT)
    resumed = backend.make(statistics=STATISTICS).fit(data, checkpoint_dir=tmp_path, **FIT)
    for name in STATISTICS:
        assert resumed.statistic(name).equals(straight.statistic(name)), name
    assert resumed.statistics == straight.statistics


@pytest.mark.parametrize("first,then,match", [
    pytest.param(spread, lambda r: 1 / 0, r"statistic 'bad' raised ZeroDivisionError: division "
                                          r"by zero; nothing was applied", id="raises"),
    pytest.param(spread, lambda r: "high", r"statistic 'bad' returned 'high': a statistic "
                                           r"returns a real number \(per step\), 3 real numbers",
                 id="a string"),
    pytest.param(weighted_losses, lambda r: (1.0, 2.0),
                 r"statistic 'bad' returned \(1.0, 2.0\): .* 3 real numbers \(one per "
                 r"micro-batch of this step\)", id="too few"),
    pytest.param(largest, lambda r: {"nope": 1.0},
                 r"statistic 'bad' returned \{'nope': 1.0\}: .* a mapping from trained variable "
                 r"names", id="a stranger"),
])
def test_a_statistic_that_fails_fails_the_step_and_nothing_is_applied(backend, first, then,
                                                                        match):
    steps = []

    def bad(result):  # right on the first step (slots, step, moving statistics non-trivial)
        steps.append(result.step)
        return first(result) if len(steps) == 1 else then(result)

    face = backend.make("batchnorm", statistics={"bad": bad})
    data = batches(6, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    before = face.values()
    with pytest.raises(hostavg.HostavgError, match=match):
        face.step(face.cut(data[1], SIZES))
    same(face.values(), before)


def test_a_statistic_keeps_its_kind_and_its_names_are_checked(backend):
    calls = []

    def changing(result):
        calls.append(1)
        return 1.0 if len(calls) == 1 else tuple(m.loss for m in result.micro)

    face = backend.make(statistics={"changing": changing})
    data = batches(6, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    before = face.values()
    with pytest.raises(hostavg.HostavgError, match=r"statistic 'changing' returned a number per "
                                                   r"micro-batch .* after a number per step"):
        face.step(face.cut(data[1], SIZES))
    same(face.values(), before)
    for statistics, match in (({"a b": spread}, r"a name must be a Python identifier"),
                              ({"ok": 3}, r"statistics\['ok'\] must be a function"),
                              ({"loss": spread}, r"'loss' is the name of a built-in quantity"),
                              ([spread], r"statistics must be a mapping")):
        with pytest.raises(hostavg.HostavgError, match=match):
            backend.make(statistics=statistics)
