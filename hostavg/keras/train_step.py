"""A model's own ``train_step``, run per micro-batch with its optimizer's apply captured.

What both Keras backends share (:class:`OwnStep`): the model's ``train_step``
runs on each micro-batch as Keras's fit would run it, but every optimizer the
model holds records what it is asked to apply instead of applying it
(:func:`captured`). The one apply of ``model.optimizer`` gives the
micro-batch's gradients; the host averages them (sample-weighted) and the real
optimizer applies the mean once. The metrics the step updates move per
micro-batch, and its returned logs are fit's training metrics. A step that
applies several optimizers, or one twice, is refused (:func:`the_apply`).

The step equals the full batch's exactly when its loss is a mean over
samples computed independently of each other (see docs/guides/keras.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import keras
import numpy as np

from hostavg.core.errors import ArgumentError, HostavgError
from hostavg.keras.advice import TRAIN_STEP_ADVICE

__all__ = ["OwnStep", "captured", "flat_logs", "held_optimizers", "log_value", "loss_tracker",
           "micro_loss", "overrides_train_step", "the_apply"]

#: The optimizer methods that :func:`captured` records instead of running.
_APPLIES = ("apply", "apply_gradients", "stateless_apply")


def overrides_train_step(model) -> bool:
    """Whether ``model``'s class has a ``train_step`` of its own (Keras's is the compiled one)."""
    return type(model).train_step is not keras.Model.train_step


def held_optimizers(model) -> dict:
    """Every optimizer ``model`` holds, by what it is to the model: ``model.optimizer`` and
    each attribute that is one (a GAN's ``d_optimizer``), each optimizer once."""
    optimizer = getattr(model, "optimizer", None)  # an uncompiled model has none
    found = {} if optimizer is None else {id(optimizer): "model.optimizer"}
    for name, value in sorted(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in found:
            found[id(value)] = f"model.{name}"
    return found


@contextmanager
def captured(model):
    """Within the block, every optimizer ``model`` holds records each ``apply``,
    ``apply_gradients`` and ``stateless_apply`` it is asked for, and changes nothing (a
    stateless apply returns the values it was given); yields the list of records,
    ``(optimizer, grads, variables or None)``, in order."""
    calls, patched = [], []

    def recorders(optimizer) -> dict:
        def apply(grads, trainable_variables=None):
            calls.append((optimizer, list(grads), trainable_variables))

        def apply_gradients(grads_and_vars):
            grads, variables = zip(*grads_and_vars)
            apply(grads, list(variables))
            return optimizer.iterations

        def stateless_apply(optimizer_variables, grads, trainable_variables):
            calls.append((optimizer, list(grads), None))
            return trainable_variables, optimizer_variables
        return {"apply": apply, "apply_gradients": apply_gradients,
                "stateless_apply": stateless_apply}

    optimizers = [o for o in _objects(model) if isinstance(o, keras.optimizers.Optimizer)]
    try:
        for optimizer in optimizers:
            for name, function in recorders(optimizer).items():
                object.__setattr__(optimizer, name, function)  # an attribute, not tracked
            patched.append(optimizer)
        yield calls
    finally:
        for optimizer in patched:
            for name in _APPLIES:
                object.__delattr__(optimizer, name)


def _objects(model) -> list:
    """``model.optimizer`` and the values of the model's attributes, each once."""
    seen = {}
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        seen.setdefault(id(value), value)
    return list(seen.values())


def the_apply(calls, model, what: str) -> tuple:
    """``(grads, variables or None)`` of the one apply of ``model.optimizer`` that ``calls``
    (:func:`captured`'s records of a ``train_step``) hold; HostavgError for none, for an
    apply of another optimizer, and for several applies."""
    if not calls:
        raise ArgumentError(f"{what}: model {model.name!r}'s train_step applied no optimizer, so "
                            f"there is nothing to average: it must call "
                            f"self.optimizer.apply(grads, variables) (or apply_gradients)")
    names = held_optimizers(model)
    applied = [names.get(id(optimizer), "an optimizer") for optimizer, _, _ in calls]
    if len(calls) > 1:
        raise several_optimizers(model, f"applies {' then '.join(applied)}")
    if calls[0][0] is not model.optimizer:
        raise ArgumentError(f"{what}: model {model.name!r}'s train_step applies {applied[0]}, "
                            f"not model.optimizer: compile the model with that optimizer, which "
                            f"hostavg then applies the mean with")
    return calls[0][1], calls[0][2]


def several_optimizers(model, said: str) -> HostavgError:
    """The refusal of a ``train_step`` that updates the weights more than once per batch."""
    return ArgumentError(
        f"model {model.name!r}'s train_step {said}: hostavg runs train_step on each "
        f"micro-batch with the apply captured and applies the micro-batches' mean once, but a "
        f"second update would need the first's result (the weights after it), which no "
        f"micro-batch has before the step's end. Give each update its own hostavg.keras.Trainer "
        f"(a model whose train_step applies one optimizer) and step them with "
        f"hostavg.keras.step_together([(trainer_a, batches_a), (trainer_b, batches_b)]), or "
        f"one after the other")


def loss_tracker(model):
    """``(total, count)`` of the model's ``keras.metrics.Mean`` named "loss" (Keras's own loss
    tracker, or a train_step's), or None."""
    for metric in model.metrics:
        if metric.name == "loss" and isinstance(metric, keras.metrics.Mean):
            return metric.total, metric.count
    return None


def micro_loss(logged, before, after):
    """This micro-batch's loss: what it added to the "loss" tracker (``before`` and ``after``:
    its (total, count) values; None for none), Δtotal / Δcount, where it updated it; else the
    logs' "loss" (``logged``) itself."""
    logged = keras.ops.cast(logged, "float32")
    if before is None:
        return logged
    count = after[1] - before[1]
    added = (after[0] - before[0]) / keras.ops.where(count > 0, count, 1)
    return keras.ops.where(count > 0, keras.ops.cast(added, "float32"), logged)


def flat_logs(logs, model, what: str) -> dict:
    """A ``train_step``'s returned logs flattened as Keras's fit flattens them (a dict within
    is merged, names sorted); HostavgError where they are not a dict holding a scalar "loss"."""
    if not isinstance(logs, dict):
        raise ArgumentError(f"{what}: model {model.name!r}'s train_step returns "
                            f"{type(logs).__name__}, not a dict of logs")
    flat = _flat(logs)
    if "loss" not in flat or tuple(keras.ops.shape(flat["loss"])) != ():
        raise ArgumentError(
            f"{what}: model {model.name!r}'s train_step returns logs {sorted(flat)} without a "
            f"scalar 'loss'; hostavg needs each micro-batch's loss: return it as logs['loss'] "
            f"(the loss it differentiates, or a keras.metrics.Mean(name='loss') tracking it)")
    return flat


def _flat(logs: dict) -> dict:
    flat = {}
    for name, value in sorted(logs.items()):
        flat.update(_flat(value) if isinstance(value, dict) else {name: value})
    return flat


def log_value(value):
    """A metric's or a log's value as Keras's logs hold it: a float, or a read-only array for
    one of several values (F1Score's per class)."""
    if np.ndim(value) == 0:
        return float(np.asarray(value))  # a JAX array's float() costs 20 us more on the CPU
    value = np.array(value)
    value.flags.writeable = False
    return value


class OwnStep:
    """What a backend that runs the model's own ``train_step`` adds to its compiled sibling.

    Its ``_trace_compute`` runs ``train_step`` with the applies captured and names the logs
    it returns (``_took`` keeps each compute's); fit's training metrics are the last
    micro-batch's logs, as Keras's fit reports the last ``train_step``'s; a snapshot holds
    them, so what a failed step or a check computed is forgotten with the rest.
    """

    advice = TRAIN_STEP_ADVICE
    runs_train_step = True

    def __init__(self, model, loss, optimizer, **kwargs):
        held = held_optimizers(model)
        if optimizer is None and "model.optimizer" not in held.values() and len(held) > 1:
            raise several_optimizers(model, f"holds {' and '.join(held.values())} and is "
                                            f"compiled with none")
        super().__init__(model, loss, optimizer, **kwargs)
        if self._scales:
            raise ArgumentError(
                f"model {model.name!r} has its own train_step and an optimizer that scales the "
                f"loss ({type(self.optimizer).__name__}); hostavg cannot tell which gradients "
                f"the step scaled: train it without loss scaling")
        self._logs = {}

    def _took(self, names, values) -> None:
        self._logs = dict(zip(names, values))

    def snapshot(self):
        return super().snapshot(), self._logs

    def restore(self, snapshot) -> None:
        values, self._logs = snapshot
        super().restore(values)

    def training_results(self) -> dict:
        """The logs the last micro-batch's ``train_step`` returned, "loss" too."""
        return {name: log_value(value) for name, value in self._logs.items()}
