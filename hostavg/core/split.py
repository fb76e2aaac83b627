"""Cutting a batch into micro-batches. Pure NumPy.

A batch is a feed dict ``{placeholder: value}`` (the TF1 trainer) or a tuple
such as ``(x, y)`` or ``(x, y, sample_weight)`` (the Keras trainer), each
element a value or a dict ``{name: value}``. An *array* (at least one
dimension; a list or tuple inside a dict) runs over samples on axis 0; every
other value (a scalar, None) is passed unchanged to every micro-batch.

Blocks: ``blocks={key: b}`` says an array's rows are b blocks of the
batch's samples one after another (a discriminator's real and fake labels);
every micro-batch then gets the matching rows of each block.

See docs/guides/training.md for blocks and sizes in detail.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from hostavg.core.errors import ArgumentError, positive_int

__all__ = ["Cut", "arrays", "as_arrays", "blocks_of", "cut", "feed_size", "pieces", "sample_count",
           "split", "take"]


class Cut(NamedTuple):
    """How a batch of n samples is cut into micro-batches: by ``size`` or by ``count``.

    ``size``: micro-batches of ``size`` samples, the last one the rest
    (ceil(n / size) of them). ``count``: min(count, n) micro-batches whose
    sizes differ by at most one, the larger first (as ``numpy.array_split``):
    n = 10, count = 4 gives 3, 3, 2, 2. Exactly one of the two is set
    (:func:`cut` makes it).
    """

    size: int | None
    count: int | None

    def sizes(self, n: int) -> list[int]:
        """The micro-batch sizes of a batch of ``n`` >= 1 samples, in order."""
        if self.size is not None:
            return [min(self.size, n - start) for start in range(0, n, self.size)]
        k = min(self.count, n)
        return [n // k + 1] * (n % k) + [n // k] * (k - n % k)

    def largest(self, n: int) -> int:
        """The largest micro-batch of a batch of ``n`` samples: ``size``, or ceil(n / count)."""
        return self.size if self.size is not None else -(-n // self.count)

    def __str__(self) -> str:
        return f"micro_batch_size={self.size}" if self.size is not None \
            else f"micro_batches={self.count}"


def cut(micro_batch_size=None, micro_batches=None) -> Cut | None:
    """The :class:`Cut` of ``micro_batch_size`` or ``micro_batches``, or None where neither is
    given.

    Raises:
      HostavgError: for both given, or either not an integer >= 1.
    """
    if micro_batch_size is not None and micro_batches is not None:
        raise ArgumentError(f"give micro_batch_size or micro_batches, not both; got micro_batch_"
                            f"size={micro_batch_size!r}, micro_batches={micro_batches!r}")
    if micro_batches is not None:
        return Cut(None, positive_int("micro_batches", micro_batches))
    if micro_batch_size is not None:
        return Cut(positive_int("micro_batch_size", micro_batch_size), None)
    return None


class _BlockedFeed(dict):
    """A feed dict that split cut with ``blocks``, which it keeps."""

    __slots__ = ("blocks",)


class _BlockedTuple(tuple):
    """A tuple batch that split cut with ``blocks``, which it keeps."""


def _blocked(batch, blocks: Mapping):
    out = (_BlockedFeed if isinstance(batch, Mapping) else _BlockedTuple)(batch)
    out.blocks = dict(blocks)
    return out


def blocks_of(batch) -> dict:
    """The blocks ``batch`` was cut with (a micro-batch of ``split(..., blocks=)``), else {}."""
    return batch.blocks if isinstance(batch, (_BlockedFeed, _BlockedTuple)) else {}


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
    raise ArgumentError(f"a batch is a dict {{key: array}} or a tuple such as (x, y), got "
                        f"{type(batch).__name__}")


def _rebuild(batch, values: dict):
    """``batch`` with each leaf replaced by ``values[path]`` where given."""
    if isinstance(batch, Mapping):
        return {key: values.get(key, value) for key, value in batch.items()}
    return tuple({key: values.get((i, key), value) for key, value in part.items()}
                 if isinstance(part, Mapping) else values.get((i,), part)
                 for i, part in enumerate(batch))


def arrays(batch, what: str = "a batch") -> dict:
    """The sample-carrying values of a batch, by path, as NumPy arrays."""
    out = {}
    for path, value in _leaves(batch).items():
        if isinstance(value, (list, tuple)):
            try:
                value = np.asarray(value)
            except ValueError as e:  # ragged nested lists
                raise ArgumentError(f"{what}: {_key_name(path)} cannot be made an array "
                                    f"({e})") from None
        if isinstance(value, np.ndarray) and value.ndim >= 1:
            out[path] = value
    return out


def as_arrays(batch, what: str = "a batch"):
    """``batch`` with each sample-carrying value a NumPy array (a list made one); the rest shared."""
    return _rebuild(batch, arrays(batch, what))


def _length(arrays: dict, what: str, blocks: Mapping | None = None) -> int | None:
    """The number of samples the arrays hold (a key of ``blocks`` holds that many rows per sample)."""
    blocks = blocks or {}
    lengths = {k: len(v) / blocks.get(k, 1) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1 or any(n != int(n) for n in lengths.values()):
        listed = ", ".join(f"{_key_name(k)}: {len(v)}" + (f" in {blocks[k]} blocks" if k in blocks
                                                          else "")
                           for k, v in arrays.items())
        raise ArgumentError(
            f"{what}: arrays have different lengths along axis 0 ({listed}); every array in a "
            f"batch must hold the same samples. An array of several blocks of the samples (labels "
            f"of real samples, then of fake ones) is declared with "
            f"blocks={{key: number_of_blocks}} to hostavg.split, whose micro-batches then know "
            f"their sizes, or to fit and check; micro-batches cut by hand need their sizes: "
            f"sizes= (one per micro-batch) to step, (trainer, batches, sizes) to step_together")
    return int(lengths.popitem()[1]) if lengths else None


def sample_count(batch, what: str = "batch", blocks: Mapping | None = None) -> int | None:
    """The number of samples in a batch (see :func:`feed_size`), or None where it holds no array."""
    return _length(arrays(batch, what), what, blocks_of(batch) if blocks is None else blocks)


def feed_size(batch, what: str = "batch", blocks: Mapping | None = None) -> int:
    """The number of samples in a batch: the common length of its arrays along axis 0.

    ``blocks`` (see :func:`split`): default those the batch was cut with
    (:func:`blocks_of`).

    Raises:
      HostavgError: when the arrays disagree, or the batch holds no array (then
        the caller must say the size).
    """
    n = sample_count(batch, what, blocks)
    if n is None:
        raise ArgumentError(
            f"{what}: no array in the batch (only scalars), so its number of samples is "
            f"unknown; say it: size= to compute, sizes= (one per micro-batch) to step")
    return n


def take(batch, rows, n: int | None = None, blocks: Mapping | None = None):
    """``batch`` restricted to the samples ``rows`` (a slice or indices) of its ``n``; other values shared.

    Arrays are indexed along axis 0 (a slice gives views); a key of ``blocks``
    (which needs ``n``) gets those rows of each of its blocks, one block after
    another.
    """
    blocks = blocks or {}
    return _rebuild(batch, {
        path: np.concatenate([array[b * n:(b + 1) * n][rows] for b in range(blocks[path])])
        if path in blocks else array[rows] for path, array in arrays(batch).items()})


def split(batch, micro_batch_size: int | None = None, *, micro_batches: int | None = None,
          blocks: Mapping | None = None) -> list:
    """Cuts every array of ``batch`` along axis 0 into micro-batches.

    Args:
      batch: a feed dict {placeholder: value}, or a tuple such as (x, y) or
        (x, y, sample_weight) whose elements are arrays or dicts of arrays;
        arrays of N samples each.
      micro_batch_size: samples per micro-batch, >= 1. The last micro-batch
        holds the remaining N mod micro_batch_size samples when that is not 0.
      micro_batches: instead of ``micro_batch_size``, the number of
        micro-batches: min(micro_batches, N) of sizes that differ by at most
        one, the larger first (10 samples in 4: 3, 3, 2, 2).
      blocks: {key: b} for arrays of b blocks of N rows (see the module
        docstring); each micro-batch gets its rows of every block.

    Returns:
      the micro-batches (ceil(N / micro_batch_size) of them), batches of the
      same form (feed dicts with the same keys, or tuples); slices are views,
      scalars are shared. Cut with ``blocks``, each keeps them
      (:func:`blocks_of`), so that step tells its size (a copy such as
      ``dict(batch)`` does not keep them).

    Raises:
      HostavgError: for both ``micro_batch_size`` and ``micro_batches``, or
        neither, or arrays of different lengths, or no samples.

    Example:
      >>> [len(f["x"]) for f in split({"x": np.zeros((10, 3)), "lr": 0.1}, 4)]
      [4, 4, 2]
      >>> [len(f["x"]) for f in split({"x": np.zeros((10, 3))}, micro_batches=4)]
      [3, 3, 2, 2]
      >>> [(len(x["a"]), len(y)) for x, y in split(({"a": np.zeros((5, 2))}, np.ones(5)), 3)]
      [(3, 3), (2, 2)]
    """
    how = cut(micro_batch_size, micro_batches)
    if how is None:
        raise ArgumentError("split needs micro_batch_size (samples per micro-batch) or "
                            "micro_batches (their number), got neither")
    if not isinstance(batch, (Mapping, tuple)):
        raise ArgumentError(f"split takes a dict {{key: array}} or a tuple (x, y), got "
                            f"{type(batch).__name__}; e.g. hostavg.split({{x: xs, y: ys}}, 32)")
    n = _length(arrays(batch, "split"), "split", blocks)
    if not n:
        raise ArgumentError(
            "split: the batch holds no samples (no array, or arrays of length 0)")
    return pieces(batch, how.sizes(n), n, blocks)


def pieces(batch, sizes: list[int], n: int, blocks: Mapping | None = None) -> list:
    """``batch`` of ``n`` samples cut into consecutive micro-batches of ``sizes`` samples (a
    :class:`Cut`'s), as :func:`split` cuts it: the arguments are taken as checked."""
    parts = [take(batch, slice(start - size, start), n, blocks)
             for start, size in zip(accumulate(sizes), sizes)]
    return [_blocked(b, blocks) for b in parts] if blocks else parts


def _key_name(key) -> str:
    if isinstance(key, tuple):  # a path in a tuple batch
        return "batch" + "".join(f"[{k!r}]" for k in key)
    return getattr(key, "name", None) or repr(key)
