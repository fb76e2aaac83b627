"""Small graph-mode models (and their Keras twin), the full-batch oracle the tests compare
hostavg against, the environment of the Python processes tests start, and the helpers several
test files share (a linear TF1 model, fit's small MLP, files with a bit flipped)."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models as hostavg_models  # noqa: E402
from hostavg.hooks import Record  # noqa: E402
from hostavg.train.checkpoint import CheckpointDir  # noqa: E402

v1 = tf.compat.v1

#: For Python processes a test starts: this checkout's hostavg before any installed one (a
#: script's own folder comes first on its path, not the current one), and these helpers.
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join(
    [str(Path(__file__).parents[1]), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))

#: The learning rates of the optimizers every exactness test runs: they move the
#: weights visibly in 20 steps.
LEARNING_RATES = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01, "rmsprop": 0.01, "adagrad": 0.1,
                  "adamw": 0.01}

#: Those optimizers in TF1.
OPTIMIZERS = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(LEARNING_RATES["sgd"]),
    "momentum": lambda: v1.train.MomentumOptimizer(LEARNING_RATES["momentum"], momentum=0.9),
    "adam": lambda: v1.train.AdamOptimizer(LEARNING_RATES["adam"]),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(LEARNING_RATES["rmsprop"]),
    "adagrad": lambda: v1.train.AdagradOptimizer(LEARNING_RATES["adagrad"]),
}

FEATURES, HIDDEN, CLASSES, VOCAB = 6, 8, 3, 50
#: The samples of a step that the step tests cut into micro-batches.
BATCH = 40


@dataclass
class Model:
    graph: tf.Graph
    inputs: dict  # name -> placeholder
    loss: tf.Tensor
    counter: tf.Variable  # forward passes run
    extra: dict = field(default_factory=dict)

    def feed(self, data: dict) -> dict:
        return {self.inputs[k]: v for k, v in data.items()}

    def values(self, sess) -> dict:
        """Every global variable by name: weights, optimizer slots, global step."""
        return graph_values(self.graph, sess)


def graph_values(graph, sess) -> dict:
    """Every global variable of ``graph`` by name, read in ``sess``: weights, slots, step."""
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


class AfterApply(v1.Session):
    """A real session that calls ``then(n)`` as its n-th apply returns (the apply: the compiled
    call fed the gradients), in Python, as a signal's handler would run there."""

    def __init__(self, then, **kwargs):
        super().__init__(**kwargs)
        self.then, self.applies = then, 0

    def _make_callable_from_options(self, options):
        run = super()._make_callable_from_options(options)
        if not any(name.startswith("gradients") for name in options.feed):
            return run

        def apply(*args, **kwargs):
            out = run(*args, **kwargs)
            self.applies += 1
            self.then(self.applies)
            return out
        return apply


def initial_weights(seed: int, dtype, sparse: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    w = {"hidden/kernel": rng.normal(0, 0.5, (FEATURES, HIDDEN)),
         "hidden/bias": rng.normal(0, 0.1, (HIDDEN,)),
         "out/kernel": rng.normal(0, 0.5, (HIDDEN, CLASSES)),
         "out/bias": np.zeros(CLASSES)}
    if sparse:
        w["embedding"] = rng.normal(0, 0.5, (VOCAB, FEATURES))
    return {k: v.astype(dtype) for k, v in w.items()}


def build(seed: int = 0, dtype=np.float32, sparse: bool = False, unused: bool = False,
          update_op: bool = False, scalar: bool = False, dropout: float = 0.0) -> Model:
    """An MLP with softmax cross-entropy; with ``sparse`` its input is the mean of
    embedding rows looked up by integer ids (an IndexedSlices gradient); with
    ``scalar`` its logits are scaled by a trained 0-d variable; with ``dropout``
    the hidden activations are dropped at that rate (always: a training graph)."""
    graph = tf.Graph()
    tf_dtype = tf.as_dtype(dtype)
    with graph.as_default():
        weights = {name: tf.Variable(value, name=name)
                   for name, value in initial_weights(seed, dtype, sparse).items()}
        counter = tf.Variable(0, trainable=False, name="forward_passes")
        y = v1.placeholder(tf.int32, [None], name="y")
        if sparse:
            ids = v1.placeholder(tf.int32, [None, 3], name="ids")
            x = tf.reduce_mean(tf.nn.embedding_lookup(weights["embedding"], ids), axis=1)
            inputs = {"ids": ids, "y": y}
        else:
            x = v1.placeholder(tf_dtype, [None, FEATURES], name="x")
            inputs = {"x": x, "y": y}
        with tf.control_dependencies([counter.assign_add(1)]):
            h = tf.tanh(tf.matmul(x, weights["hidden/kernel"]) + weights["hidden/bias"])
        if dropout:
            h = tf.nn.dropout(h, rate=dropout)
        logits = tf.matmul(h, weights["out/kernel"]) + weights["out/bias"]
        if scalar:
            logits = logits * tf.Variable(np.asarray(1.5, dtype), name="temperature")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        extra = {}
        if unused:
            extra["unused"] = tf.Variable(np.ones(4, dtype), name="unused")
        if update_op:
            # A moving mean of the hidden activations, updated like batch norm's.
            ema = extra["ema"] = tf.Variable(np.zeros(HIDDEN, dtype), trainable=False, name="ema")
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS,
                                 ema.assign(0.5 * ema + 0.5 * tf.reduce_mean(h, 0)))
    return Model(graph, inputs, loss, counter, extra)


def batches(seed: int, steps: int, n: int, dtype=np.float32, sparse: bool = False) -> list:
    rng = np.random.default_rng(seed + 1000)
    out = []
    for _ in range(steps):
        if sparse:
            data = {"ids": rng.integers(0, VOCAB, (n, 3)).astype(np.int32)}
        else:
            data = {"x": rng.normal(0, 1, (n, FEATURES)).astype(dtype)}
        data["y"] = rng.integers(0, CLASSES, n).astype(np.int32)
        out.append(data)
    return out


def probed(loss) -> tuple:
    """``loss`` plus a zero that notes, each time the graph computes it, the thread that ran it:
    (the new loss, the list of thread idents it fills)."""
    ran_in = []

    def probe():
        ran_in.append(threading.get_ident())
        return np.float32(0)

    seen = tf.reshape(v1.py_func(probe, [], tf.float32, stateful=True), [])
    return loss + tf.stop_gradient(seen), ran_in


def make_optimizer(optimizer):
    """An optimizer from a name in OPTIMIZERS, or from a function that makes one."""
    return OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer()


def full_batch(optimizer, data: list, update_sizes=None, untrained=(), **kw) -> dict:
    """The oracle: plain ``optimizer.minimize`` on each whole batch. Returns every variable.

    ``optimizer``: a name in OPTIMIZERS, or a function that makes one.
    ``update_sizes``: micro-batch sizes; before each step the graph's UPDATE_OPS
    run once per micro-batch of these sizes, in order, as a trainer runs them.
    ``untrained``: names of variables left out of the minimize (and so without slots).
    """
    model = build(**kw)
    with model.graph.as_default():
        var_list = [v for v in v1.trainable_variables() if v.op.name not in untrained]
        train = make_optimizer(optimizer).minimize(
            model.loss, global_step=v1.train.get_or_create_global_step(), var_list=var_list)
        updates = v1.get_collection(v1.GraphKeys.UPDATE_OPS) if update_sizes else []
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        for d in data:
            for part in cuts(len(d["y"]), update_sizes) if updates else ():
                sess.run(updates, model.feed({k: v[part] for k, v in d.items()}))
            sess.run(train, model.feed(d))
        return model.values(sess)


def cuts(n: int, sizes) -> list:
    """Slices of [0, n) of the given sizes."""
    bounds = np.cumsum([0] + list(sizes))
    assert bounds[-1] == n
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def keras_optimizer(name: str, **kw):
    """The Keras 3 optimizer of the kind and learning rate of ``OPTIMIZERS[name]`` (each
    framework keeps its own defaults, such as epsilon); ``kw``: more arguments."""
    import keras
    lr, kinds = LEARNING_RATES[name], keras.optimizers
    return {"sgd": lambda: kinds.SGD(lr, **kw),
            "momentum": lambda: kinds.SGD(lr, momentum=0.9, **kw),
            "adam": lambda: kinds.Adam(lr, **kw),
            "rmsprop": lambda: kinds.RMSprop(lr, **kw),
            "adagrad": lambda: kinds.Adagrad(lr, **kw),
            "adamw": lambda: kinds.AdamW(lr, weight_decay=0.1, **kw)}[name]()


def keras_model(seed=0, sparse=False, batch_norm=False, dropout=False, regularizer=None,
                frozen=False, names=True):
    """:func:`build`'s MLP as a Keras functional model, from the same initial weights.

    Optionally with batch norm after the hidden layer, dropout, a kernel
    regularizer, or a frozen Dense backbone in front. Layers are named
    (hidden, out, embedding, bn, backbone) unless ``names`` is False.
    """
    import keras
    keras.utils.set_random_seed(seed)
    name = (lambda n: n) if names else (lambda n: None)
    if sparse:
        ids = keras.Input((3,), dtype="int32")
        inputs, h = ids, keras.layers.GlobalAveragePooling1D()(
            keras.layers.Embedding(VOCAB, FEATURES, name=name("embedding"))(ids))
    else:
        inputs = h = keras.Input((FEATURES,))
    if frozen:
        backbone = keras.layers.Dense(FEATURES, name=name("backbone"), trainable=False)
        h = backbone(h)
    hidden = keras.layers.Dense(HIDDEN, activation="tanh", name=name("hidden"),
                                kernel_regularizer=regularizer)
    h = hidden(h)
    if batch_norm:
        h = keras.layers.BatchNormalization(name=name("bn"))(h)
    if dropout:
        h = keras.layers.Dropout(0.25)(h)
    out = keras.layers.Dense(CLASSES, name=name("out"))
    model = keras.Model(inputs, out(h))
    w = initial_weights(seed, np.float32, sparse)
    hidden.set_weights([w["hidden/kernel"], w["hidden/bias"]])
    out.set_weights([w["out/kernel"], w["out/bias"]])
    if sparse:
        model.get_layer(name("embedding") or model.layers[1].name).set_weights([w["embedding"]])
    return model


class FetchSpy(v1.Session):
    """A real session that notes the fetches of every compiled call it runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetched = []

    def _make_callable_from_options(self, options):
        run = super()._make_callable_from_options(options)
        fetch = list(options.fetch)

        def spy(*args, **kwargs):
            self.fetched.append(fetch)
            return run(*args, **kwargs)
        return spy


class AfterStep:
    """A fit callback whose ``after(step)`` runs after each step fit counted, once the step is in
    the History and checkpointed: ``on_applied`` notes the global step, ``on_batch_end`` calls."""

    applied = None

    def on_applied(self, result):
        self.applied = result.step

    def on_batch_end(self, batch, logs):
        self.after(self.applied)


class FailAt(AfterStep):
    """A fit callback that raises RuntimeError("stopped on purpose") after global step ``step``."""

    def __init__(self, step):
        self.step = step

    def after(self, step):
        if step == self.step:
            raise RuntimeError("stopped on purpose")


def poisoned(case, index: int) -> list:
    """``case.feeds`` (micro-batches of a dense model) with one NaN input in micro-batch ``index``."""
    x = case.model.inputs["x"]
    feeds = [dict(f) for f in case.feeds]
    feeds[index][x] = feeds[index][x].copy()
    feeds[index][x][0, 0] = np.nan
    return feeds


def linear(dtype=np.float32, lr=1.0, hooks=(), accum_dtype=None, lr_placeholder=None):
    """loss = mean over samples of w . x, so w's gradient is the mean of x: a test picks it.

    ``lr_placeholder``: "required" or "default" makes the learning rate a placeholder.
    """
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(dtype, [None, 4], name="x")
        w = tf.Variable(np.zeros(4, dtype), name="w")
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        if lr_placeholder == "required":
            lr = v1.placeholder(tf.float32, (), name="lr")
        elif lr_placeholder == "default":
            lr = v1.placeholder_with_default(np.float32(lr), (), name="lr")
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(lr), hooks=hooks,
                                  accum_dtype=accum_dtype)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    return trainer, sess, x, w, lr


def rows(x, value, n=2, dtype=np.float32):
    return {x: np.full((n, 4), value, dtype)}


def fit_setup(then=None):
    """A small MLP's trainer, session (an AfterApply calling ``then``, if given) and data."""
    model = hostavg_models.mlp(10, [16], 3, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    sess = AfterApply(then, graph=model.graph) if then else v1.Session(graph=model.graph)
    sess.run(init)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(250, 10)).astype(np.float32)
    return trainer, sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}


def variables(trainer, sess):
    names = trainer.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in names], sess.run(names)))


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


FIT = dict(batch_size=50, micro_batch_size=20, epochs=2, seed=3, progress=False)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def micro_feeds(model, data: dict, sizes) -> list:
    return [model.feed({k: v[part] for k, v in data.items()})
            for part in cuts(len(data["y"]), sizes)]


def repeating_batches(seed: int, steps: int, n: int = BATCH, window: int = 12) -> list:
    """Embedding batches whose ids come from ``window`` tokens that move each step: every
    micro-batch repeats tokens (twice, three times and more), and most rows of the table are
    absent from each step (where a lazy sparse update and a dense one part ways)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        start = (step * 13) % (VOCAB - window)
        out.append({"ids": rng.integers(start, start + window, (n, 3)).astype(np.int32),
                    "y": rng.integers(0, CLASSES, n).astype(np.int32)})
    return out


def sgd():
    return v1.train.GradientDescentOptimizer(0.1)


def recorded_step(model, feed, path, **trainer_kw) -> None:
    """One step over ``feed`` (micro-batches of 10) of a new SGD trainer of ``model``'s graph
    (made with ``trainer_kw``), written by a :class:`~hostavg.hooks.Record` to ``path``, in a
    session of its own."""
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, sgd(), hooks=[Record(path)], **trainer_kw)
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        trainer.step(sess, hostavg.split(feed, 10))


@pytest.fixture(scope="module")
def tf1():
    """A dense model, its trainer, an initialised session and a batch of 20 samples."""
    model = build()
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, sgd())
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess, model.feed(batches(0, 1, 20)[0])


FLIPS = 600  # per file, besides every bit of one entry's zip headers (see flips)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(a checkpoint fit wrote, a record step with sparse and dense micro-batch gradients)."""
    folder = tmp_path_factory.mktemp("written")
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01),
                                  hooks=[Record(folder / "rec", micro=True)])
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        data = batches(0, 1, 24, sparse=True)[0]
        trainer.fit(sess, model.feed(data), batch_size=24, micro_batch_size=8, epochs=1,
                    progress=False, checkpoint_dir=folder / "ckpt", seed=3)
    return CheckpointDir(folder / "ckpt").latest(), folder / "rec" / "step-0000000001.npz"


def flips(data: bytes, seed: int):
    """Bit positions to flip: a seeded sample of the file, and every bit of the zip structure of
    its first entry (local header, central directory entry) and of its end record, where one
    flip turns into the most kinds of exception."""
    rng = np.random.default_rng(seed)
    sample = set(rng.choice(8 * len(data), size=min(FLIPS, 8 * len(data)), replace=False).tolist())
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        first, central = z.infolist()[0].header_offset, z.start_dir
    # A local header: 30 bytes, then the name and the extra field, their lengths at 26 and 28;
    # a central directory entry: 46 bytes, then the name, extra field and comment (28, 30, 32).
    spans = [(first, 30 + sum(struct.unpack("<HH", data[first + 26:first + 30]))),
             (central, 46 + sum(struct.unpack("<HHH", data[central + 28:central + 34]))),
             (len(data) - 22, 22)]  # the end of central directory record
    structure = {8 * start + b for start, length in spans for b in range(8 * length)}
    return sorted(sample | structure)


def flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def each_flip(good: bytes, path, read, seed):
    """Flips each chosen bit of ``good`` into ``path`` and reads it: (bits refused, bits that
    loaded exactly, bits that escaped as another exception or loaded other values)."""
    want = read(path)
    refused, exact, wrong = 0, 0, []
    for bit in flips(good, seed):
        path.write_bytes(flipped(good, bit))
        try:
            got = read(path)
        except hostavg.HostavgError as e:
            if str(path) not in str(e):
                wrong.append((bit, f"HostavgError not naming the file: {e}"))
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001 - what the test looks for
            wrong.append((bit, f"{type(e).__name__}: {e}"))
            continue
        if got != want:
            wrong.append((bit, "loaded other values"))
        else:
            exact += 1
    path.write_bytes(good)
    return refused, exact, wrong
