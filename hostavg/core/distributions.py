"""Distributions over time: nine percentiles per variable of a step's gradient, weights and update.

The percentiles are TensorBoard's (its Distributions view): the minimum,
mean -+ 1, 2 and 3 standard deviations of a normal distribution, the median
and the maximum. Computed with ``np.percentile`` (linear interpolation) in
float64 over every entry of a variable (a sparse gradient densified: the rows
it does not touch are zeros).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hostavg.core.errors import ArgumentError
from hostavg.core.gradients import SparseGradient
from hostavg.core.optional import pandas

__all__ = ["PERCENTILES", "QUANTITIES", "of_step", "percentiles", "table"]

#: TensorBoard's percentiles, in percent: 0, normal -3..+3 standard deviations, 100.
PERCENTILES = (0.0, 6.68, 15.87, 30.85, 50.0, 69.15, 84.13, 93.32, 100.0)
#: What a step's distributions are of: the applied mean gradient, the weights after the
#: apply, and the update (weights after minus before).
QUANTITIES = ("gradient", "weight", "update")


def percentiles(values) -> tuple:
    """The :data:`PERCENTILES` of every entry of ``values`` (an array or a SparseGradient)."""
    if isinstance(values, SparseGradient):
        values = values.to_dense()
    flat = np.ravel(np.asarray(values, np.float64))
    return tuple(np.percentile(flat, PERCENTILES).tolist()) if flat.size else (np.nan,) * 9


def of_step(mean: Mapping, weights: Mapping, updates: Mapping) -> dict:
    """quantity -> variable -> its :data:`PERCENTILES`, for one applied step."""
    return {quantity: {name: percentiles(value) for name, value in values.items()}
            for quantity, values in zip(QUANTITIES, (mean, weights, updates))}


def table(steps: Sequence[tuple], variable: str, quantity: str, where: str):
    """A pandas DataFrame indexed by step, one column per percentile, of ``(step,
    distributions or None)`` pairs (those without are left out); HostavgError naming
    ``where`` when the quantity is unknown, no step kept distributions, or the variable is
    not one of theirs."""
    if quantity not in QUANTITIES:
        raise ArgumentError(f"{where}: quantity must be one of {QUANTITIES}, got {quantity!r}")
    kept = [(step, d[quantity]) for step, d in steps if d]
    if not kept:
        raise ArgumentError(f"{where}: no step kept distributions; make the trainer with "
                            f"distributions_every=N (then every N-th step keeps them)")
    names = list(dict.fromkeys(n for _, d in kept for n in d))
    if variable not in names:
        raise ArgumentError(f"{where}: no variable {variable!r}; the trained variables are "
                            f"{names}")
    pd = pandas(where)
    rows = [(step, d[variable]) for step, d in kept if variable in d]
    return pd.DataFrame([list(v) for _, v in rows], columns=list(PERCENTILES),
                        index=pd.Index([s for s, _ in rows], name="step"))
