"""Freeze on every built-in optimizer: a frozen step equals the framework's own apply of the same
mean to the other variables alone (its optimizer's apply given only them, which touches no slot
of the frozen ones), bit for bit for the frozen variables and every optimizer variable of theirs;
an optimizer whose slots cannot be told apart is refused, naming it; Freeze's arguments. Keras
on the backend of this process (CI runs the file with KERAS_BACKEND=jax too, .ci/run); TF1
where that is TensorFlow.

The oracle: after an ordinary first step (the slots are no longer their initial values), every
variable is read; the frozen step runs; then every variable is put back as read and the
optimizer's own apply gets the step's applied mean of the other variables only.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hostavg
import hostavg.keras
from hostavg.compat import apis
from hostavg.hooks import Freeze

v1 = tf.compat.v1
ON_JAX = keras.backend.backend() == "jax"
O = keras.optimizers
#: Every built-in Keras optimizer, with the options that make more slots.
KERAS_OPTIMIZERS = {
    "sgd-momentum": lambda: O.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: O.Adam(0.01), "adam-amsgrad": lambda: O.Adam(0.01, amsgrad=True),
    "adamw": lambda: O.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: O.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: O.Adagrad(0.1), "adadelta": lambda: O.Adadelta(1.0),
    "adamax": lambda: O.Adamax(0.01), "nadam": lambda: O.Nadam(0.01), "ftrl": lambda: O.Ftrl(0.1),
    "lion": lambda: O.Lion(0.001), "adafactor": lambda: O.Adafactor(0.01),
    "lamb": lambda: O.Lamb(0.01), "muon": lambda: O.Muon(0.01),
    "loss-scale": lambda: O.LossScaleOptimizer(O.Adam(0.01)),
}
FROZEN = ("hidden/kernel", "hidden/bias")


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 3, 32).astype(np.int32)


def keras_trainer(optimizer, hooks):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return hostavg.keras.Trainer(model, loss, optimizer, hooks=hooks, watch_outliers=False,
                                 diagnose=False)


def every_variable(trainer) -> list:
    return list(trainer.model.variables) + list(trainer.optimizer.variables)


@pytest.mark.parametrize("name", KERAS_OPTIMIZERS)
def test_a_frozen_keras_step_is_the_optimizers_own_apply_of_the_others_alone(name):
    trainer = keras_trainer(KERAS_OPTIMIZERS[name](), [Freeze("hidden/*", steps={2})])
    trainer.step(hostavg.split(data(0), 8))
    variables = every_variable(trainer)
    before = [v.numpy() for v in variables]
    result = trainer.step(hostavg.split(data(1), 8))
    frozen = [v.numpy() for v in variables]
    for v, value in zip(variables, before):
        v.assign(value)
    others = [v for v in trainer.model.trainable_variables if v.path not in FROZEN]
    optimizer, scaler = trainer.optimizer, ()
    if ON_JAX and isinstance(optimizer, O.LossScaleOptimizer):  # its apply is stateless there
        optimizer, scaler = optimizer.inner_optimizer, (optimizer.step_counter,
                                                        optimizer.dynamic_scale)
    # (scaled as Keras's gradient of the scaled loss is: a LossScaleOptimizer unscales them)
    optimizer.apply([optimizer.scale_loss(result.grads[v.path]) for v in others], others)
    own = [v.numpy() for v in variables]
    assert int(trainer.optimizer.iterations.numpy()) == 2
    touched = 0
    for v, b, f, o in zip(variables, before, frozen, own):
        if any(v is s for s in scaler):  # (the inner optimizer's apply leaves the scale's)
            continue
        if np.array_equal(o, b):  # Keras's own apply of the others left it: so must Freeze
            assert np.array_equal(f, b), v.path
        else:
            touched += 1
            np.testing.assert_allclose(f, o, rtol=1e-5, atol=1e-7, err_msg=v.path)
    assert touched >= 3  # the other layer's kernel and bias, the iterations (and their slots)
    assert all(result.update_ratios is None or result.update_ratios[n] == 0 for n in FROZEN)


class Stateful(O.SGD):
    """An optimizer that keeps a slot per variable where no list aligned with its variables does,
    named after nothing: which variable it belongs to cannot be told."""

    def build(self, variables):
        super().build(variables)
        self._by_path = {v.path: self.add_variable(v.shape, name=f"mine{i}")
                         for i, v in enumerate(variables)}


def test_an_optimizer_whose_slots_cannot_be_told_apart_is_refused_naming_it_and_nothing_changes():
    trainer = keras_trainer(Stateful(0.1), [Freeze("hidden/*", steps={2})])
    trainer.step(hostavg.split(data(0), 8))
    before = [v.numpy() for v in every_variable(trainer)]
    with pytest.raises(hostavg.ArgumentError, match=r"^freezing 'hidden/kernel', 'hidden/bias': "
                       r"which trained variable the Stateful optimizer's variables "
                       r"'stateful/mine0' \(shape \(6, 8\)\), .*belong to cannot be told"):
        trainer.step(hostavg.split(data(1), 8))
    for value, v in zip(before, every_variable(trainer)):
        assert np.array_equal(v.numpy(), value), v.path


def test_by_names_alone_adafactors_factored_moments_are_refused(monkeypatch):
    """The public fallback goes by add_variable_from_reference's names, which Adafactor's
    factored moments (named after the variable's name only, "kernel") do not have."""
    public = apis()["keras.optimizers.Optimizer._trainable_variables"].public
    monkeypatch.setattr(hostavg.keras.common, "owners", public)
    trainer = keras_trainer(O.Adafactor(0.01), [Freeze("out/*")])
    with pytest.raises(hostavg.ArgumentError, match=r"the Adafactor optimizer's variables "
                       r"'adafactor\w*/kernel' \(shape \(6,\)\), "):
        trainer.step(hostavg.split(data(0), 8))
    adam = keras_trainer(O.Adam(0.01), [Freeze("out/*", steps={2})])
    adam.step(hostavg.split(data(0), 8))
    before = {v.path: v.numpy() for v in every_variable(adam)}
    adam.step(hostavg.split(data(1), 8))
    for v in every_variable(adam):
        if "out" in v.path:
            assert np.array_equal(v.numpy(), before[v.path]), v.path


TF1_OPTIMIZERS = {
    "momentum-nesterov": lambda: v1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "adam": lambda: v1.train.AdamOptimizer(0.01),
    "rmsprop-centered": lambda: v1.train.RMSPropOptimizer(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
    "adadelta": lambda: v1.train.AdadeltaOptimizer(1.0),
    "ftrl": lambda: v1.train.FtrlOptimizer(0.1),
    "proximal-adagrad": lambda: v1.train.ProximalAdagradOptimizer(0.1),
    "adagrad-da": lambda: v1.train.AdagradDAOptimizer(0.1, v1.train.get_or_create_global_step()),
}


@pytest.mark.skipif(ON_JAX, reason="TF1 runs where Keras's backend is TensorFlow")
@pytest.mark.parametrize("name", TF1_OPTIMIZERS)
def test_a_frozen_tf1_step_is_the_optimizers_own_apply_of_the_others_alone(name):
    graph = tf.Graph()
    with graph.as_default():
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int32, [None])
        rng = np.random.default_rng(0)
        weights = {n: tf.Variable(rng.normal(0, 0.5, s).astype(np.float32), name=n) for n, s in
                   (("hidden/kernel", (6, 8)), ("hidden/bias", (8,)), ("out/kernel", (8, 3)),
                    ("out/bias", (3,)))}
        logits = tf.tanh(x @ weights["hidden/kernel"] + weights["hidden/bias"]) \
            @ weights["out/kernel"] + weights["out/bias"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        optimizer = TF1_OPTIMIZERS[name]()
        trainer = hostavg.Trainer(loss, optimizer, hooks=[Freeze("hidden/*", steps={2})],
                                  watch_outliers=False, diagnose=False)
        others = [weights["out/kernel"], weights["out/bias"]]
        fed = [v1.placeholder(tf.float32, v.shape) for v in others]
        own = optimizer.apply_gradients(zip(fed, others), v1.train.get_global_step())
        variables = v1.global_variables()
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)

    def feeds(seed):
        xs, ys = data(seed)
        return hostavg.split({x: xs, y: ys}, 8)
    trainer.step(sess, feeds(0))
    before = sess.run(variables)
    result = trainer.step(sess, feeds(1))
    frozen = sess.run(variables)
    hostavg.tf1.variables.load_variables(sess, variables, before)
    sess.run(own, dict(zip(fed, [result.grads["out/kernel"], result.grads["out/bias"]])))
    touched = 0
    for v, b, f, o in zip(variables, before, frozen, sess.run(variables)):
        if np.array_equal(o, b):
            assert np.array_equal(f, b), v.op.name
        else:
            touched += 1
            np.testing.assert_allclose(f, o, rtol=1e-6, atol=1e-7, err_msg=v.op.name)
    assert touched >= 3 and len(trainer.spec) == 4


@pytest.mark.parametrize("variables,steps,said", [
    ([], None, r"^variables must be a name or pattern, or a non-empty list of them \(strings\), "
               r"got \[\]$"),
    ([1], None, r"^variables must be .* got \[1\]$"),
    ("a", 3, r"^steps must be None or a collection of global steps \(such as \{1, 2\} or "
             r"range\(10\)\), got 3$"),
    ("a", "12", r"^steps must be None or a collection .* got '12'$"),
    ("a", [1, -1], r"^each of steps must be an integer >= 0, got -1$"),
    ("a", [1.5], r"^each of steps must be an integer >= 0, got 1.5$"),
])
def test_freezes_arguments_are_checked_when_it_is_made(variables, steps, said):
    with pytest.raises(hostavg.ArgumentError, match=said):
        Freeze(variables, steps)


def test_freeze_names_what_its_patterns_match_at_its_steps_only():
    names = ("dense/kernel", "dense/bias", "out/kernel", "out/bias")
    hook = Freeze(["*/bias", "out/kernel"], steps=range(2, 4))
    assert hook.frozen(1, names) == () and hook.frozen(4, names) == ()
    assert hook.frozen(2, names) == hook.frozen(3, names) == ("dense/bias", "out/kernel",
                                                              "out/bias")
    assert Freeze("dense/kernel").frozen(7, names) == ("dense/kernel",)
    assert Freeze("Dense/*").steps is None  # (matching is case-sensitive: refused at a step)
    with pytest.raises(hostavg.ArgumentError, match=r"^Freeze: 'Dense/\*' matches no trained "):
        Freeze("Dense/*").frozen(1, names)
