"""What a trainer tells about itself: check's verdict, per-sample gradients, update ratios and
the learning rate, and what the built-in hooks keep."""

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import LEARNING_RATES, batches

import hostavg
from hostavg.hooks import ClipGlobalNorm, ClipMicroBatchNorm, Record, SkipNonFinite, TensorBoard


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

    alone = [face.compute(m) for m in face.cut(sample, 1)]
    flat = [np.concatenate([np.ravel(g[name]) for name in face.trainer.spec]) for g in alone]
    mean = np.mean(flat, axis=0)
    for i, (g, f) in enumerate(zip(alone, flat)):
        assert table["loss"][i] == pytest.approx(g.loss, rel=1e-6)
        assert table["norm"][i] == pytest.approx(np.linalg.norm(f), rel=1e-5)
        cosine = f @ mean / (np.linalg.norm(f) * np.linalg.norm(mean))
        assert table["cosine"][i] == pytest.approx(cosine, rel=1e-4, abs=1e-6)


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
