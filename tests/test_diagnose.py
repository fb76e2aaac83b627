"""Diagnose on every face, on scikit-learn's digits: a learning rate far too high is
"update_too_large", a ReLU layer started at bias -10 is "dead" (the variables it starves), an
8-layer sigmoid MLP is "vanishing" (its lower kernels first), gradients scaled up for good are
"exploding", and healthy runs reach no verdict. TF1 and Keras on TensorFlow here; Keras on JAX
in CI's KERAS_BACKEND=jax step (.ci/run)."""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import hostavg
import hostavg.keras
from hostavg.hooks import Diagnose, DiagnosisWarning

v1 = tf.compat.v1
ON_JAX = keras.backend.backend() == "jax"
BATCH, MICRO = 128, 16


def digits():
    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def widths(depth):
    return [64] + [32] * depth + [10]


class TF1:
    """An MLP of ``depth`` hidden layers of 32 with Adam at ``lr``, as a TF1 graph; its layers
    named d0, d1, ..., out, as the Keras twin's."""

    def __init__(self, depth=1, activation="relu", bias=0.0, lr=1e-2, **kw):
        self.graph = tf.Graph()
        rng = np.random.default_rng(1)
        act = {"relu": tf.nn.relu, "sigmoid": tf.sigmoid}[activation]
        with self.graph.as_default():
            self.x = v1.placeholder(tf.float32, [None, 64], name="x")
            self.y = v1.placeholder(tf.int32, [None], name="y")
            h, sizes = self.x, widths(depth)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                name = "out" if i == depth else f"d{i}"
                with tf.name_scope(name):
                    w = tf.Variable(rng.normal(0, (2 / (a + b)) ** 0.5, (a, b)).astype(np.float32),
                                    name="kernel")
                    c = tf.Variable(np.full(b, 0.0 if i == depth else bias, np.float32),
                                    name="bias")
                h = tf.matmul(h, w) + c
                if i < depth:
                    h = act(h)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.y, logits=h))
            self.trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(lr), **kw)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.graph)
        self.sess.run(init)

    def fit(self, x, y, **kw):
        return self.trainer.fit(self.sess, {self.x: x, self.y: y}, **kw)

    def step(self, x, y):
        return self.trainer.step(self.sess, hostavg.split({self.x: x, self.y: y}, MICRO))


class Keras:
    """The same MLP in Keras."""

    def __init__(self, depth=1, activation="relu", bias=0.0, lr=1e-2, **kw):
        keras.utils.set_random_seed(1)
        h = inputs = keras.Input((64,))
        for i in range(depth):
            h = keras.layers.Dense(32, activation=activation, name=f"d{i}",
                                   bias_initializer=keras.initializers.Constant(bias))(h)
        self.model = keras.Model(inputs, keras.layers.Dense(10, name="out")(h))
        self.trainer = hostavg.keras.Trainer(
            self.model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(lr), **kw)

    def fit(self, x, y, **kw):
        return self.trainer.fit(x, y, **kw)

    def step(self, x, y):
        return self.trainer.step(hostavg.split((x, y), MICRO))


FACES = {"keras": Keras} if ON_JAX else {"tf1": TF1, "keras": Keras}
faces = pytest.mark.parametrize("face", FACES.values(), ids=FACES.keys())


def fit(face, epochs=4, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = face(**kw).fit(*digits(), batch_size=BATCH, micro_batch_size=MICRO,
                                 epochs=epochs, seed=0, progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, DiagnosisWarning)]
    table = history.diagnoses()
    assert list(table.columns) == ["step", "kind", "variables", "evidence", "advice"]
    assert len(said) == len(table)  # one warning per verdict reached
    for message, (_, row) in zip(said, table.iterrows()):
        assert message.startswith(f"step {row.step}: {row.kind}") and row.evidence in message
    return history, table


def names(table, kind) -> list:
    return [n for names in table[table.kind == kind].variables for n in names]


@faces
def test_a_learning_rate_far_too_high_is_update_too_large_then_dead(face):
    _, table = fit(face, lr=1.0)
    first = table.iloc[0]
    assert first.kind == "update_too_large" and first.step <= 3, table
    # the kernels (nearly every parameter), the biases with them at this rate
    assert sum("kernel" in n for n in first.variables) == 2, table
    assert "lower the learning rate" in first.advice


@faces
def test_a_relu_layer_started_below_zero_is_dead_and_the_output_bias_lives(face):
    _, table = fit(face, epochs=2, bias=-10.0)
    assert list(table.kind) == ["dead"], table
    assert table.iloc[0].step == 20  # 20 steps in a row of gradients exactly 0
    dead = table.iloc[0].variables
    assert sorted(n.split(":")[0] for n in dead) == ["d0/bias", "d0/kernel", "out/kernel"], dead


@faces
def test_a_deep_sigmoid_stack_is_vanishing_from_its_input_side(face):
    _, table = fit(face, epochs=2, depth=8, activation="sigmoid", lr=1e-3)
    assert set(table.kind) == {"vanishing"}, table
    vanishing = names(table, "vanishing")
    assert vanishing[0].startswith("d0/kernel") and any(n.startswith("d1/kernel") for n in vanishing)
    assert not any(n.startswith(("d7", "out")) for n in vanishing), vanishing


@faces
def test_gradients_scaled_up_for_good_are_exploding_once(face):
    case = face()
    x, y = digits()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [case.step(x[i * BATCH:(i + 1) * BATCH] * (1 if i < 10 else 1e4),
                             y[i * BATCH:(i + 1) * BATCH]) for i in range(14)]
    verdicts = [(r.step, d["kind"]) for r in results for d in r.info.get("diagnoses", ())]
    assert ("exploding", 13) in [(kind, step) for step, kind in verdicts], verdicts  # 11, 12, 13
    assert [kind for _, kind in verdicts].count("exploding") == 1
    assert sum(issubclass(w.category, DiagnosisWarning) for w in caught) == len(verdicts)


@faces
def test_healthy_runs_reach_no_verdict_and_off_means_off(face):
    for lr in (1e-2, 1e-3):
        history, table = fit(face, epochs=20, lr=lr)
        assert table.empty, table
        assert history.to_pandas().loss.iloc[-1] < history.steps[0].loss
    again = hostavg.History.from_json(history.to_json())
    assert again.diagnoses().equals(table)
    assert not any(isinstance(h, Diagnose) for h in face(diagnose=False).trainer.hooks)
    with pytest.raises(hostavg.ArgumentError) as raised:
        face(diagnose="no")
    assert "diagnose" in str(raised.value) and "'no'" in str(raised.value)


@faces
def test_verdicts_survive_a_history_read_back(face):
    history, table = fit(face, epochs=2, bias=-10.0)
    again = hostavg.History.from_json(history.to_json()).diagnoses()
    assert list(again.kind) == list(table.kind) and list(again.step) == list(table.step)
    assert [tuple(v) for v in again.variables] == [tuple(v) for v in table.variables]


@pytest.mark.skipif(ON_JAX, reason="a TF1 graph")
def test_a_large_embedding_whose_gradient_touches_a_few_rows_is_not_vanishing():
    """A sparse gradient's norm is of the rows it touches, the table's of all of them: the
    bench's embedding model (50,000 rows of 64) sat 1e4 below its output bias."""
    from hostavg.cli import models
    model = models.embedding(50_000, 64, 16, 10)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(1e-3))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            ids = rng.integers(0, 50_000, (64, 16)).astype(np.int32)
            labels = rng.integers(0, 10, 64).astype(np.int32)
            result = trainer.step(sess, hostavg.split({model.x: ids, model.y: labels}, 32))
    assert result.step == 30
    assert not [str(w.message) for w in caught if issubclass(w.category, DiagnosisWarning)]


def _applied(step, ratios, norms, grads):
    """What Diagnose reads of an applied step: update ratios (None: not measured), the weights'
    norms, and each variable's gradient norm (one micro-batch, a dense gradient of 4)."""
    from types import SimpleNamespace
    return SimpleNamespace(step=step, info={}, update_ratios=ratios, weight_norms=norms,
                           grads={n: np.zeros(4, np.float32) for n in grads},
                           stats=SimpleNamespace(variable_norms=grads, grad_norm=1.0,
                                                 micro_variable_norms=None))


@pytest.mark.parametrize("head", [False, True])
def test_weights_that_started_at_zero_are_no_reference_for_vanishing(head):
    """A bias that started at 0 (its first update ratio inf) has weights of norm 1e-6 and so a
    |gradient| / |weights| of 100, 1e7 above a kernel's 1e-5: small weights by their start, not
    a gradient that vanished elsewhere; that kernel against a head kernel at 1 is vanishing."""
    diagnose, grads = Diagnose(), {"kernel": 1e-5, "bias": 1e-4, **({"head": 1.0} if head else {})}
    norms = {"kernel": 1.0, "bias": 1e-6, **({"head": 1.0} if head else {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 31):
            ratios = {n: (math.inf if n == "bias" and step == 1 else 1e-3) for n in grads}
            diagnose.on_applied(_applied(step, ratios, norms, grads))
    said = [str(w.message) for w in caught if issubclass(w.category, DiagnosisWarning)]
    if head:
        assert len(said) == 1 and said[0].startswith("step 20: vanishing (kernel)")
        assert "below head's 1" in said[0]
    else:
        assert not said
