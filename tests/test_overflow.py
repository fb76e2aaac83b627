"""Nothing non-finite is ever kept: a finite row of 1e30 that blows Adam's second moment up is
named (row, micro-batch, variables), the state is the last applied step's bit for bit, and
SkipNonFinite trains on without it; a label the framework refuses is traced to its row; every
HostavgError has culprit_rows. Both faces here; Keras on JAX in CI's KERAS_BACKEND=jax step
(.ci/run)."""

from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import graph_values

import hostavg
import hostavg.keras
from hostavg.engine import overflow
from hostavg.hooks import Record, SkipNonFinite
from hostavg.train import loop

v1 = tf.compat.v1
ON_JAX = keras.backend.backend() == "jax"
N, FEATURES, CLASSES, BAD = 960, 64, 10, 777


def digits(seed=0):
    """Digit-like data: 64 pixels of 0..16, ten classes from a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 17, (N, FEATURES)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), 1).astype(np.int32)
    return x, y


class Applied:
    """An on_applied hook keeping every variable's value after each applied step."""

    def __init__(self, read):
        self.read, self.steps, self.values = read, [], None

    def on_applied(self, result):
        self.steps.append(result.step)
        self.values = self.read()


class TF1:
    """Softmax regression with Adam, as a TF1 graph."""

    def __init__(self, hooks=(), lr=1e-3, optimizer=None, ref=False, **kw):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = v1.placeholder(tf.float32, [None, FEATURES], name="x")
            self.y = v1.placeholder(tf.int32, [None], name="y")
            w = v1.Variable(np.random.default_rng(1).normal(0, 0.1, (FEATURES, CLASSES))
                            .astype(np.float32), name="w", use_resource=not ref)
            logits = tf.matmul(self.x, w) + tf.Variable(np.zeros(CLASSES, np.float32), name="b")
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.y, logits=logits))
            self.applied = Applied(self.values)
            self.trainer = hostavg.Trainer(loss, optimizer or v1.train.AdamOptimizer(lr),
                                           hooks=[*hooks, self.applied], **kw)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.graph)
        self.sess.run(init)

    def values(self):
        return graph_values(self.graph, self.sess)

    def fit(self, x, y, **kw):
        return self.trainer.fit(self.sess, {self.x: x, self.y: y}, batch_size=120,
                                micro_batch_size=30, seed=0, progress=False, **kw)

    def step(self, x, y, rows=None):
        return self.trainer.step(self.sess, hostavg.split({self.x: x, self.y: y}, 30), rows=rows)


class Keras:
    """An MLP with Adam, in Keras (no batch norm: it would normalise the 1e30 away)."""

    def __init__(self, hooks=(), lr=1e-3, optimizer=None, dtype=None, **kw):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(32, activation="relu", dtype=dtype)(inputs)
        self.model = keras.Model(inputs, keras.layers.Dense(CLASSES, dtype=dtype)(hidden))
        self.applied = Applied(self.values)
        self.trainer = hostavg.keras.Trainer(
            self.model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer or keras.optimizers.Adam(lr), hooks=[*hooks, self.applied], **kw)

    def values(self):
        return {f"{i}": np.asarray(v.numpy()).astype(np.float32) for i, v in
                enumerate(self.model.variables + self.trainer.optimizer.variables)}

    def fit(self, x, y, **kw):
        return self.trainer.fit(x, y, batch_size=120, micro_batch_size=30, seed=0,
                                progress=False, **kw)

    def step(self, x, y, rows=None):
        return self.trainer.step(hostavg.split((x, y), 30), rows=rows)


FACES = {"keras": Keras} if ON_JAX else {"tf1": TF1, "keras": Keras}
faces = pytest.mark.parametrize("face", FACES.values(), ids=FACES.keys())


def assert_same(before: dict, after: dict):
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@faces
def test_a_finite_row_that_blows_adam_up_is_named_and_the_last_applied_state_is_kept(
        face, tmp_path):
    x, y = digits()
    x[BAD] = 1e30
    case = face(hooks=[Record(tmp_path, micro=False)])
    with pytest.raises(hostavg.HostavgError) as raised:
        case.fit(x, y, epochs=1)
    error = raised.value
    said = str(error)
    assert "non-finite (NaN or Inf), so it was undone" in said, said
    assert ("Adam_1" if face is TF1 else "velocity") in said.split("non-finite")[0], said
    assert "It was driven by micro-batch" in said and "the others' at most" in said, said
    assert said.endswith("The samples that drove it, found in its inputs:\n"
                         f"  data row {BAD}: x holds 1e30 in 64 of 64 columns"), said
    assert error.culprit_rows == [BAD] and BAD in error.rows
    # The state of the last applied step, bit for bit; nothing non-finite in it.
    now = case.values()
    assert_same(case.applied.values, now)
    assert all(np.isfinite(v).all() for v in now.values())
    # The undone step reached no on_applied hook, no record and no History.
    steps = case.applied.steps
    assert [s.step for s in error.history.steps] == steps
    assert hostavg.load_record(tmp_path).steps == steps


@faces
def test_skip_non_finite_drops_the_micro_batch_that_blew_the_apply_up_and_trains_on(face):
    x, y = digits()
    x[BAD] = 1e30
    case = face(hooks=[SkipNonFinite()])
    history = case.fit(x, y, epochs=3)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[0] > losses[1] > losses[2], losses
    assert history.nonfinite_rows().tolist() == [BAD]
    dropped = [s for s in history.steps if s.dropped]  # (once fit, 777 may give no gradient)
    assert 1 <= len(dropped) <= 3 and all(s.nonfinite_rows == (BAD,) for s in dropped)
    assert all(np.isfinite(v).all() for v in case.values().values())


@faces
def test_a_retried_step_equals_the_step_that_never_held_that_micro_batch(face):
    x, y = digits()
    x[45] = 1e30  # micro-batch 1 of the step over rows 0:120
    skipping, plain = face(hooks=[SkipNonFinite()]), face()
    result = skipping.step(x[:120], y[:120], rows=[np.arange(i, i + 30) for i in range(0, 120, 30)])
    assert result.dropped == (1,) and result.micro[1].dropped.startswith(
        "its contribution made the apply non-finite: it made"), result.micro[1].dropped
    assert [c.row for c in result.micro[1].culprits] == [45]
    keep = np.r_[0:30, 60:120]
    plain.step(x[keep], y[keep])
    assert_same(plain.values(), skipping.values())


@faces
def test_a_hook_that_keeps_the_micro_batch_that_blew_the_apply_up_gets_the_error(face):
    class Look:
        def __init__(self):
            self.seen = []

        def on_micro_batch(self, micro):
            self.seen.append(micro.overflows)

    x, y = digits()
    x[45] = 1e30
    look = Look()
    case = face(hooks=[look])
    case.step(x[120:240], y[120:240])  # built, one step applied
    look.seen.clear()
    before = case.values()
    with pytest.raises(hostavg.HostavgError, match="It was driven by micro-batch 1 of 4") as raised:
        case.step(x[:120], y[:120])
    assert raised.value.culprit_rows == [] and [c.sample for c in raised.value.culprits] == [45]
    # Tried again once, micro-batch 1 flagged; the state as before.
    assert look.seen[:4] == [None] * 4 and look.seen[5].startswith("it made") and len(look.seen) == 6
    assert_same(before, case.values())


@faces
def test_without_check_applied_the_blow_up_is_kept(face):
    x, y = digits()
    x[45] = 1e30
    case = face(check_applied=False)
    case.step(x[:120], y[:120])
    assert not all(np.isfinite(v).all() for v in case.values().values())


def test_a_bfloat16_model_is_checked_too():
    """bfloat16 is no NumPy float (its kind is "V"), and its variables are checked all the same."""
    x, y = digits()
    x[BAD] = 1e30  # in micro-batch 0 of rows 750:870
    case = Keras(dtype="bfloat16")
    case.step(x[:120], y[:120])
    before = case.values()
    with pytest.raises(hostavg.StepError) as raised:
        case.step(x[750:870], y[750:870])
    said = str(raised.value)
    assert "non-finite (NaN or Inf), so it was undone" in said and "velocity" in said, said
    assert_same(before, case.values())
    assert all(np.isfinite(v).all() for v in case.values().values())


@pytest.mark.skipif(ON_JAX, reason="TF1")
def test_a_reference_variable_is_undone_too():
    """TF1's reference variables (use_resource=False, the graphs of tf.disable_v2_behavior()):
    the check reads each after the update, and an apply that went through equals a resource
    variable's bit for bit (the undo's tf.where reads them after the update too)."""
    x, y = digits()
    x[45] = 1e30
    case, twin = TF1(ref=True), TF1()
    for each in (case, twin):
        each.step(x[120:240], y[120:240])
    assert_same(twin.values(), case.values())
    before = case.values()
    with pytest.raises(hostavg.StepError, match="'w/Adam_1' non-finite"):
        case.step(x[:120], y[:120])
    assert_same(before, case.values())
    for each in (case, twin):
        each.step(x[240:360], y[240:360])
    assert_same(twin.values(), case.values())


@pytest.mark.skipif(ON_JAX, reason="TF1")
def test_an_apply_that_no_micro_batch_drives_says_so():
    x, y = digits()
    case = TF1(optimizer=v1.train.GradientDescentOptimizer(1e38))
    before = case.values()
    with pytest.raises(hostavg.HostavgError, match="No micro-batch stands out .gradient norms "):
        case.step(x[:120], y[:120])
    assert_same(before, case.values())


def several(bad: int, k: int = 3) -> tuple:
    """A step's data: k micro-batches of 30, one row of 1e30 in each of the first ``bad`` (rows of
    BAD's label, which with 1e30 blow Adam up); (x, y, each micro-batch's data rows)."""
    x, y = digits()
    blown = np.flatnonzero(y[480:] == y[BAD])[:bad] + 480  # (apart from rows 120:240)
    x[blown] = 1e30
    good = iter(np.setdiff1d(np.arange(N), blown))
    rows = [np.array([*blown[i:i + 1], *(next(good) for _ in range(30 - (i < bad)))])
            for i in range(k)]
    return x, y, rows


def step_of(norms, sizes=None, dropped=()):
    """What :func:`overflow.drivers` reads of a step: its micro-batches' norms and sizes."""
    sizes = sizes or [1] * len(norms)
    micro = [SimpleNamespace(index=i, size=n, dropped="dropped" if i in dropped else None)
             for i, n in enumerate(sizes)]
    return SimpleNamespace(stats=SimpleNamespace(micro_norms=tuple(norms)), micro=micro)


@pytest.mark.parametrize("norms, sizes, dropped, drivers", [
    ([7e29, 7e29, 0.7], None, (), [0, 1]),         # two alike: each in the median of the other's
    ([0.7, 0.5, 7e29, 0.6], None, (), [2]),
    ([1.0, 1e3, 1e6, 1e9], None, (), []),         # no gap of a million anywhere
    ([1.0, 2e6, 3e12], None, (), [1, 2]),          # over a million times the median below
    ([0.5, 7e29], [1, 1], (1,), [0]),              # a dropped one does not count; alone: drives
    ([0.5, float("inf"), 0.7], None, (), [1]),
    ([1e-6, 0.7], [3, 1], (), []),                 # by samples times norm: 3e-6 and 0.7
])
def test_the_micro_batches_that_stand_out_of_the_others(norms, sizes, dropped, drivers):
    assert overflow.drivers(step_of(norms, sizes, dropped))[0] == drivers


@faces
def test_several_micro_batches_that_blew_the_apply_up_are_all_named(face):
    x, y, rows = several(2)
    case = face()
    case.step(x[120:240], y[120:240])
    before = case.values()
    with pytest.raises(hostavg.StepError) as raised:
        case.step(x[np.concatenate(rows)], y[np.concatenate(rows)], rows=rows)
    error, said = raised.value, str(raised.value)
    assert "It was driven by micro-batches 0 and 1 of 3: gradient norms " in said, said
    assert error.culprit_rows == sorted([rows[0][0], rows[1][0]]), said
    assert_same(before, case.values())


@faces
def test_skip_non_finite_drops_every_micro_batch_that_blew_the_apply_up_at_once(face):
    x, y, rows = several(2)
    skipping, plain = face(hooks=[SkipNonFinite()]), face()
    result = skipping.step(x[np.concatenate(rows)], y[np.concatenate(rows)], rows=rows)
    assert result.dropped == (0, 1) and result.skipped is None
    assert [c.row for c in result.micro[0].culprits + result.micro[1].culprits] == \
        [rows[0][0], rows[1][0]]
    plain.step(x[rows[2]], y[rows[2]])
    assert_same(plain.values(), skipping.values())


@faces
def test_a_step_whose_every_micro_batch_blew_the_apply_up_is_skipped(face):
    x, y, rows = several(2, k=2)
    case = face(hooks=[SkipNonFinite()])
    case.step(x[120:240], y[120:240])
    before = case.values()
    result = case.step(x[np.concatenate(rows)], y[np.concatenate(rows)], rows=rows)
    assert result.dropped == (0, 1) and result.skipped and result.step == 1
    assert_same(before, case.values())


@faces
def test_a_label_out_of_range_is_traced_to_its_row(face):
    """TF1: the framework refuses the compute, and each sample tried alone names the row; Keras
    (TensorFlow and JAX alike): the sparse loss's targets are checked on the host first."""
    x, y = digits()
    y[BAD] = 15
    case = face()
    before = case.values()
    with pytest.raises(hostavg.HostavgError) as raised:
        case.fit(x, y, epochs=1)
    error = raised.value
    assert error.culprit_rows == [BAD], str(error)
    assert f"its 30 samples alone:\n  data row {BAD}: fails alone: InvalidArgumentError: " \
        "Received a label value of 15" in str(error) or \
        "non-finite loss" in str(error) or \
        f"data row {BAD}: y holds 15; the model's output" in str(error), str(error)
    assert_same(case.applied.values or before, case.values())


def test_every_hostavg_error_has_culprit_rows():
    with pytest.raises(hostavg.HostavgError) as raised:
        hostavg.split({"x": np.zeros(4)}, 0)
    assert raised.value.culprit_rows == [] and raised.value.culprits == ()
    assert hostavg.HostavgError("any").culprit_rows == []


@pytest.mark.skipif(ON_JAX, reason="TF1")
def test_fit_stops_once_every_micro_batch_of_several_steps_in_a_row_was_dropped():
    x, y = digits()
    x[240:] = np.nan  # from the third step on, every micro-batch of the unshuffled data
    case = TF1(hooks=[SkipNonFinite()])
    with pytest.raises(hostavg.HostavgError) as raised:
        case.trainer.fit(case.sess, {case.x: x, case.y: y}, batch_size=120, micro_batch_size=30,
                         shuffle=False, progress=False)
    error = raised.value
    assert f"every micro-batch of the last {loop.EMPTY_STEPS} steps was dropped" in str(error)
    assert error.culprit_rows == list(range(240, 240 + 120 * loop.EMPTY_STEPS))
    assert len(error.history.steps) == 2 + loop.EMPTY_STEPS
