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
from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.gradients import Gradients
from hostavg.core.results import StepResult
from hostavg.core.split import take
from hostavg.engine.step import step_together as engine_step_together
from hostavg.keras import data as keras_data
from hostavg.keras.callbacks import KerasCallbacks, split_callbacks
from hostavg.keras.common import BATCH_NORM_MODES, as_batch, structured
from hostavg.train.history import History
from hostavg.train.trainer import BaseTrainer, entries

__all__ = ["Trainer", "step_together"]

#: Keras's backend -> (module, class) of hostavg's backend for it, imported when a trainer is made.
_BACKENDS = {"tensorflow": ("hostavg.keras.tensorflow", "KerasBackend"),
             "jax": ("hostavg.keras.jax", "KerasJaxBackend")}


class Trainer(BaseTrainer):
    """Trains a Keras 3 model with gradients averaged on the host, as its compile says.

    One optimizer step runs k micro-batches through forward and backward,
    fetching each one's gradients to NumPy; their sample-weighted mean
    ``sum_i n_i g_i / sum_i n_i`` (g_i: the gradient of micro-batch i's MEAN
    loss, n_i: its samples) is applied by the optimizer once. That equals
    Keras's own ``train_on_batch`` on the concatenated batch for any
    optimizer (with sample weights too: Keras's mean divides the weighted sum
    by the number of samples), and ``optimizer.iterations`` grows by one.

    The model trains as compiled: its loss is Keras's own
    ``model.compute_loss`` (the compiled loss: a name, a ``keras.losses.Loss``,
    a dict or list per output with ``loss_weights``; plus ``model.losses``),
    or a subclass's override of ``compute_loss``, which is Keras's place to
    customise training for hostavg too: a model that overrides ``train_step``
    is refused (hostavg's step replaces it). The compiled metrics are updated
    on every micro-batch (``compute_metrics``, with the training forward
    pass, as Keras's ``train_step`` does) and reported by :meth:`fit`
    (exactly, over samples; but each output's loss of a multi-output model,
    "<output>_loss", which Keras's compiled loss weights by the batch's size
    where its compiled function fixed it, counts each micro-batch once: the
    gradient function serves micro-batches of every size). A
    ``LossScaleOptimizer`` (what compile makes under the ``mixed_float16``
    policy) is driven as Keras drives it: each micro-batch's loss scaled, its
    gradients unscaled, a step with a non-finite micro-batch skipped and the
    scale halved (``StepResult.skipped`` says so), the scale doubled after its
    growth steps.

    The same trainer contract as :class:`hostavg.Trainer`
    (:class:`~hostavg.train.trainer.BaseTrainer`): the same methods with the
    same meaning and results; only the data differs. A batch is a tuple
    ``(x, y)`` or ``(x, y, sample_weight)``; x is an array or, for a
    multi-input model, a list of arrays in input order or a dict of them by
    input name; y is an array, a list or dict per output for a multi-output
    model, or None for a loss that needs no targets. Every array's axis 0
    runs over samples. ``hostavg.split((x, y), 32)`` cuts one into
    micro-batches (arrays and dicts).

    The trainer learns the model's gradients on the first batch it sees (the
    compiled gradient function is traced then, and an unbuilt model is built
    by one forward pass with ``training=False``): :attr:`spec`,
    :meth:`accumulator` and :meth:`apply` need a batch to have been seen
    (by :meth:`compute`, :meth:`step`, :meth:`fit` or :meth:`evaluate`).
    (Which variables have a gradient, and which gradients are sparse, is
    known only by tracing the loss on data.)

    Args:
      model: a ``keras.Model``, compiled or not. It is compiled with ``loss``
        and ``optimizer`` where given (keeping its compiled metrics and
        ``loss_weights``), so ``model.save``, ``evaluate`` and ``predict`` work
        as Keras's and ``model.save`` holds the optimizer that trains.
      loss: what ``model.compile`` takes as loss (every loss a micro-batch
        MEAN: reduction "sum_over_batch_size", the default); None: the
        model's compiled loss.
      optimizer: a ``keras.optimizers.Optimizer`` or its name ("adam"),
        without ``gradient_accumulation_steps`` (hostavg accumulates); None:
        the model's compiled optimizer. It is built with the model's
        trainable variables, as Keras's fit builds it.
      batch_norm: how BatchNormalization layers' moving mean and variance
        move, one of :data:`~hostavg.keras.common.BATCH_NORM_MODES`.
        "micro" (default; Keras's own behaviour, its gradient accumulation's
        too): once per micro-batch, by that micro-batch's moments, k times
        per step. "step": once per optimizer step, by the whole batch's
        moments of the layer's inputs (the sample-weighted combination of the
        micro-batches' means and variances, the spread between micro-batches
        included): for a layer whose inputs no earlier batch norm normalised
        (the first), what a full-batch ``train_on_batch`` assigns. ``compute``
        then leaves them alone and the next ``apply`` (a step's own) moves
        them by every micro-batch computed since the last. Either way the
        forward pass normalises each micro-batch by its own moments, so the
        gradients are the same in both modes (and a later batch-norm layer
        sees inputs a full-batch pass would not). Not with ``comm`` (each rank
        sees only its micro-batches), nor with ``renorm``.
      accumulate, accum_dtype, hooks, comm, update_ratios_every, overlap: as
        for every trainer (:class:`~hostavg.train.trainer.BaseTrainer`).
        ``average="graph"`` is TF1's alone: a Keras model's mean is computed
        by NumPy (or, with ``comm``, by MPI).

    Attributes:
      model: the model.
      loss: the model's compiled loss (``model.loss``).
      optimizer: the optimizer that trains (``model.optimizer``).
      batch_norm: as given.
      spec: name (``variable.path``) -> :class:`~hostavg.VariableSpec` of every
        trained variable: the trainable variables that have a gradient.
      hooks: the hooks, in the order they run.
      rollback_variables: the variables a failed step restores: those that
        the gradient function assigns (batch-norm moving statistics, dropout
        seed states, the compiled metrics' states), found in its traced
        graph. Frozen weights, which it only reads, are not among them.
      comm: the communicator, or None.

    Raises:
      HostavgError: for a model that overrides ``train_step``, a loss that is
        not a micro-batch mean, an optimizer hostavg cannot drive (or none), or
        a model made, or a trainer made, in a ``tf.distribute`` strategy's
        scope, or on JAX under a ``keras.distribution`` (hostavg trains one
        device per process: ``comm=`` spans several).

    Example::

        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        trainer = hostavg.keras.Trainer(model)
        history = trainer.fit(x, y, batch_size=256, micro_batch_size=32, epochs=5)
        history.history["accuracy"]
    """

    def __init__(self, model, loss=None, optimizer=None, *, accumulate: str = "sum",
                 accum_dtype=None, hooks=(), comm=None, update_ratios_every: int | None = None,
                 overlap: bool = False, batch_norm: str = "micro"):
        backend = _BACKENDS.get(keras.backend.backend())
        if backend is None:
            raise HostavgError(f"hostavg.keras runs on Keras's {' or '.join(_BACKENDS)} backend, "
                               f"got {keras.backend.backend()!r}; set KERAS_BACKEND to one of "
                               f"them before importing keras")
        if not isinstance(model, keras.Model):
            raise HostavgError(f"model must be a keras.Model, got {type(model).__name__}")
        if batch_norm not in BATCH_NORM_MODES:
            raise HostavgError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}")
        if batch_norm == "step" and comm is not None:
            raise HostavgError("batch_norm='step' combines the moments of every micro-batch of a "
                               "step, but with comm= each rank sees only its own: use "
                               "batch_norm='micro'")
        super().__init__(accumulate=accumulate, accum_dtype=accum_dtype, hooks=hooks, comm=comm,
                         update_ratios_every=update_ratios_every, overlap=overlap)
        self.batch_norm = batch_norm
        if batch_norm != "micro" and keras.backend.backend() != "tensorflow":
            raise HostavgError(f"batch_norm={batch_norm!r} is built for Keras's TensorFlow backend "
                               f"only; on {keras.backend.backend()!r} use batch_norm='micro'")
        extra = {"batch_norm": batch_norm} if batch_norm != "micro" else {}
        self._backend = getattr(importlib.import_module(backend[0]), backend[1])(
            model, loss, optimizer, **extra)
        self.model, self.optimizer = model, self._backend.optimizer

    @property
    def loss(self):
        """The model's compiled loss (``model.loss``)."""
        return self.model.loss

    @property
    def rollback_variables(self) -> tuple:
        return tuple(self._backend.assigned.values())

    def accumulator(self):
        """A new, empty :class:`~hostavg.Accumulator` for this trainer's variables and settings."""
        return self._accumulator()

    def compute(self, batch, *, size: int | None = None) -> Gradients:
        """Runs one micro-batch forward (``training=True``) and backward; returns its gradients.

        Batch-norm moving statistics update, as in Keras's train step;
        trained variables and ``optimizer.iterations`` do not change.

        Args:
          batch: ``(x, y)`` or ``(x, y, sample_weight)``.
          size: its number of samples (its weight); default the length of its arrays.

        Returns:
          :class:`~hostavg.Gradients` keyed by ``variable.path`` (read-only
          arrays; a sparse gradient as a :class:`~hostavg.SparseGradient` of
          unique rows), with ``.loss``, ``.size`` and ``.sq_norms``.
        """
        return self._compute(self._backend, structured(batch), size)

    def apply(self, grads: Mapping) -> int:
        """Applies ``grads`` with the optimizer, once; runs no forward or backward pass.

        ``grads`` is a :class:`~hostavg.Gradients` or any mapping with exactly
        the keys of :attr:`spec`; values are checked (shape, dtype, finite),
        cast to each variable's dtype and copied unless hostavg made them.

        Returns:
          ``optimizer.iterations`` after the apply (one more than before).
        """
        return self._apply(self._backend, grads, {})

    def step(self, batches: Sequence, sizes: Sequence[int] | None = None,
             rows: Sequence | None = None) -> StepResult:
        """One optimizer step over the micro-batches ``batches``: compute, add, apply.

        Atomic as :meth:`hostavg.Trainer.step`: if any micro-batch fails
        (bad batch, non-finite gradient or loss, an error in TensorFlow or in
        a hook), nothing is applied and what the micro-batches assigned
        (:attr:`rollback_variables`) is restored.

        Args:
          batches: a list of batches, one per micro-batch, e.g.
            ``hostavg.split((x, y), micro_batch_size)``. With ``comm``, this
            rank's micro-batches.
          sizes: one number of samples per batch (its weight in the mean).
          rows: one array per batch of the row indices, in your data, of its
            samples: kept as ``MicroBatch.rows`` and named in errors (fit
            passes them).
        """
        return self._step(self._backend, _batches(batches, "step"), sizes, rows)

    def check(self, x, y, micro_batch_size: int, *, sample_weight=None) -> CheckReport:
        """Does this model's step over micro-batches equal its full-batch step? Changes nothing.

        As :meth:`hostavg.Trainer.check`: runs ``(x, y)`` whole (twice) and
        cut into micro-batches from the same weights, compares the weighted
        mean of the micro-batch gradients with the whole batch's gradient per
        variable, restores what the runs assigned (batch-norm statistics), and
        says the likely cause when they differ. ``str(report)`` is one line.
        """
        return self._check(self._backend, structured(as_batch(x, y, sample_weight)),
                           micro_batch_size)

    def per_sample(self, batch):
        """One row per sample of ``batch`` (``(x, y)`` or ``(x, y, sample_weight)``): its loss,
        gradient norm, and cosine with the batch's mean gradient. Changes nothing.

        As :meth:`hostavg.Trainer.per_sample`: each sample is computed alone
        (``training=True``: a sample alone is normalised by itself in batch
        norm, and dropout draws for it alone), the mean is over the samples
        whose loss and gradient are finite, and what the computes assigned is
        restored. Costs one compiled call per sample.

        Returns:
          a pandas DataFrame indexed by ``sample`` (position in the batch)
          with columns ``loss``, ``norm``, ``cosine``.

        Example::

            table = trainer.per_sample((x[:32], y[:32]))
            table.sort_values("cosine").head()
        """
        return self._per_sample(self._backend, structured(batch))

    def evaluate(self, x, y=None, *, batch_size: int | None = None, sample_weight=None) -> dict:
        """The loss and the compiled metrics over ``x`` as Keras's ``evaluate`` gives them;
        changes nothing.

        Runs Keras's own ``test_step`` (a subclass's too: the model with
        ``training=False``, ``compute_loss``, the loss's running mean weighted
        by each chunk's samples, ``compute_metrics``) on chunks of
        ``batch_size`` samples, the model's metrics reset first. Reports every
        metric that evaluation updates, by name ("loss", each compiled metric;
        a subclass's own when its ``test_step`` updates them), and none that
        nothing updated. What the forward pass assigns is restored.

        Args:
          x, y, sample_weight: as :meth:`fit` takes them: arrays of samples
            (pandas, tensors, dicts too), or a tf.data.Dataset or PyDataset of
            batches (y and sample_weight then their own).
          batch_size: samples per chunk (per evaluated call); default 32 for
            samples, each batch whole for a dataset.

        Returns:
          {"loss": ..., **{metric name: ...}} as floats.
        """
        if keras_data.is_batches(x):
            data, size = x, None if batch_size is None else positive_int("batch_size", batch_size)
        else:
            data = keras_data.samples(x, y, sample_weight)
            size = keras_data.checked_batch_size(batch_size, data)
        return self._evaluated(keras_data.chunks(data, size), data, None)

    def _evaluated(self, chunks, data, callbacks) -> dict:
        """The evaluation of ``chunks`` (of ``data``), announced to Keras ``callbacks`` if any."""
        engine = self._engine_for(self._backend, lambda: keras_data.BatchSource(data).first()
                                  if keras_data.is_batches(data) else take(data, slice(0, 1)),
                                  "evaluate")
        with engine.leaving_no_trace(self._backend, "evaluate"):
            if callbacks is None:
                return self._backend.evaluate(chunks)
            logs = self._backend.evaluate(callbacks.validating(chunks))
            callbacks.validated(logs)
            return logs

    def fit(self, x=None, y=None, *, batch_size: int | None = None, micro_batch_size: int,
            epochs: int = 1, verbose="auto", callbacks=None, validation_split: float = 0.0,
            validation_data=None, shuffle: bool = True, class_weight=None, sample_weight=None,
            initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_batch_size: int | None = None, validation_steps: int | None = None,
            validation_freq=1, seed: int | None = None,
            drop_remainder: bool = False, progress=None, checkpoint_dir=None,
            checkpoint_every: int | None = None, keep_checkpoints: int = 3) -> History:
        """Trains as Keras's ``model.fit`` does, each batch one step over micro-batches.

        Keras's arguments with Keras's meanings; each batch is cut into
        micro-batches of ``micro_batch_size`` samples and applied as one
        :meth:`step`. Keras callbacks run as in ``model.fit``
        (:mod:`hostavg.keras.callbacks`); hostavg's hooks beside them. As
        :meth:`hostavg.Trainer.fit` for seeds, checkpoints and resuming, and MPI.

        Args:
          x, y, sample_weight: the data (:mod:`hostavg.keras.data`): arrays
            of N samples (a list of them in input order, or a dict by input
            name; a pandas DataFrame or Series, tensors), or a batched ``tf.data.Dataset`` or
            ``keras.utils.PyDataset`` whose every element, ``(x, y)`` or
            ``(x, y, sample_weight)``, is one step's batch.
          batch_size: samples per step (default 32, as Keras); None for a
            dataset, whose elements are the batches.
          micro_batch_size: samples per micro-batch (the device's load).
          epochs: train until this epoch (from ``initial_epoch``).
          verbose: "auto" (a bar on a terminal or in Jupyter, one line per
            epoch elsewhere), 0 (nothing), 1 (a bar), 2 (one line per epoch);
            ``progress``, where given, wins (True, False, "always", "epoch",
            "auto": :data:`hostavg.train.loop.PROGRESS_MODES`).
          callbacks: ``keras.callbacks.Callback`` objects (EarlyStopping,
            ModelCheckpoint, ReduceLROnPlateau, CSVLogger, TensorBoard,
            BackupAndRestore, LambdaCallback, your own) and hostavg hooks
            (:class:`~hostavg.core.results.Hook`), in any order.
          validation_split: the last fraction of array data (before shuffling)
            kept for validation, as Keras keeps it.
          validation_data: ``(x, y)``, ``(x, y, sample_weight)``, or a
            dataset; evaluated at each epoch's end (:meth:`evaluate`, in
            chunks of ``validation_batch_size``, default micro_batch_size, so
            that it fits where training does) into "val_loss" and "val_<metric>".
          validation_steps: how many of those chunks (a dataset's elements) to
            evaluate; None: all of them.
          validation_freq: validate every that many epochs (an int), or at the
            end of the epochs listed (counted from 1), as Keras.
          shuffle: reorder array samples (a PyDataset's batches) each pass,
            by ``seed``; a tf.data.Dataset's order is its own.
          class_weight: {class: weight}, each sample weighted by its class.
          initial_epoch: the epoch to start at (Keras's; a checkpoint in
            ``checkpoint_dir`` wins).
          steps_per_epoch: steps per epoch; the next epoch continues the data
            where this one stopped (an epoch ends early where the data does).
            Needed for an endless dataset.
          seed, drop_remainder, checkpoint_dir, checkpoint_every,
            keep_checkpoints: hostavg's, as :meth:`hostavg.Trainer.fit`. A
            checkpoint holds the steps' losses, not the compiled metrics'
            state: an epoch resumed midway reports its metrics over the steps
            after resuming.

        Returns:
          the :class:`~hostavg.History`: ``history.history`` (name -> one value
          per epoch, as Keras's) and ``history.epoch``, with every step's
          statistics besides.

        Raises:
          HostavgError: before training, for bad arguments or data (the
            validation data too); inside a ``tf.distribute`` strategy's scope
            (on JAX, under a ``keras.distribution``).
        """
        self._backend.refuse_strategies()
        progress = _PROGRESS[_verbose(verbose)] if progress is None else progress
        keras_callbacks, hooks = split_callbacks(callbacks)
        if keras_data.is_batches(x):
            if y is not None or sample_weight is not None:
                raise HostavgError(f"y and sample_weight come from the {type(x).__name__}'s "
                                   f"elements: leave them None")
            if validation_split:
                raise HostavgError("validation_split needs arrays; with a dataset, pass "
                                   "validation_data")
            data = x
        else:
            data = keras_data.samples(x, y, sample_weight)
            if validation_split and validation_data is None:  # as Keras: no class weights there
                data, validation_data = keras_data.split_validation(data, validation_split)
            data = keras_data.weighted(data, class_weight, "the data")
        batch_size = keras_data.checked_batch_size(batch_size, data)
        val = None if validation_data is None else keras_data.validation(validation_data)
        val_size = micro_batch_size if validation_batch_size is None else positive_int(
            "validation_batch_size", validation_batch_size)
        val_steps = None if validation_steps is None else positive_int("validation_steps",
                                                                        validation_steps)
        due = _validation_due(validation_freq)
        batches = keras_data.source(data, batch_size, shuffle,
                                    class_weight if keras_data.is_batches(data) else None)
        announced = None if not keras_callbacks else KerasCallbacks(
            keras_callbacks, self.model, epochs=epochs, verbose=_verbose(verbose),
            steps=steps_per_epoch or batches.num_batches(drop_remainder),
            validation_logs=self._backend.evaluation_results)

        def source():
            self._engine_for(self._backend, lambda: take(data, slice(0, 1))
                             if batch_size is not None else batches.first(), "fit, data")
            if val is not None:  # its first sample, before any epoch trains
                first = keras_data.BatchSource(val).first() if keras_data.is_batches(val) else val
                try:
                    self._evaluated([take(first, slice(0, 1))], val, None)
                except HostavgError as e:
                    raise HostavgError(f"fit, validation_data: {e}") from e.__cause__
            return batches

        def validate(epoch):
            if val is None or not due(epoch + 1):
                return {}
            return self._evaluated(keras_data.chunks(val, val_size, val_steps), val, announced)

        self.model.stop_training = False
        finalize = _Finalize(self.model)  # before the Keras callbacks hear of the end, as in Keras
        return self._fit(self._backend, source, validate, batch_size=batch_size,
                         micro_batch_size=micro_batch_size, epochs=epochs, seed=seed,
                         drop_remainder=drop_remainder,
                         callbacks=(*hooks, finalize) if announced is None
                         else (*hooks, finalize, announced),
                         progress=progress, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
                         initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch)

    def save(self, path) -> None:
        """Writes the model's and the optimizer's variables (weights, slots, iterations) to ``path``.

        One ``.npz`` file written atomically (:mod:`hostavg.train.checkpoint`),
        each variable by its position: ``model/<i>`` in ``model.variables`` and
        ``optimizer/<i>`` in ``optimizer.variables``, so a model built the same
        way in another process reads it, whatever names Keras gave its layers.
        """
        self._save(self._backend, path)

    def restore(self, path) -> dict | None:
        """Loads a checkpoint written by :meth:`save` or :meth:`fit`; returns fit's state or None.

        Raises:
          HostavgError: if it was written by a different model; nothing changes then.
        """
        return self._restore(self._backend, path)

    def _reset_metrics(self, backend) -> None:
        self.model.reset_metrics()

    def _training_metrics(self, backend) -> dict:
        return backend.training_results()

    def _stop_requested(self) -> str | None:
        return "model.stop_training was set (by a callback)" if self.model.stop_training else None

    def __repr__(self) -> str:
        known = "unknown until the first batch" if self._engine is None else len(self.spec)
        return (f"hostavg.keras.Trainer(model={self.model.name!r}, variables={known}, "
                f"accumulate={self.accumulate!r}, accum_dtype={self.accum_dtype}, "
                f"batch_norm={self.batch_norm!r})")


def step_together(steps: Sequence[tuple]) -> list[StepResult]:
    """Steps several Keras trainers from the same weights: all computed, then all applied.

    A GAN's simultaneous update, as :func:`hostavg.step_together` for TF1:
    every trainer's gradients are taken before any model changes, then the
    means are applied in order. Atomic: if any micro-batch of any trainer
    fails, nothing is applied and every trainer's rollback variables are
    restored.

    Args:
      steps: ``(trainer, batches)`` or ``(trainer, batches, sizes)`` per
        trainer, as :meth:`Trainer.step` takes them; applied in this order.

    Returns:
      one :class:`~hostavg.StepResult` per trainer, in order.

    Example::

        res_d, res_g = hostavg.keras.step_together([(d, d_batches), (g, g_batches)])
    """
    return engine_step_together([trainer._part(trainer._backend, _batches(batches, "step_together"),
                                               sizes)
                                 for trainer, batches, sizes in entries(steps, Trainer,
                                                                        "step_together")])


#: fit's progress for each of Keras's verbose modes.
_PROGRESS = {"auto": "auto", 0: False, 1: "always", 2: "epoch"}


def _verbose(verbose):
    """Keras's ``verbose``: "auto", 0, 1 or 2 (a bool as 0 or 1)."""
    if verbose not in _PROGRESS or isinstance(verbose, float):
        raise HostavgError(f"verbose must be 'auto', 0, 1 or 2, got {verbose!r}")
    return int(verbose) if not isinstance(verbose, str) else verbose


class _Finalize:
    """fit's end, as Keras's: ``optimizer.finalize_variable_values`` (an EMA optimizer's
    averages become the weights), whatever callbacks fit was given."""

    def __init__(self, model):
        self.model = model

    def on_train_end(self, history) -> None:
        self.model.optimizer.finalize_variable_values(self.model.trainable_weights)


def _validation_due(freq):
    """Whether an epoch (from 1) validates: every ``freq``-th (an int), or those in ``freq``."""
    if isinstance(freq, (list, tuple, set, frozenset)):
        epochs = {positive_int("validation_freq's epochs", e) for e in freq}
        return lambda epoch: epoch in epochs
    every = positive_int("validation_freq", freq)
    return lambda epoch: epoch % every == 0


def _batches(batches, call: str):
    """``batches`` checked to be a list of batches (not one batch, not a mapping)."""
    if isinstance(batches, tuple) and batches and not isinstance(batches[0], (tuple, list)):
        raise HostavgError(
            f"{call} takes a list of batches, one per micro-batch, got one batch (a tuple of "
            f"{', '.join(type(b).__name__ for b in batches)}); cut it with "
            f"hostavg.split((x, y), micro_batch_size)")
    if isinstance(batches, (Mapping, str)) or not isinstance(batches, Sequence):
        raise HostavgError(
            f"{call} takes a list of (x, y) batches, one per micro-batch, got "
            f"{type(batches).__name__}; cut one with hostavg.split((x, y), micro_batch_size)")
    return [structured(batch) for batch in batches]
