"""Numerics at the edges (hostavg.core: dtypes, the accumulator, norms): bfloat16 and float8
values, huge finite gradients and accumulator weights, and an overflowing sum named as one wherever
a hook stands."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from models import batches, build, cuts, full_batch, linear, rows, v1
from test_trainer import assert_same_weights

import hostavg
from hostavg.hooks import ClipGlobalNorm, ClipMicroBatchNorm, Record
from hostavg.train import checkpoint


BF16 = np.dtype(ml_dtypes.bfloat16)


#: The float8 types TensorFlow has, as NumPy sees them through ml_dtypes.
FLOAT8 = [np.dtype(getattr(ml_dtypes, n)) for n in dir(tf.dtypes.experimental)
          if n.startswith("float8") and hasattr(ml_dtypes, n)]


STEPS, BATCH, SIZES = 4, 40, (5, 12, 3, 20)


def spec(dtype, shape=(2, 3), sparse=False):
    return {"w": hostavg.VariableSpec(shape, np.dtype(dtype), sparse)}


# --- bfloat16 and float8: accumulated in float32, saved and restored bit for bit ----------------


def test_float8_types_are_known():
    from hostavg.core.dtypes import EXTENDED
    assert FLOAT8 and all(d.name in EXTENDED for d in FLOAT8 + [BF16])


@pytest.mark.parametrize("dtype", [BF16] + FLOAT8, ids=lambda d: d.name)
@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_narrow_float_gradients_accumulate_in_float32_exactly(dtype, accumulate):
    # k > 1 raised NumPy's "found a user loop for ufunc 'multiply'" TypeError.
    rng = np.random.default_rng(0)
    grads = [rng.normal(0, 1, (2, 3)).astype(dtype) for _ in range(4)]
    weights = [5, 12, 3, 20]
    acc = hostavg.Accumulator(spec(dtype), accumulate=accumulate)
    for g, w in zip(grads, weights):
        acc.add({"w": g}, weight=w)
    mean = acc.mean()["w"]
    assert mean.dtype == np.float32
    # The oracle: the same values in float32, the same arithmetic.
    want = hostavg.Accumulator(spec(np.float32), accumulate=accumulate)
    for g, w in zip(grads, weights):
        want.add({"w": g.astype(np.float32)}, weight=w)
    np.testing.assert_array_equal(mean, want.mean()["w"])
    exact = sum(w * g.astype(np.float64) for g, w in zip(grads, weights)) / sum(weights)
    np.testing.assert_allclose(mean, exact, rtol=1e-6)


def test_narrow_float_sparse_rows_accumulate_in_float32():
    acc = hostavg.Accumulator(spec(BF16, (5, 2), sparse=True))
    acc.add({"w": hostavg.SparseGradient([1, 3], np.ones((2, 2), BF16), (5, 2))}, weight=1)
    acc.add({"w": hostavg.SparseGradient([3], np.full((1, 2), 4, BF16), (5, 2))}, weight=3)
    mean = acc.mean()["w"]
    assert mean.indices.tolist() == [1, 3] and mean.values.dtype == np.float32
    np.testing.assert_array_equal(mean.values, [[0.25, 0.25], [3.25, 3.25]])


@pytest.mark.parametrize("dtype", [BF16] + FLOAT8, ids=lambda d: d.name)
def test_narrow_floats_round_trip_through_a_checkpoint_bit_for_bit(tmp_path, dtype):
    # save wrote bfloat16 as |V2 bytes that restore then called damaged.
    bits = np.arange(256, dtype=np.uint8).repeat(dtype.itemsize).view(dtype)  # NaNs too
    values = {"w": bits.reshape(-1, 2), "step": np.int64(3), "v": np.ones(3, np.float32)}
    path = checkpoint.write(tmp_path / "c.npz", values)
    stored, _ = checkpoint.read(path, {n: (np.shape(v), np.asarray(v).dtype)
                                       for n, v in values.items()})
    assert stored["w"].dtype == dtype
    np.testing.assert_array_equal(stored["w"].view(np.uint8), values["w"].view(np.uint8))
    from hostavg.core.dtypes import decode, encode
    assert encode(values["w"])[1] == dtype.name
    np.testing.assert_array_equal(decode(*encode(values["w"])).view(np.uint8),
                                  values["w"].view(np.uint8))


def test_a_checkpoint_whose_bfloat16_bits_are_of_the_wrong_width_is_damaged(tmp_path):
    path = checkpoint.write(tmp_path / "c.npz", {"w": np.ones(2, BF16)})
    arrays = dict(np.load(path))
    arrays["var/w"] = np.ones(2, np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(hostavg.HostavgError, match=r"c.npz is damaged: \['w': uint8 values do not "
                                                   r"hold the bits of a 'bfloat16' array\]"):
        checkpoint.read(path, {"w": ((2,), BF16)})


def bf16_trainer(optimizer, **kw):
    model = build(dtype=BF16)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, optimizer(), **kw)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess


@pytest.mark.parametrize("accumulate,average", [("sum", "host"), ("stack", "host"),
                                                ("sum", "graph"), ("stack", "graph")])
def test_a_bfloat16_model_steps_like_its_full_batch_step(accumulate, average):
    optimizer = lambda: v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    data = batches(0, STEPS, BATCH, dtype=BF16)
    want = full_batch(optimizer, data, dtype=BF16)
    model, trainer, sess = bf16_trainer(optimizer, accumulate=accumulate, average=average)
    for d in data:
        feeds = [model.feed({k: v[s] for k, v in d.items()}) for s in cuts(BATCH, SIZES)]
        alone = [trainer.compute(sess, f) for f in feeds]
        res = trainer.step(sess, feeds)
        # What was applied is the float32 weighted mean of the bfloat16 micro-batch gradients.
        for name in res.grads:
            assert res.grads[name].dtype == np.float32
            exact = sum(g.size * g[name].astype(np.float64) for g in alone) / BATCH
            np.testing.assert_allclose(res.grads[name], exact, rtol=2e-6, atol=1e-7)
    # The full batch computes its gradient in bfloat16 (8 bits of mantissa): as close as that.
    assert_same_weights(model.values(sess), want, atol=2e-2)


def test_a_bfloat16_model_saves_restores_and_records_bit_for_bit(tmp_path):
    optimizer = lambda: v1.train.AdamOptimizer(0.01)  # noqa: E731
    model, trainer, sess = bf16_trainer(optimizer, accumulate="stack",
                                        hooks=[Record(tmp_path / "rec")])
    d = batches(1, 1, BATCH, dtype=BF16)[0]
    res = trainer.step(sess, [model.feed({k: v[s] for k, v in d.items()})
                              for s in cuts(BATCH, SIZES)])
    trainer.save(sess, tmp_path / "c.npz")
    saved = model.values(sess)
    with model.graph.as_default():
        sess.run(v1.global_variables_initializer())
    trainer.restore(sess, tmp_path / "c.npz")
    for name, value in model.values(sess).items():
        assert value.dtype == saved[name].dtype
        assert np.asarray(value).tobytes() == np.asarray(saved[name]).tobytes(), name
    step = hostavg.load_record(tmp_path / "rec")[1]
    for m in res.micro:
        for name, value in step.micro_grads(m.index).items():
            assert value.dtype == BF16
            np.testing.assert_array_equal(value.view(np.uint16), m.grads[name].view(np.uint16))
    for name, value in step.mean.items():
        np.testing.assert_array_equal(value, res.grads[name])


# --- Accumulator weights at the extremes ---------------------------------------------------------


@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_weights_far_apart_give_a_finite_mean(accumulate):
    # The second gradient was scaled by 1e40 in float32: Inf, then NaN.
    g1, g2 = np.array([3.0, -1.0], np.float32), np.array([1.0, 2.0], np.float32)
    acc = hostavg.Accumulator(spec(np.float32, (2,)), accumulate=accumulate)
    acc.add({"w": g1}, weight=1e-40)
    acc.add({"w": g2}, weight=1.0)
    np.testing.assert_array_equal(acc.mean()["w"], g2)
    # Either order, and with the heavier one in the middle.
    acc = hostavg.Accumulator(spec(np.float32, (2,)), accumulate=accumulate)
    for g, w in ((g2, 1e-30), (g1, 1e30), (g2, 1.0)):
        acc.add({"w": g}, weight=w)
    np.testing.assert_array_equal(acc.mean()["w"], g1)


def test_weights_far_apart_give_a_finite_sparse_mean():
    acc = hostavg.Accumulator(spec(np.float32, (4, 2), sparse=True))
    acc.add({"w": hostavg.SparseGradient([0], np.full((1, 2), 5, np.float32), (4, 2))}, weight=1e300)
    acc.add({"w": hostavg.SparseGradient([1], np.full((1, 2), 7, np.float32), (4, 2))}, weight=1e-300)
    mean = acc.mean()["w"]
    np.testing.assert_array_equal(mean.values, [[5, 5], [0, 0]])


@pytest.mark.parametrize("average", ["host", "graph"])
@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_a_trainer_accumulator_with_huge_weights_stays_finite(accumulate, average):
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.GradientDescentOptimizer(0.1),
                                  accumulate=accumulate, average=average)
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        d = batches(0, 1, 20, sparse=True)[0]
        grads = [trainer.compute(sess, model.feed({k: v[s] for k, v in d.items()}))
                 for s in cuts(20, (10, 10))]
        acc = trainer.accumulator(sess)
        for g in grads:
            acc.add(g, weight=1e300)
        mean = acc.mean()
        for name, value in mean.items():
            values = value.values if isinstance(value, hostavg.SparseGradient) else value
            assert np.all(np.isfinite(values)), name
        plain = trainer.accumulator(sess)
        for g in grads:
            plain.add(g, weight=1.0)
        for name, value in plain.mean().items():
            got = mean[name]
            if isinstance(value, hostavg.SparseGradient):
                value, got = value.to_dense(), got.to_dense()
            np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_weights_whose_total_overflows_are_refused_and_nothing_added():
    # Two weights of 1e308 gave size inf and a mean of 0.
    acc = hostavg.Accumulator(spec(np.float64, (2,)))
    acc.add({"w": np.ones(2)}, weight=1e308)
    with pytest.raises(hostavg.HostavgError, match=r"^micro-batch 1: weight 1e\+308 takes the total "
                       r"weight past float64's range \(1e\+308 so far\); only the weights' ratios "
                       r"matter: scale them down$"):
        acc.add({"w": np.ones(2)}, weight=1e308)
    assert acc.count == 1 and acc.total_weight == 1e308
    np.testing.assert_array_equal(acc.mean()["w"], [1, 1])


@pytest.mark.parametrize("weight", [1 + 0j, np.complex128(2), 10 ** 400, "1", np.float64("nan"),
                                    -np.inf, 0.0, 1e-400, True],
                         ids=["complex", "np-complex", "huge-int", "text", "nan", "-inf", "zero",
                              "underflow", "bool"])
def test_weights_that_are_not_finite_positive_reals_are_refused(weight):
    # A complex weight was accepted with only NumPy's ComplexWarning; 10**400 raised OverflowError.
    acc = hostavg.Accumulator(spec(np.float32, (2,)))
    with pytest.raises(hostavg.HostavgError,
                       match=r"^micro-batch 0: weight must be a finite number > 0, got "):
        acc.add({"w": np.ones(2)}, weight=weight)
    assert acc.count == 0


def test_numpy_weights_and_tiny_ones_are_accepted():
    acc = hostavg.Accumulator(spec(np.float32, (2,)))
    for w in (np.float16(2), np.int8(3), np.float32(1e-40), 5e-324):
        acc.add({"w": np.ones(2, np.float32)}, weight=w)
    assert acc.total_weight == pytest.approx(5.0)
    np.testing.assert_allclose(acc.mean()["w"], [1, 1], rtol=2e-7)  # 2/3 rounds once


# --- An overflowing float32 sum is named as one, whatever hook runs after it -------------------


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the case itself
def test_an_overflowing_sum_is_named_before_a_clip_hook_sees_it():
    # ClipGlobalNorm turned the Inf mean into NaN, and the error blamed the hook.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.Variable(np.zeros(4, np.float32), name="w")
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(1e-37),
                                  hooks=[ClipGlobalNorm(1.0)])
        init = v1.global_variables_initializer()
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        feeds = [{x: np.full((2, 4), 2e38, np.float32)}] * 2  # each finite; their sum is not
        with pytest.raises(hostavg.HostavgError, match=r"^step, the mean: non-finite gradients in "
                           r"'w' .*Every micro-batch's gradients were finite, so their weighted "
                           r"sum overflowed the accumulation dtype: accumulate in float64 with "
                           r"accum_dtype='float64'"):
            trainer.step(sess, feeds)
        assert sess.run(trainer.global_step) == 0


# --- Norms and statistics do not overflow; an overflowing sum is named as one ------------------


def test_norms_of_huge_finite_gradients_are_finite_in_every_dtype():
    for value, dtype, want in ((1e20, np.float32, 2e20), (100.0, np.float16, 200.0),
                               (1e160, np.float64, 2e160)):
        g = hostavg.Gradients({"w": np.full(4, value, dtype)})
        assert g.global_norm() == pytest.approx(want, rel=1e-3), dtype
    inf = hostavg.Gradients({"w": np.array([1e160, np.inf])})
    assert inf.global_norm() == np.inf
    assert np.isnan(hostavg.Gradients({"w": np.array([1e160, np.inf, np.nan])}).global_norm())


@pytest.mark.parametrize("hook", [ClipGlobalNorm(1.0), ClipMicroBatchNorm(1.0)],
                         ids=["global", "micro"])
def test_clipping_a_huge_finite_gradient_applies_a_unit_step_not_zero(hook):
    trainer, sess, x, w, _ = linear(hooks=[hook])
    g = trainer.compute(sess, rows(x, 1e20))
    assert g.sq_norms["w"] == pytest.approx(4e40, rel=1e-6)  # the session's float32 sum was inf
    res = trainer.step(sess, [rows(x, 1e20), rows(x, 1e20)])
    np.testing.assert_allclose(sess.run(w), np.full(4, -0.5), rtol=1e-6)
    assert res.stats.grad_norm == pytest.approx(1.0, rel=1e-6)
    assert res.stats.micro_norms == pytest.approx((2e20, 2e20) if isinstance(hook, ClipGlobalNorm)
                                                  else (1.0, 1.0), rel=1e-6)
    before = res.info.get("grad_norm_before_clip") or res.info["micro_norms_before_clip"][0]
    assert before == pytest.approx(2e20, rel=1e-6)


def test_half_precision_norms_are_summed_in_float32_in_the_graph():
    trainer, sess, x, w, _ = linear(dtype=np.float16, lr=1e-3, hooks=[ClipGlobalNorm(1.0)])
    g = trainer.compute(sess, rows(x, 158.0, dtype=np.float16))  # norm 316: its square passes 65504
    assert g.sq_norms["w"] == pytest.approx(4 * 158.0 ** 2)
    res = trainer.step(sess, [rows(x, 158.0, dtype=np.float16)])
    assert res.info["grad_norm_before_clip"] == pytest.approx(316.0)
    np.testing.assert_allclose(sess.run(w), np.full(4, -0.5e-3), rtol=1e-2)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the case itself
def test_an_overflowing_running_sum_is_named_and_float64_accumulation_fixes_it():
    trainer, sess, x, w, _ = linear(lr=1e-37)
    feeds = [rows(x, 2e38), rows(x, 2e38)]  # each finite; their float32 sum is not
    with pytest.raises(hostavg.HostavgError, match=r"^step, the mean: non-finite gradients in 'w' "
                       r".*Every micro-batch's gradients were finite, so their weighted sum "
                       r"overflowed the accumulation dtype: accumulate in float64 with "
                       r"accum_dtype='float64'"):
        trainer.step(sess, feeds)
    trainer, sess, x, w, _ = linear(lr=1e-37, accum_dtype="float64")
    res = trainer.step(sess, [rows(x, 2e38), rows(x, 2e38)])
    np.testing.assert_allclose(sess.run(w), np.full(4, -20.0), rtol=1e-6)
    assert res.stats.grad_norm == pytest.approx(4e38, rel=1e-6)
    assert np.isfinite(res.stats.trace_sigma)  # no Inf - Inf


def test_stack_statistics_of_huge_gradients_are_finite():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4])
        w = tf.Variable(np.zeros(4, np.float32))
        trainer = hostavg.Trainer(tf.reduce_mean(tf.reduce_sum(x * w, 1)),
                                  v1.train.GradientDescentOptimizer(1e-30), accumulate="stack")
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    res = trainer.step(sess, [{x: np.full((1, 4), v, np.float32)} for v in (1e20, 3e20)])
    assert res.stats.cosines == pytest.approx((1.0, 1.0))
    assert np.isfinite(res.stats.inner_product_test) and np.isfinite(res.stats.gsnr)
