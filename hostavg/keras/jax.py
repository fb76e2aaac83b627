"""hostavg.keras on Keras's JAX backend: :class:`KerasJaxBackend`, the engine's backend for a Keras model.

Imports JAX and Keras, never TensorFlow. Per micro-batch, one compiled
function (``jax.jit`` of ``jax.value_and_grad`` over ``model.stateless_call``
with ``training=True``, as Keras's own JAX ``train_step`` takes its gradients)
runs the forward pass, the loss (plus ``model.losses``), the backward pass
and the squared norm of every gradient, and returns the new values of the
non-trainable variables the forward pass assigns (batch-norm moving
statistics, dropout's seed state), which are then assigned to the model, as
Keras's own step leaves them. One ``jax.jit`` is made per input structure;
like Keras's own, it compiles once more for each new micro-batch size, since
XLA compiles for fixed shapes (a shorter last micro-batch costs one compile).

**Gradients are dense.** JAX has no sparse gradient: an ``Embedding``'s
gradient is its whole table, zeros but for the rows looked up, where
TensorFlow gives ``IndexedSlices`` of those rows. Every variable's
:class:`~hostavg.VariableSpec` says ``sparse=False``, and each micro-batch
brings the whole table to the host and adds it there.

**Host buffers.** The gradients come to NumPy without a copy where they
already lie in host memory (``np.from_dlpack``: the CPU; on an accelerator,
outputs placed in pinned host memory where JAX supports it and NumPy can view
it), and are frozen. Each compute donates the output buffers of the compute
two before it (``donate_argnums``), so XLA writes the new gradients into host
memory it wrote before instead of allocating: in "sum" mode, once a
micro-batch has been added, nothing holds its gradients any more, and two
sets of buffers serve every micro-batch. JAX reuses a donated buffer only when
no NumPy array views it, so gradients that are still held (by a hook, in
"stack" mode, handed out by ``compute``) are never overwritten: the compute
then allocates, as without donation. Elsewhere (an accelerator without that
support) each micro-batch's gradients are copied into new host memory.

The mean goes back through a second compiled function that applies it with
the optimizer once, statelessly (``optimizer.apply`` in a
``keras.StatelessScope`` over the trained variables and the optimizer's, as
``optimizer.stateless_apply`` does, but for the variables that have a
gradient only), donating the old values as Keras's own step does; the new
values are assigned to the variables, and ``optimizer.iterations`` grows by
one. A variable the loss does not depend on has no gradient and is not
trained (:func:`hostavg.compat.jax.used_inputs`), as on TensorFlow.

Squared norms and update ratios are reduced on the device in float32 (float64
with ``jax_enable_x64``), the variables' dtype or wider, as TF1's backend
reduces them.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Mapping
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import keras
import numpy as np

from hostavg.compat.jax import used_inputs
from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.gradients import VariableSpec, freeze
from hostavg.core.split import feed_size
from hostavg.core.stats import update_ratio
from hostavg.engine.protocols import Applied, Computed
from hostavg.keras.common import ModelVariables, model_errors
from hostavg.keras.common import leaves as _leaves
from hostavg.keras.common import rebuild as _rebuild

__all__ = ["KerasJaxBackend"]

#: The dtype squared norms are reduced in on the device: float64 if JAX allows it, else float32.
_WIDE = jax.dtypes.canonicalize_dtype(jnp.float64)
#: How many computes' output buffers are kept to be donated: the one before the last is
#: free again once the engine has added it (with ``overlap``, the one in flight is the last).
_RING = 2


class KerasJaxBackend(ModelVariables):
    """A Keras model with its loss and optimizer on Keras's JAX backend (:class:`hostavg.engine.protocols.Backend`).

    Attributes:
      spec: name -> VariableSpec of every trained variable (None until the
        first batch is prepared); dense for every variable.
      assigned: index in ``model.variables`` -> variable, for every
        non-trainable variable the traced gradient functions may assign (the
        rollback set).
      target: the model.
      host_memory: where the compiled gradients are placed for the host to
        read: "host" (the CPU's own memory) or "pinned_host" (an accelerator's
        pinned host memory), both viewed by NumPy without a copy; or "device"
        (an accelerator where JAX cannot: each gradient is copied to new host
        memory).
      reuses_buffers: whether computes donate earlier gradient buffers to
        XLA to write the next gradients into (where the host views them
        without a copy and JAX donates such buffers).
    """

    framework = "keras"

    def __init__(self, model, loss, optimizer):
        self.model, self.optimizer, self._loss = model, optimizer, loss
        self.target = model
        self.increment = 1  # every apply moves optimizer.iterations by one
        self.spec = None
        self.assigned = {}
        self._kept = None  # indices in model.trainable_variables of the trained variables
        self._computes, self._evaluates = {}, {}  # input signature -> jitted function
        self._applies = {}  # measure (bool) -> jitted apply
        self._snapshot = {}
        self._ring = []  # the last computes' gradient outputs, oldest first: donated in turn
        self._ring_lock = threading.Lock()  # a lone compute may run beside a step's
        self._training = {"training": True} if _takes_training(model) else {}
        self._inference = {"training": False} if self._training else {}
        self.host_memory, self._outputs, self.reuses_buffers = _host_outputs()

    # --- The engine's protocol ------------------------------------------------------------

    def prepare(self, batch, size, what: str) -> tuple:
        batch, leaves, signature = _leaves(batch, what)
        if size is None:
            n = feed_size(batch, what)
            if n < 1:
                raise HostavgError(f"{what}: a micro-batch must hold at least 1 sample, got {n}")
        else:
            n = positive_int(f"{what}: size", size)
        compiled = self._computes.get(signature)
        if compiled is None:
            compiled = self._computes[signature] = self._trace_compute(leaves, signature, what)
        return (*compiled, leaves), n

    def compute(self, feed) -> Computed:
        function, assigns, leaves = feed
        trainable = [v.value for v in self.model.trainable_variables]
        untrained = [v.value for v in self.model.non_trainable_variables]
        landing = self._landing()
        with _jax_errors("compute"):
            loss, sq_norms, grads, assigned = function(trainable, untrained, landing, leaves)
            jax.block_until_ready(grads)
        for v, value in zip(assigns, assigned):
            v.assign(value)
        if self.reuses_buffers:
            with self._ring_lock:
                self._ring.append(grads)
        return Computed(float(loss), {name: freeze(_host(g)) for name, g in zip(self.spec, grads)},
                        self.global_step(), dict(zip(self.spec, np.asarray(sq_norms).tolist())))

    def random_ops(self) -> tuple:
        return ()  # the check names Keras's random layers in its advice

    def apply_feed(self, feeds, what: str) -> dict:
        """Nothing: a Keras optimizer reads no input besides the gradients."""
        return {}

    def apply(self, mean: Mapping, feed: Mapping, measure: bool = True) -> Applied:
        """Applies ``mean`` once; reports the new ``optimizer.iterations``, the learning rate
        the apply used and, with ``measure``, the update-to-weight ratios, all from that one
        compiled call (measuring reduces two norms per variable)."""
        function = self._applies.get(measure)
        if function is None:
            function = self._applies[measure] = self._application(measure)
        trained = [self.model.trainable_variables[i] for i in self._kept]
        grads = [jnp.asarray(mean[name], s.dtype) for name, s in self.spec.items()]
        with _jax_errors("apply"):
            values, slots, lr, squares = function([v.value for v in trained],
                                                  [v.value for v in self.optimizer.variables],
                                                  grads)
        for v, value in zip(trained, values):
            v.assign(value)
        for v, value in zip(self.optimizer.variables, slots):
            v.assign(value)
        ratios = None
        if measure:
            squares, k = np.asarray(squares).tolist(), len(self.spec)
            ratios = {name: update_ratio(u, w)
                      for name, u, w in zip(self.spec, squares[:k], squares[k:])}
        return Applied(self.global_step(), ratios, float(lr))

    def global_step(self) -> int:
        return int(self.optimizer.iterations.value)

    def snapshot(self) -> dict:
        """The values of :attr:`assigned` (JAX arrays, which never change); a function traced
        while the step prepares adds what it assigns."""
        self._snapshot = {i: v.value for i, v in self.assigned.items()}
        return self._snapshot

    def restore(self, snapshot: dict) -> None:
        for i, value in snapshot.items():
            self.assigned[i].assign(value)

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
                function = self._evaluates[signature] = self._evaluation(signature, compiled)
            n = feed_size(chunk, what)
            metric_variables = self.model.metrics_variables if compiled else []
            with _jax_errors("evaluate"), _model_errors(what):
                loss, updated = function([v.value for v in self.model.trainable_variables],
                                         [v.value for v in self.model.non_trainable_variables],
                                         [v.value for v in metric_variables], leaves)
            for v, value in zip(metric_variables, updated):
                v.assign(value)
            total += n * float(loss)
            count += n
        out = {"loss": total / count}
        if compiled:
            out.update((name, float(value)) for name, value in self.model.get_metrics_result().items()
                       if name != "loss" and np.ndim(value) == 0)
        return out

    # --- Tracing --------------------------------------------------------------------------

    def _trace_compute(self, leaves, signature, what: str):
        """(the gradient function, the variables it assigns) for one input signature; the
        first one also fixes spec.

        Traced once here (``jax.make_jaxpr``) to learn what the loss depends on
        and what the forward pass assigns; compiled by ``jax.jit`` on its first call.
        """
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
        untrained = [v.value for v in self.model.non_trainable_variables]
        seen = {}

        def loss(values, untrained, flat):
            x, y, w = _rebuild(signature, flat)
            y_pred, new, losses = self.model.stateless_call(values, untrained, x,
                                                            return_losses=True, **self._training)
            value = self._loss(y, y_pred, w)
            for extra in losses:
                value = value + jnp.sum(extra).astype(value.dtype)
            seen["assigned"] = [i for i, (a, b) in enumerate(zip(new, untrained)) if a is not b]
            return value, [new[i] for i in seen["assigned"]]

        with _model_errors(what):
            traced = jax.make_jaxpr(loss)([v.value for v in trainable], untrained, leaves)
        shape = traced.out_avals[0].shape
        if shape != ():
            raise HostavgError(
                f"{what}: the loss has shape {shape}, not a scalar; give the micro-batch MEAN "
                f"(a keras.losses.Loss reduces it)")
        kept = [i for i, used in enumerate(used_inputs(traced)[:len(trainable)]) if used]
        if not kept:
            raise HostavgError(f"{what}: nothing to train: no trainable variable of the model has "
                               f"a gradient with respect to the loss")
        if self.spec is None:
            paths = [trainable[i].path for i in kept]
            shared = sorted({p for p in paths if paths.count(p) > 1})
            if shared:
                raise HostavgError(
                    f"trained variables share the paths {shared}; gradients are keyed by "
                    f"variable.path: give their layers distinct names")
            self.spec = {trainable[i].path: VariableSpec(tuple(trainable[i].shape),
                                                         np.dtype(trainable[i].dtype), False)
                         for i in kept}
            self._kept = kept
        elif kept != self._kept:
            raise HostavgError(
                f"{what}: with this batch's inputs the loss has gradients for other variables "
                f"({sorted(trainable[i].path for i in kept)}) than with the first batch's "
                f"({sorted(self.spec)}); give every batch the same structure")
        assigns = [self.model.non_trainable_variables[i] for i in seen["assigned"]]
        variables = self.model.variables
        for v in assigns:
            index = next(j for j, u in enumerate(variables) if u is v)
            if index not in self.assigned:
                self.assigned[index] = v
                self._snapshot[index] = v.value  # the step being prepared has not computed yet
        return self._compiled_compute(loss), assigns

    def _compiled_compute(self, loss):
        """``(trainable, untrained, landing, leaves) -> (loss, squared norms, gradients, the
        new values of the variables the forward pass assigns)``, jitted; ``landing``
        (gradient-shaped buffers) is donated."""
        kept = self._kept

        def of_kept(kept_values, trainable, untrained, flat):
            values = list(trainable)
            for i, value in zip(kept, kept_values):
                values[i] = value
            return loss(values, untrained, flat)

        gradient = jax.value_and_grad(of_kept, has_aux=True)

        def compute(trainable, untrained, landing, flat):
            (value, new), grads = gradient([trainable[i] for i in kept], trainable, untrained, flat)
            sq = jnp.stack([jnp.sum(jnp.square(g.astype(_WIDE))) for g in grads])
            return value, sq, grads, new

        return jax.jit(compute, donate_argnums=2, keep_unused=True,
                       out_shardings=(None, None, self._outputs, None))

    def _landing(self):
        """What a compute donates for its gradients: the buffers of the compute two before (or
        new ones while there are none yet), or nothing where buffers are not reused."""
        if not self.reuses_buffers:
            return ()
        with self._ring_lock:
            if len(self._ring) >= _RING:
                return self._ring.pop(0)
        return [jax.device_put(jnp.zeros(s.shape, s.dtype), self._outputs)
                for s in self.spec.values()]

    def _application(self, measure: bool):
        """``(trained values, optimizer values, mean) -> (new trained values, new optimizer
        values, learning rate, squared norms of the updates then of the weights before)``,
        jitted, the old values donated."""
        trained = [self.model.trainable_variables[i] for i in self._kept]
        optimizer = self.optimizer

        def apply(values, slots, grads):
            mapping = list(zip(trained, values)) + list(zip(optimizer.variables, slots))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                lr = jnp.asarray(optimizer.learning_rate, _WIDE)  # this iteration's (a schedule's too)
                optimizer.apply(grads, trained)
            new = [scope.get_current_value(v) for v in trained]
            squares = jnp.zeros(0, _WIDE)
            if measure:
                squares = jnp.stack([_sum_squares(a, b) for a, b in zip(new, values)]
                                    + [_sum_squares(b) for b in values])
            return new, [scope.get_current_value(v) for v in optimizer.variables], lr, squares

        return jax.jit(apply, donate_argnums=(0, 1))

    def _evaluation(self, signature, compiled: bool):
        """``(trainable, untrained, metric values, leaves) -> (loss, new metric values)``, jitted."""
        model = self.model

        def evaluation(trainable, untrained, metric_values, flat):
            x, y, w = _rebuild(signature, flat)
            y_pred, _, losses = model.stateless_call(trainable, untrained, x, return_losses=True,
                                                     **self._inference)
            value = self._loss(y, y_pred, w)
            for extra in losses:
                value = value + jnp.sum(extra).astype(value.dtype)
            if not compiled:
                return value, []
            metric_variables = model.metrics_variables
            with keras.StatelessScope(state_mapping=list(zip(metric_variables,
                                                             metric_values))) as scope:
                model.compute_metrics(x, y, y_pred, sample_weight=w)
            return value, [scope.get_current_value(v) for v in metric_variables]

        return jax.jit(evaluation)


def _takes_training(model) -> bool:
    """Whether ``model.call`` takes ``training`` (stateless_call passes it on as given)."""
    return "training" in inspect.signature(model.call).parameters


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
            land = jax.device_put(jnp.zeros(4, jnp.float32), sharding)
            where = land.unsafe_buffer_pointer()
            out = jax.jit(lambda a, land: a + 1, donate_argnums=1, keep_unused=True,
                          out_shardings=sharding)(jnp.zeros(4, jnp.float32), land)
            view = np.from_dlpack(out)
            if view.ctypes.data == out.unsafe_buffer_pointer() and view[0] == 1:
                return ("host" if sharding is None else "pinned_host", sharding,
                        out.unsafe_buffer_pointer() == where)
    except Exception:  # noqa: BLE001 - whatever fails, the gradients stay in device memory
        pass
    return "device", None, False


def _host(array) -> np.ndarray:
    """``array`` (a JAX array in host memory, or on a device) as NumPy: a view without a copy
    where it lies in host memory, else a copy. The view holds no cache on the JAX array, so
    once it and its views are gone the buffer may be donated again."""
    try:
        return np.from_dlpack(array)
    except (TypeError, BufferError, RuntimeError):
        return np.asarray(array)


def _sum_squares(x, minus=None):
    """sum((x - minus)^2), or sum(x^2), in the wide dtype."""
    x = x.astype(_WIDE)
    if minus is not None:
        x = x - minus.astype(_WIDE)
    return jnp.sum(jnp.square(x))


@contextmanager
def _jax_errors(call: str):
    """Turns what a compiled call raises at run time into a HostavgError saying where."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        raise HostavgError(f"JAX failed in the {call} ({_first_line(error)})") from error


def _model_errors(what: str):
    return model_errors(what, _first_line)


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
