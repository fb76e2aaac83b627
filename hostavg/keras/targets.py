"""Integer targets of a sparse categorical loss, checked against the model's classes on the host.

A sparse categorical cross-entropy takes targets 0..C-1, C the last
dimension of its output. Out of range, Keras on TensorFlow fails inside the
compute, naming no sample, and Keras on JAX trains on the target silently.
hostavg refuses it before any compute on every backend (in ``prepare``),
naming the samples and the value, and the engine names their data rows. Per
batch structure the targets to check are found once (:func:`of`); per
micro-batch a min and a max of each (:func:`check`), and only a batch that
fails is looked at sample by sample.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import numpy as np

from hostavg.engine.batches import refused
from hostavg.keras.batch import rebuild

__all__ = ["Target", "check", "of"]

#: How many distinct bad values of one sample a reason lists.
VALUES = 3


class Target(NamedTuple):
    """One array of targets that a sparse categorical loss takes.

    Attributes:
      leaf: its index among the batch's arrays.
      label: its name in the batch: ``y``, ``y['out']`` or ``y[1]``.
      classes: C, the last dimension of its output.
      ignore: the loss's ``ignore_class``, a target it takes besides 0..C-1, or None.
      output: its output in words: ``the model's output 'out'``.
    """

    leaf: int
    label: str
    classes: int
    ignore: int | None
    output: str


def of(model, signature, flat) -> tuple[Target, ...]:
    """The targets of batches of ``signature`` (arrays like ``flat``) that a sparse categorical
    loss of the compiled ``model`` takes; () where the loss is the model's own
    ``compute_loss`` (which may use y otherwise), where Keras cannot tell the outputs'
    shapes symbolically, or where no such loss matches a y array."""
    layout = signature[0]
    if model.loss is None or type(model).compute_loss is not keras.Model.compute_loss \
            or not (layout[1] is None or isinstance(layout[1], tuple)):  # y absent
        return ()
    try:
        outputs = _outputs(model, signature, flat)
    except Exception:  # noqa: BLE001 - a model Keras cannot run symbolically: nothing to check
        return ()
    first = 1 if layout[0] is None else len(layout[0])  # y's arrays follow x's
    found = []
    for i, name, classes in outputs:
        sparse, ignore = _sparse(_loss_of(model.loss, i, name))
        leaf, label = _leaf(layout[1], i, name, len(outputs))
        if sparse and leaf is not None and classes and flat[first + leaf].dtype.kind in "iuf":
            output = "the model's output" + ("" if name is None else f" {name!r}")
            found.append(Target(first + leaf, label, classes, ignore, output))
    return tuple(found)


def check(targets: tuple[Target, ...], flat, what: str) -> None:
    """Raises :func:`~hostavg.engine.batches.refused`'s HostavgError naming the samples whose
    targets are out of range (of the first target array that has any)."""
    for t in targets:
        y = flat[t.leaf]
        if not y.size or (y.min() > -1 and y.max() < t.classes):
            continue  # trunc(y) in 0..C-1, as Keras casts floats: -1 < y < C
        per_sample = y.reshape(len(y), -1)
        out = (per_sample <= -1) | (per_sample >= t.classes)
        if t.ignore is not None:
            out &= per_sample != t.ignore
        bad = np.flatnonzero(out.any(axis=1))
        if not len(bad):
            continue
        said = f"{t.classes} classes (0..{t.classes - 1}" + (
            "" if t.ignore is None else f", and ignore_class {t.ignore}") + ")"
        found = [(j, f"{t.label} holds {_values(per_sample[j][out[j]], per_sample.shape[1])}; "
                     f"{t.output} has {said}") for j in bad]
        raise refused(what, f"{_count(len(bad))} a target out of range of its sparse "
                            f"categorical loss", found)


def _count(k: int) -> str:
    return "1 sample holds" if k == 1 else f"{k} samples hold"


def _values(values: np.ndarray, per_sample: int) -> str:
    """A sample's bad targets in words: ``15``, or ``15, 12 in 2 of its 20 targets``."""
    distinct = np.unique(values)
    shown = ", ".join(f"{v:g}" if isinstance(v, float) else str(v)
                      for v in distinct[:VALUES].tolist())
    shown += ", ..." if len(distinct) > VALUES else ""
    return shown if per_sample == 1 else f"{shown} in {len(values)} of its {per_sample} targets"


def _outputs(model, signature, flat) -> list[tuple[int, str | None, int | None]]:
    """(position, name or None, last dimension) of each output of the model, from its output
    spec on symbolic inputs shaped as ``flat``."""
    symbolic = [keras.KerasTensor((None, *a.shape[1:]), dtype=a.dtype.name) for a in flat]
    spec = model.compute_output_spec(rebuild(signature, symbolic)[0])
    if isinstance(spec, dict):
        return [(i, name, spec[name].shape[-1]) for i, name in enumerate(sorted(spec))]
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    names = list(getattr(model, "output_names", None) or ())
    names = names if len(names) == len(specs) else [None] * len(specs)
    return [(i, name, s.shape[-1] if s.shape else None)
            for i, (name, s) in enumerate(zip(names, specs))]


def _loss_of(loss, i: int, name: str | None):
    """The compiled loss of output ``i`` (named ``name``): one for every output, or its entry
    of a dict by output name or a list by position; None where none matches."""
    if isinstance(loss, dict):
        return loss.get(name)
    if isinstance(loss, (list, tuple)):
        return loss[i] if i < len(loss) else None
    return loss


def _sparse(loss) -> tuple[bool, int | None]:
    """Whether ``loss`` is a sparse categorical cross-entropy over the last axis, and its
    ``ignore_class``."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return False, None
    if loss is keras.losses.sparse_categorical_crossentropy:
        return True, None
    if getattr(loss, "fn", None) is keras.losses.sparse_categorical_crossentropy:  # a Loss
        config = loss.get_config()
        if config.get("axis", -1) == -1:  # its classes along the output's last axis
            return True, config.get("ignore_class")
    return False, None


def _leaf(keys, i: int, name: str | None, outputs: int) -> tuple[int | None, str]:
    """(index among y's arrays, label) of output ``i``'s targets (of ``outputs``) in a y laid
    out as ``keys`` (None: one array, for a model of one output; else a dict's keys by output
    name, or Positions of a list by position); (None, "") where none is."""
    if keys is None:
        return (0, "y") if outputs == 1 else (None, "")
    for index, key in enumerate(keys):
        if key == (name if isinstance(key, str) else i):
            return index, f"y[{key!r}]"
    return None, ""
