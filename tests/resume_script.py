"""A fit run with a Record hook and checkpoints, that may kill itself, for the resume tests.

usage: python resume_script.py FOLDER OUT.npz [KILL_AT_STEP]
Trains 2 epochs with fit(checkpoint_dir=FOLDER/ckpt), recording every step to FOLDER/rec,
checkpointing only at the end; prints "step N" after each step; with KILL_AT_STEP > 0 sends
itself SIGKILL after that step (no checkpoint, no clean-up: as a machine that dies). Writes
every variable's final value to OUT.npz.
"""

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from models import AfterStep  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models  # noqa: E402

v1 = tf.compat.v1


class Kill(AfterStep):
    def __init__(self, at):
        self.at = at

    def after(self, step):
        print(f"step {step}", flush=True)
        if step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(folder, out, kill_at=0):
    folder = Path(folder)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 10)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = models.mlp(10, [16], 2, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01),
                                  hooks=[hostavg.hooks.Record(folder / "rec")])
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        trainer.fit(sess, {model.x: x, model.y: y}, batch_size=64, micro_batch_size=16,
                    epochs=2, seed=7, progress=False, checkpoint_dir=folder / "ckpt",
                    callbacks=[Kill(kill_at)])
        variables = v1.global_variables()
        np.savez(out, **dict(zip([v.op.name for v in variables], sess.run(variables))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
