"""Small classifiers in raw ``tf.compat.v1`` ops, for the command line, the benchmark and notebooks.

Each builder makes a new graph with placeholders ``x`` (float32 features, or
int32 ids for :func:`embedding`) and ``y`` (int32 labels), and returns a
:class:`Model`. Weights start from a NumPy generator seeded with ``seed``
(Glorot-uniform), so the same seed gives the same model in any process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

__all__ = ["Model", "convnet", "embedding", "mlp"]


class Model(NamedTuple):
    """A classifier graph.

    Attributes:
      graph: its own ``tf.Graph``.
      x, y: the input and label placeholders.
      loss: mean softmax cross-entropy over the batch.
      accuracy: mean of correct predictions over the batch.
      logits: (batch, classes).
    """

    graph: tf.Graph
    x: tf.Tensor
    y: tf.Tensor
    loss: tf.Tensor
    accuracy: tf.Tensor
    logits: tf.Tensor

    @property
    def parameters(self) -> int:
        with self.graph.as_default():
            return int(sum(np.prod(v.shape.as_list()) for v in v1.trainable_variables()))


def _glorot(rng, shape, fan_in, fan_out):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return tf.Variable(rng.uniform(-limit, limit, shape).astype(np.float32), name="kernel")


def _bias(units):
    return tf.Variable(np.zeros(units, np.float32), name="bias")


def _dense(rng, h, units, name):
    fan_in = h.shape[-1]
    with tf.name_scope(name):
        w = _glorot(rng, (fan_in, units), fan_in, units)
        b = _bias(units)
    return tf.matmul(h, w) + b


def _head(graph, x, y, h, classes, rng) -> Model:
    logits = _dense(rng, h, classes, "logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y)
    return Model(graph, x, y, loss, tf.reduce_mean(tf.cast(correct, tf.float32)), logits)


def mlp(features: int, hidden: Sequence[int], classes: int, *, seed: int = 0) -> Model:
    """features -> ReLU layers of ``hidden`` units -> classes."""
    graph, rng = tf.Graph(), np.random.default_rng(seed)
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, features], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        h = x
        for i, units in enumerate(hidden):
            h = tf.nn.relu(_dense(rng, h, units, f"hidden{i}"))
        return _head(graph, x, y, h, classes, rng)


def convnet(side: int, channels: Sequence[int], classes: int, *, seed: int = 0) -> Model:
    """A (side x side) grey image -> 3x3 conv + ReLU + 2x2 max-pool per entry of ``channels`` -> classes."""
    graph, rng = tf.Graph(), np.random.default_rng(seed)
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, side * side], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        h, c_in = tf.reshape(x, [-1, side, side, 1]), 1
        for i, c_out in enumerate(channels):
            with tf.name_scope(f"conv{i}"):
                k = _glorot(rng, (3, 3, c_in, c_out), 9 * c_in, 9 * c_out)
                b = _bias(c_out)
            h = tf.nn.relu(tf.nn.conv2d(h, k, 1, "SAME") + b)
            h, c_in = tf.nn.max_pool2d(h, 2, 2, "SAME"), c_out
        h = tf.reshape(h, [-1, int(np.prod(h.shape.as_list()[1:]))])
        return _head(graph, x, y, h, classes, rng)


def embedding(vocab: int, dim: int, length: int, classes: int, *, seed: int = 0) -> Model:
    """``length`` int32 ids per sample -> mean of their rows of a (vocab, dim) table -> classes.

    The table's gradient is sparse (``IndexedSlices``): only the rows looked up.
    """
    graph, rng = tf.Graph(), np.random.default_rng(seed)
    with graph.as_default():
        x = v1.placeholder(tf.int32, [None, length], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        table = tf.Variable(rng.normal(0, 0.1, (vocab, dim)).astype(np.float32), name="embedding")
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
        return _head(graph, x, y, h, classes, rng)
