"""Hessian-vector products of a batch's mean loss, accumulated over its micro-batches. Pure NumPy.

A product is linear in the loss, so the batch's is the sample-weighted mean of its
micro-batches' (``H v = sum_i n_i H_i v / sum_i n_i``, H_i the Hessian of micro-batch
i's mean loss), summed on the host in float64, as a step's gradients are. Every
product of one :class:`Operator` starts from the same state (the rollback snapshot:
moving statistics, the random layers' seed states), so the products of one call see
one operator; a backend whose random ops draw anew at every call refuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from hostavg.core import curvature
from hostavg.core.accumulator import Accumulator
from hostavg.core.curvature import Curvature, CurvatureSettings
from hostavg.core.errors import ArgumentError, HostavgError
from hostavg.core.gradients import Gradients, VariableSpec, check_finite, conform, freeze
from hostavg.engine.batches import Prepared
from hostavg.engine.protocols import Backend

__all__ = ["Operator", "StepBatch", "dense_spec", "measured"]


def dense_spec(spec: Mapping[str, VariableSpec]) -> dict:
    """``spec`` with every variable dense: what a vector and a product are given as."""
    return {name: s._replace(sparse=False) for name, s in spec.items()}


class Operator:
    """``v -> H v`` of one batch (``batches``, prepared) over ``backend``, within
    :meth:`~hostavg.engine.step.Engine.leaving_no_trace` (``snapshot``: its snapshot).

    Attributes:
      spec: every trained variable, dense.
      loss: the batch's sample-weighted mean loss, from the last product (None before).
    """

    def __init__(self, backend: Backend, batches: Sequence[Prepared], spec: Mapping, snapshot,
                 call: str):
        drawn = tuple(backend.random_ops())
        if drawn:
            names = ", ".join(f"{op.api} ({op.tensor!r})" for op in drawn)
            raise ArgumentError(
                f"{call}: the loss runs random ops that draw anew at every call ({names}), so "
                f"its Hessian-vector products would not be of one operator; measure the "
                f"curvature of a model built without them (dropout rate 0)")
        self.backend, self.batches, self.snapshot, self.call = backend, batches, snapshot, call
        self.spec = dense_spec(spec)
        self._total = float(sum(b.size for b in batches))
        self.loss = None

    def vector(self, vectors: Mapping) -> dict:
        """``vectors`` checked (the trained variables' names and shapes, finite; a
        SparseGradient densified) and cast to float64."""
        values = conform(self.spec, vectors, what=f"{self.call}: vectors", cast=True)
        check_finite(values, f"{self.call}: vectors")
        return {name: np.asarray(v, np.float64) for name, v in values.items()}

    def __call__(self, vector: Mapping) -> dict:
        """name -> H v (float64) of the batch, for ``vector`` (name -> float64 array)."""
        self.backend.restore(self.snapshot)  # one state, so one operator, for every product
        sums = {name: np.zeros(s.shape) for name, s in self.spec.items()}
        loss = 0.0
        for batch in self.batches:
            try:
                value, product = self.backend.hvp(batch.feed, vector)
            except HostavgError as e:
                raise type(e)(f"{self.call}, {batch.where}: {e}") from e.__cause__
            loss += batch.size * float(value)
            for name, p in product.items():
                sums[name] += batch.size * np.asarray(p, np.float64)
        self.loss = loss / self._total
        return {name: s / self._total for name, s in sums.items()}

    def gradients(self, product: Mapping) -> Gradients:
        """``product`` as the variables' dtypes: read-only, with the batch's loss and size."""
        return Gradients({name: freeze(np.asarray(p, self.spec[name].dtype))
                          for name, p in product.items()}, loss=self.loss, size=self._total)


def measured(product: Operator, settings: CurvatureSettings) -> Curvature:
    """The :class:`~hostavg.core.curvature.Curvature` of ``product``'s batch, with its loss."""
    spec = product.spec
    found = curvature.measure(lambda v: curvature.flat(spec, product(curvature.unflat(spec, v))),
                              spec, settings)
    return replace(found, loss=product.loss)


class StepBatch:
    """A step's own micro-batches at the weights as they are, for the hooks that measure on
    them (``on_step_batch`` before the apply, ``on_applied_batch`` after it).

    Each measurement leaves what the micro-batches' forward passes assign (moving
    statistics, seed states) as it found it, and changes no weight.
    """

    def __init__(self, backend: Backend, batches: Sequence[Prepared], spec: Mapping, compute):
        self._backend, self._batches, self._spec, self._compute = backend, batches, spec, compute

    def curvature(self, **settings) -> Curvature:
        """The batch's :class:`~hostavg.Curvature` (``trainer.curvature``'s keywords)."""
        checked = CurvatureSettings(**settings)
        snapshot = self._backend.snapshot()
        try:
            return measured(Operator(self._backend, self._batches, self._spec, snapshot,
                                     "curvature"), checked)
        finally:
            self._backend.restore(snapshot)

    def gradient(self) -> Gradients:
        """The batch's sample-weighted mean gradient (float64), with its loss, at the weights now."""
        snapshot = self._backend.snapshot()
        acc = Accumulator(self._spec, accum_dtype=np.float64)
        try:
            for batch in self._batches:
                g = self._compute(batch)
                acc.add(g)
        finally:
            self._backend.restore(snapshot)
        return acc.mean()
