"""Runs under mpiexec (or alone) for the multi-worker tests.

usage: python mpi_script.py MODES OUT
  MODES: comma-separated, run one after the other in this process (one
        TensorFlow start-up for all):
        dense | sparse | stack | uneven | scalar | overlap | keras (train, write each
        rank's variables to OUT-MODE-rank<r>.npz; uneven: rank 0 takes five micro-batches
        and rank 1 one, and at step 3 rank 1 takes none; scalar: with a 0-d
        variable; overlap: the sparse model with overlap=True; keras: the dense model
        as a Keras model with hostavg.keras.Trainer; frozen: the dense model with its
        hidden layer frozen at steps 3 to 5 by hostavg.hooks.Freeze),
        nan (rank 1's micro-batch 2 is poisoned), raise (a hook on rank 1 raises),
        die (rank 1 exits mid-step),
        misconfigured (ranks whose models, feeds or learning rates differ: each error
        is caught and printed as "rank R caught: MESSAGE", then both ranks train on
        and write OUT-misconfigured-rank<r>.npz),
        sigterm (fit, printing "rank R pid P step N" per step, slowly: the test sends
        SIGTERM to rank 1), exit (rank 1 calls sys.exit(3) in a fit callback),
        sizes, batches (fit on data of 64 samples on rank 0 and 32 on rank 1, as arrays or
        as a callable giving batches: each rank prints "rank R caught: MESSAGE", then both
        fit on 32 samples together and print "rank R global step N").
The global batch of each step is six micro-batches of unequal sizes; with two
ranks, rank r takes micro-batches 3r to 3r + 2; alone, all six.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402
from models import AfterStep, batches, build, cuts, keras_model, v1  # noqa: E402

import hostavg  # noqa: E402

SIZES = (5, 12, 3, 20, 7, 9)
STEPS = 8

modes, out = sys.argv[1].split(","), sys.argv[2]
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


class Trouble:
    def __init__(self, mode):
        self.mode = mode

    def on_micro_batch(self, record):
        if rank == 1 and record.step == 2 and record.index == 1:
            if self.mode == "raise":
                raise RuntimeError("a hook broke on purpose")
            if self.mode == "die":
                os._exit(3)


def train_keras(mode):
    import keras
    import hostavg.keras
    model = keras_model()
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                    keras.optimizers.Adam(0.01), hooks=[Trouble(mode)],
                                    comm=comm if size > 1 else None)
    for step, data in enumerate(batches(7, STEPS, sum(SIZES))):
        micro = [(data["x"][s], data["y"][s]) for s in cuts(sum(SIZES), SIZES)]
        if size > 1:
            micro = micro[:3] if rank == 0 else micro[3:]
        assert trainer.step(micro).size == sum(SIZES)
    variables = list(model.variables) + list(trainer.optimizer.variables)
    np.savez(f"{out}-{mode}-rank{rank}.npz", global_step=trainer.optimizer.iterations.numpy(),
             **{f"v{i}": v.numpy() for i, v in enumerate(variables)})


def train(mode):
    if mode == "keras":
        return train_keras(mode)
    sparse = mode in ("sparse", "overlap")
    model = build(sparse=sparse, scalar=mode == "scalar")
    with model.graph.as_default():
        frozen = [hostavg.hooks.Freeze("hidden/*", steps={3, 4, 5})] if mode == "frozen" else []
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01),
                                  hooks=[Trouble(mode), *frozen],
                                  accumulate="stack" if mode == "stack" else "sum",
                                  comm=comm if size > 1 else None, overlap=mode == "overlap")
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    for step, data in enumerate(batches(7, STEPS, sum(SIZES), sparse=sparse)):
        feeds = [model.feed({k: v[s] for k, v in data.items()}) for s in cuts(sum(SIZES), SIZES)]
        if size > 1:
            share = 3 if mode != "uneven" else 6 if step == 3 else 5  # rank 0's micro-batches
            feeds = feeds[:share] if rank == 0 else feeds[share:]
        if mode == "nan" and rank == 1 and step == 3:
            x = model.inputs["x"]
            feeds[2] = {**feeds[2], x: np.full_like(feeds[2][x], np.nan)}
        before = model.values(sess)
        result = trainer.step(sess, feeds)
        assert result.size == sum(SIZES), result.size
        if frozen and result.step in frozen[0].steps:  # the layer and Adam's moments of it
            now = model.values(sess)
            assert all(np.array_equal(now[k], before[k]) for k in now if k.startswith("hidden/"))
    np.savez(f"{out}-{mode}-rank{rank}.npz", **model.values(sess))


def linear(extra=False, width=3, lr=None):
    """loss = mean(x @ w); the learning rate a placeholder if ``lr``."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.Variable(np.ones((4, width), np.float32), name="w")
        if extra:
            tf.Variable(np.zeros(2, np.float32), name="extra")
        rate = v1.placeholder(tf.float32, (), name="lr") if lr else 0.1
        trainer = hostavg.Trainer(tf.reduce_mean(tf.matmul(x, w)),
                                  v1.train.GradientDescentOptimizer(rate), comm=comm)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    return trainer, sess, x, rate


def caught(action):
    try:
        action()
    except hostavg.HostavgError as e:
        print(f"rank {rank} caught: {e}", flush=True)
    else:
        raise AssertionError("no error")


def misconfigured():
    feed = lambda x: [{x: np.ones((2, 4), np.float32)}]  # noqa: E731
    trainer, sess, x, _ = linear(extra=rank == 1)
    caught(lambda: trainer.step(sess, feed(x)))
    trainer, sess, x, _ = linear(width=3 + rank)
    caught(lambda: trainer.step(sess, feed(x)))
    trainer, sess, x, lr = linear(lr=True)
    good = [{**feed(x)[0], lr: 0.1}]
    caught(lambda: trainer.step(sess, good[0] if rank == 1 else good))  # a dict: not a list
    caught(lambda: trainer.step(sess, [{**feed(x)[0], lr: 0.1 * (1 + rank)}]))
    for _ in range(3):  # the ranks are still in step
        trainer.step(sess, good)
    variables = trainer.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    np.savez(f"{out}-misconfigured-rank{rank}.npz",
             **dict(zip([v.op.name for v in variables], sess.run(variables))))


class Report(AfterStep):
    def __init__(self, exit_at=None):
        self.exit_at = exit_at

    def after(self, step):
        print(f"rank {rank} pid {os.getpid()} step {step}", flush=True)
        if step == self.exit_at and rank == 1:
            sys.exit(3)
        time.sleep(0.2)


def fit(exit_at=None):
    trainer, sess, x, _ = linear()
    data = np.random.default_rng(0).normal(size=(400, 4)).astype(np.float32)
    trainer.fit(sess, {x: data}, batch_size=40, micro_batch_size=10, epochs=5, seed=0,
                progress=False, callbacks=[Report(exit_at)], checkpoint_dir=f"{out}-ckpt")


def uneven(kind):
    trainer, sess, x, _ = linear()
    n = 64 if rank == 0 else 32
    data = np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32)
    given = {x: data} if kind == "sizes" else lambda: ({x: data[i:i + 16]} for i in range(0, n, 16))
    caught(lambda: trainer.fit(sess, given, batch_size=16, micro_batch_size=8, epochs=2, seed=0,
                               progress=False))
    trainer.fit(sess, {x: data[:32]}, batch_size=16, micro_batch_size=8, seed=0, progress=False)
    print(f"rank {rank} global step {sess.run(trainer.global_step)}", flush=True)


for mode in modes:
    {"misconfigured": misconfigured, "sigterm": fit, "exit": lambda: fit(exit_at=2),
     "sizes": lambda: uneven("sizes"), "batches": lambda: uneven("batches")}.get(
        mode, lambda: train(mode))()
