"""Cutting a feed dict into micro-batches. Pure NumPy.

An *array* in a feed dict is a NumPy array with at least one dimension, or a
list or tuple (converted with ``np.asarray``); its axis 0 runs over samples.
Every other value (a Python or NumPy scalar, a 0-d array: a learning rate, an
``is_training`` flag) belongs to no sample and is passed unchanged to every
micro-batch.

Blocks: some programs feed one array whose rows are several blocks of the
batch's samples one after another, such as the labels of a discriminator that
sees ``tf.concat([real_images, generated_images], 0)``: 2 N labels for N
samples. ``blocks={labels: 2}`` says so; every micro-batch then gets the
matching rows of each block (real labels of its samples, then fake ones).
Since such a feed's arrays have different lengths, give ``step`` its sizes
(``sizes=``); ``fit`` does that itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hostavg.errors import HostavgError, positive_int

__all__ = ["split", "feed_size", "take"]


def _arrays(feed_dict: Mapping) -> dict:
    """The sample-carrying values of a feed, by key, as NumPy arrays."""
    out = {}
    for key, value in feed_dict.items():
        if isinstance(value, (list, tuple)):
            value = np.asarray(value)
        if isinstance(value, np.ndarray) and value.ndim >= 1:
            out[key] = value
    return out


def _length(arrays: dict, what: str, blocks: Mapping | None = None) -> int | None:
    """The number of samples the arrays hold (a key of ``blocks`` holds that many rows per sample)."""
    blocks = blocks or {}
    lengths = {k: len(v) / blocks.get(k, 1) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1 or any(n != int(n) for n in lengths.values()):
        listed = ", ".join(f"{_key_name(k)}: {len(v)}" + (f" in {blocks[k]} blocks" if k in blocks
                                                          else "")
                           for k, v in arrays.items())
        raise HostavgError(
            f"{what}: arrays have different lengths along axis 0 ({listed}); every array in a "
            f"feed must hold the same samples. An array of several blocks of the samples (labels "
            f"of tf.concat([real, fake])) is declared with blocks={{key: number_of_blocks}}; "
            f"micro-batches made by hand take sizes= in step")
    return int(lengths.popitem()[1]) if lengths else None


def feed_size(feed_dict: Mapping, what: str = "feed", blocks: Mapping | None = None) -> int:
    """The number of samples in a feed: the common length of its arrays along axis 0.

    Raises:
      HostavgError: when the arrays disagree, or the feed holds no array (then
        the caller must say the size).
    """
    n = _length(_arrays(feed_dict), what, blocks)
    if n is None:
        raise HostavgError(
            f"{what}: no array in the feed dict (only scalars), so its number of samples is "
            f"unknown; say it: size= to compute, sizes= (one per micro-batch) to step")
    return n


def take(feed_dict: Mapping, rows, n: int, blocks: Mapping | None = None) -> dict:
    """The feed restricted to the samples ``rows`` (a slice or an index array) of its ``n``.

    Arrays are indexed along axis 0 (a slice gives views); a key of ``blocks``
    gets those rows of each of its blocks, one block after another; scalars
    are passed unchanged.
    """
    out = {}
    for key, value in feed_dict.items():
        if isinstance(value, (list, tuple)):
            value = np.asarray(value)
        if not (isinstance(value, np.ndarray) and value.ndim >= 1):
            out[key] = value
        elif blocks and key in blocks:
            out[key] = np.concatenate([value[b * n:(b + 1) * n][rows] for b in range(blocks[key])])
        else:
            out[key] = value[rows]
    return out


def split(feed_dict: Mapping, micro_batch_size: int, *, blocks: Mapping | None = None
          ) -> list[dict]:
    """Cuts every array of ``feed_dict`` along axis 0 into micro-batches.

    Args:
      feed_dict: {placeholder: value}; arrays of N samples each.
      micro_batch_size: samples per micro-batch, >= 1. The last micro-batch
        holds the remaining N mod micro_batch_size samples when that is not 0.
      blocks: {key: b} for arrays of b blocks of N rows (see the module
        docstring); each micro-batch gets its rows of every block.

    Returns:
      ceil(N / micro_batch_size) feed dicts with the same keys; slices are
      views, scalars are shared.

    Example:
      >>> [len(f["x"]) for f in split({"x": np.zeros((10, 3)), "lr": 0.1}, 4)]
      [4, 4, 2]
    """
    positive_int("micro_batch_size", micro_batch_size)
    n = _length(_arrays(feed_dict), "split", blocks)
    if not n:
        raise HostavgError(
            "split: the feed dict holds no samples (no array, or arrays of length 0)")
    return [take(feed_dict, slice(start, start + micro_batch_size), n, blocks)
            for start in range(0, n, micro_batch_size)]


def _key_name(key) -> str:
    return getattr(key, "name", None) or repr(key)
