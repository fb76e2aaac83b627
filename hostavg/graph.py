"""The TensorFlow wiring, all of it: gradient tensors, the apply op, feeds, the averaging graph.

Everything here is built once, when a :class:`~hostavg.Trainer` is made, in the
loss's graph, with no device pinned: TensorFlow places every op where it
normally would (a GPU when there is one) and only gradient values cross to the
host. Nothing here does host arithmetic; that lives in the NumPy layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from hostavg.accumulator import Reduction
from hostavg.errors import HostavgError
from hostavg.gradients import SparseGradient, VariableSpec

v1 = tf.compat.v1

__all__ = ["Wiring", "load_variables", "resolve_feed"]


class Wiring:
    """The ops of one trainer.

    Attributes:
      graph: the loss's graph.
      names: the trained variables' names (``var.op.name``), in order.
      spec: name -> :class:`VariableSpec`.
      global_step: the global step variable.
    """

    def __init__(self, loss, optimizer, var_list, global_step, *, accumulate: str,
                 average: str, accum_dtype):
        self.graph = loss.graph
        with self.graph.as_default():
            self.global_step = global_step if global_step is not None \
                else v1.train.get_or_create_global_step(self.graph)
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
            self._fetches = [loss, self.global_step.read_value()] + [
                t for g in self._grads
                for t in ((g.indices, g.values) if isinstance(g, tf.IndexedSlices) else (g,))]
            # Squared norms of the gradients (sparse rows coalesced), reduced in the session
            # where the values are fresh in cache and the work is spread over its threads
            # (Eigen's tree reduction: ~1e-7 relative error in float32): the host then makes
            # one pass per micro-batch (the add) instead of two.
            with tf.name_scope("hostavg_norms"):
                self._fetches += [tf.reduce_sum(tf.square(_coalesced_values(g)
                                                          if isinstance(g, tf.IndexedSlices) else g))
                                  for g in self._grads]
            updates = self.graph.get_collection(v1.GraphKeys.UPDATE_OPS)
            if updates:
                self._fetches.append(tf.group(*updates, name="hostavg_update_ops"))
            self.train_op = optimizer.apply_gradients(pairs, global_step=self.global_step)
            self._apply_feeds = tuple(
                t for g in self._grads for t in
                ((g.indices, g.values) + ((g.dense_shape,) if g.dense_shape is not None else ())
                 if isinstance(g, tf.IndexedSlices) else (g,)))
            self._callables = Callables()
            with tf.control_dependencies([self.train_op]):
                self._step_after = [self.global_step.read_value()]
            self.state = _State(self.graph, optimizer, self.global_step) if updates else None
            self.reducer = _GraphReducer(self.spec, accum_dtype, accumulate) \
                if average == "graph" else None

    def compute(self, sess, feed: dict):
        """Runs forward, backward and the UPDATE_OPS once.

        Returns:
          (loss, name -> value, global step, name -> squared norm of each gradient).
        """
        out = self._callables.get(sess, self._fetches, tuple(feed))(*feed.values())
        got = iter(out[2:])
        values = {}
        for name, g in zip(self.names, self._grads):
            if isinstance(g, tf.IndexedSlices):
                values[name] = SparseGradient(next(got), next(got), self.spec[name].shape)
            else:
                values[name] = next(got)
        norms = dict(zip(self.names, map(float, got)))
        for value in values.values():
            _read_only(*((value.indices, value.values) if isinstance(value, SparseGradient)
                         else (value,)))
        return out[0], values, int(out[1]), norms

    def apply(self, sess, values: Mapping) -> int:
        """Feeds ``values`` through the gradient tensors, runs the train op once; returns the new global step."""
        args = []
        for name, g in zip(self.names, self._grads):
            value = values[name]
            if isinstance(g, tf.IndexedSlices):
                args += [value.indices, value.values]
                if g.dense_shape is not None:
                    args.append(np.asarray(self.spec[name].shape))
            else:
                args.append(value)
        return int(self._callables.get(sess, self._step_after, self._apply_feeds)(*args)[0])


class Callables:
    """Compiled session calls, made once per (session, fetches, feed keys) and reused.

    ``sess.run`` spends about 0.4 ms per call in Python, parsing fetches and
    the feed dict, which is half a step of a small model (and public
    ``make_callable`` falls back to ``run`` whenever there are feeds). A
    callable made from ``CallableOptions`` skips that. Sessions are held
    weakly, so a dropped session takes its callables with it.
    """

    def __init__(self):
        self._by_session = weakref.WeakKeyDictionary()

    def get(self, sess, fetches: list, feed_keys: tuple):
        """The callable for ``fetches`` (a flat list of tensors and operations) fed ``feed_keys``.

        It takes the feed values in that order and returns the tensors' values
        in order; operations are run, not returned.
        """
        made = self._by_session.setdefault(sess, {})
        key = (id(fetches), feed_keys)
        if key not in made:
            made[key] = _compile(sess, fetches, feed_keys)
        return made[key]


def _compile(sess, fetches, feed_keys):
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
        if getattr(key, "graph", None) is not graph:
            raise HostavgError(
                f"{what}: feed key {getattr(key, 'name', key)!r} is not in the trainer's graph; "
                f"feed the placeholders of the graph the loss was built in")
        out[key] = value
    return out


def _coalesced_values(g: tf.IndexedSlices):
    """The rows of ``g`` with duplicate indices summed (what its norm is of)."""
    unique, segments = tf.unique(g.indices)
    return tf.math.unsorted_segment_sum(g.values, segments, tf.size(unique))


def _read_only(*arrays) -> None:
    for a in arrays:
        a.flags.writeable = False


class _State:
    """Saves and restores what UPDATE_OPS may change, so that a failed step leaves no trace.

    Those are the graph's non-trainable global variables other than the
    optimizer's slots and the global step: batch-norm moving statistics and
    the like. Reading them costs one small session run per step, and only
    when the graph has UPDATE_OPS.
    """

    def __init__(self, graph, optimizer, global_step):
        skip = {id(v) for v in optimizer.variables()} | {id(global_step)}
        skip |= {id(v) for v in graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)}
        self.variables = [v for v in graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
                          if id(v) not in skip]

    def save(self, sess):
        return sess.run(self.variables)

    def restore(self, sess, values) -> None:
        load_variables(sess, self.variables, values)


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

    def __init__(self, spec, accum_dtype, accumulate):
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
        self._callables = Callables()

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
