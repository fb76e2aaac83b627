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
from hostavg.core.errors import HostavgError
from hostavg.core.gradients import Gradients
from hostavg.core.results import StepResult
from hostavg.core.split import take
from hostavg.engine.step import step_together as engine_step_together
from hostavg.keras.common import BATCH_NORM_MODES, Loss, as_batch, checked_optimizer
from hostavg.train.history import History
from hostavg.train.loop import ArraySource
from hostavg.train.trainer import BaseTrainer, entries

__all__ = ["Trainer", "step_together"]

#: Keras's backend -> (module, class) of hostavg's backend for it, imported when a trainer is made.
_BACKENDS = {"tensorflow": ("hostavg.keras.tensorflow", "KerasBackend"),
             "jax": ("hostavg.keras.jax", "KerasJaxBackend")}


class Trainer(BaseTrainer):
    """Trains a Keras 3 model with gradients averaged on the host.

    One optimizer step runs k micro-batches through forward and backward,
    fetching each one's gradients to NumPy; their sample-weighted mean
    ``sum_i n_i g_i / sum_i n_i`` (g_i: the gradient of micro-batch i's MEAN
    loss, n_i: its samples) is applied by the optimizer once. That equals
    Keras's own ``train_on_batch`` on the concatenated batch for any
    optimizer (with sample weights too: Keras's mean divides the weighted sum
    by the number of samples), and ``optimizer.iterations`` grows by one.

    The same trainer contract as :class:`hostavg.Trainer`
    (:class:`~hostavg.train.trainer.BaseTrainer`): the same methods with the
    same meaning and results; only the data differs. A batch is a tuple
    ``(x, y)`` or ``(x, y, sample_weight)``; x is an array or, for a
    multi-input model, a dict of arrays by input name; y is an array (or a
    dict, for a loss that takes one). Every array's axis 0 runs over samples.
    ``hostavg.split((x, y), 32)`` cuts one into micro-batches.

    The trainer learns the model's gradients on the first batch it sees (the
    compiled gradient function is traced then, and an unbuilt model is built
    by one forward pass with ``training=False``): :attr:`spec`,
    :meth:`accumulator` and :meth:`apply` need a batch to have been seen
    (by :meth:`compute`, :meth:`step`, :meth:`fit` or :meth:`evaluate`).
    (Which variables have a gradient, and which gradients are sparse, is
    known only by tracing the loss on data.)

    Args:
      model: a ``keras.Model``.
      loss: a ``keras.losses.Loss`` with reduction "sum_over_batch_size" (the
        default), called as ``loss(y, y_pred, sample_weight=w)``, or a
        callable ``(y_true, y_pred)`` giving the micro-batch MEAN (then
        batches carry no sample weights). ``model.losses`` (regularisation)
        are added to it, as Keras does.
      optimizer: a ``keras.optimizers.Optimizer`` without
        ``gradient_accumulation_steps`` (hostavg accumulates). It is built
        with the model's trainable variables, as Keras's fit builds it.
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
      model, loss, optimizer, batch_norm: as given.
      spec: name (``variable.path``) -> :class:`~hostavg.VariableSpec` of every
        trained variable: the trainable variables that have a gradient.
      hooks: the hooks, in the order they run.
      rollback_variables: the variables a failed step restores: those that
        the gradient function assigns (batch-norm moving statistics, dropout
        seed states), found in its traced graph. Frozen weights, which it
        only reads, are not among them.
      comm: the communicator, or None.

    Example::

        trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), keras.optimizers.Adam(1e-3))
        res = trainer.step(hostavg.split((x, y), 32))
    """

    def __init__(self, model, loss, optimizer, *, accumulate: str = "sum", accum_dtype=None,
                 hooks=(), comm=None, update_ratios_every: int | None = None,
                 overlap: bool = False, batch_norm: str = "micro"):
        backend = _BACKENDS.get(keras.backend.backend())
        if backend is None:
            raise HostavgError(f"hostavg.keras runs on Keras's {' or '.join(_BACKENDS)} backend, "
                               f"got {keras.backend.backend()!r}; set KERAS_BACKEND to one of "
                               f"them before importing keras")
        if not isinstance(model, keras.Model):
            raise HostavgError(f"model must be a keras.Model, got {type(model).__name__}")
        if type(model).train_step is not keras.Model.train_step:
            raise HostavgError(
                f"model {model.name!r} overrides train_step, which hostavg cannot run: a step here "
                f"is micro-batches computed one by one and one apply; override compute_loss "
                f"instead (Keras 3's customisation point for the loss)")
        if batch_norm not in BATCH_NORM_MODES:
            raise HostavgError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}")
        if batch_norm == "step" and comm is not None:
            raise HostavgError("batch_norm='step' combines the moments of every micro-batch of a "
                               "step, but with comm= each rank sees only its own: use "
                               "batch_norm='micro'")
        super().__init__(accumulate=accumulate, accum_dtype=accum_dtype, hooks=hooks, comm=comm,
                         update_ratios_every=update_ratios_every, overlap=overlap)
        self.model, self.loss, self.optimizer = model, loss, checked_optimizer(optimizer)
        self.batch_norm = batch_norm
        if keras.backend.backend() == "tensorflow":
            self._backend = getattr(importlib.import_module(backend[0]), backend[1])(
                model, Loss(loss), self.optimizer, batch_norm)
        elif batch_norm != "micro":
            raise HostavgError(f"batch_norm={batch_norm!r} is built for Keras's TensorFlow backend "
                               f"only; on {keras.backend.backend()!r} use batch_norm='micro'")
        else:
            self._backend = getattr(importlib.import_module(backend[0]), backend[1])(
                model, Loss(loss), self.optimizer)

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
        return self._compute(self._backend, batch, size)

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
        return self._check(self._backend, as_batch(x, y, sample_weight), micro_batch_size)

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
        return self._per_sample(self._backend, batch)

    def evaluate(self, x, y, *, batch_size: int, sample_weight=None) -> dict:
        """The loss, and the metrics the model was compiled with, over ``(x, y)``; changes nothing.

        Runs the model with ``training=False`` in chunks of ``batch_size``
        samples. The loss (with ``model.losses``) is the sample-weighted mean
        over the chunks; compiled metrics (``model.compile(metrics=[...])``)
        are Keras's own, reset first and updated chunk by chunk. What the
        forward pass assigns is restored.

        Returns:
          {"loss": ..., **{metric name: ...}} as floats.
        """
        return self._evaluate(self._backend, as_batch(x, y, sample_weight), batch_size)

    def fit(self, x, y, *, batch_size: int, micro_batch_size: int, epochs: int = 1,
            sample_weight=None, shuffle: bool = True, seed: int | None = None,
            drop_remainder: bool = False, validation_data=None, callbacks=(), progress=True,
            checkpoint_dir=None, checkpoint_every: int | None = None,
            keep_checkpoints: int = 3) -> History:
        """Trains over ``(x, y)`` for ``epochs``: batches of ``batch_size`` samples, each one step.

        As :meth:`hostavg.Trainer.fit` (see there for shuffling, seeds,
        callbacks, progress, checkpoints and resuming, and MPI), over arrays:
        each batch is cut into micro-batches of ``micro_batch_size`` and
        applied as one :meth:`step`.

        Args:
          x, y, sample_weight: arrays of N samples (x may be a dict of arrays).
          validation_data: ``(x, y)`` or ``(x, y, sample_weight)``, evaluated at
            each epoch's end (:meth:`evaluate`, in chunks of micro_batch_size)
            into the epoch's "val_loss" and "val_<metric>".

        Returns:
          the :class:`~hostavg.History`.
        """
        data = as_batch(x, y, sample_weight)
        if validation_data is not None and (not isinstance(validation_data, (tuple, list))
                                            or len(validation_data) not in (2, 3)):
            raise HostavgError(f"validation_data must be (x, y) or (x, y, sample_weight), got "
                               f"{type(validation_data).__name__}")

        def source():
            batches = ArraySource(data, batch_size, shuffle)
            self._engine_for(self._backend, take(data, slice(0, 1)), "fit, data")
            if validation_data is not None:  # its first sample, before any epoch trains
                first = take(as_batch(validation_data[0], validation_data[1],
                                      validation_data[2] if len(validation_data) == 3 else None),
                             slice(0, 1))
                try:
                    self._evaluate(self._backend, first, 1)
                except HostavgError as e:
                    raise HostavgError(f"fit, validation_data: {e}") from e.__cause__
            return batches

        def validate():
            if validation_data is None:
                return {}
            return self.evaluate(*validation_data[:2], batch_size=micro_batch_size,
                                 sample_weight=validation_data[2] if len(validation_data) == 3
                                 else None)

        return self._fit(self._backend, source, validate, batch_size=batch_size,
                         micro_batch_size=micro_batch_size, epochs=epochs, seed=seed,
                         drop_remainder=drop_remainder, callbacks=callbacks, progress=progress,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                         keep_checkpoints=keep_checkpoints)

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
    return batches
