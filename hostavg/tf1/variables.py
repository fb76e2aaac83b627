"""The variables of a TF1 trainer's graph: its global step, the UPDATE_OPS it runs, what a step assigns, loading values."""

from __future__ import annotations

import tensorflow as tf

from hostavg.compat.tensorflow import input_types, is_ref_dtype
from hostavg.core.errors import HostavgError
from hostavg.frameworks.tensorflow import READ_OPS
from hostavg.tf1.walk import ops_run, placeholders_read

__all__ = ["assigned_variables", "find_global_step", "load_variables", "select_update_ops",
           "value_now"]

v1 = tf.compat.v1


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
    needed = set(placeholders_read(loss, with_default=False))
    return [u for u in graph.get_collection(v1.GraphKeys.UPDATE_OPS)
            if set(placeholders_read(u, with_default=False)) <= needed]


def assigned_variables(graph, fetches, fed=()) -> list:
    """The global variables that running ``fetches`` (``fed`` tensors fed) may assign, in
    collection order.

    Walks back from the fetches through inputs and control inputs; a variable
    counts when an op reached takes it by reference (``Assign``, ``AssignAdd``,
    scatters) or by resource handle for anything but a read. A variable that
    is only read (a frozen backbone, the weights) is not among them, so a
    step's rollback snapshot does not grow with it.
    """
    by_op = {v.op: v for v in graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)}
    found = set()
    for op in ops_run((f.op if isinstance(f, tf.Tensor) else f for f in fetches), fed):
        for tensor, kind in zip(op.inputs, input_types(op)):
            if tensor.op in by_op and (is_ref_dtype(kind) or (kind == tf.resource
                                                              and op.type not in READ_OPS)):
                found.add(tensor.op)
    return [v for op, v in by_op.items() if op in found]


def load_variables(sess, variables, values) -> None:
    """Sets ``variables`` to ``values`` exactly, adding no op to the graph.

    Runs each variable's initializer with its initial-value input fed, so it
    works on a finalized graph too. Variables made from one initial-value
    tensor (``t = tf.zeros([3]); a = tf.Variable(t); b = tf.Variable(t)``)
    share that input, which a run can feed only one value: the n-th variable
    of a shared input is set in the n-th session run (one run where no input
    is shared).
    """
    runs, count = [], {}  # runs: (initializers, feed) each
    for v, value in zip(variables, values):
        key = v.initializer.inputs[1]
        n = count[key] = count.get(key, -1) + 1
        if n == len(runs):
            runs.append(([], {}))
        runs[n][0].append(v.initializer)
        runs[n][1][key] = value
    for initializers, feed in runs:
        sess.run(initializers, feed)


def value_now(variable):
    """The variable's value as a tensor that later assignments leave alone.

    A resource variable's read keeps its value (an assignment while the read
    is held copies first); a reference variable's would alias the buffer
    that the optimizer updates in place, so it is snapshotted.
    """
    if is_ref_dtype(variable.dtype):
        return tf.raw_ops.Snapshot(input=variable)
    return variable.read_value()
