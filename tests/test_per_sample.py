"""per_sample on Keras (the process's Keras backend) and TF1 beyond the contract: a convnet
with sample weights against each sample alone, the one-sample-per-call fallback's warning."""

import warnings

import keras
import numpy as np
import pytest

import hostavg
import hostavg.keras
from hostavg.cli import models

COLUMNS = ["loss", "norm", "cosine", "cosine_to_rest"]


def brute_force(trainer, x, y, w) -> np.ndarray:
    """(n, 4) of each sample computed alone (``trainer.compute``; a sparse gradient made dense),
    cosines in float64."""
    return table_of([trainer.compute(x[i:i + 1], y[i:i + 1], w[i:i + 1])
                     for i in range(len(x))], trainer.spec)


def table_of(alone: list, spec) -> np.ndarray:
    """(n, 4) loss, norm, cosine and cosine to the rest of the Gradients ``alone`` (one per
    sample), in float64; a sparse gradient made dense."""
    flat = np.array([np.concatenate([np.ravel(getattr(g[n], "to_dense", lambda: g[n])())
                                     for n in spec]) for g in alone], np.float64)
    mean, out = flat.mean(axis=0), []
    for i, (g, f) in enumerate(zip(alone, flat)):
        rest, norm = np.delete(flat, i, axis=0).mean(axis=0), np.linalg.norm(f)
        out.append([g.loss, norm, f @ mean / (norm * np.linalg.norm(mean)),
                    f @ rest / (norm * np.linalg.norm(rest))])
    return np.array(out)


def test_keras_convnet_with_sample_weights_in_chunks_is_each_sample_alone():
    model = models.keras_convnet(8, [3], 4, seed=1)
    trainer = hostavg.keras.Trainer(model, models.keras_loss(), keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(2)
    x = rng.random((11, 64), dtype=np.float32)
    y = rng.integers(0, 4, 11).astype(np.int32)
    w = rng.uniform(0.2, 3.0, 11).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # vectorized: no fallback
        table = trainer.per_sample(x, y, w, chunk_size=4)
    want = brute_force(trainer, x, y, w)
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(want[:, 0], brute_force(trainer, x, y, np.ones_like(w))[:, 0])


def test_a_gradient_whose_squares_overflow_float32_has_its_finite_norm_and_cosines():
    """A sample weighted 1e20: its gradient's entries are finite float32 (about 1e20), their
    squares and its dot with the mean are not. Its norm is its gradient's float64 norm and
    its cosine and the others' the brute force's, in one chunk as alone: the vectorized sums
    and dots do not overflow where the gradient does not. Its cosine to the rest is NaN, not
    a number made of rounding."""
    model = models.keras_convnet(8, [3], 4, seed=1)
    trainer = hostavg.keras.Trainer(model, models.keras_loss(), keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(3)
    x = rng.random((6, 64), dtype=np.float32)
    y = rng.integers(0, 4, 6).astype(np.int32)
    w = np.ones(6, np.float32)
    w[2] = 1e20
    want = brute_force(trainer, x, y, w)
    assert np.all(np.isfinite(want)) and want[2, 1] > 1e19
    # the others sum to about 1e-20 of its gradient: rounding, for any dot in floating point
    want[2, 3] = np.nan
    for chunk_size in (1, 6):
        table = trainer.per_sample(x, y, w, chunk_size=chunk_size)
        assert table["error"].isna().all()
        np.testing.assert_allclose(table[COLUMNS].to_numpy(float), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1, 10, 30, 1000])
def test_one_sample_standing_out_has_its_cosine_to_the_rest_to_1e6(scale):
    """One sample's inputs ``scale`` times the others': the cosine to the rest subtracts
    numbers about scale^2 times its value, so float32 rounding in the vectorized sums and dots
    would be multiplied by that; such a batch is computed again from each sample alone (a
    review found 5e-5 off at 10x and NaN at 30x where the value is 0.44). At 1000x the others
    are below float64's rounding of the whole (REST_EPS): NaN, not a number."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanSquaredError(),
                                    keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    x[2] *= scale
    w = np.ones(8, np.float32)
    want = brute_force(trainer, x, y, w)
    assert np.isfinite(want).all()
    if scale == 1000:
        want[2, 3] = np.nan
    for chunk_size in (3, 8):
        table = trainer.per_sample(x, y, w, chunk_size=chunk_size)
        np.testing.assert_allclose(table[COLUMNS].to_numpy(float), want, rtol=1e-6, atol=1e-6)


def test_a_model_with_its_own_train_step_computes_alone_and_says_why_once():
    class Own(keras.Sequential):
        def train_step(self, *args):  # (data) on TensorFlow, (state, data) on JAX
            return super().train_step(*args)

    model = Own([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(loss=models.keras_loss(), optimizer=keras.optimizers.SGD(0.1))
    trainer = hostavg.keras.Trainer(model)
    x, y = np.ones((5, 3), np.float32), np.array([0, 1, 0, 1, 1], np.int32)
    with pytest.warns(UserWarning, match="trains by its own train_step") as said:
        table = trainer.per_sample(x, y, chunk_size=2)
    assert len([w for w in said if "per_sample" in str(w.message)]) == 1
    assert table["error"].isna().all() and table["loss"].notna().all()


def test_tf1_vectorizes_a_plain_graph_without_a_warning():
    """A plain TF1 graph's samples compute many per call (hostavg.tf1.samples): no warning,
    notebooks stay quiet (tests/test_tf1_samples.py has the rest)."""
    import warnings

    import tensorflow as tf
    m = models.mlp(4, [3], 2, seed=0)
    with m.graph.as_default():
        trainer = hostavg.Trainer(m.loss, tf.compat.v1.train.GradientDescentOptimizer(0.1))
        sess = tf.compat.v1.Session(graph=m.graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    feed = {m.x: np.ones((5, 4), np.float32), m.y: np.array([0, 1, 0, 1, 1], np.int32)}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        table = trainer.per_sample(sess, feed, chunk_size=2)
    assert not [str(w.message) for w in said if "computes each sample alone" in str(w.message)]
    assert table["error"].isna().all() and len(table) == 5


def test_tf1_a_sample_standing_out_has_its_cosine_to_the_rest_to_1e6():
    """The TF1 twin of the Keras case above: each sample alone, its squared norm and dot in
    float64, so one sample 10 times the others' inputs has the brute force's cosine to the
    rest (its float32 norm would be off by 1e-7 times the 3,000 the cosine magnifies)."""
    import tensorflow as tf
    v1 = tf.compat.v1
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        x, y = v1.placeholder(tf.float32, [None, 16]), v1.placeholder(tf.float32, [None, 1])
        w1 = tf.Variable(rng.normal(0, 0.3, (16, 32)).astype(np.float32))
        w2 = tf.Variable(rng.normal(0, 0.3, (32, 1)).astype(np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    xs = rng.normal(size=(8, 16)).astype(np.float32)
    ys = rng.normal(size=(8, 1)).astype(np.float32)
    xs[2] *= 10
    alone = [trainer.compute(sess, {x: xs[i:i + 1], y: ys[i:i + 1]}) for i in range(8)]
    G = np.array([np.concatenate([np.ravel(g[n]) for n in trainer.spec]) for g in alone],
                 np.float64)
    rest = np.delete(G, 2, axis=0).mean(axis=0)
    want = G[2] @ rest / (np.linalg.norm(G[2]) * np.linalg.norm(rest))
    table = trainer.per_sample(sess, {x: xs, y: ys}, chunk_size=3)
    assert table["cosine_to_rest"][2] == pytest.approx(want, rel=1e-6, abs=1e-6)
    np.testing.assert_allclose(table["norm"], np.linalg.norm(G, axis=1), rtol=1e-12)
