"""The curvature instrument: :class:`Curvature`, a hook measuring each N-th step's own batch.

What it reports goes into ``result.info`` and, declared once in
:mod:`hostavg.core.schema`, reaches History, the Record, TensorBoard and
:func:`hostavg.plot.curvature`. Pure NumPy: the products come from the step's
backend through the :class:`~hostavg.engine.products.StepBatch` the engine hands it.
"""

from __future__ import annotations

import math

import numpy as np

from hostavg.core import curvature
from hostavg.core.curvature import CurvatureSettings
from hostavg.core.errors import positive_int

__all__ = ["Curvature"]


class Curvature:
    """Measures each ``every``-th step on its own batch, before its apply, and where it landed.

    Per measured step, in ``result.info`` (None in History on other steps):

    * ``hessian_trace``, ``hessian_top_eigenvalue``: tr H (Hutchinson) and the eigenvalue
      of largest magnitude lambda (Lanczos) of the step's mean loss at its weights
      (:meth:`~hostavg.train.trainer.BaseTrainer.curvature`, of these keywords);
    * ``sharpness``: lambda * lr / 2. Above 1, gradient descent at rate lr diverges along
      the top direction (the edge of stability: Cohen et al., 2021). For momentum or an
      adaptive optimizer (Adam) the update is not lr * g, so 1 is not its threshold: read
      its trend only;
    * ``alpha``: Cockpit's step quality (:func:`~hostavg.core.curvature.step_quality`) from
      the loss and directional derivative g . u along the update u before the step and
      after it, on the same batch: -1 stays, 0 lands at the minimum, +1 overshoots;
    * ``distance``: |w - w0| after the apply, w0 the weights before the first step this
      hook saw in ``fit`` (or at all); ``update_norm``: |u|.

    Cost of a measured step: ``trace_samples`` + up to ``iterations`` Hessian-vector
    products of the batch (about two computes each), two more compute passes (the
    gradient before and after the apply), and the apply returns the weights. Over MPI
    (``comm=``) each rank measures its own micro-batches.
    """

    def __init__(self, every: int = 1, *, trace_samples: int = 16, top: int = 1,
                 iterations: int = 20, tolerance: float = 1e-3, seed: int = 0):
        self.every = positive_int("every", every)
        self.settings = CurvatureSettings(trace_samples, positive_int("top", top), iterations,
                                          tolerance, seed)
        self._start = None  # the weights before the first step seen (float64)
        self._before = None  # (the gradient and loss, the top eigenvalue) before the apply

    def on_train_begin(self) -> None:
        self._start = None

    def on_step_batch(self, batch, result):
        """Measures before the apply; {} on a first step off the schedule (its weights kept
        as the start), None on others."""
        if result.step % self.every:
            return None if self._start is not None else {}
        found = batch.curvature(**vars(self.settings))
        self._before = (batch.gradient(), found.top_eigenvalues[0])
        return {"hessian_trace": found.trace, "hessian_top_eigenvalue": found.top_eigenvalues[0]}

    def on_applied_batch(self, batch, result):
        """Measures after the apply: sharpness, alpha and distances."""
        u = {name: np.asarray(v, np.float64) for name, v in result.updates.items()}
        if self._start is None:
            self._start = {name: np.asarray(w, np.float64) - u[name]
                           for name, w in result.weights.items()}
        if result.step % self.every:
            return None
        (g0, top), self._before = self._before, None
        g1 = batch.gradient()
        names = list(u)
        along = curvature.flat(names, u)
        lr = result.learning_rate
        return {"sharpness": math.nan if lr is None else top * lr / 2,
                "alpha": curvature.step_quality(g0.loss, float(curvature.flat(names, g0) @ along),
                                                g1.loss, float(curvature.flat(names, g1) @ along)),
                "distance": float(np.linalg.norm(curvature.flat(names, result.weights)
                                                 - curvature.flat(names, self._start))),
                "update_norm": float(np.linalg.norm(along))}
