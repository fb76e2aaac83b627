"""hostavg.keras on Keras's JAX backend: :class:`KerasJaxBackend`, the engine's backend for a Keras model.

Imports JAX and Keras, never TensorFlow. Per micro-batch one ``jax.jit`` of
``jax.value_and_grad`` over ``model.stateless_call`` (as Keras's own JAX
``train_step`` takes its gradients) runs the forward pass, the loss, the
backward pass, the compiled metrics and every gradient's squared norm; the
new values of the variables the forward pass assigns are assigned to the
model, as Keras's own step leaves them. The mean goes back through a second
compiled function that applies it with the optimizer once, statelessly.

Gradients are dense (JAX has no sparse gradient: an ``Embedding``'s gradient
is its whole table). They come to NumPy without a copy where they lie in
host memory, and output buffers are donated so that two sets serve every
micro-batch computed one a call in "sum" mode (one more for each micro-batch
in flight where a step's computes are dispatched in turn).

See docs/guides/keras.md for host buffers, loss scaling, evaluation and
numerics.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from hostavg.compat.jax import used_inputs
from hostavg.compat.keras import assign
from hostavg.core.errors import ArgumentError, HostavgError, StepError, refused
from hostavg.core.gradients import freeze
from hostavg.engine.protocols import Applied, ApplyRequest, Computed, NotVectorized, SampleSums
from hostavg.keras.batch import leaves as _leaves
from hostavg.keras.batch import rebuild as _rebuild
from hostavg.keras.common import (ApplyOutputs, CompiledModel, model_errors, named_results,
                                  traced_message)
from hostavg.keras.layer_taps import LayerTaps, per_sample_dots
from hostavg.keras.train_step import OwnStep, captured, flat_logs, loss_tracker, micro_loss, the_apply

__all__ = ["KerasJaxBackend", "KerasJaxTrainStepBackend"]

#: The dtype squared norms are reduced in on the device: float64 if JAX allows it, else float32.
_WIDE = jax.dtypes.canonicalize_dtype(jnp.float64)
_COUNT = jax.dtypes.canonicalize_dtype(jnp.int64)  # (int32 unless JAX's x64 is on)
#: How many computes' output buffers a compute made alone keeps to be donated: the one
#: before the last is free again once the engine has added it (with ``overlap``, the one in
#: flight is the last). Computes dispatched in turn leave one set each, for the next.
_RING = 2
#: The most bytes of gradients one call of several micro-batches returns (their computes in
#: turn, :meth:`KerasJaxBackend.compute_many`): a step's several calls cost a dispatch each,
#: which on a small model is most of a micro-batch's time; a large gradient's own cost
#: dwarfs its dispatch, and its computes stay one a call, their buffers reused.
TOGETHER_BYTES = 16 * 2 ** 20
#: The most floating-point operations (XLA's estimate) of one micro-batch's compute that
#: computes several in one call: about a millisecond of a CPU core, where a dispatch is a
#: fair part of it. A compute with a convolution never does: XLA's CPU runs a convolution
#: inside the scan's loop several times slower (Keras's MNIST convnet example took 7 times
#: as long), and unrolled still a third slower.
TOGETHER_FLOPS = 1e7


class KerasJaxBackend(CompiledModel):
    """A compiled Keras model and its optimizer on Keras's JAX backend (:class:`hostavg.engine.protocols.Backend`).

    Args:
      model: as :class:`hostavg.keras.Trainer` takes it; compiled with ``loss``
        and ``optimizer`` (:func:`~hostavg.keras.common.compiled`).
      loss: as :class:`hostavg.keras.Trainer` takes it.
      optimizer: as :class:`hostavg.keras.Trainer` takes it.
      check_applied: as :class:`hostavg.keras.Trainer` takes it.

    Attributes:
      spec: name -> VariableSpec of every trained variable (None until the
        first batch is prepared); dense for every variable.
      model, target: the model.
      optimizer: the optimizer that trains (``model.optimizer``).
      assigned: id -> variable, for every non-trainable variable of the model,
        and every metric variable, that the traced gradient functions may
        assign (the rollback set).
      trained_metrics, evaluated_metrics: the ids of the model's metrics (of
        ``model.metrics``) that the gradient functions, and the evaluation
        functions, update.
      nonfinite: "optimizer" for a ``LossScaleOptimizer`` (it skips a
        non-finite step and lowers its scale), else "refuse".
      host_memory: where the compiled gradients are placed for the host to
        read: "host" (the CPU's own memory) or "pinned_host" (an accelerator's
        pinned host memory), both viewed by NumPy without a copy; or "device"
        (an accelerator where JAX cannot: each gradient is copied to new host
        memory).
      reuses_buffers: whether computes donate earlier gradient buffers to
        XLA to write the next gradients into (where the host views them
        without a copy and JAX donates such buffers).
    """

    def __init__(self, model, loss, optimizer, check_applied: bool = True):
        super().__init__(model, loss, optimizer, check_applied)
        self.assigned = {}
        self._kept = None  # indices in model.trainable_variables of the trained variables
        self._evaluates = {}  # input signature -> (jitted function, what it changes)
        self._applies = {}  # (ApplyRequest, debug flags on, optimizer variables) -> apply
        self._schedule = self._next_rate = None  # whether the rate is a schedule; its next value
        self._iterations = (None, 0)  # optimizer.iterations's last value read, and it as an int
        self._rate = (None, 0.0)  # the learning rate variable's last value read, as a float
        self._losses = {}  # input signature -> the loss function its compute differentiates
        self._products = {}  # input signature -> jitted Hessian-vector product
        self._samples = {}  # (input signature, "sums", "own" or "dots") -> jitted function
        self._bodies = {}  # jitted compute -> (its function, indices of what it assigns)
        self._scans = {}  # jitted compute -> its computes in turn (compute_many)
        self._together = {}  # (feed shapes, count) -> whether their scan ran (compute_many)
        self._ran_and_failed = set()  # (feed shapes, count) whose untried scan failed as it ran
        self._smalls = {}  # feed shapes -> whether their compute is small (compute_many)
        # ids of metrics, of their variables -> (results, jitted; unjitted; the metrics)
        self._results = {}
        self._scan_results = {}  # jitted compute -> the key in _results of its scan's results
        # (the key, the metric variables' values after the last scan, their results from it)
        self._latest_results = (None, [], [])
        self._snapshot = {}
        self._ring = []  # the last computes' gradient outputs, oldest first: donated in turn
        self._ring_lock = threading.Lock()  # a lone compute may run beside a step's
        # held from reading the variables' values to a call that reads them being made, and by
        # an apply until its new values are assigned: it donates the old ones, which JAX deletes
        self._values_lock = threading.RLock()
        self.host_memory, self._outputs, self.reuses_buffers = _host_outputs()

    # --- The engine's protocol ------------------------------------------------------------

    def compute(self, feed, share: float = 1.0) -> Computed:
        (function, assigns, names), leaves, _ = feed
        donated = self._donated_gradient_buffers()
        with _jax_errors("compute"), _traced_errors():
            out = self._called(function, np.float32(share), donated, leaves)
            jax.block_until_ready(out)
        assign(assigns, out[3])
        return self._read(out, names)

    def _read(self, out, names: list) -> Computed:
        """A compute's :class:`Computed` from its call's outputs ``out`` (done), and a
        train_step's logs (``names``) noted. Its gradient buffers go to the ring only once
        NumPy views them: a compute of another thread may donate them at once, and a donated
        JAX array is deleted (a view keeps the buffer, which JAX then leaves alone)."""
        loss, sq_norms, grads, _, logs = out
        self._took(names, [np.asarray(v) for v in logs])
        computed = Computed(
            float(np.asarray(loss)), {name: freeze(_host(g)) for name, g in zip(self.spec, grads)},
            self.global_step(), dict(zip(self.spec, np.asarray(sq_norms).tolist())))
        if self.reuses_buffers:
            with self._ring_lock:
                self._ring.append(grads)
        return computed

    def compute_many(self, feeds, shares) -> list[tuple[Computed, Any]]:
        """See :class:`~hostavg.engine.protocols.Many`: the first of ``feeds`` and those after
        it of the same input signature, as many as :data:`TOGETHER_BYTES` of gradients hold
        (none where fewer than two). A :meth:`_small` compute's by one jitted
        ``jax.lax.scan`` (:meth:`_scanned`); any other's, or where the scan of these shapes
        cannot be traced, dispatched in turn (:meth:`_in_turn`)."""
        most = TOGETHER_BYTES // max(1, sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                                             for s in self.spec.values()))
        shapes = _shapes(feeds[0])
        count = 1
        while count < min(len(feeds), most) and _shapes(feeds[count]) == shapes:
            count += 1
        if count < 2:
            return []
        feeds, shares = feeds[:count], shares[:count]
        works = self._together.get((shapes, count))
        scanned = [] if works is False or not self._small(shapes, feeds[0]) else \
            self._scanned(feeds, shares, shapes, works)
        return scanned or self._in_turn(feeds, shares)

    def _scanned(self, feeds, shares, shapes: tuple, works: bool | None) -> list:
        """:meth:`compute_many` by one jitted ``jax.lax.scan`` of the compute, each from the
        moving values the one before left (which the scan also returns, for the state after
        each); none where the scan of these shapes cannot be traced (or compiled)."""
        (function, assigns, names), _, _ = feeds[0]
        count = len(feeds)
        stacked = [_stacked([f[1][j] for f in feeds]) for j in range(len(feeds[0][1]))]
        together = self._scans.get(function)
        if together is None:
            together = self._scans[function] = self._scan(function)
        key, arguments = (shapes, count), (np.asarray(shares, np.float32), stacked)
        if not works:  # compiled first: a failure to trace or compile is then told apart
            try:
                self._called(together.lower, *arguments).compile()
            except Exception:  # noqa: BLE001 - the scan of these shapes does not trace
                self._together[key] = False  # (or compile): computed in turn from now on
                return []
        try:
            with _jax_errors("compute"):
                losses, sq_norms, grads, assigned, each, logs, results = self._called(
                    together, *arguments)
                jax.block_until_ready(grads)
        except Exception:  # noqa: BLE001 - failed as it ran
            if works:
                raise
            # The data's failure, most likely (a sample the model refuses), which the computes
            # in turn then name: tried again on the next step, once.
            if key in self._ran_and_failed:
                self._together[key] = False
            self._ran_and_failed.add(key)
            return []
        self._together[key] = True
        assign(assigns, assigned)
        self._latest_results = (self._scan_results[function],
                                [v.value for v in self.model.metrics_variables], results)
        losses, sq_norms, step = np.asarray(losses), np.asarray(sq_norms), self.global_step()
        grads, logs = [_host(g) for g in grads], [np.asarray(v) for v in logs]
        computed = []
        for i in range(count):
            took = [v[i] for v in logs]
            self._took(names, took)
            computed.append((Computed(
                float(losses[i]), {name: freeze(g[i]) for name, g in zip(self.spec, grads)}, step,
                dict(zip(self.spec, sq_norms[i].tolist()))),
                lambda i=i, took=took: self._state(
                    {id(v): values[i] for v, values in zip(assigns, each)},
                    dict(zip(names, took)))))
        return computed

    def _in_turn(self, feeds, shares) -> list[tuple[Any, Any]]:
        """:meth:`compute_many` by each compute's own call, made in turn before any is read:
        each from the values the one before assigned (JAX arrays not yet computed), so that
        while the engine reads and adds one, the device computes those after it (JAX's
        asynchronous dispatch). Each :class:`Computed` is read as the engine takes it
        (a function that gives it); one whose call fails as it runs restores what the
        computes before it left, then raises as :meth:`compute` does. A call that fails as
        it is made (a new shape the model refuses; on the CPU, a run-time failure) assigned
        nothing: the calls stop there, and taking that compute raises its error, once.

        Their gradient buffers are donated again by the next call's computes (those this
        call's computes donate are of computes already read)."""
        (function, assigns, names), _, _ = feeds[0]
        with self._ring_lock:
            spare, self._ring = self._ring[:-1], self._ring[-1:]
        outs = []
        for feed, share in zip(feeds, shares):
            before = [v.value for v in assigns]
            donated = (spare.pop(0) if spare else self._new_gradient_buffers()) \
                if self.reuses_buffers else ()
            out = self._dispatched(function, share, donated, feed[1])
            if isinstance(out, HostavgError):  # nothing assigned: taken, it raises as compute does
                outs.append((lambda error=out: _raised(error), lambda: None))
                break
            assign(assigns, out[3])
            values = {id(v): v.value for v in assigns}
            outs.append((lambda out=out, before=before: self._waited(out, names, assigns, before),
                         lambda out=out, values=values: self._state(
                             values, dict(zip(names, [np.asarray(v) for v in out[4]])))))
        # A call that failed as it was made keeps this frame (the caller of a frame of its
        # error's traceback), and so its locals: they hold none of the other computes' outputs.
        try:
            return outs
        finally:
            outs = spare = donated = None

    def _dispatched(self, function, share: float, donated, leaves):
        """One call of :meth:`_in_turn`: its outputs, or the HostavgError of a call that failed
        as it was made, caught here so that its traceback holds no other compute's outputs."""
        try:
            with _jax_errors("compute"), _traced_errors():
                return self._called(function, np.float32(share), donated, leaves)
        except HostavgError as error:  # (JAX deleted the buffers it was to reuse where it ran;
            return error               # where it failed as it traced, JAX's frames hold them)

    def _waited(self, out, names: list, assigns: list, before: list) -> Computed:
        """:meth:`_read` of a compute dispatched in turn (:meth:`_in_turn`), once it is done;
        where it failed as it ran, ``assigns`` get ``before`` back."""
        try:
            with _jax_errors("compute"):
                jax.block_until_ready(out)
        except HostavgError:
            assign(assigns, before)
            raise
        return self._read(out, names)

    def _called(self, function, *arguments):
        """``function`` of the model's values now (:meth:`_values`), then ``arguments``: the
        values read and the call made under the lock an apply holds while it donates them."""
        with self._values_lock:
            return function(*self._values(), *arguments)

    def _small(self, shapes: tuple, feed) -> bool:
        """Whether ``feed``'s compute is small enough to compute several a call (at most
        :data:`TOGETHER_FLOPS`, no convolution), by XLA's cost estimate of its lowering (tens
        of milliseconds, once per input shapes)."""
        small = self._smalls.get(shapes)
        if small is None:
            (function, _, _), leaves, _ = feed
            donated = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self.spec.values()] \
                if self.reuses_buffers else ()
            try:
                lowered = self._called(function.lower, np.float32(1.0), donated, leaves)
                flops = (lowered.cost_analysis() or {}).get("flops", math.inf)
                small = flops <= TOGETHER_FLOPS and "convolution" not in lowered.as_text()
            except Exception:  # noqa: BLE001 - no estimate: one compute a call, as before
                small = False
            self._smalls[shapes] = small
        return small

    def _state(self, values: dict, logs: dict):
        """The rollback snapshot (:meth:`snapshot`'s form) of ``values``, by the assigned
        variables' ids, after a compute that returned ``logs``."""
        return values

    def _scan(self, function):
        """``function``'s computes in turn (:meth:`compute_many`), a jitted ``jax.lax.scan``."""
        body, assigned, metrics = self._bodies[function]
        self._scan_results[function], results = self._scanned_results()

        def together(trainable, untrained, metric_values, slots, shares, stacked):
            def one(carry, xs):
                untrained, metric_values = list(carry[0]), list(carry[1])
                loss, sq, grads, new, logs = body(trainable, untrained, metric_values, slots,
                                                  xs[0], (), xs[1])
                for values, at, changed in ((untrained, assigned, new[:len(assigned)]),
                                            (metric_values, metrics, new[len(assigned):])):
                    for i, value in zip(at, changed):
                        values[i] = jax.lax.convert_element_type(value, values[i].dtype)
                new = [untrained[i] for i in assigned] + [metric_values[i] for i in metrics]
                return (untrained, metric_values), (loss, sq, grads, new, logs)
            (untrained, metric_values), (losses, sq, grads, each, logs) = jax.lax.scan(
                one, (untrained, metric_values), (shares, stacked))
            return losses, sq, grads, \
                [untrained[i] for i in assigned] + [metric_values[i] for i in metrics], each, \
                logs, results(metric_values)

        return jax.jit(together,
                       out_shardings=(None, None, self._outputs, None, None, None, None))

    def random_ops(self) -> tuple:
        return ()  # the check names Keras's random layers in its advice

    def training_results(self) -> dict:
        """See :meth:`CompiledModel.training_results`: every metric's ``result()`` computed on
        the device, as Keras's own JAX trainer computes them inside its train step (eagerly,
        each result dispatches its few operations one by one: about 0.1 ms a step on a small
        model). Those of the last scan (:meth:`compute_many`) where the metric variables
        still hold the very arrays it left (a JAX array never changes), else one jitted call
        on their values. Their results trace: the compute traced them (``compute_metrics``
        returns every metric's result)."""
        variables = list(self.model.metrics_variables)  # the property walks every layer
        key, _, metrics = self._results_function(variables)
        values = [v.value for v in variables]
        scanned, before, results = self._latest_results
        if scanned != key or len(before) != len(values) or \
                any(a is not b for a, b in zip(before, values)):
            results = self._results[key][0](values)
        return named_results(metrics, results, skip=("loss",))

    def _scanned_results(self) -> tuple:
        """(the key of the metrics' results a scan returns, ``metric values -> results``): none
        (None, a function of nothing) where the logs are a train_step's own, which its compute
        returns, or where the results do not trace, which is not to cost the scan."""
        variables = list(self.model.metrics_variables)
        key, results, _ = self._results_function(variables)
        if not self.runs_train_step:
            try:
                jax.eval_shape(results, [v.value for v in variables])
                return key, results
            except Exception:  # noqa: BLE001 - a result() that reads a value on the host
                pass
        return None, lambda values: []

    def _results_function(self, variables: list) -> tuple:
        """(what keys them, ``variables' values -> results``, the metrics) for the metrics
        trained now, ``variables`` the model's metric variables. :meth:`training_results`
        calls it jitted; a scan (:meth:`_scan`) calls it on the values it leaves, so that a
        step's results come from its compute's call."""
        key = (frozenset(self.trained_metrics), tuple(map(id, variables)))
        if key not in self._results:
            metrics = [m for m in self.model.metrics if id(m) in self.trained_metrics]

            def results(values):
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    return [metric.result() for metric in metrics]
            self._results[key] = (jax.jit(results), results, metrics)
        return key, *self._results[key][1:]

    def _product(self, feed, vector: Mapping) -> tuple[float, dict]:
        """(the loss, name -> H v) of one micro-batch, from ``jax.jvp`` of its gradient,
        jitted once per input signature (:meth:`_hvp_function`); assigns nothing: every
        product reads the same seed states and moving statistics."""
        _, leaves, signature = feed
        function = self._products.get(signature)
        if function is None:
            function = self._products[signature] = self._hvp_function(self._losses[signature])
        with _jax_errors("hvp"), _traced_errors():
            loss, products = function(
                *self._values(), leaves,
                [np.asarray(vector[name], s.dtype) for name, s in self.spec.items()])
        return float(loss), {name: np.asarray(p) for name, p in zip(self.spec, products)}

    def _hvp_function(self, loss):
        """``(trainable, untrained, metric values, optimizer values, leaves, v) -> (loss, H v)``,
        jitted: forward over reverse, the tangent ``v`` pushed through the gradient of the
        unscaled loss."""
        kept = self._kept

        def value(kept_values, trainable, untrained, metric_values, slots, flat):
            return loss(_with_kept(trainable, kept, kept_values), untrained, metric_values,
                        slots, flat)[1][0]

        def product(trainable, untrained, metric_values, slots, flat, vector):
            def gradient(kept_values):
                return jax.value_and_grad(value)(kept_values, trainable, untrained,
                                                 metric_values, slots, flat)
            (mean, _), (_, products) = jax.jvp(gradient, ([trainable[i] for i in kept],),
                                               (vector,))
            return mean, products
        return jax.jit(product)

    def apply_feed(self, feeds, what: str) -> dict:
        """Nothing: a Keras optimizer reads no input besides the gradients."""
        return {}

    def apply(self, mean: Mapping, feed: Mapping, request: ApplyRequest) -> Applied:
        """Applies ``mean`` once; reports the new ``optimizer.iterations``, the learning rate
        the apply used and what ``request`` asks for, all from that one compiled call
        (measuring the ratios reduces two norms per variable)."""
        # Keyed by the optimizer's variables too: the apply finds what it checks and measures
        # by their positions, which move where a schedule set in the rate variable's place
        # untracks that variable.
        traced, debugging, slots = self.traced(request), _debugging(), self.optimizer.variables
        key = (traced, debugging, tuple(map(id, slots)))
        function = self._applies.get(key)
        if function is None:
            function = self._applies[key] = self._application(traced, donates=not debugging)
        trained = _trained(self.model, self._kept)
        grads = [np.asarray(mean[name], s.dtype) for name, s in self.spec.items()]  # jit puts them
        with _jax_errors("apply"), self._values_lock:
            out = function([v.value for v in trained], [v.value for v in slots], grads)
            # Copied to the host before the next apply donates the new values' buffers.
            weights = [np.array(w) for w in out.new] if request.values else []
            assign(trained, out.new)  # the old values, where the update was undone
            assign(slots, out.slots)
        # two reads from the device, not one a number
        found, next_rate = _unpacked(out.reals, out.counts,
                                     2 * len(trained) if traced.ratios else 0,
                                     weights, [np.asarray(u) for u in out.updates])
        # (Unknown where the update was undone: the iteration stays, so the next apply's rate is
        # this one's, which the next checked apply measures again.)
        self._next_rate = next_rate if found.finite.all() else None
        if self._next_rate is not None and not self._is_schedule():
            self._rate = (self._variable_rate(), next_rate)
        self._iterations = (self.optimizer.iterations.value, found.after)
        return self._report(found, request, trained)

    def _rate_bound(self, feed) -> float | None:
        """The learning rate the next apply uses: a variable's, read on the host (about 8 us)
        where its value is not the array the last finite apply left or the last read saw (a
        JAX array never changes; a callback that sets the rate assigns another); a
        schedule's, as the last apply computed it for the next iteration (evaluating it on
        the host costs about 2 ms; only an apply moves the iteration), None before one."""
        if self._is_schedule():
            return self._next_rate
        value = self._variable_rate()
        if value is None:  # a schedule now: its next value is known after an apply
            return None
        if value is not self._rate[0]:
            self._rate = (value, super()._rate_bound(feed))
        return self._rate[1]

    def _is_schedule(self) -> bool:
        if self._schedule is None:
            self._schedule = not isinstance(self.optimizer.learning_rate, keras.Variable)
        return self._schedule

    def _variable_rate(self):
        """The learning rate variable's value (a JAX array, which never changes); None where a
        schedule was set in the variable's place (Keras allows it once the optimizer is
        built), which :meth:`_is_schedule` then says: its value read once, not each step."""
        rate = self.optimizer.learning_rate
        if isinstance(rate, keras.Variable):
            return rate.value
        self._schedule, self._next_rate = True, None
        return None

    def global_step(self) -> int:
        """``optimizer.iterations``, read from the device only where its value changed since the
        last read or apply (a JAX array never changes: another value is another array)."""
        value = self.optimizer.iterations.value
        if value is not self._iterations[0]:
            self._iterations = (value, int(np.asarray(value)))
        return self._iterations[1]

    def snapshot(self) -> dict:
        """The values of :attr:`assigned` (JAX arrays, which never change); a function traced
        while the step prepares adds what it assigns."""
        self._snapshot = {i: v.value for i, v in self.assigned.items()}
        return self._snapshot

    def restore(self, snapshot: dict) -> None:
        for i, value in snapshot.items():
            self.assigned[i].assign(value)

    # --- Per sample (hostavg.engine.protocols.Vectorized) --------------------------------------

    def sample_sums(self, feed, dotted: bool = False) -> SampleSums:
        """See :class:`~hostavg.engine.protocols.Vectorized`: ``jax.vmap`` of one sample's loss
        and gradient (its squared norm reduced there, and with ``dotted`` its dot with the
        gradients' sum) and the sum of the gradients vmap forms, in one jitted call. A squared
        norm that overflows the wide dtype (or meets a NaN) is reduced again from the gradient
        divided by its largest magnitude a, and multiplied by a^2 here, in float64."""
        losses, sq, tops, sums, dots = self._per_sample_call(feed, "own" if dotted else "sums")
        return SampleSums(np.asarray(losses, np.float64),
                          np.asarray(sq, np.float64) * np.square(np.asarray(tops, np.float64)),
                          {name: np.asarray(s) for name, s in zip(self.spec, sums)},
                          np.asarray(dots, np.float64) if dotted else None)

    def sample_dots(self, feed, mean: Mapping) -> np.ndarray:
        """See :class:`~hostavg.engine.protocols.Vectorized`: ``jax.jvp`` of the vmapped losses
        along ``mean`` (in the variables' dtypes), g_i . mean for every sample in one forward
        pass."""
        tangent = [np.asarray(mean[name], s.dtype) for name, s in self.spec.items()]
        return np.asarray(self._per_sample_call(feed, "dots", tangent), np.float64)

    def _per_sample_call(self, feed, kind: str, *extra):
        """The jitted ``kind`` function of the feed's signature (:meth:`_sample_function`,
        traced on its first call) called on the model's values now."""
        _, leaves, signature = feed
        self.vectorizable()
        loss = self._losses[signature]
        arguments = (*self._values(), leaves, *extra)
        with _jax_errors("per_sample"), _vectorizing():
            function = self._samples.get((signature, kind))
            if function is not None:
                return jax.block_until_ready(function(*arguments))
            taps = self._layer_taps(loss, leaves) if kind != "dots" else None
            function = self._sample_function(loss, kind, taps)
            try:
                out = jax.block_until_ready(function(*arguments))
            except Exception:
                if not taps:
                    raise
                # a tapped layer's input escaping the trace of a loop's body (a Dense in an
                # RNN's cell, run by lax.scan): untapped, as the layers' gradients were formed
                function = self._sample_function(loss, kind)
                out = jax.block_until_ready(function(*arguments))
            self._samples[signature, kind] = function
            return out

    def _layer_taps(self, loss, leaves) -> LayerTaps:
        """The ``Dense`` and convolution layers whose squared norms and sums the "sums"
        function takes from a and delta (:mod:`hostavg.keras.layer_taps`): the eligible ones
        that the loss, traced on one sample with the layers tapped, calls and whose kernel
        and bias it reads nowhere else (where JAX's jaxpr cannot be walked, none), with
        their outputs' shapes for a sample recorded (:attr:`LayerTaps.outputs`)."""
        trainable, kept = list(self.model.trainable_variables), self._kept
        trained = [trainable[i] for i in kept]
        taps = LayerTaps(self.model, trained)
        if not taps:
            return taps
        places, outputs = sorted(taps.indices()), [None] * len(taps)  # places: in kept's order

        def tap(j, z):
            outputs[j] = jax.ShapeDtypeStruct(z.shape, z.dtype)
            return z

        def probe(mapped, values, untrained, metric_values, slots, flat):
            own = {id(trained[p]): values[kept[p]] for p in places}
            # mapped: what a read through the variable sees
            kept_values = _with_kept([values[i] for i in kept], places, mapped)
            with taps.tapped(lambda v: own[id(v)], tap, [None] * len(taps)):
                return loss(_with_kept(values, kept, kept_values), untrained, metric_values,
                            slots, [leaf[None] for leaf in flat])
        values = [v.value for v in trainable]
        try:
            traced = jax.make_jaxpr(probe)(
                [values[kept[p]] for p in places], values,
                [v.value for v in self.model.non_trainable_variables],
                [v.value for v in self.model.metrics_variables], self._slots(),
                [leaf[0] for leaf in leaves])
        except Exception:  # the taps' doing: none (the model's own errors meet it untapped)
            return taps.without(taps.layers)
        taps.outputs = {id(layer): out for layer, out in zip(taps.layers, outputs)}
        read = {p for p, used in zip(places, used_inputs(traced)) if used}
        return taps.without(taps.holding(read) + [layer for layer, out in zip(taps.layers, outputs)
                                                  if out is None])

    def _sample_function(self, loss, kind: str, taps: LayerTaps | None = None):
        """``kind`` "sums": ``(trainable, untrained, metric values, optimizer values, leaves) ->
        (losses, squared norms, the divisors of those reduced again, the sum of their
        gradients, None)``; "own": the same with each g_i . that sum last; "dots": ``(...,
        leaves, mean) -> g_i . mean``; jitted, every sample computed alone (a batch of one)
        under ``jax.vmap``, from the same values; the new values of what the forward pass
        assigns are dropped. The squared norms of ``taps``' layers come from a and delta
        (:mod:`hostavg.keras.layer_taps`), where every norm is finite."""
        kept, optimizer, scales = self._kept, self.optimizer, self._scales

        def unscaled(grads, slots):
            if not scales:
                return grads
            scale = _scale(optimizer, slots)
            return [g / scale.astype(g.dtype) for g in grads]

        def one(kept_values, trainable, untrained, metric_values, slots, flat):
            scaled, (value, _, _) = loss(_with_kept(trainable, kept, kept_values), untrained,
                                         metric_values, slots, [leaf[None] for leaf in flat])
            return scaled, value

        def each(kept_values, trainable, untrained, metric_values, slots, flat):
            return jax.vmap(lambda leaves: one(kept_values, trainable, untrained, metric_values,
                                               slots, leaves))(flat)

        trained = _trained(self.model, kept)

        def sums(trainable, untrained, metric_values, slots, flat, dotted=False):
            kept_values, grad = [trainable[i] for i in kept], jax.grad(one, has_aux=True)

            def sample(leaves, divided):
                g, value = grad(kept_values, trainable, untrained, metric_values, slots, leaves)
                g = unscaled(g, slots)
                top = jnp.ones((), _WIDE)
                if divided:  # by the largest magnitude, where it is finite and not 0
                    largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in g])).astype(_WIDE)
                    top = jnp.where(jnp.isfinite(largest) & (largest > 0), largest, top)
                    g = [x / top.astype(x.dtype) for x in g]
                return value, jnp.sum(_squares(g)), top, g
            if taps:
                values, sq, tops, total, dots = _tapped_sums(
                    taps, trained, one, lambda g: unscaled(g, slots), kept_values,
                    (trainable, untrained, metric_values, slots), flat, dotted)
            else:
                # the sum of the gradients vmap forms anyway, not the gradient of the losses'
                # sum: XLA's batched convolution gradient rounds that to 3e-6 of the mean
                # where the samples' gradients mostly cancel (20 times the sum's)
                values, sq, tops, g = jax.vmap(lambda leaves: sample(leaves, False))(flat)
                total = [jnp.sum(x, 0) for x in g]
                dots = _formed_dots(g, total) if dotted else None
            sq, tops = jax.lax.cond(jnp.all(jnp.isfinite(sq)), lambda: (sq, tops),
                                    lambda: jax.vmap(lambda leaves: sample(leaves, True))(flat)[1:3])
            return values, sq, tops, total, dots

        def dots(trainable, untrained, metric_values, slots, flat, mean):
            return jax.jvp(lambda kv: each(kv, trainable, untrained, metric_values, slots,
                                           flat)[1], ([trainable[i] for i in kept],), (mean,))[1]

        if kind == "own":
            return jax.jit(lambda *arguments: sums(*arguments, dotted=True))
        return jax.jit(dots if kind == "dots" else sums)

    # --- Evaluation and building -------------------------------------------------------------

    def evaluate_chunk(self, chunk, what: str) -> None:
        """Runs Keras's stateless ``test_step`` on one chunk and assigns the metrics' new
        values (updated, not reset)."""
        _, leaves, signature = _leaves(chunk, what)
        if signature not in self._evaluates:
            self._evaluates[signature] = self._evaluation(signature)
        function, changed = self._evaluates[signature]
        model = self.model
        with _jax_errors("evaluate"), _model_errors(what):
            updated = function([v.value for v in model.trainable_variables],
                               [v.value for v in model.non_trainable_variables],
                               [v.value for v in model.metrics_variables], leaves)
        for v, value in zip(model.metrics_variables, updated):
            v.assign(value)
        self.evaluated_metrics |= self._metrics_of(changed)

    def refuse_strategies(self) -> None:
        """Raises HostavgError where a ``keras.distribution`` distribution is set: hostavg
        trains one model on one device per process."""
        distribution = keras.distribution.distribution()
        if distribution is not None:
            raise ArgumentError(
                f"hostavg.keras runs under a keras.distribution {type(distribution).__name__}, "
                f"which hostavg does not drive: it trains one model on one device per process "
                f"and averages the micro-batches on the host. Unset it "
                f"(keras.distribution.set_distribution(None)); for several devices or workers, "
                f"run one process per device and pass comm= (an mpi4py communicator such as "
                f"MPI.COMM_WORLD): every step averages over all ranks' micro-batches")

    def _values(self) -> tuple:
        """What every compiled function of a micro-batch reads first, the values now of: the
        model's trainable, non-trainable and metric variables, and :meth:`_slots`."""
        model = self.model
        return ([v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                [v.value for v in model.metrics_variables], self._slots())

    def _slots(self) -> list:
        """The optimizer's variables' values, for the loss scale (a LossScaleOptimizer's)."""
        return [v.value for v in self.optimizer.variables] if self._scales else []

    def _metrics_of(self, indices) -> set:
        """The ids of the model's metrics that own any of ``model.metrics_variables[indices]``."""
        changed = {id(self.model.metrics_variables[i]) for i in indices}
        return {id(m) for m in self.model.metrics if any(id(v) in changed for v in m.variables)}

    # --- Tracing --------------------------------------------------------------------------

    def _trace_compute(self, leaves, signature, what: str):
        """(the gradient function, the variables it assigns, the names of the logs it returns:
        none) for one input signature; the first one also fixes spec.

        Traced once here (``jax.make_jaxpr``) to learn what the loss depends on
        and what the forward pass assigns; compiled by ``jax.jit`` on its first call.
        """
        model, trainable = self.model, self._built(leaves, signature, what)
        untrained = [v.value for v in model.non_trainable_variables]
        metric_variables = list(model.metrics_variables)
        seen = {}

        def loss(values, untrained, metric_values, slots, flat):
            """(the loss as the optimizer scales it, (the loss, the new values of the
            non-trainable variables and of the metric variables that changed))."""
            x, y, w = _rebuild(signature, flat)
            scaled, (value, y_pred, new, metrics) = model.compute_loss_and_updates(
                values, untrained, metric_values, x, y, w, training=True,
                optimizer_variables=slots)
            with keras.StatelessScope(state_mapping=list(zip(metric_variables, metrics))) as scope:
                model.compute_metrics(x, y, y_pred, w)
            metrics = [scope.get_current_value(v) for v in metric_variables]
            seen["assigned"] = [i for i, (a, b) in enumerate(zip(new, untrained)) if a is not b]
            seen["metrics"] = [i for i, (a, b) in enumerate(zip(metrics, metric_values))
                               if a is not b]
            return scaled, (value, [new[i] for i in seen["assigned"]],
                            [metrics[i] for i in seen["metrics"]])

        with _model_errors(what):
            traced = jax.make_jaxpr(loss)([v.value for v in trainable], untrained,
                                          [v.value for v in metric_variables], self._slots(),
                                          leaves)
        kept = [i for i, used in enumerate(used_inputs(traced)[:len(trainable)]) if used]
        spec = self._traced_spec(what, traced.out_avals[0].shape, trainable,
                                 [(i, False) for i in kept])  # JAX's gradients are dense
        if self.spec is None:
            if self.nonfinite == "optimizer" and len(kept) < len(trainable):
                unreached = [v.path for i, v in enumerate(trainable) if i not in kept]
                raise ArgumentError(
                    f"{what}: on Keras's JAX backend a LossScaleOptimizer applies to every "
                    f"trainable variable at once (its stateless_apply), but the loss reaches "
                    f"none of {unreached}; make them non-trainable (layer.trainable = False), "
                    f"or train without mixed_float16's loss scaling")
            self.spec, self._kept = spec, kept
        self._losses[signature] = loss
        return self._jitted(self._compiled_compute(loss), seen), \
            self._adopt(seen["assigned"], seen["metrics"]), ()

    def _built(self, leaves, signature, what: str) -> list:
        """The model's trainable variables, the model, its optimizer and its metrics built on
        the batch ``leaves`` (of ``signature``) first where they are not."""
        x, _, _ = _rebuild(signature, leaves)
        if not self.model.built:
            with _model_errors(what):
                self.model(x, training=False)  # creates the variables; assigns nothing
        self.build_optimizer()
        self._build_metrics(signature, leaves, what)
        trainable = list(self.model.trainable_variables)
        if not trainable:
            raise ArgumentError(f"{what}: the model has no trainable variables: nothing to train")
        return trainable

    def _adopt(self, assigned: list, metrics: list) -> list:
        """The variables a gradient function assigns, ``model.non_trainable_variables[assigned]``
        then ``model.metrics_variables[metrics]``, added to the rollback set (and to the step's
        snapshot) and their metrics to :attr:`trained_metrics`."""
        assigns = [self.model.non_trainable_variables[i] for i in assigned] + \
            [self.model.metrics_variables[i] for i in metrics]
        for v in assigns:
            if id(v) not in self.assigned:
                self.assigned[id(v)] = v
                self._snapshot[id(v)] = v.value  # the step being prepared has not computed yet
        self.trained_metrics |= self._metrics_of(metrics)
        return assigns

    def _build_metrics(self, signature, leaves, what: str) -> None:
        """Creates the compiled loss's and metrics' variables, which Keras makes on their first
        use, before a compiled function is traced (JAX cannot create variables within one):
        the loss and metrics computed once on the batch's first sample, eagerly, in a
        ``StatelessScope`` that keeps what they would assign from the model (reading the
        variables' values through it: a weight regularizer reads its variable there)."""
        model = self.model
        x, y, w = _rebuild(signature, [leaf[:1] for leaf in leaves])
        values = [(v, v.value) for v in model.variables]
        with _model_errors(what), keras.StatelessScope(state_mapping=values):
            y_pred = model(x, training=False)
            model.compute_loss(x, y, y_pred, w)
            model.compute_metrics(x, y, y_pred, w)

    def _compiled_compute(self, loss):
        """``(trainable, untrained, metric values, optimizer values, share, donated, leaves) ->
        (loss, squared norms, gradients, the new values of the variables the forward pass and
        the metrics assign, no logs)`` (:meth:`_jitted` jits it). The gradients are of the loss
        as the optimizer scales it, divided by its scale."""
        kept, optimizer, scales = self._kept, self.optimizer, self._scales

        def of_kept(kept_values, trainable, untrained, metric_values, slots, share, flat):
            scaled, aux = loss(_with_kept(trainable, kept, kept_values), untrained,
                               metric_values, slots, flat)
            return (scaled * share if scales else scaled), aux

        gradient = jax.value_and_grad(of_kept, has_aux=True)

        def compute(trainable, untrained, metric_values, slots, share, donated, flat):
            (_, (value, new, metrics)), grads = gradient(
                [trainable[i] for i in kept], trainable, untrained, metric_values, slots, share,
                flat)
            if scales:  # unscaled as Keras's optimizer unscales: g / scale (x share, see
                scale = _scale(optimizer, slots) * share  # Backend.compute)
                grads = [g / scale.astype(g.dtype) for g in grads]
            return value, _squares(grads), grads, [*new, *metrics], []

        return compute

    def _jitted(self, compute, seen: Mapping):
        """``compute`` jitted, ``donated`` (gradient-shaped buffers, its sixth argument)
        donated; kept with the indices of the non-trainable and metric variables it assigns
        (``seen``'s "assigned" and "metrics") for :meth:`compute_many`."""
        function = jax.jit(compute, donate_argnums=5, keep_unused=True,
                           out_shardings=(None, None, self._outputs, None, None))
        self._bodies[function] = (compute, list(seen["assigned"]), list(seen["metrics"]))
        return function

    def _donated_gradient_buffers(self):
        """What a compute donates for its gradients: the buffers of the compute two before (or
        new ones while there are none yet), or nothing where buffers are not reused."""
        if not self.reuses_buffers:
            return ()
        with self._ring_lock:
            del self._ring[:-_RING]  # (more where computes were dispatched in turn)
            if len(self._ring) >= _RING:
                return self._ring.pop(0)
        return self._new_gradient_buffers()

    def _new_gradient_buffers(self) -> list:
        """New gradient-shaped buffers, for a compute to donate."""
        return [jax.device_put(jnp.zeros(s.shape, s.dtype), self._outputs)
                for s in self.spec.values()]

    def _application(self, request: ApplyRequest, donates: bool = True):
        """``(trained values, optimizer values, mean) ->`` :class:`_Stateless`, jitted, the old
        values donated where ``donates``: not under JAX's debug flags (:func:`_debugging`),
        where a non-finite output makes JAX call the apply again, op by op, on its inputs,
        which donated ones no longer are; the norms only with ``request.ratios``, the updates
        only with ``request.values``; where a checked one is not finite (check_applied), the
        old values come back as the new ones."""
        trained = _trained(self.model, self._kept)
        optimizer, scales = self.optimizer, self._scales
        # Nothing checked where the host proved the apply finite (request.proven).
        checks = [self._checks(v) and not request.proven
                  for v in trained + list(optimizer.variables)]
        loss_scaling = self.nonfinite == "optimizer"  # a LossScaleOptimizer
        position = {id(v): i for i, v in enumerate(trained + list(optimizer.variables))}
        measured = [position[id(v)] for v in self._bounded()[1]] \
            if any(checks) else []  # (every checked apply measures)
        iteration = position[id(optimizer.iterations)] - len(trained)

        def apply(values, slots, grads):
            mapping = list(zip(trained, values)) + list(zip(optimizer.variables, slots))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                lr = jnp.asarray(optimizer.learning_rate, _WIDE)  # this iteration's (a schedule's too)
                scale = optimizer.scale_loss(jnp.ones((), jnp.float32)) if scales else \
                    jnp.ones((), jnp.float32)
                if scales:  # scaled back, as the optimizer gets Keras's gradient of the scaled loss
                    grads = [g * scale.astype(g.dtype) for g in grads]
                if not loss_scaling:
                    optimizer.apply(grads, trained)
                # The next apply's rate (a schedule's at the next iteration), for its proof.
                next_rate = jnp.asarray(optimizer.learning_rate, _WIDE)
            if loss_scaling:  # its finite-or-skip choice is a lax.cond: only its stateless form
                new, new_slots = optimizer.stateless_apply(slots, grads, values)  # traces under jit
                after = _scale(optimizer, new_slots)
            else:
                new = [scope.get_current_value(v) for v in trained]
                new_slots = [scope.get_current_value(v) for v in optimizer.variables]
                after = scale
            squares = jnp.zeros(0, _WIDE)
            if request.ratios:
                squares = jnp.stack([_sum_squares(a, b) for a, b in zip(new, values)]
                                    + [_sum_squares(b) for b in values])
            updates = [a - b for a, b in zip(new, values)] if request.values else []
            finite = jnp.stack([jnp.all(jnp.isfinite(a)) for a, check
                                in zip([*new, *new_slots], checks) if check] or [jnp.bool_(True)])
            if any(checks):
                new, new_slots = jax.lax.cond(jnp.all(finite), lambda: (new, new_slots),
                                              lambda: (list(values), list(slots)))
            both = [*new, *new_slots]
            magnitudes = jnp.stack([jnp.max(jnp.abs(both[i]), initial=0).astype(_WIDE)
                                    for i in measured]) if measured else jnp.zeros(0, _WIDE)
            return _Stateless(new, new_slots, updates, *_packed(
                lr, next_rate, jnp.stack([scale, after]), squares, magnitudes,
                slots[iteration], new_slots[iteration], finite[:sum(checks)]))

        return jax.jit(apply, donate_argnums=(0, 1) if donates else ())

    def _evaluation(self, signature) -> tuple:
        """(``(trainable, untrained, metric values, leaves) -> new metric values``, jitted: Keras's
        own stateless ``test_step``; the indices of the metric variables it changes, a set
        filled when it is traced)."""
        model, changed = self.model, set()

        def evaluation(trainable, untrained, metric_values, flat):
            x, y, w = _rebuild(signature, flat)
            _, (_, _, metrics) = model.test_step((trainable, untrained, metric_values),
                                                 (x, y) if w is None else (x, y, w))
            changed.update(i for i, (a, b) in enumerate(zip(metrics, metric_values))
                           if a is not b)
            return metrics

        return jax.jit(evaluation), changed


class KerasJaxTrainStepBackend(OwnStep, KerasJaxBackend):
    """A Keras model with its own stateless ``train_step`` and its optimizer, on JAX (:class:`hostavg.engine.protocols.Backend`).

    Per micro-batch one ``jax.jit`` runs the model's ``train_step(state, data)``
    with every optimizer's ``stateless_apply`` captured
    (:mod:`hostavg.keras.train_step`): the gradients it is given are the
    micro-batch's, the old weights and optimizer state go on, and the state's
    new non-trainable and metric values are assigned to the model, as
    :class:`KerasJaxBackend` assigns them. Takes its arguments.
    """

    def _state(self, values: dict, logs: dict):
        return values, logs

    def _slots(self) -> list:
        """Every optimizer variable's value: a train_step's state holds them."""
        return [v.value for v in self.optimizer.variables]

    def _trace_compute(self, leaves, signature, what: str):
        """(the function that runs train_step, the variables it assigns, the names of the logs
        it returns) for one input signature; the first one also fixes spec."""
        model, trainable = self.model, self._built(leaves, signature, what)
        untrained = [v.value for v in model.non_trainable_variables]
        metric_values = [v.value for v in model.metrics_variables]
        step, seen = self._stepping(signature, what), {}
        with _model_errors(what):
            jax.make_jaxpr(lambda *args: step(*args, seen))(
                [v.value for v in trainable], untrained, metric_values, self._slots(), leaves)
        if seen["gradients"] != len(trainable):
            raise ArgumentError(f"{what}: model {model.name!r}'s train_step applies "
                                f"{seen['gradients']} gradients, not one per trainable variable "
                                f"({len(trainable)}), as stateless_apply takes them")
        spec = self._traced_spec(what, (), trainable, [(i, False) for i in range(len(trainable))])
        if self.spec is None:
            self.spec, self._kept = spec, list(range(len(trainable)))

        def compute(trainable, untrained, metric_values, slots, share, donated, flat):
            loss, grads, new, metrics, logs = step(trainable, untrained, metric_values, slots,
                                                   flat, {})
            return loss, _squares(grads), grads, [*new, *metrics], logs

        return self._jitted(compute, seen), self._adopt(seen["assigned"], seen["metrics"]), \
            seen["names"]

    def _stepping(self, signature, what: str):
        """``(trainable, untrained, metric values, optimizer values, leaves, seen) -> (loss,
        gradients, new values of the non-trainable and of the metric variables that changed,
        logs)``: the model's train_step with the apply captured; ``seen`` gets the indices of
        those variables, the logs' names and how many gradients it applied."""
        model = self.model
        variables = list(model.metrics_variables)
        found = loss_tracker(model)
        tracker = None if found is None else [_index(v, variables) for v in found]

        def step(trainable, untrained, metric_values, slots, flat, seen):
            x, y, w = _rebuild(signature, flat)
            with captured(model) as calls:
                logs, state = model.train_step((trainable, untrained, slots, metric_values),
                                               keras.utils.pack_x_y_sample_weight(x, y, w))
            logs = flat_logs(logs, model, what)
            grads, _ = the_apply(calls, model, what)
            _, new, _, metrics = state
            seen["assigned"] = [i for i, (a, b) in enumerate(zip(new, untrained)) if a is not b]
            seen["metrics"] = [i for i, (a, b) in enumerate(zip(metrics, metric_values))
                               if a is not b]
            seen["names"], seen["gradients"] = list(logs), len(grads)
            pick = (lambda values: None) if tracker is None else \
                (lambda values: [values[i] for i in tracker])
            return (micro_loss(logs["loss"], pick(metric_values), pick(metrics)), list(grads),
                    [new[i] for i in seen["assigned"]], [metrics[i] for i in seen["metrics"]],
                    list(logs.values()))
        return step


class _Stateless(NamedTuple):
    """What the jitted apply returns (:meth:`KerasJaxBackend._application`), JAX arrays.

    Attributes:
      new, slots: the trained variables' and the optimizer variables' new values (the old
        ones where the update was undone).
      updates: each trained variable's update (or empty).
      reals, counts: the apply's numbers (:func:`_packed`), in two arrays, so that the host
        reads them in two transfers from the device rather than one a number.
    """

    new: list
    slots: list
    updates: list
    reals: Any
    counts: Any


def _packed(learning_rate, next_rate, scales, squares, magnitudes, before, after, finite):
    """(reals, counts) on the device: the learning rates this iteration and the next, the loss
    scale before and after, the updates' squared norms then the weights' before (or none) and
    the magnitudes measured (or none), in the wide float dtype; ``optimizer.iterations``
    before and after and whether each checked variable is finite, as integers."""
    reals = jnp.concatenate([jnp.stack([learning_rate, next_rate]).astype(_WIDE),
                             scales.astype(_WIDE), squares.astype(_WIDE), magnitudes.astype(_WIDE)])
    counts = jnp.concatenate([jnp.stack([before, after]).astype(_COUNT), finite.astype(_COUNT)])
    return reals, counts


def _unpacked(reals, counts, squares: int, weights: list, updates: list) -> tuple:
    """(the :class:`~hostavg.keras.common.ApplyOutputs` of :func:`_packed`'s arrays, read on the
    host, with ``weights`` and ``updates``; the next iteration's learning rate), ``squares``
    of the reals after the rates and scales being squared norms, the rest magnitudes."""
    reals, counts = np.asarray(reals), np.asarray(counts)
    return ApplyOutputs(int(counts[0]), int(counts[1]), float(reals[0]), reals[4:4 + squares],
                        (float(reals[2]), float(reals[3])), weights, updates,
                        counts[2:].astype(bool), reals[4 + squares:]), float(reals[1])


def _tapped_sums(taps: LayerTaps, trained: list, one, unscaled, kept_values: list,
                 arguments: tuple, flat, dotted: bool = False) -> tuple:
    """(losses, squared norms, ones, the sum of the samples' gradients, with ``dotted`` each
    gradient's dot with that sum, else None) of every sample of ``flat`` computed alone
    under ``jax.vmap``: ``one(kept values, *arguments, leaves) -> (scaled loss, loss)``,
    ``unscaled`` its gradients divided by the loss scale. The kernels
    and biases of ``taps``' layers (indices into ``trained``, whose values are
    ``kept_values``) are not differentiated: their squared norms and sums come from each
    layer's input a and delta (:mod:`hostavg.keras.layer_taps`); the other variables'
    gradients are formed."""
    rest = taps.untapped(len(kept_values))
    own = {id(trained[p]): kept_values[p] for p in taps.indices()}

    def sample(leaves):
        def of(others, zeros):
            values, inputs = _with_kept(kept_values, rest, others), [None] * len(taps)
            with taps.tapped(lambda v: own[id(v)], lambda j, z: z + zeros[j], inputs):
                scaled, value = one(values, *arguments, leaves)
            return scaled, (value, [a[0] for a in inputs])
        zeros = [jnp.zeros(taps.outputs[id(layer)].shape, taps.outputs[id(layer)].dtype)
                 for layer in taps.layers]
        (g, deltas), (value, inputs) = jax.grad(of, (0, 1), has_aux=True)(
            [kept_values[p] for p in rest], zeros)
        g, deltas = unscaled(g), [d[0] for d in unscaled(deltas)]
        return value, sum((_sum_squares(x) for x in g), jnp.zeros((), _WIDE)), g, inputs, deltas

    values, sq, g, inputs, deltas = jax.vmap(sample)(flat)
    tapped, total, dots = taps.sums([jnp.sum(x, 0) for x in g], inputs, deltas, _WIDE, dotted)
    sq = sq + tapped
    if dotted:
        formed = _formed_dots(g, [total[p] for p in rest])
        dots = formed if dots is None else dots if formed is None else formed + dots
    return values, sq, jnp.ones_like(sq), total, dots


def _formed_dots(grads: list, sums: list):
    """(n,) each sample's formed gradients ``grads`` (each (n, *shape)) dotted with ``sums``
    (one array per gradient, :func:`~hostavg.keras.layer_taps.per_sample_dots`), in the wide
    dtype; None where there are none."""
    dots = [per_sample_dots(g, m, _WIDE) for g, m in zip(grads, sums)]
    return sum(dots[1:], dots[0]) if dots else None


def _trained(model, kept: list) -> list:
    """``model.trainable_variables[kept]``: the property walks every layer, read once."""
    trainable = model.trainable_variables
    return [trainable[i] for i in kept]


def _with_kept(trainable: list, kept: list, kept_values: list) -> list:
    """``trainable`` (every trainable variable's value) with ``kept_values`` at ``kept``."""
    values = list(trainable)
    for i, value in zip(kept, kept_values):
        values[i] = value
    return values


def _index(variable, variables: list) -> int:
    """The position of ``variable`` in ``variables`` (by identity)."""
    return next(i for i, v in enumerate(variables) if v is variable)


def _scale(optimizer, slots):
    """The optimizer's loss scale, with its variables' values ``slots``: a LossScaleOptimizer's
    dynamic scale, or the loss_scale_factor it was made with."""
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, slots))):
        return optimizer.scale_loss(jnp.ones((), jnp.float32))


def _host_outputs() -> tuple:
    """(:attr:`~KerasJaxBackend.host_memory`, the sharding gradients are placed in, whether a
    donated buffer there is written again), found by a probe on the default device.

    On the CPU its own memory; on an accelerator its pinned host memory where a
    compiled function can place outputs there that NumPy views without a copy
    (``np.from_dlpack``); else the device's ("device").
    """
    device = jax.devices()[0]
    sharding = None if device.platform == "cpu" else \
        jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unusable donation is a warning
            donated = jax.device_put(jnp.zeros(4, jnp.float32), sharding)
            where = donated.unsafe_buffer_pointer()
            out = jax.jit(lambda a, donated: a + 1, donate_argnums=1, keep_unused=True,
                          out_shardings=sharding)(jnp.zeros(4, jnp.float32), donated)
            view = np.from_dlpack(out)
            if view.ctypes.data == out.unsafe_buffer_pointer() and view[0] == 1:
                return ("host" if sharding is None else "pinned_host", sharding,
                        out.unsafe_buffer_pointer() == where)
    except Exception:  # noqa: BLE001 - whatever fails, the gradients stay in device memory
        pass
    return "device", None, False


def _shapes(feed) -> tuple:
    """A prepared feed's compute and its inputs' shapes and dtypes: feeds alike in these
    compute in one call (:meth:`KerasJaxBackend.compute_many`)."""
    return feed[0][0], feed[2], tuple((np.shape(leaf), np.result_type(leaf)) for leaf in feed[1])


def _stacked(leaves: list):
    """The micro-batches' ``leaves`` of one input stacked on a new first axis: by NumPy on the
    host, by JAX where they are on a device already."""
    if all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _host(array) -> np.ndarray:
    """``array`` (a JAX array in host memory, or on a device) as NumPy: a view without a copy
    where it lies in host memory, else a copy. The view holds no cache on the JAX array, so
    once it and its views are gone the buffer may be donated again."""
    try:
        return np.from_dlpack(array)
    except (TypeError, BufferError, RuntimeError):
        return np.asarray(array)


def _squares(grads):
    """Each gradient's squared norm, in the wide dtype."""
    return jnp.stack([jnp.sum(jnp.square(g.astype(_WIDE))) for g in grads])


def _sum_squares(x, minus=None):
    """sum((x - minus)^2), or sum(x^2), in the wide dtype."""
    x = x.astype(_WIDE)
    if minus is not None:
        x = x - minus.astype(_WIDE)
    return jnp.sum(jnp.square(x))


def _run_time() -> tuple:
    """What a compiled call raises as it runs: JAX's run-time error (a failed device, a
    callback that raised), and while ``jax_debug_nans`` or ``jax_debug_infs`` is on (read now:
    ``with jax.debug_nans(True):`` counts) the FloatingPointError of a non-finite output; else
    a FloatingPointError is the model's, as JAX traces it (NumPy's ``errstate``)."""
    if _debugging():
        return jax.errors.JaxRuntimeError, FloatingPointError
    return (jax.errors.JaxRuntimeError,)


def _debugging() -> bool:
    """Whether ``jax_debug_nans`` or ``jax_debug_infs`` is on now (``with jax.debug_nans(True):``
    counts): JAX then checks each compiled call's outputs, and calls it again op by op where
    one is not finite, to raise a FloatingPointError at the operation that made it."""
    return bool(jax.config.jax_debug_nans or jax.config.jax_debug_infs)


@contextmanager
def _jax_errors(call: str):
    """Turns what a compiled call raises as it runs (:func:`_run_time`) into a StepError saying
    where, and what: a FloatingPointError that a Keras layer wrapped by the NaN's operation."""
    try:
        yield
    except _run_time() as error:
        said = traced_message(error) if isinstance(error, FloatingPointError) else \
            _first_line(error)
        raise StepError(f"JAX failed in the {call} ({said})") from error


def _model_errors(what: str):
    return model_errors(what, _first_line)


@contextmanager
def _traced(made):
    """Turns what the model's code raises while JAX traces it (not a HostavgError, not a
    failure as it runs: :func:`_run_time`) into the exception ``made(error)``."""
    try:
        yield
    except (HostavgError, *_run_time()):
        raise
    except Exception as error:  # noqa: BLE001 - the model's own code, traced
        raise made(error) from error


def _vectorizing():
    """A vmapped function whose tracing fails (a primitive without a batching rule) raises
    :class:`~hostavg.engine.protocols.NotVectorized` saying so."""
    return _traced(lambda error: NotVectorized(
        f"jax.vmap of the model's one-sample gradient failed ({type(error).__name__}: "
        f"{_first_line(error)})"))


def _traced_errors():
    """Turns what the model raises while JAX traces a compute for a new micro-batch's shapes
    (JAX compiles per shape, at the first call) into the ArgumentError of a model that cannot
    run on that micro-batch, its fact kept (a shape built from the full batch shows there)."""
    return _traced(lambda error: refused(
        f"the model cannot run on this micro-batch ({type(error).__name__}: "
        f"{traced_message(error)})", "check its x and y against the model's inputs and the "
        f"loss", ArgumentError))


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _raised(error: BaseException):
    """Raises ``error`` (a computation that failed as its call was made)."""
    raise error
