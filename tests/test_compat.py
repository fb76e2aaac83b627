"""The private framework APIs and their public fallbacks (hostavg.compat): each fallback against
its private form on the same input, the switch HOSTAVG_PUBLIC_API_ONLY, and whole TF1 and Keras
runs with and without it, bit for bit (slow: one process each). CI also runs the contract suite
with the switch on, on Keras's TensorFlow and JAX backends (.ci/run)."""

import importlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from models import ENV, OPTIMIZERS, build, make_optimizer, v1

import hostavg
import hostavg.compat.keras
import hostavg.compat.jax
import hostavg.compat.python
import hostavg.compat.tensorflow
from hostavg.compat import PUBLIC_API_ONLY, apis, private_apis, public_api_only
from hostavg.engine import signals
from hostavg.tf1.walk import ops_run

TENSORFLOW_APIS = {
    "session_call": "tensorflow.compat.v1.Session._make_callable_from_options",
    "input_types": "tensorflow.Operation._input_types",
    "is_ref_dtype": "tensorflow.DType._is_ref_dtype",
    "learning_rate": "tensorflow.compat.v1.train.Optimizer._learning_rate_tensor/_lr_t",
    "hyperparameters": "tensorflow.compat.v1.train optimizers' _momentum/_beta1/...",
    "graph_cond": "tensorflow.python.ops.control_flow_util.ENABLE_CONTROL_FLOW_V2",
    "eager_tensor": "tensorflow.python.framework.ops.EagerTensor",
    "concrete_call":
        "tensorflow.python.eager.polymorphic_function.concrete_function.ConcreteFunction._call_flat",
}
PYTHON_APIS = {"get_handler": "_signal.getsignal", "set_handler": "_signal.signal"}
KERAS_APIS = {"compile_arguments": "keras.Model._compile_config",
              "initial_epoch": "keras.Model._initial_epoch",
              "unbuilt": "keras.Model._symbolic_build",
              "owners": "keras.optimizers.Optimizer._trainable_variables",
              "assign": "keras.Variable._direct_assign"}
JAX_APIS = {"used_inputs": "jax.extend.core.Jaxpr (walked back from the loss)"}


def forms(name: str) -> tuple:
    api = apis()[name]
    return api.private, api.public


# --- Detection and the switch ------------------------------------------------------------------


def test_every_private_api_is_detected_in_this_tensorflow_and_each_wrapper_is_its_private_form():
    """The versions the tests run on (setup.py's range) have every private API; a wrapper
    that fell back here would mean the detection is broken, or TensorFlow changed."""
    for module, names in ((hostavg.compat.tensorflow, TENSORFLOW_APIS),
                          (hostavg.compat.python, PYTHON_APIS), (hostavg.compat.keras, KERAS_APIS),
                          (hostavg.compat.jax, JAX_APIS)):
        for wrapper, name in names.items():
            assert apis()[name].used, name
            assert getattr(module, wrapper) is apis()[name].private, name
    assert private_apis() == tuple(sorted([*TENSORFLOW_APIS.values(), *PYTHON_APIS.values(),
                                           *KERAS_APIS.values(), *JAX_APIS.values()]))
    assert hostavg.private_apis is private_apis


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("", False), (None, False)])
def test_the_switch_reads_1_as_on_and_0_or_nothing_as_off(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(PUBLIC_API_ONLY, raising=False)
    else:
        monkeypatch.setenv(PUBLIC_API_ONLY, value)
    assert public_api_only() is want


@pytest.mark.parametrize("value", ["true", "yes", "2", " 1"])
def test_the_switch_refuses_any_other_value(monkeypatch, value):
    monkeypatch.setenv(PUBLIC_API_ONLY, value)
    with pytest.raises(hostavg.HostavgError, match=rf"^HOSTAVG_PUBLIC_API_ONLY must be 1 \(public "
                                                   rf"APIs only\) or 0 \(or unset\), got {value!r}$"):
        public_api_only()


def test_with_the_switch_on_a_framework_module_imported_again_uses_its_public_forms(monkeypatch):
    module = hostavg.compat.python
    try:
        monkeypatch.setenv(PUBLIC_API_ONLY, "1")
        importlib.reload(module)
        for wrapper, name in PYTHON_APIS.items():
            assert getattr(module, wrapper) is apis()[name].public
            assert not apis()[name].used and name not in private_apis()
    finally:
        monkeypatch.delenv(PUBLIC_API_ONLY)
        importlib.reload(module)
    assert all(getattr(module, w) is apis()[n].private for w, n in PYTHON_APIS.items())


# --- _signal -------------------------------------------------------------------------------------


def test_signal_handlers_read_and_set_alike_through_both_forms():
    get_private, get_public = forms("_signal.getsignal")
    set_private, set_public = forms("_signal.signal")
    before = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        pass
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            assert get_private(signum) == get_public(signum)
        set_public(signal.SIGTERM, signal.SIG_IGN)
        ignore = get_private(signal.SIGTERM)
        assert ignore == signal.SIG_IGN and get_public(signal.SIGTERM) is signal.SIG_IGN
        set_private(signal.SIGTERM, handler)
        assert get_public(signal.SIGTERM) is handler is get_private(signal.SIGTERM)
        set_private(signal.SIGTERM, ignore)  # each form takes back what it gave
        assert get_public(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("form", ["private", "public"])
def test_the_signal_guard_holds_and_puts_back_handlers_through_either_form(monkeypatch, form):
    """What the step engine does around an apply, with the wrappers of one form."""
    for wrapper, name in PYTHON_APIS.items():
        monkeypatch.setattr(signals, wrapper, getattr(apis()[name], form))
    calls, before = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        installed = {s: signal.getsignal(s) for s in before}
        with signals.region():
            signals.hold()
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            assert calls == []  # held
            signals.release()
            assert calls == [signal.SIGTERM]  # delivered; SIGINT's ignore, as it was
            signals.hold()
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == [signal.SIGTERM]
        assert calls == [signal.SIGTERM] * 2  # delivered at the region's end
        assert {s: signal.getsignal(s) for s in before} == installed
        assert signal.getsignal(signal.SIGTERM) is installed[signal.SIGTERM]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# --- Dtypes and op input types -------------------------------------------------------------------


def test_reference_dtypes_are_told_apart_alike():
    private, public = forms("tensorflow.DType._is_ref_dtype")
    bases = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.bool,
             tf.string, tf.complex64]
    refs = [tf.as_dtype(d.as_datatype_enum + 100) for d in bases]
    assert [r.name for r in refs[:3]] == ["float16_ref", "bfloat16_ref", "float32_ref"]
    for dtype in bases + refs + [tf.resource, tf.variant]:
        assert private(dtype) == public(dtype) == (dtype in refs), dtype


def graphs() -> list:
    """Graphs with every kind of input: the test model (dense, embedding, with an UPDATE_OP)
    minimized by each optimizer, and one of reference variables updated in place."""
    out = []
    for name in sorted(OPTIMIZERS):
        for sparse in (False, True):
            model = build(sparse=sparse, update_op=True)
            with model.graph.as_default():
                make_optimizer(name).minimize(model.loss)
            out.append(model.graph)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3])
        w = v1.Variable(np.ones(3, np.float32), use_resource=False, name="w")
        ema = v1.Variable(np.zeros((), np.float32), use_resource=False, trainable=False)
        loss = tf.reduce_mean(tf.add_n([x * w, x, tf.identity_n([x, w])[0]]))
        with tf.control_dependencies([v1.assign(ema, 0.5 * ema + loss)]):
            loss = tf.identity(loss)
        v1.train.AdamOptimizer(0.1).minimize(loss)
    out.append(graph)
    return out


def test_op_input_types_are_read_alike_from_the_op_def():
    """Every op of the graphs, reference inputs (Assign, ApplyAdam on a ref variable), list
    inputs (AddN, IdentityN) and resource inputs included."""
    private, public = forms("tensorflow.Operation._input_types")
    is_ref = apis()["tensorflow.DType._is_ref_dtype"].public
    kinds = set()
    for graph in graphs():
        for op in graph.get_operations():
            want = private(op)
            assert public(op) == want, (op.name, op.type)
            kinds.update("ref" if is_ref(t) else "resource" if t == tf.resource else "value"
                         for t in want)
    assert kinds == {"ref", "resource", "value"}


def test_an_ops_input_types_are_not_its_inputs_dtypes():
    """Why the fallback reads the op_def: reading a reference variable takes its ref tensor
    as a plain value, and only the op_def says so."""
    graph = tf.Graph()
    with graph.as_default():
        w = v1.Variable(np.ones(3, np.float32), use_resource=False, name="w")
    read = graph.get_operation_by_name("w/read")
    assert [t.dtype for t in read.inputs] == [w.dtype] and w.dtype.name == "float32_ref"
    assert apis()["tensorflow.Operation._input_types"].public(read) == [tf.float32]


# --- The learning rate of a TF1 optimizer -------------------------------------------------------


def lr_graph(optimizer, *, use_resource: bool, sparse: bool = False, schedule: bool = False):
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int32, [None])
        w = v1.Variable(np.ones((5, 2), np.float32), use_resource=use_resource, name="w")
        rows = tf.gather(w, ids) if sparse else w * tf.cast(tf.reduce_sum(ids), tf.float32)
        loss = tf.reduce_sum(rows ** 2)
        rate = 0.1
        if schedule:
            rate = v1.train.exponential_decay(0.5, v1.train.get_or_create_global_step(),
                                              decay_steps=1, decay_rate=0.5)
        opt = make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer(rate)
        train = opt.minimize(loss)
    return graph, opt, train


@pytest.mark.parametrize("use_resource", [False, True], ids=["ref", "resource"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_learning_rate_is_found_alike_in_the_apply_ops(optimizer, use_resource):
    private, public = forms("tensorflow.compat.v1.train.Optimizer._learning_rate_tensor/_lr_t")
    graph, opt, train = lr_graph(optimizer, use_resource=use_resource)
    want = private(opt, graph, ())  # the attribute alone
    assert want is not None
    assert public(opt, graph, ops_run([train])) is want


def test_a_scheduled_learning_rate_is_found_alike():
    private, public = forms("tensorflow.compat.v1.train.Optimizer._learning_rate_tensor/_lr_t")
    graph, opt, train = lr_graph(v1.train.GradientDescentOptimizer, use_resource=False,
                                 schedule=True)
    want = private(opt, graph, ())
    assert want.op.type != "Const" and public(opt, graph, ops_run([train])) is want


def test_without_an_apply_kernel_only_the_private_form_finds_the_learning_rate():
    """GradientDescent's sparse update is a scatter-add of -lr * rows: no op takes the rate as
    an input of its own. The private form reads the optimizer's attribute; the fallback finds
    none (the step then reports no learning rate; the weights are the same)."""
    private, public = forms("tensorflow.compat.v1.train.Optimizer._learning_rate_tensor/_lr_t")
    graph, opt, train = lr_graph(v1.train.GradientDescentOptimizer, use_resource=True,
                                 sparse=True)
    assert private(opt, graph, ops_run([train])) is not None
    assert public(opt, graph, ops_run([train])) is None


# --- Compiled session calls ----------------------------------------------------------------------


class Counting(v1.Session):
    """A real session that counts the compiled calls made from CallableOptions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made = []

    def _make_callable_from_options(self, options):
        self.made.append(options)
        return super()._make_callable_from_options(options)


class Wrapper:
    """A session wrapper (as MonitoredSession is) with run and graph, and no compiled calls."""

    def __init__(self, sess):
        self.sess, self.graph = sess, sess.graph

    def run(self, fetches, feed_dict=None, options=None):
        return self.sess.run(fetches, feed_dict, options=options)


@pytest.mark.parametrize("threads", ["pool", "caller"])
def test_a_session_call_runs_the_same_ops_on_the_same_feeds_alike(threads):
    private, public = forms("tensorflow.compat.v1.Session._make_callable_from_options")
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3])
        k = v1.placeholder(tf.int64, ())
        w = tf.Variable(np.arange(3, dtype=np.float32), name="w")
        count = tf.Variable(0, dtype=tf.int64, name="count")
        bump = count.assign_add(k).op
        y = tf.reduce_sum(tf.sin(x * w), 1)
        weights = w.read_value()
        init = v1.global_variables_initializer()
    options = v1.RunOptions(inter_op_thread_pool=-1) if threads == "caller" else None
    sess = Counting(graph=graph)
    sess.run(init)
    values = (np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3), np.int64(2))
    got = {}
    for form in (private, public, lambda *a: private(Wrapper(sess), *a[1:])):
        call = form(sess, [y, weights], [bump], (x, k), options)
        got[form] = call(*values)
    assert len(sess.made) == 1  # the private form, on the session that has it
    assert sess.made[0].run_options.inter_op_thread_pool == (-1 if threads == "caller" else 0)
    first, *others = got.values()
    for other in others:
        assert len(other) == 2
        for a, b in zip(first, other):
            np.testing.assert_array_equal(a, b)
    assert sess.run(count) == 3 * 2  # every form ran the target


# --- Eager tensors and compiled functions --------------------------------------------------------


@pytest.mark.parametrize("array,dtype", [
    (np.linspace(-1, 1, 7, dtype=np.float32), None),
    (np.linspace(-1, 1, 7) / 3, np.float32),  # float64 rounded to float32
    (np.arange(6, dtype=np.int32).reshape(2, 3), np.int64),
    (np.array([0.1, 1e-40, -2.5]), np.float32),  # 1e-40: a float32 denormal
], ids=["float32", "float64-to-float32", "int32-to-int64", "float64-to-float32-denormal"])
def test_an_eager_tensor_holds_the_same_values_either_way(array, dtype):
    private, public = forms("tensorflow.python.framework.ops.EagerTensor")
    a, b = private(array, dtype), public(array, dtype)
    assert a.dtype == b.dtype == tf.as_dtype(dtype or array.dtype)
    assert a.shape == b.shape == array.shape
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert a.numpy().tobytes() == b.numpy().tobytes()
    assert "CPU" in a.device


def test_a_graph_cond_runs_the_same_branch_with_the_same_effects_either_way():
    """Both forms run only the branch the predicate picks, its variable update included; the
    private one builds TensorFlow 1's Switch and Merge, and leaves TensorFlow 2's control
    flow on for what is built after it."""
    from tensorflow.python.ops import control_flow_util
    seen, types = {}, {}
    for form in forms("tensorflow.python.ops.control_flow_util.ENABLE_CONTROL_FLOW_V2"):
        with tf.Graph().as_default() as graph:
            pred = v1.placeholder(tf.bool, ())
            w = v1.Variable(np.float32(1.0))

            def update():
                with tf.control_dependencies([w.assign_add(2.0)]):
                    return tf.constant(True)
            out = form(pred, update, lambda: tf.constant(False))
            with tf.control_dependencies([out]):
                read = w.read_value()
            init = v1.global_variables_initializer()
        types[form] = {op.type for op in graph.get_operations()}
        with v1.Session(graph=graph) as sess:
            sess.run(init)
            seen[form] = [sess.run([out, read], {pred: p}) for p in (True, False, True)]
        assert control_flow_util.ENABLE_CONTROL_FLOW_V2
    private, public = forms("tensorflow.python.ops.control_flow_util.ENABLE_CONTROL_FLOW_V2")
    assert seen[private] == seen[public] == [[True, 3.0], [False, 3.0], [True, 5.0]]
    assert "Switch" in types[private] and "If" not in types[private]


def test_a_concrete_function_gives_the_same_outputs_either_way():
    private, public = forms(
        "tensorflow.python.eager.polymorphic_function.concrete_function.ConcreteFunction._call_flat")
    scale = tf.Variable(1.5)
    spec = [tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64)]
    several = tf.function(lambda v, n: [tf.reduce_sum(v) * scale, v * tf.cast(n, tf.float32), n + 1],
                          input_signature=spec).get_concrete_function()
    one = tf.function(lambda v, n: tf.reduce_mean(v) * scale,
                      input_signature=spec).get_concrete_function()
    args = (tf.constant([1.0, 2.0, 4.0]), tf.constant(3, tf.int64))
    for concrete in (several, one):
        a, b = private(concrete), public(concrete)
        assert a.graph is b.graph is concrete.graph
        out_a, out_b = a(*args), b(*args)
        assert type(out_a) is type(out_b)
        for x, y in zip(tf.nest.flatten(out_a), tf.nest.flatten(out_b)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x.numpy(), y.numpy())


# --- Keras ---------------------------------------------------------------------------------------


def test_a_models_compile_arguments_are_read_alike():
    """The private form gives the very objects compile was given; the public one equal objects,
    made anew from the model's compile config."""
    import keras
    private, public = forms("keras.Model._compile_config")
    accuracy = keras.metrics.SparseCategoricalAccuracy(name="acc")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss={"dense": "mse"},
                  loss_weights={"dense": 0.5}, metrics=[accuracy])
    a, b = private(model), public(model)
    assert a.keys() == b.keys() and a["metrics"][0] is accuracy
    assert b["metrics"][0].get_config() == accuracy.get_config()
    assert a["loss"] == b["loss"] and a["loss_weights"] == b["loss_weights"]
    assert b["optimizer"].get_config() == a["optimizer"].get_config()


@pytest.mark.parametrize("value", [np.arange(3, dtype=np.float32), np.arange(3),
                                   np.arange(3, dtype=np.float64), [1, 2, 3]])
def test_values_are_assigned_alike(value):
    """The same variables' values either way: the private form writes a value of the
    variable's dtype and shape as it is, converts any other as ``assign`` does."""
    import keras
    private, public = forms("keras.Variable._direct_assign")
    a, b = (keras.Variable(np.zeros(3, np.float32)) for _ in range(2))
    value = keras.ops.convert_to_tensor(value) if not isinstance(value, list) else value
    private([a], [value])
    public([b], [value])
    assert a.dtype == b.dtype == "float32"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(a.value),
                                  keras.ops.convert_to_numpy(b.value))
    with pytest.raises(ValueError):
        private([a], [np.zeros(4, np.float32)])


def test_where_backup_and_restore_resumes_is_read_by_the_private_form_only(tmp_path):
    """The fallback restores the backup's weights but starts at fit's initial_epoch."""
    import keras
    private, public = forms("keras.Model._initial_epoch")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    assert private(model) is None and public(model) is None
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    backup.set_model(model)
    backup._current_epoch = 3  # pylint: disable=protected-access
    backup._save_model()  # pylint: disable=protected-access
    backup.on_train_begin()
    assert private(model) == 3 and public(model) is None


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
                                  "Adamax", "Nadam", "Ftrl", "Lion", "Lamb", "Muon", "Adafactor"])
def test_which_variable_each_slot_belongs_to_is_told_alike_but_adafactors_factored_moments(name):
    """Both forms give each slot the variable it was made from, even where one layer's path
    begins another's ("d" and "d_kernel": 'd_kernel_' begins both kernels' slot names); the
    fallback finds no owner for Adafactor's factored moments, named after no path, and the
    private form finds them all: every optimizer variable but the scalar counters."""
    import keras
    private, public = forms("keras.optimizers.Optimizer._trainable_variables")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d"),
                              keras.layers.Dense(3, name="d_kernel")])
    kwargs = {"momentum": 0.9} if name == "SGD" else {}
    optimizer = getattr(keras.optimizers, name)(**kwargs)
    optimizer.build(model.trainable_variables)
    trained = model.trainable_variables
    a, b = private(optimizer, trained), public(optimizer, trained)
    counters = [v for v in optimizer.variables if id(v) not in a]
    assert all(v.shape == () for v in counters) and 2 <= len(counters) <= 3  # (Nadam's product)
    assert any(v is optimizer.iterations for v in counters)
    assert all(a[i] is v for i, v in b.items())
    missed = [v for v in optimizer.variables if id(v) in a and id(v) not in b]
    assert len(missed) == (8 if name == "Adafactor" else 0)  # r and c of each of 4 variables
    assert all(v.name == a[id(v)].name for v in missed)  # "kernel", "bias": no path
    for slot, owner in ((v, a[id(v)]) for v in optimizer.variables if id(v) in a):
        assert slot.shape == owner.shape or name == "Adafactor", slot.path


def test_whether_keras_fit_would_build_a_model_first_is_read_alike_but_for_the_compiled_loss():
    """Keras's fit on JAX builds (reading a first batch) a model whose layers, compiled loss or
    compiled metrics are not built; the fallback does not see the compiled loss alone."""
    import keras
    private, public = forms("keras.Model._symbolic_build")
    x, y = np.zeros((4, 3), np.float32), np.zeros((4, 2), np.float32)
    for metrics in (["mae"], None):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", metrics=metrics)
        assert private(model) and public(model) is (metrics is not None)
        model.train_on_batch(x, y)
        assert not private(model) and not public(model)
    model = keras.Sequential([keras.layers.Dense(2)])
    assert private(model) and public(model)


# --- Whole runs, with the switch on and off (one process each) --------------------------------

RUN = r"""
import json, signal, sys
import numpy as np
import tensorflow as tf
import keras
import hostavg, hostavg.keras
from models import keras_model, v1

out, sizes = {}, [3, 7, 2]

def tf1(name, optimizer, **trainer_kw):
    # Reference variables (an embedding table, a weight), a resource bias, a moving mean that
    # the UPDATE_OPS assign in place: the rollback snapshot, the update ratios' before-values
    # and the learning rate all come through the wrapped APIs.
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        ids = v1.placeholder(tf.int32, [None], name="ids")
        y = v1.placeholder(tf.float32, [None], name="y")
        table = v1.Variable(rng.normal(size=(20, 4)).astype(np.float32), use_resource=False,
                            name="table")
        w = v1.Variable(rng.normal(size=4).astype(np.float32), use_resource=False, name="w")
        b = v1.Variable(np.float32(0.1), use_resource=True, name="b")
        ema = v1.Variable(np.float32(0), use_resource=False, trainable=False, name="ema")
        h = tf.tanh(tf.reduce_sum((x + tf.gather(table, ids)) * w, 1) + b)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign(ema, 0.5 * ema + tf.reduce_mean(h)))
        loss = tf.reduce_mean((h - y) ** 2)
        step = v1.train.get_or_create_global_step()
        trainer = hostavg.Trainer(loss, optimizer(step), update_ratios_every=1, **trainer_kw)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    data = np.random.default_rng(1)
    log = []
    for _ in range(3):
        feeds = [{x: data.normal(size=(n, 4)).astype(np.float32),
                  ids: data.integers(0, 20, n).astype(np.int32),
                  y: data.normal(size=n).astype(np.float32)} for n in sizes]
        res = trainer.step(sess, feeds)
        log.append([res.loss, res.learning_rate, sorted(res.update_ratios.items()), res.step,
                    [m.loss for m in res.micro]])
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    out[name] = {"log": log, "variables": {v.op.name: sess.run(v).tolist() for v in variables},
                 "rollback": [v.op.name for v in trainer.rollback_variables]}

tf1("adam-graph-caller", lambda step: v1.train.AdamOptimizer(0.05), average="graph",
    session_threads="caller")
tf1("sgd-schedule-host-pool", lambda step: v1.train.GradientDescentOptimizer(
    v1.train.exponential_decay(0.5, step, decay_steps=1, decay_rate=0.5)))

for sparse in (False, True):
    model = keras_model(sparse=sparse)
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.Adam(0.01))
    data = np.random.default_rng(2)
    n = sum(sizes)
    x = data.integers(0, 50, (n, 3)).astype(np.int32) if sparse else \
        data.normal(size=(n, 6)).astype(np.float32)
    y = data.integers(0, 3, n).astype(np.int32)
    log = []
    for _ in range(3):
        res = trainer.step(hostavg.split((x, y), 4))
        log.append([res.loss, res.step])
    log.append(trainer.evaluate(x, y, batch_size=5))
    out[f"keras-{'sparse' if sparse else 'dense'}"] = {
        "log": log, "variables": [v.numpy().tolist() for v in model.variables + trainer.optimizer.variables]}

assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back after each step
out["private_apis"] = list(hostavg.private_apis())
json.dump(out, sys.stdout, default=lambda o: np.asarray(o).tolist())  # NumPy scalars: exact
"""


def run(public_only: bool) -> dict:
    env = dict(ENV, **{PUBLIC_API_ONLY: "1" if public_only else "0"})
    done = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_tf1_and_keras_runs_are_bit_identical_with_public_apis_only():
    """Floats cross JSON as Python floats (repr: exact), so equal means bit for bit: weights,
    slots, losses, update ratios, learning rates, evaluation."""
    private, public = run(public_only=False), run(public_only=True)
    assert public.pop("private_apis") == []
    assert private.pop("private_apis") == sorted([*TENSORFLOW_APIS.values(), *PYTHON_APIS.values(),
                                                  *KERAS_APIS.values()])
    assert private.keys() == public.keys() == {"adam-graph-caller", "sgd-schedule-host-pool",
                                               "keras-dense", "keras-sparse"}
    for name in private:
        assert public[name] == private[name], name
    log = private["sgd-schedule-host-pool"]["log"]
    assert [entry[1] for entry in log] == [0.5, 0.25, 0.125]  # found either way
    assert private["adam-graph-caller"]["rollback"] == ["ema"]


# --- JAX ------------------------------------------------------------------------------------


def test_used_inputs_finds_what_a_loss_depends_on_and_its_fallback_says_everything():
    """The walk back over the jaxpr tells an unused input (whose JAX gradient is zeros) from a
    used one, also through a nested jit; the fallback counts every input as used."""
    import jax
    import jax.numpy as jnp

    inner = jax.jit(lambda a, b: a * b)

    def loss(w, unused, v, x):
        return (inner(w, x) + v.sum()).sum(), unused * 2  # unused reaches an output, not the loss

    traced = jax.make_jaxpr(loss)(jnp.ones(3), jnp.ones(2), jnp.ones(4), jnp.ones(3))
    private, public = forms(JAX_APIS["used_inputs"])
    assert private(traced) == (True, False, True, True)
    assert public(traced) == (True, True, True, True)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_finite_flags_finds_nan_and_inf_and_not_a_sum_that_overflows(dtype):
    """Against NumPy's isfinite: the quick sum of each value overflows for the finite ones of
    float max (which the exact look clears), and is Inf or NaN for each kind of non-finite."""
    top = float(dtype.max)
    cases = [[1.0, -2.0], [top, top], [-top, -top, 1.0], [np.nan, 1.0], [np.inf, 1.0],
             [-np.inf, 1.0], [np.inf, -np.inf], [top, np.inf]]
    for chosen in ([0, 1], [0, 2], [1, 2], [3], [0, 4], [5, 1], [6], [7, 0], list(range(8))):
        values = [tf.constant(np.array(cases[i], np.float64), dtype) for i in chosen]
        want = [bool(np.all(np.isfinite(np.array(cases[i])))) for i in chosen]
        got = hostavg.compat.tensorflow.finite_flags(values).numpy().tolist()
        assert got == want, (dtype, chosen)
