"""Floating-point dtypes beyond NumPy's own: bfloat16 and the float8 types, through ml_dtypes.

TensorFlow hands bfloat16 (and float8) values to NumPy as the dtypes of the
``ml_dtypes`` package (installed with TensorFlow). NumPy sees them as kind
``"V"``, not as floats: its ufuncs will not mix them with float32 under the
usual casting rules, and its ``.npy`` format writes them as raw ``|V2``
bytes that read back as opaque void values. hostavg therefore

* accumulates them in float32 (:func:`accumulation_dtype`; float32 holds
  every bfloat16 and float8 value exactly, and sums of them far more
  precisely), converting each micro-batch's values on the host
  (:func:`arithmetic`);
* counts them as floats where it checks a cast (:func:`can_cast`);
* stores them in ``.npz`` files (checkpoints, records) as the unsigned
  integers of their bits, under their name (:func:`encode`, :func:`decode`),
  so that a save and a restore round trip every bit.

Without ml_dtypes installed these types do not occur, and every function here
is NumPy's own behaviour.
"""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - installed with TensorFlow
    ml_dtypes = None

__all__ = ["EXTENDED", "accumulation_dtype", "arithmetic", "can_cast", "decode", "encode",
           "is_extended", "is_float", "name_of"]

#: name -> dtype of every floating-point type of ml_dtypes (bfloat16, float8_*, float6_*, float4_*).
EXTENDED = {} if ml_dtypes is None else {
    name: np.dtype(getattr(ml_dtypes, name)) for name in dir(ml_dtypes)
    if (name == "bfloat16" or name.startswith("float")) and isinstance(getattr(ml_dtypes, name), type)}
_KNOWN = frozenset(EXTENDED.values())
_BITS = {1: np.uint8, 2: np.uint16}


def is_extended(dtype) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' floating-point types (NumPy's kind "V", or "f"
    for float8_e5m2, whose ``dtype.str`` "<f1" NumPy itself cannot read back)."""
    return np.dtype(dtype) in _KNOWN


def is_float(dtype) -> bool:
    """Whether ``dtype`` is a real floating-point type: NumPy's or ml_dtypes'."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or is_extended(dtype)


def can_cast(source, target) -> bool:
    """NumPy's ``can_cast(source, target, "same_kind")``, with ml_dtypes' types counted as floats."""
    source, target = np.dtype(source), np.dtype(target)
    if is_extended(source) or is_extended(target):
        kind = "f" if is_extended(source) else source.kind
        return kind in "biuf" and is_float(target)
    return np.can_cast(source, target, casting="same_kind")


def accumulation_dtype(variable_dtype, accum_dtype=None) -> np.dtype:
    """The dtype a variable's gradients are summed in: ``accum_dtype`` if given, else the
    variable's own, except float32 for ml_dtypes' narrow floats (which NumPy cannot add)."""
    if accum_dtype is not None:
        return np.dtype(accum_dtype)
    dtype = np.dtype(variable_dtype)
    return np.dtype(np.float32) if is_extended(dtype) else dtype


def arithmetic(array: np.ndarray, dtype) -> np.ndarray:
    """``array`` as NumPy's ufuncs can mix it with ``dtype``: converted to ``dtype`` (a new
    array) when it holds an ml_dtypes type, else as it is."""
    return array.astype(dtype) if is_extended(array.dtype) else array


def name_of(dtype) -> str:
    """How a file names ``dtype``: NumPy's ``dtype.str`` (``"<f4"``), or an ml_dtypes type's
    name (``"bfloat16"``), whose ``dtype.str`` (``"<V2"``) would not say which it is."""
    dtype = np.dtype(dtype)
    return dtype.name if is_extended(dtype) else dtype.str


def encode(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """``array`` as the ``.npy`` format stores it bit for bit: (its bits as unsigned integers,
    its dtype's name) for an ml_dtypes type, else (``array``, None)."""
    if not is_extended(array.dtype):
        return array, None
    return np.ascontiguousarray(array).view(_BITS[array.dtype.itemsize]), array.dtype.name


def decode(array: np.ndarray, name: str | None) -> np.ndarray:
    """What :func:`encode` gave ``(array, name)`` for. Raises ValueError when ``name`` is no
    ml_dtypes type, or ``array`` does not hold its bits."""
    if name is None:
        return array
    dtype = EXTENDED.get(name)
    if dtype is None or array.dtype != _BITS.get(dtype.itemsize):
        raise ValueError(f"{array.dtype} values do not hold the bits of a {name!r} array")
    return array.view(dtype)
