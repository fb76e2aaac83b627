"""Bad input, faults and misuse, grouped by kind: each case once gave a wrong result, a hang or a
raw error, and is kept here so that it stays fixed. Slow ones (subprocesses) are marked slow."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from models import ENV, AfterApply, FailAt, build, v1
from test_trainer import Case, unchanged

import hostavg
from hostavg.cli import models as hostavg_models
from hostavg.train.checkpoint import CheckpointDir
from hostavg.hooks import ClipGlobalNorm, ClipMicroBatchNorm, Record

HERE = Path(__file__).parent


def linear(dtype=np.float32, lr=1.0, hooks=(), accum_dtype=None, lr_placeholder=None):
    """loss = mean over samples of w . x, so w's gradient is the mean of x: a test picks it.

    ``lr_placeholder``: "required" or "default" makes the learning rate a placeholder.
    """
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(dtype, [None, 4], name="x")
        w = tf.Variable(np.zeros(4, dtype), name="w")
        loss = tf.reduce_mean(tf.reduce_sum(x * w, 1))
        if lr_placeholder == "required":
            lr = v1.placeholder(tf.float32, (), name="lr")
        elif lr_placeholder == "default":
            lr = v1.placeholder_with_default(np.float32(lr), (), name="lr")
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(lr), hooks=hooks,
                                  accum_dtype=accum_dtype)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    return trainer, sess, x, w, lr


def rows(x, value, n=2, dtype=np.float32):
    return {x: np.full((n, 4), value, dtype)}


# --- Feeds are checked like sess.run checks them, and stricter where NumPy changes values -----


@pytest.mark.parametrize("bad,match", [
    # The compiled call skips sess.run's shape check: (8, 1) broadcast against [None, 6].
    ("x", r"^step, micro-batch 1 of 4: feed 'x:0' has shape \(8, 1\), but it takes shape "
          r"\(None, 6\)"),
    # A Python int above int32's range raised a raw OverflowError.
    ("y_python", r"^step, micro-batch 1 of 4: feed 'y:0' holds values outside int32's range "
                 r"\[-2147483648, 2147483647\] \(min 1099511627776"),
    # A NumPy int64 above it wrapped around silently.
    ("y_int64", r"feed 'y:0' holds values outside int32's range .*max 1099511627776\)"),
    # Float labels were truncated silently.
    ("y_float", r"feed 'y:0' holds values that are not integers \(such as 1.5\) for a int32 "
                r"placeholder"),
    ("x_none", r"feed 'x:0' holds None of dtype object, but the placeholder takes float32"),
    ("x_text", r"feed 'x:0' holds 'a' of dtype <U1, but the placeholder takes float32"),
    ("x_tensor", r"feed 'x:0' is the graph element 'Const(_\d)?:0'; feed values, such as NumPy "
                 r"arrays, not tensors"),
    ("x_ragged", r"feed 'x:0' cannot be made an array"),
])
def test_a_bad_feed_is_refused_before_anything_runs_naming_key_and_micro_batch(bad, match):
    case = Case(update_op=True)
    x, y = case.model.inputs["x"], case.model.inputs["y"]
    with case.model.graph.as_default():
        tensor = tf.constant(1.0)
    feeds = [dict(f) for f in case.feeds]
    feeds[1] = {**feeds[1], **{
        "x": {x: np.ones((8, 1), np.float32)},
        "y_python": {y: [2 ** 40] * 10},
        "y_int64": {y: np.full(10, 2 ** 40)},
        "y_float": {y: np.full(10, 1.5)},
        "x_none": {x: None},
        "x_text": {x: "a"},
        "x_tensor": {x: tensor},
        "x_ragged": {x: [[1.0, 2.0], [3.0]]},
    }[bad]}
    unchanged(case, lambda: case.trainer.step(case.sess, feeds), match)
    assert case.sess.run(case.model.counter) == 0  # refused before any micro-batch ran


def test_feeds_that_convert_without_changing_a_value_are_taken():
    a, b = Case(), Case()
    x, y = a.model.inputs["x"], a.model.inputs["y"]
    feeds = [{x: f[x].astype(np.float64), y: f[y].astype(np.float64)} for f in a.feeds]
    got = a.trainer.step(a.sess, feeds)  # float64 inputs, whole-number float labels
    want = b.trainer.step(b.sess, b.feeds)
    for name in want.grads:
        np.testing.assert_allclose(got.grads[name], want.grads[name], rtol=1e-6, err_msg=name)


def test_a_placeholder_missing_from_a_later_micro_batch_is_refused_before_any_runs():
    # Micro-batch 0 ran (its UPDATE_OPS moved the moving mean, its hook was called) before the
    # session refused micro-batch 1 for the label it lacked.
    seen = []

    class Seen:
        def on_micro_batch(self, micro):
            seen.append(micro.index)

    case = Case(update_op=True, hooks=[Seen()])
    y = case.model.inputs["y"]
    feeds = [dict(f) for f in case.feeds]
    del feeds[1][y]
    unchanged(case, lambda: case.trainer.step(case.sess, feeds),
              r"^step, micro-batch 1 of 4: the graph reads placeholder 'y:0', which this feed "
              r"does not give; feed it to every micro-batch")
    assert case.sess.run(case.model.counter) == 0 and seen == []  # refused before any ran


# --- The train op's other inputs (a learning-rate placeholder) reach the apply ----------------


def test_a_learning_rate_placeholder_is_fed_to_the_apply_from_the_micro_batches():
    trainer, sess, x, w, lr = linear(lr_placeholder="required")
    assert trainer.apply_inputs == {"lr:0": lr}
    feeds = [{x: np.full((2, 4), 1.0, np.float32), lr: 0.5},
             {x: np.full((2, 4), 3.0, np.float32), lr: 0.5}]
    res = trainer.step(sess, feeds)
    np.testing.assert_array_equal(sess.run(w), np.full(4, -0.5 * 2.0, np.float32))
    trainer.step(sess, hostavg.split({x: np.ones((4, 4), np.float32), lr: 0.0}, 2))  # a schedule
    np.testing.assert_array_equal(sess.run(w), np.full(4, -1.0, np.float32))
    assert res.step == 1 and sess.run(trainer.global_step) == 2
    # apply takes it in feed_dict (by name too), and refuses to run without it.
    assert trainer.apply(sess, {"w": np.ones(4)}, feed_dict={"lr": 0.25}) == 3
    np.testing.assert_array_equal(sess.run(w), np.full(4, -1.25, np.float32))
    with pytest.raises(hostavg.HostavgError, match=r"^apply: the train op reads 'lr:0', which "
                       r"feed_dict 0 does not feed; pass it: trainer.apply\(sess, grads, "
                       r"feed_dict=\{placeholder: value\}\)"):
        trainer.apply(sess, {"w": np.ones(4)})
    assert sess.run(trainer.global_step) == 3


@pytest.mark.parametrize("feeds,match", [
    (lambda x, lr: [{x: np.ones((2, 4), np.float32), lr: 0.5},
                    {x: np.ones((2, 4), np.float32), lr: 0.1}],
     r"^step: micro-batches 0 and 1 feed different values to 'lr:0' \(0.5 and 0.1(0000\d+)?\), "
     r"which the train op reads; the train op runs once per step"),
    (lambda x, lr: [{x: np.ones((2, 4), np.float32)}],
     r"^step: the train op reads 'lr:0', which micro-batch 0 does not feed; feed it, the same "
     r"value, to every micro-batch"),
])
def test_a_learning_rate_that_differs_or_is_missing_is_refused_before_anything_runs(feeds, match):
    trainer, sess, x, w, lr = linear(lr_placeholder="required")
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.step(sess, feeds(x, lr))
    assert sess.run(trainer.global_step) == 0


def test_a_learning_rate_with_a_default_may_go_unfed():
    trainer, sess, x, w, lr = linear(lr=0.25, lr_placeholder="default")
    trainer.step(sess, [rows(x, 1.0)])
    np.testing.assert_array_equal(sess.run(w), np.full(4, -0.25, np.float32))
    trainer.step(sess, [{**rows(x, 1.0), lr: 1.0}])
    np.testing.assert_array_equal(sess.run(w), np.full(4, -1.25, np.float32))


# --- A sparse value for a dense variable is checked before it is densified ----------------------


@pytest.mark.parametrize("indices,values,shape,match", [
    ([-1], np.ones((1, 8)), (6, 8), r"row indices outside \[0, 6\): min -1"),  # updated the last row
    ([6], np.ones((1, 8)), (6, 8), r"row indices outside \[0, 6\): min 6, max 6"),
    ([0.0], np.ones((1, 8)), (6, 8), r"needs 1-D integer indices, got shape \(1,\) dtype float64"),
    ([True], np.ones((1, 8)), (6, 8), r"needs 1-D integer indices"),
    ([0], np.ones((1, 3)), (6, 8), r"has values of shape \(1, 3\), expected \(1, 8\)"),
    ([0], np.ones((1, 8)), (60, 8), r"has dense_shape \(60, 8\), but the variable's shape is "
                                    r"\(6, 8\)"),
])
def test_a_bad_sparse_value_for_a_dense_variable_is_refused(indices, values, shape, match):
    case = Case()
    grads = {n: np.zeros(s.shape) for n, s in case.trainer.spec.items()}
    grads["hidden/kernel"] = hostavg.SparseGradient(np.array(indices), values, shape)
    unchanged(case, lambda: case.trainer.apply(case.sess, grads),
              r"^apply: (sparse )?gradient of 'hidden/kernel' .*" + match)


def test_a_good_sparse_value_for_a_dense_variable_applies_as_its_dense_sum():
    a, b = Case(), Case()
    grads = {n: np.zeros(s.shape) for n, s in a.trainer.spec.items()}
    sparse = dict(grads, **{"hidden/kernel": hostavg.SparseGradient(
        np.array([2, 0, 2]), np.arange(24.0).reshape(3, 8), (6, 8))})
    dense = dict(grads, **{"hidden/kernel": sparse["hidden/kernel"].to_dense()})
    a.trainer.apply(a.sess, sparse)
    b.trainer.apply(b.sess, dense)
    for name, value in b.values().items():
        np.testing.assert_array_equal(a.values()[name], value, err_msg=name)


# --- Norms and statistics do not overflow; an overflowing sum is named as one ------------------


def test_norms_of_huge_finite_gradients_are_finite_in_every_dtype():
    for value, dtype, want in ((1e20, np.float32, 2e20), (100.0, np.float16, 200.0),
                               (1e160, np.float64, 2e160)):
        g = hostavg.Gradients({"w": np.full(4, value, dtype)})
        assert g.global_norm() == pytest.approx(want, rel=1e-3), dtype
    inf = hostavg.Gradients({"w": np.array([1e160, np.inf])})
    assert inf.global_norm() == np.inf
    assert np.isnan(hostavg.Gradients({"w": np.array([1e160, np.inf, np.nan])}).global_norm())


@pytest.mark.parametrize("hook", [ClipGlobalNorm(1.0), ClipMicroBatchNorm(1.0)],
                         ids=["global", "micro"])
def test_clipping_a_huge_finite_gradient_applies_a_unit_step_not_zero(hook):
    trainer, sess, x, w, _ = linear(hooks=[hook])
    g = trainer.compute(sess, rows(x, 1e20))
    assert g.sq_norms["w"] == pytest.approx(4e40, rel=1e-6)  # the session's float32 sum was inf
    res = trainer.step(sess, [rows(x, 1e20), rows(x, 1e20)])
    np.testing.assert_allclose(sess.run(w), np.full(4, -0.5), rtol=1e-6)
    assert res.stats.grad_norm == pytest.approx(1.0, rel=1e-6)
    assert res.stats.micro_norms == pytest.approx((2e20, 2e20) if isinstance(hook, ClipGlobalNorm)
                                                  else (1.0, 1.0), rel=1e-6)
    before = res.info.get("grad_norm_before_clip") or res.info["micro_norms_before_clip"][0]
    assert before == pytest.approx(2e20, rel=1e-6)


def test_half_precision_norms_are_summed_in_float32_in_the_graph():
    trainer, sess, x, w, _ = linear(dtype=np.float16, lr=1e-3, hooks=[ClipGlobalNorm(1.0)])
    g = trainer.compute(sess, rows(x, 158.0, dtype=np.float16))  # norm 316: its square passes 65504
    assert g.sq_norms["w"] == pytest.approx(4 * 158.0 ** 2)
    res = trainer.step(sess, [rows(x, 158.0, dtype=np.float16)])
    assert res.info["grad_norm_before_clip"] == pytest.approx(316.0)
    np.testing.assert_allclose(sess.run(w), np.full(4, -0.5e-3), rtol=1e-2)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the case itself
def test_an_overflowing_running_sum_is_named_and_float64_accumulation_fixes_it():
    trainer, sess, x, w, _ = linear(lr=1e-37)
    feeds = [rows(x, 2e38), rows(x, 2e38)]  # each finite; their float32 sum is not
    with pytest.raises(hostavg.HostavgError, match=r"^step, the mean: non-finite gradients in 'w' "
                       r".*Every micro-batch's gradients were finite, so their weighted sum "
                       r"overflowed the accumulation dtype: accumulate in float64 with "
                       r"accum_dtype='float64'"):
        trainer.step(sess, feeds)
    trainer, sess, x, w, _ = linear(lr=1e-37, accum_dtype="float64")
    res = trainer.step(sess, [rows(x, 2e38), rows(x, 2e38)])
    np.testing.assert_allclose(sess.run(w), np.full(4, -20.0), rtol=1e-6)
    assert res.stats.grad_norm == pytest.approx(4e38, rel=1e-6)
    assert np.isfinite(res.stats.trace_sigma)  # no Inf - Inf


def test_stack_statistics_of_huge_gradients_are_finite():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4])
        w = tf.Variable(np.zeros(4, np.float32))
        trainer = hostavg.Trainer(tf.reduce_mean(tf.reduce_sum(x * w, 1)),
                                  v1.train.GradientDescentOptimizer(1e-30), accumulate="stack")
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    res = trainer.step(sess, [{x: np.full((1, 4), v, np.float32)} for v in (1e20, 3e20)])
    assert res.stats.cosines == pytest.approx((1.0, 1.0))
    assert np.isfinite(res.stats.inner_product_test) and np.isfinite(res.stats.gsnr)


def test_a_nan_an_on_step_hook_puts_in_is_blamed_on_the_hook():
    class Poisoner:
        def on_step(self, mean, result):
            return {name: np.full(np.shape(v), np.nan) for name, v in mean.items()}

    case = Case(update_op=True, hooks=[Poisoner()])
    unchanged(case, lambda: case.trainer.step(case.sess, case.feeds),
              r"^step, the mean that on_step hook Poisoner returned: non-finite .* Look at that "
              r"hook\.$")


# --- Signals: a step is applied completely or not at all ----------------------------------------


def signal_at(signum, at):
    """What AfterApply calls: sends this process ``signum`` as apply number ``at`` returns."""
    return lambda n: os.kill(os.getpid(), signum) if n == at else None


def test_ctrl_c_as_the_apply_returns_leaves_the_step_applied_whole():
    want = Case(update_op=True)
    want.trainer.step(want.sess, want.feeds)
    got = Case(update_op=True)
    got.sess = AfterApply(signal_at(signal.SIGINT, 1), graph=got.model.graph)
    got.sess.run(got.init)
    with pytest.raises(KeyboardInterrupt):
        got.trainer.step(got.sess, got.feeds)
    # Once the step had returned. Before, the rollback put the moving mean back over the apply.
    for name, value in want.values().items():
        np.testing.assert_array_equal(got.values()[name], value, err_msg=name)


def test_ctrl_c_before_the_apply_rolls_the_step_back():
    class Interrupt:
        def on_micro_batch(self, micro):
            if micro.index == 2:
                os.kill(os.getpid(), signal.SIGINT)

    case = Case(update_op=True, hooks=[Interrupt()])
    unchanged(case, lambda: case.trainer.step(case.sess, case.feeds), None, KeyboardInterrupt)


def fit_setup(then=None):
    """A small MLP's trainer, session (an AfterApply calling ``then``, if given) and data."""
    model = hostavg_models.mlp(10, [16], 3, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    sess = AfterApply(then, graph=model.graph) if then else v1.Session(graph=model.graph)
    sess.run(init)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(250, 10)).astype(np.float32)
    return trainer, sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}


def variables(trainer, sess):
    names = trainer.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in names], sess.run(names)))


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


FIT = dict(batch_size=50, micro_batch_size=20, epochs=2, seed=3, progress=False)


def test_sigterm_as_an_apply_returns_checkpoints_a_position_that_resumes_bit_for_bit(tmp_path):
    trainer, sess, data = fit_setup()
    trainer.fit(sess, data, **FIT)
    want = variables(trainer, sess)

    trainer, sess, data = fit_setup(signal_at(signal.SIGTERM, 3))
    with pytest.raises(SystemExit) as exit_:
        trainer.fit(sess, data, checkpoint_dir=tmp_path, **FIT)
    assert exit_.value.code == 128 + signal.SIGTERM
    state = trainer.restore(sess, CheckpointDir(tmp_path).latest())
    assert sess.run(trainer.global_step) == 3
    assert (state["epoch"], state["batch"], state["samples"]) == (0, 3, 150)
    trainer, sess, data = fit_setup()
    history = trainer.fit(sess, data, checkpoint_dir=tmp_path, **FIT)
    assert_bitwise(variables(trainer, sess), want)
    assert [s.step for s in history.steps] == list(range(1, 11))


@pytest.mark.slow
def test_sigterm_at_random_moments_always_resumes_bit_for_bit(tmp_path):
    """12 runs, each sent a real SIGTERM at a random moment of its training, through fit's
    handler, then resumed from its checkpoint: each ends with the straight run's variables, bit
    for bit. One process trains them one after the other (fit_script.py --rounds), each resume
    with a new graph and session, as a restarted process would; each apply takes 10 ms more, as
    on a slow device, so that many signals land as one returns."""
    runs, rng = 12, np.random.default_rng()
    proc = subprocess.Popen([sys.executable, str(HERE / "fit_script.py"), "--rounds",
                             str(tmp_path), "10", "0.01"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        expect(proc, "started")
        started = time.monotonic()
        expect(proc, "straight")
        training = time.monotonic() - started
        exits = []
        for n in range(runs):
            proc.stdin.write(f"{n}\n")
            proc.stdin.flush()
            expect(proc, "started")
            time.sleep(rng.uniform(0, training))
            proc.send_signal(signal.SIGTERM)
            exits.append(json.loads(expect(proc, f"done {n}")))
        proc.stdin.close()
        outside = int(expect(proc, "outside"))
        assert proc.wait(60) == 0
    finally:
        watchdog.cancel()
        proc.stdout.close()
    want = dict(np.load(tmp_path / "straight.npz"))
    resumed = sum(got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
                  for got in (dict(np.load(tmp_path / f"run{n}.npz")) for n in range(runs)))
    interrupted = sum(e == [128 + signal.SIGTERM] for e in exits)
    print(f"SIGTERM: {interrupted} of {runs} runs interrupted mid-training, {resumed} of {runs} "
          f"resumed bit for bit")
    # 143: fit's SystemExit; every other signal landed before fit began or after it ended.
    assert resumed == runs and interrupted + outside == runs, (exits, outside)
    # Enough landed mid-training for the test to mean something (the moments are random).
    assert interrupted >= runs // 3, exits


def expect(proc, word: str) -> str:
    """The rest of the first line of ``proc``'s output that starts with ``word``."""
    seen = []
    for line in proc.stdout:
        if (line.rstrip("\n") + " ").startswith(word + " "):
            return line[len(word):].strip()
        seen.append(line)
    raise AssertionError(f"no {word!r} from the fit script: rc {proc.wait()}\n{''.join(seen)}")


# --- Resume: the position is samples, so another batch size continues at the right one ---------


def test_a_resume_with_another_batch_size_continues_at_the_next_sample(tmp_path):
    trainer, sess, data = fit_setup()
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.fit(sess, data, checkpoint_dir=tmp_path, callbacks=[FailAt(2)], **FIT)
    state = trainer.restore(sess, CheckpointDir(tmp_path).latest())
    assert {k: state[k] for k in ("epoch", "batch", "samples", "batch_size")} == {
        "epoch": 0, "batch": 2, "samples": 100, "batch_size": 50}

    trainer, sess, data = fit_setup()
    history = trainer.fit(sess, data, checkpoint_dir=tmp_path, **dict(FIT, batch_size=25, epochs=1))
    # From sample 100 on in batches of 25 (a batch index of 2 read as 2 * 25 trained 50:100 twice).
    assert [s.size for s in history.steps] == [50, 50] + [25] * 6
    assert history.epochs[0]["samples"] == 250

    want, want_sess, want_data = fit_setup()  # the same samples in the same order, by hand
    order = np.random.default_rng([FIT["seed"], 0]).permutation(250)
    for lo, hi in [(0, 50), (50, 100)] + [(a, a + 25) for a in range(100, 250, 25)]:
        batch = {k: v[order[lo:hi]] for k, v in want_data.items()}
        want.step(want_sess, hostavg.split(batch, FIT["micro_batch_size"]))
    assert_bitwise(variables(trainer, sess), variables(want, want_sess))


# --- Variables made from one initial-value tensor are set each to its own value ---------------


def test_variables_made_from_one_initial_value_are_restored_each_to_its_own(tmp_path):
    # load_variables fed each variable's initial value: {t: a's value, t: b's value} is one
    # dict key, so restore and a failed step's rollback gave both variables b's value.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        t = tf.zeros([3])
        w = tf.Variable(np.ones(3, np.float32), name="w")
        low, high = tf.Variable(t, trainable=False, name="low"), tf.Variable(t, trainable=False,
                                                                            name="high")
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, low.assign_sub(tf.reduce_mean(x, 0)))
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, high.assign_add(tf.reduce_mean(x, 0)))
        trainer = hostavg.Trainer(tf.reduce_mean(tf.reduce_sum(x * w, 1)),
                                  v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    assert {v.op.name for v in trainer.rollback_variables} == {"low", "high"}
    sess = v1.Session(graph=graph)
    sess.run(init)
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    trainer.step(sess, hostavg.split({x: data}, 2))
    before = sess.run({"low": low, "high": high, "w": w})
    assert not np.array_equal(before["low"], before["high"])
    bad = data.copy()
    bad[3, 0] = np.nan
    with pytest.raises(hostavg.HostavgError, match="micro-batch 1 of 2 .*non-finite"):
        trainer.step(sess, hostavg.split({x: bad}, 2))
    for name, value in sess.run({"low": low, "high": high, "w": w}).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    trainer.save(sess, tmp_path / "ckpt.npz")
    trainer.step(sess, hostavg.split({x: data}, 2))
    trainer.restore(sess, tmp_path / "ckpt.npz")
    for name, value in sess.run({"low": low, "high": high, "w": w}).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


# --- Restore checks everything before changing anything ----------------------------------------


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> dict:
    """A checkpoint fit wrote, as its arrays ("meta" decoded)."""
    folder = tmp_path_factory.mktemp("good")
    trainer, sess, data = fit_setup()
    trainer.fit(sess, data, checkpoint_dir=folder, **dict(FIT, epochs=1))
    with np.load(CheckpointDir(folder).latest()) as z:
        arrays = dict(z)
    arrays["meta"] = json.loads(str(arrays["meta"][()]))
    return arrays


def damaged(path, good, change):
    """``good`` with ``change`` made to its arrays, written to ``path``."""
    arrays = {**good, "meta": json.loads(json.dumps(good["meta"]))}  # the metadata copied deep
    change(arrays)
    if not isinstance(arrays["meta"], str):
        arrays["meta"] = json.dumps(arrays["meta"])
    arrays["meta"] = np.array(arrays["meta"])
    np.savez(path, **arrays)
    return path


def fit_state(**changes):
    def change(arrays):
        arrays["meta"]["fit"].update(changes)
    return change


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(meta="{not json"), r"is not a readable hostavg checkpoint \(JSONDecodeError"),
    (lambda a: a.update(meta="[1, 2]"), r"is damaged: its metadata is not hostavg's format 1"),
    (lambda a: a["meta"].pop("variables"), r"is damaged: its metadata's variables are not"),
    (lambda a: a["meta"]["variables"].update({"logits/bias": [[3], 7]}),
     r"is damaged: its metadata's variables are not"),
    (lambda a: a.pop("var/logits/bias"), r"is not a readable .* \(KeyError: .*logits/bias"),
    (lambda a: a.update({"var/logits/bias": np.zeros(4, np.float32)}),
     r"is damaged: \['logits/bias' is \(4,\) <f4, its metadata says \(3,\) <f4\]"),
    (fit_state(epoch=-1), r"is damaged: fit's state has epoch -1"),
    (fit_state(batch_size=0, seed="7"), r"is damaged: fit's state has batch_size 0, seed '7'"),
    (lambda a: a["meta"]["fit"].pop("samples"), r"fit's state must hold exactly \['batch', "),
    (fit_state(history="{}"), r"is damaged: fit's history: not a History's JSON \(KeyError"),
    (fit_state(history='{"steps": [[1]], "epochs": [], "stopped": null}'),
     r"fit's history: not a History's JSON \(TypeError"),
])
def test_a_damaged_checkpoint_changes_nothing_and_says_so(tmp_path, good_checkpoint, change, match):
    path = damaged(tmp_path / "damaged.npz", good_checkpoint, change)
    trainer, sess, data = fit_setup()
    before = variables(trainer, sess)
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.restore(sess, path)
    assert_bitwise(variables(trainer, sess), before)
    # fit refuses it the same way, before training.
    (tmp_path / "dir").mkdir()
    os.replace(path, tmp_path / "dir" / "ckpt-0000000009.npz")
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.fit(sess, data, checkpoint_dir=tmp_path / "dir", **FIT)
    assert_bitwise(variables(trainer, sess), before)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporaries_of_killed_writers_are_removed_by_the_next_save(tmp_path):
    trainer, sess, data = fit_setup()
    folder = CheckpointDir(tmp_path)
    stale = tmp_path / f".ckpt-0000000007.npz.{dead_pid()}.x1y2.tmp"
    live = tmp_path / f".ckpt-0000000008.npz.{os.getppid()}.x1y2.tmp"  # a running writer
    other = tmp_path / f".notes.txt.{dead_pid()}.x1y2.tmp"  # not ours
    for path in (stale, live, other):
        path.write_bytes(b"half-written")
    folder.save(1, lambda path: trainer.save(sess, path))
    assert not stale.exists() and live.exists() and other.exists()
    assert [p.name for p in folder.checkpoints()] == ["ckpt-0000000001.npz"]


def test_a_damaged_record_file_is_named_and_the_other_steps_stay_readable(tmp_path):
    case = Case(hooks=[Record(tmp_path / "rec")])
    for _ in range(3):
        case.trainer.step(case.sess, case.feeds)
    step2 = tmp_path / "rec" / "step-0000000002.npz"
    step2.write_bytes(step2.read_bytes()[:200])
    stale = tmp_path / "rec" / f".step-0000000004.npz.{dead_pid()}.ab.tmp"
    stale.write_bytes(b"half")
    record = hostavg.load_record(tmp_path / "rec")
    assert record.steps == [1, 2, 3]
    for step in (1, 3):
        assert record[step].mean.keys() == case.trainer.spec.keys()
    with pytest.raises(hostavg.HostavgError, match=r"the record's file .*step-0000000002.npz is "
                       r"damaged \(BadZipFile: .*\); the other steps stay readable"):
        record[2]
    with pytest.raises(hostavg.HostavgError, match="step-0000000002.npz is damaged"):
        record.to_pandas()
    Record(tmp_path / "rec")  # a new writer clears what a killed one left
    assert not stale.exists()


# --- fit: no silent empty runs; None where a list is expected -----------------------------------


@pytest.mark.parametrize("make,kw,match", [
    (lambda d: {k: v[:0] for k, v in d.items()}, {},
     r"^data holds 0 samples, so an epoch has no batch of batch_size 50; fit needs at least one"),
    (lambda d: {k: v[:30] for k, v in d.items()}, {"drop_remainder": True},
     r"^data holds 30 samples, so an epoch has no batch of batch_size 50 \(drop_remainder\)"),
    (lambda d: [], {}, r"^epoch 0 trained no step: the data gave 0 batches; fit needs at least one"),
    (lambda d: [{k: v[:30] for k, v in d.items()}], {"drop_remainder": True},
     r"^epoch 0 trained no step: the data gave 1 batches, every one shorter than batch_size and "
     r"dropped \(drop_remainder\)"),
    (lambda d: tf.data.Dataset.from_tensor_slices({"x": np.zeros((0, 10), np.float32)}),
     {"inputs": "x"}, r"^data holds 0 samples"),
])
def test_fit_refuses_data_that_gives_no_step(make, kw, match):
    trainer, sess, data = fit_setup()
    before = variables(trainer, sess)
    if kw.get("inputs") == "x":
        kw = {"inputs": {"x": trainer.graph.get_tensor_by_name("x:0")}}
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.fit(sess, make(data), **dict(FIT, **kw))
    assert_bitwise(variables(trainer, sess), before)


def test_none_for_hooks_and_callbacks_means_none_and_a_lone_object_is_refused():
    trainer, sess, data = fit_setup()
    history = trainer.fit(sess, data, callbacks=None, **dict(FIT, epochs=1))
    assert len(history.steps) == 5
    with pytest.raises(hostavg.HostavgError, match=r"^callbacks must be a list of objects with "
                       r"on_micro_batch or on_step or on_applied or on_resume or on_train_begin "
                       r"or on_epoch_begin or on_batch_begin or on_batch_end or on_epoch_end or "
                       r"on_train_end or close or on_step_end \(or None\), got "
                       r"<hostavg.train.callbacks.EarlyStopping"):
        trainer.fit(sess, data, callbacks=hostavg.EarlyStopping(), **FIT)
    model = build()
    with model.graph.as_default():
        assert hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.1), hooks=None).hooks == ()
        with pytest.raises(hostavg.HostavgError, match=r"^hooks must be a list of objects with "
                           r"on_micro_batch or on_step or on_applied or on_resume or "
                           r"on_train_begin or on_epoch_begin or on_batch_begin or on_batch_end "
                           r"or on_epoch_end or on_train_end or close or on_step_end "
                           r"\(or None\), got "
                           r"<hostavg.train.hooks.SkipNonFinite"):
            hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.1),
                            hooks=hostavg.hooks.SkipNonFinite())


def test_misuse_gets_one_clear_error():
    with pytest.raises(hostavg.HostavgError, match=r"^split takes a feed dict \{placeholder: "
                       r"array\} or a tuple \(x, y\), got list"):
        hostavg.split([np.zeros(4)], 2)
    model, other = build(), build()
    with model.graph.as_default():
        foreign = other.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)[0]
        with pytest.raises(hostavg.HostavgError, match=r"^var_list holds variable 'hidden/kernel:0' "
                           r"of another graph than the loss's"):
            hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.1), var_list=[foreign])
    trainer, sess, data = fit_setup()
    with trainer.graph.as_default():
        graph_mode = tf.data.Dataset.from_tensor_slices({"x": np.zeros((4, 10), np.float32)})
    with pytest.raises(hostavg.HostavgError, match=r"^fit reads a tf.data.Dataset eagerly, but "
                       r"this one is in graph mode"):
        trainer.fit(sess, graph_mode, inputs={"x": trainer.graph.get_tensor_by_name("x:0")},
                    **FIT)



# --- The command line: one line, exit status 2, before any training -----------------------------


def one_line(capsys, argv, match):
    from hostavg.cli import main
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(main(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_command_line_mistakes_are_one_line_before_any_training(tmp_path, capsys):
    train = ["train", "--dataset", "digits", "--epochs", "1", "--quiet"]
    a_file = tmp_path / "file"
    a_file.write_text("")
    one_line(capsys, [*train, "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'")
    one_line(capsys, [*train, "--checkpoint-dir", str(a_file)],
             f"hostavg train: error: --checkpoint-dir '{a_file}' is a file, not a folder")
    one_line(capsys, [*train, "--checkpoint-dir", str(a_file / "sub")],
             f"--checkpoint-dir '{a_file / 'sub'}': '{a_file}' is not a writable folder")
    one_line(capsys, [*train, "--hidden", "1000000000"],
             "hostavg train: error: --hidden 1000000000 makes an MLP of 75,000,000,010 parameters, "
             "which needs about")
    one_line(capsys, [*train, "--lr", "inf"], "--lr must be a finite number > 0, got inf")
    for command in (train, ["bench"]):
        one_line(capsys, [*command, "--json", str(tmp_path / "missing" / "out.json")],
                 f"argument --json: the folder '{tmp_path / 'missing'}' of")
    one_line(capsys, [*train, "--json", str(tmp_path)], "is a folder; name a file")


def test_a_session_closed_mid_step_is_the_error_reported_not_the_failed_rollback():
    class Closer:
        def __init__(self):
            self.sess = None

        def on_micro_batch(self, micro):
            if micro.index == 1:
                self.sess.close()

    closer = Closer()
    case = Case(update_op=True, hooks=[closer])
    closer.sess = case.sess
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 2 of 4 \(samples 20:30\): "
                       r"the session failed in the snapshot of the rollback variables "
                       r"\(\w+Error: Session has been closed") as raised:
        case.trainer.step(case.sess, case.feeds)
    assert "hostavg: restoring the variables the micro-batches assign failed too" in \
        raised.value.__notes__[0]
