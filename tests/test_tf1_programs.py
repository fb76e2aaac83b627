"""Classic TF1 programs, written the way TF1 programs were written, switched to hostavg.

Each small model here is in the style of a public example program (linear regression on
scalar variables, an MLP with dropout fed keep_prob, a GAN with batch norm in both networks,
word2vec with nce_loss, save/restore with tf.train.Saver) and is compared with its own
full-batch train op where the program is deterministic."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from models import ENV, cuts, v1

import hostavg
from hostavg.hooks import Record

HERE = Path(__file__).parent


def session(graph, init):
    sess = v1.Session(graph=graph)
    sess.run(init)
    return sess


def values(graph, sess) -> dict:
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


def assert_close(got: dict, want: dict, atol: float):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=atol, rtol=0, err_msg=name)


# --- Linear regression: scalar variables, a loss written as a sum, scalar-only feeds --------


def regression(loss_kind="mean", global_step=None):
    """The classic y = W x + b with W and b scalars, fed one sample at a time or in arrays."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, name="x")  # no shape: the classic program feeds floats
        y = v1.placeholder(tf.float32, name="y")
        W = tf.Variable(0.3, name="weight")
        b = tf.Variable(-0.2, name="bias")
        pred = W * x + b
        if loss_kind == "mean":
            loss = tf.reduce_mean(tf.square(pred - y)) / 2
        else:  # the public example: reduce_sum(...) / (2 * n_samples), a sum over the feed
            loss = tf.reduce_sum(tf.square(pred - y)) / (2 * 17)
        if global_step == "program":
            tf.Variable(0, name="global_step", trainable=False)
    return graph, x, y, loss


def linear_data(n=17, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(0, 10, n).astype(np.float32)
    return X, (2.0 * X + 1.0 + rng.normal(0, 0.5, n)).astype(np.float32)


def test_scalar_variables_fit_checkpoint_and_record(tmp_path):
    X, Y = linear_data()
    graph, x, y, loss = regression()
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01),
                                  hooks=[Record(tmp_path / "record")])
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    history = trainer.fit(sess, {x: X, y: Y}, batch_size=8, micro_batch_size=3, epochs=3,
                          seed=0, progress=False, checkpoint_dir=tmp_path / "ckpt")
    assert len(history.steps) == 9 and np.isfinite(history.steps[-1].loss)
    record = hostavg.load_record(tmp_path / "record")
    last = record[max(record.steps)]
    assert np.shape(last.mean["weight"]) == () and np.shape(last.micro_grads(0)["bias"]) == ()

    graph2, x2, y2, loss2 = regression()
    with graph2.as_default():
        other = hostavg.Trainer(loss2, v1.train.GradientDescentOptimizer(0.01))
        init2 = v1.global_variables_initializer()
    sess2 = session(graph2, init2)
    other.restore(sess2, sorted((tmp_path / "ckpt").iterdir())[-1])
    assert_close(values(graph2, sess2), values(graph, sess), atol=0)


def test_scalar_only_feeds_step_with_sizes_and_equal_the_full_batch_step():
    X, Y = linear_data()
    graph, x, y, loss = regression()
    with graph.as_default():
        opt = v1.train.AdamOptimizer(0.1)
        trainer = hostavg.Trainer(loss, opt)
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    one_by_one = [{x: float(a), y: float(b)} for a, b in zip(X, Y)]  # as the example feeds
    with pytest.raises(hostavg.HostavgError, match=r"only scalars.*sizes= \(one per micro-batch\) "
                                                   r"to step"):
        trainer.step(sess, one_by_one)
    for _ in range(3):
        trainer.step(sess, one_by_one, sizes=[1] * len(one_by_one))

    oracle, ox, oy, oloss = regression()
    with oracle.as_default():
        train = v1.train.AdamOptimizer(0.1).minimize(
            oloss, global_step=v1.train.get_or_create_global_step())
        init = v1.global_variables_initializer()
    osess = session(oracle, init)
    for _ in range(3):
        osess.run(train, {ox: X, oy: Y})
    assert_close(values(graph, sess), values(oracle, osess), atol=1e-5)


def test_a_sum_loss_is_caught_by_the_self_check_and_a_mean_loss_passes():
    X, Y = linear_data()
    for kind, ok in [("sum", False), ("mean", True)]:
        graph, x, y, loss = regression(kind)
        with graph.as_default():
            trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01))
            init = v1.global_variables_initializer()
        sess = session(graph, init)
        before = values(graph, sess)
        report = trainer.check(sess, {x: X[:16], y: Y[:16]}, micro_batch_size=4)
        assert report.ok is ok, report
        assert report.micro_batches == 4
        assert_close(values(graph, sess), before, atol=0)  # the check changes nothing
        if ok:
            assert max(report.max_rel_diff.values()) < 1e-5
            assert str(report).startswith("self-check passed: 4 micro-batches")
        else:
            assert report.scale == pytest.approx(4, rel=1e-5)
            assert "a sum over samples" in report.cause and "tf.reduce_mean" in report.cause
            assert str(report).startswith("self-check FAILED: 4 micro-batches differ")


# --- The program's own global step ----------------------------------------------------------


@pytest.mark.parametrize("make", ["resource", "ref", "int32", "collection"])
def test_a_global_step_the_program_made_is_found_and_used(make):
    X, Y = linear_data()
    graph, x, y, loss = regression()
    with graph.as_default():
        if make == "resource":
            step = tf.Variable(0, name="global_step", trainable=False, dtype=tf.int64)
        elif make == "ref":
            step = v1.Variable(0, name="global_step", trainable=False, dtype=tf.int64,
                               use_resource=False)
        elif make == "int32":
            step = tf.Variable(0, name="global_step", trainable=False, dtype=tf.int32)
        else:
            step = tf.Variable(0, name="my_counter", trainable=False, dtype=tf.int64)
            v1.add_to_collection(v1.GraphKeys.GLOBAL_STEP, step)
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01))
        init = v1.global_variables_initializer()
    assert trainer.global_step is step
    sess = session(graph, init)
    assert trainer.step(sess, hostavg.split({x: X, y: Y}, 5)).step == 1
    assert sess.run(step) == 1


def test_a_global_step_that_cannot_count_is_refused_with_what_to_do():
    graph, x, y, loss = regression()
    with graph.as_default():
        tf.Variable(0.0, name="global_step", trainable=False)
        with pytest.raises(hostavg.HostavgError,
                           match=r"the graph's global step must be a scalar integer variable.*"
                                 r"dtype float32.*pass global_step="):
            hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01))
        with pytest.raises(hostavg.HostavgError, match=r"^global_step must be a scalar integer"):
            hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01),
                            global_step=tf.constant(0))


# --- Dropout with keep_prob fed as a scalar -------------------------------------------------


def dropout_mlp(seed=0):
    rng = np.random.default_rng(seed)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 10], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        keep_prob = v1.placeholder(tf.float32, name="keep_prob")
        w1 = tf.Variable(rng.normal(0, 0.3, (10, 16)).astype(np.float32), name="w1")
        w2 = tf.Variable(rng.normal(0, 0.3, (16, 3)).astype(np.float32), name="w2")
        h = tf.nn.dropout(tf.nn.relu(tf.matmul(x, w1)), rate=1 - keep_prob, seed=1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, w2)))
    return graph, (x, y, keep_prob), loss


def test_dropout_fed_keep_prob_equals_full_batch_at_one_and_the_check_names_it_at_a_half():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(24, 10)).astype(np.float32)
    Y = rng.integers(0, 3, 24)
    graph, (x, y, keep), loss = dropout_mlp()
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.MomentumOptimizer(0.1, 0.9))
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    report = trainer.check(sess, {x: X, y: Y, keep: 0.5}, micro_batch_size=8)
    assert not report.ok and report.noise > 0.01
    assert "random ops in training mode: tf.nn.dropout ('dropout/random_uniform/" in report.cause
    assert "'keep_prob:0' switches dropout here; feed it what turns it off (1.0 for a keep " \
           "probability, 0.0 for a rate, False for a training flag)" in report.cause
    assert trainer.check(sess, {x: X, y: Y, keep: 1.0}, micro_batch_size=8).ok
    for _ in range(4):
        trainer.step(sess, hostavg.split({x: X, y: Y, keep: 1.0}, 8))

    oracle, (ox, oy, okeep), oloss = dropout_mlp()
    with oracle.as_default():
        train = v1.train.MomentumOptimizer(0.1, 0.9).minimize(
            oloss, global_step=v1.train.get_or_create_global_step())
        init = v1.global_variables_initializer()
    osess = session(oracle, init)
    for _ in range(4):
        osess.run(train, {ox: X, oy: Y, okeep: 1.0})
    assert_close(values(graph, sess), values(oracle, osess), atol=1e-5)


def switched_program(shared: bool):
    """An MLP with batch norm and dropout switched between training and inference, as TF1
    programs switched them: one ``training`` placeholder for both (``shared``), or dropout by a
    keep_prob placeholder of its own."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        training = v1.placeholder_with_default(True, [], name="training")
        h = dense(x, 8, "d1")
        with v1.variable_scope("bn"):
            moving_mean = v1.get_variable("moving_mean", [8], initializer=v1.zeros_initializer(),
                                          trainable=False)
            moving_var = v1.get_variable("moving_variance", [8], initializer=v1.ones_initializer(),
                                         trainable=False)
        m, v = tf.nn.moments(h, [0])
        momentum = tf.where(training, 0.1, 0.0)  # out of training, the statistics stay
        for moving, now in ((moving_mean, m), (moving_var, v)):
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS,
                                 moving.assign(moving + momentum * (now - moving)))
        mean, var = tf.cond(training, lambda: (m, v),
                            lambda: (tf.identity(moving_mean), tf.identity(moving_var)))
        h = tf.nn.relu(tf.nn.batch_normalization(h, mean, var, None, None, 1e-3))
        keep_prob = None
        if shared:
            rate = tf.cond(training, lambda: 0.5, lambda: 0.0)
        else:
            keep_prob = v1.placeholder_with_default(0.5, [], name="keep_prob")
            rate = 1 - keep_prob
        logits = dense(tf.nn.dropout(h, rate=rate, seed=1), 3, "d2")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    rng = np.random.default_rng(15)
    feed = {x: rng.normal(size=(24, 6)).astype(np.float32), y: rng.integers(0, 3, 24)}
    return trainer, session(graph, init), feed, training, keep_prob


def test_the_check_names_every_training_mode_switch_and_one_that_switches_both():
    # One training placeholder switched dropout and batch norm: the advised recheck with it fed
    # False passed, hiding the batch-norm difference that keep_prob 1.0 alone shows.
    trainer, sess, feed, training, _ = switched_program(shared=True)
    report = trainer.check(sess, feed, micro_batch_size=6)
    assert not report.ok and report.noise > 0.01
    assert ("'training:0' switches dropout here; feed it what turns it off (1.0 for a keep "
            "probability, 0.0 for a rate, False for a training flag) and check again. But "
            "'training:0' switches batch norm too: fed that, batch norm uses its moving "
            "statistics, and a check that then passes says nothing of batch norm in training "
            "mode") in report.cause
    assert trainer.check(sess, {**feed, training: False}, micro_batch_size=6).ok  # hides it

    trainer, sess, feed, training, keep_prob = switched_program(shared=False)
    report = trainer.check(sess, feed, micro_batch_size=6)
    assert not report.ok and report.noise > 0.01
    assert "'keep_prob:0' switches dropout here" in report.cause and "too" not in report.cause
    assert ("'training:0' switches batch norm: leave it in training mode, so that the check "
            "shows what batch norm changes") in report.cause
    report = trainer.check(sess, {**feed, keep_prob: 1.0}, micro_batch_size=6)
    assert not report.ok and report.noise < 1e-4  # batch norm's difference, shown
    assert ("an op that computes over the batch (each micro-batch's own statistics instead of "
            "the batch's), such as batch norm in training mode") in report.cause
    assert "here switched by 'training:0'" in report.cause


def test_the_check_names_the_random_op_it_finds_and_what_turns_it_off():
    # A VAE draws its noise in the graph: the advice "a keep_prob placeholder fed 1.0, a
    # training placeholder fed False" named neither.
    rng = np.random.default_rng(11)
    X = rng.normal(size=(24, 6)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        stats = tf.matmul(x, tf.Variable(rng.normal(0, 0.3, (6, 4)).astype(np.float32)))
        mu, log_var = stats[:, :2], stats[:, 2:]
        with tf.name_scope("sample"):
            z = mu + tf.exp(log_var / 2) * tf.random.normal(tf.shape(mu))
        decoded = tf.matmul(z, tf.Variable(rng.normal(0, 0.3, (2, 6)).astype(np.float32)))
        kl = -0.5 * tf.reduce_sum(1 + log_var - tf.square(mu) - tf.exp(log_var), 1)
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(decoded - x), 1) + kl)
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(1e-3))
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    report = trainer.check(sess, {x: X}, micro_batch_size=8)
    noise = "sample/random_normal/RandomStandardNormal:0"
    assert not report.ok and (f"random ops in training mode: tf.random.normal ('{noise}'). No "
                              f"feed turns them off") in report.cause
    assert "keep_prob" not in report.cause and "fed False" not in report.cause
    assert f"feed {noise!r} a fixed array" in report.cause
    assert trainer.check(sess, {x: X, noise: np.zeros((24, 2), np.float32)}, micro_batch_size=8).ok  # as it says


# --- Tensors fetched with the train op: summaries, accuracy -----------------------------------


def summarized_classifier():
    """A classifier whose program ran sess.run([train_op, summary, accuracy], feed); its weights
    a reference variable."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 10], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.Variable(np.random.default_rng(0).normal(0, 0.3, (10, 3)).astype(np.float32),
                        name="w", use_resource=False)
        logits = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        summary = v1.summary.merge([v1.summary.scalar("loss", loss),
                                    v1.summary.scalar("accuracy", accuracy)])
        weights = tf.identity(w, name="weights")  # the variable's buffer, as a session returns it
    return graph, (x, y), loss, accuracy, summary, weights


def test_tensors_fetched_with_a_step_are_each_micro_batch_s_own_before_the_update():
    # Programs that ran sess.run([train_op, summary, accuracy], feed) had to fetch them in a
    # second full-batch run after the update: another forward pass, post-update values.
    rng = np.random.default_rng(12)
    X, Y = rng.normal(size=(24, 10)).astype(np.float32), rng.integers(0, 3, 24)
    graph, (x, y), loss, accuracy, summary, weights = summarized_classifier()
    seen = []

    class Seen:
        def on_micro_batch(self, micro):
            seen.append(micro.fetched)

    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.5), hooks=[Seen()])
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    feeds = hostavg.split({x: X, y: Y}, 8)
    want = [sess.run([accuracy, loss], f) for f in feeds]
    w_before = sess.run(weights)
    res = trainer.step(sess, feeds, fetches=[accuracy, summary, "weights:0", accuracy.op])
    assert len(res.fetched) == 3 and seen == [m.fetched for m in res.micro] == list(res.fetched)
    for (acc, proto, w, none), m, (want_acc, want_loss) in zip(res.fetched, res.micro, want):
        assert acc == want_acc and m.loss == want_loss and none is None
        tags = {v.tag: v.simple_value for v in v1.Summary.FromString(proto).value}
        assert tags == pytest.approx({"loss": want_loss, "accuracy": want_acc})
        np.testing.assert_array_equal(w, w_before)  # copied: the update changed the buffer
        assert not w.flags.writeable
    assert not np.array_equal(sess.run(weights), w_before)

    seen.clear()
    history = trainer.fit(sess, {x: X, y: Y}, batch_size=12, micro_batch_size=4, shuffle=False,
                          progress=False, fetches=[accuracy])
    assert len(history.steps) == 2 and len(seen) == 6 and all(len(f) == 1 for f in seen)

    with tf.Graph().as_default():
        stranger = tf.constant(1.0)
    for bad, match in [(accuracy, r"^fetches must be a list or tuple of tensors or operations, "
                                  r"got 'Mean_\d:0'; such as fetches=\[accuracy, summary\]"),
                       ([trainer.global_step], r"^fetches\[0\]: 'global_step:0' is a variable"),
                       (["nope:0"], r"^fetches\[0\]: 'nope:0' names nothing in the trainer's graph"),
                       ([stranger], r"^fetches\[0\]: 'Const:0' is not in the trainer's graph")]:
        with pytest.raises(hostavg.HostavgError, match=match):
            trainer.step(sess, feeds, fetches=bad)
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 3: 'x:0' is fed and "
                                                   r"fetched"):
        trainer.step(sess, feeds, fetches=[x])
    assert sess.run(trainer.global_step) == 3


def test_a_fetch_that_changes_state_is_refused_before_anything_runs():
    # Porting sess.run([train_op, summary, accuracy], feed) into fetches= ran the train op once
    # per micro-batch: the weights moved k extra times, which a failed step could not undo.
    rng = np.random.default_rng(13)
    X, Y = rng.normal(size=(24, 10)).astype(np.float32), rng.integers(0, 3, 24)
    graph, (x, y), loss, accuracy, summary, weights = summarized_classifier()
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.5))
        train_op = v1.train.AdamOptimizer(0.1).minimize(loss, name="train_op")  # the program's own
        with tf.control_dependencies([train_op]):
            after = tf.identity(loss, name="loss_after")
        bump = v1.assign_add(trainer.global_step, 1, name="bump")
        queue = v1.FIFOQueue(10, [tf.float32], shapes=[[]], name="queue")
        enqueue, dequeued = queue.enqueue([1.0], name="put"), queue.dequeue(name="take")
        queued = queue.size()
        batch = v1.data.make_one_shot_iterator(tf.data.Dataset.range(5)).get_next(name="next")
        mean_loss, update_mean = v1.metrics.mean(loss)  # a streaming metric: local variables
        init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
    sess = session(graph, init)
    feeds = hostavg.split({x: X, y: Y}, 8)
    before = values(graph, sess)
    for fetch, said in [
            (train_op, r"'train_op' runs 'train_op/update_w/ApplyAdam' \(ApplyAdam\), which "
                       r"assigns the variable 'w' \(an optimizer's update\)"),
            (after, r"'loss_after:0' runs 'train_op/update_w/ApplyAdam' \(ApplyAdam\), which "
                    r"assigns the variable 'w' \(an optimizer's update\)"),
            (bump, r"'AssignAddVariableOp' runs 'AssignAddVariableOp' \(AssignAddVariableOp\), "
                   r"which assigns the variable 'global_step'"),
            (enqueue, r"'put' runs 'put' \(QueueEnqueueV2\), which adds to the queue 'queue'"),
            (dequeued, r"'take:0' runs 'take' \(QueueDequeueV2\), which takes from the queue "
                       r"'queue'"),
            (batch, r"'next:0' runs 'next' \(IteratorGetNext\), which takes the next element of "
                    r"the iterator 'OneShotIterator'")]:
        fetches = [accuracy, fetch]
        with pytest.raises(hostavg.HostavgError, match=r"^fetches\[1\]: " + said + r": fetched, it "
                           r"would run with every micro-batch\. hostavg applies the step's update "
                           r"itself, once per step; fetch what reads the graph \(summaries, "
                           r"metrics, activations\), not what changes it$"):
            trainer.step(sess, feeds, fetches=fetches)
        with pytest.raises(hostavg.HostavgError, match=r"^fetches\[1\]: " + said):
            trainer.fit(sess, {x: X, y: Y}, batch_size=12, progress=False, fetches=fetches)
    assert_close(values(graph, sess), before, atol=0)
    assert sess.run(queued) == 0 and sess.run(batch) == 0  # nothing taken, nothing added

    # Summaries, metrics (a streaming one's update op counts each micro-batch's samples) and
    # activations read the graph: allowed.
    res = trainer.step(sess, feeds, fetches=[summary, accuracy, update_mean, weights])
    assert res.step == 1 and len(res.fetched) == 3
    assert sess.run(mean_loss) == pytest.approx(np.mean([m.loss for m in res.micro]), rel=1e-6)


def test_a_fetch_that_runs_the_update_ops_a_micro_batch_runs_anyway_is_allowed():
    # Batch norm's moving statistics in UPDATE_OPS, and an accuracy made after them (as programs
    # make their train op): each micro-batch runs them once anyway, in the same session call.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        logits = dense(tf.nn.relu(batch_norm(dense(x, 8, "d1"), "bn")), 3, "d2")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        update_ops = v1.get_collection(v1.GraphKeys.UPDATE_OPS)
        with tf.control_dependencies(update_ops):
            accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        frozen = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1), update_ops=[])
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    rng = np.random.default_rng(14)
    feeds = hostavg.split({x: rng.normal(size=(12, 6)).astype(np.float32),
                           y: rng.integers(0, 3, 12)}, 4)
    res = trainer.step(sess, feeds, fetches=[accuracy, update_ops[0]])
    assert res.step == 1 and len(res.fetched) == 3
    # A trainer told to run no update ops would have them run by the fetch: refused.
    with pytest.raises(hostavg.HostavgError, match=r"^fetches\[0\]: 'Mean_1:0' runs "
                                                   r"'AssignVariableOp' \(AssignVariableOp\), "
                                                   r"which assigns the variable 'bn/moving_mean'"):
        frozen.step(sess, feeds, fetches=[accuracy])


# --- A GAN with batch norm in both networks -------------------------------------------------


def batch_norm(h, scope, training=True):
    """Batch norm as TF1 programs wrote it by hand: moments, moving averages in UPDATE_OPS."""
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        n = h.shape[-1]
        gamma = v1.get_variable("gamma", [n], initializer=v1.ones_initializer())
        beta = v1.get_variable("beta", [n], initializer=v1.zeros_initializer())
        mean_ = v1.get_variable("moving_mean", [n], initializer=v1.zeros_initializer(),
                                trainable=False)
        var_ = v1.get_variable("moving_variance", [n], initializer=v1.ones_initializer(),
                               trainable=False)
    if not training:
        return tf.nn.batch_normalization(h, mean_, var_, beta, gamma, 1e-3)
    m, v = tf.nn.moments(h, [0])
    v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, mean_.assign(0.9 * mean_ + 0.1 * m))
    v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, var_.assign(0.9 * var_ + 0.1 * v))
    return tf.nn.batch_normalization(h, m, v, beta, gamma, 1e-3)


def dense(h, units, scope):
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        w = v1.get_variable("w", [h.shape[-1], units],
                            initializer=v1.random_normal_initializer(0, 0.3, seed=len(scope)))
        b = v1.get_variable("b", [units], initializer=v1.zeros_initializer())
    return tf.matmul(h, w) + b


def gan():
    """DCGAN-style: D sees real and generated images together, labelled by a 2 x batch placeholder."""
    graph = tf.Graph()
    with graph.as_default():
        z = v1.placeholder(tf.float32, [None, 4], name="z")
        real = v1.placeholder(tf.float32, [None, 6], name="real")
        fake_in = v1.placeholder(tf.float32, [None, 6], name="fake")  # G's samples, fed back
        labels = v1.placeholder(tf.float32, [None, 1], name="labels")  # real ones, then fake zeros

        def generator(z):
            with v1.variable_scope("generator"):
                return tf.tanh(dense(tf.nn.relu(batch_norm(dense(z, 8, "g1"), "bn")), 6, "g2"))

        def discriminator(images):
            with v1.variable_scope("discriminator"):
                return dense(tf.nn.relu(batch_norm(dense(images, 8, "d1"), "bn")), 1, "d2")

        samples = generator(z)
        d_loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=labels, logits=discriminator(tf.concat([real, fake_in], 0))))
        fake_logits = discriminator(samples)
        g_loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.ones_like(fake_logits), logits=fake_logits))
        d_vars = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "discriminator")
        g_vars = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "generator")
    return graph, dict(z=z, real=real, fake=fake_in, labels=labels, samples=samples,
                       fake_logits=fake_logits), d_loss, g_loss, d_vars, g_vars


def gan_batch(rng, n):
    return {"z": rng.normal(size=(n, 4)).astype(np.float32),
            "real": rng.normal(1, 0.5, (n, 6)).astype(np.float32),
            "labels": np.concatenate([np.ones((n, 1)), np.zeros((n, 1))]).astype(np.float32)}


def gan_trainers():
    """The GAN with a trainer per network; the generator's leaves the global step alone."""
    graph, t, d_loss, g_loss, d_vars, g_vars = gan()
    with graph.as_default():
        d = hostavg.Trainer(d_loss, v1.train.AdamOptimizer(1e-3), var_list=d_vars)
        g = hostavg.Trainer(g_loss, v1.train.AdamOptimizer(1e-3), var_list=g_vars,
                            increment_global_step=False)
        init = v1.global_variables_initializer()
    return graph, t, d, g, init


def test_gan_update_ops_are_scoped_to_what_each_loss_can_run():
    graph, t, d, g, init = gan_trainers()
    scopes = lambda ops: sorted({op.name.split("/")[0].split("_")[0] for op in ops})  # noqa: E731
    # D's loss is fed real and fake images: the generator's batch norm (it needs z) is left out.
    assert scopes(d.update_ops) == ["discriminator"]
    # G's loss runs both networks on z: both networks' batch norms move.
    assert scopes(g.update_ops) == ["discriminator", "generator"]
    sess = session(graph, init)
    rng = np.random.default_rng(0)
    feed = gan_batch(rng, 12)
    fake = sess.run(t["samples"], {t["z"]: feed["z"]})
    d_feed = {t["real"]: feed["real"], t["fake"]: fake, t["labels"]: feed["labels"]}
    res = d.step(sess, hostavg.split(d_feed, 4, blocks={t["labels"]: 2}), sizes=[8, 8, 8])
    assert res.step == 1 and res.size == 24
    res = g.step(sess, hostavg.split({t["z"]: feed["z"]}, 4))
    assert res.step == 1 == sess.run(d.global_step)  # the generator leaves the step alone
    with graph.as_default():
        none = hostavg.Trainer(d.loss, v1.train.GradientDescentOptimizer(0.1),
                               var_list=v1.trainable_variables("discriminator"),
                               update_ops=[], increment_global_step=False)
    assert none.update_ops == () and not [v for v in none.rollback_variables
                                          if "moving" in v.op.name]


def test_gan_simultaneous_update_equals_the_programs_own_simultaneous_train_op():
    rng = np.random.default_rng(2)
    batches = [gan_batch(rng, 10) for _ in range(3)]

    def run(with_hostavg):
        graph, t, d_loss, g_loss, d_vars, g_vars = gan()
        with graph.as_default():
            # One network's loss, both images from the generator: a simultaneous update.
            d_loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=t["labels"], logits=t["fake_logits"]))
            d_opt, g_opt = v1.train.AdamOptimizer(1e-2), v1.train.AdamOptimizer(1e-2)
            step = v1.train.get_or_create_global_step()
            if with_hostavg:
                d = hostavg.Trainer(d_loss, d_opt, var_list=d_vars, update_ops=[])
                g = hostavg.Trainer(g_loss, g_opt, var_list=g_vars, update_ops=[],
                                    increment_global_step=False)
            else:
                d_grads = d_opt.compute_gradients(d_loss, d_vars)
                g_grads = g_opt.compute_gradients(g_loss, g_vars)
                with tf.control_dependencies([gr for gr, _ in d_grads + g_grads]):
                    train = tf.group(d_opt.apply_gradients(d_grads, global_step=step),
                                     g_opt.apply_gradients(g_grads))
            init = v1.global_variables_initializer()
        sess = session(graph, init)
        for b in batches:
            # D judges G(z) twice over (the labels say which half is "real"): both losses read z.
            feed = {t["z"]: np.concatenate([b["z"], b["z"][::-1]])[:10], t["labels"]: b["labels"][:10]}
            if with_hostavg:
                res_d, res_g = hostavg.step_together(sess, [(d, [feed]), (g, [{t["z"]: feed[t["z"]]}])])
                assert res_d.step == res_g.step
            else:
                sess.run(train, feed)
        return values(graph, sess)

    assert_close(run(True), run(False), atol=1e-6)


def test_step_together_is_atomic_across_trainers():
    graph, t, d, g, init = gan_trainers()
    sess = session(graph, init)
    rng = np.random.default_rng(3)
    feed = gan_batch(rng, 6)
    d_feed = {t["real"]: feed["real"], t["fake"]: feed["real"] * 0, t["labels"]: feed["labels"]}
    before = values(graph, sess)
    bad_z = {t["z"]: np.full((6, 4), np.nan, np.float32)}
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 1 \(samples 0:6\): "
                                                   r"non-finite gradients"):
        hostavg.step_together(sess, [(d, [d_feed], [6]), (g, [bad_z])])
    assert_close(values(graph, sess), before, atol=0)  # D's step was not applied, BN restored
    with pytest.raises(hostavg.HostavgError, match="listed twice"):
        hostavg.step_together(sess, [(g, [{t["z"]: feed["z"]}]), (g, [{t["z"]: feed["z"]}])])
    assert_close(values(graph, sess), before, atol=0)


def test_micro_batches_split_with_blocks_know_their_sizes_in_step_and_step_together():
    # step_together refused split(..., blocks=)'s micro-batches unless given sizes, and its
    # error suggested blocks=, which neither step nor step_together takes.
    def run(given_sizes):
        graph, t, d, g, init = gan_trainers()
        sess = session(graph, init)
        feed = gan_batch(np.random.default_rng(8), 10)
        fake = sess.run(t["samples"], {t["z"]: feed["z"]})
        d_feeds = hostavg.split({t["real"]: feed["real"], t["fake"]: fake,
                                 t["labels"]: feed["labels"]}, 4, blocks={t["labels"]: 2})
        g_feeds = hostavg.split({t["z"]: feed["z"]}, 4)
        entry = (d, d_feeds, [4, 4, 2]) if given_sizes else (d, d_feeds)
        res_d, _ = hostavg.step_together(sess, [entry, (g, g_feeds)])
        assert [m.size for m in res_d.micro] == [4, 4, 2] and res_d.size == 10
        res = d.step(sess, d_feeds)
        assert [m.size for m in res.micro] == [4, 4, 2]
        with pytest.raises(hostavg.HostavgError,
                           match=r"^step, micro-batch 0 of 3: arrays have different lengths along "
                                 r"axis 0 .*labels:0: 8\).*blocks=.* hostavg\.split.*sizes=.*"
                                 r"\(trainer, batches, sizes\) to step_together"):
            hostavg.step_together(sess, [(d, [dict(f) for f in d_feeds])])  # plain dicts
        return values(graph, sess)

    assert_close(run(False), run(True), atol=0)


def test_fit_with_blocks_equals_steps_over_hand_cut_micro_batches():
    graph, t, d_loss, g_loss, d_vars, g_vars = gan()
    rng = np.random.default_rng(4)
    n = 20
    real, fake = rng.normal(size=(n, 6)).astype(np.float32), rng.normal(size=(n, 6)).astype(np.float32)
    labels = np.concatenate([np.ones((n, 1)), np.zeros((n, 1))]).astype(np.float32)

    def trained(by_fit):
        graph, t, d_loss, _, d_vars, _ = gan()
        with graph.as_default():
            d = hostavg.Trainer(d_loss, v1.train.AdamOptimizer(1e-2), var_list=d_vars)
            init = v1.global_variables_initializer()
        sess = session(graph, init)
        if by_fit:
            d.fit(sess, {t["real"]: real, t["fake"]: fake, t["labels"]: labels}, batch_size=8,
                  micro_batch_size=3, shuffle=False, progress=False, blocks={"labels": 2})
        else:
            for s in cuts(n, (8, 8, 4)):
                m = s.stop - s.start
                feeds = [{t["real"]: real[s][c], t["fake"]: fake[s][c],
                          t["labels"]: np.concatenate([labels[:n][s][c], labels[n:][s][c]])}
                         for c in cuts(m, [3] * (m // 3) + ([m % 3] if m % 3 else []))]
                d.step(sess, feeds, sizes=[len(f[t["real"]]) for f in feeds])
        return values(graph, sess)

    assert_close(trained(True), trained(False), atol=0)


# --- A graph that fixes the batch size ---------------------------------------------------------


def fixed_batch_program(kind, batch_size=12):
    """A classifier written for batches of exactly ``batch_size``: a reshape or a constant of
    that many rows, or two towers that each slice their half of the batch."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = tf.Variable(np.random.default_rng(0).normal(0, 0.3, (4, 3)).astype(np.float32), name="w")

        def xent(x, y):
            logits = tf.matmul(x, w)
            if kind == "reshape":
                logits = tf.reshape(logits, [batch_size, 3])
            elif kind == "ones":
                logits += tf.ones([batch_size, 3])
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                                 logits=logits))
        if kind == "towers":
            half = batch_size // 2
            loss = tf.add_n([xent(x[i * half:(i + 1) * half], y[i * half:(i + 1) * half])
                             for i in range(2)]) / 2
        else:
            loss = xent(x, y)
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    rng = np.random.default_rng(1)
    feed = {x: rng.normal(size=(batch_size, 4)).astype(np.float32), y: rng.integers(0, 3, batch_size)}
    return graph, trainer, session(graph, init), feed


FIXED = (r"the graph likely fixes the batch size: it builds a shape from the full batch \(12 "
         r"rows\) where the micro-batch has 3 \(tf\.reshape\(x, \[batch_size, \.\.\.\]\), "
         r"tf\.ones\(\[batch_size, \.\.\.\]\), slices such as x\[i \* batch_size:\(i \+ 1\) "
         r"\* batch_size\]\); use tf\.shape\(x\)\[0\], the rows the feed has, instead of "
         r"batch_size\.")


@pytest.mark.parametrize("kind,said", [
    # The cause first; the session's own words after, without "check that micro-batch's feed".
    ("reshape", FIXED + r" The session refused the compute \(InvalidArgumentError: .*\[3,3\] vs\. "
                        r"\[12,1\]\)\.$"),
    ("ones", FIXED + r" The session refused the compute \(InvalidArgumentError: .*\[3,3\] vs\. "
                     r"\[12,3\]\)\.$"),
    # The second tower's slice is empty: its mean is NaN, its gradient 0.
    ("towers", r"finite gradients but the loss is nan\. Nothing was applied\. T" + FIXED[1:] + "$"),
])
def test_a_graph_that_fixes_the_batch_size_is_named_as_the_cause(kind, said):
    # The session's shape error blamed the feed, and a NaN loss with finite gradients
    # suggested SkipNonFinite(), which would skip every micro-batch.
    graph, trainer, sess, feed = fixed_batch_program(kind)
    before = values(graph, sess)
    with pytest.raises(hostavg.HostavgError,
                       match=r"^step, micro-batch 0 of 4 \(samples 0:3\): " + said) as raised:
        trainer.step(sess, hostavg.split(feed, 3))
    assert "check that micro-batch's feed" not in str(raised.value)
    with pytest.raises(hostavg.HostavgError,
                       match=r"^check, micro-batch 0 of 4 \(samples 0:3\): " + said):
        trainer.check(sess, feed, micro_batch_size=3)
    assert_close(values(graph, sess), before, atol=0)
    assert trainer.step(sess, [feed]).step == 1  # the whole batch in one micro-batch runs


def test_a_loss_that_overflowed_alone_is_no_fixed_batch_size_and_its_sample_is_named():
    # A run diverging made a micro-batch's loss Inf with its gradients finite; the error said
    # the graph likely fixes the batch size, pointing away from the sample.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.Variable(np.full((4, 1), 0.1, np.float32), name="w")
        penalty = tf.stop_gradient(tf.reduce_mean(tf.exp(tf.reduce_max(x, axis=1))))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w))) + penalty
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    feed = {x: np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)}
    feed[x][4, 2] = 100.0  # exp(100) overflows float32: the loss alone is Inf
    before = values(graph, sess)
    with pytest.raises(hostavg.HostavgError) as raised:
        trainer.step(sess, hostavg.split(feed, 3))
    said = str(raised.value)
    assert said.startswith("step, micro-batch 1 of 4 (samples 3:6): finite gradients but the "
                           "loss is inf"), said
    assert "fixes the batch size" not in said and "sample 4" in said, said
    assert_close(values(graph, sess), before, atol=0)


def test_a_placeholder_of_a_fixed_batch_size_is_named_as_the_cause():
    # word2vec's train_inputs = tf.placeholder(tf.int32, shape=[batch_size]) got the generic
    # shape error, without the fixed-batch advice.
    graph = tf.Graph()
    with graph.as_default():
        inputs = v1.placeholder(tf.int32, shape=[12], name="train_inputs")
        labels = v1.placeholder(tf.int32, shape=[12, 1], name="train_labels")
        embeddings = tf.Variable(np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32))
        weights = tf.Variable(np.zeros((20, 4), np.float32))
        loss = tf.reduce_mean(tf.nn.sampled_softmax_loss(
            weights, tf.zeros(20), tf.cast(labels, tf.int64), tf.nn.embedding_lookup(embeddings, inputs),
            num_sampled=5, num_classes=20))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    rng = np.random.default_rng(1)
    feed = {inputs: rng.integers(0, 20, 12), labels: rng.integers(0, 20, (12, 1))}
    before = values(graph, sess)
    said = (r"placeholder 'train_inputs:0' fixes the batch size: its shape is \(12,\), batches of "
            r"exactly 12 rows, and this feed has 3\. Make its first dimension None "
            r"\(tf\.compat\.v1\.placeholder\(\.\.\., shape=\[None, \.\.\.\]\)\), and use "
            r"tf\.shape\(x\)\[0\], the rows the feed has, where the graph needs batch_size$")
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 4: " + said):
        trainer.step(sess, hostavg.split(feed, 3))
    with pytest.raises(hostavg.HostavgError, match=r"^check, micro-batch 0 of 4: " + said):
        trainer.check(sess, feed, micro_batch_size=3)
    assert_close(values(graph, sess), before, atol=0)
    with pytest.raises(hostavg.HostavgError, match=r"feed 'train_labels:0' has shape \(12, 2\), "
                                                   r"but it takes shape \(12, 1\)"):
        trainer.step(sess, [{**feed, labels: np.zeros((12, 2), np.int32)}])  # not the batch size
    assert trainer.step(sess, [feed]).step == 1  # the whole batch in one micro-batch runs


# --- Graphs fed by a tf.data iterator --------------------------------------------------------


def dataset_program(X, Y, batch_size, seed=0):
    """A classifier whose batches come from a tf.data iterator: no placeholder, and every
    session run takes the next batch of ``batch_size`` (the data repeated: every batch full)."""
    graph = tf.Graph()
    with graph.as_default():
        dataset = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(batch_size)
        images, labels = v1.data.make_one_shot_iterator(dataset).get_next()
        w = tf.Variable(np.random.default_rng(seed).normal(0, 0.3, (X.shape[1], 3)).astype(np.float32),
                        name="w")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(images, w)))
    return graph, (images, labels), loss


def test_check_takes_blocks_and_says_what_it_needs_where_the_feed_holds_no_samples():
    # check had no blocks= (a discriminator's labels of tf.concat([real, fake])), and on a feed
    # of scalars or a graph fed by tf.data it said "split: the batch holds no samples".
    graph, t, d, g, init = gan_trainers()
    sess = session(graph, init)
    feed = gan_batch(np.random.default_rng(9), 12)
    fake = sess.run(t["samples"], {t["z"]: feed["z"]})
    before = values(graph, sess)
    report = d.check(sess, {"real:0": feed["real"], t["fake"]: fake, "labels": feed["labels"]}, micro_batch_size=4,
                     blocks={"labels": 2})
    assert report.micro_batches == 3 and not report.ok and "batch norm" in report.cause
    assert_close(values(graph, sess), before, atol=0)

    X, Y = linear_data()
    graph, x, y, loss = regression()
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01))
        init = v1.global_variables_initializer()
    with pytest.raises(hostavg.HostavgError,
                       match=r"^check: the feed dict holds no array of samples to cut into "
                             r"micro-batches "
                             r"\(only scalars: 'x:0', 'y:0'\)\. check runs one batch whole and in "
                             r"micro-batches: feed it that batch's arrays, such as "
                             r"\{x: X\[:256\], y: Y\[:256\]\}"):
        trainer.check(session(graph, init), {x: 1.0, y: 2.0}, micro_batch_size=1)

    rng = np.random.default_rng(10)
    X, Y = rng.normal(size=(64, 5)).astype(np.float32), rng.integers(0, 3, 64)
    graph, (images, labels), loss = dataset_program(X, Y, 16)
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    with pytest.raises(hostavg.HostavgError,
                       match=r"^check: the feed dict holds no array of samples .* \(an empty feed "
                             r"dict\).*"
                             r"a graph that reads its batch from a tf\.data iterator or a queue: "
                             r"feed the tensors it reads"):
        trainer.check(sess, {}, micro_batch_size=4)
    # Fed the iterator's outputs, the check runs on that batch and takes nothing from the iterator.
    assert trainer.check(sess, {images: X[:16], labels: Y[:16]}, micro_batch_size=4).ok
    np.testing.assert_array_equal(sess.run(images), X[:16])


def test_a_graph_fed_by_tf_data_steps_over_k_micro_batches_of_its_iterator_as_one_batch():
    # The porting guide's recipe: the dataset re-batched to the micro-batch size, and step given
    # k feeds that feed nothing, with their sizes: k session runs take the k batches in turn.
    rng = np.random.default_rng(13)
    X, Y = rng.normal(size=(96, 5)).astype(np.float32), rng.integers(0, 3, 96)
    k, m = 4, 8
    graph, _, loss = dataset_program(X, Y, m)
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.MomentumOptimizer(0.1, 0.9))
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    for _ in range(5):  # 160 samples: the data repeats, as the program's own does
        res = trainer.step(sess, [{}] * k, sizes=[m] * k)
    assert res.size == k * m and res.step == 5

    oracle, _, oloss = dataset_program(X, Y, k * m)
    with oracle.as_default():
        train = v1.train.MomentumOptimizer(0.1, 0.9).minimize(
            oloss, global_step=v1.train.get_or_create_global_step())
        init = v1.global_variables_initializer()
    osess = session(oracle, init)
    for _ in range(5):
        osess.run(train)
    assert_close(values(graph, sess), values(oracle, osess), atol=1e-6)


# --- Reference variables: TF1's variables before resource variables ---------------------------


def ref_batch_norm_mlp():
    """An MLP with batch norm written by hand, every variable a reference variable, as
    programs that call tf.compat.v1.disable_v2_behavior() make them."""
    graph = tf.Graph()
    with graph.as_default(), v1.variable_scope("", use_resource=False):
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = tf.nn.relu(batch_norm(dense(x, 8, "d1"), "bn"))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=dense(h, 3, "d2")))
    return graph, (x, y), loss


def test_reference_variables_are_restored_by_check_and_by_a_failed_step():
    # The snapshot read each variable with read_value(), which for a reference variable is the
    # variable's own buffer: the moving statistics kept what check and the failed step left.
    graph, (x, y), loss = ref_batch_norm_mlp()
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.MomentumOptimizer(0.1, 0.9))
        init = v1.global_variables_initializer()
    moving = [v for v in trainer.rollback_variables if "moving" in v.op.name]
    assert len(moving) == 2 and all(v.dtype._is_ref_dtype for v in moving)
    sess = session(graph, init)
    rng = np.random.default_rng(7)
    X, Y = rng.normal(2, 3, (16, 6)).astype(np.float32), rng.integers(0, 3, 16)
    trainer.step(sess, hostavg.split({x: X, y: Y}, 4))  # slots and statistics non-trivial
    before = values(graph, sess)
    report = trainer.check(sess, {x: X, y: Y}, micro_batch_size=4)
    assert not report.ok and "batch norm" in report.cause
    assert_close(values(graph, sess), before, atol=0)
    bad = X.copy()
    bad[9, 2] = np.nan
    with pytest.raises(hostavg.HostavgError, match=r"micro-batch 2 of 4 .*non-finite"):
        trainer.step(sess, hostavg.split({x: bad, y: Y}, 4))
    assert_close(values(graph, sess), before, atol=0)


@pytest.mark.slow
def test_a_program_that_disables_v2_behavior_is_restored_by_check_and_by_a_failed_step():
    run = subprocess.run([sys.executable, str(HERE / "v1_script.py")], capture_output=True,
                         text=True, env=ENV, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ref", "check", "unchanged", "failed", "unchanged"]


# --- word2vec with nce_loss: sampled, sparse --------------------------------------------------


def test_word2vec_nce_trains_with_sparse_gradients_and_the_check_names_the_sampling():
    vocab, dim = 60, 8
    graph = tf.Graph()
    with graph.as_default():
        inputs = v1.placeholder(tf.int32, [None], name="inputs")
        context = v1.placeholder(tf.int64, [None, 1], name="context")
        embeddings = tf.Variable(v1.random_uniform([vocab, dim], -1, 1, seed=1), name="embeddings")
        nce_w = tf.Variable(v1.truncated_normal([vocab, dim], stddev=0.3, seed=2), name="nce_w")
        nce_b = tf.Variable(tf.zeros([vocab]), name="nce_b")
        loss = tf.reduce_mean(tf.nn.nce_loss(
            weights=nce_w, biases=nce_b, labels=context,
            inputs=tf.nn.embedding_lookup(embeddings, inputs), num_sampled=5, num_classes=vocab))
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.5))
        init = v1.global_variables_initializer()
    assert all(trainer.spec[n].sparse for n in ("embeddings", "nce_w", "nce_b"))
    sess = session(graph, init)
    rng = np.random.default_rng(5)
    words = rng.integers(0, vocab, 64).astype(np.int32)
    feed = {inputs: words, context: ((words + 1) % vocab).astype(np.int64)[:, None]}
    report = trainer.check(sess, feed, micro_batch_size=16)
    assert not report.ok and ("random ops in training mode: a sampled loss "
                              "('nce_loss/LogUniformCandidateSampler:0')") in report.cause
    assert "check with the full loss" in report.cause
    first = trainer.step(sess, hostavg.split(feed, 16))
    assert isinstance(first.grads["embeddings"], hostavg.SparseGradient)
    losses = [trainer.step(sess, hostavg.split(feed, 16)).loss for _ in range(30)]
    assert np.mean(losses[-5:]) < first.loss


# --- tf.train.Saver beside the Trainer --------------------------------------------------------


def test_a_saver_built_after_the_trainer_saves_slots_and_step_and_restore_refuses_its_files(tmp_path):
    X, Y = linear_data()
    graph, x, y, loss = regression()
    with graph.as_default():
        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.1))
        saver = v1.train.Saver()  # after the Trainer: it sees the slots and the global step
        init = v1.global_variables_initializer()
    sess = session(graph, init)
    trainer.step(sess, hostavg.split({x: X, y: Y}, 6))
    with graph.as_default():  # TF 2's Saver builds its save ops in the default graph
        prefix = saver.save(sess, str(tmp_path / "model.ckpt"), global_step=trainer.global_step)
    want = values(graph, sess)
    trainer.step(sess, hostavg.split({x: X, y: Y}, 6))
    with graph.as_default():
        saver.restore(sess, prefix)
    assert_close(values(graph, sess), want, atol=0)
    for path in (prefix, prefix + ".index", tmp_path):
        with pytest.raises(hostavg.HostavgError, match=r"is a tf\.train\.Saver checkpoint.*"
                                                       r"saver\.restore\(sess, '.*model\.ckpt-1'\)"):
            trainer.restore(sess, path)
    assert_close(values(graph, sess), want, atol=0)


# --- The tf-keras recipe: tf.compat.v1.layers and a dynamic RNN -------------------------------


@pytest.mark.slow
def test_legacy_layers_and_a_dynamic_rnn_run_with_tf_keras_and_equal_the_full_batch_step():
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))  # this checkout's
    run = subprocess.run([sys.executable, str(HERE / "legacy_script.py")], capture_output=True,
                         text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "max diff" in run.stdout
    assert float(run.stdout.split("max diff")[1]) < 1e-5
