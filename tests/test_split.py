"""split: cutting feed dicts into micro-batches. Pure NumPy."""

import numpy as np
import pytest

import hostavg
from hostavg import HostavgError, split


def test_split_cuts_arrays_and_shares_scalars():
    x, y = np.arange(20).reshape(10, 2), list(range(10))
    parts = split({"x": x, "y": y, "lr": 0.5, "flag": np.array(True)}, 4)
    assert [len(p["x"]) for p in parts] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), x)
    np.testing.assert_array_equal(parts[2]["y"], [8, 9])
    assert all(p["lr"] == 0.5 and p["flag"] for p in parts)
    assert np.shares_memory(parts[1]["x"], x)


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_split_refuses_a_bad_micro_batch_size(size):
    with pytest.raises(HostavgError, match=rf"micro_batch_size must be an integer >= 1, got {size!r}"):
        split({"x": np.zeros(4)}, size)
    with pytest.raises(HostavgError, match=rf"micro_batches must be an integer >= 1, got {size!r}"):
        split({"x": np.zeros(4)}, micro_batches=size)


def test_split_takes_micro_batch_size_or_micro_batches_exactly():
    with pytest.raises(HostavgError, match=r"^split needs micro_batch_size .* or micro_batches "
                                           r".*, got neither$"):
        split({"x": np.zeros(4)})
    with pytest.raises(HostavgError, match=r"^give micro_batch_size or micro_batches, not both; "
                                           r"got micro_batch_size=2, micro_batches=3$"):
        split({"x": np.zeros(4)}, 2, micro_batches=3)


@pytest.mark.parametrize("n", range(1, 26))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_micro_batches_are_k_of_sizes_differing_by_at_most_one_the_larger_first(n, k):
    """Brute force: every sample once, in order; min(k, n) parts; sizes differing by at most one,
    never growing; and the largest is ceil(n / k), as Cut.largest says."""
    from hostavg.core.split import Cut
    x = np.arange(n)
    parts = split((x, x * 2), micro_batches=k)
    sizes = [len(a) for a, _ in parts]
    assert len(parts) == min(k, n) and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True) == Cut(None, k).sizes(n)
    assert max(sizes) == -(-n // k) == Cut(None, k).largest(n)
    np.testing.assert_array_equal(np.concatenate([a for a, _ in parts]), x)
    np.testing.assert_array_equal(np.concatenate([b for _, b in parts]), x * 2)


def test_split_refuses_arrays_of_different_lengths_and_empty_feeds():
    with pytest.raises(HostavgError, match=r"different lengths along axis 0 \('x': 4, 'y': 3\)"):
        split({"x": np.zeros(4), "y": np.zeros(3)}, 2)
    with pytest.raises(HostavgError, match="holds no samples"):
        split({"x": np.zeros((0, 3))}, 2)
    with pytest.raises(HostavgError, match="holds no samples"):
        split({"lr": 0.1}, 2)


def test_split_cuts_tuples_with_dicts_sample_weights_and_none():
    x = {"a": np.arange(10).reshape(5, 2), "b": np.arange(5)}
    y, w = np.arange(5) * 10, np.ones(5)
    parts = split((x, y, w), 2)
    assert len(parts) == 3 and all(isinstance(p, tuple) and len(p) == 3 for p in parts)
    np.testing.assert_array_equal(parts[2][0]["a"], [[8, 9]])
    np.testing.assert_array_equal(parts[1][1], [20, 30])
    assert set(parts[0][0]) == {"a", "b"} and len(parts[0][2]) == 2
    (_, _, none), = split((np.zeros((3, 1)), np.zeros(3), None), 4)
    assert none is None
    with pytest.raises(HostavgError, match=r"different lengths along axis 0 \(batch\[0\]\['a'\]: 5, "
                                           r"batch\[0\]\['b'\]: 5, batch\[1\]: 4\)"):
        split((x, y[:4]), 2)
    with pytest.raises(HostavgError, match=r"split takes a dict \{key: array\} or a tuple \(x, y\), got list"):
        split([np.zeros(3)], 2)


def test_take_and_feed_size_read_tuples_like_feed_dicts():
    from hostavg.core.split import feed_size, take
    batch = ({"a": np.arange(6)}, np.arange(6) * 2, 0.5)
    assert feed_size(batch) == 6
    x, y, scalar = take(batch, np.array([5, 0]))
    np.testing.assert_array_equal(x["a"], [5, 0])
    np.testing.assert_array_equal(y, [10, 0])
    assert scalar == 0.5


def test_micro_batches_cut_with_blocks_keep_them_and_know_their_size():
    from hostavg.core.split import blocks_of, feed_size
    parts = split({"x": np.zeros((5, 2)), "labels": np.arange(10)}, 2, blocks={"labels": 2})
    assert [feed_size(p) for p in parts] == [2, 2, 1]
    assert blocks_of(parts[0]) == {"labels": 2} and blocks_of(dict(parts[0])) == {}
    np.testing.assert_array_equal(parts[2]["labels"], [4, 9])
    pairs = split((np.zeros(3), np.arange(6)), 2, blocks={(1,): 2})
    assert [feed_size(p) for p in pairs] == [2, 1] and isinstance(pairs[0], tuple)
    np.testing.assert_array_equal(pairs[1][1], [2, 5])


# --- Ragged lists -----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", ["dict", "tuple"])
def test_split_refuses_ragged_lists_naming_them(batch):
    # ValueError: setting an array element with a sequence (NumPy's own).
    ragged = [[1.0, 2.0], [3.0]]
    data = {"x": ragged} if batch == "dict" else (ragged, [0, 1])
    name = "'x'" if batch == "dict" else r"batch\[0\]"
    with pytest.raises(hostavg.HostavgError, match=rf"^split: {name} cannot be made an array "
                                                   rf"\(setting an array element"):
        hostavg.split(data, 1)
