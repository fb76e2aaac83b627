"""The samples that make a micro-batch non-finite, found exactly: a NaN planted in a known row,
a finite row whose loss is not, on both faces; only after a failure, at most one compute per
sample, the model unchanged; and every dropped micro-batch's rows kept in fit's History."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import graph_values

import hostavg
import hostavg.keras
from hostavg.engine import culprits
from hostavg.hooks import SkipNonFinite
from hostavg.tf1.session import SessionBackend

v1 = tf.compat.v1
N, FEATURES = 240, 4


def data(seed=0):
    """x whose column 0 is > 0 (the models take its log), y from x."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) + 0.5
    return x, (x[:, 1] > 0).astype(np.int32)


class TF1:
    """An MLP on [log(x0), x1, x2, x3] with a batch-norm-like moving mean in UPDATE_OPS."""

    def __init__(self, hooks=(), overlap=False, loss_over_batch=False):
        rng = np.random.default_rng(1)
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = v1.placeholder(tf.float32, [None, FEATURES], name="x")
            self.y = v1.placeholder(tf.int32, [None], name="y")
            w = tf.Variable(rng.normal(0, 0.5, (FEATURES, 2)).astype(np.float32), name="w")
            feats = tf.concat([tf.math.log(self.x[:, :1]), self.x[:, 1:]], 1)
            ema = tf.Variable(np.zeros(FEATURES, np.float32), trainable=False, name="ema")
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS,
                                 ema.assign(0.5 * ema + 0.5 * tf.reduce_mean(self.x, 0)))
            logits = tf.matmul(feats, w)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.y, logits=logits))
            if loss_over_batch:  # finite for every sample alone, Inf for 3 together (float32)
                loss += 1e-30 * w[0, 0] * tf.reduce_sum(tf.square(self.x[:, 3]))
            self.trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1),
                                           hooks=hooks, overlap=overlap)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.graph)
        self.sess.run(init)

    def values(self):
        return graph_values(self.graph, self.sess)

    def fit(self, x, y, **kw):
        return self.trainer.fit(self.sess, {self.x: x, self.y: y}, batch_size=60,
                                micro_batch_size=10, seed=3, progress=False, **kw)

    def step(self, x, y, **kw):
        return self.trainer.step(self.sess, hostavg.split({self.x: x, self.y: y}, 10), **kw)


class Keras:
    """The same model in Keras, with a BatchNormalization layer (moving statistics)."""

    def __init__(self, hooks=(), overlap=False):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        feats = keras.layers.Lambda(lambda t: keras.ops.concatenate(
            [keras.ops.log(t[:, :1]), t[:, 1:]], axis=1))(inputs)
        h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="hidden")(feats))
        self.model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h))
        self.trainer = hostavg.keras.Trainer(
            self.model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.SGD(0.1), hooks=hooks, overlap=overlap)

    def values(self):
        return {f"{i}": v.numpy() for i, v in
                enumerate(self.model.variables + self.trainer.optimizer.variables)}

    def fit(self, x, y, **kw):
        return self.trainer.fit(x, y, batch_size=60, micro_batch_size=10, seed=3, progress=False,
                                **kw)

    def step(self, x, y, **kw):
        return self.trainer.step(hostavg.split((x, y), 10), **kw)


FACES = {"tf1": TF1, "keras": Keras}


def counting(monkeypatch, face) -> list:
    """A list that grows by one with every micro-batch computed (a sample alone too)."""
    calls = []
    backend = SessionBackend if face is TF1 else type(face().trainer._backend)
    compute = backend.compute

    def counted(self, feed, *share):
        calls.append(1)
        return compute(self, feed, *share)
    monkeypatch.setattr(backend, "compute", counted)
    return calls


def position(row: int) -> tuple[int, int]:
    """(micro-batch of its batch, global step before it) of data row ``row`` in fit's first
    epoch with seed 3 (batches of 60, micro-batches of 10)."""
    at = int(np.flatnonzero(np.random.default_rng([3, 0]).permutation(N) == row)[0])
    return at % 60 // 10, at // 60


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("face", FACES.values(), ids=FACES.keys())
def test_a_nan_planted_in_a_row_is_named_from_the_inputs_and_one_compute_clears_the_rest(
        face, overlap, monkeypatch):
    x, y = data()
    x[137, 2] = np.nan
    case = face(overlap=overlap)
    case.fit(x[:60], y[:60])  # traced and built, and a step taken
    calls = counting(monkeypatch, face)
    with pytest.raises(hostavg.HostavgError) as raised:
        case.fit(x, y)
    error = raised.value
    micro, step = position(137)
    assert str(error).endswith("The samples that make it non-finite, found in its inputs:\n"
                               "  data row 137: x holds NaN in column 2"), str(error)
    assert f"micro-batch {micro} of 6" in str(error)
    np.testing.assert_array_equal(error.culprit_rows, [137])
    assert error.culprits == (hostavg.core.results.Culprit(
        (position(137)[0] * 10) + list(error.rows).index(137), 137, "x holds NaN in column 2"),)
    assert 137 in error.rows and len(error.rows) == 10  # .rows: every row of the micro-batch
    # The steps before, the failing one's micro-batches up to it (and with overlap the one
    # computing beside it), then its 9 other samples once, together.
    assert len(calls) == step * 6 + micro + 1 + overlap * (micro < 5) + 1


@pytest.mark.parametrize("face", FACES.values(), ids=FACES.keys())
def test_a_finite_row_whose_loss_is_not_is_found_sample_by_sample_and_nothing_changes(
        face, monkeypatch):
    x, y = data()
    x[313 % N, 0] = -1.0  # log(-1): a finite input, a NaN loss
    row = 313 % N
    case = face()
    case.fit(np.abs(x[:1]), y[:1])  # traced and built, one step taken
    calls = counting(monkeypatch, face)
    with pytest.raises(hostavg.HostavgError) as raised:
        case.fit(x, y)
    micro, step = position(row)
    error = raised.value
    assert str(error).endswith("The samples that make it non-finite, found computing each of "
                               f"its 10 samples alone:\n  data row {row}: finite inputs, "
                               f"non-finite loss and gradients"), str(error)
    np.testing.assert_array_equal(error.culprit_rows, [row])
    assert len(calls) == step * 6 + micro + 1 + 10  # bounded: one compute per sample

    # The model, its moving statistics and the optimizer's state as they were.
    before = case.values()
    with pytest.raises(hostavg.HostavgError, match=f"sample {row - 60} of the step: finite"):
        case.step(x[60:100], y[60:100])
    after = case.values()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_without_rows_the_samples_are_named_by_their_place_in_the_step():
    x, y = data()
    x[13, 1] = np.inf
    x[13, 3] = -np.inf
    x[17] = np.nan
    case = TF1()
    with pytest.raises(hostavg.HostavgError) as raised:
        case.step(x[:40], y[:40])
    error = raised.value
    assert str(error).endswith(
        "found in its inputs:\n  sample 13 of the step: x holds Inf in column 1 and -Inf in "
        "column 3\n  sample 17 of the step: x holds NaN in 4 columns [0, 1, 2, 3]"), str(error)
    assert error.culprit_rows == [] and [c.sample for c in error.culprits] == [13, 17]


def test_a_micro_batch_non_finite_only_as_a_whole_names_no_sample():
    x, y = data()
    x[20:23, 3] = 1.3e19  # each square 1.7e38 is finite in float32, three summed are not
    case = TF1(loss_over_batch=True)
    before = case.values()
    with pytest.raises(hostavg.HostavgError) as raised:
        case.step(x[:40], y[:40], rows=[np.arange(i, i + 10) for i in range(0, 40, 10)])
    error = raised.value
    assert str(error).endswith("\nNo sample of it is non-finite alone (computing each of its 10 "
                               "samples alone): only the micro-batch as a whole, as with an op "
                               "over the batch (batch norm in training mode) or a sum over its "
                               "samples that overflows."), str(error)
    assert error.culprits == () and error.culprit_rows == []
    after = case.values()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_a_finite_step_computes_each_micro_batch_once(monkeypatch):
    calls = counting(monkeypatch, TF1)
    case = TF1()
    x, y = data()
    case.step(x[:40], y[:40])
    assert len(calls) == 4


@pytest.mark.parametrize("face", FACES.values(), ids=FACES.keys())
def test_skip_non_finite_in_fit_keeps_every_dropped_micro_batchs_culprit_rows(face, tmp_path):
    x, y = data()
    bad = {5: "x holds NaN in column 2", 77: "x holds Inf in column 1",
           150: "finite inputs, non-finite loss and gradients",
           151: "finite inputs, non-finite loss and gradients"}
    x[5, 2], x[77, 1], x[150, 0], x[151, 0] = np.nan, np.inf, -1.0, -2.0
    assert position(77) == position(150)  # one micro-batch holds a bad input and a bad loss
    case = face(hooks=[SkipNonFinite()])
    history = case.fit(x, y, checkpoint_dir=tmp_path / "ck")
    np.testing.assert_array_equal(history.nonfinite_rows(), sorted(bad))
    table = history.to_pandas()
    dropped = [m for step in table["dropped"] for m in step]
    micro_of = {r: position(r) for r in bad}
    assert len(dropped) == len({micro_of[r] for r in bad})
    for r, (micro, step) in micro_of.items():
        assert micro in table["dropped"][step] and r in table["nonfinite_rows"][step]
    assert table["size"].sum() == N - 10 * len(dropped)
    # The History a checkpoint keeps (a resumed fit's) holds them too.
    resumed = face(hooks=[SkipNonFinite()]).fit(x, y, checkpoint_dir=tmp_path / "ck")
    np.testing.assert_array_equal(resumed.nonfinite_rows(), sorted(bad))


def test_a_dropped_micro_batch_carries_its_culprits_on_the_step_result():
    x, y = data()
    x[12, 0] = -1.0
    case = TF1(hooks=[SkipNonFinite()])
    res = case.step(x[:40], y[:40], rows=[np.arange(i, i + 10) + 1000 for i in range(0, 40, 10)])
    assert res.dropped == (1,) and res.micro[0].culprits is None
    assert res.micro[1].culprits == (hostavg.core.results.Culprit(
        12, 1012, "finite inputs, non-finite loss and gradients"),)
    assert res.micro_table()["culprits"].tolist()[1] == [
        "data row 1012: finite inputs, non-finite loss and gradients"]


# --- The input scan, by hand -------------------------------------------------------------


def test_inputs_are_named_by_their_key_wherever_in_the_sample():
    n = 3
    images = np.zeros((n, 2, 2), np.float32)
    images[1, 0, 1] = np.nan
    labels = np.zeros(2 * n, np.float32)  # two blocks of the samples
    labels[n + 2] = np.inf
    ids = np.zeros((n, 2), np.int32)
    found = culprits.in_inputs(({"image": images, "ids": ids}, labels), n, 30, [7, 8, 9])
    assert [str(c) for c in found] == ["data row 8: x['image'] holds NaN at [0, 1]",
                                       "data row 9: y (block 1) holds Inf"]
    wide = np.zeros((2, 10))
    wide[0, 1:8] = np.nan
    assert [c.reason for c in culprits.in_inputs({"x:0": wide, "lr": np.nan}, 2, 0, None)] == [
        "x holds NaN in 7 columns [1, 2, 3, 4, ...]"]
    with pytest.raises(hostavg.HostavgError, match=r"cannot be cut into its 4 samples \(lengths "
                                                   r"\{'x': 6\}\)"):
        culprits.in_inputs({"x": np.zeros(6)}, 4, 0, None)
