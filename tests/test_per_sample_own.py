"""per_sample of a batch of one chunk in one call (hostavg.engine.samples): each gradient is
dotted with the samples' own sum in the call that forms it, so no second pass runs where the
host can bound what rounding and flushed products move a cosine; a loss that is no mean over
its samples changes nothing of it, and tiny gradients (whose squares XLA flushes to 0 on a
CPU) compute alone, to the brute force's values either way."""

import keras
import numpy as np
import pytest

import hostavg
import hostavg.keras
from hostavg.cli import models
from hostavg.engine import samples
from test_per_sample import COLUMNS, brute_force, table_of


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


@pytest.mark.parametrize("size, holds", [(1.0, True), (1e-20, False)])
def test_own_dots_whose_products_may_flush_below_the_normals_are_not_used(size, holds):
    """Gradients of norm 1e-13 (squares normal) dotted with a sum S of norm ``size``: where
    S's entries times theirs fall below float32's normals (1e-20: the samples' gradients
    cancel), what flushing may lose (the floor, 2.9e-36 for 243 parameters) is 1e-3 of a dot,
    and the second pass must run."""
    rows = object.__new__(samples._PerSample)
    rows.rounding, rows.floor = 2e-8, 243 * 1.18e-38
    rows.sq, rows.dots = np.full(4, 1e-26), np.full(4, 1e-13 * size * 0.3)
    rows.summed = {"w": np.full(243, size / np.sqrt(243))}
    part = samples._Part(None, [0, 1, 2, 3], (None, []), None, True)
    assert rows._own_holds([part], (size / 4) ** 2, 4) == holds
