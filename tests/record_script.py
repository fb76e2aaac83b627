"""Trains with a Record hook until killed, printing each finished step (for the crash test).

usage: python record_script.py RECORD_DIR
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models  # noqa: E402

v1 = tf.compat.v1

model = models.mlp(784, [256], 10, seed=0)  # ~200k parameters: each step's file takes a while
with model.graph.as_default():
    trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(1e-3),
                              hooks=[hostavg.hooks.Record(sys.argv[1])])
    init = v1.global_variables_initializer()
rng = np.random.default_rng(0)
feed = {model.x: rng.normal(size=(64, 784)).astype(np.float32),
        model.y: rng.integers(0, 10, 64).astype(np.int32)}
with v1.Session(graph=model.graph) as sess:
    sess.run(init)
    for _ in range(10_000):
        print(trainer.step(sess, hostavg.split(feed, 8)).step, flush=True)
