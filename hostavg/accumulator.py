"""The host accumulator: a running sum or a stack of micro-batch gradients.

Pure NumPy. The mean it returns is sample-weighted::

    mean = sum_i w_i * g_i / sum_i w_i

where g_i is the gradient of micro-batch i's MEAN loss and w_i its weight
(by default its number of samples). With w_i = n_i this is exactly the
gradient of the mean loss over the concatenated batch.

Numerics: dense values are accumulated in ``accum_dtype`` (by default each
variable's own dtype), in the order the micro-batches were added: first
``w_1 * g_1``, then ``+= w_i * g_i``, then one division by ``sum_i w_i``. The
"sum" and "stack" modes run this same arithmetic, so they give bit-identical
means. Sparse rows are kept as they come (indices, values, weight) and summed
once, in :meth:`Accumulator.mean`, so their memory is the number of rows seen,
never the size of the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from hostavg.errors import HostavgError
from hostavg.gradients import Gradients, SparseGradient, VariableSpec, check_finite, conform

__all__ = ["ACCUMULATE_MODES", "Accumulator", "Reduction", "as_accum_dtype", "numpy_reduce"]

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
      sums: "sum" mode: name -> sum_i w_i g_i, in the accumulation dtype.
      stacks: "stack" mode: name -> [g_1, ..., g_k] as added.
      rows: sparse variables: name -> (segment_ids (n,), num_rows, values
        (n, ...), row_weights (n,)); the mean's row r is
        sum over j with segment_ids[j] == r of row_weights[j] * values[j], / total.
      dtypes: name -> accumulation dtype.
    """

    total: float
    weights: np.ndarray
    sums: dict
    stacks: dict
    rows: dict
    dtypes: dict


Reducer = Callable[[Reduction], dict]


def numpy_reduce(r: Reduction) -> dict:
    """The host reducer: the mean of a :class:`Reduction` with NumPy.

    Returns name -> dense mean, or for a sparse variable the (num_rows, ...)
    mean values of its unique rows.
    """
    out = {name: np.divide(s, r.total) for name, s in r.sums.items()}
    for name, gs in r.stacks.items():
        acc = np.empty(gs[0].shape, r.dtypes[name])
        scratch = np.empty_like(acc)
        for i, (g, w) in enumerate(zip(gs, r.weights)):
            weighted_add(acc, g, float(w), first=i == 0, scratch=scratch)
        out[name] = np.divide(acc, r.total, out=acc)
    for name, (segments, num_rows, values, row_weights) in r.rows.items():
        dtype = r.dtypes[name]
        weighted = values.astype(dtype) * row_weights.astype(dtype).reshape(
            (-1,) + (1,) * (values.ndim - 1))
        summed = np.zeros((num_rows,) + values.shape[1:], dtype)
        np.add.at(summed, segments, weighted)
        out[name] = np.divide(summed, r.total, out=summed)
    return out


def weighted_add(acc: np.ndarray, g: np.ndarray, w: float, *, first: bool,
                 scratch: np.ndarray) -> None:
    """``acc = w * g`` when ``first``, else ``acc += w * g``, in acc's dtype, allocating nothing."""
    if first:
        np.multiply(g, w, out=acc, dtype=acc.dtype)
    else:
        np.multiply(g, w, out=scratch, dtype=acc.dtype)
        np.add(acc, scratch, out=acc)


class Accumulator:
    """Adds micro-batch gradients on the host and returns their weighted mean.

    Args:
      spec: name -> :class:`VariableSpec` of every trained variable, usually
        ``trainer.spec``; every added gradient must have exactly these keys.
      accumulate: one of :data:`ACCUMULATE_MODES`.
      accum_dtype: the dtype sums are kept in; None keeps each variable's dtype.
      reducer: turns a :class:`Reduction` into the mean; default
        :func:`numpy_reduce` (a trainer with ``average="graph"`` passes one that
        runs in its session).

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
            raise HostavgError(
                f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
        if not spec:
            raise HostavgError("spec is empty: there is no variable to accumulate")
        self.spec = dict(spec)
        self.accumulate = accumulate
        self.accum_dtype = as_accum_dtype(accum_dtype)
        self._dtypes = {n: self.accum_dtype or np.dtype(s.dtype) for n, s in self.spec.items()}
        self._reduce = reducer or numpy_reduce
        dense = [n for n, s in self.spec.items() if not s.sparse]
        self._sums, self._scratch = {}, {}
        if accumulate == "sum":
            self._sums = _views(dense, self.spec, self._dtypes)
            self._scratch = _views(dense, self.spec, self._dtypes)
        self.reset()

    def reset(self) -> None:
        """Forgets every added micro-batch; keeps the buffers for reuse."""
        self.count = 0
        self.total_weight = 0.0
        self.weights: list[float] = []
        self.sq_norms: list[float] = []
        self._loss_sum = 0.0
        self._losses_known = True
        self._stacks = {n: [] for n, s in self.spec.items() if not s.sparse} \
            if self.accumulate == "stack" else {}
        self._rows = {n: [] for n, s in self.spec.items() if s.sparse}

    def add(self, grads: Mapping, weight: float | None = None) -> None:
        """Adds one micro-batch's gradients with weight ``weight``.

        Args:
          grads: name -> gradient, exactly the spec's names; a
            :class:`Gradients` from ``trainer.compute`` or any mapping.
          weight: how much this micro-batch counts; default ``grads.size``, its
            number of samples. Must be finite and > 0.

        Raises:
          HostavgError: naming the micro-batch (its index in this accumulator)
            and the variables, for a bad weight, missing or extra keys, a wrong
            shape or dtype, or non-finite values or loss. Nothing is added then.
        """
        what = f"micro-batch {self.count}"
        if weight is None:
            weight = getattr(grads, "size", None)
            if weight is None:
                raise HostavgError(
                    f"{what}: no weight given and the gradients carry no size; "
                    f"pass acc.add(grads, weight=number_of_samples)")
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.number)) \
                or not math.isfinite(weight) or weight <= 0:
            raise HostavgError(f"{what}: weight must be a finite number > 0, got {weight!r}")
        loss = getattr(grads, "loss", None)
        values = conform(self.spec, grads, what=what)
        sq_norm = check_finite(values, what, loss)
        weight = float(weight)
        for name, value in values.items():
            if name in self._rows:
                self._rows[name].append((value.indices, value.values, weight))
            elif self.accumulate == "sum":
                weighted_add(self._sums[name], value, weight, first=self.count == 0,
                             scratch=self._scratch[name])
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
        """The weighted mean of what was added, as new arrays (later adds do not change it).

        Args:
          reducer: for this call only, instead of the accumulator's own.

        Returns:
          :class:`Gradients` with values in the accumulation dtype; sparse
          variables as :class:`SparseGradient` with sorted unique indices (the
          union of the rows seen); ``.loss`` the weighted mean loss (None if any
          micro-batch had none) and ``.size`` the total weight.

        Raises:
          HostavgError: when nothing was added.
        """
        if self.count == 0:
            raise HostavgError("the accumulator is empty: add() at least one micro-batch before mean()")
        rows, unique = {}, {}
        for name, parts in self._rows.items():
            indices = np.concatenate([p[0] for p in parts])
            unique[name], segments = np.unique(indices, return_inverse=True)
            values = np.concatenate([p[1] for p in parts])
            row_weights = np.repeat([p[2] for p in parts], [len(p[0]) for p in parts])
            rows[name] = (segments, len(unique[name]), values, row_weights)
        reduced = (reducer or self._reduce)(Reduction(
            self.total_weight, np.asarray(self.weights), self._sums, self._stacks, rows,
            self._dtypes))
        out = {}
        for name, s in self.spec.items():
            value = reduced[name]
            out[name] = SparseGradient(unique[name], value, s.shape) if s.sparse else value
        loss = self._loss_sum / self.total_weight if self._losses_known else None
        return Gradients(out, loss=loss, size=self.total_weight)

    def __repr__(self) -> str:
        return (f"Accumulator(accumulate={self.accumulate!r}, count={self.count}, "
                f"total_weight={self.total_weight}, variables={len(self.spec)})")


def as_accum_dtype(dtype) -> np.dtype | None:
    """``dtype`` as a floating-point NumPy dtype; None stays None (each variable's own dtype)."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.kind != "f":
        raise HostavgError(f"accum_dtype must be a floating-point dtype such as 'float64', got {dtype!r}")
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
