"""The TF1 face's graph wiring (hostavg.tf1.wiring): sparse rows coalesced in the session the
same way for every micro-batch, TF1 Adam's sparse mean applied densely, every other optimizer's
kept sparse."""

import numpy as np
import pytest
import tensorflow as tf
from models import (CLASSES, VOCAB, batches, build, full_batch, make_optimizer, micro_feeds,
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
    """The densifying ops of ``graph``, those of its conditionals' branches too (the apply a
    step of one micro-batch runs in its compute's call is one)."""
    found = []
    for op in graph.get_operations():
        if "hostavg_densify" in op.name and op.type == "UnsortedSegmentSum":
            found.append(op)
        if op.type in ("If", "StatelessIf"):
            found += densify_ops(graph._get_function(op.get_attr("then_branch").name).graph)
    return found


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
    # checked one, and the unchecked one that serves an apply the host proved finite), and so
    # is the one a step of one micro-batch runs in its compute's call.
    model, sess, trainer, _ = train("adam", data, UNEQUAL, model_kw={"sparse": True},
                                      update_ratios_every=2)
    assert len(densify_ops(trainer.graph)) == 4
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
    # the train op, the checked one, which measures, and the one run in a compute's call
    assert AdamSubclass.sparse_applies == 3
    assert_same_weights(model.values(sess), full_batch(lambda: AdamSubclass(0.01), data,
                                                       sparse=True), atol=1e-6)


# --- A step of one micro-batch in one session call ---------------------------------------------


@pytest.fixture
def calls(monkeypatch):
    """Counts the trainers' session calls by kind: computes, applies, and computes that apply
    too (with how many of those the gate refused: nothing applied)."""
    from hostavg.tf1.session import SessionBackend
    counted = {"compute": 0, "apply": 0, "compute_apply": 0, "refused": 0}
    for kind in ("compute", "apply", "compute_apply"):
        def counting(*args, _kind=kind, _method=getattr(SessionBackend, kind), **kwargs):
            counted[_kind] += 1
            out = _method(*args, **kwargs)
            counted["refused"] += _kind == "compute_apply" and (out is None or out[1] is None)
            return out
        monkeypatch.setattr(SessionBackend, kind, counting)
    return counted


def quiet_trainer(model, optimizer, **kw):
    """A Trainer with no default hook, its variables initialized in a new session."""
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, optimizer, watch_outliers=False, diagnose=False,
                                  **kw)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return trainer, sess


def test_a_step_of_one_micro_batch_is_one_session_call_once_its_bounds_are_measured(calls):
    model = build(update_op=True)
    trainer, sess = quiet_trainer(model, v1.train.AdamOptimizer(0.01))
    data = batches(0, 4, 16)
    trainer.step(sess, [model.feed(data[0])])  # measures the bounds: a checked apply of its own
    assert calls == {"compute": 1, "apply": 1, "compute_apply": 0, "refused": 0}
    model.graph.finalize()  # (a MonitoredSession's graph: nothing more is built)
    for d in data[1:]:
        assert trainer.step(sess, [model.feed(d)]).proven
    assert calls == {"compute": 1, "apply": 1, "compute_apply": 3, "refused": 0}


class Looking:
    """Looks at every micro-batch before the apply."""

    def on_micro_batch(self, micro):
        return None


@pytest.mark.parametrize("why", ["hook", "fetches", "graph average", "update ratios",
                                 "two micro-batches"])
def test_a_step_that_something_must_see_before_its_apply_runs_apart(calls, why):
    model = build()
    kw = {"hook": {"hooks": [Looking()]}, "fetches": {},
          "graph average": {"average": "graph"}, "update ratios": {"update_ratios_every": 1},
          "two micro-batches": {}}[why]
    trainer, sess = quiet_trainer(model, v1.train.GradientDescentOptimizer(0.1), **kw)
    step_kw = {"fetches": [model.loss]} if why == "fetches" else {}
    for d in batches(0, 3, 16):
        feeds = micro_feeds(model, d, [8, 8]) if why == "two micro-batches" else [model.feed(d)]
        trainer.step(sess, feeds, **step_kw)
    assert calls["compute_apply"] == 0 and calls["apply"] == 3


def test_a_fed_learning_rate_and_a_global_step_left_alone_in_one_call(calls):
    """Fused: the rate each step is fed, reported and applied as by the same steps apart."""
    def run(hooks):
        model = build()
        with model.graph.as_default():
            rate = v1.placeholder(tf.float32, (), name="rate")
        trainer, sess = quiet_trainer(model, v1.train.MomentumOptimizer(rate, 0.9),
                                      increment_global_step=False, hooks=hooks)
        results = [trainer.step(sess, [{**model.feed(d), rate: 0.1 / (i + 1)}])
                   for i, d in enumerate(batches(0, 3, 16))]
        return results, model.values(sess)
    results, got = run(())
    assert calls["compute_apply"] == 2 and calls["refused"] == 0
    np.testing.assert_allclose([r.learning_rate for r in results], [0.1, 0.05, 0.1 / 3])
    assert [r.step for r in results] == [0, 0, 0]
    apart, want = run([Looking()])
    assert [r.learning_rate for r in apart] == [r.learning_rate for r in results]
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_micro_batch_the_gate_refuses_is_checked_from_the_same_call_as_a_step_apart(calls):
    """A NaN: the gate refuses the apply, and the call's gradients are checked as those of a
    compute: the same error naming its row as the step computed apart, without computing the
    micro-batch again; nothing applied, the forward pass's counter put back."""
    def run(hooks):
        model = build(update_op=True)
        trainer, sess = quiet_trainer(model, v1.train.AdamOptimizer(0.01), hooks=hooks)
        data = batches(0, 2, 16)
        trainer.step(sess, [model.feed(data[0])])
        before, counted = model.values(sess), dict(calls)
        bad = dict(data[1], x=data[1]["x"].copy())
        bad["x"][5, 0] = np.nan
        with pytest.raises(hostavg.StepError, match="sample 5") as raised:
            trainer.step(sess, [model.feed(bad)])
        after = model.values(sess)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        return str(raised.value), {k: calls[k] - counted[k] for k in calls}
    said, fused = run(())
    assert fused["compute_apply"] == fused["refused"] == 1 and fused["apply"] == 0
    said_apart, apart = run([Looking()])
    assert apart["compute_apply"] == 0 and apart["apply"] == 0
    assert said == said_apart
    assert fused["compute"] == apart["compute"] - 1 > 0  # (the culprit search's parts)
