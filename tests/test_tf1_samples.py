"""per_sample on the TF1 face, vectorized (hostavg.tf1.samples): the loss's subgraph imported
per sample under tf.vectorized_map gives each sample's values as computed alone, on a graph
with what TF1 programs hold (a fed scalar, a placeholder with a default, a variable read twice,
one not trained, a counter the loss waits for), in one session call per pass and chunk; where
it must refuse, a warning says why and each sample computes alone, to the same values."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import hostavg
from hostavg.tf1.session import SessionBackend
from hostavg.tf1.wiring import Wiring
from test_per_sample import COLUMNS, table_of

v1 = tf.compat.v1


def _build(kind=None, optimizer=None):
    """(trainer, session, feed of 11 samples, the counter): an MLP whose logits are scaled by
    a fed scalar, with ``kind`` "sequence", "dropout", "sparse", "reference" or "finalized"."""
    rng = np.random.default_rng(0)
    graph = tf.Graph()
    with graph.as_default():
        y = v1.placeholder(tf.int32, [None], name="y")
        scale = v1.placeholder(tf.float32, [], name="scale")
        training = v1.placeholder_with_default(True, [], name="training")
        variable = (lambda value, **kw: v1.Variable(value, use_resource=False, **kw)) \
            if kind == "reference" else tf.Variable
        w1 = variable(rng.normal(0, 0.5, (6, 8)).astype(np.float32), name="w1")
        w2 = variable(rng.normal(0, 0.5, (8, 3)).astype(np.float32), name="w2")
        offset = tf.Variable(np.full(8, 0.1, np.float32), trainable=False, name="offset")
        counter = tf.Variable(0, trainable=False, name="forward_passes")
        if kind == "sparse":
            table = tf.Variable(rng.normal(size=(20, 6)).astype(np.float32), name="table")
            x = v1.placeholder(tf.int32, [None, 2], name="ids")
            inputs = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
            xs = rng.integers(0, 20, (11, 2)).astype(np.int32)
        elif kind == "sequence":  # 3 rows a sample, folded into the batch for one MatMul
            x = v1.placeholder(tf.float32, [None, 3, 6], name="x")
            inputs, xs = tf.reshape(x, [-1, 6]), rng.normal(size=(11, 3, 6)).astype(np.float32)
        else:
            x = v1.placeholder(tf.float32, [None, 6], name="x")
            inputs, xs = x, rng.normal(size=(11, 6)).astype(np.float32)
        with tf.control_dependencies([counter.assign_add(1)]):
            h = tf.tanh(tf.matmul(inputs, w1) + offset)
        if kind == "sequence":
            h = tf.reduce_mean(tf.reshape(h, [-1, 3, 8]), axis=1)
        h = tf.where(training, h, 0.5 * h)
        if kind == "dropout":
            h = tf.nn.dropout(h, rate=0.5)
        logits = (tf.matmul(h, w2) + 0.1 * tf.matmul(tf.square(h), w2)) * scale  # w2 read twice
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        trainer = hostavg.Trainer(loss, optimizer or v1.train.GradientDescentOptimizer(0.1))
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    if kind == "finalized":
        graph.finalize()
    feed = {x: xs, y: rng.integers(0, 3, 11).astype(np.int32), scale: np.float32(1.5)}
    return trainer, sess, feed, counter


def _alone(trainer, sess, feed) -> np.ndarray:
    """(n, 4) of each of the 11 samples computed alone (trainer.compute of a batch of one)."""
    return _alone_rows(trainer, sess, feed, 11)


def _alone_rows(trainer, sess, feed, n: int) -> np.ndarray:
    """(n, 4) of each of ``n`` samples computed alone."""
    rows = [{k: (v[i:i + 1] if np.ndim(v) else v) for k, v in feed.items()} for i in range(n)]
    return table_of([trainer.compute(sess, row) for row in rows], trainer.spec)


@pytest.mark.parametrize("kind, chunk_size, passes", [
    (None, 1, ()), (None, 4, ()), (None, 11, (1,)), ("sequence", 4, ()),
    ("sequence", 11, (1,))])
def test_each_sample_as_alone_in_one_call_per_chunk_and_pass_and_nothing_changed(
        kind, chunk_size, passes, monkeypatch):
    """w1's gradient a^T delta is not formed (hostavg.tf1.samples taps its MatMul), except
    where its input holds several rows of a sample ("sequence"); w2 is read twice."""
    trainer, sess, feed, counter = _build(kind)
    table = _vectorized(trainer, sess, feed, chunk_size, monkeypatch, passes)
    assert sess.run(counter) == 0  # the counter the loss waits for: not assigned
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), _alone(trainer, sess, feed),
                               rtol=1e-6, atol=1e-6)


def _vectorized(trainer, sess, feed, chunk_size, monkeypatch, passes=(1, 2)):
    """trainer.per_sample of ``feed``, asserting that no sample computed alone (no warning, no
    compute) and that each chunk was one session call per pass: a batch of one chunk one call
    in all, its dots with its own sum, where their rounding allows (``passes``: how many calls
    it may make)."""
    calls, computes = [], []
    samples, compute = Wiring.samples, SessionBackend.compute
    monkeypatch.setattr(Wiring, "samples", lambda self, s, f, kind, *a: calls.append(kind)
                        or samples(self, s, f, kind, *a))
    monkeypatch.setattr(SessionBackend, "compute", lambda *a: computes.append(1) or compute(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        table = trainer.per_sample(sess, feed, chunk_size=chunk_size)
    chunks = -(-len(table) // chunk_size)
    assert not computes
    if chunks > 1:
        assert sorted(calls) == ["dots"] * chunks + ["sums"] * chunks
    else:
        assert calls == ["own"] + ["dots"] * (len(calls) - 1) and len(calls) in passes
    monkeypatch.undo()
    return table


class _OwnGradients(v1.train.GradientDescentOptimizer):
    def compute_gradients(self, loss, *args, **kwargs):
        return [(2 * g, v) for g, v in super().compute_gradients(loss, *args, **kwargs)]


@pytest.mark.parametrize("kind, why", [
    ("sparse", "'table' has a sparse gradient"),
    ("reference", "'w1' is a reference variable"),
    ("finalized", "the graph is finalized"),
    ("dropout", r"stateful ops \(RandomUniform\)"),
    ("own gradients", "_OwnGradients computes its own gradients")])
def test_where_it_cannot_vectorize_it_says_why_and_computes_each_alone(kind, why):
    trainer, sess, feed, _ = _build(kind, _OwnGradients(0.1) if kind == "own gradients" else None)
    with pytest.warns(UserWarning, match=f"per_sample computes each sample alone.*{why}"):
        table = trainer.per_sample(sess, feed, chunk_size=4)
    assert table["error"].isna().all() and len(table) == 11
    if kind != "dropout":  # a random draw per call
        np.testing.assert_allclose(table[COLUMNS].to_numpy(float),
                                   _alone(trainer, sess, feed), rtol=1e-6, atol=1e-6)


def _dilated_gradients_run() -> bool:
    """Whether this machine's TensorFlow computes a dilated Conv2D's input gradient on the
    CPU: its oneDNN kernels do; without them (TensorFlow leaves oneDNN off on CPUs without
    AVX-512, an AMD EPYC among them) the Eigen kernel refuses dilation rates over 1."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.ones([1, 6, 6, 1])
        grad = tf.gradients(tf.nn.conv2d(x, tf.ones([2, 2, 1, 1]), 1, "VALID", dilations=2),
                            x)[0]
    try:
        v1.Session(graph=graph).run(grad)
        return True
    except tf.errors.InvalidArgumentError:
        return False


def test_a_convnet_with_strided_same_and_dilated_valid_convolutions_is_each_sample_alone(
        monkeypatch):
    """Its Conv2D kernels' gradients formed per kernel offset (hostavg.core.convolution):
    "SAME" with a stride on 8x8 (one more row and column after), "VALID" dilated, and a
    kernel read by two convolutions (formed by the vectorized gradient instead)."""
    if not _dilated_gradients_run():
        pytest.skip("this machine's TensorFlow has no CPU kernel for a dilated convolution's "
                    "gradient (no oneDNN): the model cannot train here at all")
    rng = np.random.default_rng(1)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, 2], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        k1, k2, k3 = (tf.Variable(rng.normal(0, 0.4, shape).astype(np.float32))
                      for shape in [(3, 3, 2, 4), (2, 2, 4, 3), (1, 1, 3, 3)])
        h = tf.nn.relu(tf.nn.conv2d(x, k1, strides=2, padding="SAME"))           # 4x4
        h = tf.tanh(tf.nn.conv2d(h, k2, strides=1, padding="VALID", dilations=2))  # 2x2
        h = tf.nn.conv2d(h, k3, 1, "VALID") + tf.nn.conv2d(tf.square(h), k3, 1, "VALID")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.reduce_mean(h, axis=[1, 2])))
    _vectorized_as_alone(loss, {x: rng.normal(size=(11, 8, 8, 2)).astype(np.float32),
                                y: rng.integers(0, 3, 11).astype(np.int32)}, monkeypatch)


def test_kernels_read_through_an_op_and_explicit_padding_vectorize(monkeypatch):
    """A trained scalar only a one-input op reads (exp of a log temperature), a kernel read
    through tf.identity (untapped: formed), a Conv2D padded explicitly and unevenly (tapped):
    vectorized, each sample as alone (an outside review found the first stopping the whole
    vectorization, and the last failing every call and computing each sample alone)."""
    rng = np.random.default_rng(2)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6, 6, 1], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        kernel = tf.Variable(rng.normal(0, 0.5, (3, 3, 1, 2)).astype(np.float32))
        w = tf.Variable(rng.normal(0, 0.3, (2 * 7 * 7, 3)).astype(np.float32))
        log_temperature = tf.Variable(np.float32(0.3))
        h = tf.nn.relu(tf.nn.conv2d(x, kernel, 1, [[0, 0], [1, 2], [2, 1], [0, 0]]))  # 7x7
        logits = tf.matmul(tf.reshape(h, [-1, 2 * 7 * 7]), tf.identity(w)) \
            * tf.exp(log_temperature)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
    _vectorized_as_alone(loss, {x: rng.normal(size=(11, 6, 6, 1)).astype(np.float32),
                                y: rng.integers(0, 3, 11).astype(np.int32)}, monkeypatch)


def _vectorized_as_alone(loss, feed: dict, monkeypatch) -> None:
    """A trainer of ``loss`` (SGD): per_sample of ``feed``'s 11 samples in chunks of 4 is
    vectorized (:func:`_vectorized`) and each sample's values as alone."""
    with loss.graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        sess = v1.Session(graph=loss.graph)
        sess.run(v1.global_variables_initializer())
    table = _vectorized(trainer, sess, feed, 4, monkeypatch)
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), _alone(trainer, sess, feed),
                               rtol=1e-6, atol=1e-6)


def test_a_call_of_several_samples_that_fails_where_each_alone_runs_stops_vectorizing_once(
        monkeypatch):
    """Where the framework refuses the vectorized call though every sample computes alone (a
    kernel it lacks for the vectorized form), per_sample says why once and computes the rest
    alone rather than failing the same call again on every chunk: values as alone."""
    from hostavg.core.errors import StepError
    trainer, sess, feed, _ = _build()
    tried = []

    def refused(self, feed, dotted=False):  # as the session's refusal comes: its error under
        tried.append(dotted)
        said = "No OpKernel was registered to support Op 'Made-up' used by a pfor"
        raise StepError(f"the session refused the per_sample (InvalidArgumentError: {said}); "
                        f"check that micro-batch's feed") \
            from tf.errors.InvalidArgumentError(None, None, said)

    monkeypatch.setattr(SessionBackend, "sample_sums", refused)
    with pytest.warns(UserWarning, match=r"^per_sample computes each sample alone, one call "
                      r"each: the call of several samples failed where each alone computes "
                      r"\(InvalidArgumentError: No OpKernel was registered to support Op "
                      r"'Made-up' used by a pfor\)$") as said:
        table = trainer.per_sample(sess, feed, chunk_size=4)
    assert len(said) == 1 and tried == [False]  # 3 chunks: the first one's call alone
    assert table["error"].isna().all()
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), _alone(trainer, sess, feed),
                               rtol=1e-6, atol=1e-6)


def test_a_sample_whose_tapped_gradient_overflows_is_left_out_as_alone():
    """A linear regression's sample whose loss is finite (its residual squared, 2e38) and
    whose gradient 2 r x (9e38) is not, in float32: its norm Inf and cosines NaN as alone, and
    the others' cosines those of the mean without it, not NaN (an outside review: its float64
    |a|^2 |delta|^2 was finite, and its Inf entered the mean)."""
    rng = np.random.default_rng(3)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.float32, [None, 1], name="y")
        w = tf.Variable(np.full((4, 1), 0.5, np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        sess = v1.Session(graph=graph)
        sess.run(v1.global_variables_initializer())
    xs, ys = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 1)).astype(np.float32)
    xs[2, 0] = 3e19
    want = _alone_rows(trainer, sess, {x: xs, y: ys}, 6)
    assert np.isfinite(want[2, 0]) and not np.isfinite(want[2, 1])
    for chunk_size in (1, 6):
        table = trainer.per_sample(sess, {x: xs, y: ys}, chunk_size=chunk_size)
        assert np.isinf(table["norm"][2]) and table.loc[2, ["cosine", "cosine_to_rest"]].isna().all()
        keep = np.delete(np.arange(6), 2)
        np.testing.assert_allclose(table.drop(index=2)[COLUMNS].to_numpy(float),
                                   _alone_rows(trainer, sess, {x: xs[keep], y: ys[keep]}, 5),
                                   rtol=1e-6, atol=1e-6)
