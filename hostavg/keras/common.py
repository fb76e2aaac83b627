"""What every Keras backend of hostavg shares: the batch's structure, the loss, the optimizer check.

A batch is ``(x, y)`` or ``(x, y, sample_weight)``; each part an array or a dict
of arrays (by input name), axis 0 over samples. Framework-free but for Keras's
own loss and optimizer classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import keras
import numpy as np

from hostavg.core.errors import HostavgError

__all__ = ["ModelVariables", "model_errors", "BATCH_NORM_MODES", "MEAN_REDUCTIONS", "Loss", "as_batch", "checked_optimizer",
           "leaves", "rebuild"]

#: Keras loss reductions that give the micro-batch MEAN, sum_j w_j l_j / n_samples.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")

#: How BatchNormalization layers' moving statistics move. "micro": once per micro-batch, by
#: its moments (Keras's own behaviour, with its gradient accumulation too). "step": once per
#: optimizer step, by the whole batch's moments of each layer's inputs, as a full-batch
#: step moves them.
BATCH_NORM_MODES = ("micro", "step")


def as_batch(x, y, sample_weight) -> tuple:
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def leaves(batch, what: str) -> tuple:
    """(batch as a tuple, its arrays in order, its input signature) of a batch (x, y[, sample_weight]).

    The signature is the layout (a dict's keys, sorted, or None for an array;
    per part) and each array's dtype and shape past axis 0: batches with the
    same signature share one compiled function.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        got = f"{type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) \
            else type(batch).__name__
        raise HostavgError(f"{what}: a batch is a tuple (x, y) or (x, y, sample_weight), got {got}")
    batch = tuple(batch[:2]) if len(batch) == 3 and batch[2] is None else tuple(batch)
    layout, leaves = [], []
    for name, part in zip(("x", "y", "sample_weight"), batch):
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
                raise HostavgError(f"{what}: {label} cannot be made an array ({e})") from None
            if array.dtype.kind == "c":  # the TF1 face refuses them too
                raise HostavgError(f"{what}: {label} holds complex values ({array.dtype}), whose "
                                   f"imaginary part the model would drop; pass real arrays")
            if array.ndim < 1:
                raise HostavgError(f"{what}: {label} is not an array of samples (got "
                                   f"{type(value).__name__} of shape {array.shape}); axis 0 of "
                                   f"every array runs over the batch's samples")
            leaves.append(array)
    signature = (tuple(layout), tuple((a.dtype.str, a.shape[1:]) for a in leaves))
    return batch, leaves, signature


def rebuild(signature, flat) -> tuple:
    """(x, y, sample_weight or None) from the arrays or tensors ``flat``, laid out as ``signature`` says."""
    flat, parts = iter(flat), []
    for keys in signature[0]:
        parts.append(next(flat) if keys is None else {k: next(flat) for k in keys})
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


class Loss:
    """A trainer's loss, normalised once: ``loss(y, y_pred, sample_weight or None)`` -> the micro-batch mean.

    Attributes:
      weighs_samples: whether it takes sample weights (a ``keras.losses.Loss``
        does; a plain callable(y_true, y_pred) does not).
      name: what messages call it (its class, or the callable's name).
    """

    def __init__(self, loss):
        if isinstance(loss, keras.losses.Loss):
            if loss.reduction not in MEAN_REDUCTIONS:
                raise HostavgError(
                    f"loss {loss.name!r} has reduction={loss.reduction!r}, but hostavg needs the "
                    f"micro-batch MEAN: make it with reduction='sum_over_batch_size' (the default)")
            self.weighs_samples = True
        elif callable(loss):
            self.weighs_samples = False
        else:
            raise HostavgError(f"loss must be a keras.losses.Loss or a callable(y_true, y_pred) "
                               f"giving the micro-batch mean, got {loss!r}")
        self._loss = loss
        self.name = type(loss).__name__ if self.weighs_samples else getattr(loss, "__name__",
                                                                           repr(loss))

    def __call__(self, y, y_pred, sample_weight):
        if self.weighs_samples:
            return self._loss(y, y_pred, sample_weight=sample_weight)
        return self._loss(y, y_pred)


def checked_optimizer(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise HostavgError(
            "optimizer is a LossScaleOptimizer, whose apply unscales gradients that hostavg never "
            "scaled; pass its inner optimizer (hostavg checks every micro-batch for NaN and Inf "
            "on the host)")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise HostavgError(
            f"optimizer must be a keras.optimizers.Optimizer (e.g. keras.optimizers.Adam(1e-3)), "
            f"got {type(optimizer).__name__}; a tf.compat.v1.train optimizer goes with "
            f"hostavg.Trainer")
    if optimizer.gradient_accumulation_steps:
        raise HostavgError(
            f"optimizer has gradient_accumulation_steps={optimizer.gradient_accumulation_steps}, "
            f"but hostavg accumulates on the host: make the optimizer without it and pass the "
            f"micro-batches to step")
    return optimizer


class ModelVariables:
    """What every Keras backend does alike with a model's and its optimizer's variables
    (Keras's own variable API): name them for checkpoints, read, assign, build the optimizer.

    A backend sets ``model`` and ``optimizer``.
    """

    def named_variables(self) -> dict:
        """Every variable of the model and the optimizer by its position, ``model/<i>`` and
        ``optimizer/<i>``: names that agree between processes that built the same model."""
        if not self.model.built:
            raise HostavgError("the model is not built yet; run compute, step or fit on a batch "
                               "first, or give the model an Input")
        self.build_optimizer()
        return {**{f"model/{i:04d}": v for i, v in enumerate(self.model.variables)},
                **{f"optimizer/{i:04d}": v for i, v in enumerate(self.optimizer.variables)}}

    def variables(self) -> dict:
        return {name: v.numpy() for name, v in self.named_variables().items()}

    def assign(self, values: Mapping) -> None:
        for name, v in self.named_variables().items():
            v.assign(values[name])

    def build_optimizer(self) -> None:
        """Builds the optimizer with the model's trainable variables, as Keras's fit does."""
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)


@contextmanager
def model_errors(what: str, message):
    """Turns an error building or tracing the model on a batch into a HostavgError naming the
    batch; ``message(error)`` is what went wrong, in the backend's own way of telling."""
    try:
        yield
    except HostavgError:
        raise
    except Exception as error:
        raise HostavgError(
            f"{what}: the model cannot run on this batch ({type(error).__name__}: "
            f"{message(error)}); check its x and y against the model's inputs and the loss") \
            from error
