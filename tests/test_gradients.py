"""Gradients and SparseGradient: values, norms, densification, coalesce_rows against brute force,
and a sparse value for a dense variable checked before it is densified."""

import numpy as np
import pytest
from test_trainer import Case, unchanged

import hostavg
from hostavg import Gradients, SparseGradient
from hostavg.core.gradients import _stable_order, coalesce_rows


def test_sparse_gradient_coalesce_and_to_dense_sum_duplicates():
    g = SparseGradient([3, 1, 3], [[1.0, 2.0], [5.0, 5.0], [10.0, 20.0]], (4, 2))
    np.testing.assert_array_equal(g.to_dense(), [[0, 0], [5, 5], [0, 0], [11, 22]])
    c = g.coalesce()
    np.testing.assert_array_equal(c.indices, [1, 3])
    np.testing.assert_array_equal(c.values, [[5, 5], [11, 22]])
    assert g.shape == (4, 2) and g.dtype == np.float64


def test_gradients_is_a_read_only_mapping_with_a_global_norm():
    g = Gradients({"a": np.array([3.0]), "e": SparseGradient([0, 0], [[2.0], [2.0]], (3, 1))},
                  loss=0.25, size=8)
    assert list(g) == ["a", "e"] and len(g) == 2 and g.loss == 0.25 and g.size == 8
    assert g.global_norm() == 5.0  # sqrt(3^2 + (2 + 2)^2): duplicate rows are summed first
    with pytest.raises(TypeError):
        g["a"] = np.zeros(1)
    assert "sparse 2 rows of (3, 1)" in repr(g)


def test_an_empty_sparse_gradient_coalesces_to_itself():
    g = SparseGradient(np.zeros(0, np.int64), np.zeros((0, 3), np.float32), (5, 3)).coalesce()
    assert g.indices.shape == (0,) and g.values.shape == (0, 3)
    assert g.to_dense().sum() == 0


# --- A sparse value for a dense variable is checked before it is densified ----------------------


@pytest.mark.parametrize("indices,values,shape,match", [
    ([-1], np.ones((1, 8)), (6, 8), r"row indices outside \[0, 6\): min -1"),  # updated the last row
    ([6], np.ones((1, 8)), (6, 8), r"row indices outside \[0, 6\): min 6, max 6"),
    ([0.0], np.ones((1, 8)), (6, 8), r"needs 1-D integer indices, got shape \(1,\) dtype float64"),
    ([True], np.ones((1, 8)), (6, 8), r"needs 1-D integer indices"),
    ([0], np.ones((1, 3)), (6, 8), r"has values of shape \(1, 3\), expected \(1, 8\)"),
    ([0], np.ones((1, 8)), (60, 8), r"has dense_shape \(60, 8\), but the variable's shape is "
                                    r"\(6, 8\)"),
])
def test_a_bad_sparse_value_for_a_dense_variable_is_refused(indices, values, shape, match):
    case = Case()
    grads = {n: np.zeros(s.shape) for n, s in case.trainer.spec.items()}
    grads["hidden/kernel"] = hostavg.SparseGradient(np.array(indices), values, shape)
    unchanged(case, lambda: case.trainer.apply(case.sess, grads),
              r"^apply: (sparse )?gradient of 'hidden/kernel' .*" + match)


def test_a_good_sparse_value_for_a_dense_variable_applies_as_its_dense_sum():
    a, b = Case(), Case()
    grads = {n: np.zeros(s.shape) for n, s in a.trainer.spec.items()}
    sparse = dict(grads, **{"hidden/kernel": hostavg.SparseGradient(
        np.array([2, 0, 2]), np.arange(24.0).reshape(3, 8), (6, 8))})
    dense = dict(grads, **{"hidden/kernel": sparse["hidden/kernel"].to_dense()})
    a.trainer.apply(a.sess, sparse)
    b.trainer.apply(b.sess, dense)
    for name, value in b.values().items():
        np.testing.assert_array_equal(a.values()[name], value, err_msg=name)


# --- coalesce_rows and _stable_order against brute force ------------------------------------------


def brute_coalesce(indices, values):
    """A dict summing each index's rows in the order they came; sorted by index."""
    sums = {}
    for i, row in zip(indices.tolist(), values):
        sums[i] = sums[i] + row if i in sums else row.copy()
    keys = sorted(sums)
    rows = np.array([sums[k] for k in keys], values.dtype)
    return np.array(keys, indices.dtype), rows.reshape((len(keys),) + values.shape[1:])


def rows_case(kind: str, rng, index_dtype, base: int) -> np.ndarray:
    """Indices that drive coalesce_rows down one path (checked by the test)."""
    distinct = base + rng.choice(1000, 24, replace=False)
    if kind == "unique":
        indices = distinct
    elif kind == "sorted":
        indices = np.sort(distinct)
    elif kind == "pairs":  # 8 of 24 twice, none thrice
        indices = rng.permutation(np.concatenate([distinct, distinct[:8]]))
    elif kind == "thrice":  # few duplicates, one index four times
        indices = rng.permutation(np.concatenate([distinct, distinct[:1].repeat(3), distinct[1:3]]))
    else:  # "many": 60 rows of 5 indices
        indices = rng.choice(distinct[:5], 60)
    return indices.astype(index_dtype)


@pytest.mark.parametrize("value_dtype,row_shape", [(np.float32, (3,)), (np.float64, ()),
                                                   (np.float32, (2, 3)), (np.float64, (4,))],
                         ids=["f32-2d", "f64-1d", "f32-3d", "f64-2d"])
@pytest.mark.parametrize("index_dtype,base", [(np.int32, 0), (np.int64, 0), (np.int64, 2 ** 31),
                                              (np.int64, 2 ** 40)],
                         ids=["int32", "int64", "int64-2^31", "int64-2^40"])
@pytest.mark.parametrize("kind", ["unique", "sorted", "pairs", "thrice", "many"])
def test_coalesce_rows_equals_a_dict_summing_rows_in_order(kind, index_dtype, base, value_dtype,
                                                           row_shape):
    rng = np.random.default_rng([ord(c) for c in kind] + [base % 997, len(row_shape)])
    for _ in range(5):
        indices = rows_case(kind, rng, index_dtype, base)
        values = rng.normal(size=(len(indices),) + row_shape).astype(value_dtype)
        _, counts = np.unique(indices, return_counts=True)
        assert {"unique": counts.max() == 1, "sorted": counts.max() == 1,
                "pairs": counts.max() == 2 and 2 * len(counts) > len(indices),
                "thrice": counts.max() >= 3 and 2 * len(counts) > len(indices),
                "many": 2 * len(counts) <= len(indices)}[kind]
        got = coalesce_rows(indices, values)
        want = brute_coalesce(indices, values)
        if kind == "sorted":
            assert got[0] is indices and got[1] is values
        assert got[0].dtype == indices.dtype and got[1].dtype == values.dtype
        np.testing.assert_array_equal(got[0], want[0])
        if kind != "many":
            np.testing.assert_array_equal(got[1], want[1])  # the same additions in the same order
        else:  # np.add.reduceat adds a run in its own order: within rounding of the exact sum
            exact = brute_coalesce(indices, values.astype(np.float64))[1]
            size = brute_coalesce(indices, np.abs(values).astype(np.float64))[1]
            counts = counts.reshape((-1,) + (1,) * len(row_shape))
            assert np.all(np.abs(got[1] - exact) <= 2 * counts * np.finfo(value_dtype).eps * size)


def test_coalesce_rows_of_fewer_than_two_rows_are_those_rows():
    for n in (0, 1):
        indices, values = np.arange(n) + 7, np.ones((n, 2), np.float32)
        got = coalesce_rows(indices, values)
        assert got[0] is indices and got[1] is values


@pytest.mark.parametrize("dtype,high", [(np.int32, 5), (np.int32, 2 ** 31 - 1), (np.int64, 5),
                                        (np.int64, 2 ** 31 - 1), (np.int64, 2 ** 31),
                                        (np.int64, 2 ** 62), (np.uint32, 2 ** 32 - 1)])
def test_stable_order_is_numpys_stable_argsort(dtype, high):
    rng = np.random.default_rng(high % 1009)
    for n in (1, 2, 3, 17, 1000):
        for indices in (rng.integers(max(high - 4, 0), high, n, endpoint=True, dtype=dtype),
                        rng.integers(0, high, n, endpoint=True, dtype=dtype)):
            np.testing.assert_array_equal(_stable_order(indices),
                                          np.argsort(indices, kind="stable"))


def test_only_arrays_freeze_made_are_trusted_and_their_entries_go_with_them():
    """What the caches trust (is_frozen, own): freeze's own views, read-only, still alive.
    An array made later at a freed one's address, one whose flag was set back, or a copy
    is not trusted; and no entry outlives its array."""
    import gc
    from hostavg.core import gradients
    from hostavg.core.gradients import freeze, is_frozen, own
    given = np.arange(3.0)
    view = freeze(given)
    assert is_frozen(view) and not view.flags.writeable and not given.flags.writeable
    assert not is_frozen(given) and not is_frozen(view.copy())
    assert own(view) is view and own(given) is not given and is_frozen(own(given))
    gc.collect()
    before = len(gradients._FROZEN)
    views = [freeze(np.zeros(3)) for _ in range(200)]
    assert len(gradients._FROZEN) == before + 200
    del views
    gc.collect()
    assert len(gradients._FROZEN) == before
    for _ in range(200):  # a new array where a frozen view was (CPython reuses addresses)
        freeze(np.zeros(3))
        other = np.zeros(3)
        other.flags.writeable = False
        assert not is_frozen(other)
    back = freeze(np.zeros(3))
    back.base.flags.writeable = True  # a foreign buffer's flag can be set back by hand
    back.flags.writeable = True
    assert not is_frozen(back)
