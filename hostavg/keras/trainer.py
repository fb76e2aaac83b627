"""The Keras 3 engine: a Keras model trained with gradients averaged on the host.

``import hostavg.keras`` (not imported by ``import hostavg``). The step engine
(:mod:`hostavg.engine`) runs every step as it does for a TF1 graph; this module
is its Keras backend (:class:`KerasBackend`) and the :class:`Trainer` face.

Per micro-batch, one compiled function (``tf.function``, traced once per
input structure with the batch dimension left open, so micro-batches of any
size share it) runs the forward pass with ``training=True``, the loss (plus
``model.losses``), the backward pass and the squared norm of every gradient,
and reads the optimizer's step. Its outputs cross to NumPy without a copy
(``np.asarray`` of a CPU tensor; from a GPU, one copy to the host) and are
frozen. A sparse gradient
(``IndexedSlices``, as an ``Embedding`` gives) has its duplicate rows summed
in the same function and stays sparse on the host.

The mean goes back through a second compiled function that takes the
gradients as inputs and calls ``optimizer.apply_gradients`` once, so
``optimizer.iterations`` grows by one per step; when no gradient is sparse it
is compiled with XLA, which fuses the optimizer's elementwise update into one
pass per variable. Sparse means go back as
``tf.IndexedSlices`` with unique indices: Keras 3's sparse update on
TensorFlow squares each row it is given, so rows repeated within one
IndexedSlices would make it differ from the dense step; with unique rows it
equals the dense full-batch step.

Requires Keras's TensorFlow backend (``KERAS_BACKEND=tensorflow``, the
default when JAX and PyTorch are absent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import keras
import numpy as np
import tensorflow as tf

from hostavg.core.check import CheckReport
from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.gradients import Gradients, SparseGradient, VariableSpec, coalesce_rows, freeze
from hostavg.core.results import StepResult
from hostavg.core.split import feed_size, take
from hostavg.core.stats import update_ratio
from hostavg.engine.protocols import Applied, Computed
from hostavg.engine.step import step_together as engine_step_together
from hostavg.tf1.graph import READ_OPS, first_line
from hostavg.train.history import History
from hostavg.train.loop import ArraySource
from hostavg.train.trainer import BaseTrainer, entries

__all__ = ["KerasBackend", "Trainer", "step_together"]

#: Keras loss reductions that give the micro-batch MEAN, sum_j w_j l_j / n_samples.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


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
      accumulate, accum_dtype, hooks, comm, update_ratios_every, overlap: as
        for every trainer (:class:`~hostavg.train.trainer.BaseTrainer`).
        ``average="graph"`` is TF1's alone: a Keras model's mean is computed
        by NumPy (or, with ``comm``, by MPI).

    Attributes:
      model, loss, optimizer: as given.
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
                 overlap: bool = False):
        if keras.backend.backend() != "tensorflow":
            raise HostavgError(f"hostavg.keras needs Keras's TensorFlow backend, got "
                               f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow before "
                               f"importing keras")
        if not isinstance(model, keras.Model):
            raise HostavgError(f"model must be a keras.Model, got {type(model).__name__}")
        super().__init__(accumulate=accumulate, accum_dtype=accum_dtype, hooks=hooks, comm=comm,
                         update_ratios_every=update_ratios_every, overlap=overlap)
        self.model, self.loss, self.optimizer = model, loss, _checked_optimizer(optimizer)
        self._backend = KerasBackend(model, _Loss(loss), self.optimizer)

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
        return self._check(self._backend, _batch(x, y, sample_weight), micro_batch_size)

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
        return self._evaluate(self._backend, _batch(x, y, sample_weight), batch_size)

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
        data = _batch(x, y, sample_weight)
        if validation_data is not None and (not isinstance(validation_data, (tuple, list))
                                            or len(validation_data) not in (2, 3)):
            raise HostavgError(f"validation_data must be (x, y) or (x, y, sample_weight), got "
                               f"{type(validation_data).__name__}")

        def source():
            batches = ArraySource(data, batch_size, shuffle)
            self._engine_for(self._backend, take(data, slice(0, 1)), "fit, data")
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
                f"accumulate={self.accumulate!r}, accum_dtype={self.accum_dtype})")


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


class KerasBackend:
    """A Keras model with its loss and optimizer: the engine's Keras backend (:class:`hostavg.engine.Backend`).

    Attributes:
      spec: name -> VariableSpec of every trained variable (None until the
        first batch is prepared).
      assigned: index in ``model.variables`` -> variable, for every
        non-trainable variable the traced gradient functions may assign (the
        rollback set).
      target: the model.
    """

    framework = "keras"

    def __init__(self, model, loss, optimizer):
        self.model, self.optimizer, self._loss = model, optimizer, loss
        self.target = model
        self.increment = 1  # every apply moves optimizer.iterations by one
        self.spec = None
        self.assigned = {}
        self._trained = None  # the variables of spec, in order
        self._computes, self._evaluates = {}, {}  # input signature -> compiled function
        # measure (bool) -> the compiled apply; whether its XLA compile was tried yet
        self._applies, self._jit_tried, self._apply_jit = {}, {}, False
        self._snapshot = {}

    # --- The engine's protocol ------------------------------------------------------------

    def prepare(self, batch, size, what: str) -> tuple:
        batch, leaves, signature = _leaves(batch, what)
        if size is None:
            n = feed_size(batch, what)
            if n < 1:
                raise HostavgError(f"{what}: a micro-batch must hold at least 1 sample, got {n}")
        else:
            n = positive_int(f"{what}: size", size)
        function = self._computes.get(signature)
        if function is None:
            function = self._computes[signature] = self._trace_compute(leaves, signature, what)
        return (function, leaves), n

    def compute(self, feed) -> Computed:
        function, leaves = feed
        with _tensorflow_errors("compute"):
            loss, step, sq_norms, *got = function(*map(_tensor, leaves))
        got = iter(got)
        grads = {}
        for name, s in self.spec.items():
            if s.sparse:
                indices = freeze(np.asarray(next(got)))
                grads[name] = SparseGradient(indices, freeze(np.asarray(next(got))), s.shape)
            else:
                grads[name] = freeze(np.asarray(next(got)))
        return Computed(float(loss), grads, int(step),
                        dict(zip(self.spec, np.asarray(sq_norms).tolist())))

    def apply_feed(self, feeds, what: str) -> dict:
        """Nothing: a Keras optimizer reads no input besides the gradients."""
        return {}

    def apply(self, mean: Mapping, feed: Mapping, measure: bool = True) -> Applied:
        """Applies ``mean`` once; reports the new ``optimizer.iterations``, the learning rate
        the apply used and, with ``measure``, the update-to-weight ratios, all from that one
        compiled call (measuring keeps each weight's value from before the update while the
        optimizer runs, and reduces two norms per variable)."""
        step, lr, squares = self._apply_mean(mean, measure)
        ratios = None
        if measure:
            squares, k = squares.tolist(), len(self.spec)
            ratios = {name: update_ratio(u, w)
                      for name, u, w in zip(self.spec, squares[:k], squares[k:])}
        return Applied(step, ratios, lr)

    def _apply_mean(self, mean: Mapping, measure: bool) -> tuple:
        """(iterations after, learning rate, squared norms of the updates then of the weights
        before, or an empty array) of one apply of ``mean``."""
        args = []
        for name, s in self.spec.items():
            value = mean[name]
            if s.sparse:  # Keras squares the rows it is given: they must be unique
                indices, values = value.indices, value.values
                if len(indices) > 1 and not np.all(indices[1:] > indices[:-1]):
                    indices, values = coalesce_rows(indices, values)
                args += [_tensor(indices, np.int64), _tensor(values, s.dtype)]
            else:
                args.append(_tensor(value, s.dtype))
        if measure not in self._applies:
            self._applies[measure] = self._trace(self._application(measure), self._apply_specs(),
                                                 "apply", jit_compile=self._apply_jit)
            self._jit_tried[measure] = not self._apply_jit
        if not self._jit_tried[measure]:
            self._jit_tried[measure] = True
            try:  # the first call compiles: an optimizer XLA cannot compile runs without it
                return _applied(self._applies[measure](*args))
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
                self._applies[measure] = self._trace(self._application(measure),
                                                     self._apply_specs(), "apply")
        with _tensorflow_errors("apply"):
            return _applied(self._applies[measure](*args))

    def global_step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def snapshot(self) -> dict:
        """The values of :attr:`assigned`; a function traced while the step prepares adds what it assigns."""
        self._snapshot = {i: v.numpy() for i, v in self.assigned.items()}
        return self._snapshot

    def restore(self, snapshot: dict) -> None:
        for i, value in snapshot.items():
            self.assigned[i].assign(value)

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

    # --- Evaluation and building -------------------------------------------------------------

    def evaluate(self, chunks: list, metrics=None) -> dict:
        """The sample-weighted mean loss over ``chunks`` (batches), and the compiled metrics'
        results (``metrics`` is TF1's: a Keras model's metrics are those it was compiled with)."""
        compiled = self.model.compiled
        if compiled:
            self.model.reset_metrics()
        total, count = 0.0, 0
        for i, chunk in enumerate(chunks):
            what = f"evaluate, chunk {i} of {len(chunks)}"
            chunk, leaves, signature = _leaves(chunk, what)
            function = self._evaluates.get(signature)
            if function is None:
                function = self._evaluates[signature] = self._trace(
                    self._evaluation(signature, compiled), leaves, what)
            n = feed_size(chunk, what)
            with _tensorflow_errors("evaluate"):
                total += n * float(function(*map(_tensor, leaves)))
            count += n
        out = {"loss": total / count}
        if compiled:
            out.update((name, float(value)) for name, value in self.model.get_metrics_result().items()
                       if name != "loss" and np.ndim(value) == 0)
        return out

    def build_optimizer(self) -> None:
        """Builds the optimizer with the model's trainable variables, as Keras's fit does."""
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    # --- Tracing --------------------------------------------------------------------------

    def _trace_compute(self, leaves, signature, what: str):
        """The gradient function for one input signature; the first one also fixes spec and apply."""
        x, _, w = _rebuild(signature, leaves)
        if w is not None and not self._loss.weighs_samples:
            raise HostavgError(
                f"{what}: the batch has sample weights, but the loss is a plain callable(y_true, "
                f"y_pred); pass a keras.losses.Loss, which weights samples")
        if not self.model.built:
            with _model_errors(what):
                self.model(x, training=False)  # creates the variables; assigns nothing
        self.build_optimizer()
        trainable = list(self.model.trainable_variables)
        if not trainable:
            raise HostavgError(f"{what}: the model has no trainable variables: nothing to train")
        seen = {}  # filled while tracing

        def gradients(*flat):
            x, y, w = _rebuild(signature, flat)
            with tf.GradientTape() as tape:
                loss = self._total_loss(y, self.model(x, training=True), w)
            seen["loss_shape"], seen["kept"] = loss.shape, []
            out, norms = [], []
            for i, g in enumerate(tape.gradient(loss, trainable)):
                if g is None:
                    continue
                seen["kept"].append((i, isinstance(g, tf.IndexedSlices)))
                if isinstance(g, tf.IndexedSlices):  # duplicate rows summed: unique rows
                    unique, rows = tf.unique(g.indices)
                    g = tf.math.unsorted_segment_sum(g.values, rows, tf.size(unique))
                    out.append(unique)
                out.append(g)
                norms.append(tf.cast(2 * tf.nn.l2_loss(g), tf.float64))  # one pass, no temporary
            return [loss, tf.convert_to_tensor(self.optimizer.iterations),
                    tf.stack(norms) if norms else tf.zeros(0, tf.float64), *out]

        function = self._trace(gradients, leaves, what)
        if seen["loss_shape"].rank != 0:
            raise HostavgError(
                f"{what}: the loss has shape {tuple(seen['loss_shape'])}, not a scalar; give the "
                f"micro-batch MEAN (a keras.losses.Loss reduces it)")
        if not seen["kept"]:
            raise HostavgError(f"{what}: nothing to train: no trainable variable of the model has "
                               f"a gradient with respect to the loss")
        spec = {trainable[i].path: VariableSpec(tuple(trainable[i].shape),
                                                np.dtype(trainable[i].dtype), sparse)
                for i, sparse in seen["kept"]}
        if self.spec is None:
            paths = [trainable[i].path for i, _ in seen["kept"]]
            shared = sorted({p for p in paths if paths.count(p) > 1})
            if shared:
                raise HostavgError(
                    f"trained variables share the paths {shared}; gradients are keyed by "
                    f"variable.path: give their layers distinct names")
            self.spec, self._trained = spec, [trainable[i] for i, _ in seen["kept"]]
            # XLA fuses the optimizer's elementwise update into one pass over each variable
            # (Adam on the 2M-parameter MLP: 3.8 ms against 9.6 ms); it needs fixed shapes,
            # so a model with sparse gradients (rows that vary in number) applies without it.
            self._apply_jit = not any(s.sparse for s in spec.values())
        elif spec != self.spec:
            raise HostavgError(
                f"{what}: with this batch's inputs the loss has gradients for other variables "
                f"({sorted(spec)}) than with the first batch's ({sorted(self.spec)}); give every "
                f"batch the same structure")
        self._note_assignments(function)
        return function

    def _trace(self, python_function, leaves, what: str, jit_compile: bool = False):
        """``python_function`` compiled for ``leaves``' dtypes and shapes, the batch dimension open.

        ``leaves`` are arrays (their axis 0 left open) or ready TensorSpecs.
        """
        specs = [a if isinstance(a, tf.TensorSpec) else
                 tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)) for a in leaves]
        with _model_errors(what):
            return _fast(tf.function(python_function, input_signature=specs,
                                     jit_compile=jit_compile).get_concrete_function())

    def _apply_specs(self) -> list:
        specs = []
        for s in self.spec.values():
            dtype = tf.as_dtype(s.dtype)
            specs += [tf.TensorSpec((None,), tf.int64), tf.TensorSpec((None,) + s.shape[1:], dtype)] \
                if s.sparse else [tf.TensorSpec(s.shape, dtype)]
        return specs

    def _application(self, measure: bool):
        spec, variables, optimizer = list(self.spec.values()), self._trained, self.optimizer

        def apply(*flat):
            flat, grads = iter(flat), []
            for s in spec:
                if s.sparse:
                    indices = next(flat)
                    grads.append(tf.IndexedSlices(next(flat), indices, tf.constant(s.shape, tf.int64)))
                else:
                    grads.append(next(flat))
            lr = tf.cast(optimizer.learning_rate, tf.float64)  # this iteration's (a schedule's too)
            before = [tf.identity(v.value) for v in variables] if measure else []
            optimizer.apply_gradients(zip(grads, variables))
            squares = tf.zeros(0, tf.float64)
            if measure:  # the reads of ``before`` precede the update: it waits for them
                squares = tf.stack([_sum_squares(v.value, b) for v, b in zip(variables, before)]
                                   + [_sum_squares(b) for b in before])
            return tf.convert_to_tensor(optimizer.iterations), lr, squares
        return apply

    def _evaluation(self, signature, compiled: bool):
        def evaluation(*flat):
            x, y, w = _rebuild(signature, flat)
            y_pred = self.model(x, training=False)
            if compiled:
                self.model.compute_metrics(x, y, y_pred, sample_weight=w)
            return self._total_loss(y, y_pred, w)
        return evaluation

    def _total_loss(self, y, y_pred, w):
        loss = self._loss(y, y_pred, w)
        extra = self.model.losses
        if extra:
            loss = loss + tf.add_n([tf.cast(tf.reduce_sum(e), loss.dtype) for e in extra])
        return loss

    def _note_assignments(self, function) -> None:
        """Adds the non-trainable variables ``function`` may assign to :attr:`assigned` (and to the step's snapshot)."""
        inner = {t.ref() for op in function.graph.get_operations() if op.type not in READ_OPS
                 for t in op.inputs if t.dtype == tf.resource}
        handles = {id(outer) for outer, captured in function.graph.captures
                   if captured.ref() in inner}
        for i, v in enumerate(self.model.variables):
            if not v.trainable and i not in self.assigned and id(v.value.handle) in handles:
                self.assigned[i] = v
                self._snapshot[i] = v.numpy()  # the step being prepared has not computed yet


_EagerTensor = type(tf.constant(0.0))
with tf.device("CPU:0"):
    _HOST = tf.constant(0.0).device  # the host's device name; a call copies to a GPU itself


def _tensor(array: np.ndarray, dtype=None):
    """``array`` as an eager tensor (cast to ``dtype``), sharing its memory where TensorFlow can.

    ``tf.convert_to_tensor`` copies every NumPy array first, in case the caller
    changes it later: a page-faulting copy of each gradient per apply (4 ms a
    step on the 2M-parameter MLP). Building the tensor directly shares a
    64-byte aligned array's memory, as a TF1 session's feed does; hostavg's
    means are aligned and frozen (:func:`~hostavg.accumulator.aligned_empty`),
    and what a call takes is read only for the call.
    """
    dtype = tf.as_dtype(array.dtype if dtype is None else dtype)
    return _EagerTensor(array, _HOST, dtype.as_datatype_enum)


def _fast(concrete):
    """A ConcreteFunction as a callable of tensors in its signature's order.

    A ConcreteFunction's ``__call__`` binds and casts its arguments in Python,
    about 0.13 ms a call (measured on the 50k-parameter MLP: 0.49 ms a
    micro-batch against 0.37 ms); its ``_call_flat`` takes the tensors as they
    are, and every caller here passes exactly the signature's dtypes. Where
    TensorFlow no longer has it, the public call serves.
    """
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None:
        return concrete
    captured = concrete.captured_inputs

    def call(*tensors):
        return call_flat(list(tensors), captured)
    call.graph = concrete.graph
    return call


def _applied(out) -> tuple:
    """(iterations, learning rate, squares) of a compiled apply's outputs, on the host."""
    step, lr, squares = out
    return int(step), float(lr), np.asarray(squares)


def _sum_squares(x, minus=None):
    """sum((x - minus)^2), or sum(x^2), in float64 (TF1's backend reduces in the variable's
    dtype, float32 at least; Keras variables are few and this runs only when measuring)."""
    x = tf.cast(x, tf.float64)
    if minus is None:
        return tf.reduce_sum(tf.square(x))
    return tf.reduce_sum(tf.math.squared_difference(x, tf.cast(minus, tf.float64)))


def _batch(x, y, sample_weight) -> tuple:
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def _leaves(batch, what: str) -> tuple:
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
            array = np.asarray(value)
            if array.ndim < 1:
                raise HostavgError(f"{what}: {label} is not an array of samples (got "
                                   f"{type(value).__name__} of shape {array.shape}); axis 0 of "
                                   f"every array runs over the batch's samples")
            leaves.append(array)
    signature = (tuple(layout), tuple((a.dtype.str, a.shape[1:]) for a in leaves))
    return batch, leaves, signature


def _rebuild(signature, flat) -> tuple:
    """(x, y, sample_weight or None) from the arrays or tensors ``flat``, laid out as ``signature`` says."""
    flat, parts = iter(flat), []
    for keys in signature[0]:
        parts.append(next(flat) if keys is None else {k: next(flat) for k in keys})
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


class _Loss:
    """A trainer's loss, normalised once: ``loss(y, y_pred, sample_weight or None)`` -> the micro-batch mean.

    Attributes:
      weighs_samples: whether it takes sample weights (a ``keras.losses.Loss``
        does; a plain callable(y_true, y_pred) does not).
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

    def __call__(self, y, y_pred, sample_weight):
        if self.weighs_samples:
            return self._loss(y, y_pred, sample_weight=sample_weight)
        return self._loss(y, y_pred)


def _checked_optimizer(optimizer):
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


@contextmanager
def _tensorflow_errors(call: str):
    """Turns what a compiled call raises into a HostavgError saying what to do."""
    try:
        yield
    except tf.errors.OpError as error:
        said = f"{type(error).__name__}: {first_line(error)}"
        if isinstance(error, tf.errors.InvalidArgumentError):
            raise HostavgError(f"TensorFlow refused the {call} ({said}); check that "
                               f"micro-batch's x and y") from error
        raise HostavgError(f"TensorFlow failed in the {call} ({said})") from error


@contextmanager
def _model_errors(what: str):
    """Turns an error building or tracing the model on a batch into a HostavgError naming the batch."""
    try:
        yield
    except HostavgError:
        raise
    except Exception as error:
        raise HostavgError(
            f"{what}: the model cannot run on this batch ({type(error).__name__}: "
            f"{_message(error)}); check its x and y against the model's inputs and the loss") \
            from error


def _message(error) -> str:
    """What went wrong, from an error raised while tracing (autograph wraps it in a traceback)."""
    text = str(error).strip()
    if not text.startswith("in user code:"):
        return first_line(error)
    last = text.splitlines()[-1].strip()  # "ValueError: what went wrong"
    return last.removeprefix(f"{type(error).__name__}: ")
