"""Everything hostavg needs of TensorFlow: importing it quietly, its errors, the ops that read a
variable or write its rows, a cheap finite check, and its private APIs.

:func:`import_tensorflow` is ``hostavg.import_tensorflow``; this module imports
TensorFlow through it. Imported by the TF1 and Keras backends and the command
line (``import hostavg`` imports it when ``hostavg.import_tensorflow`` is first
read). Each private API's wrapper is the private form where the private API
exists and behaves, and else its public fallback (always with
``HOSTAVG_PUBLIC_API_ONLY=1``; see :mod:`hostavg.compat`). Detection runs no
session and no eager op, so it initialises no device. The wrappers:
:func:`session_call`, :func:`input_types`, :func:`is_ref_dtype`,
:func:`learning_rate`, :func:`hyperparameters`, :func:`graph_cond`, :func:`eager_tensor`
and :func:`concrete_call`.

See docs/explanation/ownership.md for each wrapper's private API, its
fallback and how they differ.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterable

import numpy as np

from hostavg.compat import choose

__all__ = ["READ_OPS", "ROWS_KEPT", "concrete_call", "eager_tensor", "finite_flags", "first_line",
           "graph_cond", "hyperparameters", "import_tensorflow", "input_types", "is_ref_dtype",
           "largest_magnitudes", "learning_rate", "magnitude_ends", "rows_fed",
           "rows_of", "sample_squares", "session_call"]

#: Ops that take a variable (its resource handle) only to read it.
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
                      "VarIsInitializedOp", "IsVariableInitialized"})

#: Op types that pass their input's values on, some of them or all: the rows a write is given
#: through them are rows of the fed indices.
ROWS_KEPT = frozenset({"Identity", "Unique", "Cast"})


#: What TF_CPP_MIN_LOG_LEVEL becomes unless it was set: fatal errors only. TensorFlow's
#: own errors reach Python as exceptions; what its C++ core logs at start-up ("failed
#: call to cuInit" on a machine without a GPU) is noise to most.
QUIET_LEVEL = "3"


def import_tensorflow():
    """TensorFlow, imported without the log lines its C++ core prints while it loads.

    If ``TF_CPP_MIN_LOG_LEVEL`` is set, yours wins and TensorFlow is imported
    as it is. Otherwise it is set to ``"3"`` (TensorFlow's C++ core logs
    fatal errors only) and, while TensorFlow loads, the process's standard
    error (file descriptor 2) goes to ``/dev/null``: the lines printed there
    before TensorFlow sets its logging up ("oneDNN custom operations are
    on", "Could not find cuda drivers") ignore ``TF_CPP_MIN_LOG_LEVEL``. An
    exception raised by the import propagates as usual. The CLI and the
    notebooks import TensorFlow this way; to see every line, set
    ``TF_CPP_MIN_LOG_LEVEL=0``.

    Example::

        import hostavg
        tf = hostavg.import_tensorflow()
    """
    if "tensorflow" in sys.modules or "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        import tensorflow
        return tensorflow
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = QUIET_LEVEL
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 to silence
        import tensorflow
        return tensorflow
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        import tensorflow
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return tensorflow


def first_line(error) -> str:
    """The line of a TensorFlow error message that says what went wrong."""
    for line in str(getattr(error, "message", error)).splitlines():
        line = line.strip()
        if line and not line.startswith(("Graph execution error", "Detected at node", "File ",
                                         "Node: ")):
            return line
    return str(error)


tf = import_tensorflow()
v1 = tf.compat.v1


def _parameters(function) -> list:
    return list(inspect.signature(function).parameters)


# --- Compiled session calls ------------------------------------------------------------------

try:
    from tensorflow.core.protobuf.config_pb2 import CallableOptions
    from tensorflow.python.client.session import BaseSession
except ImportError:  # detection fails, and the public fallback serves
    CallableOptions = BaseSession = None


def _session_call_private(sess, tensors: list, targets: list, feed_keys: tuple,
                          run_options=None) -> Callable:
    """A callable that feeds its arguments to ``feed_keys``, runs ``targets`` and returns ``tensors``' values.

    Made by ``Session._make_callable_from_options``: ``sess.run`` spends
    about as long in Python parsing fetches and the feed dict as a small
    model computes, and public ``make_callable`` falls back to ``run``
    whenever there are feeds; a callable made from ``CallableOptions`` skips
    that. A session without it (a wrapper such as ``MonitoredSession``) gets
    the public fallback. Arguments must be arrays of the keys' dtypes.
    """
    make = getattr(sess, "_make_callable_from_options", None)
    if make is None:
        return _session_call_public(sess, tensors, targets, feed_keys, run_options)
    options = CallableOptions(feed=[k.name for k in feed_keys], fetch=[t.name for t in tensors],
                              target=[op.name for op in targets])
    if run_options is not None:
        options.run_options.CopyFrom(run_options)
    return make(options)


def _session_call_public(sess, tensors: list, targets: list, feed_keys: tuple,
                         run_options=None) -> Callable:
    """A callable that feeds its arguments to ``feed_keys``, runs ``targets`` and returns ``tensors``' values.

    By ``sess.run``, given ``run_options`` (a ``tf.compat.v1.RunOptions``)
    on each call.
    """
    fetches, n = list(tensors) + list(targets), len(tensors)
    options = {} if run_options is None else {"options": run_options}  # a wrapper's run may lack it

    def run(*values):
        return sess.run(fetches, dict(zip(feed_keys, values)), **options)[:n]
    return run


def _session_call_works() -> bool:
    return _parameters(BaseSession._make_callable_from_options) == ["self", "callable_options"] \
        and {"feed", "fetch", "target", "run_options"} <= set(CallableOptions.DESCRIPTOR.fields_by_name)


session_call = choose("tensorflow.compat.v1.Session._make_callable_from_options",
                      _session_call_private, _session_call_public, _session_call_works)


# --- Operations and dtypes -------------------------------------------------------------------


def _input_types_private(op) -> list:
    """The dtypes ``op`` takes its inputs as (a reference dtype where it takes a variable by
    reference), by ``Operation._input_types``."""
    return op._input_types  # pylint: disable=protected-access


def _input_types_public(op) -> list:
    """The dtypes ``op`` takes its inputs as (a reference dtype where it takes a variable by
    reference), from its ``op_def``'s input arguments and its attributes.

    Not the inputs' own dtypes: an op that reads a reference variable
    (``Identity`` of ``w``) is given ``float32_ref`` and takes ``float32``.
    """
    out = []
    for arg in op.op_def.input_arg:
        if arg.type_list_attr:
            types = list(op.get_attr(arg.type_list_attr))
        else:
            one = arg.type if arg.type else op.get_attr(arg.type_attr)
            types = [one] * (op.get_attr(arg.number_attr) if arg.number_attr else 1)
        # A reference dtype's enum is its base dtype's + 100 (types.proto: DT_FLOAT_REF = 101).
        out += [tf.as_dtype(tf.as_dtype(t).as_datatype_enum + (100 if arg.is_ref else 0))
                for t in types]
    return out


def _is_ref_dtype_private(dtype) -> bool:
    """Whether ``dtype`` is a reference dtype (``float32_ref``: a TF1 ``Variable(use_resource=False)``),
    by ``DType._is_ref_dtype``."""
    return dtype._is_ref_dtype  # pylint: disable=protected-access


def _is_ref_dtype_public(dtype) -> bool:
    """Whether ``dtype`` is a reference dtype (``float32_ref``: a TF1 ``Variable(use_resource=False)``):
    one that is not its own ``base_dtype``."""
    return dtype != dtype.base_dtype


@functools.cache
def _probe_graph():
    """A small graph with every kind of input the probes compare: reference and resource
    variables, list inputs (AddN), an optimizer of each learning-rate attribute."""
    graph = tf.Graph()
    with graph.as_default():
        ref = v1.Variable(np.ones(2, np.float32), use_resource=False, name="ref")
        resource = v1.Variable(np.ones(2, np.float32), use_resource=True, name="resource")
        grad = tf.add_n([tf.ones(2), tf.ones(2)])
        descent = v1.train.GradientDescentOptimizer(0.5)
        adam = v1.train.AdamOptimizer(0.5)
        for optimizer in (descent, adam):
            optimizer.apply_gradients([(grad, ref), (grad, resource)])
    return graph, (descent, adam)


def _input_types_works() -> bool:
    graph, _ = _probe_graph()
    ops = graph.get_operations()
    return all(_input_types_private(op) == _input_types_public(op) for op in ops) \
        and any(map(_is_ref_dtype_public, (t for op in ops for t in _input_types_private(op))))


def _is_ref_dtype_works() -> bool:
    ref = tf.as_dtype(tf.float32.as_datatype_enum + 100)
    return _is_ref_dtype_private(ref) is True and _is_ref_dtype_private(tf.float32) is False \
        and _is_ref_dtype_private(tf.resource) is False


input_types = choose("tensorflow.Operation._input_types", _input_types_private,
                     _input_types_public, _input_types_works)
is_ref_dtype = choose("tensorflow.DType._is_ref_dtype", _is_ref_dtype_private,
                      _is_ref_dtype_public, _is_ref_dtype_works)


# --- The learning rate of a TF1 optimizer -----------------------------------------------------

#: Where TF1 optimizers keep the learning-rate tensor their apply reads (GradientDescent,
#: Momentum, RMSProp, Adagrad, Ftrl: the first; Adam, Adadelta: the second). The probe
#: checks one optimizer of each, in this order.
LEARNING_RATE_ATTRIBUTES = ("_learning_rate_tensor", "_lr_t")

#: The input of an apply kernel (``ApplyAdam``, ``ResourceApplyGradientDescent``, ...) that
#: takes the learning rate.
_RATE_ARGUMENTS = ("lr", "alpha")


def _rate(tensor, graph):
    """``tensor`` if it can be a learning rate of ``graph`` (a floating scalar in it), else None."""
    if isinstance(tensor, tf.Tensor) and tensor.graph is graph and tensor.shape.rank == 0 \
            and tensor.dtype.base_dtype.is_floating:
        return tensor
    return None


def _learning_rate_public(optimizer, graph, ops: Iterable):
    """The learning-rate tensor that the apply kernels among ``ops`` read, or None.

    ``ops``: the ops a train op runs (``optimizer`` is not read: the private
    form's signature). The rate is the ``lr`` (or ``alpha``)
    input of every apply kernel among them (``ApplyAdam``,
    ``ResourceApplyGradientDescent``, ...; a cast looked through), where they
    all read one tensor. An update made of plain ops (GradientDescent's sparse
    update: a scatter-add of ``-lr * rows``) has none.
    """
    found = set()
    for op in ops:
        if "Apply" in op.type:
            names = [arg.name for arg in op.op_def.input_arg]
            for name in set(names) & set(_RATE_ARGUMENTS):
                tensor = op.inputs[names.index(name)]  # apply kernels take no lists: one input each
                while tensor.op.type == "Cast":
                    tensor = tensor.op.inputs[0]
                found.add(tensor)
    return _rate(found.pop(), graph) if len(found) == 1 else None


def _learning_rate_private(optimizer, graph, ops: Iterable):
    """The learning-rate tensor the optimizer's apply reads, or None: a TF1 optimizer's
    ``_learning_rate_tensor`` or ``_lr_t``, else what the public fallback finds in ``ops``."""
    for attr in LEARNING_RATE_ATTRIBUTES:
        tensor = _rate(getattr(optimizer, attr, None), graph)
        if tensor is not None:
            return tensor
    return _learning_rate_public(optimizer, graph, ops)


def _learning_rate_works() -> bool:
    graph, optimizers = _probe_graph()
    return all(_rate(getattr(optimizer, attr, None), graph) is not None
               and _learning_rate_private(optimizer, graph, ()) is _learning_rate_public(
                   optimizer, graph, [op for op in graph.get_operations()
                                      if op.name.startswith(optimizer.get_name() + "/")])
               for optimizer, attr in zip(optimizers, LEARNING_RATE_ATTRIBUTES))


learning_rate = choose("tensorflow.compat.v1.train.Optimizer._learning_rate_tensor/_lr_t",
                       _learning_rate_private, _learning_rate_public, _learning_rate_works)


#: The hyper-parameters of the TF1 optimizers whose update hostavg can bound
#: (:mod:`hostavg.tf1.bounds`), by class name: name -> the attribute holding it.
HYPERPARAMETERS = {"GradientDescentOptimizer": {},
                   "MomentumOptimizer": {"momentum": "_momentum", "nesterov": "_use_nesterov"},
                   "AdamOptimizer": {"beta1": "_beta1", "beta2": "_beta2", "epsilon": "_epsilon"}}


def _hyperparameters_private(optimizer) -> dict | None:
    """name -> value (a number, or a tensor) of each hyper-parameter of ``optimizer`` besides
    its learning rate, read from its attributes, where it is one of :data:`HYPERPARAMETERS`
    exactly (not a subclass, which may change the update); else None."""
    names = HYPERPARAMETERS.get(type(optimizer).__name__)
    if names is None or type(optimizer) is not getattr(tf.compat.v1.train,
                                                       type(optimizer).__name__):
        return None
    return {name: getattr(optimizer, attr) for name, attr in names.items()}


def _hyperparameters_public(optimizer) -> None:
    """None: TF1's optimizers keep their hyper-parameters in private attributes only, so the
    host cannot bound their update (every apply is checked on the device)."""
    return None


def _hyperparameters_works() -> bool:
    train = tf.compat.v1.train
    momentum = _hyperparameters_private(train.MomentumOptimizer(0.5, 0.25, use_nesterov=True))
    adam = _hyperparameters_private(train.AdamOptimizer(0.5, 0.125, 0.0625, 0.03125))
    return momentum == {"momentum": 0.25, "nesterov": True} and adam == {
        "beta1": 0.125, "beta2": 0.0625, "epsilon": 0.03125}


hyperparameters = choose("tensorflow.compat.v1.train optimizers' _momentum/_beta1/...",
                         _hyperparameters_private, _hyperparameters_public,
                         _hyperparameters_works)
_probe_graph.cache_clear()


# --- A conditional in a TF1 graph ------------------------------------------------------------

try:
    from tensorflow.python.ops import control_flow_util
except ImportError:  # detection fails, and the public fallback serves
    control_flow_util = None
_COND_LOCK = threading.Lock()


def _graph_cond_private(pred, true_fn, false_fn):
    """``tf.compat.v1.cond`` built of Switch and Merge ops in the graph, as TensorFlow 1 built
    it, with TensorFlow 2's control flow switched off while it is built (under a lock; a
    graph another thread builds meanwhile gets TensorFlow 1's too). A TensorFlow 2 cond is
    an ``If`` op that calls its branch as a function: 60-70 us more a session call on a
    2-core CPU."""
    with _COND_LOCK:
        was = control_flow_util.ENABLE_CONTROL_FLOW_V2
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
        try:
            return v1.cond(pred, true_fn, false_fn)
        finally:
            control_flow_util.ENABLE_CONTROL_FLOW_V2 = was


def _graph_cond_public(pred, true_fn, false_fn):
    """``tf.compat.v1.cond`` as TensorFlow builds it (an ``If`` op under TensorFlow 2's behavior)."""
    return v1.cond(pred, true_fn, false_fn)


def _graph_cond_works() -> bool:
    if not isinstance(getattr(control_flow_util, "ENABLE_CONTROL_FLOW_V2", None), bool):
        return False
    was = control_flow_util.ENABLE_CONTROL_FLOW_V2
    with tf.Graph().as_default() as graph:
        _graph_cond_private(v1.placeholder(tf.bool, ()), lambda: tf.constant(1.0),
                            lambda: tf.constant(2.0))
    types = {op.type for op in graph.get_operations()}
    return "Switch" in types and "Merge" in types and not types & {"If", "StatelessIf"} \
        and control_flow_util.ENABLE_CONTROL_FLOW_V2 is was


graph_cond = choose("tensorflow.python.ops.control_flow_util.ENABLE_CONTROL_FLOW_V2",
                    _graph_cond_private, _graph_cond_public, _graph_cond_works)


# --- Eager tensors and compiled functions (Keras) ---------------------------------------------

try:
    from tensorflow.python.eager.context import ensure_initialized
    from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
    from tensorflow.python.framework.ops import EagerTensor
except ImportError:  # detection fails, and the public fallbacks serve
    ensure_initialized = ConcreteFunction = EagerTensor = None

#: The host's CPU: an eager tensor built there from a NumPy array shares the array's memory.
HOST = "/device:CPU:0"


def _eager_tensor_private(array: np.ndarray, dtype=None):
    """``array`` as an eager tensor of ``dtype`` (default its own), sharing its memory where TensorFlow can.

    Built by the ``EagerTensor`` constructor on the host's CPU:
    ``tf.convert_to_tensor`` copies every NumPy array first, in case the
    caller changes it later (a page-faulting copy of each gradient per apply);
    the constructor shares a 64-byte aligned array's memory, as a TF1
    session's feed does. Only for arrays left unchanged while the tensor lives.
    (The constructor needs TensorFlow's eager context, which
    ``context.ensure_initialized`` makes on the first call, as any eager op would.)
    """
    ensure_initialized()
    return EagerTensor(array, HOST, tf.as_dtype(array.dtype if dtype is None else dtype).as_datatype_enum)


def _eager_tensor_public(array: np.ndarray, dtype=None):
    """``array`` as an eager tensor of ``dtype`` (default its own), by ``tf.convert_to_tensor`` (a copy)."""
    return tf.convert_to_tensor(array, tf.as_dtype(array.dtype if dtype is None else dtype))


def _eager_tensor_works() -> bool:
    return isinstance(EagerTensor, type) and issubclass(EagerTensor, tf.Tensor) \
        and callable(ensure_initialized)


def _concrete_call_private(concrete) -> Callable:
    """``concrete`` (a ConcreteFunction) as a callable of tensors in its signature's order, with its ``graph``.

    By ``ConcreteFunction._call_flat``: the public ``__call__`` binds and
    casts its arguments in Python on every call; ``_call_flat`` takes the
    tensors as they are. Callers pass exactly the signature's dtypes.
    """
    call_flat, captured = concrete._call_flat, concrete.captured_inputs  # pylint: disable=protected-access

    def call(*tensors):
        return call_flat(list(tensors), captured)
    call.graph = concrete.graph
    return call


def _concrete_call_public(concrete) -> Callable:
    """``concrete`` (a ConcreteFunction) as a callable of tensors in its signature's order, with its ``graph``: itself."""
    return concrete


def _concrete_call_works() -> bool:
    return _parameters(ConcreteFunction._call_flat) == ["self", "tensor_inputs", "captured_inputs"]


eager_tensor = choose("tensorflow.python.framework.ops.EagerTensor", _eager_tensor_private,
                      _eager_tensor_public, _eager_tensor_works)
concrete_call = choose(
    "tensorflow.python.eager.polymorphic_function.concrete_function.ConcreteFunction._call_flat",
    _concrete_call_private, _concrete_call_public, _concrete_call_works)


def rows_fed(op, indices: dict):
    """The ref of the fed indices (a key of ``indices``) whose rows are all ``op`` writes, where
    it is a scatter or a sparse apply fed them (or some of them); else None."""
    if "Nd" in op.type or not op.type.startswith(("ResourceScatter", "ResourceSparseApply")):
        return None
    names = [arg.name for arg in op.op_def.input_arg]
    if "indices" not in names:
        return None
    tensor = op.inputs[names.index("indices")]
    while tensor.ref() not in indices and tensor.op.type in ROWS_KEPT and tensor.value_index == 0:
        tensor = tensor.op.inputs[0]
    return tensor.ref() if tensor.ref() in indices else None


def rows_of(writes: set, indices: dict):
    """What ``indices`` holds for the fed indices whose rows are all a variable's writes are
    of, given :func:`rows_fed` of each op that writes it (``writes``); None where one writes
    it otherwise (None among them) or two write different rows."""
    return indices[next(iter(writes))] if len(writes) == 1 and None not in writes else None


def finite_flags(values: list, undo=None):
    """Whether each of ``values`` (float tensors) is finite in every entry: a bool vector;
    where any is not, what ``undo(flags)`` returns (the flags, once it undid an update).

    One pass over each: its sum is finite when every entry is (an Inf or a NaN entry makes
    it Inf or NaN); only where a sum is not (an entry not finite, or finite ones whose sum
    overflows) does a ``tf.cond`` look at each entry: ``value * 0`` is NaN exactly at an Inf
    or a NaN, so its sum is finite exactly where every entry is. (IsFinite and All, a
    reduction of booleans, take several times a float sum over the same entries.)
    """
    quick = tf.math.is_finite(tf.stack([_sum(v) for v in values]))

    def exact():
        flags = tf.math.is_finite(tf.stack([_sum(v * tf.zeros((), v.dtype)) for v in values]))
        if undo is None:
            return flags
        return tf.cond(tf.reduce_all(flags), lambda: flags, lambda: undo(flags))
    return tf.cond(tf.reduce_all(quick), lambda: quick, exact)


def sample_squares(known, grads: list):
    """(n,) float64: ``known`` (n,) float64 plus each sample's sum of squares over ``grads``
    (each (n, size), a row per sample), squared in the gradients' dtype; where a sum is not
    finite (a square overflowing float32), all of them again in float64."""
    sq = tf.add_n([known, *(tf.cast(tf.reduce_sum(tf.square(g), 1), tf.float64) for g in grads)])
    return tf.cond(tf.reduce_all(tf.math.is_finite(sq)), lambda: sq, lambda: tf.add_n(
        [known, *(tf.reduce_sum(tf.square(tf.cast(g, tf.float64)), 1) for g in grads)]))


def magnitude_ends(values: list):
    """One float64 vector: the largest entry of each of ``values`` (float tensors), then minus
    its smallest: two reductions each, no copy (an ``abs`` would allocate the value again);
    :func:`largest_magnitudes` makes them each value's largest magnitude."""
    return tf.stack([tf.cast(x, tf.float64) for value in values
                     for x in (tf.reduce_max(value), -tf.reduce_min(value))])


def largest_magnitudes(ends) -> np.ndarray:
    """Each value's largest magnitude from :func:`magnitude_ends`' vector (an array on the
    host); 0 for an empty value (whose ends are -inf)."""
    ends = np.asarray(ends, np.float64)
    return np.maximum(np.maximum(ends[0::2], ends[1::2]), 0.0)


def _sum(value):
    """The sum of ``value``'s entries as a float32 scalar, summed in float32 at least (a sum
    of narrower floats overflows early)."""
    if value.dtype not in (tf.float32, tf.float64):
        value = tf.cast(value, tf.float32)
    return tf.cast(tf.reduce_sum(value), tf.float32)
