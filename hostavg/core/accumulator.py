"""The host accumulator: a running sum or a stack of micro-batch gradients.

Pure NumPy. The mean it returns is sample-weighted::

    mean = sum_i w_i * g_i / sum_i w_i

where g_i is the gradient of micro-batch i's MEAN loss and w_i its weight
(by default its number of samples). With w_i = n_i this is exactly the
gradient of the mean loss over the concatenated batch.

Dense values are accumulated in ``accum_dtype``, in the order added, kept as
``s * buffer`` with s the largest weight so far, so that no weight can
overflow the sum; "sum" and "stack" run the same arithmetic
(:class:`RunningSum`) and give bit-identical means. Sparse rows are kept as
they come and summed once, in :meth:`Accumulator.mean`.

See docs/explanation/computes.md for the numerics in detail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from hostavg.core.dtypes import accumulation_dtype, arithmetic
from hostavg.core.errors import ArgumentError, positive_number
from hostavg.core.gradients import (Gradients, SparseGradient, VariableSpec, check_finite, coalesce_rows,
                               conform, freeze, is_frozen, sorted_unique)

__all__ = ["ACCUMULATE_MODES", "Accumulator", "Reduction", "RunningSum", "aligned_empty",
           "as_accum_dtype", "numpy_reduce", "stack_sum", "weighted_rows"]

#: "sum": a running sum, host memory O(parameters) whatever the number of
#: micro-batches. "stack": every micro-batch's gradients are kept (for
#: inspection), memory grows linearly with the number of micro-batches.
ACCUMULATE_MODES = ("sum", "stack")


class Reduction(NamedTuple):
    """What an accumulator hands to a reducer to turn into a mean.

    Exactly one of ``sums`` and ``stacks`` holds the dense variables.

    Attributes:
      total: sum of the weights, sum_i w_i.
      weights: (k,) float64, the weights in the order they were added.
      scale: the largest weight, s = max_i w_i (None while nothing was added).
      sums: "sum" mode: name -> (sum_i w_i g_i) / scale (in the accumulation
        dtype, or g_1 itself while it is the only one).
      stacks: "stack" mode: name -> [g_1, ..., g_k] as added.
      rows: sparse variables: name -> (indices (n,), values (n, ...),
        row_weights (n,)), every micro-batch's rows one after the other,
        row_weights[j] the weight of row j's micro-batch divided by scale (at
        most 1); the mean's row for index r is the sum of row_weights[j] *
        values[j] over j with indices[j] == r, times scale / total.
      dtypes: name -> accumulation dtype.
    """

    total: float
    weights: np.ndarray
    scale: float
    sums: dict
    stacks: dict
    rows: dict
    dtypes: dict


Reducer = Callable[[Reduction], dict]


def numpy_reduce(r: Reduction) -> dict:
    """The host reducer: the mean of a :class:`Reduction` with NumPy.

    Returns name -> dense mean, or for a sparse variable (sorted unique
    indices, their mean rows).
    """
    factor = r.scale / r.total
    sums = {**r.sums, **{name: stack_sum(gs, r.weights, r.dtypes[name])
                         for name, gs in r.stacks.items()}}
    out = {name: _scaled(s, factor, r.dtypes[name]) for name, s in sums.items()}
    alone = len(r.weights) == 1 and r.weights[0] == r.total  # one micro-batch: its rows are the mean
    for name, (indices, values, row_weights) in r.rows.items():
        if alone and values.dtype == r.dtypes[name]:
            out[name] = coalesce_rows(indices, values)  # as they are when already coalesced
            continue
        unique, summed = weighted_rows(indices, values, row_weights, r.dtypes[name])
        out[name] = (unique, np.multiply(summed, factor, out=summed))
    return out


def _scaled(s: np.ndarray, factor: float, dtype) -> np.ndarray:
    """``s * factor`` in ``dtype`` as a new array; ``s`` itself where that is the same and it
    cannot change (one micro-batch: its frozen gradient is the mean)."""
    if factor == 1.0 and s.dtype == dtype and is_frozen(s):
        return s
    return np.multiply(s, factor, out=aligned_empty(s.shape, dtype), dtype=dtype)


def stack_sum(gs: list, weights, dtype) -> np.ndarray:
    """(sum_i w_i g_i) / w_1 of stacked micro-batch gradients, with :class:`RunningSum`'s arithmetic."""
    running = RunningSum(np.empty(gs[0].shape, dtype))
    for g, w in zip(gs, weights):
        running.add(g, float(w))
    return running.value


def weighted_rows(indices, values, row_weights, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique row indices and sum_j row_weights[j] * values[j] for each, in ``dtype``."""
    weighted = values.astype(dtype) * np.asarray(row_weights).astype(dtype).reshape(
        (-1,) + (1,) * (values.ndim - 1))
    return coalesce_rows(indices, weighted)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an ``align``-byte boundary.

    TensorFlow takes a fed array without copying it only when it is aligned
    like its own tensors (64 bytes); NumPy guarantees 16. What the copy costs an
    apply: docs/explanation/performance.md, "Choices on the host".
    """
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(map(int, shape))  # Python ints
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + align, np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset:offset + size].view(dtype).reshape(shape)


class RunningSum:
    """sum_i w_i g_i of one dense variable, kept as ``scale * value`` in a reused buffer.

    The scale is the largest weight added so far. The first micro-batch sets
    it (its weight); a first array hostavg froze (as the session returns
    them) is not even copied, since it cannot change: the second add writes
    ``g_1 + g_2`` into the buffer. A weight equal to the scale then costs one
    pass (an add); a smaller one multiplies by ``w / scale`` (< 1) into a
    scratch buffer first; a larger one rescales the sum by ``scale / w`` (< 1)
    and becomes the scale. Arithmetic runs in the buffer's dtype (values of an
    ml_dtypes type are converted to it first).

    Attributes:
      scale: the largest weight added, or None while empty.
    """

    def __init__(self, buffer: np.ndarray, scratch: _Scratch | None = None):
        self._buffer, self._scratch = buffer, scratch or _Scratch()
        self.reset()

    def reset(self) -> None:
        self.scale = None
        self._first = None

    @property
    def value(self) -> np.ndarray:
        """(sum_i w_i g_i) / scale."""
        return self._buffer if self._first is None else self._first

    def add(self, g: np.ndarray, w: float) -> None:
        buf = self._buffer
        g = arithmetic(g, buf.dtype)
        if self.scale is None:
            self.scale = w
            if is_frozen(g):
                self._first = g
            else:  # the caller may change it later: keep a copy
                np.copyto(buf, g, casting="same_kind")
            return
        base, self._first = self.value, None
        if w > self.scale:  # the sum in units of the new, larger weight: no factor exceeds 1
            np.multiply(base, self.scale / w, out=buf, dtype=buf.dtype, casting="same_kind")
            base, self.scale = buf, w
        if w == self.scale:
            np.add(base, g, out=buf, dtype=buf.dtype, casting="same_kind")
        else:
            tmp = self._scratch.like(buf)
            np.multiply(g, w / self.scale, out=tmp, dtype=buf.dtype, casting="same_kind")
            np.add(base, tmp, out=buf, dtype=buf.dtype, casting="same_kind")


class _Scratch:
    """A buffer made on first need (unequal weights only) and reused for arrays up to its size."""

    def __init__(self):
        self._flat = {}

    def like(self, array: np.ndarray) -> np.ndarray:
        flat = self._flat.get(array.dtype)
        if flat is None or flat.size < array.size:
            flat = self._flat[array.dtype] = np.empty(array.size, array.dtype)
        return flat[:array.size].reshape(array.shape)


class Accumulator:
    """Adds micro-batch gradients on the host and returns their weighted mean.

    Args:
      spec: name -> :class:`VariableSpec` of every trained variable, usually
        ``trainer.spec``; every added gradient must have exactly these keys.
      accumulate: one of :data:`ACCUMULATE_MODES`.
      accum_dtype: the dtype sums are kept in; None keeps each variable's dtype
        (float32 for bfloat16 and float8 variables:
        :func:`~hostavg.core.dtypes.accumulation_dtype`).
      reducer: turns a :class:`Reduction` into the mean; default
        :func:`numpy_reduce` (a trainer with ``average="graph"`` passes one that
        runs in its session).

    What is added is owned by the accumulator from then on (a copy where
    hostavg did not freeze it); see docs/explanation/ownership.md.

    Attributes:
      count: micro-batches added since construction or :meth:`reset`.
      total_weight: sum of their weights.
      weights: their weights, in order.
      sq_norms: their gradients' squared L2 norms, in order (computed anyway,
        by the finiteness check; the statistics use them).

    Example:
      >>> spec = {"w": VariableSpec((2,), np.dtype("float32"), False)}
      >>> acc = Accumulator(spec)
      >>> acc.add({"w": np.array([1.0, 2.0])}, weight=1)
      >>> acc.add({"w": np.array([4.0, 8.0])}, weight=3)
      >>> acc.mean()["w"]
      array([3.25, 6.5 ], dtype=float32)
    """

    def __init__(self, spec: Mapping[str, VariableSpec], *, accumulate: str = "sum",
                 accum_dtype=None, reducer: Reducer | None = None):
        if accumulate not in ACCUMULATE_MODES:
            raise ArgumentError(
                f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
        if not spec:
            raise ArgumentError("spec is empty: there is no variable to accumulate")
        self.spec = dict(spec)
        self.accumulate = accumulate
        self.accum_dtype = as_accum_dtype(accum_dtype)
        self._dtypes = {n: accumulation_dtype(s.dtype, self.accum_dtype)
                        for n, s in self.spec.items()}
        self._reduce = reducer or numpy_reduce
        dense = [n for n, s in self.spec.items() if not s.sparse]
        scratch = _Scratch()
        self._sums = {name: RunningSum(buf, scratch) for name, buf in
                      _views(dense, self.spec, self._dtypes).items()} if accumulate == "sum" else {}
        self._touched = True
        self.reset()

    def reset(self) -> None:
        """Forgets every added micro-batch; keeps the buffers for reuse."""
        if not self._touched:
            return  # as reset already: nothing was added since, nor begun to be
        self.count = 0
        self.total_weight = 0.0
        self.weights: list[float] = []
        self.sq_norms: list[float] = []
        for running in self._sums.values():
            running.reset()
        self._loss_sum = 0.0
        self._losses_known = True
        self._stacks = {n: [] for n, s in self.spec.items() if not s.sparse} \
            if self.accumulate == "stack" else {}
        self._rows = {n: [] for n, s in self.spec.items() if s.sparse}
        self._first = None
        self._touched = False

    def add(self, grads: Mapping, weight: float | None = None) -> None:
        """Adds one micro-batch's gradients with weight ``weight``.

        Args:
          grads: name -> gradient, exactly the spec's names; a
            :class:`Gradients` from ``trainer.compute`` or any mapping.
          weight: how much this micro-batch counts; default ``grads.size``, its
            number of samples. A real number, finite and > 0; the total of
            the weights must be finite too (only their ratios matter).

        Raises:
          HostavgError: naming the micro-batch (its index in this accumulator)
            and the variables, for a bad weight, missing or extra keys, a wrong
            shape or dtype, or non-finite values or loss. Nothing is added then.
        """
        what = f"micro-batch {self.count}"
        if weight is None:
            weight = getattr(grads, "size", None)
            if weight is None:
                raise ArgumentError(
                    f"{what}: no weight given and the gradients carry no size; "
                    f"pass acc.add(grads, weight=number_of_samples)")
        weight = positive_number(f"{what}: weight", weight)
        if math.isinf(self.total_weight + weight):
            raise ArgumentError(
                f"{what}: weight {weight!r} takes the total weight past float64's range "
                f"({self.total_weight!r} so far); only the weights' ratios matter: scale them down")
        loss = getattr(grads, "loss", None)
        values = conform(self.spec, grads, what=what)
        sq_norm = check_finite(values, what, loss, getattr(grads, "sq_norms", None))
        self.add_checked(values, weight, loss, sq_norm)

    def add_checked(self, values: dict, weight: float, loss: float | None, sq_norm: float) -> None:
        """Adds ``values`` that :func:`~hostavg.core.gradients.conform` and
        :func:`~hostavg.core.gradients.check_finite` passed (the engine's path: :meth:`add`
        checks, then calls this), with their squared norm ``sq_norm``; nothing is copied."""
        self._touched = True  # (before any change: an add cut off halfway is reset too)
        # the first micro-batch, its own mean if no other comes (not held past a second add)
        self._first = values if self.count == 0 else None
        for name, value in values.items():
            if name in self._rows:
                self._rows[name].append((value.indices, value.values, weight))
            elif self.accumulate == "sum":
                self._sums[name].add(value, weight)
            else:
                self._stacks[name].append(value)
        if loss is None:
            self._losses_known = False
        else:
            self._loss_sum += weight * float(loss)
        self.weights.append(weight)
        self.sq_norms.append(sq_norm)
        self.total_weight += weight
        self.count += 1

    def mean(self, reducer: Reducer | None = None) -> Gradients:
        """The weighted mean of what was added, as read-only arrays that later adds do not change.

        With one micro-batch added that hostavg froze (a session's or compiled
        call's output) in the accumulation dtype, its arrays are the mean as
        they are; otherwise new arrays.

        Args:
          reducer: for this call only, instead of the accumulator's own (an
            empty accumulator is then allowed: a reducer across processes
            may bring the micro-batches).

        Returns:
          :class:`Gradients` with values in the accumulation dtype; sparse
          variables as :class:`SparseGradient` with sorted unique indices (the
          union of the rows seen); ``.loss`` the weighted mean loss (None if any
          micro-batch had none) and ``.size`` the total weight.

        Raises:
          HostavgError: when nothing was added (and no reducer was given).
        """
        if self.count == 0 and reducer is None:
            raise ArgumentError("the accumulator is empty: add() at least one micro-batch before mean()")
        loss = self._loss_sum / self.total_weight if self._losses_known and self.count else None
        if reducer is None and self._reduce is numpy_reduce and self._lone_mean():
            return Gradients(self._first, loss=loss, size=self.total_weight)
        reduced = (reducer or self._reduce)(self.reduction())
        out = {}
        for name, s in self.spec.items():
            value = reduced[name]
            out[name] = SparseGradient(*map(freeze, value), s.shape) if s.sparse else freeze(value)
        return Gradients(out, loss=loss, size=self.total_weight)

    def own_mean(self, values: Mapping) -> bool:
        """Whether ``values``, added alone, would be their own mean as they are
        (:func:`numpy_reduce` would give the same values): frozen, in the accumulation dtypes,
        a sparse gradient's rows sorted and unique."""
        for name, value in values.items():
            if value.dtype != self._dtypes[name] or not is_frozen(value):
                return False
            if isinstance(value, SparseGradient) and not sorted_unique(value.indices):
                return False
        return True

    def _lone_mean(self) -> bool:
        """Whether the one micro-batch added is its own mean as it is (:meth:`own_mean`)."""
        return self.count == 1 and self.own_mean(self._first)

    @property
    def loss_sum(self) -> float | None:
        """sum_i w_i * loss_i over the added micro-batches (None if any had no loss)."""
        return self._loss_sum if self._losses_known else None

    def reduction(self) -> Reduction:
        """What a reducer turns into the mean: the running sums or the stacks, and the rows."""
        scale = max(self.weights) if self.weights else None
        rows = {}
        for name, parts in self._rows.items():
            shape = self.spec[name].shape
            if len(parts) == 1:
                indices, values, weight = parts[0]
                rows[name] = (indices, values, np.full(len(indices), weight / scale))
            elif parts:
                rows[name] = (np.concatenate([p[0] for p in parts]),
                              np.concatenate([p[1] for p in parts]),
                              np.repeat([p[2] / scale for p in parts], [len(p[0]) for p in parts]))
            else:
                rows[name] = (np.zeros(0, np.int64), np.zeros((0,) + shape[1:], self._dtypes[name]),
                              np.zeros(0))
        return Reduction(self.total_weight, np.asarray(self.weights), scale,
                         {name: running.value for name, running in self._sums.items()},
                         self._stacks, rows, self._dtypes)

    def __repr__(self) -> str:
        return (f"Accumulator(accumulate={self.accumulate!r}, count={self.count}, "
                f"total_weight={self.total_weight}, variables={len(self.spec)})")


def as_accum_dtype(dtype) -> np.dtype | None:
    """``dtype`` (a NumPy dtype, its name, or a framework's dtype with ``as_numpy_dtype``
    such as ``tf.float64``) as a floating-point NumPy dtype; None stays None (each
    variable's own dtype)."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    except TypeError:
        dt = None
    if dt is None or dt.kind != "f":
        raise ArgumentError(f"accum_dtype must be a floating-point dtype such as 'float64', got {dtype!r}")
    return dt


def _views(names, spec, dtypes) -> dict:
    """One flat buffer per dtype, cut into a view of each variable's shape."""
    out = {}
    for dtype in {dtypes[n] for n in names}:
        group = [n for n in names if dtypes[n] == dtype]
        flat = np.zeros(sum(math.prod(spec[n].shape) for n in group), dtype)
        offset = 0
        for n in group:
            size = math.prod(spec[n].shape)
            out[n] = flat[offset:offset + size].reshape(spec[n].shape)
            offset += size
    return out
