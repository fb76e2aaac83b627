"""A fit run with checkpoints, for the interrupt-and-resume tests.

usage: python fit_script.py CHECKPOINT_DIR OUT.npz [SECONDS_PER_STEP [EPOCHS [SECONDS_PER_APPLY]]]
       python fit_script.py --rounds FOLDER EPOCHS SECONDS_PER_APPLY

Prints "started" when fit begins and "step N" after each step; writes every
variable's final value to OUT.npz. A slow step (the optional sleep, in a
callback) gives the test time to kill the process mid-run; a slow apply (a
sleep as the apply's session call returns, as on a slow device) makes a signal
sent at a random moment land there often.

With --rounds, one process trains many times, for a test that sends it SIGTERM
at chosen moments: first a straight run (FOLDER/straight.npz, then "straight"),
then, for each number N read from standard input, run N in FOLDER/runN: fit,
and, each time fit exits on SIGTERM (SystemExit), fit again on the same
checkpoint directory with a new graph and session, as a restarted process
would; it writes FOLDER/runN.npz and prints "done N" and fit's exit codes
(JSON). At the end of standard input it prints "outside" and the number of
SIGTERMs that landed outside fit, where this script's own handler takes them
(the default action would end the process).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from models import AfterApply, AfterStep  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models  # noqa: E402

v1 = tf.compat.v1


class Slow(AfterStep):
    def __init__(self, seconds):
        self.seconds = seconds

    def after(self, step):
        print(f"step {step}", flush=True)
        time.sleep(self.seconds)


def train(checkpoint_dir, seconds=0.0, epochs=6, apply_seconds=0.0) -> dict:
    """Fits (or resumes) the run in ``checkpoint_dir``; every variable's final value by name."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 10)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = models.mlp(10, [16], 2, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    with AfterApply(lambda n: time.sleep(apply_seconds), graph=model.graph) as sess:
        sess.run(init)
        print("started", flush=True)
        trainer.fit(sess, {model.x: x, model.y: y}, batch_size=64, micro_batch_size=16,
                    epochs=epochs, seed=7, progress=False, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=1, callbacks=[Slow(seconds)])
        variables = v1.global_variables()
        return dict(zip([v.op.name for v in variables], sess.run(variables)))


def main(checkpoint_dir, out, seconds=0.0, epochs=6, apply_seconds=0.0):
    np.savez(out, **train(checkpoint_dir, seconds, epochs, apply_seconds))


def rounds(folder, epochs, apply_seconds):
    folder = Path(folder)
    outside = []
    signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))
    np.savez(folder / "straight.npz", **train(folder / "straight", 0, epochs, apply_seconds))
    print("straight", flush=True)
    for line in sys.stdin:
        n = int(line)
        exits = []
        while True:
            try:
                values = train(folder / f"run{n}", 0, epochs, apply_seconds)
                break
            except SystemExit as exit_:
                exits.append(exit_.code)
        np.savez(folder / f"run{n}.npz", **values)
        print(f"done {n} {json.dumps(exits)}", flush=True)
    print(f"outside {len(outside)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--rounds":
        rounds(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        main(sys.argv[1], sys.argv[2], *[f(a) for f, a in zip((float, int, float), sys.argv[3:])])
