"""Runs under mpiexec (or alone) for the multi-worker tests.

usage: python mpi_script.py MODES OUT
  MODES: comma-separated, run one after the other in this process (one
        TensorFlow start-up for all):
        dense | sparse | stack | uneven | scalar | keras (train, write each rank's
        variables to OUT-MODE-rank<r>.npz; uneven: rank 0 takes five micro-batches
        and rank 1 one, and at step 3 rank 1 takes none; scalar: with a 0-d
        variable; keras: the dense model as a Keras model with hostavg.keras.Trainer),
        nan (rank 1's micro-batch 2 is poisoned), raise (a hook on rank 1 raises),
        die (rank 1 exits mid-step).
The global batch of each step is six micro-batches of unequal sizes; with two
ranks, rank r takes micro-batches 3r to 3r + 2; alone, all six.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from models import batches, build, cuts, keras_model, v1  # noqa: E402

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
    model = build(sparse=mode == "sparse", scalar=mode == "scalar")
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), hooks=[Trouble(mode)],
                                  accumulate="stack" if mode == "stack" else "sum",
                                  comm=comm if size > 1 else None)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    for step, data in enumerate(batches(7, STEPS, sum(SIZES), sparse=mode == "sparse")):
        feeds = [model.feed({k: v[s] for k, v in data.items()}) for s in cuts(sum(SIZES), SIZES)]
        if size > 1:
            share = 3 if mode != "uneven" else 6 if step == 3 else 5  # rank 0's micro-batches
            feeds = feeds[:share] if rank == 0 else feeds[share:]
        if mode == "nan" and rank == 1 and step == 3:
            x = model.inputs["x"]
            feeds[2] = {**feeds[2], x: np.full_like(feeds[2][x], np.nan)}
        result = trainer.step(sess, feeds)
        assert result.size == sum(SIZES), result.size
    np.savez(f"{out}-{mode}-rank{rank}.npz", **model.values(sess))


for mode in modes:
    train(mode)
