"""The host accumulator on tiny hand-computed cases. Pure NumPy: no TensorFlow here."""

import numpy as np
import pytest

from hostavg import Accumulator, Gradients, HostavgError, SparseGradient, VariableSpec

F32 = np.dtype("float32")
SPEC = {"w": VariableSpec((2,), F32, False),
        "emb": VariableSpec((5, 2), F32, True)}


def grads(w, rows, vals, loss=None, size=None):
    return Gradients({"w": np.array(w, np.float32),
                      "emb": SparseGradient(rows, np.array(vals, np.float32), (5, 2))},
                     loss=loss, size=size)


@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_equal_weights_average_1_2_3_4_to_2_5(accumulate):
    acc = Accumulator({"w": VariableSpec((), F32, False)}, accumulate=accumulate)
    for g in (1, 2, 3, 4):
        acc.add({"w": np.float32(g)}, weight=1)
    assert acc.mean()["w"] == 2.5


@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_sample_weighted_mean_dense_and_sparse(accumulate):
    acc = Accumulator(SPEC, accumulate=accumulate)
    acc.add(grads([1, 2], [0, 3, 0], [[1, 1], [2, 2], [3, 3]], loss=1.0, size=1))
    acc.add(grads([4, 8], [3], [[4, 0]], loss=2.0, size=3))
    mean = acc.mean()
    np.testing.assert_array_equal(mean["w"], [(1 + 12) / 4, (2 + 24) / 4])
    emb = mean["emb"]
    # Row 0: (1 + 3) * 1; row 3: 2 * 1 + 4 * 3 (first column) and 2 * 1 + 0 (second), / 4.
    np.testing.assert_array_equal(emb.indices, [0, 3])
    np.testing.assert_array_equal(emb.values, [[1, 1], [3.5, 0.5]])
    assert emb.dense_shape == (5, 2)
    assert mean.loss == (1.0 + 6.0) / 4 and mean.size == 4
    assert acc.count == 2 and acc.weights == [1.0, 3.0] and acc.total_weight == 4


def test_mean_is_a_copy_and_reset_reuses_the_buffers():
    acc = Accumulator(SPEC)
    acc.add(grads([1, 1], [1], [[1, 1]]), weight=1)
    first = acc.mean()
    acc.reset()
    acc.add(grads([3, 3], [2], [[2, 2]]), weight=2)
    np.testing.assert_array_equal(first["w"], [1, 1])
    np.testing.assert_array_equal(acc.mean()["w"], [3, 3])
    np.testing.assert_array_equal(acc.mean()["emb"].indices, [2])


def test_reset_forgets_an_add_that_failed_halfway():
    """An add cut off after its first variables (an interrupt, or add_checked given a wrong
    shape) has counted nothing yet: reset must still forget what it added, sums and rows."""
    spec = {"a": VariableSpec((2,), F32, False), "b": VariableSpec((3,), F32, False),
            "emb": VariableSpec((5, 2), F32, True)}
    acc = Accumulator(spec)
    with pytest.raises(ValueError):
        acc.add_checked({"emb": SparseGradient([1], np.ones((1, 2), np.float32), (5, 2)),
                         "a": np.full(2, 5, np.float32), "b": np.ones(4, np.float32)},
                        1.0, None, 0.0)
    acc.reset()
    for _ in range(2):
        acc.add({"a": np.ones(2, np.float32), "b": np.ones(3, np.float32),
                 "emb": SparseGradient([3], np.ones((1, 2), np.float32), (5, 2))}, weight=1.0)
    mean = acc.mean()
    np.testing.assert_array_equal(mean["a"], [1, 1])
    np.testing.assert_array_equal(mean["emb"].indices, [3])


@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_one_frozen_micro_batch_is_its_own_mean_and_anything_else_is_reduced_anew(accumulate):
    """A session's outputs come frozen: one micro-batch's are then the mean as they are (the
    step of one micro-batch pays no copy); the same values as the reduction gives otherwise."""
    from hostavg.core.accumulator import numpy_reduce
    from hostavg.core.gradients import freeze

    def frozen(rows, dtype=np.float32):
        return {"w": freeze(np.array([1, 2], dtype)),
                "emb": SparseGradient(freeze(np.array(rows)),
                                      freeze(np.arange(2 * len(rows), dtype=dtype).reshape(-1, 2)),
                                      (5, 2))}

    acc = Accumulator(SPEC, accumulate=accumulate)
    lone = frozen([1, 3])
    acc.add(Gradients(lone, loss=0.5), weight=3)
    mean = acc.mean()
    assert np.shares_memory(mean["w"], lone["w"])  # no copy
    assert np.shares_memory(mean["emb"].values, lone["emb"].values)
    assert mean.loss == 0.5 and mean.size == 3
    reduced = numpy_reduce(acc.reduction())  # what the reduction would have given
    np.testing.assert_array_equal(reduced["w"], mean["w"])
    np.testing.assert_array_equal(reduced["emb"][1], mean["emb"].values)
    with pytest.raises(ValueError, match="read-only"):
        mean["w"][0] = 9
    for case, given in [("rows unsorted", frozen([3, 1])), ("rows repeated", frozen([1, 1])),
                        ("not frozen", grads([1, 2], [1, 3], [[0, 1], [2, 3]])),
                        ("float64", frozen([1, 3], np.float64))]:
        acc.reset()
        acc.add(given, weight=3)
        mean = acc.mean()
        assert not np.shares_memory(mean["emb"].values, given["emb"].values), case
        assert mean["w"].dtype == F32 and list(mean["emb"].indices) == sorted(
            set(given["emb"].indices)), case
    acc.reset()
    acc.add(lone, weight=1)
    acc.add(frozen([1, 3]), weight=1)
    mean = acc.mean()  # two: their mean, new
    assert not np.shares_memory(mean["w"], lone["w"])
    np.testing.assert_array_equal(mean["emb"].values, lone["emb"].values)


def test_accum_dtype_float64_keeps_what_float32_loses():
    spec = {"w": VariableSpec((1,), F32, False)}
    tiny = {"w": np.array([1e-8], np.float32)}
    # The exact sum is 1 + 1000 * 1e-8; in float32 each tiny add rounds away (eps ~ 6e-8).
    for dtype, total in [(None, 1.0), ("float64", 1.0 + 1e-5)]:
        acc = Accumulator(spec, accum_dtype=dtype)
        acc.add({"w": np.array([1.0], np.float32)}, weight=1)
        for _ in range(1000):
            acc.add(tiny, weight=1)
        mean = acc.mean()["w"]
        assert mean.dtype == (dtype or F32)
        np.testing.assert_allclose(mean, [total / 1001], rtol=1e-7)


def test_dense_value_for_sparse_variable_and_sparse_for_dense():
    acc = Accumulator(SPEC)
    acc.add({"w": SparseGradient([1, 1], np.array([2.0, 3.0], np.float32), (2,)),
             "emb": np.ones((5, 2), np.float32)}, weight=1)
    mean = acc.mean()
    np.testing.assert_array_equal(mean["w"], [0, 5])
    np.testing.assert_array_equal(mean["emb"].indices, np.arange(5))


@pytest.mark.parametrize("weight", [0, -1, np.nan, np.inf, True, "2"])
def test_bad_weight_is_refused_and_nothing_added(weight):
    acc = Accumulator(SPEC)
    with pytest.raises(HostavgError, match=r"^micro-batch 0: weight must be a finite number > 0, got "):
        acc.add(grads([1, 1], [0], [[1, 1]]), weight=weight)
    assert acc.count == 0


def test_errors_name_the_micro_batch_and_variable_and_add_nothing():
    acc = Accumulator(SPEC)
    acc.add(grads([1, 1], [0], [[1, 1]]), weight=1)
    cases = [
        (grads([1, 1], [0], [[1, 1]]), "micro-batch 1: no weight given"),
        (grads([1, 1], [0], [[1, 1]], loss=float("nan"), size=1),
         "^micro-batch 1: finite gradients but the loss is nan. Nothing was applied"),
        (Gradients({"w": np.ones(2)}, size=1), r"missing \['emb'\], unexpected \[\]"),
        (grads([1, 1], [7], [[1, 1]], size=1), r"'emb' has row indices outside \[0, 5\): min 7, max 7"),
        (grads([1, 1], [0, 1], [[1, 1]], size=1), r"'emb' has values of shape \(1, 2\), expected \(2, 2\)"),
        (grads([1, np.nan], [0], [[1, 1]], size=1),
         r"^micro-batch 1: non-finite gradients in 'w' \(1 of 2 entries: 1 NaN, 0 Inf\)\. Nothing"),
        (grads([np.inf, np.nan], [0], [[np.inf, 1]], loss=0.5, size=1),
         r"non-finite gradients in 'w' \(2 of 2 entries: 1 NaN, 1 Inf\), 'emb' \(1 of 2 entries: "
         r"0 NaN, 1 Inf\); the loss was finite \(0\.5\)\. .*hooks=\[hostavg\.hooks\.SkipNonFinite\(\)\]"),
    ]
    for g, match in cases:
        with pytest.raises(HostavgError, match=match):
            acc.add(g)
    assert acc.count == 1
    np.testing.assert_array_equal(acc.mean()["w"], [1, 1])


def test_constructor_and_empty_mean_errors():
    with pytest.raises(HostavgError, match="accumulate must be one of .* got 'avg'"):
        Accumulator(SPEC, accumulate="avg")
    with pytest.raises(HostavgError, match="accum_dtype must be a floating-point dtype .* got 'int8'"):
        Accumulator(SPEC, accum_dtype="int8")
    with pytest.raises(HostavgError, match="spec is empty"):
        Accumulator({})
    with pytest.raises(HostavgError, match="the accumulator is empty"):
        Accumulator(SPEC).mean()


def test_sum_and_stack_give_bit_identical_means():
    rng = np.random.default_rng(0)
    spec = {"a": VariableSpec((64, 32), F32, False), "b": VariableSpec((7,), F32, False)}
    sums, stacks = Accumulator(spec), Accumulator(spec, accumulate="stack")
    for _ in range(9):
        g = {name: rng.normal(size=s.shape).astype(np.float32) for name, s in spec.items()}
        w = float(rng.integers(1, 50))
        sums.add(g, weight=w)
        stacks.add(g, weight=w)
    for name in spec:
        np.testing.assert_array_equal(sums.mean()[name], stacks.mean()[name])
