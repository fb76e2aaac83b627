"""A TF1 program as most were written: tf.compat.v1.disable_v2_behavior(), so every variable is a
reference variable (``tf.compat.v1.Variable``, ``get_variable``; TensorFlow 2's ``tf.Variable``
stays a resource variable). Batch norm's moving statistics must come back after check() and after a
step that fails on a NaN. Prints what it saw, one word each; fails with an assertion otherwise.

Runs in its own process: disable_v2_behavior() is global to the process.
"""

import numpy as np
import tensorflow as tf

import hostavg

v1 = tf.compat.v1
v1.disable_v2_behavior()

x = v1.placeholder(tf.float32, [None, 6], name="x")
y = v1.placeholder(tf.int64, [None], name="y")
w = v1.Variable(np.random.default_rng(0).normal(0, 0.3, (6, 3)).astype(np.float32), name="w")
h = tf.matmul(x, w)
moving_mean = v1.Variable(tf.zeros([3]), trainable=False, name="moving_mean")
moving_var = v1.Variable(tf.ones([3]), trainable=False, name="moving_variance")
mean, var = tf.nn.moments(h, [0])
v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign(moving_mean, 0.9 * moving_mean + 0.1 * mean))
v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign(moving_var, 0.9 * moving_var + 0.1 * var))
logits = tf.nn.batch_normalization(h, mean, var, None, None, 1e-3)
loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(0.01))
assert all(v.dtype != v.dtype.base_dtype for v in trainer.rollback_variables)
print("ref")

sess = v1.Session()
sess.run(v1.global_variables_initializer())
rng = np.random.default_rng(1)
X, Y = rng.normal(2, 3, (16, 6)).astype(np.float32), rng.integers(0, 3, 16)
trainer.step(sess, hostavg.split({x: X, y: Y}, 4))
variables = v1.global_variables()


def unchanged(before):
    for v, a, b in zip(variables, sess.run(variables), before):
        np.testing.assert_array_equal(a, b, err_msg=v.op.name)
    print("unchanged")


before = sess.run(variables)
assert not trainer.check(sess, {x: X, y: Y}, micro_batch_size=4).ok
print("check")
unchanged(before)
bad = X.copy()
bad[9, 2] = np.nan
try:
    trainer.step(sess, hostavg.split({x: bad, y: Y}, 4))
except hostavg.HostavgError as e:
    assert "micro-batch 2 of 4" in str(e), e
    print("failed")
unchanged(before)
