"""Small classifiers in raw ``tf.compat.v1`` ops and as Keras 3 models, for the command line,
the benchmark and notebooks.

Each TF1 builder makes a new graph with placeholders ``x`` (float32 features,
or int32 ids for :func:`embedding`) and ``y`` (int32 labels), and returns a
:class:`Model`; each ``keras_`` builder returns the same classifier as a
``keras.Sequential`` (logits out; :func:`keras_loss` is its loss). Weights
start from a NumPy generator seeded with ``seed`` (Glorot-uniform), so the
same seed gives the same model in any process, in either form. TensorFlow is
imported by the TF1 builders only, so the Keras ones run on any Keras backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the TF1 builders import it when called
    import tensorflow as tf

__all__ = ["Model", "convnet", "convnet_weights", "embedding", "embedding_weights", "keras_convnet",
           "keras_embedding", "keras_loss", "keras_mlp", "mlp", "mlp_weights"]


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
            return int(sum(np.prod(v.shape.as_list())
                           for v in _tf().compat.v1.trainable_variables()))


def _tf():
    """TensorFlow, imported when a TF1 model is built."""
    import tensorflow
    return tensorflow


def _glorot(rng, fan_in: int, fan_out: int, shape=None) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape or (fan_in, fan_out)).astype(np.float32)


def _pooled(side: int, layers: int) -> int:
    """The side of a ``side`` x ``side`` image after ``layers`` 2x2 max-pools with SAME padding."""
    for _ in range(layers):
        side = -(-side // 2)
    return side


def mlp_weights(features: int, hidden: Sequence[int], classes: int, seed: int = 0) -> list:
    """The initial [kernel, bias, ...] of :func:`mlp` (and :func:`keras_mlp`), layer by layer."""
    rng, out, width = np.random.default_rng(seed), [], features
    for units in (*hidden, classes):
        out += [_glorot(rng, width, units), np.zeros(units, np.float32)]
        width = units
    return out


def convnet_weights(side: int, channels: Sequence[int], classes: int, seed: int = 0) -> list:
    """The initial [kernel, bias, ...] of :func:`convnet` (and :func:`keras_convnet`)."""
    rng, out, c_in = np.random.default_rng(seed), [], 1
    for c_out in channels:
        out += [_glorot(rng, 9 * c_in, 9 * c_out, (3, 3, c_in, c_out)), np.zeros(c_out, np.float32)]
        c_in = c_out
    flat = _pooled(side, len(channels)) ** 2 * c_in
    return out + [_glorot(rng, flat, classes), np.zeros(classes, np.float32)]


def embedding_weights(vocab: int, dim: int, length: int, classes: int, seed: int = 0) -> list:
    """The initial [table, kernel, bias] of :func:`embedding` (and :func:`keras_embedding`)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0, 0.1, (vocab, dim)).astype(np.float32)
    return [table, _glorot(rng, dim, classes), np.zeros(classes, np.float32)]


def _dense(h, kernel, bias, name):
    tf = _tf()
    with tf.name_scope(name):
        w = tf.Variable(kernel, name="kernel")
        b = tf.Variable(bias, name="bias")
    return tf.matmul(h, w) + b


def _head(graph, x, y, h, kernel, bias) -> Model:
    tf = _tf()
    logits = _dense(h, kernel, bias, "logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y)
    return Model(graph, x, y, loss, tf.reduce_mean(tf.cast(correct, tf.float32)), logits)


def mlp(features: int, hidden: Sequence[int], classes: int, *, seed: int = 0) -> Model:
    """features -> ReLU layers of ``hidden`` units -> classes."""
    weights = mlp_weights(features, hidden, classes, seed)
    tf = _tf()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, features], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        h = x
        for i in range(len(hidden)):
            h = tf.nn.relu(_dense(h, *weights[2 * i:2 * i + 2], f"hidden{i}"))
        return _head(graph, x, y, h, *weights[-2:])


def convnet(side: int, channels: Sequence[int], classes: int, *, seed: int = 0) -> Model:
    """A (side x side) grey image -> 3x3 conv + ReLU + 2x2 max-pool per entry of ``channels`` -> classes."""
    weights = convnet_weights(side, channels, classes, seed)
    tf = _tf()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, side * side], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        h = tf.reshape(x, [-1, side, side, 1])
        for i in range(len(channels)):
            with tf.name_scope(f"conv{i}"):
                k = tf.Variable(weights[2 * i], name="kernel")
                b = tf.Variable(weights[2 * i + 1], name="bias")
            h = tf.nn.relu(tf.nn.conv2d(h, k, 1, "SAME") + b)
            h = tf.nn.max_pool2d(h, 2, 2, "SAME")
        h = tf.reshape(h, [-1, int(np.prod(h.shape.as_list()[1:]))])
        return _head(graph, x, y, h, *weights[-2:])


def embedding(vocab: int, dim: int, length: int, classes: int, *, seed: int = 0) -> Model:
    """``length`` int32 ids per sample -> mean of their rows of a (vocab, dim) table -> classes.

    The table's gradient is sparse (``IndexedSlices``): only the rows looked up.
    """
    table, *head = embedding_weights(vocab, dim, length, classes, seed)
    tf = _tf()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.int32, [None, length], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        table = tf.Variable(table, name="embedding")
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
        return _head(graph, x, y, h, *head)


# --- The same classifiers as Keras 3 models -------------------------------------------------
#
# Same layers, same initial weights (the same draws), so a Keras model and its TF1 twin
# compute the same function. Their loss is keras_loss(); keras.optimizers.Adam with
# epsilon=1e-8 makes the same update as tf.compat.v1.train.AdamOptimizer.


def keras_loss():
    """Softmax cross-entropy of logits against int labels, the micro-batch mean (as the TF1 models' loss)."""
    import keras
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _keras(layers, weights):
    import keras
    model = keras.Sequential(layers)
    model.set_weights(weights)
    return model


def keras_mlp(features: int, hidden: Sequence[int], classes: int, *, seed: int = 0):
    """:func:`mlp` as a ``keras.Sequential`` (logits out)."""
    import keras
    return _keras([keras.Input((features,))]
                  + [keras.layers.Dense(units, activation="relu") for units in hidden]
                  + [keras.layers.Dense(classes)], mlp_weights(features, hidden, classes, seed))


def keras_convnet(side: int, channels: Sequence[int], classes: int, *, seed: int = 0):
    """:func:`convnet` as a ``keras.Sequential``."""
    import keras
    layers = [keras.Input((side * side,)), keras.layers.Reshape((side, side, 1))]
    for c_out in channels:
        layers += [keras.layers.Conv2D(c_out, 3, padding="same", activation="relu"),
                   keras.layers.MaxPooling2D(2, padding="same")]
    return _keras(layers + [keras.layers.Flatten(), keras.layers.Dense(classes)],
                  convnet_weights(side, channels, classes, seed))


def keras_embedding(vocab: int, dim: int, length: int, classes: int, *, seed: int = 0):
    """:func:`embedding` as a ``keras.Sequential``; the table's gradient is sparse there too."""
    import keras
    return _keras([keras.Input((length,), dtype="int32"), keras.layers.Embedding(vocab, dim),
                   keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(classes)],
                  embedding_weights(vocab, dim, length, classes, seed))
