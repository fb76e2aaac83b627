"""Which samples make a micro-batch non-finite: looked for once it was, at most once per sample.

When a micro-batch's own loss or gradients hold NaN or Inf, the engine looks
at its samples the cheap way first: :func:`in_inputs` names the samples
whose inputs hold NaN or Inf (the others computed once together to confirm);
else each other sample is computed alone (:func:`find`). The engine restores
what these computes assign, so the model is as before. If no sample is
non-finite alone, no sample is named. Pure NumPy.

See docs/guides/inspecting.md for the search in detail.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from hostavg.core.errors import HostavgError
from hostavg.core.results import Culprit
from hostavg.core.split import arrays, take

__all__ = ["describe", "find", "in_inputs", "key_name", "rows_of"]

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


def _samples(feed, n: int) -> dict:
    """path -> array of the feed laid out as (blocks, n, ...) per sample; HostavgError where an
    array's length is no multiple of ``n``, or the feed has no array."""
    found = arrays(feed)
    if not found:
        raise HostavgError("its feed holds no array (only scalars), so it cannot be cut into "
                           "samples")
    uneven = {key_name(p): len(a) for p, a in found.items() if len(a) % n or not len(a)}
    if uneven:
        raise HostavgError(f"its arrays cannot be cut into its {n} samples (lengths {uneven})")
    return {path: a.reshape(len(a) // n, n, *a.shape[1:]) for path, a in found.items()}


def in_inputs(feed, n: int, start: int, rows) -> tuple:
    """The :class:`~hostavg.core.results.Culprit` samples of ``feed`` (``n`` samples, the first
    the step's sample ``start``, of data ``rows`` or None) whose float inputs hold NaN or Inf,
    sorted; () when every input is finite."""
    return _in_inputs(_samples(feed, n), n, start, rows)


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


def find(feed, n: int, start: int, rows, compute: Callable) -> tuple[tuple, str]:
    """The culprit samples of a non-finite micro-batch's ``feed``, sorted, and how they were found.

    ``n`` samples, the first the step's sample ``start``, of data ``rows`` (or
    None). ``compute(part, size)`` computes a feed of ``size`` of them (cut with
    :func:`hostavg.core.split.take`) and gives (loss, squared gradient norm).
    First the samples whose inputs are non-finite (:func:`in_inputs`); if there
    are any, the others are computed once together, and if they are finite that
    is all; else (and when every input is finite) each of the others is computed
    alone. At most ``n + 1`` computes, none when every sample's inputs are bad;
    the caller restores what they assign.
    """
    laid = _samples(feed, n)
    blocks = {path: a.shape[0] for path, a in laid.items() if a.shape[0] > 1}
    found = _in_inputs(laid, n, start, rows)
    named = {c.sample - start for c in found}
    others = [j for j in range(n) if j not in named]
    if not found:
        how = f"computing each of its {n} samples alone"
    elif not others or all(map(math.isfinite, compute(take(feed, others, n, blocks), len(others)))):
        return found, "in its inputs"
    else:
        how = f"in its inputs, then computing each of its {len(others)} others alone"
    for j in others:
        loss, sq_norm = compute(take(feed, [j], n, blocks), 1)
        if not math.isfinite(loss):
            said = "non-finite loss" + ("" if math.isfinite(sq_norm) else " and gradients")
        elif not math.isfinite(sq_norm):
            said = "finite loss, non-finite gradients"
        else:
            continue
        found += (_culprit(j, start, rows, f"finite inputs, {said}"),)
    return tuple(sorted(found, key=lambda c: c.sample)), how


def _culprit(j: int, start: int, rows, reason: str) -> Culprit:
    return Culprit(start + j, None if rows is None else int(rows[j]), reason)


def describe(found: tuple, how: str) -> str:
    """The lines an error gains: the culprits (a handful), or that no sample is non-finite alone."""
    if not found:
        return (f"\nNo sample of it is non-finite alone ({how}): only the micro-batch as a "
                f"whole, as with an op over the batch (batch norm in training mode) or a sum "
                f"over its samples that overflows.")
    lines = [f"  {c}" for c in found[:LISTED]]
    if len(found) > LISTED:
        lines.append(f"  ... and {len(found) - LISTED} more (the exception's .culprits holds all)")
    return f"\nThe samples that make it non-finite, found {how}:\n" + "\n".join(lines)


def rows_of(found: tuple, rows) -> np.ndarray | None:
    """The culprits' data rows, sorted (a read-only int64 array); None where the rows are unknown."""
    if rows is None:
        return None
    out = np.sort(np.array([c.row for c in found], np.int64))
    out.flags.writeable = False
    return out

