"""The overlapped step (``overlap=True``): micro-batch i + 1 computes in a worker thread while
the host takes micro-batch i. The same results bit for bit, errors that name the micro-batch
they came from, and nothing restored under a computation still running."""

import threading
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from models import OPTIMIZERS, batches, build, cuts, full_batch, poisoned, v1
from models import keras_model
from test_trainer import BATCH, UNEQUAL, assert_same_weights

import hostavg
import hostavg.keras

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
