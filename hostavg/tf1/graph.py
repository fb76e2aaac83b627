"""The TensorFlow wiring, all of it: gradient tensors, the apply op, feeds, the averaging graph.

Everything here is built once, when a :class:`~hostavg.Trainer` is made, in the
loss's graph, with no device pinned: TensorFlow places every op where it
normally would (a GPU when there is one) and only gradient values cross to the
host. Nothing here does host arithmetic; that lives in the NumPy layer.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from hostavg.core.accumulator import Reduction
from hostavg.engine.protocols import Applied, Computed, HostAverage
from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.gradients import SparseGradient, VariableSpec, freeze, squared_norm
from hostavg.core.split import feed_size

v1 = tf.compat.v1

#: Where a trainer's session calls run their ops. "pool" (the default): the session's
#: inter-op thread pool, as ``sess.run`` does. "caller": the thread that calls
#: (TensorFlow's ``RunOptions.inter_op_thread_pool = -1``): no hand-off to the pool and back,
#: which costs 50-100 us a call on 2 cores, as much as a small model's whole compute. Two
#: differences make it opt-in: the calling thread does not flush denormal floats to zero as
#: TensorFlow's pool threads do, so values below ~1.2e-38 (float32) can differ from
#: ``sess.run``'s in kernels small enough to run inline; and a kernel that blocks its
#: thread until another op of the same call runs (a StagingArea's get before its put) would
#: wait forever, so calls that reach one of :data:`BLOCKING_OPS` use the pool anyway. A
#: graph placed on several devices (CPU and GPU) uses the pool either way.
SESSION_THREADS = ("pool", "caller")

#: Op types whose kernels block their thread until another op runs (StagingArea and
#: MapStagingArea gets, peeks and full puts): a call reaching one runs in the pool.
BLOCKING_OPS = frozenset({"Stage", "Unstage", "StagePeek", "MapStage", "MapUnstage",
                          "MapUnstageNoKey", "MapPeek", "OrderedMapStage", "OrderedMapUnstage",
                          "OrderedMapUnstageNoKey", "OrderedMapPeek"})

__all__ = ["BLOCKING_OPS", "READ_OPS", "SESSION_THREADS", "GraphAverage", "SessionBackend", "Wiring",
           "assigned_variables", "feed_array", "first_line", "load_variables", "resolve_feed"]


class Wiring:
    """The ops of one trainer.

    Attributes:
      graph: the loss's graph.
      names: the trained variables' names (``var.op.name``), in order.
      spec: name -> :class:`VariableSpec`.
      global_step: the global step variable.
      apply_inputs: name -> placeholder, each placeholder the train op reads
        (not through the fed gradients): a learning rate, a schedule's input.
        The apply is fed them (see :meth:`SessionBackend.apply_feed`).
      learning_rate: the optimizer's learning-rate tensor (fetched with each
        apply), or None where the optimizer exposes none.
    """

    def __init__(self, loss, optimizer, var_list, global_step, *, accumulate: str,
                 average: str, accum_dtype, update_ops=None, increment_global_step=True,
                 session_threads: str = "pool"):
        self.graph, self.loss = loss.graph, loss
        with self.graph.as_default():
            self.global_step = find_global_step(self.graph, global_step)
            self.increment = 1 if increment_global_step else 0
            self.update_ops = select_update_ops(self.graph, loss, update_ops)
            pairs = [(g, v) for g, v in optimizer.compute_gradients(loss, var_list=var_list)
                     if g is not None]
            if not pairs:
                raise HostavgError(
                    "nothing to train: no variable in var_list has a gradient with respect "
                    "to the loss (check var_list, and that the loss depends on trainable "
                    "variables)")
            self.names = [v.op.name for _, v in pairs]
            self.spec = {v.op.name: VariableSpec(
                tuple(v.shape.as_list()), np.dtype(v.dtype.base_dtype.as_numpy_dtype),
                isinstance(g, tf.IndexedSlices)) for g, v in pairs}
            self._grads = [g for g, _ in pairs]
            # Sparse rows leave the session coalesced: sorted, unique, duplicates summed there,
            # by the same ops whatever the micro-batch, so that a gradient depends only on its
            # feed and weights. (NumPy coalesces 512 rows in ~50 us in a loop of its own, but
            # within a step, on rows fresh from the session, whole steps measured alike up to
            # 512 rows, NumPy up to 30% faster at 2k-8k rows, the session up to 34% faster at
            # 32k; the session also fetches only the unique rows.) Squared norms are reduced
            # in the session where the values are fresh in cache and the work is spread over
            # its threads (Eigen's tree reduction: ~1e-7 relative error in float32): the host
            # then makes one pass per micro-batch (the add) instead of two. Half precision is
            # summed in float32; a float32 sum that overflows (entries above ~1e19) is redone
            # on the host in float64 (see compute).
            with tf.name_scope("hostavg_coalesce"):
                fetched = [_coalesced(g) if isinstance(g, tf.IndexedSlices) else g
                           for g in self._grads]
            self._fetches = [loss, self.global_step.read_value()] + _flat(fetched)
            with tf.name_scope("hostavg_norms"):
                self._fetches += [_squared_norm(g.values if isinstance(g, tf.IndexedSlices) else g)
                                  for g in fetched]
            if self.update_ops:
                self._fetches.append(tf.group(*self.update_ops, name="hostavg_update_ops"))
            # What a failed step must restore: every variable the compute call may assign.
            self.assigned = assigned_variables(self.graph, self._fetches)
            self._assigned_values = [v.read_value() for v in self.assigned]
            variables = [v for _, v in pairs]
            step = self.global_step if increment_global_step else None
            # TF1's AdamOptimizer updates every row of its slots and variable on a sparse step
            # too (m = beta1 * m, then a scatter-add of the rows; the same for v; then the whole
            # variable), in about eight passes over the table; its dense kernel does the same
            # arithmetic in one fused pass. The mean's rows (unique: coalesced) are therefore
            # scattered into a dense gradient in the graph, where the table lives, and applied
            # densely: 6.5 instead of 13.9 ms for a 50,000 x 64 table on 2 cores. Any other
            # optimizer gets the rows as they are: its sparse update is its own semantics.
            densify = type(optimizer) is v1.train.AdamOptimizer
            self.train_op = optimizer.apply_gradients(_applied(pairs, densify), global_step=step)
            # The update-to-weight ratios, measured in the apply's own session call by a
            # second apply op of the same optimizer (same slots): the weights are read before
            # it runs (its ops wait for the reads), and the norms of (after - before) and of
            # before are reduced where the values live. Holding the reads makes the optimizer
            # copy what it updates in place (a whole embedding table), so the plain train op
            # above, which reads nothing first, serves the applies that do not measure.
            with tf.name_scope("hostavg_update_ratios"):
                before = [_value_now(v) for v in variables]
            with tf.control_dependencies(before):
                fed = [tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
                       if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in self._grads]
            measured_train_op = optimizer.apply_gradients(_applied(zip(fed, variables), densify),
                                                          global_step=step)
            self._apply_feeds = tuple(
                t for g in self._grads for t in
                ((g.indices, g.values) + ((g.dense_shape,) if g.dense_shape is not None else ())
                 if isinstance(g, tf.IndexedSlices) else (g,)))
            self.apply_inputs = {t.name: t for t in _placeholders_read(self.train_op,
                                                                       self._apply_feeds)}
            self._callables = Callables(session_threads)
            self._feed_forms = {}  # feed key -> (NumPy dtype, shape with None where any)
            with tf.control_dependencies([self.train_op]):
                step_after = self.global_step.read_value()
            with tf.control_dependencies([measured_train_op]):
                measured_step_after = self.global_step.read_value()
                with tf.name_scope("hostavg_update_ratios"):
                    after = [_value_now(v) for v in variables]
                    # One fetched vector: |after - before|^2 per variable, then |before|^2.
                    sums = [_sum_squares(a, b) for a, b in zip(after, before)] + [
                        _sum_squares(b) for b in before]
                    if len({t.dtype for t in sums}) > 1:
                        sums = [tf.cast(t, tf.float64) for t in sums]
                    squares = [tf.stack(sums)]
            self.learning_rate = _learning_rate(optimizer, self.graph)
            # (An identity: a learning-rate placeholder is fed to the apply, and a fed tensor
            # cannot be fetched.)
            lr = [] if self.learning_rate is None else [tf.identity(self.learning_rate)]
            # What an apply fetches: the global step after it and the learning rate, and
            # when measuring, the squared norms of each update and of each weight before it.
            self._apply_fetches = {False: [step_after] + lr,
                                   True: [measured_step_after] + lr + squares}
            self.reducer = _GraphReducer(self.spec, accum_dtype, accumulate, session_threads) \
                if average == "graph" else None

    def compute(self, sess, feed: dict) -> Computed:
        """Runs forward, backward and the UPDATE_OPS once; the gradients come back frozen
        (sparse ones coalesced)."""
        out = self._callables.get(sess, self._fetches, tuple(feed))(*feed.values())
        got = iter(out[2:])
        values = {}
        for name, g in zip(self.names, self._grads):
            if isinstance(g, tf.IndexedSlices):
                values[name] = SparseGradient(freeze(next(got)), freeze(next(got)),
                                              self.spec[name].shape)
            else:
                values[name] = freeze(next(got))
        sq_norms = {name: q if math.isfinite(q) else squared_norm(values[name])
                    for name, q in zip(self.names, map(float, got))}
        return Computed(out[0], values, int(out[1]), sq_norms)

    def conform_feed(self, feed: dict, what: str) -> dict:
        """Each value as an array of its key's dtype, checked against its key's shape, as ``sess.run`` would.

        (The compiled session calls skip that check: an array of the wrong
        shape would broadcast silently.) Stricter than ``sess.run`` where
        NumPy's conversion would change values silently: integers out of the
        placeholder's range, non-integer floats for an integer placeholder,
        None, text or objects for a numeric one, and tensors are refused
        (see :func:`feed_array`).
        """
        out = {}
        for key, value in feed.items():
            form = self._feed_forms.get(key)
            if form is None:
                shape = key.shape
                form = self._feed_forms[key] = (
                    key.dtype.base_dtype.as_numpy_dtype,
                    None if shape.rank is None else tuple(shape.as_list()))
            dtype, shape = form
            array = feed_array(value, dtype, f"{what}: feed {key.name!r}")
            if shape is not None and (array.ndim != len(shape) or any(
                    want is not None and got != want for got, want in zip(array.shape, shape))):
                raise HostavgError(
                    f"{what}: feed {key.name!r} has shape {array.shape}, but it takes shape "
                    f"{tuple(shape)} (None: any length)")
            out[key] = array
        return out

    def snapshot(self, sess) -> list | None:
        """The values of :attr:`assigned` (None when there are none)."""
        if not self.assigned:
            return None
        return self._callables.get(sess, self._assigned_values, ())()

    def restore(self, sess, values) -> None:
        if values is not None:
            load_variables(sess, self.assigned, values)

    def apply(self, sess, values: Mapping, feed: Mapping, measure: bool = True) -> Applied:
        """Feeds ``values`` through the gradient tensors (and ``feed``, name -> value, to
        :attr:`apply_inputs`), runs the train op once.

        Returns the new global step, the learning rate and, with ``measure``,
        the update-to-weight ratios, all from that one session call.
        Measuring keeps each weight's value from before the update alive
        while the optimizer runs (a copy of the weights) and reduces two norms
        per variable: about the cost of the apply itself again.
        """
        args = list(feed.values())
        for name, g in zip(self.names, self._grads):
            value = values[name]
            if isinstance(g, tf.IndexedSlices):
                args += [value.indices, value.values]
                if g.dense_shape is not None:
                    args.append(np.asarray(self.spec[name].shape))
            else:
                args.append(value)
        keys = tuple(self.apply_inputs[name] for name in feed) + self._apply_feeds
        out = self._callables.get(sess, self._apply_fetches[measure], keys)(*args)
        lr = None if self.learning_rate is None else float(out[1])
        ratios = None
        if measure:
            squares, k = out[-1].tolist(), len(self.names)
            ratios = {name: _ratio(u, w) for name, u, w in zip(self.names, squares[:k], squares[k:])}
        return Applied(int(out[0]), ratios, lr)


class SessionBackend:
    """A trainer's :class:`Wiring` bound to one session: the engine's TF1 backend.

    Session errors come out as :class:`HostavgError` saying what to do: an
    uninitialized variable asks for the initializer to be run after the
    Trainer is built; a feed the session refused points at the feed; any other
    failure is reported as the session's, with its first line.
    """

    framework = "tf1"

    def __init__(self, wiring: Wiring, sess):
        graph = getattr(sess, "graph", None)
        if graph is not wiring.graph:
            raise HostavgError(
                f"the session runs another graph than the trainer's (got {sess!r}); "
                f"create it with tf.compat.v1.Session(graph=loss.graph)")
        self.wiring, self.session = wiring, sess
        self.spec = wiring.spec
        self.increment = wiring.increment

    @property
    def target(self):
        return self.session

    def conform(self, feed_dict, what: str) -> dict:
        """``feed_dict`` keyed by tensors, each value checked and converted (:meth:`Wiring.conform_feed`)."""
        return self.wiring.conform_feed(resolve_feed(self.wiring.graph, feed_dict, what), what)

    def prepare(self, feed_dict, size, what: str) -> tuple[dict, int]:
        feed = self.conform(feed_dict, what)
        if size is None:
            # Every value is an array now: one length along axis 0 is the size (feed_size
            # walks any structure, and says what is wrong when the lengths differ).
            lengths = {len(a) for a in feed.values() if a.ndim}
            n = lengths.pop() if len(lengths) == 1 else feed_size(feed, what)
            if n < 1:
                raise HostavgError(f"{what}: a micro-batch must hold at least 1 sample, got {n}")
            return feed, n
        return feed, positive_int(f"{what}: size", size)

    def compute(self, feed: dict) -> Computed:
        with _session_errors("compute"):
            return self.wiring.compute(self.session, feed)

    def apply_feed(self, feeds, what: str) -> dict:
        """The value every feed gives each of the train op's :attr:`~Wiring.apply_inputs`, by name.

        A placeholder with a default may go unfed (by every feed); any other
        must be fed the same value by each.
        """
        out = {}
        whose = "micro-batch" if what == "step" else "feed_dict"
        for name, key in self.wiring.apply_inputs.items():
            given = [f.get(key) for f in feeds]
            if all(v is None for v in given) and key.op.type == "PlaceholderWithDefault":
                continue
            first = given[0]
            for i, value in enumerate(given):
                if value is None:
                    raise HostavgError(
                        f"{what}: the train op reads {name!r}, which {whose} {i} does not feed; "
                        + ("feed it, the same value, to every micro-batch" if what == "step" else
                           "pass it: trainer.apply(sess, grads, feed_dict={placeholder: value})"))
                if value is not first and not (value.shape == first.shape
                                               and np.array_equal(value, first)):
                    raise HostavgError(
                        f"{what}: micro-batches 0 and {i} feed different values to {name!r} "
                        f"({_brief(first)} and {_brief(value)}), which the train op reads; the "
                        f"train op runs once per step, so feed every micro-batch the same value")
            out[name] = first
        return out

    def apply(self, mean, feed, measure: bool = True) -> Applied:
        with _session_errors("apply"):
            return self.wiring.apply(self.session, mean, feed, measure)

    def global_step(self) -> int:
        return int(self.session.run(self.wiring.global_step))

    def evaluate(self, chunks, metrics=None) -> dict:
        """The loss and ``metrics`` (name -> scalar tensor, each a mean over its chunk) over
        ``chunks`` (feed dicts), sample-weighted; runs no gradient and no UPDATE_OPS."""
        fetches = {"loss": self.wiring.loss, **(metrics or {})}
        totals, count = dict.fromkeys(fetches, 0.0), 0
        for chunk in chunks:
            n = feed_size(chunk)
            with _session_errors("evaluate"):
                got = self.session.run(fetches, chunk)
            for name, value in got.items():
                if np.ndim(value) != 0:
                    raise HostavgError(f"evaluate: metric {name!r} has shape {np.shape(value)}, "
                                       f"not a scalar; give the mean over the batch")
                totals[name] += n * float(value)
            count += n
        return {name: total / count for name, total in totals.items()}

    def snapshot(self):
        return self.wiring.snapshot(self.session)

    def restore(self, snapshot) -> None:
        self.wiring.restore(self.session, snapshot)

    def variables(self) -> dict:
        variables = self._globals()
        return dict(zip([v.op.name for v in variables], self.session.run(variables)))

    def assign(self, values) -> None:
        variables = self._globals()
        load_variables(self.session, variables, [values[v.op.name] for v in variables])

    def _globals(self) -> list:
        return self.wiring.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)


class _session_errors:
    """Turns what a session call raises into a HostavgError saying what to do."""

    def __init__(self, call: str):
        self.call = call

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or isinstance(error, HostavgError) or not isinstance(error, Exception):
            return False
        said = f"{type(error).__name__}: {first_line(error)}"
        if isinstance(error, tf.errors.FailedPreconditionError) and "initializ" in str(error):
            raise HostavgError(
                f"a variable is not initialized ({said}); run "
                f"tf.compat.v1.global_variables_initializer() after building the Trainer, "
                f"which creates the optimizer's slots and the global step") from error
        if isinstance(error, (tf.errors.InvalidArgumentError, ValueError, TypeError,
                              OverflowError)):
            raise HostavgError(f"the session refused the {self.call} ({said}); check that "
                               f"micro-batch's feed") from error
        if isinstance(error, (tf.errors.OpError, RuntimeError)):
            raise HostavgError(f"the session failed in {self.call} ({said})") from error
        return False


def first_line(error) -> str:
    """The line of a TensorFlow error message that says what went wrong."""
    for line in str(getattr(error, "message", error)).splitlines():
        line = line.strip()
        if line and not line.startswith(("Graph execution error", "Detected at node", "File ",
                                         "Node: ")):
            return line
    return str(error)


class GraphAverage(HostAverage):
    """average="graph": the mean computed by the trainer's small averaging graph, in the step's session."""

    def __init__(self, wiring: Wiring):
        self._reducer = wiring.reducer

    def reducer(self, backend: SessionBackend, total: float):
        return self._reducer.bind(backend.session)


class Callables:
    """Compiled session calls, made once per (session, fetches, feed keys) and reused.

    ``sess.run`` spends about 0.4 ms per call in Python, parsing fetches and
    the feed dict, which is half a step of a small model (and public
    ``make_callable`` falls back to ``run`` whenever there are feeds). A
    callable made from ``CallableOptions`` skips that. Sessions are held
    weakly, so a dropped session takes its callables with it.

    ``threads`` (one of :data:`SESSION_THREADS`): "pool" hands each call's ops to
    the session's inter-op thread pool, as ``sess.run`` does; "caller" runs them
    in the calling thread (``RunOptions.inter_op_thread_pool = -1``), except in
    calls that reach one of :data:`BLOCKING_OPS`.
    """

    def __init__(self, threads: str = "pool"):
        self._by_session = weakref.WeakKeyDictionary()
        self.threads = threads

    def get(self, sess, fetches: list, feed_keys: tuple):
        """The callable for ``fetches`` (a flat list of tensors and operations) fed ``feed_keys``.

        It takes the feed values in that order and returns the tensors' values
        in order; operations are run, not returned.
        """
        made = self._by_session.setdefault(sess, {})
        key = (id(fetches), feed_keys)
        if key not in made:
            made[key] = _compile(sess, fetches, feed_keys, self.threads)
        return made[key]


def _compile(sess, fetches, feed_keys, threads: str):
    tensors = [f for f in fetches if isinstance(f, tf.Tensor)]
    targets = [f for f in fetches if isinstance(f, tf.Operation)]
    if not hasattr(sess, "_make_callable_from_options"):
        # A session wrapper (such as a MonitoredSession) without compiled calls: plain run.
        def run_plain(*values):
            return sess.run(tensors + targets, dict(zip(feed_keys, values)))[:len(tensors)]
        return run_plain
    dtypes = [k.dtype.base_dtype.as_numpy_dtype for k in feed_keys]
    opts = config_pb2.CallableOptions()
    opts.feed.extend(k.name for k in feed_keys)
    opts.fetch.extend(t.name for t in tensors)
    opts.target.extend(op.name for op in targets)
    if threads == "caller" and not _reaches(fetches, feed_keys, BLOCKING_OPS):
        opts.run_options.inter_op_thread_pool = -1
    run = sess._make_callable_from_options(opts)  # pylint: disable=protected-access

    def call(*values):
        return run(*[np.asarray(v, d) for v, d in zip(values, dtypes)])
    return call


def resolve_feed(graph, feed_dict: Mapping, what: str) -> dict:
    """The feed with every key a tensor of ``graph`` (names such as ``"x:0"`` are looked up)."""
    if not isinstance(feed_dict, Mapping):
        raise HostavgError(f"{what}: a feed must be a dict {{placeholder: array}}, "
                           f"got {type(feed_dict).__name__}")
    out = {}
    for key, value in feed_dict.items():
        if isinstance(key, str):
            try:
                key = graph.as_graph_element(key)
            except (KeyError, ValueError, TypeError) as e:
                raise HostavgError(
                    f"{what}: feed key {key!r} names nothing in the trainer's graph ({e})") from None
            if isinstance(key, tf.Operation):  # "x" names the op; its one output is "x:0"
                if len(key.outputs) != 1:
                    raise HostavgError(
                        f"{what}: feed key {key.name!r} names an op with {len(key.outputs)} "
                        f"outputs; name the tensor, such as {key.name + ':0'!r}")
                key = key.outputs[0]
        if getattr(key, "graph", None) is not graph:
            raise HostavgError(
                f"{what}: feed key {getattr(key, 'name', key)!r} is not in the trainer's graph; "
                f"feed the placeholders of the graph the loss was built in")
        out[key] = value
    return out


def _value_now(variable):
    """The variable's value as a tensor that later assignments leave alone.

    A resource variable's read keeps its value (an assignment while the read
    is held copies first); a reference variable's would alias the buffer
    that the optimizer updates in place, so it is snapshotted.
    """
    if variable.dtype._is_ref_dtype:  # pylint: disable=protected-access
        return tf.raw_ops.Snapshot(input=variable)
    return variable.read_value()


def _sum_squares(x, minus=None):
    """sum((x - minus)^2), or sum(x^2), in the variable's dtype (float32 for narrower floats)."""
    if x.dtype.base_dtype not in (tf.float32, tf.float64):
        x = tf.cast(x, tf.float32)
        minus = None if minus is None else tf.cast(minus, tf.float32)
    return tf.reduce_sum(tf.square(x) if minus is None else tf.math.squared_difference(x, minus))


def _ratio(update_sq: float, weight_sq: float) -> float:
    """|update| / |weights| from their squares: 0 where nothing moved, inf where weights of 0 did."""
    if update_sq == 0:
        return 0.0
    return math.sqrt(update_sq / weight_sq) if weight_sq > 0 else math.inf


def _learning_rate(optimizer, graph):
    """The tensor of the learning rate the optimizer's apply uses, where it exposes one (TF1 optimizers do)."""
    for attr in ("_learning_rate_tensor", "_lr_t"):
        t = getattr(optimizer, attr, None)
        if isinstance(t, tf.Tensor) and t.graph is graph and t.shape.rank == 0 \
                and t.dtype.base_dtype.is_floating:
            return t
    return None


def feed_array(value, dtype, what: str) -> np.ndarray:
    """``value`` as an array of ``dtype``, refused (HostavgError starting with ``what``) where that would change it.

    Numbers convert within their kind and to wider kinds (bool and integers
    to float, float64 to float32); integers must fit an integer dtype, and
    floats given for one must be whole numbers. None, text, objects and
    tensors are refused for a numeric dtype.
    """
    if isinstance(value, np.ndarray) and value.dtype == dtype:
        return value
    if isinstance(value, (tf.Tensor, tf.Variable, tf.Operation)):
        raise HostavgError(f"{what} is the graph element {value.name!r}; feed values, such as "
                           f"NumPy arrays, not tensors: compute it with sess.run first")
    want = np.dtype(dtype)
    try:
        array = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise HostavgError(f"{what} cannot be made an array ({e})") from None
    if want.kind not in "biufc" or array.dtype == want:
        return array.astype(want, copy=False)
    if array.dtype.kind not in "biuf" or (want.kind == "b" and array.dtype.kind == "f"):
        raise HostavgError(f"{what} holds {_brief(array)} of dtype {array.dtype}, but the "
                           f"placeholder takes {want.name}")
    if want.kind in "iu" and array.size:
        whole = np.isfinite(array) & (array == np.round(array)) if array.dtype.kind == "f" else True
        if not np.all(whole):
            raise HostavgError(f"{what} holds values that are not integers (such as "
                               f"{array[~whole].flat[0].item()!r}) for a {want.name} placeholder; feed "
                               f"integers")
        info = np.iinfo(want)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise HostavgError(f"{what} holds values outside {want.name}'s range [{info.min}, "
                               f"{info.max}] (min {low}, max {high})")
    return array.astype(want)


def _brief(value: np.ndarray) -> str:
    return repr(value.item()) if value.size == 1 else f"an array of shape {value.shape}"


def _squared_norm(g):
    """The sum of squares of ``g``'s entries, in float32 at least."""
    if g.dtype.size < 4:
        g = tf.cast(g, tf.float32)
    return tf.reduce_sum(tf.square(g))


def _placeholders_read(op, fed=(), with_default: bool = True) -> list:
    """The placeholders that running ``op`` reads when ``fed`` (tensors) are fed, by name.

    ``with_default``: count placeholders with a default too (read, though
    they need no feed).
    """
    kinds = ("Placeholder", "PlaceholderWithDefault") if with_default else ("Placeholder",)
    found = [o for o in _ops_run([op], fed) if o.type in kinds]
    return [op.outputs[0] for op in sorted(found, key=lambda o: o.name)]


def _reaches(fetches, fed, types: frozenset) -> bool:
    """Whether running ``fetches`` (tensors and operations) with ``fed`` fed runs an op of ``types``."""
    ops = [f.op if isinstance(f, tf.Tensor) else f for f in fetches]
    return any(op.type in types for op in _ops_run(ops, fed))


def _ops_run(ops, fed=()):
    """Every op that running ``ops`` runs when ``fed`` (tensors) are fed: a walk back through
    inputs and control inputs, stopping at fed tensors."""
    fed, seen, todo = set(fed), set(), list(ops)
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        yield op
        todo.extend(t.op for t in op.inputs if t not in fed)
        todo.extend(op.control_inputs)


def _applied(pairs, densify: bool) -> list:
    """(gradient, variable) pairs to apply, sparse gradients made dense if ``densify``
    (a segment sum scatters the rows, adding any that repeat) where the variable's rows
    are counted."""
    with tf.name_scope("hostavg_densify"):
        return [(tf.math.unsorted_segment_sum(g.values, g.indices, v.shape[0])
                 if densify and isinstance(g, tf.IndexedSlices) and v.shape[0] is not None
                 else g, v) for g, v in pairs]


def _flat(grads) -> list:
    """The tensors of ``grads`` in order: each dense gradient, and a sparse one's indices and values."""
    return [t for g in grads
            for t in ((g.indices, g.values) if isinstance(g, tf.IndexedSlices) else (g,))]


def _coalesced(g: tf.IndexedSlices) -> tf.IndexedSlices:
    """``g`` with sorted unique indices, the rows of each index summed."""
    unique, segments = tf.unique(g.indices)
    summed = tf.math.unsorted_segment_sum(g.values, segments, tf.size(unique))
    order = tf.argsort(unique)
    return tf.IndexedSlices(tf.gather(summed, order), tf.gather(unique, order), g.dense_shape)


def find_global_step(graph, global_step):
    """The trainer's global step: ``global_step`` if given, else the graph's own, else a new one.

    The graph's own is the variable in the GLOBAL_STEP collection, or else a
    global variable named ``global_step`` (as TF1 programs make it:
    ``tf.Variable(0, name="global_step", trainable=False)``), ref or resource,
    of any integer dtype.
    """
    if global_step is None:
        found = graph.get_collection(v1.GraphKeys.GLOBAL_STEP) or [
            v for v in graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
            if v.op.name == "global_step"]
        if not found:
            return v1.train.get_or_create_global_step(graph)
        global_step, what = found[0], "the graph's global step"
    else:
        what = "global_step"
    dtype = getattr(global_step, "dtype", None)
    if not isinstance(global_step, tf.Variable) or getattr(global_step, "graph", None) is not graph \
            or not dtype.base_dtype.is_integer or global_step.shape.rank != 0:
        raise HostavgError(
            f"{what} must be a scalar integer variable of the loss's graph, got "
            f"{getattr(global_step, 'name', global_step)!r} "
            f"({'dtype ' + dtype.base_dtype.name + ', shape ' + str(global_step.shape) if dtype is not None else type(global_step).__name__}); "
            f"pass global_step= a variable such as tf.Variable(0, name='global_step', trainable=False)")
    return global_step


def select_update_ops(graph, loss, update_ops) -> list:
    """The ops each micro-batch runs beside forward and backward.

    None: the UPDATE_OPS whose inputs the loss's own feeds can supply (an op
    that needs a placeholder the loss does not, such as the other network's
    batch norm in a GAN, is left out); a list: exactly those ops (or tensors);
    ``[]``: none.
    """
    if update_ops is not None:
        ops = [u.op if isinstance(u, (tf.Tensor, tf.Variable)) else u for u in update_ops]
        stray = [getattr(u, "name", u) for u in ops
                 if not isinstance(u, tf.Operation) or u.graph is not graph]
        if stray:
            raise HostavgError(f"update_ops must be ops or tensors of the loss's graph, got "
                               f"{stray[:3]}")
        return ops
    needed = set(_placeholders_read(loss.op, with_default=False))
    return [u for u in graph.get_collection(v1.GraphKeys.UPDATE_OPS)
            if set(_placeholders_read(u if isinstance(u, tf.Operation) else u.op,
                                      with_default=False)) <= needed]


#: Ops that take a variable (its resource handle) only to read it.
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
                      "VarIsInitializedOp", "IsVariableInitialized"})


def assigned_variables(graph, fetches) -> list:
    """The global variables that running ``fetches`` may assign, in collection order.

    Walks back from the fetches through inputs and control inputs; a variable
    counts when an op reached takes it by reference (``Assign``, ``AssignAdd``,
    scatters) or by resource handle for anything but a read. A variable that
    is only read (a frozen backbone, the weights) is not among them, so a
    step's rollback snapshot does not grow with it.
    """
    by_op = {v.op: v for v in graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)}
    found, seen = set(), set()
    todo = [f.op if isinstance(f, tf.Tensor) else f for f in fetches]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        for tensor, kind in zip(op.inputs, op._input_types):  # pylint: disable=protected-access
            source = tensor.op
            if source in by_op and (kind._is_ref_dtype or (kind == tf.resource  # pylint: disable=protected-access
                                                           and op.type not in READ_OPS)):
                found.add(source)
            todo.append(source)
        todo.extend(op.control_inputs)
    return [v for op, v in by_op.items() if op in found]


def load_variables(sess, variables, values) -> None:
    """Sets ``variables`` to ``values`` exactly, in one session run, adding no op to the graph.

    Runs each variable's initializer with its initial-value input fed, so it
    works on a finalized graph too.
    """
    if variables:
        sess.run([v.initializer for v in variables],
                 {v.initializer.inputs[1]: value for v, value in zip(variables, values)})


class _GraphReducer:
    """average="graph": the mean of a :class:`Reduction`, computed by a small graph in the session.

    "sum" mode feeds each variable's running sum and scales it by
    ``scale / total`` in the graph; "stack" mode feeds the stacked micro-batch gradients
    (k, *shape) and their weights and reduces over axis 0 in the graph; sparse
    rows are summed by ``unsorted_segment_sum``. The host only stacks, numbers
    the unique rows, feeds and fetches.
    """

    def __init__(self, spec, accum_dtype, accumulate, threads: str):
        self._dense_inputs, self._row_inputs, self._outputs = {}, {}, {}
        with tf.name_scope("hostavg_average"):
            self._total = v1.placeholder(tf.float64, (), name="total")
            self._weights = v1.placeholder(tf.float64, (None,), name="weights")
            self._factor = v1.placeholder(tf.float64, (), name="scale_over_total")
            for name, s in spec.items():
                dtype = tf.as_dtype(accum_dtype or s.dtype)
                total = tf.cast(self._total, dtype)
                if s.sparse:
                    ph = (v1.placeholder(tf.int64, (None,)), v1.placeholder(tf.int64, ()),
                          v1.placeholder(dtype, (None,) + s.shape[1:]),
                          v1.placeholder(dtype, (None,)))
                    segments, num_rows, values, row_weights = ph
                    weighted = values * tf.reshape(row_weights, [-1] + [1] * (len(s.shape) - 1))
                    self._outputs[name] = tf.math.unsorted_segment_sum(
                        weighted, segments, num_rows) / total
                    self._row_inputs[name] = ph
                elif accumulate == "sum":
                    summed = self._dense_inputs[name] = v1.placeholder(dtype, s.shape)
                    self._outputs[name] = summed * tf.cast(self._factor, dtype)
                else:
                    stack = self._dense_inputs[name] = v1.placeholder(dtype, (None,) + s.shape)
                    self._outputs[name] = tf.tensordot(
                        tf.cast(self._weights, dtype), stack, 1) / total
        self._fetches = list(self._outputs.values())
        self._callables = Callables(threads)

    def bind(self, sess):
        """A reducer (Reduction -> name -> mean) that runs in ``sess``."""
        def reduce(r: Reduction) -> dict:
            feed = {self._total: r.total, self._weights: r.weights,
                    self._factor: r.scale / r.total}
            for name, s in r.sums.items():
                feed[self._dense_inputs[name]] = s
            for name, gs in r.stacks.items():
                feed[self._dense_inputs[name]] = np.stack(gs)
            uniques = {}
            for name, (indices, values, row_weights) in r.rows.items():
                uniques[name], segments = np.unique(indices, return_inverse=True)
                feed.update(zip(self._row_inputs[name],
                                (segments, len(uniques[name]), values, row_weights)))
            out = dict(zip(self._outputs,
                           self._callables.get(sess, self._fetches, tuple(feed))(*feed.values())))
            return {name: (uniques[name], value) if name in uniques else value
                    for name, value in out.items()}
        return reduce
