"""An apply that made the weights or the optimizer's state non-finite: what drove it, in words.

The backend checks, in the apply's own call, every trained variable and every
variable of the optimizer for NaN and Inf after the update, and undoes the
update where one is found (``Applied.nonfinite`` names them). The engine then
names the micro-batches that drove it (:func:`drivers`: those whose gradient,
weighted by their samples, stands out of the step's others by
:data:`~hostavg.engine.culprits.EXTREME`; where none does, those holding samples
that stand out of their micro-batch's others), and their culprit samples
(:class:`~hostavg.engine.culprits.Extreme`). Pure NumPy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hostavg.core.errors import HostavgError, StepError
from hostavg.core.gradients import freeze
from hostavg.engine import culprits

__all__ = ["LISTED", "Overflow", "drivers", "overflowed", "undone"]

#: How many names of non-finite variables an error lists.
LISTED = 6


class Overflow(NamedTuple):
    """A micro-batch that drove a try of a step's apply non-finite.

    Attributes:
      index: its position in the step.
      reason: what the apply made non-finite, and the drivers' gradient norms against the others'.
      culprits: its :class:`~hostavg.core.results.Culprit` samples (found as
        :class:`~hostavg.engine.culprits.Extreme`), sorted.
      error: the step's error, raised where no hook drops it when the step is tried again.
    """

    index: int
    reason: str
    culprits: tuple
    error: HostavgError


def drivers(result) -> tuple[list[int], str]:
    """The accumulated micro-batches of ``result`` whose contribution (samples times gradient
    norm) stands out, and their norms against the others' in words; ([], the norms) where none
    does.

    A contribution stands out where it is not finite, or is over
    :data:`~hostavg.engine.culprits.EXTREME` times the median of those that do not stand
    out: the finite ones sorted, the first that is over that many times the median of
    those below it stands out with every one above it (so that two bad micro-batches of
    like norms do not hide each other, as in a median of the others that holds the other);
    a step's only micro-batch drives it alone.
    """
    norms = result.stats.micro_norms
    kept = [m.index for m in result.micro if m.dropped is None]
    weight = {i: result.micro[i].size * norms[i] for i in kept}
    finite = sorted((i for i in kept if math.isfinite(weight[i])), key=weight.get)
    out = set(kept) if len(kept) == 1 else set(kept) - set(finite)
    for j in range(1, len(finite)):
        if weight[finite[j]] > culprits.EXTREME * float(np.median([weight[i] for i in finite[:j]])):
            out |= set(finite[j:])
            break
    if not out:
        listed = ", ".join(culprits.short(norms[i]) for i in kept[:8])
        return [], f"gradient norms {listed}{', ...' if len(kept) > 8 else ''}"
    return sorted(out), _driven(sorted(out), result)


def _driven(top: list, result) -> str:
    """``micro-batch 1 of 4: gradient norm 1e30, the others' at most 0.7``: the drivers ``top``
    of ``result`` and their norms against the other accumulated micro-batches'."""
    norms, k = result.stats.micro_norms, len(result.micro)
    rest = [norms[m.index] for m in result.micro if m.dropped is None and m.index not in top]
    said = (f"micro-batch {top[0]} of {k}: gradient norm {culprits.short(norms[top[0]])}"
            if len(top) == 1 else
            f"micro-batches {_and(map(str, top))} of {k}: gradient norms "
            f"{_and(culprits.short(norms[i]) for i in top)}")
    if rest:
        return f"{said}, the others' at most {culprits.short(max(rest))}"
    return f"{said}, the step's only one" if len(top) == 1 else f"{said}, all of the step's"


def _and(words) -> str:
    """``a, b and c``."""
    words = list(words)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _shown(names: tuple) -> str:
    """A handful of ``names``, quoted: ``'a', 'b' and 3 more``."""
    return ", ".join(map(repr, names[:LISTED])) + (
        f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def undone(where: str, names: tuple, before: str) -> str:
    """``where: it made 'a', 'b' non-finite (NaN or Inf), so it was undone: ...``: what an apply
    that made the variables ``names`` non-finite did; ``before``: what the state is as before
    (the step, the apply)."""
    return (f"{where}: it made {_shown(names)} non-finite (NaN or Inf), so it was undone: the "
            f"weights, the optimizer's state and the global step are as before the {before}.")


def overflowed(search: culprits.CulpritSearch, result, names: tuple, batches: list
               ) -> tuple[HostavgError, list[Overflow]]:
    """The error of a step whose apply made ``names`` non-finite (and was undone), and the
    :class:`Overflow` of each micro-batch that drove it ([] where none does); their culprit
    samples are looked for with ``search``. ``batches``: the step's micro-batches
    (:class:`~hostavg.engine.batches.Prepared`).

    Where no contribution stands out (:func:`drivers`), every accumulated micro-batch is
    looked into for samples that stand out of its others (at most one compute per sample
    and one more): those where some do drove it (several bad micro-batches of like norms,
    or every one).
    """
    what = undone("step, the apply", names, "step")
    top, said = drivers(result)
    norms = result.stats.micro_norms
    kept = [m.index for m in result.micro if m.dropped is None]
    others = [norms[i] for i in kept if i not in top]
    judge = culprits.Extreme(culprits.EXTREME * max(others) if top and others else math.inf)
    found, failed = {}, []
    for i in top or kept:
        try:
            found[i] = search.find(batches[i], judge)
        except Exception as e:  # noqa: BLE001 - the step's own error is the one to see
            failed.append(f"hostavg: looking for the samples of micro-batch {i} that drove it "
                          f"failed ({type(e).__name__}: {e})")
    if not top:
        top = [i for i in kept if i in found and found[i][0]]
        said = _driven(top, result) if top else said
    if not top:
        error = StepError(
            f"{what} No micro-batch stands out ({said}), nor a sample within one: the weights "
            f"or the optimizer's state grew over earlier steps; lower the learning rate, or "
            f"clip the gradients (hostavg.hooks.ClipGlobalNorm).")
        for note in failed:
            error.add_note(note)
        return error, []
    error = StepError(f"{what} It was driven by {said}." + "".join(
        _described(i, *found[i], several=len(top) > 1) for i in top if i in found))
    for note in failed:
        error.add_note(note)
    error.culprits = tuple(sorted((c for i in top if i in found for c in found[i][0]),
                                  key=lambda c: c.sample))
    error.culprit_rows = culprits.rows_of(error.culprits)
    if all(batches[i].rows is not None for i in top):
        error.rows = freeze(np.concatenate([batches[i].rows for i in top]))
    reason = f"it made {_shown(names)} non-finite ({said})"
    return error, [Overflow(i, reason, found[i][0] if i in found else (), error) for i in top]


def _described(index: int, found: tuple, how: str, several: bool) -> str:
    """The lines naming micro-batch ``index``'s culprits ``found`` (as :func:`culprits.describe`
    says them), headed by the micro-batch where ``several`` drove the apply."""
    lines = culprits.describe(found, how, culprits.Extreme.what, culprits.Extreme.none_alone)
    if not several:
        return lines
    return f"\nMicro-batch {index}: {lines[1].lower()}{lines[2:]}"
