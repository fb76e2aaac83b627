"""Cutting a batch into micro-batches. Pure NumPy.

A batch is either

* a feed dict ``{placeholder: value}`` (the TF1 trainer), or
* a tuple such as ``(x, y)`` or ``(x, y, sample_weight)`` (the Keras
  trainer), each element a value or a dict ``{name: value}`` (a multi-input
  model's x).

An *array* is a NumPy array with at least one dimension, or a list or tuple
inside a dict (converted with ``np.asarray``); its axis 0 runs over samples.
Every other value (a Python or NumPy scalar, a 0-d array: a learning rate, an
``is_training`` flag; None) belongs to no sample and is passed unchanged to
every micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hostavg.errors import HostavgError, positive_int

__all__ = ["feed_size", "split", "take"]


def _leaves(batch) -> dict:
    """Every value of a batch by its path: a feed dict's key, or (position,) / (position, key) in a tuple."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, tuple):
        out = {}
        for i, part in enumerate(batch):
            if isinstance(part, Mapping):
                out.update(((i, key), value) for key, value in part.items())
            else:
                out[(i,)] = part
        return out
    raise HostavgError(f"a batch is a feed dict or a tuple such as (x, y), got {type(batch).__name__}")


def _rebuild(batch, values: dict):
    """``batch`` with each leaf replaced by ``values[path]`` where given."""
    if isinstance(batch, Mapping):
        return {key: values.get(key, value) for key, value in batch.items()}
    return tuple({key: values.get((i, key), value) for key, value in part.items()}
                 if isinstance(part, Mapping) else values.get((i,), part)
                 for i, part in enumerate(batch))


def _arrays(batch) -> dict:
    """The sample-carrying values of a batch, by path, as NumPy arrays."""
    out = {}
    for path, value in _leaves(batch).items():
        if isinstance(value, (list, tuple)):
            value = np.asarray(value)
        if isinstance(value, np.ndarray) and value.ndim >= 1:
            out[path] = value
    return out


def _length(arrays: dict, what: str) -> int | None:
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) > 1:
        listed = ", ".join(f"{_key_name(k)}: {len(v)}" for k, v in arrays.items())
        raise HostavgError(
            f"{what}: arrays have different lengths along axis 0 ({listed}); every "
            f"array in a feed must hold the same samples")
    return lengths.pop() if lengths else None


def feed_size(batch, what: str = "feed") -> int:
    """The number of samples in a batch: the common length of its arrays along axis 0.

    Raises:
      HostavgError: when the arrays disagree, or the batch holds no array (then
        the caller must say the size).
    """
    n = _length(_arrays(batch), what)
    if n is None:
        raise HostavgError(
            f"{what}: no array in the batch, so its number of samples is unknown; "
            f"pass size= explicitly")
    return n


def take(batch, rows):
    """``batch`` with every array indexed by ``rows`` (a slice or indices) along axis 0; other values shared."""
    return _rebuild(batch, {path: array[rows] for path, array in _arrays(batch).items()})


def split(batch, micro_batch_size: int) -> list:
    """Cuts every array of ``batch`` along axis 0 into micro-batches.

    Args:
      batch: a feed dict {placeholder: value}, or a tuple such as (x, y) or
        (x, y, sample_weight) whose elements are arrays or dicts of arrays;
        arrays of N samples each.
      micro_batch_size: samples per micro-batch, >= 1. The last micro-batch
        holds the remaining N mod micro_batch_size samples when that is not 0.

    Returns:
      ceil(N / micro_batch_size) batches of the same form (feed dicts with
      the same keys, or tuples); slices are views, scalars are shared.

    Example:
      >>> [len(f["x"]) for f in split({"x": np.zeros((10, 3)), "lr": 0.1}, 4)]
      [4, 4, 2]
      >>> [(len(x["a"]), len(y)) for x, y in split(({"a": np.zeros((5, 2))}, np.ones(5)), 3)]
      [(3, 3), (2, 2)]
    """
    positive_int("micro_batch_size", micro_batch_size)
    arrays = _arrays(batch)
    n = _length(arrays, "split")
    if not n:
        raise HostavgError(
            "split: the batch holds no samples (no array, or arrays of length 0)")
    return [_rebuild(batch, {path: array[start:start + micro_batch_size]
                             for path, array in arrays.items()})
            for start in range(0, n, micro_batch_size)]


def _key_name(key) -> str:
    if isinstance(key, tuple):  # a path in a tuple batch
        return "batch" + "".join(f"[{k!r}]" for k in key)
    return getattr(key, "name", None) or repr(key)
