"""The variables of a TF1 trainer's graph: its global step, the UPDATE_OPS it runs, what a step
assigns, what a fetch would change, loading values."""

from __future__ import annotations

import tensorflow as tf

from hostavg.compat.tensorflow import READ_OPS, input_types, is_ref_dtype
from hostavg.core.errors import ArgumentError
from hostavg.tf1.walk import ops_run, placeholders_read

__all__ = ["DATA_OPS", "assigned_variables", "find_global_step", "load_variables",
           "select_update_ops", "state_changes", "value_now"]

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
        raise ArgumentError(
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
            raise ArgumentError(f"update_ops must be ops or tensors of the loss's graph, got "
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
    by_op = _by_op(graph)
    found = {v.op for op in ops_run((f.op if isinstance(f, tf.Tensor) else f for f in fetches), fed)
             for v in _assigns(op, by_op)}
    return [v for op, v in by_op.items() if op in found]


#: Op types that take or put a queue's or an iterator's data, by what they do to it.
DATA_OPS = {
    **dict.fromkeys(["QueueEnqueue", "QueueEnqueueV2", "QueueEnqueueMany", "QueueEnqueueManyV2"],
                    "adds to the queue"),
    **dict.fromkeys(["QueueDequeue", "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2",
                     "QueueDequeueUpTo", "QueueDequeueUpToV2"], "takes from the queue"),
    **dict.fromkeys(["QueueClose", "QueueCloseV2"], "closes the queue"),
    **dict.fromkeys(["IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional"],
                    "takes the next element of the iterator"),
    "MakeIterator": "restarts the iterator",
}


def state_changes(graph, fetches, done: frozenset) -> list:
    """What running ``fetches`` (tensors and operations) changes beyond the ops ``done`` (what
    runs anyway): (op, what it changes) for each op that assigns a global variable or takes or
    puts a queue's or an iterator's data (:data:`DATA_OPS`); trained variables' first, then
    by name. Local variables (a streaming metric's counts) are not among them."""
    by_op = _by_op(graph)
    trained = {v.op.name for v in graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)}
    found = []
    for op in ops_run(f.op if isinstance(f, tf.Tensor) else f for f in fetches):
        if op in done:
            continue
        assigned = sorted(_assigns(op, by_op), key=lambda v: (v.op.name not in trained, v.op.name))
        if assigned:
            update = " (an optimizer's update)" if "Apply" in op.type else ""
            found.append((assigned[0].op.name not in trained, op.name, op,
                          f"assigns the variable {assigned[0].op.name!r}{update}"))
        elif op.type in DATA_OPS:
            handle = next((t.op.name for t in op.inputs
                           if t.dtype == tf.resource or is_ref_dtype(t.dtype)), op.name)
            found.append((True, op.name, op, f"{DATA_OPS[op.type]} {handle!r}"))
    return [(op, what) for *_, op, what in sorted(found, key=lambda f: f[:2])]


def _by_op(graph) -> dict:
    """The global variables of ``graph`` by their ops."""
    return {v.op: v for v in graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)}


def _assigns(op, by_op: dict) -> list:
    """The variables of ``by_op`` that ``op`` may assign: those it takes by reference
    (``Assign``, ``AssignAdd``, scatters) or by resource handle for anything but a read."""
    return [by_op[tensor.op] for tensor, kind in zip(op.inputs, input_types(op))
            if tensor.op in by_op and (is_ref_dtype(kind) or (kind == tf.resource
                                                              and op.type not in READ_OPS))]


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
