"""split: cutting feed dicts into micro-batches. Pure NumPy."""

import numpy as np
import pytest

from hostavg import HostavgError, split


def test_split_cuts_arrays_and_shares_scalars():
    x, y = np.arange(20).reshape(10, 2), list(range(10))
    parts = split({"x": x, "y": y, "lr": 0.5, "flag": np.array(True)}, 4)
    assert [len(p["x"]) for p in parts] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), x)
    np.testing.assert_array_equal(parts[2]["y"], [8, 9])
    assert all(p["lr"] == 0.5 and p["flag"] for p in parts)
    assert np.shares_memory(parts[1]["x"], x)


@pytest.mark.parametrize("size", [0, -3, 2.5, True, None])
def test_split_refuses_a_bad_micro_batch_size(size):
    with pytest.raises(HostavgError, match=rf"micro_batch_size must be an integer >= 1, got {size!r}"):
        split({"x": np.zeros(4)}, size)


def test_split_refuses_arrays_of_different_lengths_and_empty_feeds():
    with pytest.raises(HostavgError, match=r"different lengths along axis 0 \('x': 4, 'y': 3\)"):
        split({"x": np.zeros(4), "y": np.zeros(3)}, 2)
    with pytest.raises(HostavgError, match="holds no samples"):
        split({"x": np.zeros((0, 3))}, 2)
    with pytest.raises(HostavgError, match="holds no samples"):
        split({"lr": 0.1}, 2)
