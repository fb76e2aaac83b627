"""A classic TF1 RNN program (tf.compat.v1.nn.rnn_cell, dynamic_rnn, tf.compat.v1.layers).

Run with TF_USE_LEGACY_KERAS=1 and tf-keras installed (``pip install -e '.[legacy]'``):
those modules are gone with Keras 3 otherwise. Trains the same model twice, with
hostavg over 3 micro-batches and with its own full-batch train op, and prints the
largest difference between the two.
"""

import os

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "set TF_USE_LEGACY_KERAS=1 before TensorFlow"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hostavg  # noqa: E402

v1 = tf.compat.v1
STEPS, TIME, FEATURES, UNITS, CLASSES = 4, 7, 3, 5, 2


def build(seed):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(seed)
        x = v1.placeholder(tf.float32, [None, TIME, FEATURES], name="x")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        y = v1.placeholder(tf.int32, [None], name="y")
        cell = v1.nn.rnn_cell.BasicRNNCell(UNITS)
        _, state = v1.nn.dynamic_rnn(cell, x, sequence_length=lengths, dtype=tf.float32)
        logits = v1.layers.dense(state, CLASSES, name="out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return graph, (x, lengths, y), loss


def values(graph, sess):
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


rng = np.random.default_rng(0)
data = [(rng.normal(size=(12, TIME, FEATURES)).astype(np.float32),
         rng.integers(2, TIME + 1, 12).astype(np.int32), rng.integers(0, CLASSES, 12).astype(np.int32))
        for _ in range(STEPS)]

graph, inputs, loss = build(1)
with graph.as_default():
    trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.05))
    init = v1.global_variables_initializer()
sess = v1.Session(graph=graph)
sess.run(init)
start = values(graph, sess)
for arrays in data:
    trainer.step(sess, hostavg.split(dict(zip(inputs, arrays)), 5))

oracle, oinputs, oloss = build(1)
with oracle.as_default():
    train = v1.train.AdamOptimizer(0.05).minimize(oloss, global_step=v1.train.get_or_create_global_step())
    init = v1.global_variables_initializer()
osess = v1.Session(graph=oracle)
osess.run(init)
variables = oracle.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
hostavg.tf1.variables.load_variables(osess, variables, [start[v.op.name] for v in variables])
for arrays in data:
    osess.run(train, dict(zip(oinputs, arrays)))

got, want = values(graph, sess), values(oracle, osess)
assert got.keys() == want.keys(), (sorted(got), sorted(want))
print("max diff", max(float(np.max(np.abs(got[k] - want[k]))) for k in want))
