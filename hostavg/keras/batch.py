"""A Keras batch ``(x, y[, sample_weight])`` as arrays and back: the batch codec every Keras backend shares.

Each part is an array, a dict of arrays (by input name) or a list of arrays
(in order: carried as a dict by :class:`Position`), axis 0 over samples (y may
be None, for a model whose loss needs no targets). :func:`leaves` flattens a
batch into its arrays and a signature (batches of one signature share one
compiled function); :func:`rebuild` lays arrays or tensors out as it says.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hostavg.core.errors import ArgumentError

__all__ = ["Position", "as_batch", "leaves", "positions", "rebuild", "structured"]

#: A part of a batch that is absent (y of a model whose loss needs no targets).
_ABSENT = "absent"


class Position(int):
    """The key of an entry of a list or tuple of arrays (a multi-input model's ``[xa, xb]``, a
    multi-output model's ``[y1, y2]``), carried as a dict ``{Position(i): array}`` so that it
    is cut into micro-batches as a dict is; given back to the model as a list."""

    def __repr__(self) -> str:
        return f"{int(self)}"


def positions(part):
    """``part`` (x, y or sample_weight), a list or tuple of arrays (not one of numbers or of
    rows: that is one array), as a dict by :class:`Position`; anything else as it is."""
    if isinstance(part, (list, tuple)) and part and all(np.ndim(v) >= 1 for v in part) \
            and not any(isinstance(v, (list, tuple)) for v in part):
        return {Position(i): v for i, v in enumerate(part)}
    return part


def structured(batch):
    """A batch ``(x, y[, sample_weight])`` with each part that is a list of arrays as a dict by
    :class:`Position` (see :func:`positions`); anything else as it is."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return tuple(positions(part) for part in batch)
    return batch


def as_batch(x, y, sample_weight) -> tuple:
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def leaves(batch, what: str) -> tuple:
    """(batch as a tuple, its arrays in order, its input signature) of a batch (x, y[, sample_weight]).

    The signature is the layout (a dict's keys, sorted, None for an array, or
    "absent" for a y of None; per part) and each array's dtype and shape past
    axis 0: batches with the same signature share one compiled function.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        got = f"{type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) \
            else type(batch).__name__
        raise ArgumentError(f"{what}: a batch is a tuple (x, y) or (x, y, sample_weight), got {got}")
    batch = tuple(batch[:2]) if len(batch) == 3 and batch[2] is None else tuple(batch)
    layout, leaves = [], []
    for name, part in zip(("x", "y", "sample_weight"), batch):
        if part is None and name == "y":
            layout.append(_ABSENT)
            continue
        if isinstance(part, Mapping):
            keys = tuple(sorted(part, key=str))
            named = [(f"{name}[{k!r}]", part[k]) for k in keys]
        else:
            keys, named = None, [(name, part)]
        layout.append(keys)
        for label, value in named:
            try:
                array = np.asarray(value)
            except ValueError as e:  # ragged nested lists
                raise ArgumentError(f"{what}: {label} cannot be made an array ({e})") from None
            if array.dtype.kind == "c":  # the TF1 face refuses them too
                raise ArgumentError(f"{what}: {label} holds complex values ({array.dtype}), whose "
                                    f"imaginary part the model would drop; pass real arrays")
            if array.ndim < 1:
                raise ArgumentError(f"{what}: {label} is not an array of samples (got "
                                    f"{type(value).__name__} of shape {array.shape}); axis 0 of "
                                    f"every array runs over the batch's samples")
            leaves.append(array)
    signature = (tuple(layout), tuple((a.dtype.str, a.shape[1:]) for a in leaves))
    return batch, leaves, signature


def rebuild(signature, flat) -> tuple:
    """(x, y, sample_weight or None) from the arrays or tensors ``flat``, laid out as ``signature`` says."""
    flat, parts = iter(flat), []
    for keys in signature[0]:
        part = None if keys == _ABSENT else next(flat) if keys is None \
            else {k: next(flat) for k in keys}
        if keys not in (None, _ABSENT) and keys and all(isinstance(k, Position) for k in keys):
            part = [part[k] for k in sorted(keys)]  # a list of arrays, as it was given
        parts.append(part)
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None
