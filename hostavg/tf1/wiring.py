"""The TensorFlow ops of one TF1 trainer: gradient tensors, norms, the apply ops.

Everything here is built once, when a :class:`~hostavg.Trainer` is made, in the
loss's graph, with no device pinned: TensorFlow places every op where it
normally would (a GPU when there is one) and only gradient values cross to the
host. Nothing here does host arithmetic; that lives in the NumPy layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from hostavg.compat.tensorflow import (first_line, graph_cond, is_ref_dtype, largest_magnitudes,
                                       learning_rate, magnitude_ends)
from hostavg.tf1.bounds import update_bound
from hostavg.core.errors import ArgumentError
from hostavg.core.gradients import SparseGradient, VariableSpec, freeze, squared_norm
from hostavg.engine.protocols import Applied, ApplyRequest, Computed
from hostavg.tf1.advice import advice_for
from hostavg.tf1.average import GraphReducer
from hostavg.tf1.checked import checked_train_op, rows_written
from hostavg.tf1.feeds import FeedConformer
from hostavg.tf1 import samples
from hostavg.tf1.session import Callables
from hostavg.tf1.variables import (assigned_variables, find_global_step, load_variables,
                                   select_update_ops, state_changes, value_now)
from hostavg.tf1.walk import ops_run, placeholders_read, random_ops, switches

__all__ = ["Wiring"]

v1 = tf.compat.v1


class Wiring:
    """The ops of one trainer.

    Attributes:
      graph: the loss's graph.
      trained: the trained variables, in order.
      names: their names (``var.op.name``).
      spec: name -> :class:`VariableSpec`.
      global_step: the global step variable.
      slots: name -> the optimizer's slots of each trained variable (``get_slot``), in the
        order of its ``get_slot_names()``.
      apply_inputs: name -> placeholder, each placeholder the train op reads
        (not through the fed gradients): a learning rate, a schedule's input.
        The apply is fed them (see :meth:`~hostavg.tf1.session.SessionBackend.apply_feed`).
      learning_rate: the optimizer's learning-rate tensor (fetched with each
        apply), or None where none is found
        (:func:`hostavg.compat.tensorflow.learning_rate`).
      conform_feed: ``conform_feed(feed, what)``: a feed keyed by tensors,
        each value an array of its key's dtype, checked against its key's
        shape (:meth:`~hostavg.tf1.feeds.FeedConformer.conform`).
    """

    def __init__(self, loss, optimizer, var_list, global_step, *, accumulate: str,
                 average: str, accum_dtype, update_ops=None, increment_global_step=True,
                 session_threads: str = "auto", check_applied: bool = True):
        self.graph, self.loss, self.checks = loss.graph, loss, check_applied
        with self.graph.as_default():
            self.global_step = find_global_step(self.graph, global_step)
            self.increment = 1 if increment_global_step else 0
            self.update_ops = select_update_ops(self.graph, loss, update_ops)
            pairs = _gradient_pairs(optimizer, loss, var_list)
            self.trained, self._grads = [v for _, v in pairs], [g for g, _ in pairs]
            self.names = [v.op.name for v in self.trained]
            self.spec = _variable_specs(pairs)
            self._vectorized = samples.Vectorized(loss, self.trained, optimizer, pairs)
            self._fetches, fetched, sq = _compute_fetches(loss, self.global_step, self._grads,
                                                          self.update_ops)
            # What a failed step must restore: every variable the compute call may assign, read
            # into values of their own (a reference variable's read_value() is its buffer,
            # which the next compute's UPDATE_OPS assign in place).
            self.assigned = assigned_variables(self.graph, self._fetches)
            self._assigned_values = [value_now(v) for v in self.assigned]
            self._apply_feeds = _apply_feeds(self._grads)
            step = self.global_step if increment_global_step else None
            self.train_op, measured_train_op, before = _train_ops(
                optimizer, pairs, step, measured=not check_applied)
            self.apply_inputs = {t.name: t for t in placeholders_read(self.train_op,
                                                                      self._apply_feeds)}
            named_slots = {name: {slot: s for slot in optimizer.get_slot_names()
                                  if (s := optimizer.get_slot(v, slot)) is not None}
                           for name, v in zip(self.names, self.trained)}
            self.slots = {name: tuple(held.values()) for name, held in named_slots.items()}
            self.learning_rate = learning_rate(optimizer, self.graph,
                                               ops_run([self.train_op], self._apply_feeds))
            self.update_bound = None  # what the host-side proof of an apply reads
            if check_applied:
                self.update_bound = update_bound(
                    optimizer, self.learning_rate, self.apply_inputs, self.spec,
                    {name: {slot: s.op.name for slot, s in held.items()}
                     for name, held in named_slots.items()}, self.trained)
            self._checked = []  # the variables an apply checks finite (check_applied), in order
            checked_op = None
            if check_applied:
                measured, checked_op = _checked_train_ops(
                    optimizer, pairs, step, self.train_op, self._apply_feeds)
                self._checked, measured_train_op, before = measured
            self._apply_fetches = _apply_fetches(self.global_step, self.train_op,
                                                 measured_train_op, pairs, before,
                                                 self.learning_rate, checked_op)
            if self.update_bound is not None:  # the proven applies run the train ops unchecked
                unchecked, unchecked_before = _measured_op(optimizer, pairs, step)
                self._apply_fetches = self._apply_fetches._replace(
                    proven=_apply_fetches(self.global_step, self.train_op, unchecked, pairs,
                                          unchecked_before, self.learning_rate, None),
                    measuring=self._apply_fetches.measuring_too(
                        checked_op, measured_train_op, self._measured_variables()))
            self._fused = self._fuse(optimizer, step, fetched, sq) if average == "host" else None
            self._callables = Callables(session_threads)
            self._unfed = {}  # (fetches' id, feed keys) -> placeholders read and not fed
            self._extended = {}  # more fetches -> the compute's fetches and them
            self._runs, self._changes = None, {}  # the ops compute runs; fetch -> its change
            self._tensors = sum(isinstance(f, tf.Tensor) for f in self._fetches)
            self.conform_feed = FeedConformer().conform
            self.reducer = GraphReducer(self.spec, accum_dtype, accumulate, session_threads) \
                if average == "graph" else None

    def compute(self, sess, feed: dict, fetches: tuple = ()) -> Computed:
        """Runs forward, backward and the UPDATE_OPS once; the gradients come back frozen
        (sparse ones coalesced).

        ``fetches``: more tensors and operations of the graph to run in the same
        session call; their values come back as ``Computed.fetched``, copied (a
        reference variable's read is its buffer, which the apply updates in
        place) and read-only, None for an operation.
        """
        out = self._callables.get(sess, self._with(fetches), tuple(feed))(*feed.values())
        return self._computed(out, fetches)

    def compute_apply(self, sess, feed: dict, allowance: float) -> tuple | None:
        """:meth:`compute` of ``feed`` and, in the same session call, the train op run unchecked
        on its gradients (sparse rows coalesced, as an apply of them is fed), where the gate
        of :meth:`_fuse` lets it: ``(Computed, Applied)``, the Applied None where the gate
        refused (nothing applied); None where the call failed (the compute's own error, or a
        gate built as an assertion refusing)."""
        fetches, placeholder = self._fused
        try:
            out = self._callables.get(sess, fetches, (*feed, placeholder))(*feed.values(),
                                                                            allowance)
        except (tf.errors.OpError, ValueError, TypeError):  # the compute's own, or the assertion's
            return None  # (the apply waits for the gate, which waits for every compute fetch)
        k = self._tensors
        computed = self._computed(out[:k], ())
        if not out[k + 2]:  # (an assertion's gate that lets the call end let the apply run)
            return computed, None
        rate = None if self.learning_rate is None else float(out[k + 1])
        return computed, Applied(int(out[k]), learning_rate=rate)

    @property
    def fuses(self) -> bool:
        """Whether :meth:`compute_apply` serves: not where the mean is averaged in the graph."""
        return self._fused is not None

    def _fuse(self, optimizer, step, coalesced: list, squares: list) -> tuple:
        """What :meth:`compute_apply` runs: (the compute's fetches, then the global step after
        another apply op of ``optimizer`` (its slots) run on their gradients ``coalesced``,
        the learning rate and whether the gate let it run; the placeholder of the allowance),
        ``squares`` the compute's squared norms of them.
        The gate, after every compute fetch and the UPDATE_OPS: the loss is a finite scalar
        and the L2 norm of all the gradients (squares reduced in float64), times sqrt(rows)
        of the sparse one with the most, is at most the allowance (:meth:`Proof.allowance
        <hostavg.engine.proof.Proof.allowance>`). A cond runs the apply where it holds
        (:func:`~hostavg.compat.tensorflow.graph_cond`); where the optimizer's apply cannot
        be built in a branch (a reference variable under TensorFlow 2's control flow), an
        assertion that fails the call does (TensorFlow may log each refusal). Built with the
        trainer: an op made a control input once a session ran it is changed after its run."""
        with tf.name_scope("hostavg_fused"):
            allowance = v1.placeholder(tf.float64, (), name="allowance")
            total = tf.add_n([tf.cast(q, tf.float64) for q in squares])
            rows = [tf.size(g.indices) for g in coalesced if isinstance(g, tf.IndexedSlices)]
            factor = tf.sqrt(tf.cast(tf.maximum(tf.reduce_max(tf.stack(rows)), 1), tf.float64)) \
                if rows else tf.constant(1.0, tf.float64)
            loss = self._fetches[0]
            ok = tf.logical_and(tf.equal(tf.rank(loss), 0),
                                tf.reduce_all(tf.math.is_finite(tf.cast(loss, tf.float32))))
            ok = tf.logical_and(ok, tf.logical_and(tf.math.is_finite(total),
                                                   tf.sqrt(total) * factor <= allowance))
            ops = [f for f in self._fetches if isinstance(f, tf.Operation)]
            with tf.control_dependencies(ops + [self._fetches[1]]):
                ok = tf.identity(ok, name="allowed")

            def apply():
                with tf.control_dependencies([optimizer.apply_gradients(
                        _applied(zip(coalesced, self.trained), _densifies_sparse(optimizer)),
                        global_step=step)]):
                    return tf.constant(True)
            try:
                with tf.name_scope("gate"):
                    applied = graph_cond(ok, apply, lambda: tf.constant(False))
            except (ValueError, TypeError, NotImplementedError):
                applied = self._asserted(ok, apply)
            with tf.control_dependencies([applied]):
                after = [self.global_step.read_value()]
            after.append(tf.identity(self.learning_rate) if self.learning_rate is not None
                         else tf.constant(0.0))
            after.append(applied)
        tensors = [f for f in self._fetches if isinstance(f, tf.Tensor)]
        return tensors + after + ops, allowance

    @staticmethod
    def _asserted(ok, apply):
        """The apply behind an assertion of ``ok``, which fails the call where it does not hold."""
        with tf.control_dependencies([tf.debugging.Assert(
                ok, ["hostavg: the fused apply is not allowed"], name="gate")]):
            return apply()

    def _computed(self, out: list, fetches: tuple) -> Computed:
        """The :class:`Computed` of a compute call's outputs ``out`` (``fetches``: the more
        tensors it ran)."""
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
        return Computed(out[0], values, int(out[1]), sq_norms,
                        _fetched(fetches, out[self._tensors:]) if fetches else ())

    def samples(self, sess, feed: dict, kind: str, means: tuple = ()) -> list:
        """The vectorized samples of ``feed`` (:mod:`hostavg.tf1.samples`), ``kind`` "sums",
        "own" or "dots" (fed ``means``, in :attr:`names`' order), in one session call. Raises
        NotVectorized."""
        fetches, placeholders = self._vectorized.fetches(feed, kind)
        return self._callables.get(sess, fetches, tuple(feed) + placeholders)(*feed.values(),
                                                                              *means)

    def hvp(self, sess, feed: dict, vector: Mapping) -> tuple:
        """(the loss, name -> H v as a dense array) by double backprop: the gradient of
        ``sum(g * v)`` fed ``vector`` (:meth:`_products`); runs no UPDATE_OPS."""
        placeholders, fetches = self._products
        keys = tuple(feed) + placeholders
        out = self._callables.get(sess, fetches, keys)(*feed.values(),
                                                       *(vector[n] for n in self.names))
        return out[0], dict(zip(self.names, out[1:]))

    @functools.cached_property
    def _products(self) -> tuple:
        """(a placeholder per trained variable for v, [loss, H v of each]), built in the graph
        on the first product: ``d/dw sum_j <g_j(w), v_j>``, a sparse gradient's rows dotted
        with the rows of v they index; a product with no path to a variable is 0."""
        with self.graph.as_default(), tf.name_scope("hostavg_hvp"):
            vs = tuple(v1.placeholder(s.dtype, s.shape, name="v") for s in self.spec.values())
            dot = tf.add_n([tf.reduce_sum(g.values * tf.gather(v, g.indices))
                            if isinstance(g, tf.IndexedSlices) else tf.reduce_sum(g * v)
                            for g, v in zip(self._grads, vs)])
            try:
                products = tf.gradients(dot, self.trained)
            except LookupError as e:  # an op of the backward pass has no gradient of its own
                raise ArgumentError(f"hvp: the loss's gradient cannot be differentiated again "
                                    f"({first_line(e)}); build the loss of ops with second "
                                    f"derivatives") from e
            dense = [tf.zeros_like(v) if p is None else tf.convert_to_tensor(p)
                     for p, v in zip(products, vs)]
        return vs, [self.loss, *dense]

    def _with(self, fetches: tuple) -> list:
        """The compute's fetches followed by ``fetches``: one list per tuple of them, kept,
        since compiled calls and :meth:`unfed` are found by the list."""
        if not fetches:
            return self._fetches
        found = self._extended.get(fetches)
        if found is None:
            found = self._extended[fetches] = self._fetches + list(fetches)
        return found

    @functools.cached_property
    def random_ops(self) -> tuple:
        """The random ops :meth:`compute` runs (:func:`~hostavg.tf1.walk.random_ops`), found once."""
        return tuple(random_ops(self._fetches))

    @functools.cached_property
    def advice(self) -> dict:
        """The check's advice, naming the training-mode switches :meth:`compute` reads
        (:func:`~hostavg.tf1.advice.advice_for`); found once."""
        dropout = [self.graph.get_tensor_by_name(r.tensor).op for r in self.random_ops
                   if r.kind == "random"]
        return advice_for(switches(self._fetches, dropout, frozenset(v.op for v in self.assigned)))

    def changes(self, fetch) -> tuple | None:
        """The first (op, what it changes) that running ``fetch`` (a tensor or an operation) in
        :meth:`compute` would add to what a micro-batch changes anyway (its UPDATE_OPS, the
        queue or iterator its loss reads): :func:`~hostavg.tf1.variables.state_changes`;
        None where it adds nothing. Found once per fetch."""
        if fetch not in self._changes:
            if self._runs is None:
                self._runs = frozenset(ops_run(f.op if isinstance(f, tf.Tensor) else f
                                               for f in self._fetches))
            self._changes[fetch] = next(iter(state_changes(self.graph, [fetch], self._runs)),
                                        None)
        return self._changes[fetch]

    def unfed(self, feed_keys: tuple, fetches: tuple = ()) -> tuple:
        """The placeholders (without a default) that :meth:`compute` (with ``fetches``) reads
        and ``feed_keys`` (tensors) do not feed, sorted by name; found once per set of keys.

        A fed tensor cuts the walk: what only it reads needs no feed.
        """
        run = self._with(fetches)
        key = (id(run), feed_keys)
        found = self._unfed.get(key)
        if found is None:
            found = self._unfed[key] = tuple(placeholders_read(run, feed_keys, with_default=False))
        return found

    def snapshot(self, sess) -> list | None:
        """The values of :attr:`assigned` (None when there are none)."""
        if not self.assigned:
            return None
        return self._callables.get(sess, self._assigned_values, ())()

    def restore(self, sess, values) -> None:
        if values is not None:
            load_variables(sess, self.assigned, values)

    def apply(self, sess, mean: Mapping, feed: Mapping, request: ApplyRequest) -> Applied:
        """Feeds ``mean`` through the gradient tensors (and ``feed``, name -> value, to
        :attr:`apply_inputs`), runs the train op once.

        Returns the new global step, the learning rate and what ``request`` asks
        for (the update-to-weight ratios; the weights after and the updates),
        all from that one session call.
        Measuring keeps each weight's value from before the update alive
        while the optimizer runs (a copy of the weights) and reduces two norms
        per variable: about the cost of the apply itself again. Checking
        (``check_applied``) keeps what the update can write (the touched rows
        of a variable written only by rows, every other written value whole:
        :mod:`hostavg.tf1.checked`) and sums each checked value once more; the
        names of those it finds non-finite, after it undid the update, come
        back as ``Applied.nonfinite``.
        """
        args = list(feed.values())
        for name, g in zip(self.names, self._grads):
            value = mean[name]
            if isinstance(g, tf.IndexedSlices):
                args += [value.indices, value.values]
                if g.dense_shape is not None:
                    args.append(np.asarray(self.spec[name].shape))
            else:
                args.append(value)
        keys = tuple(self.apply_inputs[name] for name in feed) + self._apply_feeds
        fetches, kind = self._apply_fetches.of(request)
        out = self._callables.get(sess, fetches, keys)(*args)
        if self._checked and kind != "proven":
            *out, finite = out
            nonfinite = tuple(v.op.name for v, ok in zip(self._checked, finite) if not ok)
            if nonfinite:
                return Applied(int(out[0]), nonfinite=nonfinite)
        magnitudes = None
        if kind == "magnitudes":
            *out, found = out
            magnitudes = dict(zip(self.update_bound.measured,
                                  largest_magnitudes(found).tolist()))
        weights = updates = ()
        if request.values:
            k = len(self.names)
            out, weights, updates = out[:-2 * k], out[-2 * k:-k], out[-k:]
        return Applied.of(self.names, int(out[0]),
                          None if self.learning_rate is None else float(out[1]), request,
                          out[-1] if request.ratios else (), weights, updates)._replace(
                              magnitudes=magnitudes)

    def _measured_variables(self) -> list:
        """The variables an apply asked for magnitudes measures, in the order of
        :attr:`~hostavg.core.bounds.UpdateBound.measured`."""
        by_name = {v.op.name: v for v in self.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)}
        return [by_name[name] for name in self.update_bound.measured]


def _gradient_pairs(optimizer, loss, var_list) -> list:
    """The optimizer's (gradient, variable) pairs for ``loss`` over ``var_list``, those without
    a gradient left out; a HostavgError where no variable is left or one is no real float."""
    try:
        pairs = [(g, v) for g, v in optimizer.compute_gradients(loss, var_list=var_list)
                 if g is not None]
    except ValueError as e:  # TensorFlow's check of the variables' dtypes
        raise ArgumentError(
            f"the optimizer cannot train the variables the loss reaches ({first_line(e)}); "
            f"hostavg trains real floating-point variables: leave the others out with "
            f"var_list") from e
    if not pairs:
        raise ArgumentError(
            "nothing to train: no variable in var_list has a gradient with respect "
            "to the loss (check var_list, and that the loss depends on trainable "
            "variables)")
    return pairs


def _variable_specs(pairs) -> dict:
    """Each trained variable's name -> :class:`VariableSpec` (shape, dtype, whether sparse)."""
    return {v.op.name: VariableSpec(tuple(v.shape.as_list()),
                                    np.dtype(v.dtype.base_dtype.as_numpy_dtype),
                                    isinstance(g, tf.IndexedSlices)) for g, v in pairs}


def _compute_fetches(loss, global_step, grads: list, update_ops: list) -> tuple[list, list, list]:
    """What a micro-batch's compute fetches: the loss, the global step, each gradient (a
    sparse one coalesced, as its indices and values), each gradient's squared norm, and the
    UPDATE_OPS; and the gradients as fetched (the sparse ones coalesced) and their squared
    norms, each a list.

    Sparse rows leave the session coalesced (sorted, unique, duplicates summed) by the same
    ops whatever the micro-batch, so that a gradient depends only on its feed and weights,
    and only the unique rows are fetched. Squared norms are reduced in the session, where
    the values are fresh in cache and the work is spread over its threads (Eigen's tree
    reduction: ~1e-7 relative error in float32): the host then makes one pass per
    micro-batch (the add) instead of two. Half precision is summed in float32; a float32 sum
    that overflows (entries above ~1e19) is redone on the host in float64 (see
    :meth:`Wiring.compute`). See docs/explanation/performance.md for the measurements.
    """
    with tf.name_scope("hostavg_coalesce"):
        fetched = [_coalesced(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    fetches = [loss, global_step.read_value()] + _flat(fetched)
    with tf.name_scope("hostavg_norms"):
        squares = [_squared_norm(g.values if isinstance(g, tf.IndexedSlices) else g)
                   for g in fetched]
    fetches += squares
    if update_ops:
        fetches.append(tf.group(*update_ops, name="hostavg_update_ops"))
    return fetches, fetched, squares


def _apply_feeds(grads: list) -> tuple:
    """The tensors an apply feeds, in order: each dense gradient, and a sparse one's indices,
    values and (where it has one) dense shape."""
    return tuple(t for g in grads for t in
                 ((g.indices, g.values) + ((g.dense_shape,) if g.dense_shape is not None else ())
                  if isinstance(g, tf.IndexedSlices) else (g,)))


def _densifies_sparse(optimizer) -> bool:
    """Whether a sparse gradient is applied dense: for TF1's AdamOptimizer itself.

    Its sparse update touches every row of its slots and variable anyway
    (m = beta1 * m, then a scatter-add of the rows; the same for v; then the
    whole variable) in several passes, where its dense kernel does the same
    arithmetic in one fused pass; the mean's rows (unique: coalesced) are
    therefore scattered into a dense gradient in the graph, where the table
    lives (docs/explanation/performance.md has the timings). Any other
    optimizer, a subclass of Adam's too, gets the rows as they are: its
    sparse update is its own semantics.
    """
    return type(optimizer) is v1.train.AdamOptimizer


def _train_ops(optimizer, pairs: list, global_step, measured: bool = True) -> tuple:
    """The train op, and a second apply op of the same optimizer (same slots) that measures
    the update-to-weight ratios: ``(train_op, measured_train_op, before)``, ``before`` the
    weights read before the measured op runs (its ops wait for the reads); without
    ``measured`` (the checked apply measures), the train op alone: ``(train_op, None, None)``.

    Holding the reads makes the optimizer copy what it updates in place (a
    whole embedding table), so the plain train op, which reads nothing
    first, serves the applies that do not measure.
    """
    train_op = optimizer.apply_gradients(_applied(pairs, _densifies_sparse(optimizer)),
                                         global_step=global_step)
    if not measured:
        return train_op, None, None
    return (train_op, *_measured_op(optimizer, pairs, global_step))


def _measured_op(optimizer, pairs: list, global_step) -> tuple:
    """``(measured_train_op, before)``: an apply op of ``optimizer`` (its slots) that runs once
    ``before``, the trained variables' values, are read (:func:`_train_ops`)."""
    variables = [v for _, v in pairs]
    with tf.name_scope("hostavg_update_ratios"):
        before = [value_now(v) for v in variables]
    with tf.control_dependencies(before):
        fed = [tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
               if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g, _ in pairs]
    measured_train_op = optimizer.apply_gradients(
        _applied(zip(fed, variables), _densifies_sparse(optimizer)), global_step=global_step)
    return measured_train_op, before


def _checked_train_ops(optimizer, pairs: list, global_step, train_op, apply_feeds: tuple
                       ) -> tuple:
    """The checked train ops (:func:`~hostavg.tf1.checked.checked_train_op`):
    ``((checked, measured op, weights before), plain op)``, the measured one keeping the
    trained variables whole (for the update ratios), the plain one keeping what it can by rows
    (the same op where nothing is written by rows)."""
    densify = _densifies_sparse(optimizer)

    def apply(fed_pairs):
        return optimizer.apply_gradients(_applied(fed_pairs, densify), global_step=global_step)
    measured = checked_train_op(apply, pairs, train_op, apply_feeds, whole=True)
    by_rows = any(r is not None for r in rows_written(train_op, pairs, [v for _, v in pairs],
                                                      apply_feeds))
    plain = checked_train_op(apply, pairs, train_op, apply_feeds, whole=False) if by_rows \
        else measured
    return measured, plain.op


class ApplyFetches(NamedTuple):
    """What an apply fetches, by what it is asked for (:meth:`of`): lists of tensors and ops.

    Attributes:
      plain: the global step after it and the learning rate (where one is found).
      ratios: those, then the squared norms of each update and of each weight
        before it, as one vector.
      values: those of ``ratios``, then each weight after it and each update.
      proven: where the host may prove applies finite (:mod:`hostavg.engine.proof`), the
        same three of the unchecked train ops; else None.
      measuring: there, the same three of the checked ones, each measuring after it the
        largest magnitude of every variable the proof bounds (before the checked op).

    Where applies check, each of the first three ends with the checked train op (its
    output: whether each checked variable is finite).
    """

    plain: list
    ratios: list
    values: list
    proven: ApplyFetches | None = None
    measuring: ApplyFetches | None = None

    def of(self, request: ApplyRequest) -> tuple[list, str]:
        """(the fetches, which) of an apply asked for ``request``: which is "proven" (the
        unchecked ones), "magnitudes" (checked, then measuring) or "checked" (or, where
        applies do not check, the plain ones)."""
        if request.proven and self.proven is not None:
            return self.proven.of(ApplyRequest(request.ratios, request.values))[0], "proven"
        if request.magnitudes and self.measuring is not None:
            return self.measuring.of(ApplyRequest(request.ratios, request.values))[0], \
                "magnitudes"
        return (self.values if request.values else self.ratios if request.ratios
                else self.plain), "checked"

    def measuring_too(self, checked_op, measured_train_op, variables: list) -> ApplyFetches:
        """These fetches, each with the magnitudes of ``variables`` after its checked op
        (``checked_op``, or ``measured_train_op`` for the ratios and values), before it."""
        plain = _magnitudes(checked_op, variables)
        measured = plain if measured_train_op is checked_op else \
            _magnitudes(measured_train_op, variables)
        return ApplyFetches(self.plain[:-1] + [plain, self.plain[-1]],
                            self.ratios[:-1] + [measured, self.ratios[-1]],
                            self.values[:-1] + [measured, self.values[-1]])


def _apply_fetches(global_step, train_op, measured_train_op, pairs: list, before: list, rate,
                   checked_op) -> ApplyFetches:
    """What an apply fetches (``rate``: the optimizer's learning-rate tensor, or None). With
    ``checked_op`` (the checked train op that keeps rows where it can,
    :func:`_checked_train_ops`), ``measured_train_op`` is the checked one that keeps the
    weights whole and serves the applies that measure, and ``checked_op`` the plain one;
    either is fetched last. Else the plain apply runs the train op, which reads no weight
    before it."""
    with tf.control_dependencies([measured_train_op]):
        measured_step_after = global_step.read_value()
        with tf.name_scope("hostavg_update_ratios"):
            after = [value_now(v) for _, v in pairs]
            updates = [a - b for a, b in zip(after, before)]
        squares = [_update_squares(after, before)]
    # (An identity: a learning-rate placeholder is fed to the apply, and a fed tensor
    # cannot be fetched.)
    lr = [] if rate is None else [tf.identity(rate)]
    ratios = [measured_step_after] + lr + squares
    if checked_op is None:
        with tf.control_dependencies([train_op]):
            step_after = global_step.read_value()
        return ApplyFetches([step_after] + lr, ratios, ratios + after + updates)
    with tf.control_dependencies([checked_op]):
        step_after = global_step.read_value()
    return ApplyFetches([step_after] + lr + [checked_op], ratios + [measured_train_op],
                        ratios + after + updates + [measured_train_op])


def _magnitudes(op, variables: list):
    """Once ``op`` ran: the largest and minus the smallest entry of each of ``variables``, one
    float64 vector (two reductions each, no copy; a reference variable's read kept in order
    as :mod:`hostavg.tf1.checked` keeps it)."""
    with tf.control_dependencies([op]), tf.name_scope("hostavg_magnitudes"):
        return magnitude_ends([tf.abs(v.read_value()) if is_ref_dtype(v.dtype) else v.read_value()
                               for v in variables])


def _update_squares(after: list, before: list):
    """One vector: |after - before|^2 per variable, then |before|^2, ``after`` the variables
    read after the measured apply."""
    with tf.name_scope("hostavg_update_ratios"):
        sums = [_sum_squares(a, b) for a, b in zip(after, before)] + [
            _sum_squares(b) for b in before]
        if len({t.dtype for t in sums}) > 1:
            sums = [tf.cast(t, tf.float64) for t in sums]
        return tf.stack(sums)


def _fetched(fetches: tuple, values) -> tuple:
    """The value of each of ``fetches`` from a call's outputs ``values`` (tensors only, in
    order): arrays copied and read-only, None for an operation."""
    values, out = iter(values), []
    for f in fetches:
        if isinstance(f, tf.Operation):
            out.append(None)
        else:
            value = next(values)
            out.append(freeze(np.array(value)) if isinstance(value, np.ndarray) else value)
    return tuple(out)


def _squared_norm(g):
    """The sum of squares of ``g``'s entries, in float32 at least."""
    if g.dtype.size < 4:
        g = tf.cast(g, tf.float32)
    return tf.reduce_sum(tf.square(g))


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


def _sum_squares(x, minus=None):
    """sum((x - minus)^2), or sum(x^2), in the variable's dtype (float32 for narrower floats)."""
    if x.dtype.base_dtype not in (tf.float32, tf.float64):
        x = tf.cast(x, tf.float32)
        minus = None if minus is None else tf.cast(minus, tf.float32)
    return tf.reduce_sum(tf.square(x) if minus is None else tf.math.squared_difference(x, minus))
