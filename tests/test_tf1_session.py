"""The TF1 face's session calls (hostavg.tf1.session): session_threads "caller" and "pool" run
the same ops, and calls in the caller thread into blocking kernels and queues do not hang."""

import re
import subprocess
import sys
import threading

import pytest
from models import ENV, assert_bitwise, batches, build, full_batch, micro_feeds, probed, v1
from test_trainer import BATCH, UNEQUAL, assert_same_weights, train

import hostavg
from hostavg.tf1.session import SESSION_THREADS


# --- session_threads: "caller" and "pool" run the same ops ---------------------------------------


@pytest.mark.parametrize("model_kw,average", [
    ({}, "host"),
    ({"sparse": True}, "host"),
    ({"update_op": True}, "graph"),  # a moving mean written with assign ops, in UPDATE_OPS
    ({"sparse": True, "update_op": True}, "graph"),
], ids=["dense", "embedding", "update_ops-graph", "embedding-update_ops-graph"])
def test_caller_and_pool_give_bit_identical_weights_equal_to_the_full_batch_step(model_kw, average):
    data = batches(5, 4, BATCH, sparse=model_kw.get("sparse", False))
    weights = {}
    for threads in SESSION_THREADS:  # "auto" runs calls both ways while it times them
        model, sess = train("adam", data, UNEQUAL, model_kw=model_kw, average=average,
                            session_threads=threads)[:2]
        weights[threads] = model.values(sess)
    assert_bitwise(weights["caller"], weights["pool"])
    assert_bitwise(weights["auto"], weights["pool"])
    # The oracle runs the UPDATE_OPS once per micro-batch too, then minimize on the whole batch.
    assert_same_weights(weights["pool"], full_batch("adam", data, update_sizes=UNEQUAL,
                                                    **model_kw), atol=2e-6)


def denormal_graph():
    """A graph whose values pass through float32 denormals (1e-10 * 1e-30 = 1e-40), which
    TensorFlow's pool threads flush to zero, and whose loss magnifies them back: a variable
    w's gradient is 0 where they are flushed, about 4e-10 where they are kept."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None], name="x")
        w = v1.get_variable("w", initializer=tf.constant(1.0))
        tiny = x * tf.constant(1e-30) * w  # denormal products, and their gradient
        loss = tf.reduce_sum(tiny) * tf.constant(1e30)
    return graph, x, w, tiny, loss


def test_caller_threads_flush_denormals_as_the_pool_and_sess_run_do():
    """In the calling thread the ops flush denormal floats to zero as the pool's threads do
    (hostavg.tf1.denormals), so "caller" equals sess.run bit for bit; the calling thread's
    own state is put back after each call. Without it, TensorFlow's inline ops keep them."""
    import numpy as np
    from hostavg.compat.tensorflow import session_call
    from hostavg.tf1.denormals import like_the_pool
    from hostavg.tf1.faster import Faster
    from hostavg.tf1.session import Callables
    if like_the_pool() is None:
        pytest.skip("no MXCSR to set on this platform: the documented difference stays")
    kept = np.float32(1e-40) * np.float32(1.0)  # this thread's own state, before any call
    graph, x, w, tiny, loss = denormal_graph()
    sess = v1.Session(graph=graph)
    sess.run(w.initializer)
    feed = np.full(4, 1e-10, np.float32)
    want = sess.run([tiny, loss], {x: feed})
    assert not want[0].any() and want[1] == 0  # flushed: the pool's answer
    raw = session_call(sess, [tiny, loss], [], (x,), v1.RunOptions(inter_op_thread_pool=-1))(feed)
    assert raw[0].all() and raw[1] > 0  # kept: TensorFlow's own caller-thread run differs
    for threads in SESSION_THREADS:
        call = Callables(threads).get(sess, [tiny, loss], (x,))
        for _ in range(2 * (Faster.WARM + Faster.TIMED) + 1):  # "auto": both ways, then one
            assert_bitwise(dict(enumerate(call(feed))), dict(enumerate(want)))
    with pytest.raises(ZeroDivisionError):  # a call that raises puts the state back too
        like_the_pool()(lambda: 1 / 0)
    assert np.float32(1e-40) * np.float32(1.0) == kept  # this thread's own state again


def test_a_caller_trainer_steps_through_denormal_gradients_as_the_pool_one():
    """A trainer whose gradients pass through denormals steps the same in both modes, equal
    to the program's own train op run by sess.run (the fused step of one micro-batch, and a
    step of two): flushed, w does not move."""
    import numpy as np
    from hostavg.tf1.denormals import like_the_pool
    if like_the_pool() is None:
        pytest.skip("no MXCSR to set on this platform: the documented difference stays")
    feed = np.full(4, 1e-10, np.float32)
    weights = {}
    for threads in (*SESSION_THREADS, "own"):
        graph, x, w, _, loss = denormal_graph()
        with graph.as_default():
            opt = v1.train.GradientDescentOptimizer(1e9)  # a kept gradient moves w by 0.4
            if threads == "own":
                train_op = opt.minimize(loss)
            else:
                trainer = hostavg.Trainer(loss, opt, session_threads=threads)
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=graph)
        sess.run(init)
        for k in (1, 2) * 4:  # ("auto" runs the calls both ways while it times them)
            if threads == "own":
                sess.run(train_op, {x: feed})
            else:
                trainer.step(sess, [{x: feed[i::k]} for i in range(k)])
        weights[threads] = sess.run(w)
    assert weights["caller"] == weights["pool"] == weights["own"] == 1.0, weights


class PoolSpy(v1.Session):
    """A real session that notes the inter-op pool every compiled call was made for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools = []

    def _make_callable_from_options(self, options):
        self.pools.append(options.run_options.inter_op_thread_pool)
        return super()._make_callable_from_options(options)


@pytest.mark.parametrize("threads,pools", [("caller", {-1}), ("pool", {0}), ("auto", {0, -1})])
def test_session_threads_decides_which_thread_runs_the_ops(threads, pools):
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
    assert len(sess.pools) >= 3 and set(sess.pools) == pools
    assert len(ran_in) == len(feeds)
    me = threading.get_ident()
    # ("auto" alternates the two while it times them: the pool's first)
    assert [t == me for t in ran_in] == [-1 in pools and (0 not in pools or i % 2 == 1)
                                         for i in range(len(feeds))]


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
                              session_threads=THREADS)
    sess = v1.Session(graph=graph)
    sess.run(v1.global_variables_initializer())
for _ in range(3):
    res = trainer.step(sess, [{x: np.ones((2, 3), np.float32)}] * 2)
print("stepped", res.step)
"""


@pytest.mark.slow  # a fresh TensorFlow process each
@pytest.mark.parametrize("threads", ["caller", "auto"])
def test_a_call_that_reaches_a_blocking_kernel_runs_in_the_pool_even_when_caller_is_asked(
        threads):
    """In the calling thread a StagingArea's get, run before its put in the same call, would
    block the only thread that could run the put: forever, deaf to Ctrl-C. ("auto" would try
    the calling thread on its second call.)"""
    out = subprocess.run([sys.executable, "-c", STAGING.replace("THREADS", repr(threads))],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "stepped 3", out.stderr[-2000:]


@pytest.mark.parametrize("value", ["x", None, "Caller"])
def test_an_unknown_session_threads_is_refused_naming_the_choices(value):
    model = build()
    with model.graph.as_default(), pytest.raises(hostavg.HostavgError, match="^" + re.escape(
            f"session_threads must be one of ('auto', 'pool', 'caller'), got {value!r}") + "$"):
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


# --- Calls in the caller thread into a queue that a runner thread feeds -----------------------


QUEUE = """
import threading, numpy as np, tensorflow as tf, hostavg
v1 = tf.compat.v1
graph = tf.Graph()
with graph.as_default():
    x_in = v1.placeholder(tf.float32, [None, 3])
    queue = tf.queue.FIFOQueue(4, [tf.float32], shapes=[[3]])
    enqueue = queue.enqueue_many([x_in])
    x = queue.dequeue_many(5)  # a micro-batch's samples come from the queue, not the feed
    w = tf.Variable(tf.ones([3]))
    loss = tf.reduce_mean(tf.linalg.matvec(x, w) ** 2)
    trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.01),
                              session_threads="caller", overlap=OVERLAP)
    init = v1.global_variables_initializer()
sess = v1.Session(graph=graph)
sess.run(init)
stop = threading.Event()

def feed_queue():  # as a QueueRunner does: a thread of its own enqueueing with sess.run
    while not stop.is_set():
        try:
            sess.run(enqueue, {x_in: np.ones((2, 3), np.float32)},
                     options=v1.RunOptions(timeout_in_ms=200))
        except tf.errors.DeadlineExceededError:
            pass

runner = threading.Thread(target=feed_queue, daemon=True)
runner.start()
for _ in range(3):
    res = trainer.step(sess, [{}, {}, {}], sizes=[5, 5, 5])
stop.set()
runner.join()
print("stepped", res.step, float(res.loss))
"""


@pytest.mark.slow  # a fresh TensorFlow process each
@pytest.mark.parametrize("overlap", [False, True])
def test_a_queue_fed_by_a_runner_thread_does_not_hang_calls_in_the_caller_thread(overlap):
    out = subprocess.run([sys.executable, "-c", QUEUE.replace("OVERLAP", str(overlap))],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["stepped", "3"]
