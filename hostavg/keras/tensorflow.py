"""hostavg.keras on Keras's TensorFlow backend: :class:`KerasBackend`, the engine's backend for a Keras model.

Per micro-batch one ``tf.function`` (traced once per input structure, the
batch dimension open) runs what Keras's own ``train_step`` runs up to the
apply: the forward pass with ``training=True``, ``compute_loss`` (scaled by a
``LossScaleOptimizer`` and unscaled again), the compiled metrics' update,
every gradient's squared norm. A sparse gradient has its duplicate rows
summed there and stays sparse on the host. The mean goes back through a
second compiled function that calls ``optimizer.apply_gradients`` once (with
XLA when no gradient is sparse); sparse means go back with unique indices,
so the step equals the dense full-batch step.

Batch norm (``batch_norm``, one of :data:`~hostavg.keras.common.BATCH_NORM_MODES`):
"micro" moves the moving statistics once per micro-batch, as Keras does;
"step" moves them once per step, by the whole batch's moments.

See docs/guides/keras.md for loss scaling, evaluation, metrics and the
batch-norm maths.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import contextmanager

import keras
import numpy as np
import tensorflow as tf

from hostavg.compat.tensorflow import (READ_OPS, concrete_call, eager_tensor, finite_flags,
                                       first_line, largest_magnitudes, magnitude_ends, rows_fed,
                                       rows_of, sample_squares)
from hostavg.core.blas import need_one_blas_thread
from hostavg.core.errors import ArgumentError, HostavgError, StepError, refused
from hostavg.core.gradients import SparseGradient, coalesce_rows, freeze
from hostavg.engine.protocols import Applied, ApplyRequest, Computed, NotVectorized, SampleSums
from hostavg.keras.batch import leaves as _leaves
from hostavg.keras.batch import rebuild as _rebuild
from hostavg.keras.common import (ApplyOutputs, CompiledModel, loss_function, model_errors,
                                  traced_message)
from hostavg.keras.layer_taps import LayerTaps, per_sample_dots
from hostavg.keras.train_step import OwnStep, captured, flat_logs, loss_tracker, micro_loss, the_apply

__all__ = ["KerasBackend", "KerasTrainStepBackend", "refuse_strategies"]


class KerasBackend(CompiledModel):
    """A compiled Keras model and its optimizer: the engine's Keras backend (:class:`hostavg.engine.protocols.Backend`).

    Args:
      model: as :class:`hostavg.keras.Trainer` takes it; compiled with ``loss``
        and ``optimizer`` (:func:`~hostavg.keras.common.compiled`).
      loss: as :class:`hostavg.keras.Trainer` takes it.
      optimizer: as :class:`hostavg.keras.Trainer` takes it.
      batch_norm: one of :data:`~hostavg.keras.common.BATCH_NORM_MODES` (see the module
        docstring).
      check_applied: as :class:`hostavg.keras.Trainer` takes it.

    Attributes:
      model: the model.
      optimizer: the optimizer that trains (``model.optimizer``).
      spec: name -> VariableSpec of every trained variable (None until the
        first batch is prepared).
      assigned: id -> variable, for every non-trainable variable of the model,
        and every metric variable, that the traced gradient functions may
        assign (the rollback set).
      trained_metrics, evaluated_metrics: the ids of the model's metrics (of
        ``model.metrics``) that the gradient functions, and the evaluation
        functions, update.
      target: the model.
      nonfinite: "optimizer" for a ``LossScaleOptimizer`` (it skips a
        non-finite step and lowers its scale), else "refuse".
      batch_norm: as given.
    """

    def __init__(self, model, loss, optimizer, batch_norm: str = "micro",
                 check_applied: bool = True):
        super().__init__(model, loss, optimizer, check_applied)
        self._loss = loss_function(model)
        self.assigned = {}
        self._trained = None  # the variables of spec, in order
        self._evaluates = {}  # input signature -> compiled function
        self._products = {}  # input signature -> compiled Hessian-vector product
        self._samples = {}  # (input signature, "sums", "own" or "dots") -> compiled function
        # ApplyRequest -> the compiled apply; whether its XLA compile was tried yet
        self._applies, self._jit_tried, self._apply_jit = {}, {}, False
        self._rows = None  # what an apply keeps of each variable it holds (_rows_written)
        self._last_rate = None  # the learning rate the last apply used
        self._snapshot = _Snapshot()
        self.batch_norm = batch_norm
        # "step": (moving mean, moving variance, momentum) per BatchNormalization layer, found
        # when the first gradient function is traced; and per micro-batch computed since the
        # last apply, (its rows, the moving values it would have assigned, in that order).
        self._norms, self._moved = [], []

    # --- The engine's protocol ------------------------------------------------------------

    def random_ops(self) -> tuple:
        return ()  # the check names Keras's random layers in its advice

    def compute(self, feed, share: float = 1.0) -> Computed:
        (function, names), leaves, _ = feed
        args = [*map(eager_tensor, leaves)]
        if self._scales:  # the micro-batch's part of the step's loss scale (see Backend.compute)
            args.append(eager_tensor(np.float32(share)))
        with _tensorflow_errors("compute"):
            loss, step, sq_norms, *got = function(*args)
        got = iter(got)
        grads = {}
        for name, s in self.spec.items():
            if s.sparse:
                indices = freeze(np.asarray(next(got)))
                grads[name] = SparseGradient(indices, freeze(np.asarray(next(got))), s.shape)
            else:
                grads[name] = freeze(np.asarray(next(got)))
        rest = [np.asarray(v) for v in got]
        self._took(names, rest)  # a train_step's logs
        if self._norms:  # "step": the moving values it would have assigned, for the apply
            self._moved.append((len(leaves[0]), [v.astype(np.float64) for v in rest]))
        return Computed(float(loss), grads, int(step),
                        dict(zip(self.spec, np.asarray(sq_norms).tolist())))

    def _product(self, feed, vector: Mapping) -> tuple[float, dict]:
        """(the loss, name -> H v) of one micro-batch, from a ``tf.function`` traced once per
        input signature (:meth:`_hvp_function`)."""
        _, leaves, signature = feed
        function = self._products.get(signature)
        if function is None:
            specs = [tf.TensorSpec(s.shape, tf.as_dtype(s.dtype)) for s in self.spec.values()]
            function = self._products[signature] = self._trace(
                self._hvp_function(signature), [*leaves, *specs], "hvp")
            self._note_assignments(function)
        with _tensorflow_errors("hvp"):
            loss, *products = function(*map(eager_tensor, leaves), *(
                eager_tensor(vector[name], s.dtype) for name, s in self.spec.items()))
        return float(loss), {name: np.asarray(p) for name, p in zip(self.spec, products)}

    def _hvp_function(self, signature):
        """``(*leaves, *v) -> [loss, *H v]``: the gradient of ``sum(g * v)`` by a tape around
        the tape of g (a sparse g's rows dotted with v's rows), dense; the forward pass in
        training mode, no metric updated."""
        model, trained, k = self.model, self._trained, len(self.spec)

        def product(*flat):
            x, y, w = _rebuild(signature, flat[:-k])
            vs = flat[-k:]
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    loss = self._loss(x, y, model(x, training=True), w)
                dot = tf.add_n([tf.reduce_sum(g.values * tf.gather(v, g.indices))
                                if isinstance(g, tf.IndexedSlices) else tf.reduce_sum(g * v)
                                for g, v in zip(inner.gradient(loss, trained), vs)])
            return [loss, *(tf.zeros_like(v) if p is None else tf.convert_to_tensor(p)
                            for p, v in zip(outer.gradient(dot, trained), vs))]
        return product

    def sample_sums(self, feed, dotted: bool = False) -> SampleSums:
        """See :class:`~hostavg.engine.protocols.Vectorized`: ``tf.vectorized_map`` of one
        sample's loss and gradient in a ``tf.function``, reduced there in the gradients' dtype
        (as a batch's gradient sums its samples), then cast to float64; with ``dotted``, each
        gradient dotted with their sum there too."""
        losses, sq, *sums = self._per_sample_call(feed, "own" if dotted else "sums", [])
        dots = np.asarray(sums.pop(), np.float64) if dotted else None
        return SampleSums(np.asarray(losses, np.float64), np.asarray(sq),
                          {name: np.asarray(s) for name, s in zip(self.spec, sums)}, dots)

    def sample_dots(self, feed, mean: Mapping) -> np.ndarray:
        """See :class:`~hostavg.engine.protocols.Vectorized`: g_i . ``mean`` as the derivative of
        each sample's loss along ``mean`` (in the variables' dtypes), forward mode
        (``tf.autodiff.ForwardAccumulator``) under ``tf.vectorized_map``: no sample's gradient
        is formed."""
        return np.asarray(self._per_sample_call(
            feed, "dots", [eager_tensor(mean[name], np.float64) for name in self.spec])[0],
            np.float64)

    def _per_sample_call(self, feed, kind: str, extra: list):
        """The compiled ``kind`` function of the feed's signature (:meth:`_sample_function`)
        called on the feed's arrays and ``extra``."""
        _, leaves, signature = feed
        self.vectorizable()
        function = self._samples.get((signature, kind))
        if function is None:
            function = self._samples[signature, kind] = self._sample_trace(leaves, signature, kind)
        with _tensorflow_errors("per_sample"):
            return function(*map(eager_tensor, leaves), *extra)

    def _sample_trace(self, leaves, signature, kind: str):
        """:meth:`_sample_function` of ``kind`` traced for the feed's ``leaves``; "sums" and
        "own" with the eligible ``Dense`` and convolution layers tapped
        (:mod:`hostavg.keras.layer_taps`) whose kernel and bias the loss reads nowhere else
        (traced again without those it does, or does not call)."""
        means = [tf.TensorSpec(s.shape, tf.float64) for s in self.spec.values()]
        taps = LayerTaps(self.model, self._trained) if kind != "dots" else None
        while True:
            read = []  # the taps' layers whose weights the loss reads elsewhere, while tracing
            try:
                function = self._trace(self._sample_function(signature, kind, taps, read),
                                       [*leaves, *(means if kind == "dots" else [])], "per_sample")
            except HostavgError as e:
                if taps:  # the taps' doing (a Dense in a loop's body, say): untapped
                    taps = taps.without(taps.layers)
                    continue
                raise NotVectorized(f"tf.vectorized_map of the model's one-sample gradient "
                                    f"failed: {e}") from e
            if not read:
                return function
            taps = taps.without(read)

    def _sample_function(self, signature, kind: str, taps: LayerTaps | None = None,
                         read: list | None = None):
        """``(*leaves) -> [losses, squared norms, *sums]`` ("sums"; "own": and each g_i . their
        sum, from the gradients the sums form) or ``(*leaves, *mean) -> [g_i . mean]``
        ("dots"): every sample computed alone (a batch of one) under
        ``tf.vectorized_map``, in a ``keras.StatelessScope`` (it assigns nothing).

        A squared norm is summed in the gradient's dtype, and again in float64 where that
        overflows (or a NaN is met), so that a finite gradient's norm is finite. The squared
        norms and sums of ``taps``' layers come from a and delta (:func:`_tapped_one`); where
        the loss reads one's weights elsewhere, its layer is added to ``read`` while tracing."""
        model, trained, optimizer, scales = self.model, self._trained, self.optimizer, self._scales
        k = len(trained)

        def forward(leaves):
            """One sample's loss, in a ``StatelessScope`` that reads every variable's value (a
            weight regularizer reads its variable there), keeps what would be assigned and
            collects what layers add (an activity regularizer's loss, which ``model.losses``
            then reads from it; a scope that does not collect drops it)."""
            x, y, w = _rebuild(signature, [leaf[None] for leaf in leaves])
            with keras.StatelessScope(state_mapping=[(v, v.value) for v in model.variables],
                                      collect_losses=True):
                return self._loss(x, y, model(x, training=True), w)

        def unscaled(grads):
            return [g / tf.cast(_scale(optimizer), g.dtype) for g in grads] if scales else grads

        def scaled(loss):
            return optimizer.scale_loss(loss) if scales else loss

        def one(leaves):
            with tf.GradientTape() as tape:
                loss = forward(leaves)
                optimized = scaled(loss)
            return loss, [tf.reshape(g, [-1]) for g in unscaled(tape.gradient(optimized, trained))]

        def sums(*flat):
            flat, own = list(flat), kind == "own"
            if taps:
                losses, grads, inputs, deltas = tf.vectorized_map(
                    lambda leaves: _tapped_one(taps, trained, forward, scaled, unscaled, read,
                                                leaves), flat)
                if read:  # traced again without those layers (_sample_trace)
                    return [losses]
            else:
                (losses, grads), inputs, deltas = tf.vectorized_map(one, flat), [], []
            total = [tf.reduce_sum(g, 0) for g in grads]
            tapped, total, dots = taps.sums(total, inputs, deltas, tf.float64, own) if taps \
                else (None, total, None)
            sq = sample_squares(tf.zeros_like(losses, tf.float64) if tapped is None else tapped,
                                grads)
            out = [losses, sq, *(tf.cast(tf.reshape(g, v.shape), tf.float64)
                                 for g, v in zip(total, trained))]
            if not own:
                return out
            parts = [d for d in (dots,) if d is not None]
            parts += [per_sample_dots(g, tf.reshape(total[p], [-1]), tf.float64)
                      for g, p in zip(grads, taps.untapped(k) if taps else range(k))]
            return [*out, tf.add_n(parts)]

        def dots(*flat):
            tangents = [tf.cast(m, v.dtype) for m, v in zip(flat[-k:], trained)]

            def along(leaves):
                with tf.autodiff.ForwardAccumulator([v.value for v in trained], tangents) as acc:
                    loss = forward(leaves)
                return tf.cast(acc.jvp(loss, unconnected_gradients="zero"), tf.float64)
            return [tf.vectorized_map(along, list(flat[:-k]))]

        return dots if kind == "dots" else sums

    def apply_feed(self, feeds, what: str) -> dict:
        """Nothing: a Keras optimizer reads no input besides the gradients."""
        return {}

    def apply(self, mean: Mapping, feed: Mapping, request: ApplyRequest) -> Applied:
        """Applies ``mean`` once; reports the new ``optimizer.iterations``, the learning rate
        the apply used and what ``request`` asks for, all from that one compiled call
        (measuring the ratios keeps each weight's value from before the update while the
        optimizer runs, and reduces two norms per variable); or that a
        ``LossScaleOptimizer`` skipped the step, and the scale it left."""
        out = self._apply_mean(mean, request)
        if not out.ran:  # proven for a lower learning rate than it met: checked instead
            out = self._apply_mean(mean, request._replace(proven=False, magnitudes=True))
        self._last_rate = out.learning_rate
        applied = self._report(out, request, self._trained)
        if not applied.nonfinite:  # else undone: the step fails, and its snapshot is restored
            self._move_norms()  # "step": moved by the forward passes, skipped or not, as in Keras
        return applied

    def _rate_bound(self, feed) -> float | None:
        """Twice the learning rate the last apply used (None before one): reading the rate on
        the host costs about half an apply here, so a proven apply is given this bound and
        runs only where the rate it meets is within it (else it is run checked)."""
        return None if self._last_rate is None else 2.0 * abs(self._last_rate)

    def _apply_mean(self, mean: Mapping, request: ApplyRequest) -> ApplyOutputs:
        """What one compiled apply of ``mean``, asked for ``request``, gives back, on the host."""
        args = []
        for name, s in self.spec.items():
            value = mean[name]
            if s.sparse:  # Keras squares the rows it is given: they must be unique
                indices, values = coalesce_rows(value.indices, value.values)
                args += [eager_tensor(indices, np.int64), eager_tensor(values, s.dtype)]
            else:
                args.append(eager_tensor(value, s.dtype))
        request = self.traced(request)
        if request.proven:  # the learning rate it was proven for
            args.append(eager_tensor(np.float64(self._rate_bound(None)), np.float64))
        if request not in self._applies:
            self._applies[request] = self._trace(self._application(request),
                                                 self._apply_specs(request), "apply",
                                                 jit_compile=self._apply_jit)
            self._jit_tried[request] = not self._apply_jit
        if not self._jit_tried[request]:
            self._jit_tried[request] = True
            try:  # the first call compiles: an optimizer XLA cannot compile runs without it
                return _on_host(self._applies[request](*args))
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
                self._applies[request] = self._trace(self._application(request),
                                                     self._apply_specs(request), "apply")
        with _tensorflow_errors("apply"):
            return _on_host(self._applies[request](*args))

    def _move_norms(self) -> None:
        """"step": moves every BatchNormalization layer's moving mean and variance once, by the
        whole batch's moments, from the micro-batches computed since the last apply."""
        need_one_blas_thread()
        moved, self._moved = self._moved, []
        if not moved:
            return
        rows = np.array([n for n, _ in moved], np.float64)
        weights = rows / rows.sum()
        for j, (mean, variance, momentum) in enumerate(self._norms):
            if momentum == 1:  # moving statistics that never move
                continue
            means = np.stack([values[2 * j] for _, values in moved])
            variances = np.stack([values[2 * j + 1] for _, values in moved])
            new_mean = np.tensordot(weights, means, 1)
            spread = np.tensordot(weights, (means - new_mean) ** 2, 1) / (1 - momentum)
            mean.assign(new_mean.astype(mean.dtype))
            variance.assign((np.tensordot(weights, variances, 1) + spread).astype(variance.dtype))

    def global_step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def snapshot(self) -> dict:
        """The values of :attr:`assigned` (and, in "step", how many micro-batches' moments wait
        for the apply); a function traced while the step prepares adds what it assigns."""
        self._snapshot = _Snapshot({i: v.numpy() for i, v in self.assigned.items()})
        self._snapshot.moved = len(self._moved)
        return self._snapshot

    def restore(self, snapshot: dict) -> None:
        for i, value in snapshot.items():
            self.assigned[i].assign(value)
        del self._moved[snapshot.moved:]  # "step": micro-batches computed since, forgotten

    def refuse_strategies(self) -> None:
        """Raises HostavgError inside a ``tf.distribute`` strategy's scope (see :func:`refuse_strategies`)."""
        refuse_strategies(self.model)

    # --- Evaluation and building -------------------------------------------------------------

    def evaluate_chunk(self, chunk, what: str) -> None:
        """Runs ``test_step`` on one chunk (its metrics are updated, not reset)."""
        _, leaves, signature = _leaves(chunk, what)
        function = self._evaluates.get(signature)
        if function is None:
            function = self._evaluates[signature] = self._trace(
                self._evaluation(signature), leaves, what)
            self.evaluated_metrics |= self._metrics_assigned(function)
        with _tensorflow_errors("evaluate"):
            function(*map(eager_tensor, leaves))

    # --- Tracing --------------------------------------------------------------------------

    def _trace_compute(self, leaves, signature, what: str):
        """(the gradient function for one input signature, the names of the logs it returns
        after the gradients: none); the first one also fixes spec and apply."""
        trainable = self._built(leaves, signature, what)
        if self.batch_norm == "step" and self.spec is None:
            self._norms = _batch_norms(self.model)
        moving = [v for mean, variance, _ in self._norms for v in (mean, variance)]
        seen = {}  # filled while tracing
        model, optimizer, scales = self.model, self.optimizer, self._scales

        def gradients(*flat):
            if scales:
                *flat, share = flat
            x, y, w = _rebuild(signature, flat)
            before = [tf.identity(v.value) for v in moving]
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = self._loss(x, y, y_pred, w)
                scaled = optimizer.scale_loss(loss) * share if scales else loss
            after = [tf.identity(v.value) for v in moving]  # what the forward pass assigned
            for v, value in zip(moving, before):  # "step": the apply moves them, once
                v.assign(value)
            seen["loss_shape"] = loss.shape
            scale = _scale(optimizer) * share if scales else None
            seen["kept"], out, norms = _gradient_outputs(tape.gradient(scaled, trainable), scale)
            model.compute_metrics(x, y, y_pred, w)
            return [loss, tf.convert_to_tensor(optimizer.iterations), norms, *out, *after]

        function = self._trace(gradients, [*leaves, tf.TensorSpec((), tf.float32)] if scales
                               else leaves, what)
        return self._adopted(function, what, seen["loss_shape"], trainable, seen["kept"]), ()

    def _built(self, leaves, signature, what: str) -> list:
        """The model's trainable variables, the model and its optimizer built on the batch
        ``leaves`` (of ``signature``) first where they are not."""
        x, _, _ = _rebuild(signature, leaves)
        if not self.model.built:
            with _model_errors(what):
                self.model(x, training=False)  # creates the variables; assigns nothing
        self.build_optimizer()
        trainable = list(self.model.trainable_variables)
        if not trainable:
            raise ArgumentError(f"{what}: the model has no trainable variables: nothing to train")
        return trainable

    def _adopted(self, function, what: str, shape, trainable: list, kept: list):
        """``function``, a traced gradient function whose loss has ``shape`` and which gives
        the gradients of ``trainable[i]`` for each ``(i, sparse)`` of ``kept``, checked; the
        first fixes spec and the apply, and each adds what it assigns to the rollback set."""
        spec = self._traced_spec(what, shape if shape.rank is not None else (None,), trainable,
                                 kept)
        if self.spec is None:
            self.spec, self._trained = spec, [trainable[i] for i, _ in kept]
            # XLA fuses the optimizer's elementwise update into one pass over each variable
            # (what it saves: the performance page); it needs fixed shapes, so a model
            # with sparse gradients (rows that vary in number) applies without it.
            self._apply_jit = not any(s.sparse for s in spec.values())
        self._note_assignments(function)
        self.trained_metrics |= self._metrics_assigned(function)
        return function

    def _trace(self, python_function, leaves, what: str, jit_compile: bool = False):
        """``python_function`` compiled for ``leaves``' dtypes and shapes, the batch dimension open.

        ``leaves`` are arrays (their axis 0 left open) or ready TensorSpecs.
        """
        specs = [a if isinstance(a, tf.TensorSpec) else
                 tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)) for a in leaves]
        with _model_errors(what):
            return concrete_call(tf.function(python_function, input_signature=specs,
                                     jit_compile=jit_compile).get_concrete_function())

    def _apply_specs(self, request: ApplyRequest | None = None) -> list:
        """The compiled apply's input signature: the mean's tensors, then, for a proven
        ``request``, the learning rate it was proven for."""
        specs = []
        for s in self.spec.values():
            dtype = tf.as_dtype(s.dtype)
            specs += [tf.TensorSpec((None,), tf.int64), tf.TensorSpec((None,) + s.shape[1:], dtype)] \
                if s.sparse else [tf.TensorSpec(s.shape, dtype)]
        if request is not None and request.proven:
            specs.append(tf.TensorSpec((), tf.float64))
        return specs

    def _application(self, request: ApplyRequest):
        """The compiled apply's Python function: the mean's tensors in, its
        :class:`~hostavg.keras.common.ApplyOutputs` (tensors) out.

        Where applies check (check_applied), what it keeps of each weight and optimizer
        variable to undo with is what the update can change: the rows of a sparse gradient
        where the optimizer writes only those (:meth:`_rows_written`), else all of it; a
        request that measures keeps the weights whole."""
        spec, variables, optimizer = list(self.spec.values()), self._trained, self.optimizer
        scales = self._scales
        # What an apply checks and undoes (check_applied): the weights and the optimizer's
        # state; nothing where the host proved it finite (request.proven).
        checks = self.check_applied and not request.proven
        held = variables + list(optimizer.variables) if checks else variables
        checked = [i for i, v in enumerate(held) if checks and self._checks(v)]
        rows = self._rows_written(held) if checks else [None] * len(held)
        if request.ratios or request.values:
            rows[:len(variables)] = [None] * len(variables)
        measured = self._bounded()[1] if checks else []  # (every checked apply measures)

        def apply(*flat):
            if request.proven:
                flat, proven_for = flat[:-1], flat[-1]
            grads = _gradients(spec, flat)
            at = [None if r is None else flat[r] for r in rows]
            lr = tf.cast(optimizer.learning_rate, tf.float64)  # this iteration's (a schedule's too)
            reads = request.ratios or request.values or checked
            before = [tf.identity(v.value) if r is None else v.value.sparse_read(r)
                      for v, r in zip(held, at)] if reads else []
            step = tf.identity(optimizer.iterations)
            scale = tf.identity(_scale(optimizer)) if scales else tf.ones((), tf.float32)
            if scales:  # scaled back, as the optimizer gets Keras's gradient of the scaled loss
                grads = [_times(g, scale) for g in grads]
            with tf.control_dependencies([step, scale]):
                if request.proven:  # only at a rate the proof covers
                    ran = tf.cond(tf.abs(lr) <= proven_for,
                                  lambda: _applied(optimizer, grads, variables),
                                  lambda: tf.constant(False))
                else:
                    ran = _applied(optimizer, grads, variables)
            squares = tf.zeros(0, tf.float64)
            if request.ratios:  # the reads of ``before`` precede the update: it waits for them
                squares = tf.stack([_sum_squares(v.value, b) for v, b in zip(variables, before)]
                                   + [_sum_squares(b) for b in before[:len(variables)]])
            after = [tf.identity(v.value) for v in variables] if request.values else []
            finite = _undo_if_nonfinite(held, checked, before, at)
            with tf.control_dependencies([finite]):  # (after the update, or its undoing)
                magnitudes = magnitude_ends([v.value for v in measured]) if measured else \
                    tf.zeros(0, tf.float64)
            return ApplyOutputs(step, tf.convert_to_tensor(optimizer.iterations), lr, squares,
                                (scale, _scale(optimizer) if scales else scale), after,
                                [a - b for a, b in zip(after, before)], finite, magnitudes,
                                ran)
        return apply

    def _rows_written(self, held: list) -> list:
        """For each of ``held``: the position, among the apply's inputs, of the sparse
        gradient's indices whose rows are all the optimizer's apply writes of it, else None;
        found once, from the graph of the optimizer's apply traced alone.

        A variable counts when every op that writes it is a scatter of those rows
        (:func:`~hostavg.compat.tensorflow.rows_fed`): Keras's SGD without momentum writes a
        table by rows; its momentum, Adam's moments, weight decay write it whole.
        """
        if self._rows is None:
            spec, variables, optimizer = list(self.spec.values()), self._trained, self.optimizer

            def alone(*flat):
                optimizer.apply_gradients(zip(_gradients(spec, flat), variables))
                return tf.zeros(())
            graph = tf.function(alone, input_signature=self._apply_specs()) \
                .get_concrete_function().graph
            starts = np.cumsum([0] + [2 if s.sparse else 1 for s in spec])
            indices = {graph.inputs[i].ref(): int(i) for i, s in zip(starts, spec) if s.sparse}
            outer = {captured.ref(): id(handle) for handle, captured in graph.captures}
            by_handle = {id(v.value.handle): k for k, v in enumerate(held)}
            writes = {}
            for op in graph.get_operations():
                for t in op.inputs:
                    k = by_handle.get(outer.get(t.ref()))
                    if k is not None and t.dtype == tf.resource and op.type not in READ_OPS:
                        writes.setdefault(k, set()).add(rows_fed(op, indices))
            self._rows = [rows_of(writes.get(k, {None}), indices) for k in range(len(held))]
        return list(self._rows)

    def _evaluation(self, signature):
        def evaluation(*flat):
            x, y, w = _rebuild(signature, flat)
            self.model.test_step((x, y) if w is None else (x, y, w))
            return tf.zeros(())
        return evaluation

    def _assigned_handles(self, function) -> set:
        """The ids of the handles of the variables that ``function`` may assign."""
        inner = {t.ref() for op in function.graph.get_operations() if op.type not in READ_OPS
                 for t in op.inputs if t.dtype == tf.resource}
        return {id(outer) for outer, captured in function.graph.captures
                if captured.ref() in inner}

    def _note_assignments(self, function) -> None:
        """Adds the non-trainable variables (model and metric variables) ``function`` may assign
        to :attr:`assigned` (and to the step's snapshot)."""
        handles = self._assigned_handles(function)
        for v in [*self.model.variables, *self.model.metrics_variables]:
            if not v.trainable and id(v) not in self.assigned and id(v.value.handle) in handles:
                self.assigned[id(v)] = v
                self._snapshot[id(v)] = v.numpy()  # the step being prepared has not computed yet

    def _metrics_assigned(self, function) -> set:
        """The ids of the model's metrics whose state ``function`` updates."""
        handles = self._assigned_handles(function)
        return {id(m) for m in self.model.metrics
                if any(id(v.value.handle) in handles for v in m.variables)}


class KerasTrainStepBackend(OwnStep, KerasBackend):
    """A Keras model with its own ``train_step`` and its optimizer (:class:`hostavg.engine.protocols.Backend`).

    Per micro-batch one ``tf.function`` runs the model's ``train_step`` with
    every optimizer's apply captured (:mod:`hostavg.keras.train_step`): what it
    would apply is the micro-batch's gradients, the metrics it updates move,
    and its logs come back with them. The mean is applied as
    :class:`KerasBackend` applies it. Takes :class:`KerasBackend`'s arguments;
    ``batch_norm`` only "micro" (the step's forward pass is the model's own).
    """

    def __init__(self, model, loss, optimizer, batch_norm: str = "micro",
                 check_applied: bool = True):
        if batch_norm != "micro":
            raise ArgumentError(f"batch_norm={batch_norm!r} moves the statistics of hostavg's own "
                                f"forward pass, but model {model.name!r} trains by its own "
                                f"train_step: use batch_norm='micro'")
        super().__init__(model, loss, optimizer, check_applied=check_applied)

    def _trace_compute(self, leaves, signature, what: str):
        """(the function that runs train_step on one input signature, the names of the logs it
        returns after the gradients); the first one also fixes spec and apply."""
        trainable = self._built(leaves, signature, what)
        model, seen, tracker = self.model, {}, loss_tracker(self.model)

        def step(*flat):
            x, y, w = _rebuild(signature, flat)
            before = None if tracker is None else [tf.identity(v.value) for v in tracker]
            with captured(model) as calls:
                logs = model.train_step(keras.utils.pack_x_y_sample_weight(x, y, w))
            try:
                logs = flat_logs(logs, model, what)
                grads, variables = the_apply(calls, model, what)
            except HostavgError as error:  # raised once traced: autograph would rewrite it
                seen["refused"] = error
                return tf.zeros(())
            after = None if tracker is None else [tf.identity(v.value) for v in tracker]
            seen["variables"] = trainable if variables is None else list(variables)
            seen["kept"], out, norms = _gradient_outputs(grads, None)
            seen["names"] = list(logs)
            return [micro_loss(logs["loss"], before, after),
                    tf.convert_to_tensor(self.optimizer.iterations), norms, *out, *logs.values()]

        function = self._trace(step, leaves, what)
        if "refused" in seen:  # without autograph's frames
            raise type(seen["refused"])(*seen["refused"].args) from None
        return self._adopted(function, what, tf.TensorShape(()), seen["variables"],
                             seen["kept"]), seen["names"]


def _on_host(out: ApplyOutputs) -> ApplyOutputs:
    """The outputs of a compiled apply (tensors) as numbers and NumPy arrays."""
    return ApplyOutputs(int(out.before), int(out.after), float(out.learning_rate),
                        np.asarray(out.squares), tuple(float(s) for s in out.scales),
                        [np.asarray(w) for w in out.weights], [np.asarray(u) for u in out.updates],
                        np.asarray(out.finite), largest_magnitudes(out.magnitudes),
                        bool(out.ran))


def _applied(optimizer, grads: list, variables: list):
    """True, once ``optimizer`` applied ``grads`` to ``variables``."""
    optimizer.apply_gradients(zip(grads, variables))
    return tf.constant(True)


def _gradient_outputs(grads, scale) -> tuple:
    """What a gradient function returns of ``grads`` (one per variable, None where the loss
    does not reach it): ((index, sparse) of each kept, the kept gradients, a sparse one as its
    unique rows then their summed values, each divided by ``scale`` unless None, and their
    squared norms in float64)."""
    kept, out, norms = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        kept.append((i, isinstance(g, tf.IndexedSlices)))
        if isinstance(g, tf.IndexedSlices):  # duplicate rows summed: unique rows
            unique, rows = tf.unique(g.indices)
            g = tf.math.unsorted_segment_sum(g.values, rows, tf.size(unique))
            out.append(unique)
        if scale is not None:  # unscaled as Keras's optimizer unscales: g / scale (x share)
            g = g / tf.cast(scale, g.dtype)
        out.append(g)
        norms.append(tf.cast(2 * tf.nn.l2_loss(g), tf.float64))  # one pass, no temporary
    return kept, out, tf.stack(norms) if norms else tf.zeros(0, tf.float64)


def _gradients(spec: list, flat) -> list:
    """The gradients of the apply's inputs ``flat``: a dense tensor per variable of ``spec``, a
    sparse one's indices then values as an IndexedSlices."""
    flat, grads = iter(flat), []
    for s in spec:
        if s.sparse:
            indices = next(flat)
            grads.append(tf.IndexedSlices(next(flat), indices, tf.constant(s.shape, tf.int64)))
        else:
            grads.append(next(flat))
    return grads


def _undo_if_nonfinite(held: list, checked: list, before: list, rows: list):
    """Whether each of ``held`` at the positions ``checked`` is finite now (after the update),
    of its ``rows`` only where given (:func:`~hostavg.compat.tensorflow.finite_flags`); where
    any is not, every one of ``held`` is given back its value ``before`` the update (those rows
    of it, or all)."""
    if not checked:
        return tf.zeros(0, tf.bool)

    def undo(finite):
        for v, b, r in zip(held, before, rows):
            if r is None:
                v.assign(b)
            else:
                v.value.scatter_update(tf.IndexedSlices(b, r))
        return tf.identity(finite)
    return finite_flags([held[i].value if rows[i] is None else held[i].value.sparse_read(rows[i])
                         for i in checked], undo)


def _tapped_one(taps: LayerTaps, trained: list, forward, scaled, unscaled, read: list,
                leaves) -> tuple:
    """One sample's loss, the flat gradients of the ``trained`` variables that are not
    ``taps``' kernels and biases, and per tapped layer its input a and delta (the sample's,
    its batch of one dropped), all divided by the loss scale (``unscaled``);
    ``forward(leaves)`` the loss, ``scaled(loss)`` as the optimizer scales it. A layer whose
    kernel or bias still gets a gradient (the loss reads it elsewhere), or that the loss
    does not call, is added to ``read``."""
    places = sorted(taps.indices())
    others = [trained[p] for p in taps.untapped(len(trained))]
    tapped = [trained[p] for p in places]
    inputs, zeros = [None] * len(taps), [None] * len(taps)
    with tf.GradientTape() as tape:
        def tap(j, z):
            zeros[j] = tf.zeros_like(z)
            tape.watch(zeros[j])
            return z + zeros[j]
        with taps.tapped(lambda v: tf.stop_gradient(v.value), tap, inputs):
            loss = forward(leaves)
        optimized = scaled(loss)
    read += [layer for layer, z in zip(taps.layers, zeros) if z is None]
    called = [z for z in zeros if z is not None]
    grads = tape.gradient(optimized, [*others, *tapped, *called])
    read += taps.holding({p for p, g in zip(places, grads[len(others):len(others) + len(tapped)])
                          if g is not None})
    deltas = unscaled([tf.zeros_like(z) if g is None else g  # an output the loss skips
                       for g, z in zip(grads[len(others) + len(tapped):], called)])
    return (loss, [tf.reshape(g, [-1]) for g in unscaled(grads[:len(others)])],
            [x[0] for x in inputs if x is not None], [d[0] for d in deltas])


def _scale(optimizer):
    """The optimizer's loss scale now: a LossScaleOptimizer's dynamic scale, or the
    loss_scale_factor it was made with (what its ``scale_loss`` multiplies a loss by)."""
    return optimizer.scale_loss(tf.ones((), tf.float32))


def _times(g, scale):
    """``g * scale``, for a dense gradient or the values of an IndexedSlices."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(scale, g.dtype)


def refuse_strategies(model) -> None:
    """Raises HostavgError inside a ``tf.distribute`` strategy's scope, or for a model made in one."""
    if tf.distribute.has_strategy():
        strategy, where = tf.distribute.get_strategy(), "inside"
    elif model.distribute_strategy is not tf.distribute.get_strategy():
        strategy, where = model.distribute_strategy, "for a model made in"
    else:
        return
    raise ArgumentError(
        f"hostavg.keras runs {where} a {type(strategy).__name__} scope, which hostavg does not "
        f"drive: it trains one model on one device per process and averages the micro-batches "
        f"on the host. Build the model and the Trainer outside the strategy; for several "
        f"devices or workers, run one process per device and pass comm= (an mpi4py "
        f"communicator such as MPI.COMM_WORLD): every step averages over all ranks' "
        f"micro-batches")


class _Snapshot(dict):
    """A backend's snapshot: id -> value of each assigned variable (:attr:`KerasBackend.assigned`);
    ``moved``: how many micro-batches' moving statistics waited for the apply ("step")."""

    moved = 0


def _batch_norms(model) -> list:
    """(moving mean, moving variance, momentum) of every BatchNormalization layer of ``model``
    that moves its statistics in training (trainable), found through ``model.layers`` (nested
    models too); HostavgError for one with renorm, whose statistics move otherwise."""
    import keras
    out, todo = [], list(model.layers)
    while todo:
        layer = todo.pop(0)
        todo[:0] = getattr(layer, "layers", [])
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            if getattr(layer, "renorm", False):
                raise ArgumentError(f"batch_norm='step' combines plain batch norm's moments; "
                                    f"layer {layer.name!r} has renorm=True, whose statistics move "
                                    f"otherwise: use batch_norm='micro'")
            out.append((layer.moving_mean, layer.moving_variance, float(layer.momentum)))
    return out



def _sum_squares(x, minus=None):
    """sum((x - minus)^2), or sum(x^2), in float64 (TF1's backend reduces in the variable's
    dtype, float32 at least; Keras variables are few and this runs only when measuring)."""
    x = tf.cast(x, tf.float64)
    if minus is None:
        return tf.reduce_sum(tf.square(x))
    return tf.reduce_sum(tf.math.squared_difference(x, tf.cast(minus, tf.float64)))


@contextmanager
def _tensorflow_errors(call: str):
    """Turns what a compiled call raises into a HostavgError saying what to do."""
    try:
        yield
    except tf.errors.OpError as error:
        said = f"{type(error).__name__}: {first_line(error)}"
        if isinstance(error, tf.errors.InvalidArgumentError):
            raise refused(f"TensorFlow refused the {call} ({said})",
                          "check that micro-batch's x and y") from error
        raise StepError(f"TensorFlow failed in the {call} ({said})") from error


def _model_errors(what: str):
    return model_errors(what, traced_message)
