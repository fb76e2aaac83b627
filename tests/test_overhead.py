"""The shortcuts that cut a step's fixed cost, each against an oracle that does not take them:
session calls in the caller thread or TF's inter-op pool, sparse rows coalesced on the host or in
the session, the NumPy coalesce and its stable order, TF1 Adam's sparse mean applied densely, a
lone micro-batch's norms reused as the step's, and the signal handlers swapped through
``_signal``."""

import math
import os
import re
import signal
import threading

import numpy as np
import pytest
import tensorflow as tf
from models import (CLASSES, VOCAB, AfterApply, batches, build, cuts, full_batch, make_optimizer,
                    probed, v1)
from test_adversarial import linear
from test_trainer import BATCH, UNEQUAL, Case, assert_same_weights, train, unchanged

import hostavg
from hostavg.core.gradients import _stable_order, coalesce_rows
from hostavg.hooks import Drop
from hostavg.tf1.session import SESSION_THREADS


def assert_bitwise(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def micro_feeds(model, data: dict, sizes) -> list:
    return [model.feed({k: v[part] for k, v in data.items()})
            for part in cuts(len(data["y"]), sizes)]


def repeating_batches(seed: int, steps: int, n: int = BATCH, window: int = 12) -> list:
    """Embedding batches whose ids come from ``window`` tokens that move each step: every
    micro-batch repeats tokens (twice, three times and more), and most rows of the table are
    absent from each step (where a lazy sparse update and a dense one part ways)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        start = (step * 13) % (VOCAB - window)
        out.append({"ids": rng.integers(start, start + window, (n, 3)).astype(np.int32),
                    "y": rng.integers(0, CLASSES, n).astype(np.int32)})
    return out


# --- session_threads: "caller" and "pool" run the same ops ---------------------------------------


@pytest.mark.parametrize("model_kw,average", [
    ({}, "host"),
    ({"sparse": True}, "host"),
    ({"update_op": True}, "graph"),  # a moving mean written with assign ops, in UPDATE_OPS
    ({"sparse": True, "update_op": True}, "graph"),
], ids=["dense", "embedding", "update_ops-graph", "embedding-update_ops-graph"])
def test_caller_and_pool_give_bit_identical_weights_equal_to_the_full_batch_step(model_kw, average):
    data = batches(5, 4, BATCH, sparse=model_kw.get("sparse", False))
    caller, pool = (train("adam", data, UNEQUAL, model_kw=model_kw, average=average,
                            session_threads=threads)[:2]
                    for threads in SESSION_THREADS)
    caller, pool = (model.values(sess) for model, sess in (caller, pool))
    assert_bitwise(caller, pool)
    # The oracle runs the UPDATE_OPS once per micro-batch too, then minimize on the whole batch.
    assert_same_weights(caller, full_batch("adam", data, update_sizes=UNEQUAL, **model_kw),
                        atol=2e-6)


class PoolSpy(v1.Session):
    """A real session that notes the inter-op pool every compiled call was made for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools = []

    def _make_callable_from_options(self, options):
        self.pools.append(options.run_options.inter_op_thread_pool)
        return super()._make_callable_from_options(options)


@pytest.mark.parametrize("threads,pool", [("caller", -1), ("pool", 0)])
def test_session_threads_decides_which_thread_runs_the_ops(threads, pool):
    model = build(update_op=True)
    with model.graph.as_default():
        loss, ran_in = probed(model.loss)
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), average="graph",
                                  session_threads=threads)
        init = v1.global_variables_initializer()
    sess = PoolSpy(graph=model.graph)
    sess.run(init)
    feeds = micro_feeds(model, batches(6, 1, BATCH)[0], UNEQUAL)
    res = trainer.step(sess, feeds)
    trainer.apply(sess, res.grads)
    # compute, the graph average's reduce, and both applies (measured or not: apply measures not)
    assert len(sess.pools) >= 3 and set(sess.pools) == {pool}
    assert len(ran_in) == len(feeds)
    me = threading.get_ident()
    assert all(t == me for t in ran_in) if threads == "caller" else all(t != me for t in ran_in)


STAGING = """
import numpy as np, tensorflow as tf, hostavg
from tensorflow.python.ops import data_flow_ops
v1 = tf.compat.v1
graph = tf.Graph()
with graph.as_default():
    x = v1.placeholder(tf.float32, [None, 3])
    area = data_flow_ops.StagingArea([tf.float32], shapes=[[None, 3]])
    put = area.put([x])  # this micro-batch's input staged, and read back in the same call
    got = area.get()
    got = got[0] if isinstance(got, (list, tuple)) else got
    w = tf.Variable(tf.ones([3]))
    loss = tf.reduce_mean(tf.linalg.matvec(got, w) ** 2)
    trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1), update_ops=[put],
                              session_threads="caller")
    sess = v1.Session(graph=graph)
    sess.run(v1.global_variables_initializer())
for _ in range(3):
    res = trainer.step(sess, [{x: np.ones((2, 3), np.float32)}] * 2)
print("stepped", res.step)
"""


@pytest.mark.slow  # a fresh TensorFlow process
def test_a_call_that_reaches_a_blocking_kernel_runs_in_the_pool_even_when_caller_is_asked():
    """In the calling thread a StagingArea's get, run before its put in the same call, would
    block the only thread that could run the put: forever, deaf to Ctrl-C."""
    import subprocess
    import sys
    from models import ENV
    out = subprocess.run([sys.executable, "-c", STAGING], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "stepped 3", out.stderr[-2000:]


@pytest.mark.parametrize("value", ["x", None, "Caller"])
def test_an_unknown_session_threads_is_refused_naming_the_choices(value):
    model = build()
    with model.graph.as_default(), pytest.raises(hostavg.HostavgError, match="^" + re.escape(
            f"session_threads must be one of ('pool', 'caller'), got {value!r}") + "$"):
        hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), session_threads=value)


def test_two_threads_stepping_their_own_trainers_in_the_caller_thread_both_finish_correctly():
    data = {sparse: batches(7, 6, BATCH, sparse=sparse) for sparse in (False, True)}
    alone = {sparse: train("adam", data[sparse], UNEQUAL, model_kw={"sparse": sparse})
             for sparse in data}
    runs = {}
    for sparse in data:
        model = build(sparse=sparse)
        with model.graph.as_default():
            trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01),
                                      session_threads="caller")
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=model.graph)
        sess.run(init)
        runs[sparse] = (model, sess, trainer)
    start, failed = threading.Barrier(2), []

    def work(sparse):
        model, sess, trainer = runs[sparse]
        try:
            start.wait()
            for d in data[sparse]:
                trainer.step(sess, micro_feeds(model, d, UNEQUAL))
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    workers = [threading.Thread(target=work, args=(sparse,)) for sparse in data]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not failed and not any(w.is_alive() for w in workers)
    for sparse, (model, sess, trainer) in runs.items():
        want_model, want_sess = alone[sparse][:2]
        assert_bitwise(model.values(sess), want_model.values(want_sess))
        assert sess.run(trainer.global_step) == len(data[sparse])


# --- Sparse rows coalesced in the session, the same way for every micro-batch -------------------

#: One micro-batch of ids, out of order, repeating tokens: 4 twice in a sample, 6 four times
#: (three in one sample), 17 twice across samples.
REPEATS = np.array([[9, 4, 4], [6, 6, 6], [1, 30, 6], [49, 0, 17], [17, 2, 3],
                    [5, 7, 8], [40, 41, 42], [33, 22, 11], [12, 13, 14], [48, 47, 46]], np.int32)


def test_compute_coalesces_sparse_rows_as_the_dense_gradient_has_them():
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01))
        table = model.graph.get_tensor_by_name("embedding:0")
        # The oracle: the dense gradient, which no coalescing touched.
        dense = tf.convert_to_tensor(tf.gradients(model.loss, table)[0])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    feed = model.feed({"ids": REPEATS, "y": np.arange(10, dtype=np.int32) % CLASSES})
    want = sess.run(dense, feed)
    g = trainer.compute(sess, feed)
    rows = g["embedding"]
    np.testing.assert_array_equal(rows.indices, np.unique(REPEATS))
    np.testing.assert_allclose(rows.values, want[np.unique(REPEATS)], rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(rows.to_dense(), want)  # no row left out
    for name, value in g.items():
        flat = np.ravel(value.values if name == "embedding" else value).astype(np.float64)
        assert g.sq_norms[name] == pytest.approx(flat @ flat, rel=1e-6), name


def test_a_sparse_gradient_depends_only_on_its_feed_not_on_earlier_calls():
    """The same feed from the same weights gives the same bits whatever ran before (small and
    large micro-batches, check): a run resumed by a fresh trainer continues bit for bit.
    Coalescing once chose host or session by the previous call's row count, which differ in
    rounding above ~16k rows."""
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.MomentumOptimizer(0.05, momentum=0.9))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    rng = np.random.default_rng(3)
    ids = model.inputs["ids"]

    def feed(n):
        return {ids: rng.integers(0, VOCAB, (n, 3)).astype(np.int32),
                model.inputs["y"]: rng.integers(0, CLASSES, n).astype(np.int32)}
    big = feed(8000)  # 24,000 rows of a 50-row table
    first = trainer.compute(sess, big)
    again = trainer.compute(sess, big)
    trainer.compute(sess, feed(4))
    after_small = trainer.compute(sess, big)
    trainer.check(sess, feed(64), micro_batch_size=16)
    after_check = trainer.compute(sess, big)
    for g in (again, after_small, after_check):
        for name in first:
            a, b = first[name], g[name]
            if name == "embedding":
                np.testing.assert_array_equal(a.indices, b.indices)
                a, b = a.values, b.values
            np.testing.assert_array_equal(a, b, err_msg=name)
        assert g.sq_norms == first.sq_norms


# --- coalesce_rows and _stable_order against brute force ------------------------------------------


def brute_coalesce(indices, values):
    """A dict summing each index's rows in the order they came; sorted by index."""
    sums = {}
    for i, row in zip(indices.tolist(), values):
        sums[i] = sums[i] + row if i in sums else row.copy()
    keys = sorted(sums)
    rows = np.array([sums[k] for k in keys], values.dtype)
    return np.array(keys, indices.dtype), rows.reshape((len(keys),) + values.shape[1:])


def rows_case(kind: str, rng, index_dtype, base: int) -> np.ndarray:
    """Indices that drive coalesce_rows down one path (checked by the test)."""
    distinct = base + rng.choice(1000, 24, replace=False)
    if kind == "unique":
        indices = distinct
    elif kind == "sorted":
        indices = np.sort(distinct)
    elif kind == "pairs":  # 8 of 24 twice, none thrice
        indices = rng.permutation(np.concatenate([distinct, distinct[:8]]))
    elif kind == "thrice":  # few duplicates, one index four times
        indices = rng.permutation(np.concatenate([distinct, distinct[:1].repeat(3), distinct[1:3]]))
    else:  # "many": 60 rows of 5 indices
        indices = rng.choice(distinct[:5], 60)
    return indices.astype(index_dtype)


@pytest.mark.parametrize("value_dtype,row_shape", [(np.float32, (3,)), (np.float64, ()),
                                                   (np.float32, (2, 3)), (np.float64, (4,))],
                         ids=["f32-2d", "f64-1d", "f32-3d", "f64-2d"])
@pytest.mark.parametrize("index_dtype,base", [(np.int32, 0), (np.int64, 0), (np.int64, 2 ** 31),
                                              (np.int64, 2 ** 40)],
                         ids=["int32", "int64", "int64-2^31", "int64-2^40"])
@pytest.mark.parametrize("kind", ["unique", "sorted", "pairs", "thrice", "many"])
def test_coalesce_rows_equals_a_dict_summing_rows_in_order(kind, index_dtype, base, value_dtype,
                                                           row_shape):
    rng = np.random.default_rng([ord(c) for c in kind] + [base % 997, len(row_shape)])
    for _ in range(5):
        indices = rows_case(kind, rng, index_dtype, base)
        values = rng.normal(size=(len(indices),) + row_shape).astype(value_dtype)
        _, counts = np.unique(indices, return_counts=True)
        assert {"unique": counts.max() == 1, "sorted": counts.max() == 1,
                "pairs": counts.max() == 2 and 2 * len(counts) > len(indices),
                "thrice": counts.max() >= 3 and 2 * len(counts) > len(indices),
                "many": 2 * len(counts) <= len(indices)}[kind]
        got = coalesce_rows(indices, values)
        want = brute_coalesce(indices, values)
        if kind == "sorted":
            assert got[0] is indices and got[1] is values
        assert got[0].dtype == indices.dtype and got[1].dtype == values.dtype
        np.testing.assert_array_equal(got[0], want[0])
        if kind != "many":
            np.testing.assert_array_equal(got[1], want[1])  # the same additions in the same order
        else:  # np.add.reduceat adds a run in its own order: within rounding of the exact sum
            exact = brute_coalesce(indices, values.astype(np.float64))[1]
            size = brute_coalesce(indices, np.abs(values).astype(np.float64))[1]
            counts = counts.reshape((-1,) + (1,) * len(row_shape))
            assert np.all(np.abs(got[1] - exact) <= 2 * counts * np.finfo(value_dtype).eps * size)


def test_coalesce_rows_of_fewer_than_two_rows_are_those_rows():
    for n in (0, 1):
        indices, values = np.arange(n) + 7, np.ones((n, 2), np.float32)
        got = coalesce_rows(indices, values)
        assert got[0] is indices and got[1] is values


@pytest.mark.parametrize("dtype,high", [(np.int32, 5), (np.int32, 2 ** 31 - 1), (np.int64, 5),
                                        (np.int64, 2 ** 31 - 1), (np.int64, 2 ** 31),
                                        (np.int64, 2 ** 62), (np.uint32, 2 ** 32 - 1)])
def test_stable_order_is_numpys_stable_argsort(dtype, high):
    rng = np.random.default_rng(high % 1009)
    for n in (1, 2, 3, 17, 1000):
        for indices in (rng.integers(max(high - 4, 0), high, n, endpoint=True, dtype=dtype),
                        rng.integers(0, high, n, endpoint=True, dtype=dtype)):
            np.testing.assert_array_equal(_stable_order(indices),
                                          np.argsort(indices, kind="stable"))


# --- TF1 Adam's sparse mean applied densely; every other optimizer's kept sparse ------------------


def densify_ops(graph) -> list:
    return [op for op in graph.get_operations()
            if op.name.startswith("hostavg_densify") and op.type == "UnsortedSegmentSum"]


def dense_accumulation(optimizer, data: list, sizes) -> dict:
    """In-graph dense accumulation: each micro-batch's gradients made dense and summed, weighted
    by its size, in variables; then ``apply_gradients`` of their mean.

    Returns the model's variables (not the sums')."""
    model = build(sparse=True)
    with model.graph.as_default():
        opt = make_optimizer(optimizer)
        pairs = opt.compute_gradients(model.loss)
        size, total = v1.placeholder(tf.float32, ()), v1.placeholder(tf.float32, ())
        with v1.variable_scope("dense_sums"):
            sums = [v1.get_variable(f"sum{i}", v.shape, v.dtype.base_dtype, tf.zeros_initializer(),
                                    trainable=False) for i, (_, v) in enumerate(pairs)]
        add = tf.group(*[s.assign_add(tf.convert_to_tensor(g) * size)
                         for s, (g, _) in zip(sums, pairs)])
        apply = opt.apply_gradients([(s / total, v) for s, (_, v) in zip(sums, pairs)],
                                    global_step=v1.train.get_or_create_global_step())
        with tf.control_dependencies([apply]):
            reset = tf.group(*[s.assign(tf.zeros_like(s)) for s in sums])
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        for d in data:
            for n, feed in zip(sizes, micro_feeds(model, d, sizes)):
                sess.run(add, {**feed, size: n})
            sess.run(reset, {total: len(d["y"])})
        return {k: v for k, v in model.values(sess).items() if not k.startswith("dense_sums/")}


def test_adam_applies_the_sparse_mean_densely_as_its_full_batch_and_dense_accumulation_do():
    data = repeating_batches(10, 5)
    # Steps 2 and 4 measure update ratios: the second (measured) train op is densified too.
    model, sess, trainer, _ = train("adam", data, UNEQUAL, model_kw={"sparse": True},
                                      update_ratios_every=2)
    assert len(densify_ops(trainer.graph)) == 2
    got = model.values(sess)
    assert_same_weights(got, full_batch("adam", data, sparse=True), atol=1e-6)
    assert_same_weights(got, dense_accumulation("adam", data, UNEQUAL), atol=1e-6)


@pytest.mark.parametrize("optimizer", ["momentum", "adagrad"])
def test_other_optimizers_keep_their_sparse_update(optimizer):
    data = repeating_batches(11, 5)
    model, sess, trainer, _ = train(optimizer, data, UNEQUAL, model_kw={"sparse": True})
    assert densify_ops(trainer.graph) == []
    got = model.values(sess)
    assert_same_weights(got, full_batch(optimizer, data, sparse=True), atol=1e-6)
    if optimizer == "momentum":
        # A dense apply moves absent rows by their momentum: this test would see it.
        dense = dense_accumulation(optimizer, data, UNEQUAL)
        assert np.max(np.abs(dense["embedding"] - got["embedding"])) > 1e-3


class AdamSubclass(v1.train.AdamOptimizer):
    """An Adam of the user's: its sparse update may be its own, so it must get the rows."""

    sparse_applies = 0

    def _resource_apply_sparse(self, grad, var, indices):
        AdamSubclass.sparse_applies += 1
        return super()._resource_apply_sparse(grad, var, indices)

    def _apply_sparse(self, grad, var):
        AdamSubclass.sparse_applies += 1
        return super()._apply_sparse(grad, var)


def test_a_subclass_of_adam_keeps_the_sparse_update():
    AdamSubclass.sparse_applies = 0
    data = repeating_batches(12, 3)
    model, sess, trainer, _ = train(lambda: AdamSubclass(0.01), data, UNEQUAL,
                                    model_kw={"sparse": True})
    assert densify_ops(trainer.graph) == []
    assert AdamSubclass.sparse_applies == 3  # the train op, the measured one, the checked one
    assert_same_weights(model.values(sess), full_batch(lambda: AdamSubclass(0.01), data,
                                                       sparse=True), atol=1e-6)


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


# --- Signals during a step, and the handlers after it -------------------------------------------


@pytest.fixture
def handlers():
    """SIGINT's and SIGTERM's handlers before the test, put back after it."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield before
    for s, handler in before.items():
        signal.signal(s, handler)


SEND = {"os.kill": lambda s: os.kill(os.getpid(), s), "raise_signal": signal.raise_signal}


@pytest.mark.parametrize("send", sorted(SEND))
def test_ctrl_c_in_on_step_raises_and_applies_nothing(send, handlers):
    class Interrupt:
        sent = False

        def on_step(self, mean, result):
            if not self.sent:
                self.sent = True
                SEND[send](signal.SIGINT)

    case = Case(update_op=True, hooks=[Interrupt()])
    unchanged(case, lambda: case.trainer.step(case.sess, case.feeds), None, KeyboardInterrupt)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert case.trainer.step(case.sess, case.feeds).step == 1  # nothing was left held


@pytest.mark.parametrize("send", sorted(SEND))
def test_ctrl_c_in_on_applied_raises_once_the_step_was_applied_whole(send, handlers):
    class Interrupt:
        def on_applied(self, result):
            SEND[send](signal.SIGINT)

    want = Case(update_op=True)
    want.trainer.step(want.sess, want.feeds)
    got = Case(update_op=True, hooks=[Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        got.trainer.step(got.sess, got.feeds)
    assert_bitwise(got.values(), want.values())
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def custom(calls):
    def handler(signum, frame):
        calls.append(signum)
    return handler


@pytest.mark.parametrize("kinds", [("default", "default"), ("custom", "ignore"),
                                   ("ignore", "custom"), ("custom", "custom")],
                         ids=lambda k: "-".join(k))
def test_handlers_are_exactly_what_they_were_after_a_step(kinds, handlers):
    calls = []
    installed = {}
    for s, kind in zip((signal.SIGINT, signal.SIGTERM), kinds):
        if kind != "default":
            signal.signal(s, signal.SIG_IGN if kind == "ignore" else custom(calls))
        installed[s] = signal.getsignal(s)
    # With a default handler no signal is sent (SIGTERM's would end pytest).
    sent = [] if "default" in kinds else [signal.SIGINT, signal.SIGTERM]
    send = lambda n: [os.kill(os.getpid(), s) for s in sent] if n == 1 else None  # noqa: E731
    want = Case(update_op=True)
    got = Case(update_op=True)
    got.sess = AfterApply(send, graph=got.model.graph)
    got.sess.run(got.init)
    for step in (1, 2):
        want.trainer.step(want.sess, want.feeds)
        assert got.trainer.step(got.sess, got.feeds).step == step
        for s, handler in installed.items():
            assert signal.getsignal(s) == handler and (not callable(handler)
                                                       or signal.getsignal(s) is handler), s
    # The signals that came during the apply waited for it, then reached their own handlers.
    assert calls == [s for s, kind in zip((signal.SIGINT, signal.SIGTERM), kinds)
                     if kind == "custom" and s in sent]
    assert_bitwise(got.values(), want.values())


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
