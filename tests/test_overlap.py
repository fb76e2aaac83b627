"""The overlapped step (``overlap=True``): micro-batch i + 1 computes in a worker thread while
the host takes micro-batch i. The same results bit for bit, errors that name the micro-batch
they came from, and nothing restored under a computation still running. Also: fit resumed,
records, hooks that drop, clip or compute, two trainers together, errors racing each other."""

import gc
import os
import signal
import threading
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from models import (OPTIMIZERS, FailAt, batches, build, cuts, full_batch, keras_model, poisoned,
                    probed, v1)
from test_tf1_programs import gan, gan_batch
from test_trainer import BATCH, UNEQUAL, assert_same_weights

import hostavg
import hostavg.keras
from hostavg.cli import models
from hostavg.core.gradients import SparseGradient
from hostavg.hooks import ClipMicroBatchNorm, Record, SkipNonFinite
from hostavg.train.checkpoint import CheckpointDir

STEPS = 6


def tf1_run(overlap: bool, optimizer="adam", sizes=UNEQUAL, hooks=(), **model_kw):
    """STEPS steps of hostavg; returns (every variable, the results)."""
    data = batches(7, STEPS, BATCH, sparse=model_kw.get("sparse", False))
    model = build(**model_kw)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, OPTIMIZERS[optimizer](), overlap=overlap,
                                  hooks=hooks)
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        results = [trainer.step(sess, [model.feed({k: v[s] for k, v in d.items()})
                                       for s in cuts(BATCH, sizes)]) for d in data]
        return model.values(sess), results, data


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "momentum"])
@pytest.mark.parametrize("model_kw", [{}, {"sparse": True}, {"update_op": True}],
                         ids=["dense", "sparse", "update-ops"])
def test_overlapped_steps_equal_plain_steps_bit_for_bit_and_the_full_batch_step(optimizer,
                                                                                  model_kw):
    plain, plain_results, data = tf1_run(False, optimizer, **model_kw)
    overlapped, results, _ = tf1_run(True, optimizer, **model_kw)
    for name in plain:
        np.testing.assert_array_equal(overlapped[name], plain[name], err_msg=name)
    for a, b in zip(plain_results, results):
        assert (a.loss, a.stats.micro_norms, a.stats.grad_norm) == \
            (b.loss, b.stats.micro_norms, b.stats.grad_norm)
    if not model_kw.get("update_op"):  # the oracle has no moving statistics to compare
        assert_same_weights(overlapped, full_batch(optimizer, data, **model_kw), atol=1e-5)


def test_hooks_run_in_order_on_the_calling_thread_while_the_next_micro_batch_computes():
    seen, computing = [], []

    class Watch:
        def on_micro_batch(self, micro):
            seen.append((micro.index, threading.current_thread() is threading.main_thread()))
            # The worker is busy with micro-batch index + 1 (or done with it) by now.
            computing.append(any(t.name.startswith("hostavg-compute")
                                 for t in threading.enumerate()))

        def on_step(self, mean, result):
            seen.append(("step", threading.current_thread() is threading.main_thread()))

    _, results, _ = tf1_run(True, hooks=[Watch()])
    assert seen[:5] == [(0, True), (1, True), (2, True), (3, True), ("step", True)]
    assert len(seen) == 5 * STEPS and all(computing)


def test_a_micro_batch_that_fails_to_compute_is_named_and_nothing_changes():
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), overlap=True)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    data = batches(1, 1, BATCH, sparse=True)[0]
    feeds = [model.feed({k: v[s] for k, v in data.items()}) for s in cuts(BATCH, UNEQUAL)]
    trainer.step(sess, feeds)
    before = model.values(sess)
    ids = model.inputs["ids"]
    feeds[2] = {**feeds[2], ids: np.full_like(feeds[2][ids], 10_000)}  # beyond the table
    rows = [np.arange(a, a + n) for a, n in zip(np.cumsum([0, *UNEQUAL[:-1]]), UNEQUAL)]
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 2 of 4 \(samples "
                                                   r"17:20, data rows \[17, 18, 19\]\)") as raised:
        trainer.step(sess, feeds, rows=rows)
    np.testing.assert_array_equal(raised.value.rows, [17, 18, 19])
    after = model.values(sess)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_a_nan_is_blamed_on_its_own_micro_batch_not_the_one_computing():
    model = build()
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), overlap=True)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)

    class Case:
        pass
    case = Case()
    case.model, case.feeds = model, hostavg.split(model.feed(batches(2, 1, BATCH)[0]), 10)
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 1 of 4 \(samples 10:20\): "
                                                   r"non-finite gradients"):
        trainer.step(sess, poisoned(case, 1))


def slow_update_model(delay: float):
    """build()'s MLP whose forward pass counts itself after ``delay`` seconds (a py function):
    a micro-batch's compute is still running for that long."""
    model = build(update_op=True)
    with model.graph.as_default():
        slow = tf.numpy_function(lambda x: (time.sleep(delay), x)[1], [model.loss], tf.float32)
        late = tf.Variable(0, trainable=False, name="late_counter")
        with tf.control_dependencies([late.assign_add(1)]):
            loss = tf.identity(tf.reshape(slow, []) * 0 + model.loss)
    return model, loss, late


def test_a_failing_hook_waits_for_the_micro_batch_in_flight_before_restoring():
    class FailFirst:
        def on_micro_batch(self, micro):
            if micro.index == 0:
                raise RuntimeError("hook failed")

    model, loss, late = slow_update_model(0.3)
    with model.graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), overlap=True,
                                  hooks=[FailFirst()])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    assert any(v is late for v in trainer.rollback_variables)
    feeds = hostavg.split(model.feed(batches(3, 1, BATCH)[0]), 10)
    before = model.values(sess)
    with pytest.raises(RuntimeError, match="hook failed"):
        trainer.step(sess, feeds)
    # Micro-batch 1 was computing (0.3 s) when the hook failed; had the rollback not waited
    # for it, its counter increment would land after the restore.
    time.sleep(0.5)
    after = model.values(sess)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.parametrize("make", [
    lambda loss: hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), overlap="yes"),
    lambda loss: hostavg.keras.Trainer(keras_model(), "mse", keras.optimizers.Adam(),
                                       overlap="yes")])
def test_overlap_must_be_a_bool(make):
    model = build()
    with model.graph.as_default(), pytest.raises(hostavg.HostavgError,
                                                 match=r"^overlap must be True or False, got 'yes'$"):
        make(model.loss)


@pytest.mark.parametrize("overlap", [False, True])
def test_sum_mode_holds_no_micro_batch_gradient_past_its_add(overlap):
    """Host memory of "sum" mode does not grow with k: by the time the mean is made, every
    micro-batch's gradient arrays are gone (a step once kept them all until it ended): freed
    once added, not left to a garbage collection."""
    refs, alive = [], []

    class Watch:
        def on_micro_batch(self, micro):
            refs.append(weakref.ref(micro.grads["hidden/kernel"]))

        def on_step(self, mean, result):
            alive.append(sum(r() is not None for r in refs))

    tf1_run(overlap, hooks=[Watch()])
    assert len(refs) == 4 * STEPS and alive == [0] * STEPS


def assert_bitwise(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name in want:
        if isinstance(want[name], SparseGradient):
            for part in ("indices", "values"):
                np.testing.assert_array_equal(getattr(got[name], part), getattr(want[name], part),
                                              err_msg=f"{name}.{part}")
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def assert_same_results(got: list, want: list):
    """Step results equal in every number a user sees."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.step, a.loss, a.size, a.skipped) == (b.step, b.loss, b.size, b.skipped)
        np.testing.assert_equal((a.stats.micro_norms, a.stats.grad_norm, a.info),
                                (b.stats.micro_norms, b.stats.grad_norm, b.info))  # NaN == NaN
        np.testing.assert_equal([(m.loss, m.size, m.dropped) for m in a.micro],
                                [(m.loss, m.size, m.dropped) for m in b.micro])
        if a.grads is not None or b.grads is not None:
            assert_bitwise(dict(a.grads), dict(b.grads))


def tf1_trainer(overlap, model_kw=None, **trainer_kw):
    """build()'s model with an Adam trainer, initialised: (model, sess, trainer)."""
    model = build(**(model_kw or {}))
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), overlap=overlap,
                                  **trainer_kw)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, sess, trainer


def tf1_steps(overlap, steps=3, sizes=UNEQUAL, model_kw=None, feeds=None, **trainer_kw):
    """``steps`` steps (or one of ``feeds(model)``): (every variable, the results)."""
    model, sess, trainer = tf1_trainer(overlap, model_kw, **trainer_kw)
    sparse = (model_kw or {}).get("sparse", False)
    if feeds is None:
        data = [[model.feed({k: v[s] for k, v in d.items()}) for s in cuts(BATCH, sizes)]
                for d in batches(9, steps, BATCH, sparse=sparse)]
    else:
        data = [feeds(model)]
    results = [trainer.step(sess, f) for f in data]
    return model.values(sess), results


def compute_threads():
    return [t for t in threading.enumerate() if t.name.startswith("hostavg-compute")]


# --- fit, checkpoints and records --------------------------------------------------------------


def tf1_fit(overlap, ckpt=None, stop=None, hooks=()):
    model = models.mlp(10, [16], 3, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), overlap=overlap,
                                  hooks=hooks)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(250, 10)).astype(np.float32)
    data = {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)}
    history = trainer.fit(sess, data, batch_size=96, micro_batch_size=32, epochs=2, seed=3,
                          checkpoint_dir=ckpt, checkpoint_every=2 if ckpt else None, progress=False,
                          callbacks=[FailAt(stop)] if stop else [])
    with model.graph.as_default():
        variables = v1.global_variables()
    return dict(zip([v.op.name for v in variables], sess.run(variables))), history


def test_an_overlapped_fit_stopped_and_resumed_equals_an_uninterrupted_plain_fit(tmp_path):
    want, want_history = tf1_fit(False)
    ckpt = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        tf1_fit(True, ckpt, stop=5)
    CheckpointDir(ckpt).latest().unlink()  # as if killed: resume from step 4, not 5
    got, history = tf1_fit(True, ckpt)
    assert_bitwise(got, want)
    assert [s.loss for s in history.steps] == [s.loss for s in want_history.steps]


def test_an_overlapped_keras_fit_resumed_equals_an_uninterrupted_plain_fit(tmp_path):
    rng = np.random.default_rng(12)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def run(overlap, epochs, ckpt=None):
        model = keras_model(seed=2, batch_norm=True, names=False)
        trainer = hostavg.keras.Trainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(0.01), overlap=overlap)
        trainer.fit(x, y, batch_size=64, micro_batch_size=16, epochs=epochs, seed=3,
                    progress=False, checkpoint_dir=ckpt)
        return [v.numpy() for v in model.variables + trainer.optimizer.variables]

    want = run(False, 3)
    run(True, 1, tmp_path / "ck")
    got = run(True, 3, tmp_path / "ck")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_an_overlapped_record_equals_a_plain_one(tmp_path):
    for overlap in (False, True):
        tf1_fit(overlap, hooks=[Record(tmp_path / str(overlap), micro=True)])
    plain, overlapped = (hostavg.load_record(tmp_path / str(o)) for o in (False, True))
    assert overlapped.steps == plain.steps == [1, 2, 3, 4, 5, 6]
    for s in plain.steps:
        a, b = plain[s], overlapped[s]
        assert (a.loss, a.size, a.stats, a.micro, a.info) == (b.loss, b.size, b.stats, b.micro,
                                                              b.info)
        assert_bitwise(dict(b.mean), dict(a.mean))
        for i in range(len(a.micro)):
            assert_bitwise(dict(b.micro_grads(i)), dict(a.micro_grads(i)))


# --- Hooks that drop and clip -------------------------------------------------------------------


def test_skip_non_finite_and_clipping_with_overlap_equal_them_without():
    def feeds(model):
        case = type("Case", (), {})()
        case.model = model
        case.feeds = hostavg.split(model.feed(batches(4, 1, BATCH)[0]), 10)
        return poisoned(case, 2)

    runs = [tf1_steps(overlap, feeds=feeds, hooks=[SkipNonFinite(), ClipMicroBatchNorm(0.05)])
            for overlap in (False, True)]
    (want, want_results), (got, results) = runs
    assert_bitwise(got, want)
    assert_same_results(results, want_results)
    assert [m.dropped is not None for m in results[0].micro] == [False, False, True, False]
    clipped = results[0].info["micro_norms_before_clip"]
    assert np.isnan(clipped[2]) and all(n > 0.05 for i, n in enumerate(clipped) if i != 2)


def test_a_step_whose_every_micro_batch_is_dropped_with_overlap_is_skipped_and_restored():
    def feeds(model):
        x = model.inputs["x"]
        out = hostavg.split(model.feed(batches(4, 1, BATCH)[0]), 10)
        return [{**f, x: np.full_like(f[x], np.nan)} for f in out]

    (want, want_results), (got, results) = (
        tf1_steps(overlap, feeds=feeds, model_kw={"update_op": True}, hooks=[SkipNonFinite()])
        for overlap in (False, True))
    assert results[0].skipped == "all 4 micro-batches were dropped; nothing was applied"
    assert_same_results(results, want_results)
    assert_bitwise(got, want)


# --- Two trainers stepped together --------------------------------------------------------------


def test_an_overlapped_gan_stepped_together_equals_a_plain_one():
    rng = np.random.default_rng(5)
    data = [gan_batch(rng, 12) for _ in range(3)]

    def run(overlap):
        graph, t, d_loss, g_loss, d_vars, g_vars = gan()
        with graph.as_default():
            d = hostavg.Trainer(d_loss, v1.train.AdamOptimizer(1e-3), var_list=d_vars,
                                overlap=overlap)
            g = hostavg.Trainer(g_loss, v1.train.AdamOptimizer(1e-3), var_list=g_vars,
                                increment_global_step=False, overlap=overlap)
            init = v1.global_variables_initializer()
            variables = v1.global_variables()
        sess = v1.Session(graph=graph)
        sess.run(init)
        out = []
        for feed in data:
            fake = sess.run(t["samples"], {t["z"]: feed["z"]})
            d_feed = {t["real"]: feed["real"], t["fake"]: fake, t["labels"]: feed["labels"]}
            out += hostavg.step_together(sess, [
                (d, hostavg.split(d_feed, 4, blocks={t["labels"]: 2}), [8, 8, 8]),
                (g, hostavg.split({t["z"]: feed["z"]}, 4))])
        return dict(zip([v.op.name for v in variables], sess.run(variables))), out

    (want, want_results), (got, results) = run(False), run(True)
    assert_bitwise(got, want)
    assert_same_results(results, want_results)


def test_a_failing_second_trainer_of_an_overlapped_pair_restores_both():
    """The generator's hook fails while its next micro-batch computes: the discriminator's
    batch norm moved during its own (finished) micro-batches and must be restored too."""
    class FailAtOne:
        def on_micro_batch(self, micro):
            if micro.index == 1:
                raise RuntimeError("generator hook failed")

    graph, t, d_loss, g_loss, d_vars, g_vars = gan()
    with graph.as_default():
        d = hostavg.Trainer(d_loss, v1.train.AdamOptimizer(1e-3), var_list=d_vars, overlap=True)
        g = hostavg.Trainer(g_loss, v1.train.AdamOptimizer(1e-3), var_list=g_vars,
                            increment_global_step=False, overlap=True, hooks=[FailAtOne()])
        init = v1.global_variables_initializer()
        variables = v1.global_variables()
    sess = v1.Session(graph=graph)
    sess.run(init)
    feed = gan_batch(np.random.default_rng(6), 12)
    fake = sess.run(t["samples"], {t["z"]: feed["z"]})
    d_feed = {t["real"]: feed["real"], t["fake"]: fake, t["labels"]: feed["labels"]}
    before = sess.run(variables)
    with pytest.raises(RuntimeError, match="generator hook failed"):
        hostavg.step_together(sess, [(d, hostavg.split(d_feed, 4, blocks={t["labels"]: 2}),
                                      [8, 8, 8]),
                                     (g, hostavg.split({t["z"]: feed["z"]}, 4))])
    for v, a, b in zip(variables, sess.run(variables), before):
        np.testing.assert_array_equal(a, b, err_msg=v.op.name)


# --- Errors racing each other -------------------------------------------------------------------


def test_a_hook_failing_on_the_last_micro_batch_restores_and_the_next_step_is_clean():
    class FailLast:
        armed = True

        def on_micro_batch(self, micro):
            if self.armed and micro.index == 3:
                raise RuntimeError("last hook failed")

    hook = FailLast()
    model, sess, trainer = tf1_trainer(True, {"update_op": True}, hooks=[hook])
    feeds = hostavg.split(model.feed(batches(3, 1, BATCH)[0]), 10)
    before = model.values(sess)
    rows = [np.arange(i, i + 10) for i in range(0, BATCH, 10)]
    with pytest.raises(RuntimeError, match="last hook failed") as raised:
        trainer.step(sess, feeds, rows=rows)
    np.testing.assert_array_equal(raised.value.rows, np.arange(30, 40))
    assert any("micro-batch 3 of 4" in note for note in raised.value.__notes__)
    assert_bitwise(model.values(sess), before)
    hook.armed = False
    trainer.step(sess, feeds)
    want, _ = tf1_steps(False, feeds=lambda m: hostavg.split(m.feed(batches(3, 1, BATCH)[0]), 10),
                        model_kw={"update_op": True})
    assert_bitwise(model.values(sess), want)


def test_the_first_failure_by_micro_batch_order_surfaces_not_the_next_compute():
    """Micro-batch 0's hook fails while micro-batch 1 (ids beyond the table) fails to compute
    in the worker: the hook's error is the step's, and nothing changed."""
    class FailFirst:
        def on_micro_batch(self, micro):
            if micro.index == 0:
                time.sleep(0.2)  # micro-batch 1 has failed by now
                raise RuntimeError("first hook failed")

    model, sess, trainer = tf1_trainer(True, {"sparse": True}, hooks=[FailFirst()])
    feeds = hostavg.split(model.feed(batches(2, 1, BATCH, sparse=True)[0]), 10)
    ids = model.inputs["ids"]
    feeds[1] = {**feeds[1], ids: np.full_like(feeds[1][ids], 10_000)}
    before = model.values(sess)
    with pytest.raises(RuntimeError, match="first hook failed") as raised:
        trainer.step(sess, feeds, rows=[np.arange(i, i + 10) for i in range(0, BATCH, 10)])
    np.testing.assert_array_equal(raised.value.rows, np.arange(0, 10))
    assert_bitwise(model.values(sess), before)


def test_ctrl_c_in_a_hook_while_the_next_micro_batch_computes_rolls_back_after_it():
    class Interrupt:
        armed = True

        def on_micro_batch(self, micro):
            if self.armed and micro.index == 0:
                os.kill(os.getpid(), signal.SIGINT)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    model, loss, late = slow_update_model(0.3)
    hook = Interrupt()
    with model.graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), overlap=True,
                                  hooks=[hook])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    feeds = hostavg.split(model.feed(batches(3, 1, BATCH)[0]), 20)
    before = model.values(sess)
    with pytest.raises(KeyboardInterrupt):
        trainer.step(sess, feeds)
    time.sleep(0.4)  # a compute left running would have counted itself by now
    assert_bitwise(model.values(sess), before)
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    hook.armed = False
    assert trainer.step(sess, feeds).step == 1


# --- Hooks that compute, and calls right after a step -------------------------------------------


def test_a_hook_computing_on_its_own_trainer_during_an_overlapped_step_changes_nothing():
    seen = {}

    def run(overlap):
        model = build()
        computed = []

        class Peek:
            def on_micro_batch(self, micro):
                computed.append(trainer.compute(sess, feeds[-1 - micro.index]))

        with model.graph.as_default():
            trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), overlap=overlap,
                                      hooks=[Peek()])
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=model.graph)
        sess.run(init)
        results = []
        for d in batches(8, 3, BATCH):
            feeds = [model.feed({k: v[s] for k, v in d.items()}) for s in cuts(BATCH, UNEQUAL)]
            results.append(trainer.step(sess, feeds))
        seen[overlap] = computed
        return model.values(sess), results

    (want, want_results), (got, results) = run(False), run(True)
    assert_bitwise(got, want)
    assert_same_results(results, want_results)
    for a, b in zip(seen[True], seen[False]):
        assert a.loss == b.loss
        assert_bitwise(dict(a), dict(b))


def test_a_keras_hook_computing_on_its_own_trainer_during_an_overlapped_step_changes_nothing():
    data = batches(8, 2, BATCH)

    def run(overlap):
        computed = []

        class Peek:
            def on_micro_batch(self, micro):
                computed.append(trainer.compute(*parts[-1 - micro.index]))

        model = keras_model(seed=3)
        trainer = hostavg.keras.Trainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(0.01), overlap=overlap, hooks=[Peek()])
        for d in data:
            parts = [(d["x"][s], d["y"][s]) for s in cuts(BATCH, UNEQUAL)]
            trainer.step(parts)
        return [v.numpy() for v in model.variables], computed

    (want, want_computed), (got, computed) = run(False), run(True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(computed, want_computed):
        assert a.loss == b.loss
        assert_bitwise(dict(a), dict(b))


@pytest.mark.parametrize("failed", [False, True], ids=["after-a-step", "after-a-failed-step"])
def test_check_and_per_sample_right_after_an_overlapped_step_equal_those_after_a_plain_one(failed):
    class Fail:
        def on_micro_batch(self, micro):
            if failed and micro.index == 0:
                raise RuntimeError("failed on purpose")

    out = {}
    for overlap in (False, True):
        model, sess, trainer = tf1_trainer(overlap, {"update_op": True}, hooks=[Fail()])
        feed = model.feed(batches(6, 1, BATCH)[0])
        if failed:
            with pytest.raises(RuntimeError):
                trainer.step(sess, hostavg.split(feed, 10))
        else:
            trainer.step(sess, hostavg.split(feed, 10))
        report = trainer.check(sess, feed, micro_batch_size=10)
        samples = trainer.per_sample(sess, {k: v[:6] for k, v in feed.items()})
        out[overlap] = (str(report), samples.to_dict("list"), model.values(sess))
    np.testing.assert_equal(out[True][:2], out[False][:2])
    assert_bitwise(out[True][2], out[False][2])


def test_a_collected_trainer_ends_its_worker_thread():
    before = set(compute_threads())
    model, sess, trainer = tf1_trainer(True)
    trainer.step(sess, hostavg.split(model.feed(batches(1, 1, BATCH)[0]), 10))
    mine = [t for t in compute_threads() if t not in before]
    assert len(mine) == 1
    del trainer
    gc.collect()
    mine[0].join(5)
    assert not mine[0].is_alive()


# --- Where the micro-batches compute ------------------------------------------------------------


def probed_trainer(threads, overlap):
    """build()'s model whose loss notes the thread that runs it: (model, sess, trainer, threads)."""
    model = build()
    with model.graph.as_default():
        loss, ran_in = probed(model.loss)
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), overlap=overlap,
                                  session_threads=threads)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, sess, trainer, ran_in


def test_one_overlapped_micro_batch_computes_in_the_calling_thread_and_more_in_the_worker():
    model, sess, trainer, ran_in = probed_trainer("caller", True)
    feed = model.feed(batches(2, 1, BATCH)[0])
    one = trainer.step(sess, [feed])
    assert ran_in == [threading.get_ident()]
    ran_in.clear()
    trainer.step(sess, hostavg.split(feed, 10))
    assert len(ran_in) == 4 and threading.get_ident() not in ran_in
    plain, plain_sess, plain_trainer, _ = probed_trainer("caller", False)
    want = plain_trainer.step(plain_sess, [plain.feed(batches(2, 1, BATCH)[0])])
    assert_same_results([one], [want])


@pytest.mark.parametrize("accumulate,average", [("stack", "graph"), ("sum", "graph"),
                                                ("stack", "host")])
@pytest.mark.parametrize("threads", ["pool", "caller"])
def test_overlap_with_every_accumulation_and_average_equals_it_without(accumulate, average,
                                                                       threads):
    runs = [tf1_steps(overlap, model_kw={"sparse": True, "update_op": True},
                      accumulate=accumulate, average=average, session_threads=threads)
            for overlap in (False, True)]
    (want, want_results), (got, results) = runs
    assert_bitwise(got, want)
    assert_same_results(results, want_results)
    if accumulate == "stack":
        for a, b in zip(results[-1].micro, want_results[-1].micro):
            assert (a.grads.loss, a.grads.size) == (b.grads.loss, b.grads.size)
            assert_bitwise(dict(a.grads), dict(b.grads))


def test_a_py_function_in_the_loss_runs_in_the_caller_thread_overlapped_or_not():
    """tf.py_function (eager, unlike py_func) inside the loss, with the ops in the caller thread
    and that thread the overlap's worker: the same numbers as in the pool, one thread."""
    def run(threads, overlap):
        model = build()
        with model.graph.as_default():
            scale = tf.py_function(lambda v: v * 2.0, [model.loss], tf.float32)
            loss = model.loss + 0 * tf.stop_gradient(tf.reshape(scale, []))
            trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01), overlap=overlap,
                                      session_threads=threads)
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=model.graph)
        sess.run(init)
        out = [trainer.step(sess, [model.feed({k: v[s] for k, v in d.items()})
                                   for s in cuts(BATCH, UNEQUAL)]) for d in batches(3, 2, BATCH)]
        return model.values(sess), out

    want, want_results = run("pool", False)
    for threads, overlap in (("caller", False), ("caller", True), ("pool", True)):
        got, results = run(threads, overlap)
        assert_bitwise(got, want)
        assert_same_results(results, want_results)


# --- Memory -------------------------------------------------------------------------------------


def test_keras_sum_mode_with_overlap_holds_no_micro_batch_gradient_past_its_add():
    """Every micro-batch's gradients are freed once added, without a garbage collection."""
    import weakref
    refs, alive = [], []

    class Watch:
        def on_micro_batch(self, micro):
            refs.append(weakref.ref(next(iter(micro.grads.values()))))

        def on_step(self, mean, result):
            alive.append(sum(r() is not None for r in refs))

    model = keras_model(seed=4)
    trainer = hostavg.keras.Trainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01), overlap=True, hooks=[Watch()])
    for d in batches(5, 3, BATCH):
        trainer.step([(d["x"][s], d["y"][s]) for s in cuts(BATCH, UNEQUAL)])
    assert len(refs) == 12 and alive == [0, 0, 0]
