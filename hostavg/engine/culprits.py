"""Which samples make a micro-batch fail: looked for once it did, at most once per sample.

When a micro-batch's own loss or gradients hold NaN or Inf (:class:`NonFinite`),
or it drove an apply non-finite (:class:`Extreme`), the engine looks at its
samples the cheap way first: the samples whose inputs hold NaN or Inf (or
extreme values), the others computed once together to confirm; else each
other sample is computed alone (:func:`find`). A micro-batch whose compute
raised has each sample computed alone (:func:`failing`, :class:`Failing`).
A :class:`CulpritSearch` runs them over one backend and restores what these
computes assign, so the model is as before. Pure NumPy.

See docs/guides/inspecting.md for the search in detail.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from hostavg.core.errors import HostavgError, StepError, short
from hostavg.core.results import Culprit
from hostavg.core.split import arrays, take

__all__ = ["EXTREME", "NONE_FAILING", "Contribution", "CulpritSearch", "Extreme", "Failing",
           "NonFinite", "block_counts", "describe",
           "failing", "find", "in_inputs", "key_name", "refusal", "rows_of", "sample_arrays",
           "short"]

#: The names of a batch tuple's parts, by position.
PARTS = ("x", "y", "sample_weight")
#: How many culprits an error message lists (the exception's ``.culprits`` holds all).
LISTED = 10
#: How many non-finite positions within one sample's array a reason lists.
POSITIONS = 4


def key_name(path) -> str:
    """A feed's key in words: a placeholder's name without ``:0``, or ``x``, ``y``,
    ``sample_weight`` (and ``x['a']`` for a dict's key) in a batch tuple.

    Example:
      >>> key_name("x:0"), key_name((0, "image")), key_name((2,))
      ('x', "x['image']", 'sample_weight')
    """
    if isinstance(path, tuple):
        part = PARTS[path[0]] if path[0] < len(PARTS) else f"batch[{path[0]}]"
        return part + "".join(f"[{k!r}]" for k in path[1:])
    name = path if isinstance(path, str) else getattr(path, "name", None) or repr(path)
    return name.removesuffix(":0")


def sample_arrays(feed, n: int) -> dict:
    """path -> array of the feed laid out as (blocks, n, ...) per sample; HostavgError where an
    array's length is no multiple of ``n``, or the feed has no array."""
    found = arrays(feed)
    if not found:
        raise StepError("it holds no array (only scalars), so it cannot be cut into samples")
    uneven = {key_name(p): len(a) for p, a in found.items() if len(a) % n or not len(a)}
    if uneven:
        raise StepError(f"its arrays cannot be cut into its {n} samples (lengths {uneven})")
    return {path: a.reshape(len(a) // n, n, *a.shape[1:]) for path, a in found.items()}


def block_counts(laid: dict) -> dict:
    """path -> number of blocks of each array of :func:`sample_arrays`' ``laid`` that has more
    than one (what :func:`hostavg.core.split.take` cuts block by block)."""
    return {path: a.shape[0] for path, a in laid.items() if a.shape[0] > 1}


def in_inputs(feed, n: int, start: int, rows) -> tuple:
    """The :class:`~hostavg.core.results.Culprit` samples of ``feed`` (``n`` samples, the first
    the step's sample ``start``, of data ``rows`` or None) whose float inputs hold NaN or Inf,
    sorted; () when every input is finite."""
    return _in_inputs(sample_arrays(feed, n), n, start, rows)


def _in_inputs(laid: dict, n: int, start: int, rows) -> tuple:
    reasons = {}
    for path, blocks in laid.items():
        if blocks.dtype.kind not in "fc" or not blocks.size:
            continue
        bad = ~np.isfinite(blocks.reshape(blocks.shape[0], n, -1))
        if not bad.any():
            continue
        for j in np.flatnonzero(bad.any(axis=(0, 2))):
            for b in range(blocks.shape[0]):
                if bad[b, j].any():
                    name = key_name(path) + (f" (block {b})" if blocks.shape[0] > 1 else "")
                    reasons.setdefault(int(j), []).append(_holds(name, blocks[b, j]))
    return tuple(_culprit(j, start, rows, "; ".join(said)) for j, said in sorted(reasons.items()))


def _holds(name: str, value: np.ndarray) -> str:
    """``"x holds NaN in column 2"``: what is non-finite in one sample's ``value``, and where."""
    value = np.asarray(value)
    finite_or_nan = np.isfinite(value) | np.isnan(value)
    kinds = (("NaN", np.isnan(value)),
             ("Inf", ~finite_or_nan & (np.real(value) > 0)),
             ("-Inf", ~finite_or_nan & ~(np.real(value) > 0)))
    parts = [kind + _where(np.argwhere(mask)) for kind, mask in kinds if mask.any()]
    return f"{name} holds {' and '.join(parts)}"


def _where(positions: np.ndarray) -> str:
    """Where within a sample: nothing for a scalar, columns for a vector, indices beyond."""
    if positions.shape[1] == 0:
        return ""
    listed = [int(p[0]) if len(p) == 1 else [int(i) for i in p] for p in positions[:POSITIONS]]
    more = ", ..." if len(positions) > POSITIONS else ""
    if positions.shape[1] == 1:
        if len(positions) == 1:
            return f" in column {listed[0]}"
        return f" in {len(positions)} columns [{', '.join(map(str, listed))}{more}]"
    if len(positions) == 1:
        return f" at {listed[0]}"
    return f" at {len(positions)} entries [{', '.join(map(str, listed))}{more}]"


class NonFinite:
    """What :func:`find` looks for in a non-finite micro-batch: samples whose inputs hold NaN
    or Inf, else samples whose loss or gradients are non-finite alone.

    ``what`` says what the culprits did, ``none_alone`` (a format of ``how``) that none did.
    """

    what = "make it non-finite"
    none_alone = ("No sample of it is non-finite alone ({how}): only the micro-batch as a "
                  "whole, as with an op over the batch (batch norm in training mode) or a sum "
                  "over its samples that overflows.")

    def search(self, feed, n: int, start: int, rows, compute: Callable) -> tuple[tuple, str]:
        """The culprits of a micro-batch's ``feed`` and how they were found (:func:`find`)."""
        return find(feed, n, start, rows, compute, self)

    def inputs(self, laid: dict, n: int, start: int, rows) -> tuple:
        return _in_inputs(laid, n, start, rows)

    def clear(self, loss: float, sq_norm: float) -> bool:
        """Whether samples computed together are free of what is looked for."""
        return math.isfinite(loss) and math.isfinite(sq_norm)

    def reason(self, loss: float, sq_norm: float, others: list) -> str | None:
        """Why one sample computed alone is a culprit (None: it is not); ``others``: the other
        samples' squared gradient norms."""
        if not math.isfinite(loss):
            return "finite inputs, non-finite loss" + ("" if math.isfinite(sq_norm)
                                                       else " and gradients")
        return None if math.isfinite(sq_norm) else "finite inputs, finite loss, non-finite gradients"


class Extreme(NonFinite):
    """What :func:`find` looks for in the micro-batch that drove an apply non-finite: samples
    whose inputs hold values over :data:`EXTREME` times the other samples' (the median of each
    sample's largest magnitude) or NaN or Inf, else samples whose gradient norm is non-finite
    or over :data:`EXTREME` times the median of the others'.

    ``limit``: the largest gradient norm of the other samples together that clears them (the
    step's other micro-batches' largest times :data:`EXTREME`; inf where it had none).
    """

    what = "drove it"
    none_alone = ("No sample of it stands out alone ({how}): its gradient is large as a whole; "
                  "lower the learning rate, or clip the gradients (hostavg.hooks.ClipGlobalNorm).")

    def __init__(self, limit: float):
        self.limit = limit

    def inputs(self, laid: dict, n: int, start: int, rows) -> tuple:
        return _in_inputs(laid, n, start, rows) or _in_extremes(laid, n, start, rows)

    def clear(self, loss: float, sq_norm: float) -> bool:
        return super().clear(loss, sq_norm) and math.sqrt(sq_norm) <= self.limit

    def reason(self, loss: float, sq_norm: float, others: list) -> str | None:
        said = super().reason(loss, sq_norm, others)
        typical = math.sqrt(float(np.median(others))) if others else math.nan
        if said is None and math.sqrt(sq_norm) > EXTREME * typical:
            said = f"gradient norm {short(math.sqrt(sq_norm))}, the others' median {short(typical)}"
        return said


#: How many times larger than the other samples' a value or a gradient norm must be to stand
#: out as what drove an apply non-finite.
EXTREME = 1e6


def _in_extremes(laid: dict, n: int, start: int, rows) -> tuple:
    """The culprit samples whose float inputs hold a value over :data:`EXTREME` times the median
    over the other samples of their largest magnitude (of the same input), sorted."""
    reasons = {}
    for path, blocks in laid.items():
        if blocks.dtype.kind != "f" or not blocks.size or n < 2:
            continue
        size = np.abs(np.moveaxis(blocks, 1, 0).reshape(n, -1).astype(np.float64))
        peaks = size.max(axis=1)
        order = np.sort(peaks)
        for j in np.flatnonzero(peaks > EXTREME * order[(n - 1) // 2]):
            typical = np.median(np.delete(peaks, j))
            if peaks[j] > EXTREME * typical:
                values = np.moveaxis(blocks, 1, 0)[j].ravel()
                reasons.setdefault(int(j), []).append(
                    _large(key_name(path), values, size[j] > EXTREME * typical, blocks.ndim > 3))
    return tuple(_culprit(j, start, rows, "; ".join(said)) for j, said in sorted(reasons.items()))


def _large(name: str, values: np.ndarray, big: np.ndarray, deep: bool) -> str:
    """``"x holds 1e30 in 64 of 64 columns"``: the extreme entries of one sample's ``values``."""
    found = np.unique(values[big])
    what = short(found[0]) if len(found) == 1 else \
        f"values up to {short(np.abs(values[big]).max())} in magnitude"
    return f"{name} holds {what} in {int(big.sum())} of {big.size} {'entries' if deep else 'columns'}"


def find(feed, n: int, start: int, rows, compute: Callable,
         judge: NonFinite = NonFinite()) -> tuple[tuple, str]:
    """The culprit samples of a micro-batch's ``feed``, sorted, and how they were found.

    ``n`` samples, the first the step's sample ``start``, of data ``rows`` (or
    None). ``compute(part, size)`` computes a feed of ``size`` of them (cut with
    :func:`hostavg.core.split.take`) and gives (loss, squared gradient norm).
    ``judge`` says what a culprit is (:class:`NonFinite`, :class:`Extreme`).
    First the samples its inputs name; if there are any, the others are
    computed once together, and if the judge clears them that is all; else
    (and when no input is named) each of the others is computed alone. At most
    ``n + 1`` computes, none when every sample's inputs are named; the caller
    restores what they assign.
    """
    laid = sample_arrays(feed, n)
    blocks = block_counts(laid)
    found = judge.inputs(laid, n, start, rows)
    named = {c.sample - start for c in found}
    others = [j for j in range(n) if j not in named]
    if not found:
        how = f"computing each of its {n} samples alone"
    elif not others or judge.clear(*compute(take(feed, others, n, blocks), len(others))):
        return found, "in its inputs"
    else:
        how = f"in its inputs, then computing each of its {len(others)} others alone"
    alone = [compute(take(feed, [j], n, blocks), 1) for j in others]
    squares = [sq for _, sq in alone]
    for k, (j, (loss, sq_norm)) in enumerate(zip(others, alone)):
        said = judge.reason(loss, sq_norm, squares[:k] + squares[k + 1:])
        if said is not None:
            found += (_culprit(j, start, rows, said),)
    return tuple(sorted(found, key=lambda c: c.sample)), how


#: What an error says where no one sample of a micro-batch whose compute raised is to blame.
NONE_FAILING = "No one sample of it is to blame ({how})."


def failing(feed, n: int, start: int, rows, compute: Callable, refused: type) -> tuple[tuple, str]:
    """The samples of a micro-batch whose compute raised ``refused``, sorted, and how they were
    found: each computed alone (``compute(part, size)``), those that raise ``refused`` named.

    A lone sample is named without a compute; every sample is named where each fails alone
    (values out of range in every row). At most ``n`` computes; the caller restores what
    they assign.
    """
    if n == 1:
        return (_culprit(0, start, rows, "fails: the micro-batch's only sample"),), "at once"
    blocks = block_counts(sample_arrays(feed, n))
    found = []
    for j in range(n):
        try:
            compute(take(feed, [j], n, blocks), 1)
        except refused as e:
            found.append(_culprit(j, start, rows, f"fails alone: {refusal(e)}"))
    how = f"computing each of its {n} samples alone"
    return tuple(found), how + ("" if found else ", none fails")


def refusal(error: BaseException) -> str:
    """What the framework said refusing one sample: the first line of its own error (the
    cause of ``error``) with its type, shortened."""
    said = error.__cause__ or error
    line = (str(said).strip().splitlines() or [""])[0]
    return f"{type(said).__name__}: {line[:157] + '...' if len(line) > 160 else line}"


class Failing:
    """What :func:`failing` looks for in a micro-batch whose compute raised ``refused``: the
    samples that raise it alone."""

    what = "fail"
    none_alone = NONE_FAILING

    def __init__(self, refused: type):
        self.refused = refused

    def search(self, feed, n: int, start: int, rows, compute: Callable) -> tuple[tuple, str]:
        return failing(feed, n, start, rows, compute, self.refused)


class Contribution:
    """What a search of an outlier micro-batch looks for: the samples whose contribution, their
    loss or their gradient norm computed alone (a sample's weight included where the loss
    weighs it), is over ``factor`` times the median of the micro-batch's samples' and within
    ``factor`` of the largest (a row scaled by 1e4 is named, not the ordinary samples at 15x
    the median beside it); the largest first (by how many times the median). Each sample is
    computed alone: ``n`` computes."""

    what = "stand out"
    none_alone = "No sample of it stands out alone ({how}): it is large as a whole."

    def __init__(self, factor: float):
        self.factor = factor

    def search(self, feed, n: int, start: int, rows, compute: Callable) -> tuple[tuple, str]:
        laid = sample_arrays(feed, n)
        blocks = block_counts(laid)
        alone = [compute(take(feed, [j], n, blocks), 1) for j in range(n)]
        losses = np.array([loss for loss, _ in alone], np.float64)
        norms = np.sqrt(np.array([sq for _, sq in alone], np.float64))
        times = np.maximum(_times(losses), _times(norms))
        found = []
        for j in np.argsort(-times, kind="stable"):
            if not (times[j] > self.factor and times[j] * self.factor >= times.max()):
                break
            said = (f"loss {short(losses[j])}, {short(_times(losses)[j])}x the median; gradient "
                    f"norm {short(norms[j])}, {short(_times(norms)[j])}x the median"
                    + "".join(f"; {key_name(p)}'s largest value {short(_peak(a, j))}"
                              for p, a in laid.items() if a.dtype.kind == "f"))
            found.append(replace(_culprit(int(j), start, rows, said), loss=float(losses[j]),
                                 grad_norm=float(norms[j])))
        return tuple(found), f"computing each of its {n} samples alone"


def _times(values: np.ndarray) -> np.ndarray:
    """Each of ``values`` over their median (0 where the median is 0 or a value not finite)."""
    median = np.median(values)
    if not median > 0:
        return np.zeros_like(values)
    return np.nan_to_num(values / median, nan=0.0, posinf=0.0)


def _peak(blocks: np.ndarray, j: int) -> float:
    """Sample ``j``'s largest value by magnitude (signed) in an input laid as (blocks, n, ...)."""
    values = np.moveaxis(blocks, 1, 0)[j].ravel()
    return float(values[np.argmax(np.abs(values))]) if values.size else math.nan


class CulpritSearch:
    """Looks for the culprit samples of one backend's micro-batches, as a judge says
    (:class:`NonFinite`, :class:`Extreme`, :class:`Failing`).

    ``compute(feed, size, what)`` computes a part of a micro-batch, prepared by the
    backend (``what``: where, for its errors), and gives (loss, squared gradient norm).
    What the computes assign is restored once a search is done.
    """

    def __init__(self, backend, compute: Callable):
        self.backend, self.compute = backend, compute

    def find(self, batch, judge=NonFinite()) -> tuple[tuple, str]:
        """The culprit samples of micro-batch ``batch`` (a
        :class:`~hostavg.engine.batches.Prepared`), sorted, and how they were found."""
        snapshot = []

        def compute(part, size: int) -> tuple[float, float]:
            if not snapshot:
                snapshot.append(self.backend.snapshot())
            what = f"{batch.where}, looking at {size} of its samples"
            part, size = self.backend.prepare(part, size, what)
            return self.compute(part, size, what)

        try:
            return judge.search(batch.given, batch.size, batch.start, batch.rows, compute)
        finally:
            if snapshot:
                self.backend.restore(snapshot[0])

    def name(self, error: HostavgError, batch, judge=NonFinite()) -> None:
        """Adds the culprit samples of ``batch``, the micro-batch that failed the step, to its
        ``error``: lines in the message, ``.culprits`` and ``.culprit_rows`` (sorted data
        rows; [] where the rows are unknown); a note where the search fails."""
        try:
            found, how = self.find(batch, judge)
        except Exception as failed:  # noqa: BLE001 - the step's own error is the one to see
            error.add_note(f"hostavg: looking for the samples that {judge.what} failed "
                           f"({type(failed).__name__}: {failed})")
            return
        error.culprits, error.culprit_rows = found, rows_of(found)
        error.args = (f"{error.args[0]}{describe(found, how, judge.what, judge.none_alone)}",
                      *error.args[1:])


def _culprit(j: int, start: int, rows, reason: str) -> Culprit:
    return Culprit(start + j, None if rows is None else int(rows[j]), reason)


def describe(found: tuple, how: str, what: str = "make it non-finite",
             none: str = NonFinite.none_alone) -> str:
    """The lines an error gains: the culprits (a handful) that ``what``, or ``none`` (a format
    of ``how``) where there are none."""
    if not found:
        return "\n" + none.format(how=how)
    lines = [f"  {c}" for c in found[:LISTED]]
    if len(found) > LISTED:
        lines.append(f"  ... and {len(found) - LISTED} more (the exception's .culprits holds all)")
    return f"\nThe samples that {what}, found {how}:\n" + "\n".join(lines)


def rows_of(found: tuple) -> list:
    """The culprits' data rows, sorted ints; [] where the rows are unknown."""
    return sorted(c.row for c in found if c.row is not None)

