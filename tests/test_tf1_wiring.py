"""The TF1 face's graph wiring (hostavg.tf1.wiring): sparse rows coalesced in the session the
same way for every micro-batch, TF1 Adam's sparse mean applied densely, every other optimizer's
kept sparse."""

import numpy as np
import pytest
import tensorflow as tf
from models import (CLASSES, VOCAB, build, full_batch, make_optimizer, micro_feeds,
                    repeating_batches, v1)
from test_trainer import UNEQUAL, assert_same_weights, train

import hostavg


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


# --- TF1 Adam's sparse mean applied densely; every other optimizer's kept sparse ------------------


def densify_ops(graph) -> list:
    return [op for op in graph.get_operations()
            if "hostavg_densify" in op.name and op.type == "UnsortedSegmentSum"]


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
    # Steps 2 and 4 measure update ratios: the train ops that measure are densified too (the
    # checked one, and the unchecked one that serves an apply the host proved finite).
    model, sess, trainer, _ = train("adam", data, UNEQUAL, model_kw={"sparse": True},
                                      update_ratios_every=2)
    assert len(densify_ops(trainer.graph)) == 3
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
    assert AdamSubclass.sparse_applies == 2  # the train op and the checked one, which measures
    assert_same_weights(model.values(sess), full_batch(lambda: AdamSubclass(0.01), data,
                                                       sparse=True), atol=1e-6)
