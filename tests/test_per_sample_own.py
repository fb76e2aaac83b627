"""per_sample of a batch of one chunk in one call (hostavg.engine.samples): each gradient is
dotted with the samples' own sum (divided by its largest entry) in the call that forms it,
so no second pass runs where those dots cover every finite sample and the host can bound
their rounding; a loss that is no mean over its samples changes nothing of it, and tiny
gradients (whose squares XLA flushes to 0 on a CPU) compute alone, to the brute force's
values either way."""

import keras
import numpy as np
import pytest

import hostavg
import hostavg.keras
from hostavg.cli import models
from hostavg.engine import samples
from test_per_sample import COLUMNS, brute_force, table_of


def _trainer():
    return hostavg.keras.Trainer(models.keras_mlp(12, [16], 3, seed=1), models.keras_loss(),
                                 keras.optimizers.SGD(0.1))


def _batch():
    rng = np.random.default_rng(5)
    return (rng.normal(size=(40, 12)).astype(np.float32),
            rng.integers(0, 3, 40).astype(np.int32), np.ones(40, np.float32))


@pytest.mark.parametrize("chunk_size", [16, 40])
def test_a_summed_loss_is_each_sample_alone_in_one_call_or_two_passes(chunk_size, monkeypatch):
    """TF1 (the Keras face refuses a summed loss, whose batch gradient is 40 times the
    samples' mean): one chunk dots with the samples' own sum, chunks of 16 after, with M."""
    import tensorflow as tf

    from hostavg.tf1.session import SessionBackend
    v1 = tf.compat.v1
    m = models.mlp(12, [16], 3, seed=1)
    with m.graph.as_default():
        summed = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=m.y,
                                                                             logits=m.logits))
        trainer = hostavg.Trainer(summed, v1.train.GradientDescentOptimizer(0.1))
        sess = v1.Session(graph=m.graph)
        sess.run(v1.global_variables_initializer())
    x, y, _ = _batch()
    dotted, dots = [], SessionBackend.sample_dots
    monkeypatch.setattr(SessionBackend, "sample_dots", lambda *a: dotted.append(1) or dots(*a))
    table = trainer.per_sample(sess, {m.x: x, m.y: y}, chunk_size=chunk_size)
    assert bool(dotted) == (chunk_size == 16)
    alone = [trainer.compute(sess, {m.x: x[i:i + 1], m.y: y[i:i + 1]}) for i in range(len(x))]
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), table_of(alone, trainer.spec),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1e-20, 1e-13])
@pytest.mark.parametrize("chunk_size", [16, 40])
def test_tiny_gradients_keep_their_norms_and_cosines(scale, chunk_size, monkeypatch):
    """A loss times 1e-20: each gradient about 1e-21, float32's normal, but its squares
    (about 1e-44) are not, and XLA on a CPU flushes them to 0: each sample computes alone,
    its norm from its gradient in float64. Times 1e-13, their squares and the products of
    their dots (one chunk: with the samples' own sum) are normal: vectorized."""
    def tiny(y, logits):
        return scale * keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    trainer = hostavg.keras.Trainer(models.keras_mlp(12, [16], 3, seed=1), tiny,
                                    keras.optimizers.SGD(0.1))
    x, y, w = _batch()
    alone, one = [], samples._PerSample._one
    monkeypatch.setattr(samples._PerSample, "_one", lambda *a: alone.append(1) or one(*a))
    table = trainer.per_sample(x, y, w, chunk_size=chunk_size)
    # a call per pass, but one: a batch of one chunk keeps them for its dots
    passes = 1 if chunk_size >= len(x) else 2
    assert len(alone) == (passes * len(x) if scale == 1e-20 else 0)
    want = brute_force(trainer, x, y, w)
    assert 1e-3 * scale < want[:, 1].min() and want[:, 1].max() < 10 * scale
    np.testing.assert_allclose(table["norm"], want[:, 1], rtol=1e-6)
    np.testing.assert_allclose(table[COLUMNS[2:]].to_numpy(float), want[:, 2:], rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("chunk_size", [16, 40])
def test_a_sample_with_a_zero_gradient_counts_in_the_mean(chunk_size):
    """Weighted 0, sample 5's gradient is 0: it computes alone (its squared norm too small to
    trust) and is one of the K samples of the mean, so one chunk's dots with the others' sum
    S are not g_i . S / K: the second pass runs (an outside review found cosines off by
    K / (K - 1))."""
    trainer = _trainer()
    x, y, w = _batch()
    w[5] = 0.0
    table = trainer.per_sample(x, y, w, chunk_size=chunk_size)
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), brute_force(trainer, x, y, w),
                               rtol=1e-6, atol=1e-6)


def test_a_tapped_layer_dots_with_the_sum_divided_by_its_largest_entry():
    """A bias-free Dense fed inputs of 3e-25, its loss times 1e10: each gradient a^T delta is
    about 1e-15, but (a S) delta would form a_k S_kj of 1e-39, below float32's normals, and
    flush them (cosines of 0 where alone they are 0.74); S / max|S| keeps them normal."""
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, use_bias=False)])

    def loss(y, p):
        return 1e10 * keras.ops.mean(keras.ops.square(p - y), axis=-1)
    trainer = hostavg.keras.Trainer(model, loss, keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x = (3e-25 * rng.normal(size=(4, 6))).astype(np.float32)
    y, w = rng.normal(size=(4, 3)).astype(np.float32), np.ones(4, np.float32)
    np.testing.assert_allclose(trainer.per_sample(x, y, w)[COLUMNS].to_numpy(float),
                               brute_force(trainer, x, y, w), rtol=1e-6, atol=1e-6)


def test_tf1_a_tapped_matmul_dots_with_the_sum_divided_by_its_largest_entry():
    """The TF1 twin of the case above: a MatMul tapped as a Dense is."""
    import tensorflow as tf
    v1 = tf.compat.v1
    graph, rng = tf.Graph(), np.random.default_rng(0)
    with graph.as_default():
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.float32, [None, 3])
        w = tf.Variable(rng.normal(size=(6, 3)).astype(np.float32))
        loss = 1e10 * tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    feed = {x: (3e-25 * rng.normal(size=(4, 6))).astype(np.float32),
            y: rng.normal(size=(4, 3)).astype(np.float32)}
    alone = [trainer.compute(sess, {k: v[i:i + 1] for k, v in feed.items()}) for i in range(4)]
    np.testing.assert_allclose(trainer.per_sample(sess, feed)[COLUMNS].to_numpy(float),
                               table_of(alone, trainer.spec), rtol=1e-6, atol=1e-6)
