"""The step engine's promises, each tried against the way it was once broken: ownership of
arrays, one step at a time, a rollback that does not grow with frozen variables, errors that
name the real culprit, op-name feed keys and 0-d variables; a step's norms are those of the
mean it applied, and a mean that overflows only when cast is refused."""

import math
import re
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from models import (OPTIMIZERS, FetchSpy, assert_bitwise, batches, build, cuts, linear, micro_feeds,
                    poisoned, repeating_batches, v1)
from test_trainer import BATCH, Case, unchanged

import hostavg
from hostavg.hooks import Drop

# --- Ownership: what hostavg hands out is read-only; what it receives is copied ------------


def test_the_applied_mean_is_read_only_and_an_edited_copy_is_checked_again():
    case = Case()
    res = case.trainer.step(case.sess, case.feeds)
    for value in list(res.grads.values()) + list(case.trainer.compute(case.sess, case.feeds[0]).values()):
        assert not value.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            value[...] = np.nan
    for value in res.grads.values():  # hostavg's own arrays: the flag cannot be set back
        with pytest.raises(ValueError):
            value.flags.writeable = True
    edited = {name: np.array(value) for name, value in res.grads.items()}
    edited["hidden/kernel"][0, 0] = np.nan
    unchanged(case, lambda: case.trainer.apply(case.sess, edited),
              r"apply: non-finite gradients in 'hidden/kernel' \(1 of 48 entries: 1 NaN")


def test_a_norm_cached_for_someone_elses_array_is_not_trusted():
    case = Case()
    g = case.trainer.compute(case.sess, case.feeds[0])
    assert g.sq_norms.keys() == g.keys()  # the session's own, on frozen arrays
    mine = {name: np.array(value) for name, value in g.items()}
    claimed = hostavg.Gradients(mine, loss=g.loss, size=g.size, sq_norms=g.sq_norms)
    assert claimed.sq_norms == {}
    mine["out/bias"][0] = np.inf
    acc = case.trainer.accumulator()
    with pytest.raises(hostavg.HostavgError, match=r"non-finite gradients in 'out/bias'"):
        acc.add(claimed)


def test_an_on_step_hook_that_edits_the_mean_in_place_is_stopped_and_named():
    class Vandal:
        def on_step(self, mean, result):
            mean["out/bias"][0] = np.nan  # returns None: the edit would go unseen

    case = Case(update_op=True, hooks=[Vandal()])
    raised = unchanged(case, lambda: case.trainer.step(case.sess, case.feeds), "read-only",
                       ValueError)
    assert raised.__notes__ == ["hostavg: raised by hook Vandal in on_step of step 1; nothing was "
                                "applied"]


@pytest.mark.parametrize("accumulate", ["sum", "stack"])
def test_a_reused_buffer_gives_the_same_mean_in_sum_and_stack(accumulate):
    spec = {"w": hostavg.VariableSpec((3,), np.dtype("float64"), False),
            "e": hostavg.VariableSpec((5, 2), np.dtype("float64"), True)}
    acc = hostavg.Accumulator(spec, accumulate=accumulate)
    dense, rows = np.empty(3), np.empty((2, 2))
    for i in range(3):  # one buffer, filled anew for every micro-batch
        dense[:] = i + 1
        rows[:] = 10 * (i + 1)
        acc.add({"w": dense, "e": hostavg.SparseGradient(np.array([1, 3]), rows, (5, 2))},
                weight=1)
    dense[:], rows[:] = -100, -100  # and changed after the last add
    mean = acc.mean()
    np.testing.assert_array_equal(mean["w"], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(mean["e"].indices, [1, 3])
    np.testing.assert_array_equal(mean["e"].values, np.full((2, 2), 20.0))


def test_a_hook_that_returns_an_array_it_later_changes_changes_nothing():
    class Keeper:
        """Returns its own buffer as the replacement, then scribbles on it."""

        def __init__(self):
            self.buffers = []

        def on_micro_batch(self, micro):
            out = {name: np.array(value) for name, value in micro.grads.items()}
            self.buffers.append(out)
            return out

        def on_step(self, mean, result):
            for out in self.buffers:
                for value in out.values():
                    value[...] = np.nan
            self.buffers = []

    plain, kept = Case(accumulate="stack"), Case(accumulate="stack", hooks=[Keeper()])
    want = plain.trainer.step(plain.sess, plain.feeds)
    got = kept.trainer.step(kept.sess, kept.feeds)
    for name in want.grads:
        np.testing.assert_array_equal(got.grads[name], want.grads[name])
        for a, b in zip(got.micro, want.micro):
            np.testing.assert_array_equal(a.grads[name], b.grads[name])


# --- One step at a time -------------------------------------------------------------------


def test_a_second_concurrent_step_is_refused_and_the_first_is_unharmed():
    entered, release = threading.Event(), threading.Event()

    class Gate:
        def on_micro_batch(self, micro):
            if micro.index == 0:
                entered.set()
                release.wait(30)

    case = Case(hooks=[Gate()])
    trainer = case.trainer
    results = []
    first = threading.Thread(target=lambda: results.append(trainer.step(case.sess, case.feeds)))
    first.start()
    assert entered.wait(30)
    with pytest.raises(hostavg.HostavgError, match="another step of this trainer is running"):
        trainer.step(case.sess, case.feeds)
    release.set()
    first.join(30)
    assert results[0].size == BATCH and results[0].step == 1
    assert trainer.step(case.sess, case.feeds).step == 2  # the lock was released


def test_two_threads_hammering_one_trainer_never_get_an_inconsistent_step():
    class Yield:
        """Lets the other thread run between micro-batches, as a slower model would."""

        def on_micro_batch(self, micro):
            time.sleep(0.001)

    case = Case(hooks=[Yield()])
    results, refusals, other = [], [], []

    def worker():
        for _ in range(30):
            try:
                results.append(case.trainer.step(case.sess, case.feeds))
            except hostavg.HostavgError as e:
                refusals.append(str(e))
            except Exception as e:  # noqa: BLE001 - recorded, then asserted empty
                other.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not other
    assert all("another step of this trainer is running" in r for r in refusals)
    assert len(results) + len(refusals) == 60
    assert all(r.size == r.grads.size == BATCH and len(r.micro) == 4 for r in results)
    assert sorted(r.step for r in results) == list(range(1, len(results) + 1))


# --- The rollback snapshot holds only what a micro-batch assigns --------------------------


def test_a_large_frozen_variable_is_not_in_the_rollback_snapshot():
    model = build(update_op=True)
    with model.graph.as_default():
        backbone = tf.Variable(np.ones((512, 6), np.float32), trainable=False, name="backbone")
        x = model.inputs["x"]
        loss = model.loss + 1e-3 * tf.reduce_mean(tf.matmul(backbone, tf.transpose(x)))
        # Diagnose would have this first apply measure update ratios too
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), diagnose=False)
        init = v1.global_variables_initializer()
    assert {v.op.name for v in trainer.rollback_variables} == {"ema", "forward_passes"}
    sess = FetchSpy(graph=model.graph)
    sess.run(init)
    feeds = hostavg.split(model.feed(batches(3, 1, BATCH)[0]), 10)
    trainer.step(sess, feeds)
    snapshot, *computes, apply = sess.fetched
    # The apply fetches the global step, the learning rate, whether each variable it wrote
    # is finite (check_applied) and, the first apply, the magnitudes of the weights and
    # slots that the host-side proof of the next applies starts from.
    assert len(snapshot) == 2 and len(computes) == 4 and len(apply) == 4
    assert "hostavg_magnitudes" in apply[2]
    read = {model.graph.get_tensor_by_name(name).op.inputs[0].op.inputs[0].op.name
            for name in snapshot}  # Identity <- ReadVariableOp <- the variable's handle
    assert read == {"ema", "forward_passes"}

    # No assignment anywhere (no counter, no UPDATE_OPS): no snapshot call at all.
    with tf.Graph().as_default() as graph:
        xs = v1.placeholder(tf.float32, [None, 2])
        w = tf.Variable(np.ones((2, 1), np.float32))
        plain = hostavg.Trainer(tf.reduce_mean(tf.matmul(xs, w) ** 2),
                                v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    assert plain.rollback_variables == ()
    sess = FetchSpy(graph=graph)
    sess.run(init)
    plain.step(sess, hostavg.split({xs: np.ones((4, 2), np.float32)}, 2))
    assert len(sess.fetched) == 3  # two computes, one apply


def test_a_nan_after_a_dropped_micro_batch_is_named_by_its_own_index():
    class DropFirst:
        def on_micro_batch(self, micro):
            return hostavg.hooks.Drop("first") if micro.index == 0 else None

    case = Case(hooks=[DropFirst()])
    with pytest.raises(hostavg.HostavgError) as raised:
        case.trainer.step(case.sess, poisoned(case, 1))
    message = str(raised.value)
    assert message.startswith("step, micro-batch 1 of 4 (samples 10:20): non-finite gradients")
    assert "micro-batch 0" not in message


def test_a_bug_in_a_hook_propagates_as_itself_naming_the_hook():
    class Buggy:
        def on_micro_batch(self, micro):
            if micro.index == 2:
                return None + 1
            return None

    case = Case(update_op=True, hooks=[Buggy()])
    raised = unchanged(case, lambda: case.trainer.step(case.sess, case.feeds), "unsupported operand",
                       TypeError)
    assert raised.__notes__ == [
        "hostavg: raised by hook Buggy in on_micro_batch of micro-batch 2 of 4 (samples 20:30); "
        "nothing was applied"]


def test_a_nan_a_hook_put_in_is_blamed_on_the_hook():
    class Poisoner:
        def on_micro_batch(self, micro):
            return {name: np.full(np.shape(v), np.nan) for name, v in micro.grads.items()}

    case = Case(hooks=[Poisoner()])
    with pytest.raises(hostavg.HostavgError,
                       match=r"^step, micro-batch 0 of 4 \(samples 0:10\): non-finite .* They were "
                             r"finite before on_micro_batch hook Poisoner replaced them"):
        case.trainer.step(case.sess, case.feeds)


def test_an_initializer_made_before_the_trainer_is_named_as_such():
    model = build()
    with model.graph.as_default():
        early = v1.global_variables_initializer()  # before the Trainer makes slots and the step
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01))
    sess = v1.Session(graph=model.graph)
    sess.run(early)
    feeds = hostavg.split(model.feed(batches(3, 1, BATCH)[0]), 10)
    advice = (r"a variable is not initialized \(FailedPreconditionError: .*\); run "
              r"tf\.compat\.v1\.global_variables_initializer\(\) after building the Trainer")
    with pytest.raises(hostavg.HostavgError, match="^step, micro-batch 0 of 4 .*: " + advice) as e:
        trainer.step(sess, feeds)
    assert "feed" not in str(e.value)
    with pytest.raises(hostavg.HostavgError, match="^compute: " + advice):
        trainer.compute(sess, feeds[0])


def test_compute_wraps_session_errors_like_step_and_only_feed_errors_blame_the_feed():
    case = Case()
    x = case.model.inputs["x"]
    with pytest.raises(hostavg.HostavgError,
                       match=r"^compute: feed 'x:0' has shape \(10, 5\), but it takes shape "):
        case.trainer.compute(case.sess, {**case.feeds[0], x: np.ones((10, 5), np.float32)})
    y = case.model.inputs["y"]
    with pytest.raises(hostavg.HostavgError, match=r"^compute: the session refused the compute "
                       r"\(InvalidArgumentError: .*\); check that micro-batch's feed"):
        case.trainer.compute(case.sess, {**case.feeds[0], y: np.full(10, 7, np.int32)})
    closed = v1.Session(graph=case.model.graph)
    closed.close()
    with pytest.raises(hostavg.HostavgError,
                       match=r"^compute: the session failed in compute \(\w+Error: .*closed") as e:
        case.trainer.compute(closed, case.feeds[0])
    assert "feed" not in str(e.value)


def test_feed_keys_may_be_op_names_tensor_names_or_tensors():
    a, b = Case(), Case()
    by_name = [{"x": f[a.model.inputs["x"]], "y:0": f[a.model.inputs["y"]]} for f in a.feeds]
    g = a.trainer.compute(a.sess, by_name[0])
    want = b.trainer.compute(b.sess, b.feeds[0])
    for name in want:
        np.testing.assert_array_equal(g[name], want[name])
    a.trainer.step(a.sess, by_name)
    b.trainer.step(b.sess, b.feeds)
    assert a.values().keys() == b.values().keys()
    for name, value in b.values().items():
        np.testing.assert_array_equal(a.values()[name], value, err_msg=name)


# --- 0-d variables ------------------------------------------------------------------------


def scalar_model(optimizer, seed=0):
    """y = w * x + b with scalar w and b, plus an embedding row bias (sparse)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None], name="x")
        ids = v1.placeholder(tf.int32, [None], name="ids")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = tf.Variable(0.5, name="w")
        b = tf.Variable(-0.25, name="b")
        table = tf.Variable(np.zeros((7, 1), np.float32), name="table")
        pred = w * x + b + tf.squeeze(tf.gather(table, ids), 1)
        loss = tf.reduce_mean(tf.square(pred - y))
        step = v1.train.get_or_create_global_step()
    return graph, (x, ids, y), loss, OPTIMIZERS[optimizer], step


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_scalar_variables_compute_step_and_apply_and_equal_the_full_batch_step(optimizer):
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=12).astype(np.float32), rng.integers(0, 7, 12).astype(np.int32),
             rng.normal(size=12).astype(np.float32)) for _ in range(5)]

    def run(accumulated):
        graph, inputs, loss, make, step = scalar_model(optimizer)
        with graph.as_default():
            opt = make()
            if accumulated:
                trainer = hostavg.Trainer(loss, opt)
            else:
                train = opt.minimize(loss, global_step=step)
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=graph)
        sess.run(init)
        for arrays in data:
            feed = dict(zip(inputs, arrays))
            if accumulated:
                res = trainer.step(sess, [{k: v[s] for k, v in feed.items()}
                                          for s in cuts(12, (5, 4, 3))])
            else:
                sess.run(train, feed)
        variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
        return dict(zip([v.op.name for v in variables], sess.run(variables))), \
            (trainer, sess, res) if accumulated else None

    want, _ = run(False)
    got, (trainer, sess, res) = run(True)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
    assert trainer.spec["w"].shape == () and trainer.spec["table"].sparse
    assert res.grads["w"].shape == () and not res.grads["w"].flags.writeable
    step = trainer.apply(sess, {"w": 0.0, "b": np.float64(1.0), "table": res.grads["table"]})
    assert step == 6


# --- Errors name the real culprit: a hook's NaN, a closed session -----------------------------


def test_a_nan_an_on_step_hook_puts_in_is_blamed_on_the_hook():
    class Poisoner:
        def on_step(self, mean, result):
            return {name: np.full(np.shape(v), np.nan) for name, v in mean.items()}

    case = Case(update_op=True, hooks=[Poisoner()])
    unchanged(case, lambda: case.trainer.step(case.sess, case.feeds),
              r"^step, the mean that on_step hook Poisoner returned: non-finite .* Look at that "
              r"hook\.$")


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


# --- A step's norms are those of the mean it applied ---------------------------------------------


def norms_of(grads) -> dict:
    """NumPy's L2 norm of each value, in float64 (a sparse gradient: of its coalesced rows)."""
    return {name: float(np.linalg.norm(np.ravel(
        v.coalesce().values if isinstance(v, hostavg.SparseGradient) else v).astype(np.float64)))
        for name, v in grads.items()}


def assert_norms_of(stats, grads):
    want = norms_of(grads)
    assert stats.variable_norms.keys() == want.keys()
    for name, norm in want.items():
        assert stats.variable_norms[name] == pytest.approx(norm, rel=1e-6), name
    assert stats.grad_norm == pytest.approx(math.hypot(*want.values()), rel=1e-6)


def dense(value) -> np.ndarray:
    return value.to_dense() if isinstance(value, hostavg.SparseGradient) else np.asarray(value)


def sgd_case(hooks=(), accum_dtype=None):
    """The embedding MLP with plain SGD (so the weights' change is -0.5 * the applied mean)."""
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.GradientDescentOptimizer(0.5), hooks=hooks,
                                  accum_dtype=accum_dtype)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess


def weights(model, sess, trainer) -> dict:
    return {name: value for name, value in model.values(sess).items() if name in trainer.spec}


@pytest.mark.parametrize("accum_dtype", [None, "float64"])
@pytest.mark.parametrize("sizes", [(BATCH,), (10, 10, 20)], ids=["k1", "k3"])
def test_step_norms_are_those_of_the_applied_mean(sizes, accum_dtype):
    model, trainer, sess = sgd_case(accum_dtype=accum_dtype)
    for d in repeating_batches(13, 2):
        before = weights(model, sess, trainer)
        res = trainer.step(sess, micro_feeds(model, d, sizes))
        assert all(v.dtype == (accum_dtype or np.float32) for v in res.grads.values())
        assert_norms_of(res.stats, res.grads)
        after = weights(model, sess, trainer)
        for name in before:  # what res.grads says was applied, was
            np.testing.assert_allclose(before[name] - after[name], 0.5 * dense(res.grads[name]),
                                       rtol=1e-5, atol=1e-6, err_msg=name)


class KeepOnly:
    """Drops every micro-batch but one."""

    def __init__(self, index):
        self.index = index

    def on_micro_batch(self, micro):
        return None if micro.index == self.index else Drop("not this one")


class Replace:
    """Replaces each micro-batch's gradients (on_micro_batch) or the mean (on_step) with ``factor``
    times themselves, as ``dtype``."""

    def __init__(self, where, factor=3.0, dtype=np.float32):
        self.factor, self.dtype = factor, dtype
        setattr(self, where, self._replace)

    def _replace(self, grads, *_):
        grads = getattr(grads, "grads", grads)
        return {name: hostavg.SparseGradient(v.indices, (v.values * self.factor).astype(self.dtype),
                                             v.dense_shape)
                if isinstance(v, hostavg.SparseGradient) else (v * self.factor).astype(self.dtype)
                for name, v in grads.items()}


@pytest.mark.parametrize("accum_dtype", [None, "float64"])
def test_a_step_left_with_one_micro_batch_has_that_micro_batchs_norms(accum_dtype):
    model, trainer, sess = sgd_case(hooks=[KeepOnly(1)], accum_dtype=accum_dtype)
    data = repeating_batches(14, 1)[0]
    feeds = micro_feeds(model, data, (10, 10, 20))
    alone = trainer.compute(sess, feeds[1])
    res = trainer.step(sess, feeds)
    assert [m.dropped for m in res.micro] == ["not this one", None, "not this one"]
    assert_norms_of(res.stats, res.grads)
    assert_norms_of(res.stats, alone)


@pytest.mark.parametrize("hook", [Replace("on_micro_batch"),
                                  Replace("on_micro_batch", 2.0, np.float64),
                                  Replace("on_step", 0.25)],
                         ids=["on_micro_batch", "on_micro_batch-float64", "on_step"])
@pytest.mark.parametrize("sizes", [(BATCH,), (10, 10, 20)], ids=["k1", "k3"])
def test_norms_are_of_the_gradients_a_hook_put_in(hook, sizes):
    model, trainer, sess = sgd_case()
    data = repeating_batches(15, 1)[0]
    alone = trainer.compute(sess, model.feed(data))  # the whole batch: the mean without the hook
    model, trainer, sess = sgd_case(hooks=[hook])
    res = trainer.step(sess, micro_feeds(model, data, sizes))
    assert_norms_of(res.stats, res.grads)
    for name, norm in norms_of(alone).items():
        assert res.stats.variable_norms[name] == pytest.approx(hook.factor * norm, rel=1e-5), name


OVERFLOW = ("step, the mean: non-finite gradients in 'w' (4 of 4 entries: 0 NaN, 4 Inf). Nothing "
            "was applied. Every micro-batch's gradients were finite, so their weighted sum "
            "overflowed the accumulation dtype: accumulate in float64 with accum_dtype='float64'.")


class Huge:
    """Replaces a micro-batch's gradient of w with float64 values beyond float32's range."""

    def on_micro_batch(self, micro):
        return {"w": np.full(4, 1e39)}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("how", ["float64-model-float32-sums", "float64-from-a-hook",
                                 "float64-from-a-hook-float64-sums"])
def test_a_mean_that_overflows_only_when_cast_is_refused_not_applied(how, k):
    message = re.escape(OVERFLOW) + "$"
    if how == "float64-model-float32-sums":
        trainer, sess, x, w, _ = linear(np.float64, accum_dtype="float32")
        feed = {x: np.full((2, 4), 1e39)}
    else:
        sums = "float64" if how.endswith("float64-sums") else None
        trainer, sess, x, w, _ = linear(np.float32, hooks=[Huge()], accum_dtype=sums)
        feed = {x: np.ones((2, 4), np.float32)}
        if sums:  # the float64 mean is finite; its cast to float32 is not
            message = re.escape(OVERFLOW.split(" Every")[0] + " Every micro-batch's gradients "
                                "were finite and were summed in float64, so the mean "
                                "itself is beyond the range of the variables' dtype: scale the "
                                "loss down, or clip the gradients (hostavg.hooks.ClipGlobalNorm).")
            message += "$"
    with np.errstate(over="ignore"), pytest.raises(hostavg.HostavgError, match="^" + message):
        trainer.step(sess, [feed] * k)
    np.testing.assert_array_equal(sess.run(w), np.zeros(4))
    assert sess.run(trainer.global_step) == 0


class HugeRows:
    """Replaces a micro-batch's embedding rows with float64 values beyond float32's range."""

    def on_micro_batch(self, micro):
        rows = micro.grads["embedding"]
        return {**micro.grads, "embedding": hostavg.SparseGradient(
            rows.indices, np.full(rows.values.shape, 1e39), rows.dense_shape)}


@pytest.mark.parametrize("sizes", [(BATCH,), (10, 30)], ids=["k1", "k2"])
def test_sparse_rows_that_overflow_only_when_cast_are_refused_not_applied(sizes):
    model, trainer, sess = sgd_case(hooks=[HugeRows()])
    data = repeating_batches(16, 1)[0]
    before = model.values(sess)
    with np.errstate(over="ignore"), pytest.raises(hostavg.HostavgError, match=(
            r"^step, the mean: non-finite gradients in 'embedding' \((\d+) of \1 entries: 0 NaN, "
            r"\1 Inf\)\. Nothing was applied\. Every micro-batch's gradients were finite")):
        trainer.step(sess, micro_feeds(model, data, sizes))
    assert_bitwise(model.values(sess), before)


def test_an_evolved_record_is_what_dataclasses_replace_makes():
    """evolved (the engine's cheap replace of a frozen record) equals dataclasses.replace:
    the changed fields changed, the others the same objects, the original untouched, still
    frozen; a name that is no field is refused as replace refuses it."""
    import dataclasses
    from hostavg.core.results import MicroBatch, StepResult, evolved
    micro = (MicroBatch(0, 4, 0.5, None),)
    record = StepResult(0.5, None, micro, 3, 4, info={"a": 1})
    new = evolved(record, step=4, proven=True)
    assert new == dataclasses.replace(record, step=4, proven=True) and type(new) is StepResult
    assert (record.step, record.proven, new.step, new.proven) == (3, False, 4, True)
    assert new.micro is record.micro and new.info is record.info
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.step = 5
    with pytest.raises(TypeError, match="no field stepp"):
        evolved(record, stepp=4)
    assert repr(new) == repr(dataclasses.replace(record, step=4, proven=True))
