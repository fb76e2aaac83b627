"""Cases an outside review found where the host-side proof of an apply could have passed a
NaN or an Inf, each now refused or caught by the device-side check (never kept): clipping's
squares in float16, a variable's constraint, a schedule's rate after an undone apply, gradients
whose squares flush to 0, two trainers of the same variables. Keras on this process's backend
(CI runs the file on JAX too); the TF1 case where TensorFlow runs."""

import keras
import numpy as np
import pytest

import hostavg
import hostavg.keras

QUIET = {"watch_outliers": False, "diagnose": False}
ON_JAX = keras.backend.backend() == "jax"


def dense(dtype="float32", constraint=None):
    inputs = keras.Input((4,))
    out = keras.layers.Dense(1, use_bias=False, dtype=dtype, kernel_initializer="ones",
                             kernel_constraint=constraint)(inputs)
    return keras.Model(inputs, out)


def run(trainer, model, xs):
    """Steps of 8 rows of ``x`` each, targets -1e3: (each step's proven or the error it raised)."""
    seen = []
    for value in xs:
        x, y = np.full((8, 4), value, np.float32), np.full((8, 1), -1e3, np.float32)
        try:
            seen.append(trainer.step([(x, y)]).proven)
        except hostavg.StepError as error:
            seen.append(str(error))
        assert np.isfinite(model.trainable_variables[0].numpy()).all(), seen
    return seen


@pytest.mark.parametrize("clip", [{"global_clipnorm": 1.0}, {"clipnorm": 1000.0}])
def test_clipping_s_squares_in_float16_are_checked_too(clip):
    model = dense("float16")
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanAbsoluteError(),
                                    keras.optimizers.SGD(1e-4, **clip), **QUIET)
    seen = run(trainer, model, [1.0, 1.0, 300.0 if "global_clipnorm" in clip else 100.0])
    assert seen[:2] == [False, True]
    assert seen[2] is not True  # not proven: checked on the device (which undid it on TF)


def test_a_variable_with_a_constraint_is_never_proven():
    model = dense(constraint=lambda w: w * 8.0)
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanAbsoluteError(),
                                    keras.optimizers.SGD(1e-4), **QUIET)
    seen = run(trainer, model, [1.0] + [1e-30] * 44)
    assert all(s is False for s in seen[:40]) and "so it was undone" in seen[-1], seen


def test_after_an_undone_apply_a_schedule_s_rate_is_not_taken_from_it():
    """The schedule's rate is 1e30 until iteration 2: the apply there is undone, the iteration
    stays at 2, and the next apply's rate is 1e30 again (not 1e-6, the rate after 2)."""
    model = dense()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [1e30, 1e-6])
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanAbsoluteError(),
                                    keras.optimizers.SGD(schedule), **QUIET)
    seen = run(trainer, model, [1e-20, 1e-20, 1e10, 5e8])
    assert seen[:2] == [False, True] and all("so it was undone" in s for s in seen[2:]), seen


def test_gradients_whose_squares_flush_to_0_are_still_bounded():
    model = dense()
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanAbsoluteError(),
                                    keras.optimizers.SGD(1e30), **QUIET)
    run(trainer, model, [1e-20] * 3)
    proof, = trainer._engine._proofs.values()
    assert np.abs(model.trainable_variables[0].numpy()).max() <= proof.bounds["weight"]


@pytest.mark.skipif(ON_JAX, reason="a TF1 graph needs TensorFlow")
def test_two_trainers_of_the_same_variables_forget_each_other_s_bounds():
    import tensorflow as tf
    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float32, [None, 4])
        w = tf.Variable(np.ones((4, 1), np.float32))
        loss = tf.reduce_mean(tf.abs(tf.matmul(x, w) + 1e3))
        first = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(1e-3), **QUIET)
        second = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(1e6),
                                 increment_global_step=False, **QUIET)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    feed = [{x: np.ones((8, 4), np.float32)}]
    assert [first.step(sess, feed).proven for _ in range(2)] == [False, True]
    second.step(sess, feed)  # moves w by 1e6 times more, unseen by the first's bounds
    assert first.step(sess, feed).proven is False  # so it measures again
    proof, = first._engine._proofs.values()
    assert np.abs(sess.run(w)).max() <= proof.bounds["weight"]
