"""A step's micro-batches made ready before any runs: each one's feed, size, place and data rows."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import numpy as np

from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.gradients import freeze

__all__ = ["describe_rows", "prepare"]


def prepare(backend, feeds, sizes, call: str = "step", rows=None) -> list:
    """Every micro-batch checked and sized before any runs: (feed, n, start, where, rows) each."""
    if isinstance(feeds, Mapping) or not isinstance(feeds, (Sequence, np.ndarray)):
        raise HostavgError(
            f"{call} takes a list of feed dicts, one per micro-batch, got "
            f"{type(feeds).__name__}; cut one big feed with hostavg.split(feed, micro_batch_size)")
    if sizes is not None:
        if isinstance(sizes, Mapping) or not isinstance(sizes, (Sequence, np.ndarray)) \
                or len(sizes) != len(feeds):
            raise HostavgError(f"sizes must hold one number of samples per feed ({len(feeds)}), "
                               f"got {sizes!r}")
        sizes = [positive_int(f"sizes[{i}]", n) for i, n in enumerate(sizes)]
    if rows is not None and (isinstance(rows, Mapping) or not isinstance(rows, (Sequence, np.ndarray))
                             or len(rows) != len(feeds)):
        raise HostavgError(f"rows must hold one array of row indices per feed ({len(feeds)}), "
                           f"or be None; got {type(rows).__name__} of length "
                           f"{len(rows) if hasattr(rows, '__len__') else '?'}")
    out, start = [], 0
    for i, feed in enumerate(feeds):
        what = f"micro-batch {i} of {len(feeds)}"
        given = None if rows is None else np.asarray(rows[i])
        known = given is not None and given.ndim == 1 and given.dtype.kind in "iu"
        try:
            feed, n = backend.prepare(feed, None if sizes is None else sizes[i],
                                      f"{call}, {what}" + (f" (data {describe_rows(given)})"
                                                           if known and len(given) else ""))
        except Exception as e:
            if known:
                with contextlib.suppress(AttributeError):  # a type with __slots__
                    e.rows = freeze(given.astype(np.int64))  # the data rows of the feed that failed
            raise
        indices = None if rows is None else _rows(rows[i], n, f"{call}, {what}")
        said = "" if indices is None else f", data {describe_rows(indices)}"
        out.append((feed, n, start, f"{what} (samples {start}:{start + n}{said})", indices))
        start += n
    return out


def _rows(rows, n: int, what: str) -> np.ndarray | None:
    """A micro-batch's data rows as a read-only int64 array of length ``n`` (or None)."""
    if rows is None:
        return None
    array = np.asarray(rows)
    if array.shape != (n,) or (array.size and array.dtype.kind not in "iu"):
        raise HostavgError(f"{what}: rows must be {n} integer row indices, one per sample, got "
                           f"shape {array.shape} dtype {array.dtype}")
    return freeze(array.astype(np.int64))


def describe_rows(rows, handful: int = 8) -> str:
    """Data rows in words: each of a handful, a range ``a:b`` when contiguous, else the first few.

    Example:
      >>> describe_rows(np.arange(96, 128)), describe_rows([7, 3])
      ('rows 96:128', 'rows [7, 3]')
    """
    rows = np.asarray(rows)
    if len(rows) <= handful:
        return f"rows {rows.tolist()}"
    if np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
        return f"rows {rows[0]}:{rows[0] + len(rows)}"
    shown = ", ".join(map(str, rows[:handful // 2].tolist()))
    return (f"rows [{shown}, ...] ({len(rows)} of them, between {rows.min()} and {rows.max()}; "
            f"the exception's .rows holds all)")
