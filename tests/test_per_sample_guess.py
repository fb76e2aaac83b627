"""per_sample's single pass (hostavg.engine.samples): each sample's g_i . M_b, M_b the mean
gradient of one compute of the batch, stands for g_i . M (M: the samples' own mean) only
where the host's bound on what M - M_b moves a cosine keeps every cosine within 1e-6. The
bound against the brute force (gradients in general position, one dominating, gradients
that mostly cancel, two samples); through a Keras trainer, a batch mean that is not the
samples' (a summed loss, an error put into M_b) makes the second pass run, to the brute
force's values, and an exact M_b does not."""

import keras
import numpy as np
import pytest

import hostavg
import hostavg.keras
from hostavg.cli import models
from hostavg.core.stats import cosines_from_dots
from hostavg.engine import samples
from test_per_sample import COLUMNS, brute_force, table_of


def _cosines(G, dots) -> np.ndarray:
    """(2, k): the cosines per_sample computes from each row's ``dots`` with the rows' mean."""
    mean = G.mean(axis=0)
    return np.array(cosines_from_dots(dots, (G * G).sum(axis=1), mean @ mean, np.ones(len(G))))


def _gradients(case: str, rng) -> np.ndarray:
    G = rng.normal(size=(2 if case == "two" else 64, 40))
    if case == "dominant":  # along the others' sum, 30 times a row: its cosine to them near 1
        others = np.delete(G, 3, axis=0).sum(axis=0)
        G[3] = 30 * np.linalg.norm(G[0]) * others / np.linalg.norm(others) + 0.1 * G[3]
    elif case == "cancel":  # the mean a hundredth of a row
        G -= G.mean(axis=0) - rng.normal(size=40) * 0.01 * np.linalg.norm(G[0]) / np.sqrt(40)
    return G


def _errors(G, size: float, rng):
    """Errors e of M, |e| = ``size`` |M|: along each row (its dot off by the most: |g_i| |e|),
    against it, and in random directions."""
    scale = size * np.linalg.norm(G.mean(axis=0))
    for row in G:
        yield row * scale / np.linalg.norm(row)
        yield -row * scale / np.linalg.norm(row)
    for _ in range(10):
        e = rng.normal(size=G.shape[1])
        yield e * scale / np.linalg.norm(e)


@pytest.mark.parametrize("case", ["general", "dominant", "cancel", "two"])
@pytest.mark.parametrize("size", [1e-10, 1e-8, 1e-6, 1e-3])
def test_the_bound_covers_every_cosine_a_wrong_mean_moves(case, size):
    """Each cosine from g_i . (M + e) is within _guess_error of the one from g_i . M; where
    the bound would let the guess stand (1e-6), no cosine turns NaN or back."""
    rng = np.random.default_rng(["general", "dominant", "cancel", "two"].index(case))
    G = _gradients(case, rng)
    mean, k = G.mean(axis=0), len(G)
    exact = _cosines(G, G @ mean)
    worst = 0.0
    for e in _errors(G, size, rng):
        dots = G @ (mean + e)
        bound = samples._guess_error(dots, (G * G).sum(axis=1), mean @ mean, k,
                                     float(np.linalg.norm(e)))
        moved = np.abs(_cosines(G, dots) - exact)
        # the cosine with M moves by exactly off / |M| where e is along g_i: float64's noise
        assert np.nanmax(moved) <= bound * (1 + 1e-9) + 1e-15, (np.nanmax(moved), bound)
        if bound <= samples.TOLERANCE:
            assert (np.isnan(_cosines(G, dots)) == np.isnan(exact)).all()
        worst = max(worst, float(np.nanmax(moved) / bound))
    assert worst > 0.4  # what a bound that could not fail would not reach
    if size == 1e-10:  # the batch compute's rounding: the guess stands
        assert bound <= samples.TOLERANCE / 2


def _trainer():
    return hostavg.keras.Trainer(models.keras_mlp(12, [16], 3, seed=1), models.keras_loss(),
                                 keras.optimizers.SGD(0.1))


def _batch():
    rng = np.random.default_rng(5)
    return (rng.normal(size=(40, 12)).astype(np.float32),
            rng.integers(0, 3, 40).astype(np.int32), np.ones(40, np.float32))


def _passes(trainer, monkeypatch, off: float = 0.0):
    """(per_sample's table of the batch in chunks of 16, whether its second pass ran), with
    M_b multiplied by 1 + ``off``."""
    dotted, guess = [], samples._PerSample._guess

    def wrong(self, snapshot):
        out = guess(self, snapshot)
        return out if out is None else (out[0] * (1 + off), out[1])
    monkeypatch.setattr(samples._PerSample, "_guess", wrong)
    backend = type(trainer._backend)
    dots = backend.sample_dots
    monkeypatch.setattr(backend, "sample_dots", lambda *a: dotted.append(1) or dots(*a))
    x, y, w = _batch()
    return trainer.per_sample(x, y, w, chunk_size=16), bool(dotted)


@pytest.mark.parametrize("off", [0.0, 1e-3, -1e-5])
def test_a_mean_that_is_not_the_samples_is_not_used(off, monkeypatch):
    trainer = _trainer()
    table, second = _passes(trainer, monkeypatch, off)
    assert second == (off != 0)
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), brute_force(trainer, *_batch()),
                               rtol=1e-6, atol=1e-6)


def test_a_summed_loss_has_a_batch_mean_k_times_the_samples_and_takes_the_second_pass(
        monkeypatch):
    """TF1 (the Keras face refuses a summed loss): the batch's gradient is 40 times the
    samples' mean; the second pass dots with theirs."""
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
    table = trainer.per_sample(sess, {m.x: x, m.y: y}, chunk_size=16)
    assert dotted
    alone = [trainer.compute(sess, {m.x: x[i:i + 1], m.y: y[i:i + 1]}) for i in range(len(x))]
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), table_of(alone, trainer.spec),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1e-20, 1e-13])
@pytest.mark.parametrize("chunk_size", [16, 40])
def test_tiny_gradients_keep_their_norms_and_cosines(scale, chunk_size, monkeypatch):
    """A loss times 1e-20: each gradient about 1e-21, float32's normal, but its squares
    (about 1e-44) are not, and XLA on a CPU flushes them to 0: each sample computes alone,
    its norm from its gradient in float64. Times 1e-13, their squares and the products of a
    dot with M_b (one chunk: with the samples' own sum) are normal: vectorized."""
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
