"""The Trainer against the full-batch oracle, and its guarantees: no forward pass in
apply, one global step per apply, UPDATE_OPS per micro-batch, atomic steps, errors;
its arguments (var_list, accum_dtype, evaluate's metrics, step_together) checked."""

import re

import numpy as np
import pytest
import tensorflow as tf
from models import (BATCH, FetchSpy, batches, build, cuts, full_batch, make_optimizer, sgd,
                    tf1, v1)

import hostavg

STEPS = 20
EQUAL, UNEQUAL = (10, 10, 10, 10), (5, 12, 3, 20)


def train(optimizer, data, sizes, *, model_kw=None, session=v1.Session, **trainer_kw):
    """hostavg over the same batches as the oracle, each cut into ``sizes``; returns (model,
    sess, trainer, results). ``optimizer``: a name in OPTIMIZERS or a function that makes one."""
    model = build(**(model_kw or {}))
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, make_optimizer(optimizer), **trainer_kw)
        init = v1.global_variables_initializer()
    sess = session(graph=model.graph)
    sess.run(init)
    results = []
    for d in data:
        feeds = [model.feed({k: v[s] for k, v in d.items()}) for s in cuts(len(d["y"]), sizes)]
        results.append(trainer.step(sess, feeds))
    return model, sess, trainer, results


def assert_same_weights(got: dict, want: dict, atol: float):
    got = {k: v for k, v in got.items() if k != "forward_passes"}
    want = {k: v for k, v in want.items() if k != "forward_passes"}
    assert got.keys() == want.keys()
    worst = max(np.max(np.abs(got[k] - want[k])) for k in want)
    assert worst <= atol, {k: float(np.max(np.abs(got[k] - want[k]))) for k in want}


@pytest.mark.parametrize("accumulate,average", [("sum", "graph"), ("stack", "host"),
                                                ("stack", "graph")])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_every_mode_equals_full_batch_step(accumulate, average, sparse):
    data = batches(1, STEPS, BATCH, sparse=sparse)
    want = full_batch("adam", data, sparse=sparse)
    model, sess, _, _ = train("adam", data, UNEQUAL, model_kw={"sparse": sparse},
                              accumulate=accumulate, average=average)
    assert_same_weights(model.values(sess), want, atol=1e-5)


def test_float64_model_and_float64_accumulation():
    data = batches(2, 5, BATCH, dtype=np.float64)
    want = full_batch("adam", data, dtype=np.float64)
    model, sess, trainer, results = train("adam", data, UNEQUAL, model_kw={"dtype": np.float64})
    assert_same_weights(model.values(sess), want, atol=1e-12)
    assert all(v.dtype == np.float64 for v in results[-1].grads.values())

    data = batches(2, 5, BATCH)
    want = full_batch("adam", data)
    model, sess, trainer, results = train("adam", data, UNEQUAL, accum_dtype="float64")
    assert trainer.accum_dtype == np.float64
    assert all(v.dtype == np.float64 for v in results[-1].grads.values())
    assert_same_weights(model.values(sess), want, atol=1e-5)


class Case:
    """One dense model with a trainer, initialised, plus a batch split into 4 micro-batches."""

    def __init__(self, accumulate="sum", average="host", hooks=(), **model_kw):
        self.model = build(**model_kw)
        with self.model.graph.as_default():
            self.trainer = hostavg.Trainer(self.model.loss, v1.train.AdamOptimizer(0.01),
                                           accumulate=accumulate, average=average, hooks=hooks)
            self.init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.model.graph)
        self.sess.run(self.init)
        self.data = batches(3, 1, BATCH)[0]
        self.feeds = hostavg.split(self.model.feed(self.data), 10)

    def values(self):
        return self.model.values(self.sess)


def test_graph_average_runs_its_reduce_in_the_session():
    def averaging(calls):
        return [f for f in calls if all(name.startswith("hostavg_average/") for name in f)]

    for accumulate in ("sum", "stack"):
        case = Case(accumulate=accumulate, average="graph")
        host = Case(accumulate=accumulate)
        sess = FetchSpy(graph=case.model.graph)
        sess.run(case.init)
        sess.fetched.clear()
        got = case.trainer.step(sess, case.feeds).grads
        assert len(averaging(sess.fetched)) == 1
        assert len(averaging(sess.fetched)[0]) == len(got)
        want = host.trainer.step(host.sess, host.feeds).grads
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
        # The interactive accumulator of a graph-averaging trainer needs its session.
        acc = case.trainer.accumulator(sess)
        acc.add(case.trainer.compute(sess, case.feeds[0]))
        sess.fetched.clear()
        acc.mean()
        assert len(averaging(sess.fetched)) == 1 == len(sess.fetched)


def test_global_step_grows_by_one_per_step_whatever_the_micro_batches():
    case = Case()
    for k, step in [(1, 1), (4, 2), (40, 3)]:
        feeds = hostavg.split(case.model.feed(case.data), BATCH // k)
        assert len(feeds) == k
        assert case.trainer.step(case.sess, feeds).step == step
    assert case.sess.run(case.trainer.global_step) == 3
    assert case.sess.run(case.model.counter) == 1 + 4 + 40


def test_update_ops_run_with_every_micro_batch_not_with_apply():
    case = Case(update_op=True)
    ema = case.model.extra["ema"]
    h = case.model.graph.get_tensor_by_name("Tanh:0")
    hidden = [case.sess.run(h, f) for f in case.feeds]  # before the step moves the weights
    want = np.zeros(8, np.float32)
    for a in hidden:
        want = 0.5 * want + 0.5 * a.mean(0)
    res = case.trainer.step(case.sess, case.feeds)
    np.testing.assert_allclose(case.sess.run(ema), want, rtol=1e-5)
    case.trainer.apply(case.sess, res.grads)
    np.testing.assert_allclose(case.sess.run(ema), want, rtol=1e-5)


def test_variables_without_gradient_are_left_out_and_untouched():
    case = Case(unused=True)
    assert "unused" not in case.trainer.spec
    res = case.trainer.step(case.sess, case.feeds)
    assert set(res.grads) == {"hidden/kernel", "hidden/bias", "out/kernel", "out/bias"}
    np.testing.assert_array_equal(case.values()["unused"], np.ones(4))


def test_sparse_gradients_stay_sparse():
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    assert trainer.spec["embedding"].sparse
    data = batches(4, 1, BATCH, sparse=True)[0]
    res = trainer.step(sess, hostavg.split(model.feed(data), 10))
    seen = np.unique(data["ids"])
    mean = res.grads["embedding"]
    assert isinstance(mean, hostavg.SparseGradient)
    np.testing.assert_array_equal(mean.indices, seen)
    assert mean.values.shape == (len(seen), 6)
    for m in trainer.step(sess, hostavg.split(model.feed(data), 10)).micro:
        assert m.grads is None


# --- Bad input: one clear error, and nothing changed ----------------------------------


def unchanged(case, action, match, kind=hostavg.HostavgError):
    """Runs ``action``; asserts it raises ``kind`` matching ``match`` and changes nothing; returns the error."""
    before = case.values()
    with pytest.raises(kind, match=match) as raised:
        action()
    after = case.values()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    return raised.value


def test_step_errors_leave_everything_unchanged():
    case = Case(update_op=True)
    case.trainer.step(case.sess, case.feeds)  # slots and global step are non-trivial
    t, s, f = case.trainer, case.sess, case.feeds
    x = case.model.inputs["x"]
    unchanged(case, lambda: t.step(s, []), "step got no micro-batches")
    unchanged(case, lambda: t.step(s, f[0]), r"step takes a list of feed dicts.*hostavg\.split")
    y = case.model.inputs["y"]
    empty = {x: f[0][x][:0], y: f[0][y][:0]}
    unchanged(case, lambda: t.step(s, f[:2] + [empty]),
              r"micro-batch 2 of 3: a micro-batch must hold at least 1 sample, got 0")
    bad = [dict(g) for g in f] + [dict(f[0])]
    bad[2][x] = bad[2][x].copy()
    bad[2][x][3, 1] = np.nan
    unchanged(case, lambda: t.step(s, bad),
              r"^step, micro-batch 2 of 5 \(samples 20:30\): non-finite gradients in "
              r"'hidden/kernel' \(48 of 48 entries: 48 NaN, 0 Inf\), .* and the loss is nan\.")
    wrong_width = [dict(g) for g in f]
    wrong_width[2][x] = np.ones((10, 5), np.float32)
    unchanged(case, lambda: t.step(s, wrong_width),
              r"step, micro-batch 2 of 4: feed 'x:0' has shape \(10, 5\), but it takes shape "
              r"\(None, 6\)")
    other = build()
    with other.graph.as_default():
        stranger = v1.placeholder(np.float32, [None], name="stranger")
    unchanged(case, lambda: t.step(s, f[:1] + [{**f[1], stranger: np.ones(10)}]),
              r"micro-batch 1 of 2: feed key 'stranger:0' is not in the trainer's graph")
    unchanged(case, lambda: t.step(s, [{**f[0], "nope:0": np.ones(3)}]),
              r"feed key 'nope:0' names nothing in the trainer's graph")
    other_sess = v1.Session(graph=other.graph)
    unchanged(case, lambda: t.step(other_sess, f), "the session runs another graph")


def test_a_nan_gradient_is_named_by_variable_and_micro_batch():
    case = Case()
    g = [case.trainer.compute(case.sess, f) for f in case.feeds]
    poisoned = {name: np.array(v) for name, v in g[1].items()}
    poisoned["out/bias"][1] = np.inf
    acc = case.trainer.accumulator()
    acc.add(g[0])
    with pytest.raises(hostavg.HostavgError,
                       match=r"^micro-batch 1: non-finite gradients in 'out/bias' \(1 of 3 "
                             r"entries: 0 NaN, 1 Inf\)\. Nothing was applied"):
        acc.add(poisoned, weight=10)
    assert acc.count == 1 and acc.total_weight == 10


def test_apply_errors_leave_everything_unchanged():
    case = Case()
    case.trainer.step(case.sess, case.feeds)
    t, s = case.trainer, case.sess
    good = {k: np.array(v) for k, v in t.compute(s, case.feeds[0]).items()}

    def edited(**changes):
        out = dict(good)
        out.update(changes)
        return {k: v for k, v in out.items() if v is not None}

    unchanged(case, lambda: t.apply(s, edited(**{"out/bias": None})),
              re.escape("apply: gradient keys do not match the trained variables: "
                        "missing ['out/bias'], unexpected []"))
    unchanged(case, lambda: t.apply(s, edited(extra=np.ones(2))),
              re.escape("missing [], unexpected ['extra']"))
    unchanged(case, lambda: t.apply(s, edited(**{"out/bias": np.ones(4)})),
              re.escape("apply: gradient of 'out/bias' has shape (4,), expected the "
                        "variable's shape (3,)"))
    unchanged(case, lambda: t.apply(s, edited(**{"out/bias": np.ones(3, np.complex64)})),
              "gradient of 'out/bias' has dtype complex64, which does not cast safely")
    unchanged(case, lambda: t.apply(s, edited(**{"out/bias": np.array([0, np.nan, 0])})),
              r"apply: non-finite gradients in 'out/bias' \(1 of 3 entries: 1 NaN, 0 Inf\)")
    unchanged(case, lambda: t.apply(s, edited(**{"out/bias": np.array([0, 1e300, 0])})),
              r"apply: non-finite gradients in 'out/bias' \(1 of 3 entries: 0 NaN, 1 Inf\)")
    unchanged(case, lambda: t.apply(s, [1, 2]), "apply: gradients must be a mapping")


def test_constructor_errors():
    model = build(unused=True)
    with model.graph.as_default():
        opt = v1.train.AdamOptimizer(0.01)
        with pytest.raises(hostavg.HostavgError, match="loss must be a scalar .* got shape"):
            hostavg.Trainer(model.loss * np.ones(3, np.float32), opt)
        with pytest.raises(hostavg.HostavgError,
                           match="optimizer must be a tf.compat.v1.train.Optimizer .* got Adam"):
            import tensorflow as tf
            hostavg.Trainer(model.loss, tf.keras.optimizers.Adam())
        with pytest.raises(hostavg.HostavgError, match="nothing to train"):
            hostavg.Trainer(model.loss, opt, [model.extra["unused"]])
        with pytest.raises(hostavg.HostavgError, match="var_list is empty"):
            hostavg.Trainer(model.loss, opt, [])
        with pytest.raises(hostavg.HostavgError,
                           match=r"accumulate must be one of \('sum', 'stack'\), got 'mean'"):
            hostavg.Trainer(model.loss, opt, accumulate="mean")
        with pytest.raises(hostavg.HostavgError, match="average must be one of"):
            hostavg.Trainer(model.loss, opt, average="device")
        with pytest.raises(hostavg.HostavgError, match="accum_dtype must be a floating-point"):
            hostavg.Trainer(model.loss, opt, accum_dtype="int32")
    with pytest.raises(hostavg.HostavgError, match="loss must be a scalar tensor of a"):
        hostavg.Trainer(3.0, v1.train.AdamOptimizer(0.01))


# --- What a step tells about the weights and the data -------------------------------------

LEARNING_RATES = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01, "rmsprop": 0.01, "adagrad": 0.1}


def test_a_scheduled_learning_rate_is_read_at_its_apply_and_ref_variables_get_ratios():
    graph = v1.Graph()
    with graph.as_default():
        x = v1.placeholder(np.float32, [None, 2])
        w = v1.Variable(np.ones((2, 1), np.float32), use_resource=False, name="w")  # a ref variable
        step = v1.train.get_or_create_global_step()
        lr = v1.train.exponential_decay(0.5, step, decay_steps=1, decay_rate=0.5)
        trainer = hostavg.Trainer(v1.reduce_mean(v1.matmul(x, w) ** 2),
                                  v1.train.GradientDescentOptimizer(lr), update_ratios_every=1)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    feed = {x: np.array([[1.0, 2.0], [0.5, -1.0]], np.float32)}
    for k in range(3):
        before = sess.run(w)
        g = trainer.compute(sess, feed)["w"]
        res = trainer.step(sess, [feed])
        assert res.learning_rate == pytest.approx(0.5 * 0.5 ** k)  # the schedule before the increment
        want = np.linalg.norm(sess.run(w) - before) / np.linalg.norm(before)
        assert res.update_ratios["w"] == pytest.approx(want, rel=1e-5)
        assert want == pytest.approx(res.learning_rate * np.linalg.norm(g) / np.linalg.norm(before),
                                     rel=1e-5)


def test_rows_go_onto_micro_batches_and_into_errors():
    case = Case()
    rows = [np.arange(100, 110), [7, 3, 5, 1, 9, 2, 8, 4, 6, 0],
            np.random.default_rng(0).permutation(1000)[:10], np.arange(30, 40)]
    res = case.trainer.step(case.sess, case.feeds, rows=rows)
    for m, r in zip(res.micro, rows):
        np.testing.assert_array_equal(m.rows, r)
        assert m.rows.dtype == np.int64 and not m.rows.flags.writeable
    assert res.micro_table()["rows"].tolist()[1] == rows[1]
    x = case.model.inputs["x"]
    bad = [dict(f) for f in case.feeds]
    bad[2][x] = bad[2][x].copy()
    bad[2][x][4, 0] = np.nan
    error = unchanged(case, lambda: case.trainer.step(case.sess, bad, rows=rows),
                      r"^step, micro-batch 2 of 4 \(samples 20:30, data rows \[\d+, \d+, \d+, \d+, "
                      r"\.\.\.\] \(10 of them, between \d+ and \d+; the exception's \.rows holds "
                      r"all\)\): non-finite gradients")
    np.testing.assert_array_equal(error.rows, rows[2])
    unchanged(case, lambda: case.trainer.step(case.sess, [bad[0], bad[2]], rows=rows[:2]),
              r"step, micro-batch 1 of 2 \(samples 10:20, data rows \[7, 3, 5, 1, \.\.\.\]")
    unchanged(case, lambda: case.trainer.step(case.sess, case.feeds, rows=rows[:3]),
              r"rows must hold one array of row indices per micro-batch \(4\)")
    unchanged(case, lambda: case.trainer.step(case.sess, case.feeds, rows=[[1, 2]] * 4),
              r"micro-batch 0 of 4: rows must be 10 integer row indices, one per sample, got "
              r"shape \(2,\)")
    assert hostavg.engine.batches.describe_rows(np.arange(96, 128)) == "rows 96:128"


def test_per_sample_is_each_sample_alone_against_the_feeds_mean_and_changes_nothing():
    case = Case(update_op=True)
    feed = case.feeds[0]
    before = case.values()
    table = case.trainer.per_sample(case.sess, feed)
    after = case.values()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert list(table.columns) == ["loss", "norm", "cosine", "cosine_to_rest", "error"]
    assert len(table) == 10 and table["error"].isna().all()
    alone = [case.trainer.compute(case.sess, f) for f in hostavg.split(feed, 1)]
    whole = case.trainer.compute(case.sess, feed)
    flat = lambda g: np.concatenate([np.ravel(g[n]) for n in case.trainer.spec])  # noqa: E731
    mean = flat(whole)
    for i, g in enumerate(alone):
        assert table["loss"][i] == pytest.approx(g.loss, rel=1e-6)
        assert table["norm"][i] == pytest.approx(np.linalg.norm(flat(g)), rel=1e-5)
        want = flat(g) @ mean / (np.linalg.norm(flat(g)) * np.linalg.norm(mean))
        assert table["cosine"][i] == pytest.approx(want, rel=1e-4, abs=1e-6)

    x = case.model.inputs["x"]
    bad = dict(feed)
    bad[x] = feed[x].copy()
    bad[x][6, 2] = np.nan
    table = case.trainer.per_sample(case.sess, bad)
    assert np.isnan(table["norm"][6]) and np.isnan(table["cosine"][6])
    assert np.isnan(table["cosine_to_rest"][6]) and table["error"].isna().all()  # not an error
    numbers = table.drop(index=6).drop(columns="error")
    assert np.isfinite(numbers.to_numpy(float)).all()  # the mean of the other nine


def test_update_ratios_are_measured_every_so_many_steps_or_where_diagnose_asks_or_never():
    for every, diagnose, measured in ((2, False, [False, True, False, True]),
                                      (None, False, [False] * 4),
                                      (None, True, [True] * 4)):  # its first 20 applies
        case = Case()
        with case.model.graph.as_default():
            trainer = hostavg.Trainer(case.model.loss, v1.train.AdamOptimizer(0.01),
                                      update_ratios_every=every, diagnose=diagnose)
            case.sess.run(v1.global_variables_initializer())
        results = [trainer.step(case.sess, case.feeds) for _ in range(4)]
        assert [r.update_ratios is not None for r in results] == measured
        assert all(r.learning_rate == pytest.approx(0.01) for r in results)
    with pytest.raises(hostavg.HostavgError, match="update_ratios_every must be an integer >= 1, "
                                                   "got 0"):
        hostavg.Trainer(case.model.loss, v1.train.AdamOptimizer(0.01), update_ratios_every=0)


# --- One micro-batch averaged in the session --------------------------------------------------


@pytest.mark.parametrize("accumulate,sparse", [("stack", False), ("sum", True)],
                         ids=["dense-stack", "sparse-sum"])
def test_one_micro_batch_averaged_in_the_session_is_checked_on_its_own_mean(accumulate, sparse):
    """average="graph" once computed (w g) / w in the variable's dtype, which overflowed where
    w g did; the step's mean must be checked on its own values, not the micro-batch's norms."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None])
        if sparse:
            w = tf.Variable(np.zeros((4, 1), np.float32), name="w")
            ids = v1.placeholder(tf.int32, [None])
            loss = tf.reduce_mean(tf.nn.embedding_lookup(w, ids)[:, 0] * x) * 2.5  # rows 1.25e38
        else:
            w = tf.Variable(0.0, name="w")
            loss = tf.reduce_mean(w * x)  # gradient 1.5e38
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(1e-3),
                                  average="graph", accumulate=accumulate)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    feed = {x: np.full(3, 1.5e38, np.float32)}  # 3 samples: times 3, Inf
    if sparse:
        feed[ids] = np.array([0, 1, 2], np.int32)
    # The sums are kept in units of the largest weight (issue 24 item 10): w g no longer
    # overflows, and the step's mean is the micro-batch's own finite gradient, checked as such.
    alone = trainer.compute(sess, feed)
    res = trainer.step(sess, [feed])
    mean, own = res.grads["w"], alone["w"]
    if sparse:
        mean, own = mean.to_dense(), own.to_dense()
    assert np.all(np.isfinite(mean)) and res.stats.grad_norm == pytest.approx(alone.global_norm())
    np.testing.assert_allclose(mean, own, rtol=1e-6)


def kernel(model):
    return next(v for v in model.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
                if v.op.name == "hidden/kernel")


# --- var_list, accum_dtype, the variables -------------------------------------------------------


@pytest.mark.parametrize("given,match", [
    # Iterating a variable raised OperatorNotAllowedInGraphError.
    ("w", r"^var_list must be a list of variables, got the variable 'hidden/kernel'; e.g. "
          r"var_list=\[w\]$"),
    # NotImplementedError ('Trying to update a Tensor ', ...) from the optimizer.
    ("[loss]", r"^var_list holds the tensor 'Mean:0', not a variable; list the variables to "
               r"train$"),
    # "variable None of another graph".
    ("[None]", r"^var_list holds None, not a variable; list the variables to train$"),
    # Accepted, then the apply's feed was blamed ("fed more than once").
    ("[w, w]", r"^var_list holds 'hidden/kernel' twice; list each variable once$"),
    ("[other]", r"^var_list holds variable 'v:0' of another graph than the loss's; pass variables of "
                r"the graph the loss was built in$"),
])
def test_a_var_list_that_is_no_list_of_the_graphs_variables_is_refused(given, match):
    model = build()
    w = kernel(model)
    with tf.Graph().as_default():
        other = tf.Variable(1.0, name="v")
    var_list = {"w": w, "[loss]": [model.loss], "[None]": [None], "[w, w]": [w, w],
                "[other]": [other]}[given]
    with model.graph.as_default(), pytest.raises(hostavg.HostavgError, match=match):
        hostavg.Trainer(model.loss, sgd(), var_list=var_list)


def test_a_complex_variable_is_refused_naming_it():
    # TensorFlow's "Invalid type tf.complex64 for Variable:0" came out as a raw ValueError.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.complex64, [None, 2])
        w = tf.Variable(np.ones(2, np.complex64), name="c")
        loss = tf.math.real(tf.reduce_mean(tf.reduce_sum(x * w, 1)))
        with pytest.raises(hostavg.HostavgError, match=r"^the optimizer cannot train the variables "
                           r"the loss reaches \(Invalid type tf.complex64 for c:0, expected: .*\); "
                           r"hostavg trains real floating-point variables: leave the others out "
                           r"with var_list$"):
            hostavg.Trainer(loss, sgd())


def test_accum_dtype_takes_a_tensorflow_dtype():
    # accum_dtype=tf.float64 was refused ("must be a floating-point dtype ..., got tf.float64").
    model = build()
    with model.graph.as_default():
        assert hostavg.Trainer(model.loss, sgd(), accum_dtype=tf.float64).accum_dtype == np.float64
    assert hostavg.Accumulator({"w": hostavg.VariableSpec((1,), np.float32, False)},
                               accum_dtype=tf.float64).accum_dtype == np.float64


def test_an_accum_dtype_tensorflow_has_not_is_refused_with_average_graph():
    # TypeError: Cannot convert the argument `type_value`: dtype('float128') to a TensorFlow DType.
    model = build()
    with model.graph.as_default(), pytest.raises(
            hostavg.HostavgError, match=r"^accum_dtype float128 has no TensorFlow dtype, and "
                                        r"average='graph' sums in the session: pass float16, "
                                        r"float32 or float64, or average='host'$"):
        hostavg.Trainer(model.loss, sgd(), accum_dtype="longdouble", average="graph")


# --- evaluate's metrics, step_together --------------------------------------------------------


def test_evaluate_refuses_a_metric_of_another_graph_or_not_a_scalar(tf1):
    # A metric of another graph was blamed on "that micro-batch's feed".
    model, trainer, sess, feed = tf1
    with tf.Graph().as_default():
        other = tf.constant(1.0)
    with pytest.raises(hostavg.HostavgError, match=r"^evaluate: metric 'a' is 'Const:0', a tensor "
                                                   r"of another graph than the loss's; give a "
                                                   r"scalar tensor of the loss's graph$"):
        trainer.evaluate(sess, feed, batch_size=10, metrics={"a": other})
    with pytest.raises(hostavg.HostavgError, match=r"^evaluate: metric 'a' has shape \(None, 6\), "
                                                   r"not a scalar; give the mean over the batch$"):
        trainer.evaluate(sess, feed, batch_size=10, metrics={"a": model.inputs["x"]})
    with pytest.raises(hostavg.HostavgError, match=r"^evaluate: metric 'a' is 1.0, not a tensor of "
                                                   r"the loss's graph"):
        trainer.evaluate(sess, feed, batch_size=10, metrics={"a": 1.0})


def test_step_together_echoes_what_it_got(tf1):
    _, _, sess, _ = tf1
    with pytest.raises(hostavg.HostavgError, match=r"^step_together takes a list of "
                                                   r"\(trainer, batches\) pairs, got None$"):
        hostavg.step_together(sess, None)
