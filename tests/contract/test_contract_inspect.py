"""What a trainer tells about itself: check's verdict, per-sample gradients, update ratios and
the learning rate, and what the built-in hooks keep."""

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import CLASSES, FEATURES, LEARNING_RATES, batches

import hostavg
from hostavg.hooks import (ClipGlobalNorm, ClipMicroBatchNorm, LivePlot, Record, SkipNonFinite,
                           TensorBoard)


@pytest.mark.parametrize("model,ok,verdict", [
    pytest.param("mlp", True, "self-check passed", id="mean"),
    pytest.param("sum", False, "a sum over samples", id="sum"),
    pytest.param("dropout", False, "random ops in training mode", id="dropout"),  # each names them
])
def test_check_passes_a_mean_loss_and_names_a_sum_or_dropout(backend, model, ok, verdict):
    face = backend.make(model)
    report = face.check(batches(8, 1, 40)[0], 10)
    assert report.ok is ok, str(report)
    assert report.micro_batches == 4
    assert verdict in str(report), str(report)
    if model == "sum":
        assert report.scale == pytest.approx(4, rel=1e-4)  # 4 equal micro-batches


def test_evaluate_is_the_frameworks_loss_over_all_the_data_and_changes_nothing(backend):
    face = backend.make("batchnorm")
    data = batches(15, 2, BATCH)
    face.step(face.cut(data[0], SIZES))  # moving statistics away from their start
    before = face.values()
    got = face.evaluate(data[1], batch_size=7)  # chunks of 7, 7, 7, 7 and 4
    same(face.values(), before)  # the counter too
    assert got["loss"] == pytest.approx(face.loss(data[1]), rel=1e-6)


def test_per_sample_is_each_sample_computed_alone_and_changes_nothing(backend):
    face = backend.make("batchnorm")
    data = batches(9, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    sample = {k: v[:6] for k, v in data[1].items()}
    before = face.values()
    table = face.per_sample(sample)
    same(face.values(), before)  # moving statistics and the counter too
    assert list(table.columns) == ["loss", "norm", "cosine", "cosine_to_rest", "error"]
    assert table.index.name == "sample" and list(table.index) == list(range(6))
    rows = [40, 3, 17, 99, 5, 12]  # the data rows, in a shuffled batch's order
    by_row = face.per_sample(sample, rows=np.array(rows))
    assert by_row.index.name == "row" and list(by_row.index) == rows
    np.testing.assert_array_equal(by_row.drop(columns="error").to_numpy(float),
                                  table.drop(columns="error").to_numpy(float))
    assert by_row["error"].isna().all()

    # Brute force from each sample computed alone: the mean of all, and of the others.
    alone = [face.compute(m) for m in face.cut(sample, 1)]
    flat = np.array([np.concatenate([np.ravel(g[name]) for name in face.trainer.spec])
                     for g in alone], np.float64)
    mean = flat.mean(axis=0)
    for i, (row, g, f) in enumerate(zip(rows, alone, flat)):
        rest = np.delete(flat, i, axis=0).mean(axis=0)
        assert by_row.loc[row, "loss"] == pytest.approx(g.loss, rel=1e-6)
        assert by_row.loc[row, "norm"] == pytest.approx(np.linalg.norm(f), rel=1e-5)
        for column, other in (("cosine", mean), ("cosine_to_rest", rest)):
            cosine = f @ other / (np.linalg.norm(f) * np.linalg.norm(other))
            assert by_row.loc[row, column] == pytest.approx(cosine, rel=1e-4, abs=1e-6), column


def test_per_sample_refuses_rows_that_repeat(backend):
    """The table is indexed by row: a row given twice would make table.loc[row] two rows."""
    face = backend.make()
    sample = {k: v[:4] for k, v in batches(9, 1, BATCH)[0].items()}
    with pytest.raises(hostavg.ArgumentError) as raised:
        face.per_sample(sample, rows=np.array([7, 3, 7, 9]))
    assert str(raised.value) == (
        "per_sample: rows must be distinct, since they index the table (table.loc[row]): row 7 "
        "is given for samples 0 and 2; give each sample its own data row, or rows=None to index "
        "the table by sample")


def test_per_sample_keeps_the_row_of_a_sample_whose_compute_fails(backend):
    """A target out of range: the framework's error on TF1, hostavg's own check on Keras (which
    JAX would train on silently); the others are as without it, and nothing changes."""
    face = backend.make()
    data = batches(9, 1, 6)[0]
    want = face.per_sample(data, rows=np.arange(10, 16))
    data["y"][2] = 7  # of 3 classes
    before = face.values()
    table = face.per_sample(data, rows=np.arange(10, 16))
    same(face.values(), before)
    error = table.loc[12, "error"]
    assert isinstance(error, str) and "7" in error, error
    assert table.loc[12, ["loss", "norm", "cosine", "cosine_to_rest"]].isna().all()
    assert table["error"].drop(index=12).isna().all()
    kept = [10, 11, 13, 14, 15]
    np.testing.assert_allclose(table.loc[kept, ["loss", "norm"]], want.loc[kept, ["loss", "norm"]],
                               rtol=1e-6)


def learnable(n: int = 64, seed: int = 5) -> dict:
    """``n`` samples whose class is the argmax of a fixed linear map of their features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return {"x": x, "y": np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), 1).astype(np.int32)}


def test_a_planted_mislabel_has_the_largest_loss_and_norm_though_its_cosine_is_positive(backend):
    """A well-fit model: the mislabel's gradient dwarfs the others', so the mean it is compared
    with is mostly its own (the guide says so): loss and norm find it, ``cosine`` does not."""
    face = backend.make()
    data = learnable()
    face.fit(data, epochs=150, batch_size=64, micro_batch_size=64, progress=False, shuffle=False)
    planted = face.per_sample(data)["loss"].idxmin()  # the sample it is surest of
    data["y"][planted] = (data["y"][planted] + 1) % CLASSES
    table = face.per_sample(data, rows=np.arange(64))
    assert table["loss"].idxmax() == planted and table["norm"].idxmax() == planted
    assert table["cosine"][planted] > 0.5 and table["cosine"].idxmin() != planted
    assert table["cosine_to_rest"][planted] < 0  # against the others, once they are apart
    assert (table["cosine"] >= table["cosine_to_rest"] - 1e-6).all()  # a mean leans to each


def test_a_minority_that_pulls_against_the_rest_has_negative_cosines_to_the_rest(backend):
    """Alike inputs, 56 of class 0 and 8 of class 1: at the start weights the 8 pull against
    the others (their mean mostly the 56), the 56 with them."""
    face = backend.make()
    rng = np.random.default_rng(6)
    x = (rng.normal(0, 0.1, (64, FEATURES)) + 1).astype(np.float32)
    y = np.zeros(64, np.int32)
    minority = rng.choice(64, 8, replace=False)
    y[minority] = 1
    table = face.per_sample({"x": x, "y": y})
    against = table.index[table["cosine_to_rest"] < 0]
    assert sorted(against) == sorted(minority), table


#: Optimizers that keep their learning rate in different attributes (TF1: Adam its own), and
#: a sparse table.
RATIOS = [("mlp", "sgd"), ("mlp", "adam"), ("embedding", "adagrad")]


@pytest.mark.parametrize("model,optimizer", RATIOS, ids=["-".join(r) for r in RATIOS])
def test_update_ratios_and_learning_rate_are_those_of_the_apply(backend, model, optimizer):
    face = backend.make(model, optimizer, update_ratios_every=1)
    for d in batches(10, 2, BATCH, sparse=model == "embedding"):
        before = face.values()
        res = face.step(face.cut(d, SIZES))
        after = face.values()
        assert res.update_ratios.keys() == face.trainer.spec.keys()
        for name in face.trainer.spec:
            moved, norm = np.linalg.norm(after[name] - before[name]), np.linalg.norm(before[name])
            want = 0.0 if not moved else moved / norm if norm else np.inf  # out/bias starts at 0
            assert res.update_ratios[name] == pytest.approx(want, rel=1e-4), name
        assert res.learning_rate == pytest.approx(LEARNING_RATES[optimizer], rel=1e-6)


def test_skip_non_finite_drops_the_micro_batch_and_record_and_tensorboard_keep_the_step(
        backend, tmp_path):
    board = TensorBoard(tmp_path / "tb", histograms_every=1)
    face = backend.make(hooks=[SkipNonFinite(), Record(tmp_path / "rec"), board])
    data = batches(11, 1, BATCH)[0]
    data["x"][SIZES[0] + 2, 0] = np.nan  # in micro-batch 1
    res = face.step(face.cut(data, SIZES))
    assert res.dropped == (1,) and res.size == BATCH - SIZES[1]
    assert res.micro[1].dropped.startswith("non-finite")

    others = backend.make()  # the step over micro-batches 0 and 2 alone
    micro = others.cut(data, SIZES)
    want = others.step([micro[0], micro[2]])
    same(face.values(), others.values(), skip=face.assigned())
    for name in want.grads:
        np.testing.assert_array_equal(res.grads[name], want.grads[name])

    step = hostavg.load_record(tmp_path / "rec")[1]
    for name, value in res.grads.items():
        np.testing.assert_array_equal(step.mean[name], value)
    board.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def scaled(grads, max_norm: float) -> dict:
    """``grads`` scaled down to global norm ``max_norm`` (dense gradients)."""
    factor = min(1.0, max_norm / grads.global_norm())
    return {name: np.asarray(value) * factor for name, value in grads.items()}


def test_clipping_hooks_apply_the_clipped_mean(backend):
    data = batches(14, 1, BATCH)[0]
    whole, each = backend.make(hooks=[ClipGlobalNorm(0.05)]), backend.make(
        hooks=[ClipMicroBatchNorm(0.05)])
    clipped = {face: face.step(face.cut(data, SIZES)).grads for face in (whole, each)}
    twin = backend.make()
    grads = [twin.compute(m) for m in twin.cut(data, SIZES)]
    acc = twin.accumulator()
    for g in grads:  # each micro-batch clipped, then the sample-weighted mean
        acc.add(scaled(g, 0.05), weight=g.size)
    for face, want in ((whole, scaled(twin.mean(twin.cut(data, SIZES)), 0.05)),
                       (each, acc.mean())):
        for name in want:
            np.testing.assert_allclose(clipped[face][name], want[name], rtol=1e-6, atol=1e-9)
    assert clipped[whole].global_norm() == pytest.approx(0.05, rel=1e-5)


class Reads:
    """A hook that reads, through the public API, what a step's distributions are of: the
    weights before (``on_step``, with the mean it is given) and after (``on_applied``)."""

    def __init__(self):
        self.face, self.seen = None, {}

    def on_step(self, mean, result):
        values = self.face.values()
        self.seen[result.step] = {"gradient": {n: dense(g) for n, g in mean.items()},
                                  "before": {n: values[n] for n in mean}}

    def on_applied(self, result):
        values, seen = self.face.values(), self.seen[result.step]
        seen["weight"] = {n: values[n] for n in seen["gradient"]}
        seen["update"] = {n: values[n] - seen["before"][n] for n in seen["gradient"]}


def dense(g) -> np.ndarray:
    return g.to_dense() if isinstance(g, hostavg.SparseGradient) else np.asarray(g)


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_distributions_are_the_percentiles_of_what_a_hook_reads(backend, model, tmp_path):
    reads = Reads()
    face = backend.make(model, distributions_every=2,
                        hooks=[reads, Record(tmp_path / "rec", micro=False)])
    reads.face = face
    data = batches(12, 1, 3 * BATCH, sparse=model == "embedding")[0]
    history = face.fit(data, batch_size=BATCH, micro_batch_size=8, progress=False)
    steps = [s.step for s in history.steps]
    assert steps == [1, 2, 3]
    assert [s.distributions is not None for s in history.steps] == [False, True, False]
    record = hostavg.load_record(tmp_path / "rec")
    for name in face.trainer.spec:
        for quantity in ("gradient", "weight", "update"):
            want = np.percentile(np.asarray(reads.seen[2][quantity][name], np.float64),
                                 [0, 6.68, 15.87, 30.85, 50, 69.15, 84.13, 93.32, 100])
            for table in (history.distributions(name, quantity),
                          record.distributions(name, quantity)):
                assert list(table.index) == [2]
                np.testing.assert_array_equal(table.loc[2].to_numpy(), want, err_msg=name)


def test_tensorboard_holds_weight_and_update_histograms_of_the_steps_that_kept_them(
        backend, tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea
    reads = Reads()
    face = backend.make("embedding", distributions_every=2,
                        hooks=[reads, TensorBoard(tmp_path / "tb", histograms_every=100)])
    reads.face = face
    results = [face.step(face.cut(d, SIZES)) for d in batches(13, 3, BATCH, sparse=True)]
    assert [r.weights is not None for r in results] == [False, True, False]
    kept = results[1]
    for name, value in kept.weights.items():  # what the apply read back, as a hook reads it
        np.testing.assert_array_equal(value, reads.seen[2]["weight"][name])
        np.testing.assert_allclose(kept.updates[name], reads.seen[2]["update"][name], atol=1e-7)
        with pytest.raises(ValueError, match="read-only"):
            value[...] = 0
    face.trainer.hooks[1].close()
    reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.HISTOGRAMS: 0}).Reload()
    names = list(face.trainer.spec)
    assert {t for t in reader.Tags()["histograms"] if "/" in t and not t.startswith("hostavg/")} \
        == {f"{kind}/{n}" for kind in ("gradients", "weights", "updates") for n in names}
    for kind, quantity in (("weights", "weight"), ("updates", "update"), ("gradients", "gradient")):
        for name in names:
            (h,) = reader.Histograms(f"{kind}/{name}")  # step 2 alone: histograms_every is 100
            want = np.asarray(reads.seen[2][quantity][name], np.float64)
            if kind == "gradients" and isinstance(kept.grads[name], hostavg.SparseGradient):
                want = np.asarray(kept.grads[name].values, np.float64)  # the touched rows
            value = h.histogram_value
            assert (h.step, value.num) == (2, want.size), (kind, name)
            assert (value.min, value.max) == pytest.approx((want.min(), want.max()), abs=1e-7)
            assert value.sum == pytest.approx(want.sum(), rel=1e-5, abs=1e-6)


def test_liveplot_draws_the_steps_fit_applied_every_n_and_at_the_end(backend, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image
    live = LivePlot(every=2, panels=("loss", "micro_norms"), path=tmp_path / "live.png")
    face = backend.make("mlp", hooks=[live])
    history = face.fit(batches(12, 1, 3 * BATCH)[0], batch_size=BATCH, micro_batch_size=8,
                       progress=False)
    assert live.redraws == 2  # step 2, and fit's end (step 3)
    assert [s.loss for s in live.history.steps] == [s.loss for s in history.steps]
    assert matplotlib.image.imread(tmp_path / "live.png").std() > 0
    loss, norms = live.figure().axes[:2]
    np.testing.assert_array_equal(norms.lines[0].get_ydata(), [s.grad_norm for s in history.steps])
