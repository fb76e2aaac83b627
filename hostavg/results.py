"""What a step hands back, and what hooks see and return: pure data, no TensorFlow.

A hook is any object with ``on_micro_batch(micro)`` and/or
``on_step(mean, result)`` (see :class:`Hook`). Every array reachable from
these objects is read-only (see :mod:`hostavg.gradients`): to change a
gradient, return a new mapping from the hook.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from hostavg.errors import HostavgError
from hostavg.gradients import Gradients
from hostavg.stats import StepStats

__all__ = ["Drop", "Hook", "MicroBatch", "StepResult"]


@dataclass(frozen=True)
class Drop:
    """Returned by a hook's ``on_micro_batch``: leave this micro-batch out of the step.

    Attributes:
      reason: recorded as the micro-batch's ``dropped``.
    """

    reason: str = "dropped by a hook"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step; hooks receive it before it is accumulated.

    Attributes:
      index: its position in the step, from 0.
      size: its number of samples (its weight in the mean).
      loss: its mean loss.
      grads: its :class:`Gradients`. Hooks always see them; on a StepResult
        they are kept in ``accumulate="stack"`` and None in "sum", which keeps
        no per-micro-batch gradients.
      start: the index of its first sample within the step's samples
        (it covered samples start:start + size).
      step: the global step the step will have after its apply.
      dropped: why a hook dropped it (see :class:`hostavg.hooks.Drop`), or None.
    """

    index: int
    size: int
    loss: float
    grads: Gradients | None
    start: int = 0
    step: int = 0
    dropped: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
      loss: the sample-weighted mean loss over the accumulated micro-batches,
        sum_i n_i loss_i / sum_i n_i (None if the step was skipped).
      grads: the :class:`Gradients` that were applied (None if skipped).
      micro: one :class:`MicroBatch` per micro-batch, in order, dropped ones too.
      step: the global step after the apply (unchanged if skipped).
      size: samples accumulated, sum_i n_i over micro-batches not dropped.
      stats: the step's :class:`~hostavg.stats.StepStats` (``grad_norm`` NaN
        and no estimates if skipped).
      skipped: why nothing was applied (every micro-batch was dropped), or None.
      info: what hooks reported, by key (e.g. norms before clipping).
    """

    loss: float | None
    grads: Gradients | None
    micro: tuple
    step: int
    size: int
    stats: StepStats | None = None
    skipped: str | None = None
    info: dict = field(default_factory=dict)

    @property
    def dropped(self) -> tuple:
        """Indices of the micro-batches that hooks dropped."""
        return tuple(m.index for m in self.micro if m.dropped is not None)

    def micro_table(self):
        """A pandas DataFrame, one row per micro-batch: index, start, size, loss, norm, cosine, dropped.

        ``cosine`` (with the mean) is filled in "stack" mode only.
        """
        try:
            import pandas as pd
        except ImportError:
            raise HostavgError("micro_table needs pandas: pip install pandas") from None
        cos = iter(self.stats.cosines) if self.stats and self.stats.cosines else None
        norms = self.stats.micro_norms if self.stats else [math.nan] * len(self.micro)
        return pd.DataFrame([{
            "index": m.index, "start": m.start, "size": m.size, "loss": m.loss, "norm": norm,
            "cosine": next(cos) if cos is not None and m.dropped is None else math.nan,
            "dropped": m.dropped} for m, norm in zip(self.micro, norms)]).set_index("index")


class Hook(Protocol):
    """What a trainer calls during a step; a hook has either method or both.

    ``on_micro_batch(micro)`` gets each :class:`MicroBatch`, with its
    gradients, before it is accumulated, and returns None (keep it), a
    mapping of replacement gradients, or a :class:`Drop`.
    ``on_step(mean, result)`` gets the mean :class:`Gradients` and the
    :class:`StepResult` before the apply, and returns None or a replacement
    mean. Hooks run in the order given; an exception raised in a hook
    propagates as it is, with a note naming the hook and the micro-batch, and
    nothing is applied.
    """

    def on_micro_batch(self, micro: MicroBatch) -> Mapping | Drop | None: ...

    def on_step(self, mean: Gradients, result: StepResult) -> Mapping | None: ...
