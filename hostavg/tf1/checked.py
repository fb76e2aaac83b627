"""The checked apply of a TF1 trainer (``check_applied``): an apply op that checks what it
wrote for NaN and Inf and undoes the update where it finds any, in one session call.

What it keeps to undo with is what the update can change: of a variable the optimizer writes
only by rows (a sparse update of SGD, Momentum, Adagrad, RMSProp: scatters and sparse-apply
ops whose rows are the fed gradient's), those rows, gathered before and checked after; of any other
(a dense update, Adam's slots, the global step), its whole value. Holding a whole value makes
the optimizer copy what it would update in place, so an embedding table under sparse SGD is
read by rows, never copied.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import tensorflow as tf

from hostavg.compat.tensorflow import (READ_OPS, finite_flags, input_types, is_ref_dtype,
                                       rows_fed, rows_of)
from hostavg.tf1.variables import assigned_variables, value_now
from hostavg.tf1.walk import ops_run

__all__ = ["CheckedApply", "checked_train_op"]

v1 = tf.compat.v1


class CheckedApply(NamedTuple):
    """What :func:`checked_train_op` built.

    Attributes:
      checked: the float variables the apply checks, in order (the names an apply that
        went non-finite reports come from them).
      op: the checked train op; its output: whether each of ``checked`` is finite.
      before: each trained variable's whole value before the update, for the update
        ratios (empty where ``whole`` was not asked).
    """

    checked: list
    op: tf.Tensor
    before: list


def checked_train_op(apply, pairs: list, train_op, apply_feeds: tuple, whole: bool) -> CheckedApply:
    """The apply that checks what it wrote: ``apply(pairs)`` (the optimizer's apply_gradients
    of the same slots as ``train_op``) run once every value it may write is kept, then each
    float one checked, and a ``tf.cond`` putting the kept values back where any is not finite.

    What is kept and checked of each variable ``train_op`` writes (found by walking it:
    weights, slots, the optimizer's counters, the global step): the rows of the fed sparse
    gradient where the optimizer writes nothing else of it (:func:`rows_written`), else its
    whole value; ``whole`` keeps the trained variables whole (to measure the update ratios).
    """
    variables = [v for _, v in pairs]
    ids = {id(v) for v in variables}
    written = variables + [v for v in assigned_variables(train_op.graph, [train_op], apply_feeds)
                           if id(v) not in ids]
    rows = rows_written(train_op, pairs, written, apply_feeds)
    if whole:
        rows[:len(variables)] = [None] * len(variables)
    with tf.name_scope("hostavg_check_applied"):
        kept = [value_now(v) if r is None else v.sparse_read(r) for v, r in zip(written, rows)]
        with tf.control_dependencies(kept):
            fed = [tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
                   if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g, _ in pairs]
        applied = apply(list(zip(fed, variables)))
        floats = [i for i, v in enumerate(written) if v.dtype.base_dtype.is_floating]
        with tf.control_dependencies([applied]):
            finite = finite_flags([_read_after(written[i], rows[i]) for i in floats],
                                  functools.partial(_undo, written, rows, kept))
        op = _put_references(finite, written, kept)
    return CheckedApply([written[i] for i in floats], op, kept[:len(variables)] if whole else [])


def rows_written(train_op, pairs: list, written: list, fed: tuple) -> list:
    """For each of ``written``: the fed indices of the sparse gradient (of ``pairs``) whose rows
    are all that ``train_op`` writes of it, else None.

    A resource variable counts when every op that writes it is a scatter or a sparse apply
    whose indices are the fed ones, or some of them
    (:func:`~hostavg.compat.tensorflow.rows_fed`); a reference variable never does (it is
    read and put back whole).
    """
    indices = {g.indices.ref(): g.indices for g, _ in pairs if isinstance(g, tf.IndexedSlices)}
    by_op = {v.op: v for v in written if not is_ref_dtype(v.dtype)}
    writes = {}  # variable op -> the fed indices of each op that writes it (None: not by rows)
    for op in ops_run([train_op], fed):
        for tensor, kind in zip(op.inputs, input_types(op)):
            if tensor.op in by_op and kind == tf.resource and op.type not in READ_OPS:
                writes.setdefault(tensor.op, set()).add(rows_fed(op, indices))
    return [rows_of(writes.get(v.op, {None}), indices) for v in written]


def _read_after(variable, rows):
    """A read of ``variable`` (of its ``rows`` only, where given) that stays within the control
    dependencies it is made in.

    (read_value, sparse_read: a new read there.) A reference variable's read is an Identity of
    its buffer, which grappler's arithmetic optimizer may swap with the check after it,
    leaving the check to read the buffer without the dependencies (before the update writes
    it): an Abs between them, which no optimizer swaps, keeps the order.
    """
    if rows is not None:
        return variable.sparse_read(rows)
    value = variable.read_value()
    return tf.abs(value) if is_ref_dtype(variable.dtype) else value


def _undo(written: list, rows: list, kept: list, finite):
    """``finite``, once every resource variable of ``written`` is given back what was ``kept``
    of it (its ``rows``, or all of it); run in a ``tf.cond``, only where ``finite`` is not all
    true."""
    with tf.control_dependencies([
            v.assign(b) if r is None else v.scatter_update(tf.IndexedSlices(b, r))
            for v, r, b in zip(written, rows, kept) if not is_ref_dtype(v.dtype)]):
        return tf.identity(finite)


def _put_references(finite, written: list, kept: list):
    """``finite``, once every reference variable of ``written`` (which ``tf.cond`` cannot
    capture) is given back its value ``kept`` where ``finite`` is not all true, by a
    ``tf.where`` of its two values each time."""
    ok = tf.reduce_all(finite)
    with tf.control_dependencies([finite]):  # after the update
        put = [v1.assign(v, tf.where(ok, v.read_value(), b)) for v, b in zip(written, kept)
               if is_ref_dtype(v.dtype)]
    if not put:
        return finite
    with tf.control_dependencies(put):
        return tf.identity(finite)
