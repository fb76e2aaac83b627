"""The Keras face: ``hostavg.keras.Trainer``, a Keras 3 model trained by the one trainer contract.

``import hostavg.keras`` (not imported by ``import hostavg``). The trainer
contract is :class:`~hostavg.train.trainer.BaseTrainer`'s; this face checks
Keras's arguments and gives batches as ``(x, y[, sample_weight])``; the
backend is Keras's own backend's (:mod:`hostavg.keras.tensorflow` on
TensorFlow, :mod:`hostavg.keras.jax` on JAX).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

import keras

from hostavg.core.check import CheckReport
from hostavg.core.curvature import Curvature
from hostavg.core.errors import ArgumentError, HostavgError, positive_int
from hostavg.core.gradients import Gradients
from hostavg.core.results import StepResult
from hostavg.core.split import Cut, take
from hostavg.engine.step import step_together as engine_step_together
from hostavg.keras import data as keras_data
from hostavg.keras.callbacks import KerasCallbacks, split_callbacks
from hostavg.keras.batch import as_batch, structured
from hostavg.keras.common import BATCH_NORM_MODES
from hostavg.keras.train_step import overrides_train_step
from hostavg.train.history import History
from hostavg.train.progress import checked_verbose
from hostavg.train.sources import Validation, refuse_endless
from hostavg.train.trainer import (DEFAULT_BATCH_SIZE, BaseTrainer, deprecated_form, is_integer,
                                   micro_batch_size_third, together_entries)

__all__ = ["Trainer", "step_together"]

#: Keras's backend -> (module, class for a compiled model, class for a model with its own
#: train_step) of hostavg's backend for it, imported when a trainer is made.
_BACKENDS = {"tensorflow": ("hostavg.keras.tensorflow", "KerasBackend", "KerasTrainStepBackend"),
             "jax": ("hostavg.keras.jax", "KerasJaxBackend", "KerasJaxTrainStepBackend")}


class Trainer(BaseTrainer):
    """Trains a Keras 3 model with gradients averaged on the host, as its compile says.

    The trainer contract is :class:`~hostavg.train.trainer.BaseTrainer`'s:
    the same methods, arguments and results as :class:`hostavg.Trainer`. The
    mean is applied by the model's optimizer once per step, so a step equals
    Keras's ``train_on_batch`` on the whole batch (sample weights too), and
    ``optimizer.iterations`` grows by one. The loss is Keras's own
    ``model.compute_loss`` (a subclass's override too), the compiled metrics
    are updated on every micro-batch, and a ``LossScaleOptimizer``
    (``mixed_float16``) is driven as Keras drives it. The trainer learns the
    model's variables on the first batch it sees (its gradient function is
    traced then): :attr:`spec`, :meth:`accumulator` and :meth:`apply` need one.

    What this face adds, because Keras users expect it:

    - data as Keras takes it: ``compute``, ``check`` and ``per_sample`` take
      ``x, y=None, sample_weight=None`` as ``train_on_batch``; ``step`` a list
      of ``(x, y)`` or ``(x, y, sample_weight)`` batches; ``fit`` and
      ``evaluate`` ``x, y`` and ``sample_weight=`` as ``model.fit``: arrays,
      lists or dicts of them, pandas, or a ``tf.data.Dataset``/``PyDataset``
      of batches;
    - ``fit``'s ``validation_split``, ``class_weight``,
      ``validation_batch_size`` and ``validation_steps``, Keras callbacks
      beside hostavg's hooks, and ``model.history``, as Keras's.
    The Keras guide says the rest (custom train_step, masked losses, batch norm).

    Example::

        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        history = hostavg.keras.Trainer(model, micro_batch_size=32).fit(x, y, epochs=5)
    """

    def __init__(self, model, loss=None, optimizer=None, *, micro_batch_size: int | None = None,
                 micro_batches: int | None = None, accumulate: str = "sum", accum_dtype=None,
                 hooks=(), comm=None, update_ratios_every: int | None = None,
                 overlap: bool = False, batch_norm: str = "micro",
                 distributions_every: int | None = None, check_applied: bool = True,
                 statistics=None, watch_outliers: bool = True, diagnose: bool = True):
        """Takes the model as compiled, compiling it with ``loss`` and ``optimizer`` where given.

        The keywords every face takes are :class:`~hostavg.train.trainer.BaseTrainer`'s
        (``micro_batch_size``, ``accumulate``, ``hooks``, ...).

        Args:
          model: a ``keras.Model``, compiled or not; it is compiled with
            ``loss`` and ``optimizer`` where given (keeping its metrics and
            ``loss_weights``), so ``model.save`` holds the optimizer that trains.
          loss: what ``model.compile`` takes as loss, each a micro-batch MEAN
            (reduction "sum_over_batch_size"); None: the compiled loss.
          optimizer: a ``keras.optimizers.Optimizer`` or its name, without
            ``gradient_accumulation_steps``; None: the compiled optimizer.
          batch_norm: one of :data:`~hostavg.keras.common.BATCH_NORM_MODES`:
            "micro" (Keras's own) moves BatchNormalization's moving statistics
            once per micro-batch; "step" once per step, by the whole batch's
            moments (TensorFlow backend only, not with ``comm``).

        Attributes:
          model: the model.
          loss: the model's compiled loss (``model.loss``).
          optimizer: the optimizer that trains (``model.optimizer``).
          batch_norm: as given.

        Raises:
          HostavgError: for a model whose own ``train_step`` applies several
            optimizers (or under loss scaling), a loss that is not a micro-batch mean, an optimizer hostavg cannot drive, or a
            model or trainer in a ``tf.distribute`` scope or under a
            ``keras.distribution`` (``comm=`` spans several devices).
        """
        backend = _BACKENDS.get(keras.backend.backend())
        if backend is None:
            raise ArgumentError(f"hostavg.keras runs on Keras's {' or '.join(_BACKENDS)} backend, "
                                f"got {keras.backend.backend()!r}; set KERAS_BACKEND to one of "
                                f"them before importing keras")
        if not isinstance(model, keras.Model):
            raise ArgumentError(f"model must be a keras.Model, got {type(model).__name__}")
        if batch_norm not in BATCH_NORM_MODES:
            raise ArgumentError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}")
        if batch_norm == "step" and comm is not None:
            raise ArgumentError("batch_norm='step' combines the moments of every micro-batch of a "
                                "step, but with comm= each rank sees only its own: use "
                                "batch_norm='micro'")
        super().__init__(micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                         accumulate=accumulate, accum_dtype=accum_dtype, hooks=hooks, comm=comm,
                         update_ratios_every=update_ratios_every, overlap=overlap,
                         distributions_every=distributions_every,
                         check_applied=check_applied, statistics=statistics,
                         watch_outliers=watch_outliers, diagnose=diagnose)
        self.batch_norm = batch_norm
        if batch_norm != "micro" and keras.backend.backend() != "tensorflow":
            raise ArgumentError(f"batch_norm={batch_norm!r} is built for Keras's TensorFlow backend "
                                f"only; on {keras.backend.backend()!r} use batch_norm='micro'")
        extra = {"batch_norm": batch_norm} if batch_norm != "micro" else {}
        extra["check_applied"] = self.check_applied
        kind = backend[2] if overrides_train_step(model) else backend[1]
        self._backend = getattr(importlib.import_module(backend[0]), kind)(
            model, loss, optimizer, **extra)
        self.model, self.optimizer = model, self._backend.optimizer

    @property
    def loss(self):
        """The model's compiled loss (``model.loss``)."""
        return self.model.loss

    @property
    def rollback_variables(self) -> tuple:
        """What a failed step restores: the variables the gradient function assigns
        (batch-norm moving statistics, dropout seed states, the compiled metrics' states)."""
        return tuple(self._backend.assigned.values())

    def accumulator(self):
        return self._accumulator()

    def compute(self, x, y=None, sample_weight=None, *, size: int | None = None) -> Gradients:
        return self._compute(self._backend, self._batch(x, y, sample_weight, "compute"), size)

    def apply(self, grads: Mapping) -> int:
        return self._apply(self._backend, grads, {})

    def step(self, batches: Sequence, sizes: Sequence[int] | None = None,
             rows: Sequence | None = None) -> StepResult:
        return self._step(self._backend, _batches(batches, "step"), sizes, rows)

    @micro_batch_size_third("x, y")
    def check(self, x, y=None, sample_weight=None, *,
              micro_batch_size: int | None = None) -> CheckReport:
        return self._check(self._backend, self._batch(x, y, sample_weight, "check"),
                           micro_batch_size)

    def per_sample(self, x, y=None, sample_weight=None, *, rows=None,
                   chunk_size=None):
        return self._per_sample(self._backend, self._batch(x, y, sample_weight, "per_sample"),
                                rows, chunk_size)

    def hvp(self, x, y=None, sample_weight=None, *, vectors: Mapping,
            micro_batch_size: int | None = None) -> Gradients:
        return self._hvp(self._backend, self._batch(x, y, sample_weight, "hvp"), vectors,
                         micro_batch_size)

    def curvature(self, x, y=None, sample_weight=None, *, trace_samples: int = 16, top: int = 1,
                  iterations: int = 20, tolerance: float = 1e-3, seed: int = 0,
                  micro_batch_size: int | None = None) -> Curvature:
        return self._curvature(self._backend, self._batch(x, y, sample_weight, "curvature"),
                               dict(trace_samples=trace_samples, top=top, iterations=iterations,
                                    tolerance=tolerance, seed=seed), micro_batch_size)

    def evaluate(self, x=None, y=None, *, batch_size: int | None = None,
                 sample_weight=None) -> dict:
        if keras_data.is_batches(x):
            data = keras_data.read_as_keras(keras_data.DatasetSource(x), self.model)
            size = None if batch_size is None else positive_int("batch_size", batch_size)
        else:
            data = keras_data.samples(x, y, sample_weight)
            size = keras_data.checked_batch_size(batch_size, data)
        return self._evaluate(self._backend, keras_data.Chunks(data, size))

    def _batch(self, x, y, sample_weight, call: str):
        """One batch as the backend takes it, from Keras's ``x, y, sample_weight``; 0.1.0's one
        tuple ``compute((x, y))`` (and ``per_sample``'s) unpacked, with a DeprecationWarning."""
        if is_integer(sample_weight):
            said = ("micro_batch_size by keyword: check(x, y, micro_batch_size=...)"
                    if call == "check" else "an array of one weight per sample")
            raise ArgumentError(f"{call} takes x, y, sample_weight as train_on_batch does, and got "
                                f"the number {sample_weight!r} as sample_weight; pass {said}")
        if isinstance(x, tuple) and y is None and sample_weight is None and len(x) in (2, 3) \
                and _input_count(self.model) <= 1:
            if call == "check":
                raise ArgumentError(f"check takes x, y, sample_weight as train_on_batch does, and "
                                    f"got one tuple of {len(x)} as x; unpack the batch: "
                                    f"check(*batch)")
            given = "x, y, sample_weight" if len(x) == 3 else "x, y"
            deprecated_form(f"{call}(({given}))", f"{call}({given}) (or {call}(*batch))",
                            stacklevel=4)
            x, y, sample_weight = (*x, None)[:3]
        return structured(as_batch(x, y, sample_weight))

    def fit(self, x=None, y=None, *, batch_size: int | None = None,
            micro_batch_size: int | None = None, epochs: int = 1, verbose="auto", callbacks=None,
            validation_data=None, validation_freq=1, shuffle: bool = True,
            initial_epoch: int = 0, steps_per_epoch: int | None = None, seed: int | None = None,
            drop_remainder: bool = False, progress=None, checkpoint_dir=None,
            checkpoint_every: int | None = None, keep_checkpoints: int = 3,
            validation_split: float = 0.0, class_weight=None, sample_weight=None,
            validation_batch_size: int | None = None,
            validation_steps: int | None = None) -> History:
        self._backend.refuse_strategies()
        keras_callbacks, hooks = split_callbacks(callbacks)
        data, validation_data = self._fit_data(x, y, sample_weight, class_weight,
                                               validation_split, validation_data)
        batch_size = keras_data.checked_batch_size(batch_size, data)
        val = None if validation_data is None else keras_data.validation(validation_data)
        source = keras_data.source(data, batch_size, shuffle,
                                   class_weight if keras_data.is_batches(data) else None,
                                   steps_per_epoch)
        verbose = checked_verbose(verbose)
        progbar = progress is None and verbose != 0  # Keras's own; hostavg's display off
        listeners = None if not (keras_callbacks or progbar) else KerasCallbacks(
            keras_callbacks, self.model, epochs=epochs, verbose=verbose, progbar=progbar,
            steps=steps_per_epoch or source.num_batches(drop_remainder),
            validation_logs=self._backend.evaluation_results)
        self.model.stop_training = False
        finalize = _Finalize(self.model)  # before the Keras callbacks hear of the end, as in Keras
        val_size = None if validation_batch_size is None else positive_int(
            "validation_batch_size", validation_batch_size)
        val_steps = None if validation_steps is None else positive_int("validation_steps",
                                                                        validation_steps)
        arguments = self._fit_arguments(
            batch_size=batch_size, micro_batch_size=micro_batch_size, epochs=epochs,
            verbose=verbose, progress=False if progbar else progress,
            validation_freq=validation_freq, seed=seed, drop_remainder=drop_remainder,
            callbacks=(*hooks, finalize) if listeners is None else (*hooks, finalize, listeners),
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch)
        self._read_first(source, val, steps_per_epoch)
        validation = None if val is None else Validation(
            _validation_chunks(val, arguments.cut, batch_size, val_size, val_steps),
            arguments.validation_freq, listeners=listeners)
        try:
            history = self._fit(self._backend, source, validation, arguments)
        except BaseException as error:  # one that stopped training carries its History
            _leave_history(self.model, getattr(error, "history", None))
            raise
        _leave_history(self.model, history)
        return history

    def _read_first(self, source, val, steps_per_epoch) -> None:
        """What fit reads before it trains, its arguments checked: the first batch of
        ``source`` (the model's variables learned from it) and the first sample of ``val``
        (the validation data), evaluated."""
        refuse_endless(source, steps_per_epoch)  # before anything reads the data
        own = isinstance(source, keras_data.DatasetSource)  # the data gives its own batches
        if own:
            keras_data.read_as_keras(source, self.model)
        self._engine_for(self._backend, source.first if own
                         else lambda: take(source.data, slice(0, 1)), "fit, data")
        if val is not None:  # its first sample, before any epoch trains
            first = val.first() if isinstance(val, keras_data.DatasetSource) else val
            try:
                self._evaluate(self._backend, [take(first, slice(0, 1))])
            except HostavgError as e:
                raise type(e)(f"fit, validation_data: {e}") from e.__cause__

    @staticmethod
    def _fit_data(x, y, sample_weight, class_weight, validation_split, validation_data):
        """fit's training data (weighted by class) and validation data, as Keras takes them."""
        if keras_data.is_batches(x):
            if y is not None or sample_weight is not None:
                raise ArgumentError(f"y and sample_weight come from the {type(x).__name__}'s "
                                    f"elements: leave them None")
            if validation_split:
                raise ArgumentError("validation_split needs arrays; with a dataset, pass "
                                    "validation_data")
            return x, validation_data
        data = keras_data.samples(x, y, sample_weight)
        if validation_split and validation_data is None:  # as Keras: no class weights there
            data, validation_data = keras_data.split_validation(data, validation_split)
        return keras_data.weighted(data, class_weight, "the data"), validation_data

    def save(self, path) -> None:
        self._save(self._backend, path)

    def restore(self, path) -> dict | None:
        return self._restore(self._backend, path)

    def _reset_metrics(self, backend) -> None:
        self.model.reset_metrics()

    def _training_metrics(self, backend) -> dict:
        return backend.training_results()

    def _stop_requested(self) -> str | None:
        return "model.stop_training was set (by a callback)" if self.model.stop_training else None

    def _face(self) -> dict:
        return {"face": "hostavg.keras.Trainer", "model": self.model.name,
                "batch_norm": self.batch_norm}


def step_together(steps: Sequence[tuple]) -> list[StepResult]:
    """Steps several Keras trainers from the same weights: all computed, then all applied.

    A GAN's simultaneous update, as :func:`hostavg.step_together` for TF1:
    every trainer's gradients are taken before any model changes, then the
    means are applied in order. Atomic: if any micro-batch of any trainer
    fails, nothing is applied and every trainer's rollback variables are
    restored.
    The first apply found non-finite has every step tried again without the
    micro-batches that drove it where a hook drops them (``SkipNonFinite``);
    a later one raises, saying which applies stay (docs/explanation/errors.md).

    Args:
      steps: ``(trainer, batches)`` or ``(trainer, batches, sizes)`` per
        trainer, as :meth:`Trainer.step` takes them; applied in this order.

    Returns:
      one :class:`~hostavg.StepResult` per trainer, in order (``[]`` for ``[]``).

    Example::

        res_d, res_g = hostavg.keras.step_together([(d, d_batches), (g, g_batches)])
    """
    return engine_step_together([trainer._together_entry(trainer._backend,
                                                         _batches(batches, "step_together"), sizes)
                                 for trainer, batches, sizes in together_entries(steps, Trainer,
                                                                                 "step_together")])


class _Finalize:
    """fit's end, as Keras's, whatever callbacks fit was given: ``model.history``
    (:func:`_leave_history`) and ``optimizer.finalize_variable_values`` (an EMA optimizer's
    averages become the weights), before the Keras callbacks hear of the end."""

    def __init__(self, model):
        self.model = model

    def on_train_end(self, history) -> None:
        _leave_history(self.model, history)
        self.model.optimizer.finalize_variable_values(self.model.trainable_weights)


def _validation_chunks(val, cut: Cut, batch_size, size, steps) -> keras_data.Chunks:
    """The chunks fit evaluates ``val`` in (see ``fit``'s ``validation_data``): of
    ``validation_batch_size`` samples, else cut as fit cuts its batches, over its first
    ``validation_steps`` chunks or batches."""
    if size is not None or not isinstance(val, keras_data.DatasetSource):
        return keras_data.Chunks(val, size or cut.largest(batch_size or DEFAULT_BATCH_SIZE),
                                 steps=steps)
    return keras_data.Chunks(val, cut.size, cut.count, steps)


def _leave_history(model, history) -> None:
    """Sets ``model.history`` to fit's ``history`` where there is one, as Keras's fit leaves its
    History there: at the end (Keras callbacks' ``on_train_end`` see it), and when an error
    stops training, with the epochs it finished; an argument refused before training leaves
    ``model.history`` as it was. (Keras sets it when training begins; hostavg's fit makes its
    History then, so callbacks before the end see the previous fit's.)

    It is hostavg's :class:`~hostavg.History`, the object fit returns, as Keras's fit returns
    the one it leaves, rather than a ``keras.callbacks.History`` copy that could disagree with
    it: its ``history`` and ``epoch`` are Keras's, and every step's statistics are there too.
    """
    if history is not None:
        model.history = history


def _input_count(model) -> int:
    """How many inputs ``model`` takes; 0 where it cannot tell yet (a subclass not built)."""
    try:
        return len(model.inputs or ())
    except (AttributeError, ValueError):
        return 0


def _batches(batches, call: str):
    """``batches`` checked to be a list of batches (not one batch, not a mapping)."""
    if isinstance(batches, tuple) and batches and not isinstance(batches[0], (tuple, list)):
        raise ArgumentError(
            f"{call} takes a list of batches, one per micro-batch, got one batch (a tuple of "
            f"{', '.join(type(b).__name__ for b in batches)}); cut it with "
            f"hostavg.split((x, y), micro_batch_size)")
    if isinstance(batches, (Mapping, str)) or not isinstance(batches, Sequence):
        raise ArgumentError(
            f"{call} takes a list of (x, y) batches, one per micro-batch, got "
            f"{type(batches).__name__}; cut one with hostavg.split((x, y), micro_batch_size)")
    return [structured(batch) for batch in batches]
