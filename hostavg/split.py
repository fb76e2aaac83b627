"""Cutting a feed dict into micro-batches. Pure NumPy.

An *array* in a feed dict is a NumPy array with at least one dimension, or a
list or tuple (converted with ``np.asarray``); its axis 0 runs over samples.
Every other value (a Python or NumPy scalar, a 0-d array: a learning rate, an
``is_training`` flag) belongs to no sample and is passed unchanged to every
micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hostavg.errors import HostavgError, positive_int

__all__ = ["split", "feed_size"]


def _arrays(feed_dict: Mapping) -> dict:
    """The sample-carrying values of a feed, by key, as NumPy arrays."""
    out = {}
    for key, value in feed_dict.items():
        if isinstance(value, (list, tuple)):
            value = np.asarray(value)
        if isinstance(value, np.ndarray) and value.ndim >= 1:
            out[key] = value
    return out


def _length(arrays: dict, what: str) -> int | None:
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) > 1:
        listed = ", ".join(f"{_key_name(k)}: {len(v)}" for k, v in arrays.items())
        raise HostavgError(
            f"{what}: arrays have different lengths along axis 0 ({listed}); every "
            f"array in a feed must hold the same samples")
    return lengths.pop() if lengths else None


def feed_size(feed_dict: Mapping, what: str = "feed") -> int:
    """The number of samples in a feed: the common length of its arrays along axis 0.

    Raises:
      HostavgError: when the arrays disagree, or the feed holds no array (then
        the caller must say the size).
    """
    n = _length(_arrays(feed_dict), what)
    if n is None:
        raise HostavgError(
            f"{what}: no array in the feed dict, so its number of samples is unknown; "
            f"pass size= explicitly")
    return n


def split(feed_dict: Mapping, micro_batch_size: int) -> list[dict]:
    """Cuts every array of ``feed_dict`` along axis 0 into micro-batches.

    Args:
      feed_dict: {placeholder: value}; arrays of N samples each.
      micro_batch_size: samples per micro-batch, >= 1. The last micro-batch
        holds the remaining N mod micro_batch_size samples when that is not 0.

    Returns:
      ceil(N / micro_batch_size) feed dicts with the same keys; slices are
      views, scalars are shared.

    Example:
      >>> [len(f["x"]) for f in split({"x": np.zeros((10, 3)), "lr": 0.1}, 4)]
      [4, 4, 2]
    """
    positive_int("micro_batch_size", micro_batch_size)
    if not isinstance(feed_dict, Mapping):
        raise HostavgError(f"split takes a feed dict {{placeholder: array}}, got "
                           f"{type(feed_dict).__name__}; e.g. hostavg.split({{x: xs, y: ys}}, 32)")
    arrays = _arrays(feed_dict)
    n = _length(arrays, "split")
    if not n:
        raise HostavgError(
            "split: the feed dict holds no samples (no array, or arrays of length 0)")
    return [{key: arrays[key][start:start + micro_batch_size] if key in arrays else value
             for key, value in feed_dict.items()}
            for start in range(0, n, micro_batch_size)]


def _key_name(key) -> str:
    return getattr(key, "name", None) or repr(key)
