"""WatchOutliers on every face: a finite row scaled by 1e4 in scikit-learn's digits is named
at the step it spikes, by row, found at that step's weights before the apply; "skip" takes the
spike out of the losses, "raise" changes nothing; History.micro_table holds each micro-batch's
rows. TF1 and Keras on TensorFlow here; Keras on JAX in CI's KERAS_BACKEND=jax step (.ci/run)."""

import warnings
from dataclasses import replace

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import hostavg
import hostavg.keras
from hostavg.core.gradients import Gradients, freeze
from hostavg.core.results import Drop, MicroBatch, Outlier, Search
from hostavg.engine import culprits
from hostavg.hooks import OutlierWarning, WatchOutliers
from hostavg.train.hooks import FACTOR, WARMUP

v1 = tf.compat.v1
ON_JAX = keras.backend.backend() == "jax"
BAD, SCALE, BATCH, MICRO = 500, 1e4, 128, 16


def digits(bad=True):
    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)
    if bad:
        x[BAD] *= SCALE
    return x, y


class TF1:
    """A ReLU MLP (64-32-10) with Adam, as a TF1 graph."""

    def __init__(self, **kw):
        self.graph = tf.Graph()
        rng = np.random.default_rng(1)
        with self.graph.as_default():
            self.x = v1.placeholder(tf.float32, [None, 64], name="x")
            self.y = v1.placeholder(tf.int32, [None], name="y")
            w1 = tf.Variable(rng.normal(0, 0.2, (64, 32)).astype(np.float32), name="w1")
            w2 = tf.Variable(rng.normal(0, 0.2, (32, 10)).astype(np.float32), name="w2")
            logits = tf.matmul(tf.nn.relu(tf.matmul(self.x, w1)), w2)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.y, logits=logits))
            self.trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(1e-2), **kw)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.graph)
        self.sess.run(init)

    def fit(self, x, y, **kw):
        return self.trainer.fit(self.sess, {self.x: x, self.y: y}, **kw)

    def values(self):
        return {v.name: self.sess.run(v) for v in self.graph.get_collection("variables")}


class Keras:
    """The same MLP in Keras, with Adam."""

    def __init__(self, **kw):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        self.model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
        self.trainer = hostavg.keras.Trainer(
            self.model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(1e-2), **kw)

    def fit(self, x, y, **kw):
        return self.trainer.fit(x, y, **kw)

    def values(self):
        return {f"{i}": np.array(v.numpy()) for i, v in
                enumerate(self.model.variables + self.trainer.optimizer.variables)}


FACES = {"keras": Keras} if ON_JAX else {"tf1": TF1, "keras": Keras}
faces = pytest.mark.parametrize("face", FACES.values(), ids=FACES.keys())


def fit(face, **kw):
    case = face(**kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = case.fit(*digits(), batch_size=BATCH, micro_batch_size=MICRO, epochs=2, seed=0,
                           progress=False)
    return history, [w for w in caught if issubclass(w.category, OutlierWarning)]


def spiking(history) -> list:
    """The steps after the warm-up where the micro-batch holding row BAD has a loss or gradient
    norm over FACTOR times the median of every micro-batch's (brute force, from the table)."""
    table = history.micro_table()
    medians = table[["loss", "grad_norm"]].median()
    return [step for (step, _), (rows, loss, norm) in
            table[["rows", "loss", "grad_norm"]].iterrows()
            if BAD in rows and step > WARMUP
            and (loss > FACTOR * medians.loss or norm > FACTOR * medians.grad_norm)]


@pytest.fixture(scope="module", params=FACES.values(), ids=FACES.keys())
def warned(request):
    return (request.param, *fit(request.param))


def test_the_row_is_named_at_each_step_it_spikes(warned):
    _, history, caught = warned
    steps = spiking(history)
    assert steps  # row BAD's step of the second epoch, of the first too where after the warm-up
    table = history.outliers()
    assert list(table.columns) == ["step", "micro_batch", "row", "loss", "grad_norm", "factor",
                                   "quantity"]
    named = table.groupby(["step", "micro_batch"]).row.first()  # the largest first
    assert set(named.index.get_level_values("step")) == set(steps), table
    assert (named == BAD).all(), table
    assert (table.factor > FACTOR).all() and set(table.quantity) <= {"loss", "grad_norm"}
    first = table[table.row == BAD].iloc[0]
    micro = history.micro_table().loc[(first.step, first.micro_batch)]
    assert first.loss > 10 * micro.loss / MICRO  # its own loss, alone, dwarfs the others'
    # One warning per outlier micro-batch, naming the step, the micro-batch and the row.
    assert len(caught) == len(named)
    said = str(caught[0].message)
    assert said.startswith(f"step {first.step}, micro-batch {first.micro_batch} ({MICRO} "
                           f"samples) is an outlier: "), said
    assert f"\n  data row {BAD}: loss " in said and "x's largest value 1e4" in said, said
    assert "x the median" in said and "; kept. The samples that stand out:" in said, said


def test_the_spike_stays_in_the_losses_with_warn(warned):
    _, history, _ = warned
    losses = history.to_pandas().set_index("step").loss
    assert losses[spiking(history)].min() > 3 * losses.median()  # one micro-batch of 8


@faces
def test_skip_drops_the_outlier_and_the_spike_is_gone(face):
    history, caught = fit(face, watch_outliers=False,
                          hooks=[WatchOutliers(action="skip")])
    steps = spiking(history)
    losses = history.to_pandas().set_index("step").loss
    assert losses[steps].max() < 2 * losses.median(), losses[steps]
    table = history.micro_table()
    dropped = table[table.dropped]
    assert [s for s, _ in dropped.index] == steps and all(BAD in r for r in dropped.rows)
    assert list(history.outliers().groupby("step").row.first()) == [BAD] * len(steps)
    assert "; dropped. The samples that stand out:" in str(caught[0].message)
    assert len(caught) == len(dropped)  # the step computed again searches and warns no more


class Applied:
    """An on_applied hook keeping every variable's value after each applied step."""

    def __init__(self):
        self.read, self.steps, self.values = None, [], None

    def on_applied(self, result):
        self.steps.append(result.step)
        self.values = self.read()


def test_raise_fails_the_step_before_the_apply_with_nothing_changed(warned):
    face, history, _ = warned
    first = history.outliers().iloc[0]
    applied = Applied()
    case = face(watch_outliers=False, hooks=[applied, WatchOutliers(action="raise")])
    applied.read = case.values
    with pytest.raises(hostavg.StepError) as raised:
        case.fit(*digits(), batch_size=BATCH, micro_batch_size=MICRO, epochs=2, seed=0,
                 progress=False)
    said = str(raised.value)
    assert f"step {first.step}, micro-batch {first.micro_batch} ({MICRO} samples) is an " \
           f"outlier: " in said, said
    assert f"nothing was applied. The samples that stand out:\n  data row {BAD}: loss" in said
    assert applied.steps == list(range(1, first.step))
    after = case.values()
    assert applied.values.keys() == after.keys()
    for name in after:
        np.testing.assert_array_equal(after[name], applied.values[name], err_msg=name)


@faces
def test_a_healthy_run_is_silent_and_off_means_off(face):
    case = face()
    assert any(isinstance(h, WatchOutliers) for h in case.trainer.hooks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = case.fit(*digits(bad=False), batch_size=BATCH, micro_batch_size=MICRO,
                           epochs=60, seed=0, progress=False)  # into the loss's late tail
    assert history.to_pandas().loss.tail(15).median() < 0.02
    assert not [w for w in caught if issubclass(w.category, OutlierWarning)]
    assert history.outliers().empty
    assert not any(isinstance(h, WatchOutliers) for h in face(watch_outliers=False).trainer.hooks)


@faces
def test_micro_table_holds_every_micro_batch_with_its_rows(face):
    x, y = digits(bad=False)
    history = face(watch_outliers=False).fit(x[:100], y[:100], batch_size=40,
                                             micro_batch_size=16, seed=0, progress=False)
    table = history.micro_table()
    assert table.index.names == ["step", "micro_batch"]
    assert list(table.columns) == ["size", "rows", "loss", "grad_norm", "dropped"]
    # 100 rows in batches of 40, 40, 20, cut in micro-batches of 16: 16, 16, 8, 16, 16, 8, 16, 4
    assert list(table["size"]) == [16, 16, 8, 16, 16, 8, 16, 4]
    assert sorted(r for rows in table.rows for r in rows) == list(range(100))
    assert [len(r) for r in table.rows] == list(table["size"])
    for step in history.steps:
        assert list(table.loc[step.step].loss) == list(step.micro_losses)
        assert list(table.loc[step.step].grad_norm) == list(step.micro_norms)
    assert not table.dropped.any()
    # JSON (a checkpoint) holds every column but the rows, a data set's worth of integers
    again = hostavg.History.from_json(history.to_json()).micro_table()
    assert again.rows.isna().all()
    assert again.drop(columns="rows").equals(table.drop(columns="rows"))


# --- The judge and the window, by hand --------------------------------------------------------


def judged(losses, sq_norms, factor=10.0, rows=None):
    """Contribution's search over a micro-batch whose sample j computes alone to (losses[j],
    sq_norms[j]); the sample is told by its x, j itself; and the computes it made."""
    n = len(losses)
    feed = {"x": np.arange(n, dtype=np.float32).reshape(n, 1) * [1.0, -2.0]}
    made = []

    def compute(part, size):
        j = int(part["x"][0, 0])
        made.append(j)
        return losses[j], sq_norms[j]

    found, how = culprits.Contribution(factor).search(feed, n, 100, rows, compute)
    return found, how, made


def test_the_samples_over_factor_times_the_median_are_named_the_largest_first():
    losses = [1.0, 1.0, 50.0, 1.0, 2.0, 300.0]
    found, how, made = judged(losses, [1.0] * 6, rows=np.arange(6) + 10)
    assert made == list(range(6)) and how == "computing each of its 6 samples alone"
    # median loss 1.5: sample 5 is 200x, sample 2 33x; sample 4 (1.33x) is not named
    assert [(c.sample, c.row) for c in found] == [(105, 15), (102, 12)]
    assert str(found[0]) == ("data row 15: loss 300, 200x the median; gradient norm 1, 1x the "
                             "median; x's largest value -10")
    assert (found[0].loss, found[0].grad_norm) == (300.0, 1.0)


def test_a_gradient_norm_alone_makes_a_culprit_and_ordinary_samples_beside_a_huge_one_are_not():
    found, _, _ = judged([1.0] * 6, [1.0, 1.0, 1.0, 1.0, 400.0, 1e12])  # norms 1 ... 20, 1e6
    # sample 4 is 20x the median norm, but 5e4 times smaller than sample 5: not named
    assert [c.sample for c in found] == [105]
    assert found[0].row is None and str(found[0]).startswith("sample 105 of the step: loss 1, 1x")


def test_no_sample_stands_out_where_the_micro_batch_is_large_as_a_whole():
    assert judged([5.0] * 4, [9.0] * 4)[0] == ()
    assert judged([0.0] * 4, [0.0] * 4)[0] == ()  # a median of 0 judges nothing


def micro(step, index, loss, norm=1.0, size=4):
    grads = Gradients({"w": freeze(np.array([norm], np.float32))}, loss=loss, size=size)
    return MicroBatch(index, size, loss, grads, index * size, step)


def test_the_window_judges_after_the_warm_up_against_the_median_of_the_last_steps():
    hook = WatchOutliers(factor=10.0, window=4)
    assert hook.drops is False and WatchOutliers(action="skip").drops is False
    for step in range(1, WARMUP + 1):  # the warm-up: nothing is judged, however large
        assert hook.on_micro_batch(micro(step, 0, 1.0 if step < WARMUP else 1e6)) is None
        assert hook.on_micro_batch(micro(step, 1, 1.0)) is None
    # the window holds steps 1..3: losses 1 1 1 1 1e6 1 -> median 1
    asked = hook.on_micro_batch(micro(WARMUP + 1, 0, 10.5))
    assert isinstance(asked, Search) and isinstance(asked.judge, culprits.Contribution)
    assert asked.outlier == Outlier("loss", 10.5, 1.0, 10.5)
    assert str(asked.outlier) == "loss 10.5, 10.5x the median 1"
    assert hook.on_micro_batch(micro(WARMUP + 1, 1, 9.9)) is None
    third = hook.on_micro_batch(micro(WARMUP + 1, 2, 1.0, norm=11.0))
    assert third.outlier.quantity == "grad_norm"
    # non-finite micro-batches are SkipNonFinite's: neither judged nor held
    assert hook.on_micro_batch(micro(WARMUP + 1, 3, float("nan"))) is None
    # once the step ran: micro-batch 0 (10.5) against its step's others (9.9, 1.0): median
    # 5.45, not 10x: not an outlier; micro-batch 2's norm 11 against 1, 1: one, still
    assert asked.still(micro(WARMUP + 1, 0, 10.5)) is None
    assert third.still(micro(WARMUP + 1, 2, 1.0, norm=11.0)) == Outlier("grad_norm", 11.0, 1.0,
                                                                        11.0)


def test_a_step_whose_micro_batches_rose_together_has_no_outlier():
    hook = WatchOutliers(factor=10.0, window=5)
    for step in range(1, WARMUP + 1):
        for i in range(4):
            hook.on_micro_batch(micro(step, i, 1.0))
    asked = [hook.on_micro_batch(micro(WARMUP + 1, i, 300.0 + i)) for i in range(4)]
    assert all(isinstance(a, Search) for a in asked)  # against the last steps, each is
    assert [a.still(micro(WARMUP + 1, i, 300.0 + i)) for i, a in enumerate(asked)] == [None] * 4
    # held in the window: the next step's 300s are ordinary (median of 12 ones and 4 300s: 1)
    # until the window's median moves; one micro-batch alone is judged against the past only
    lone = WatchOutliers(factor=10.0, window=5)
    for step in range(1, WARMUP + 1):
        lone.on_micro_batch(micro(step, 0, 1.0))
    alone = lone.on_micro_batch(micro(WARMUP + 1, 0, 300.0))
    assert alone.still(micro(WARMUP + 1, 0, 300.0)) == Outlier("loss", 300.0, 1.0, 300.0, alone=True)


def test_a_step_tried_again_is_held_once_and_skip_drops_through_the_search():
    hook = WatchOutliers(factor=10.0, window=3, action="skip")
    for i in range(3):  # step 1's first try, failed: not held
        hook.on_micro_batch(micro(1, i, 100.0))
    for step in (1, 2, 3):
        hook.on_micro_batch(micro(step, 0, 1.0))
    out = hook.on_micro_batch(micro(4, 0, 20.0))  # held wrongly, the median would be 50.5
    assert isinstance(out, Search) and out.outlier.factor == 20.0
    assert hook.on_micro_batch(micro(4, 1, 1.0)) is None
    searched = replace(micro(4, 0, 20.0), outlier=out.still(micro(4, 0, 20.0)))
    with pytest.warns(OutlierWarning, match="; dropped. The samples"):
        dropped = out.then(searched)
    assert dropped == Drop("an outlier: loss 20, 20x the median 1")
    # the step computed again: the outlier, shown with its outlier, is not asked again, nor
    # held: with a window of one step, step 5 is judged against step 4's 1.0 alone
    assert hook.on_micro_batch(searched) is None
    assert hook.on_micro_batch(micro(4, 1, 1.0)) is None
    one = WatchOutliers(factor=10.0, window=1, action="skip")
    one.on_micro_batch(micro(1, 0, 1.0))
    first = one.on_micro_batch(micro(2, 0, 20.0))
    one.on_micro_batch(micro(2, 1, 1.0))
    assert first.still(micro(2, 0, 20.0)) is not None
    one.on_micro_batch(replace(micro(2, 0, 20.0), outlier=first.outlier))  # computed again
    one.on_micro_batch(micro(2, 1, 1.0))
    assert one.on_micro_batch(micro(3, 0, 15.0)).outlier.median == 1.0  # not 10.5


@pytest.mark.parametrize("kw, said", [
    ({"factor": 0}, "factor must be a finite number > 0, got 0"),
    ({"factor": 1}, "factor must be > 1 (times the median: at 1, half of all micro-batches "
                    "would be outliers), got 1"),
    ({"window": 0}, "window must be an integer >= 1, got 0"),
    ({"action": "drop"}, "action must be one of ('warn', 'skip', 'raise'), got 'drop'"),
])
def test_wrong_arguments_are_named(kw, said):
    with pytest.raises(hostavg.ArgumentError) as raised:
        WatchOutliers(**kw)
    assert str(raised.value).startswith(said), str(raised.value)


def test_watch_outliers_must_be_a_bool():
    with pytest.raises(hostavg.ArgumentError) as raised:
        Keras(watch_outliers="no")
    assert "watch_outliers" in str(raised.value) and "'no'" in str(raised.value)
