"""A step's micro-batches made ready before any runs: each one's feed, size, place and data rows."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from hostavg.core.errors import ArgumentError, HostavgError, positive_int
from hostavg.core.gradients import freeze
from hostavg.core.results import Culprit
from hostavg.engine import culprits

__all__ = ["Prepared", "describe_rows", "prepare", "prepare_one", "refused", "row_indices"]


class Prepared(NamedTuple):
    """One micro-batch of a step, made ready before any runs (:func:`prepare`).

    Attributes:
      feed: what the backend's ``prepare`` made of it, ready to compute.
      size: its number of samples.
      start: the step's sample its first one is (the samples of the micro-batches before it).
      where: its place in words, for errors: ``micro-batch i of k (samples a:b, data rows ...)``.
      rows: its samples' data rows, a read-only int64 array, or None.
      given: its feed as given, which the culprit search cuts into samples.
    """

    feed: Any
    size: int
    start: int
    where: str
    rows: np.ndarray | None
    given: Any


def prepare(backend, feeds, sizes, call: str = "step", rows=None,
            emptied=frozenset()) -> list[Prepared]:
    """Every micro-batch checked and sized before any runs: a :class:`Prepared` each.

    ``emptied``: the indices of micro-batches whose every sample was left out
    (:mod:`~hostavg.engine.skipping`): a Prepared of ``feed`` None and size 0 each, not
    given to the backend. An error of micro-batch ``i`` gets ``.micro_batch`` (``i``) and
    ``.start`` (the step's sample its first one is)."""
    if isinstance(feeds, Mapping) or not isinstance(feeds, (Sequence, np.ndarray)):
        raise ArgumentError(
            f"{call} takes a list of {backend.advice['batches_name']}, one per micro-batch, got "
            f"{type(feeds).__name__}; cut one big batch with hostavg.split(batch, "
            f"micro_batch_size)")
    if sizes is not None:
        if isinstance(sizes, Mapping) or not isinstance(sizes, (Sequence, np.ndarray)) \
                or len(sizes) != len(feeds):
            raise ArgumentError(f"sizes must hold one number of samples per micro-batch "
                                f"({len(feeds)}), got {sizes!r}")
        sizes = [positive_int(f"sizes[{i}]", n) for i, n in enumerate(sizes)]
    if rows is not None and (isinstance(rows, Mapping) or not isinstance(rows, (Sequence, np.ndarray))
                             or len(rows) != len(feeds)):
        raise ArgumentError(f"rows must hold one array of row indices per micro-batch "
                            f"({len(feeds)}), or be None; got {type(rows).__name__} of length "
                            f"{len(rows) if hasattr(rows, '__len__') else '?'}")
    out, start = [], 0
    for i, feed in enumerate(feeds):
        what = f"micro-batch {i} of {len(feeds)}"
        if i in emptied:
            out.append(Prepared(None, 0, start, f"{what} (every sample left out)",
                                None if rows is None else freeze(np.zeros(0, np.int64)), feed))
            continue
        its_rows = None if rows is None else np.asarray(rows[i])
        known = its_rows is not None and its_rows.ndim == 1 and its_rows.dtype.kind in "iu"
        try:
            made, n = prepare_one(backend, feed, None if sizes is None else sizes[i],
                                  f"{call}, {what}" + (f" (data {describe_rows(its_rows)})"
                                                       if known and len(its_rows) else ""),
                                  start, its_rows if known else None)
        except Exception as e:
            with contextlib.suppress(AttributeError):  # a type with __slots__
                e.micro_batch, e.start = i, start
                if known:
                    e.rows = freeze(its_rows.astype(np.int64))  # the failed feed's data rows
            raise
        indices = None if rows is None else row_indices(rows[i], n, f"{call}, {what}")
        said = "" if indices is None else f", data {describe_rows(indices)}"
        out.append(Prepared(made, n, start, f"{what} (samples {start}:{start + n}{said})", indices,
                            feed))
        start += n
    return out


def prepare_one(backend, feed, size, what: str, start: int = 0, rows=None) -> tuple:
    """``backend.prepare(feed, size, what)`` of a feed whose first sample is the batch's sample
    ``start``, of data ``rows`` (or None); the samples a :func:`refused` error names are named
    by their place in the batch and their data row."""
    try:
        return backend.prepare(feed, size, what)
    except HostavgError as e:
        problem = getattr(e, "refused", None)
        if problem is not None:
            if rows is not None and len(rows) <= max(c.sample for c in e.culprits):
                rows = None  # not one row per sample: the feed's own error is for prepare
            e.culprits = tuple(Culprit(start + c.sample, None if rows is None
                                       else int(rows[c.sample]), c.reason) for c in e.culprits)
            e.culprit_rows = culprits.rows_of(e.culprits)
            e.args = (_refusal(what, problem, e.culprits), *e.args[1:])
        raise


def refused(what: str, problem: str, found) -> HostavgError:
    """The error of a backend's ``prepare`` that refuses samples of a feed: ``problem`` in
    words, and per refused sample (its position in the feed, what is wrong with it), in order.

    Its ``.culprits`` hold a :class:`~hostavg.core.results.Culprit` per sample,
    at its position in the feed (the batch's, where the feed is the batch) until
    :func:`prepare_one` places them; ``.culprit_rows`` their sorted data rows,
    [] while unknown.
    """
    found = tuple(Culprit(int(j), None, reason) for j, reason in found)
    error = ArgumentError(_refusal(what, problem, found))
    error.culprits, error.culprit_rows, error.refused = found, [], problem
    return error


def _refusal(what: str, problem: str, found: tuple) -> str:
    """``what: problem:`` and a line per refused sample (a handful)."""
    lines = [f"  {f'data row {c.row}' if c.row is not None else f'sample {c.sample} of the batch'}"
             f": {c.reason}" for c in found[:culprits.LISTED]]
    if len(found) > culprits.LISTED:
        lines.append(f"  ... and {len(found) - culprits.LISTED} more (the exception's .culprits "
                     f"holds all)")
    return f"{what}: {problem}:\n" + "\n".join(lines)


def row_indices(rows, n: int, what: str) -> np.ndarray | None:
    """A feed's data rows as a read-only int64 array of length ``n`` (or None)."""
    if rows is None:
        return None
    array = np.asarray(rows)
    if array.shape != (n,) or (array.size and array.dtype.kind not in "iu"):
        raise ArgumentError(f"{what}: rows must be {n} integer row indices, one per sample, got "
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
