"""Gradient values on the host: dense arrays and sparse rows, by variable name.

Pure NumPy. A :class:`Gradients` is what one micro-batch, or the mean of many,
looks like once it has left the session: a read-only mapping from a variable's
name (``var.op.name``) to a NumPy array of the variable's shape or, for a
variable read through ``tf.gather`` / ``embedding_lookup``, to a
:class:`SparseGradient` holding only the rows that were touched.

Ownership, the one rule every part of hostavg follows:

* what hostavg hands out (gradients from ``compute``, means, ``res.grads``,
  micro-batch gradients) is **frozen**: a read-only view that cannot be made
  writeable again, of an array nobody else holds (:func:`freeze`);
* what hostavg receives (``acc.add``, ``apply``, what a hook returns) is kept
  as it is when hostavg froze it itself, and **copied** otherwise
  (:func:`own`), so a caller who later changes or reuses an array cannot
  change a result;
* a cached value about an array (a squared norm in :attr:`Gradients.sq_norms`)
  is trusted only for arrays hostavg froze itself (:func:`is_frozen`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hostavg.core import display
from hostavg.core.blas import need_one_blas_thread
from hostavg.core.dtypes import can_cast
from hostavg.core.errors import ArgumentError, StepError

__all__ = ["VariableSpec", "SparseGradient", "Gradients", "check_finite", "coalesce_rows", "conform",
           "freeze", "global_norm", "is_frozen", "nonfinite_entries", "own", "sorted_unique",
           "squared_norm", "squared_norms"]

#: Every array :func:`freeze` made: its id -> a weak reference to it, which takes the entry
#: with it when the array goes: what the caches may trust. (A plain dict of C-level
#: references: a step freezes a few arrays per variable, and a WeakValueDictionary's
#: Python-level entries cost twice as much.)
_FROZEN: dict = {}


def _forget(key: int):
    """The callback of the reference ``_FROZEN[key]``: removes that entry, if it is still the
    one whose array went."""
    def gone(ref, key=key, frozen=_FROZEN):  # (the dict bound here: safe at interpreter exit)
        if frozen.get(key) is ref:
            frozen.pop(key, None)
    return gone


def freeze(array) -> np.ndarray:
    """A read-only view of ``array``, which the caller hands over: nobody else may keep writing to it.

    Every NumPy array it is a view of is made read-only too, so the view
    cannot be made writeable again where NumPy can tell (an array over a
    foreign buffer, as a session returns them, can still have its flag set
    back by hand; hostavg then stops trusting it, see :func:`is_frozen`).
    Used on arrays hostavg made (session outputs, means, copies); 0-d values
    (NumPy scalars) become 0-d arrays.
    """
    base = np.asarray(array)
    link = base
    while isinstance(link, np.ndarray):
        link.flags.writeable = False
        link = link.base
    view = base.view()
    key = id(view)
    _FROZEN[key] = weakref.ref(view, _forget(key))
    return view


def is_frozen(value) -> bool:
    """Whether ``value`` (an array or a :class:`SparseGradient`) is made of arrays :func:`freeze` made, still read-only."""
    if isinstance(value, SparseGradient):
        return is_frozen(value.indices) and is_frozen(value.values)
    ref = _FROZEN.get(id(value))
    return ref is not None and ref() is value and not value.flags.writeable


def own(value, dtype=None):
    """``value`` if hostavg froze it (and it has ``dtype``), else a frozen copy (cast to ``dtype``).

    Casting to a narrower float turns values out of its range into Inf, which
    :func:`check_finite` then reports.
    """
    if isinstance(value, SparseGradient):
        return SparseGradient(own(value.indices), own(value.values, dtype), value.dense_shape)
    if is_frozen(value) and (dtype is None or value.dtype == dtype):
        return value
    with np.errstate(over="ignore"):
        return freeze(np.array(value, dtype=dtype, copy=True))


class VariableSpec(NamedTuple):
    """The form of one trained variable's gradient.

    Attributes:
      shape: the variable's shape; a dense gradient has exactly this shape.
      dtype: the variable's NumPy dtype.
      sparse: True when TensorFlow hands the gradient over as
        ``IndexedSlices`` (rows of the variable, e.g. an embedding table).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    sparse: bool


@dataclass(frozen=True)
class SparseGradient:
    """Rows of a gradient: ``dense[indices[i]] += values[i]``.

    The same row may appear more than once (one per sample that read it);
    :meth:`coalesce` sums duplicates, :meth:`to_dense` builds the full array.

    Attributes:
      indices: (n,) integer row indices into the variable.
      values: (n, *dense_shape[1:]) the rows' gradient values.
      dense_shape: the variable's shape.
    """

    indices: np.ndarray
    values: np.ndarray
    dense_shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "indices", np.asarray(self.indices))
        object.__setattr__(self, "values", np.asarray(self.values))
        object.__setattr__(self, "dense_shape", tuple(int(d) for d in self.dense_shape))

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape, so that a gradient's shape reads the same either way."""
        return self.dense_shape

    def coalesce(self) -> SparseGradient:
        """The same gradient with sorted, unique indices (duplicate rows summed)."""
        return SparseGradient(*coalesce_rows(self.indices, self.values), self.dense_shape)

    def to_dense(self) -> np.ndarray:
        """The full ``dense_shape`` array, duplicates summed. Allocates the whole table."""
        dense = np.zeros(self.dense_shape, self.values.dtype)
        np.add.at(dense, self.indices, self.values)
        return dense

    def __repr__(self) -> str:
        return display.shortened(f"SparseGradient({len(self.indices)} rows of {self.dense_shape} "
                                 f"{self.dtype})")


def sorted_unique(indices: np.ndarray) -> bool:
    """Whether ``indices`` are sorted and unique: rows in the form :func:`coalesce_rows` gives."""
    return len(indices) < 2 or bool(np.all(indices[1:] > indices[:-1]))


def coalesce_rows(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``indices`` and, for each, the sum of its rows of ``values``.

    Rows already sorted and unique (as a session or an earlier coalesce gives
    them) come back as they are, after one comparison pass. Otherwise one
    stable sort, then the rows of each index are summed: with few duplicates
    in the order they came (the first row of each index is copied and the
    others added to it: one fancy-indexed add when no index comes three times,
    else ``np.add.at``, whose fixed cost is large even for a few rows); with many
    by ``np.add.reduceat`` over each run, in NumPy's own order (about an ulp from
    the sequential sum; its cost grows with the number of runs of equal indices,
    not with their length). Either way the result depends only on the input.
    """
    if sorted_unique(indices):
        return indices, values
    n = len(indices)
    order = _stable_order(indices)
    ordered = indices[order]
    first = np.empty(n, bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    if len(starts) == n:
        return ordered, np.take(values, order, axis=0)
    if 2 * len(starts) > n:  # few duplicates: gather each index's first row, add the others
        summed = np.take(values, order[starts], axis=0)
        repeats = np.flatnonzero(~first)
        into = np.cumsum(first)[repeats] - 1
        extra = np.take(values, order[repeats], axis=0)
        if bool(np.all(into[1:] > into[:-1])):  # no index thrice: one fancy add does it
            summed[into] += extra
        else:
            np.add.at(summed, into, extra)
    else:
        summed = np.add.reduceat(np.take(values, order, axis=0), starts, axis=0)
    return ordered[starts], summed


def _stable_order(indices: np.ndarray) -> np.ndarray:
    """``np.argsort(indices, kind="stable")``, computed as the unstable sort of unique keys
    (index, position), which NumPy sorts faster than it sorts stably (the performance page,
    "Choices on the host")."""
    n = len(indices)
    if n < 2 ** 31 and int(indices.max()) < 2 ** 31:
        keys = indices.astype(np.int64) << 32
        keys |= np.arange(n)
        return np.argsort(keys)
    return np.argsort(indices, kind="stable")


class Gradients(Mapping):
    """A read-only mapping from variable name to gradient value.

    Values are NumPy arrays of the variable's shape, or :class:`SparseGradient`
    for variables whose gradient is a set of rows. Variables whose gradient is
    ``None`` in the graph are absent.

    Attributes:
      loss: the micro-batch's loss (for a mean: the sample-weighted mean of the
        micro-batches' losses), or None where unknown.
      size: the number of samples behind these gradients (for a mean: the sum
        of the weights), or None where unknown.
      sq_norms: name -> squared L2 norm of that variable's gradient, where
        already known (``trainer.compute`` has the session reduce them, sparse
        rows coalesced); the finiteness check and the statistics use them
        instead of reading the values again. A norm given to the constructor
        is kept only for a value hostavg froze (:func:`is_frozen`), which
        cannot change under it; empty where unknown.

    Example:
      >>> g = Gradients({"w": np.array([3.0, 4.0])}, loss=0.5, size=8)
      >>> g.global_norm()
      5.0
    """

    __slots__ = ("_values", "loss", "size", "sq_norms")

    def __init__(self, values: Mapping[str, Any], *, loss: float | None = None,
                 size: float | None = None, sq_norms: Mapping[str, float] | None = None):
        self._values = dict(values)
        self.loss = loss
        self.size = size
        # a framework's squared norm not finite (its float32 squares overflowed, or a NaN) is
        # taken on the host, in float64, when asked: finite wherever the entries are
        self.sq_norms = {name: float(q) for name, q in (sq_norms or {}).items()
                         if name in self._values and is_frozen(self._values[name])
                         and math.isfinite(q)}

    def __getitem__(self, name: str):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self):
        return self._values.keys()

    def items(self):
        return self._values.items()

    def values(self):
        return self._values.values()

    def as_dict(self) -> dict:
        """A new dict of the same values (which stay read-only)."""
        return dict(self._values)

    def global_norm(self) -> float:
        """sqrt of the sum of squares of every entry (sparse rows coalesced first); see :func:`global_norm`."""
        return global_norm(self._values, self.sq_norms)

    def __repr__(self) -> str:
        tail = display.fields({"loss": self.loss, "size": self.size})
        room = display.REPR_LIMIT - len(tail) - 40
        parts = []
        for name, v in self._values.items():
            part = f"{name!r}: {_shape(v)}"
            if sum(len(p) + 2 for p in parts) + len(part) > room:
                parts.append(f"… {len(self) - len(parts)} more")
                break
            parts.append(part)
        return display.shortened(f"Gradients({{{', '.join(parts)}}}{', ' + tail if tail else ''})")

    def _repr_html_(self) -> str:
        rows = [[name, _shape(v), math.sqrt(self.sq_norms[name]) if name in self.sq_norms
                 else math.sqrt(squared_norm(v))] for name, v in self._values.items()]
        caption = (f"Gradients of {len(self)} variables: global norm "
                   f"{display.number(self.global_norm())}, loss {display.number(self.loss)}, "
                   f"size {display.number(self.size)}")
        return display.html(caption, ["variable", "shape and dtype", "norm"], rows)


def _shape(value) -> str:
    """A gradient's shape and dtype in words: ``(20, 64) float32``, ``sparse 3 rows of (50, 4)
    float32``."""
    rows = f"sparse {len(value.indices)} rows of " if isinstance(value, SparseGradient) else ""
    return f"{rows}{tuple(value.shape)} {value.dtype}"


def squared_norm(value) -> float:
    """The squared L2 norm of a dense array or a sparse gradient (duplicate rows summed first).

    Float32 products are summed in float32 within blocks of 65,536 entries and
    the blocks in float64, so the result has float32's relative accuracy
    (about 1e-7) whatever the size, in one pass that allocates nothing. Where
    that overflows (float32 entries above ~1e19, float16 above ~250) it is
    summed again in float64, so finite entries of a narrower float always give
    a finite result; NaN or Inf entries give NaN or Inf.
    """
    if isinstance(value, SparseGradient):
        value = value.coalesce().values
    flat = np.ravel(value)
    if flat.dtype.kind != "f":
        flat = flat.astype(np.float64)
    sq = _blocked_dot(flat)
    if not math.isfinite(sq) and flat.dtype.itemsize < 8:
        with np.errstate(over="ignore", invalid="ignore"):
            sq = math.fsum(_blocked_dot(flat[i:i + BLOCK].astype(np.float64))
                           for i in range(0, flat.size, BLOCK))
    return sq


def squared_norms(grads) -> dict:
    """name -> squared norm of each of ``grads`` (a :class:`Gradients`), the cached ones where
    known (:attr:`Gradients.sq_norms`)."""
    known = grads.sq_norms
    return {name: known[name] if name in known else squared_norm(value)
            for name, value in grads.items()}


def _blocked_dot(flat: np.ndarray) -> float:
    need_one_blas_thread()
    with np.errstate(over="ignore", invalid="ignore"):
        if flat.size <= BLOCK:
            return float(np.dot(flat, flat))
        return math.fsum(float(np.dot(flat[i:i + BLOCK], flat[i:i + BLOCK]))
                         for i in range(0, flat.size, BLOCK))


def global_norm(values: Mapping, sq_norms: Mapping[str, float] | None = None) -> float:
    """The L2 norm of every entry of ``values`` (name -> array or SparseGradient) together.

    sqrt(sum of :func:`squared_norm`), taken from ``sq_norms`` where given.
    Where that sum passes float64's range (float64 entries above ~1e154) the
    entries are scaled by the largest first, so finite values always have a
    finite norm; any NaN or Inf entry gives NaN or Inf.
    """
    sq_norms = sq_norms or {}
    total = math.fsum(sq_norms[n] if n in sq_norms else squared_norm(v) for n, v in values.items())
    if not math.isinf(total):
        return math.sqrt(total)
    entries = [_entries(v) for v in values.values()]
    scale = max((float(np.max(np.abs(e))) for e in entries if e.size), default=0.0)
    if not math.isfinite(scale):
        return scale
    return scale * math.sqrt(math.fsum(squared_norm(e / scale) for e in entries))


def _entries(value) -> np.ndarray:
    """The entries a norm is taken of: a sparse gradient's coalesced rows."""
    return value.coalesce().values if isinstance(value, SparseGradient) else np.asarray(value)


#: Entries per block of the blocked host reductions: float32 sums stay accurate
#: within a block, and 65,536 float64 values (512 KiB) stay in cache.
BLOCK = 65536


def nonfinite_entries(value, sq_norm: float | None = None) -> tuple[int, int]:
    """(NaN count, Inf count) of a gradient's entries.

    A finite squared norm (``sq_norm`` where known, else one pass) means
    (0, 0) at once; only a non-finite one is counted entry by entry (float64
    entries beyond ~1e154 overflow a squared norm while finite: (0, 0)).
    """
    if math.isfinite(squared_norm(value) if sq_norm is None else sq_norm):
        return 0, 0
    array = value.values if isinstance(value, SparseGradient) else np.asarray(value)
    return int(np.isnan(array).sum()), int(np.isinf(array).sum())


#: What a non-finite micro-batch gradient usually needs.
INPUTS_HINT = ("Look at that micro-batch's inputs or lower the learning rate; to skip such "
               "micro-batches instead, pass hooks=[hostavg.hooks.SkipNonFinite()] to the Trainer.")


def check_finite(values: Mapping, what: str, loss: float | None = None,
                 known: Mapping[str, float] | None = None, hint: str = INPUTS_HINT,
                 loss_hint: str | None = None) -> float:
    """Raises HostavgError naming every variable with NaN or Inf (and the loss, if given); returns the squared norm.

    A squared norm is NaN or Inf whenever an entry is, so one is enough per
    variable: taken from ``known`` where given, else one pass over the values
    (see :func:`nonfinite_entries`). ``hint`` ends the message: where to look;
    ``loss_hint``, where given, ends it instead when the gradients are finite
    and only the loss is not.
    """
    total, bad = 0.0, []
    known = known or {}
    for name, value in values.items():
        sq = known[name] if name in known else squared_norm(value)
        nan, inf = nonfinite_entries(value, sq)
        if nan + inf:
            size = (value.values if isinstance(value, SparseGradient) else np.asarray(value)).size
            bad.append(f"{name!r} ({nan + inf} of {size} entries: {nan} NaN, {inf} Inf)")
            continue
        total += sq
    loss_ok = loss is None or math.isfinite(loss)
    if bad or not loss_ok:
        where = f"non-finite gradients in {', '.join(bad)}" if bad else "finite gradients"
        said = "" if loss is None else (f"; the loss was finite ({loss:.6g})" if loss_ok
                                        else f"{' and' if bad else ' but'} the loss is {loss}")
        if not bad and loss_hint is not None:
            hint = loss_hint
        raise StepError(f"{what}: {where}{said}. Nothing was applied. {hint}")
    return total


def conform(spec: Mapping[str, VariableSpec], grads: Mapping, *, what: str,
            cast: bool = False) -> dict:
    """Checks ``grads`` against ``spec`` and returns them as NumPy values.

    Checks, in this order, raising :class:`HostavgError` on the first failure:
    the keys are exactly the spec's; each value has the variable's shape (a
    sparse value: 1-D integer indices in range and rows of the right shape); its
    dtype casts to the variable's within the same kind (float64 to float32 and
    integers to float are fine, complex to float is not). Finiteness is
    :func:`check_finite`'s.

    A dense value for a sparse variable becomes a :class:`SparseGradient` of all
    rows; a sparse value for a dense variable is checked like one for a sparse
    variable, then densified.

    Args:
      spec: the variables, as the trainer sees them.
      grads: any mapping from name to array or :class:`SparseGradient`.
      what: how to name the input in messages, e.g. ``"micro-batch 2"``.
      cast: also cast each value to its variable's dtype (so that a later
        finiteness check sees float64 values that overflow float32 as Inf).

    Returns:
      A dict in the spec's order, of values hostavg owns (:func:`own`): the
      caller's arrays are copied unless hostavg froze them itself.
    """
    if not isinstance(grads, Mapping):
        raise ArgumentError(
            f"{what}: gradients must be a mapping from variable name to array, "
            f"got {type(grads).__name__}")
    if grads.keys() != spec.keys():
        missing = [n for n in spec if n not in grads]
        extra = [n for n in grads if n not in spec]
        raise ArgumentError(
            f"{what}: gradient keys do not match the trained variables: "
            f"missing {missing}, unexpected {extra}. Use exactly the names of "
            f"trainer.spec (var.op.name of each variable that has a gradient).")
    return {name: own(_conform_value(name, s, grads[name], what), s.dtype if cast else None)
            for name, s in spec.items()}


def _conform_value(name: str, s: VariableSpec, value, what: str):
    if not isinstance(value, SparseGradient):
        try:
            value = np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise ArgumentError(f"{what}: gradient of {name!r} cannot be made an array ({e})") from None
        if s.sparse and value.shape == s.shape:
            value = SparseGradient(freeze(np.arange(s.shape[0])), value, s.shape)
    if not can_cast(value.dtype, s.dtype):
        raise ArgumentError(
            f"{what}: gradient of {name!r} has dtype {value.dtype}, which does not cast "
            f"safely to the variable's {np.dtype(s.dtype).name}; pass floating-point values")
    if isinstance(value, SparseGradient):
        if not s.shape:
            raise ArgumentError(f"{what}: gradient of {name!r} is sparse (rows), but the variable "
                                f"is a scalar; pass a 0-d array")
        if value.dense_shape != s.shape:
            raise ArgumentError(f"{what}: sparse gradient of {name!r} has dense_shape "
                                f"{value.dense_shape}, but the variable's shape is {s.shape}")
        idx = value.indices
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ArgumentError(
                f"{what}: sparse gradient of {name!r} needs 1-D integer indices, "
                f"got shape {idx.shape} dtype {idx.dtype}")
        want = (len(idx),) + tuple(s.shape[1:])
        if value.values.shape != want:
            raise ArgumentError(
                f"{what}: sparse gradient of {name!r} has values of shape "
                f"{value.values.shape}, expected {want} ({len(idx)} rows of the "
                f"variable's shape {s.shape})")
        if len(idx) and (idx.min() < 0 or idx.max() >= s.shape[0]):
            raise ArgumentError(
                f"{what}: sparse gradient of {name!r} has row indices outside "
                f"[0, {s.shape[0]}): min {idx.min()}, max {idx.max()}")
        value = SparseGradient(idx, value.values, s.shape)
        if not s.sparse:
            return freeze(value.to_dense())
    elif value.shape != s.shape:
        raise ArgumentError(
            f"{what}: gradient of {name!r} has shape {value.shape}, expected the "
            f"variable's shape {s.shape}")
    return value
