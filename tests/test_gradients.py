"""Gradients and SparseGradient: values, norms, densification. Pure NumPy."""

import numpy as np
import pytest

from hostavg import Gradients, SparseGradient


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
