"""An apply that made the weights or the optimizer's state non-finite: what drove it, in words.

The backend checks, in the apply's own call, every trained variable and every
variable of the optimizer for NaN and Inf after the update, and undoes the
update where one is found (``Applied.nonfinite`` names them). The engine then
names the micro-batch that drove it (the one whose gradient, weighted by its
samples, stands out of the step's others by :data:`~hostavg.engine.culprits.EXTREME`),
and its culprit samples (:class:`~hostavg.engine.culprits.Extreme`). Pure NumPy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hostavg.core.errors import HostavgError, StepError
from hostavg.engine import culprits

__all__ = ["LISTED", "Overflow", "driver", "overflowed"]

#: How many names of non-finite variables an error lists.
LISTED = 6


class Overflow(NamedTuple):
    """The micro-batch that drove a try of a step's apply non-finite.

    Attributes:
      index: its position in the step.
      reason: what the apply made non-finite, and its gradient norm against the others'.
      culprits: its :class:`~hostavg.core.results.Culprit` samples (found as
        :class:`~hostavg.engine.culprits.Extreme`), sorted.
      error: the step's error, raised where no hook drops it when the step is tried again.
    """

    index: int
    reason: str
    culprits: tuple
    error: HostavgError


def driver(result) -> tuple[int | None, str]:
    """The accumulated micro-batch of ``result`` whose contribution (samples times gradient
    norm) stands out of the others' by :data:`~hostavg.engine.culprits.EXTREME` (or the only
    one), and its norm against the others' in words; (None, the norms) where none does."""
    norms = result.stats.micro_norms
    kept = [m.index for m in result.micro if m.dropped is None]
    weight = {i: result.micro[i].size * norms[i] for i in kept}
    top = max(kept, key=lambda i: (not math.isfinite(weight[i]), weight[i]))
    rest = [norms[i] for i in kept if i != top]
    said = f"micro-batch {top} of {len(result.micro)}: gradient norm {culprits.short(norms[top])}"
    if not rest:
        return top, f"{said}, the step's only one"
    typical = float(np.median([result.micro[i].size * norms[i] for i in kept if i != top]))
    against = f"the others' at most {culprits.short(max(rest))}"
    if weight[top] > culprits.EXTREME * typical or not math.isfinite(weight[top]):
        return top, f"{said}, {against}"
    listed = ", ".join(culprits.short(norms[i]) for i in kept[:8])
    return None, f"gradient norms {listed}{', ...' if len(kept) > 8 else ''}"


def overflowed(search: culprits.CulpritSearch, result, names: tuple, batches: list
               ) -> tuple[HostavgError, Overflow | None]:
    """The error of a step whose apply made ``names`` non-finite (and was undone), and the
    :class:`Overflow` of the micro-batch that drove it (None where none stands out); its
    culprit samples are looked for with ``search``. ``batches``: the step's micro-batches
    (:class:`~hostavg.engine.batches.Prepared`)."""
    shown = ", ".join(map(repr, names[:LISTED])) + (
        f" and {len(names) - LISTED} more" if len(names) > LISTED else "")
    what = (f"step, the apply: it made {shown} non-finite (NaN or Inf), so it was undone: the "
            f"weights, the optimizer's state and the global step are as before the step.")
    top, said = driver(result)
    if top is None:
        return StepError(
            f"{what} No micro-batch stands out ({said}): the weights or the optimizer's state "
            f"grew over earlier steps; lower the learning rate, or clip the gradients "
            f"(hostavg.hooks.ClipGlobalNorm)."), None
    error = StepError(f"{what} It was driven by {said}.")
    norms = result.stats.micro_norms
    others = [norms[m.index] for m in result.micro if m.dropped is None and m.index != top]
    search.name(error, batches[top],
                culprits.Extreme(culprits.EXTREME * max(others) if others else math.inf))
    if batches[top].rows is not None:
        error.rows = batches[top].rows
    return error, Overflow(top, f"it made {shown} non-finite ({said})", error.culprits, error)
