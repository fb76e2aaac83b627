"""Built-in trainer hooks that steer a step: skip non-finite micro-batches, clip.

The hooks that write what happened, :class:`~hostavg.inspect.record.Record`
and :class:`~hostavg.inspect.tensorboard.TensorBoard`, live in
:mod:`hostavg.inspect`; ``hostavg.hooks`` holds them all.

A hook is any object with some of ``on_micro_batch(micro)``,
``on_step(mean, result)`` and ``on_applied(result)``
(:class:`hostavg.core.results.Hook`); pass them as ``hostavg.Trainer(...,
hooks=[...])``. Everything a hook is given is read-only: to change
gradients, return new ones. Pure NumPy: TensorFlow is imported only when a
:class:`TensorBoard` hook writes its first step. They run in the order given;
:class:`Record` and :class:`TensorBoard` write in ``on_applied``, so they
record what was applied wherever they are listed (a :class:`Record` listed
after a hook that replaces micro-batch gradients stores the replacements).
"""

from __future__ import annotations

import math

import numpy as np

from hostavg.core.errors import positive_number
from hostavg.core.gradients import SparseGradient, nonfinite_entries
from hostavg.core.results import Drop

__all__ = ["ClipGlobalNorm", "ClipMicroBatchNorm", "Drop", "SkipNonFinite"]


class SkipNonFinite:
    """Drops micro-batches whose loss or gradients hold NaN or Inf, or whose contribution made
    the step's apply non-finite (``MicroBatch.overflows``), instead of raising.

    The step goes on with the others (sample-weighted as usual; a step whose
    apply went non-finite is tried again without the micro-batch that drove
    it); the dropped ones are in ``result.dropped`` with the reason in
    ``micro[i].dropped``. If every micro-batch is dropped the step is skipped:
    nothing is applied, the global step stays, and ``result.skipped`` says so.
    ``fit`` stops with an error naming the rows once every micro-batch of
    5 steps in a row (``hostavg.train.loop.EMPTY_STEPS``) was dropped.
    """

    def on_micro_batch(self, record):
        if record.overflows is not None:
            return Drop(f"its contribution made the apply non-finite: {record.overflows}")
        grads = record.grads
        parts = []
        bad = [name for name, v in grads.items()
               if any(nonfinite_entries(v, grads.sq_norms.get(name)))]
        if bad:
            parts.append("gradients in " + ", ".join(map(repr, bad)))
        if not math.isfinite(record.loss):
            parts.append(f"loss {record.loss}")
        return Drop("non-finite " + " and ".join(parts)) if parts else None


def _scaled(grads, factor: float) -> dict:
    return {name: SparseGradient(v.indices, v.values * factor, v.dense_shape)
            if isinstance(v, SparseGradient) else np.asarray(v) * factor
            for name, v in grads.items()}


class ClipMicroBatchNorm:
    """Scales each micro-batch's gradients to global norm at most ``max_norm`` before accumulation.

    This is the per-micro-batch clipping of differentially private training
    (with noise added separately). The norms before clipping are reported in
    ``result.info["micro_norms_before_clip"]``, one per micro-batch in step
    order, NaN for a micro-batch that an earlier hook dropped; tables
    (``micro_table``) and :func:`hostavg.plot.micro_norms` show them beside
    the clipped norms.
    """

    def __init__(self, max_norm: float):
        self.max_norm = positive_number("max_norm", max_norm)
        self._norms, self._step = {}, None

    def on_micro_batch(self, record):
        if record.step != self._step or record.index in self._norms:  # a new step, or a retry
            self._norms, self._step = {}, record.step
        norm = record.grads.global_norm()
        self._norms[record.index] = norm
        if norm > self.max_norm:
            return _scaled(record.grads, self.max_norm / norm)
        return None

    def on_step(self, mean, result):
        result.info["micro_norms_before_clip"] = tuple(self._norms.get(m.index, math.nan)
                                                       for m in result.micro)


class ClipGlobalNorm:
    """Scales the mean gradient to global norm at most ``max_norm`` before it is applied.

    The norm before clipping is reported in ``result.info["grad_norm_before_clip"]``;
    ``result.stats.grad_norm`` is the norm applied.
    """

    def __init__(self, max_norm: float):
        self.max_norm = positive_number("max_norm", max_norm)

    def on_step(self, mean, result):
        norm = mean.global_norm()
        result.info["grad_norm_before_clip"] = norm
        return _scaled(mean, self.max_norm / norm) if norm > self.max_norm else None
