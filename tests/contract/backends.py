"""The faces of hostavg the contract suite runs, each behind the same small surface.

A contract test is written once, against :class:`Backend` and :class:`Face`:

* data travels in one neutral form, a dict ``{"x" or "ids": array, "y": array}``
  of one batch (:func:`models.batches`); :meth:`Face.cut` turns it into the
  face's micro-batches (feed dicts for TF1, ``(x, y)`` tuples for Keras);
* :meth:`Backend.make` builds one of :data:`MODELS` from fixed initial weights
  (:func:`models.initial_weights`) with its trainer, ready to step;
* :meth:`Backend.oracle` runs the framework's OWN full-batch step on the same
  model from the same weights, and :meth:`Face.values` reads every variable
  (weights, optimizer state, step, moving statistics) as a dict of arrays
  under the same names, so the two compare key by key.

Adding a backend is one more subclass of :class:`Backend` (and of :class:`Face`
where its data differs), listed in :data:`BACKENDS`.

Keras's backend is fixed per process (``KERAS_BACKEND``), so a process runs the
backends of the Keras it has: TF1 and Keras on TensorFlow, or Keras on JAX
(``KERAS_BACKEND=jax pytest tests/contract``; CI runs that as a step of its
own, .ci/run).
"""

import keras
import numpy as np
import tensorflow as tf
from models import (OPTIMIZERS, build, cuts, full_batch, keras_model, keras_optimizer,
                    make_optimizer, v1)

import hostavg
import hostavg.keras
from hostavg.tf1.variables import load_variables

#: The models every backend builds (see :meth:`Backend.make`).
MODELS = (
    "mlp",        # models.build's MLP: 6 features, 8 hidden (tanh), 3 classes, mean cross-entropy
    "embedding",  # its input the mean of 3 embedding rows of 50: a sparse gradient, repeated ids
    "batchnorm",  # moving statistics and a counter, both assigned by every forward pass
    "dropout",    # random ops in training mode
    "sum",        # the loss a SUM over the samples instead of their mean
)

#: The unequal micro-batches a batch is cut into, and its size.
SIZES = (5, 11, 16)
BATCH = sum(SIZES)

class Face:
    """One model with its trainer, bound to where its values live, called as the trainer is.

    The faces differ only in what the frameworks differ in: :attr:`where`, the
    arguments every trainer method takes first (a TF1 session), and
    :meth:`native`/:meth:`args`, how one batch is given. Every other method
    is the trainer's own, called the same on every backend (``data`` a
    neutral batch, ``micro`` one micro-batch of :meth:`cut`).
    """

    #: The hostavg trainer, for what tests read of it directly (spec, hooks).
    trainer = None
    #: What every trainer method takes first.
    where: tuple = ()

    def native(self, data: dict):
        """One batch of neutral ``data`` in this face's form (what ``step`` takes a list of)."""
        raise NotImplementedError

    def args(self, batch) -> tuple:
        """One batch in this face's form as the positional arguments of ``compute``."""
        raise NotImplementedError

    def cut(self, data: dict, sizes) -> list:
        """``data`` cut into micro-batches: of ``sizes`` samples each (a tuple), or with
        :func:`hostavg.split` (an int, the micro-batch size)."""
        if isinstance(sizes, int):
            return hostavg.split(self.native(data), sizes)
        return [self.native({k: v[s] for k, v in data.items()})
                for s in cuts(len(data["y"]), sizes)]

    def step(self, micro, **kw):
        return self.trainer.step(*self.where, micro, **kw)

    def compute(self, micro):
        return self.trainer.compute(*self.where, *self.args(micro))

    def accumulator(self):
        return self.trainer.accumulator(*self.where)

    def apply(self, grads):
        return self.trainer.apply(*self.where, grads)

    def check(self, data, micro_batch_size):
        return self.trainer.check(*self.where, *self.args(self.native(data)),
                                  micro_batch_size=micro_batch_size)

    def per_sample(self, data, **kw):
        return self.trainer.per_sample(*self.where, *self.args(self.native(data)), **kw)

    def hvp(self, data, vectors, **kw):
        return self.trainer.hvp(*self.where, *self.args(self.native(data)), vectors=vectors, **kw)

    def curvature(self, data, **kw):
        return self.trainer.curvature(*self.where, *self.args(self.native(data)), **kw)

    def fit(self, data, **kw):
        return self.trainer.fit(*self.where, *self.args(self.native(data)), **kw)

    def evaluate(self, data, batch_size):
        return self.trainer.evaluate(*self.where, *self.args(self.native(data)),
                                     batch_size=batch_size)

    def save(self, path):
        self.trainer.save(*self.where, path)

    def restore(self, path):
        return self.trainer.restore(*self.where, path)

    def values(self) -> dict:
        """Every variable's value by name: weights, optimizer state, step, moving statistics."""
        raise NotImplementedError

    def set(self, name: str, value) -> None:
        """Sets the trained variable ``name`` (a key of the trainer's spec) to ``value``."""
        raise NotImplementedError

    #: What an error names the Adam second moment of the variable "hidden/kernel" by.
    second_moment = ""

    def loss(self, data: dict) -> float:
        """The framework's own inference loss of the model as it is, over all ``data`` at once."""
        raise NotImplementedError

    def assigned(self) -> set:
        """The names (in :meth:`values`) of the trainer's rollback variables: those the
        forward pass assigns, which differ from a full-batch step's (k passes, not one)."""
        raise NotImplementedError

    def mean(self, micro: list):
        """The accumulated mean of ``micro``, from lone computes: no step runs."""
        grads = [self.compute(m) for m in micro]
        acc = self.accumulator()
        for g in grads:
            acc.add(g)
        return acc.mean()


class Backend:
    """One face of hostavg, as the contract suite drives it.

    Attributes:
      id: the test id.
    """

    id = ""
    #: Whether an embedding's gradient comes as rows (a SparseGradient); dense on JAX.
    sparse_rows = True

    def make(self, model: str = "mlp", optimizer: str = "adam", **trainer_kw) -> Face:
        """``model`` (one of :data:`MODELS`) from fixed weights, with a trainer whose optimizer
        is ``optimizer`` (a name in ``models.OPTIMIZERS``) and whose keywords are ``trainer_kw``."""
        raise NotImplementedError

    def oracle(self, model: str, optimizer: str, data: list, untrained=()) -> dict:
        """The framework's own full-batch step on each batch of ``data``, from the weights
        :meth:`make` starts from, the variables ``untrained`` names (of the trainer's spec)
        left out of training; returns :meth:`Face.values` afterwards."""
        raise NotImplementedError

    def pair(self, hooks=((), ()), **trainer_kw) -> tuple[Face, Face]:
        """Two faces whose trainers can step together (:meth:`step_together`), with ``hooks``
        (one list per trainer) and ``trainer_kw``."""
        raise NotImplementedError

    def step_together(self, steps: list) -> list:
        """``hostavg``'s step_together over ``(face, micro-batches)`` pairs."""
        raise NotImplementedError


# --- TF1: a tf.compat.v1 graph and its session ---------------------------------------------


class TF1Face(Face):
    def __init__(self, model, trainer, sess):
        self.model, self.trainer, self.sess = model, trainer, sess
        self.where = (sess,)

    def native(self, data):
        return self.model.feed(data)

    def args(self, batch):
        return (batch,)

    def loss(self, data):
        return float(self.sess.run(self.trainer.loss, self.native(data)))

    def values(self):
        return self.model.values(self.sess)

    def set(self, name, value):
        variable, = [v for v in self.model.graph.get_collection("variables") if v.op.name == name]
        load_variables(self.sess, [variable], [value])

    second_moment = "'hidden/kernel/Adam_1'"

    def assigned(self):
        return {v.op.name for v in self.trainer.rollback_variables}


class TF1(Backend):
    """``hostavg.Trainer`` on a models.build graph; the oracle is the optimizer's own
    ``minimize`` on the whole batch in a twin graph (models.full_batch)."""

    id = "tf1"
    #: models.build's options per model ("sum" rescales the mean loss, below).
    BUILD = {"mlp": {}, "embedding": {"sparse": True}, "batchnorm": {"update_op": True},
             "dropout": {"dropout": 0.25}, "sum": {}}
    def _model(self, model):
        built = build(**self.BUILD[model])
        loss = built.loss
        if model == "sum":
            with built.graph.as_default():
                loss = loss * tf.cast(tf.size(built.inputs["y"]), loss.dtype)
        return built, loss

    def make(self, model="mlp", optimizer="adam", **trainer_kw):
        built, loss = self._model(model)
        with built.graph.as_default():
            trainer = hostavg.Trainer(loss, make_optimizer(optimizer), **trainer_kw)
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=built.graph)
        sess.run(init)
        return TF1Face(built, trainer, sess)

    def oracle(self, model, optimizer, data, untrained=()):
        return full_batch(OPTIMIZERS[optimizer], data, untrained=untrained, **self.BUILD[model])

    def pair(self, hooks=((), ()), **trainer_kw):
        """Two trainers of one graph, a GAN's two networks: the hidden layer's and the output
        layer's, each with its own Adam; the second leaves the global step alone."""
        built, loss = self._model("mlp")
        with built.graph.as_default():
            hidden = [v for v in v1.trainable_variables() if v.op.name.startswith("hidden/")]
            out = [v for v in v1.trainable_variables() if v.op.name.startswith("out/")]
            first = hostavg.Trainer(loss, make_optimizer("adam"), hidden, hooks=hooks[0],
                                    **trainer_kw)
            second = hostavg.Trainer(loss, make_optimizer("adam"), out, increment_global_step=False,
                                     hooks=hooks[1], **trainer_kw)
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=built.graph)
        sess.run(init)
        return TF1Face(built, first, sess), TF1Face(built, second, sess)

    def step_together(self, steps):
        sess = steps[0][0].sess
        return hostavg.step_together(sess, [(face.trainer, micro) for face, micro in steps])


# --- Keras 3 (TensorFlow backend) ------------------------------------------------------------


def keras_values(model, optimizer) -> dict:
    """Every variable of ``model`` by path, and of ``optimizer`` as ``optimizer/<name>`` (its
    path without the optimizer's own name, which Keras makes unique per instance)."""
    out = {v.path: v.numpy() for v in model.variables}
    out.update((f"optimizer/{v.path.split('/', 1)[-1]}", v.numpy()) for v in optimizer.variables)
    return out


def keras_batch(data: dict) -> tuple:
    """Neutral ``data`` as a Keras batch ``(x, y)``."""
    return data["ids"] if "ids" in data else data["x"], data["y"]


def counted(model):
    """``model`` behind a layer that counts its forward passes in a variable it assigns."""

    class Counter(keras.layers.Layer):
        def build(self, input_shape):
            self.count = self.add_weight(shape=(), initializer="zeros", dtype="int64",
                                         trainable=False, name="count")

        def call(self, x):
            self.count.assign_add(1)
            return x

    inputs = keras.Input(model.inputs[0].shape[1:], dtype=model.inputs[0].dtype)
    return keras.Model(inputs, model(Counter(name="counter")(inputs)))


class KerasFace(Face):
    def __init__(self, trainer):
        self.trainer = trainer

    def native(self, data):
        return keras_batch(data)

    def args(self, batch):
        return batch

    def loss(self, data):
        x, y = self.native(data)
        return float(self.trainer.loss(y, self.trainer.model(x, training=False)))

    def values(self):
        return keras_values(self.trainer.model, self.trainer.optimizer)

    def set(self, name, value):
        variable, = [v for v in self.trainer.model.variables if v.path == name]
        variable.assign(value)

    second_moment = "/hidden_kernel_velocity'"  # the optimizer's own name first: 'adam/...'

    def assigned(self):
        return {v.path for v in self.trainer.rollback_variables}


class Keras(Backend):
    """``hostavg.keras.Trainer`` on models.keras_model; the oracle is ``train_on_batch`` on a
    twin model from the same weights."""

    id = "keras"

    def _model(self, model):
        if model == "batchnorm":
            built = counted(keras_model(batch_norm=True))
        else:
            built = keras_model(sparse=model == "embedding", dropout=model == "dropout")
        if model == "sum":
            def loss(y, logits):
                return keras.ops.sum(keras.losses.sparse_categorical_crossentropy(
                    y, logits, from_logits=True))
        else:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return built, loss

    def make(self, model="mlp", optimizer="adam", **trainer_kw):
        built, loss = self._model(model)
        return KerasFace(hostavg.keras.Trainer(built, loss, keras_optimizer(optimizer),
                                               **trainer_kw))

    def _untrained(self, model, untrained):
        """The twin of ``model`` (``_model``) with the variables ``untrained`` names made
        untrained, and its loss."""
        built, loss = self._model(model)
        for v in built.trainable_variables:
            if v.path in untrained:
                v.trainable = False
        return built, loss

    def oracle(self, model, optimizer, data, untrained=()):
        """``train_on_batch``; for the embedding model, Keras's own apply of the densified
        whole-batch gradient instead, since Keras 3's sparse update on TensorFlow squares each
        row it is given, so ids repeated in a batch make train_on_batch differ from the
        full-batch step (tests/test_keras.py shows it)."""
        built, loss = self._untrained(model, untrained)
        opt = keras_optimizer(optimizer)
        if model == "embedding":
            opt.build(built.trainable_variables)
            for d in data:
                x, y = keras_batch(d)
                with tf.GradientTape() as tape:
                    value = loss(y, built(x, training=True))
                grads = tape.gradient(value, built.trainable_variables)
                opt.apply_gradients(zip([tf.convert_to_tensor(g) for g in grads],
                                        built.trainable_variables))
        else:  # eagerly: Keras's own train step, without 0.2 s of tracing per oracle
            built.compile(optimizer=opt, loss=loss, run_eagerly=True)
            for d in data:
                built.train_on_batch(*keras_batch(d))
        return keras_values(built, opt)

    def pair(self, hooks=((), ()), **trainer_kw):
        return self.make(hooks=hooks[0], **trainer_kw), self.make(hooks=hooks[1], **trainer_kw)

    def step_together(self, steps):
        return hostavg.keras.step_together([(face.trainer, micro) for face, micro in steps])


class KerasJax(Keras):
    """``hostavg.keras.Trainer`` on Keras's JAX backend; the oracle is ``train_on_batch`` on a
    twin model from the same weights, for every model (a JAX gradient is dense, so Keras's
    sparse update on TensorFlow, which the embedding oracle avoids there, never runs)."""

    id = "keras-jax"
    sparse_rows = False

    def oracle(self, model, optimizer, data, untrained=()):
        built, loss = self._untrained(model, untrained)
        opt = keras_optimizer(optimizer)
        built.compile(optimizer=opt, loss=loss)
        for d in data:
            built.train_on_batch(*keras_batch(d))
        return keras_values(built, opt)


#: Every backend the contract runs in this process, in order: those of Keras's backend.
BACKENDS = {"tensorflow": (TF1(), Keras()), "jax": (KerasJax(),)}[keras.backend.backend()]


def same(got: dict, want: dict, atol: float = 0.0, skip=()) -> None:
    """Asserts that ``got`` and ``want`` (:meth:`Face.values`) hold the same names, but
    ``skip``, and the same values: within ``atol``, or bit for bit (dtype too) when it is 0.
    The message names every variable that differs and by how much."""
    got = {k: np.asarray(v) for k, v in got.items() if k not in skip}
    want = {k: np.asarray(v) for k, v in want.items() if k not in skip}
    assert got.keys() == want.keys(), (f"only got {sorted(got.keys() - want.keys())}, "
                                       f"only wanted {sorted(want.keys() - got.keys())}")
    diffs = {k: float(np.max(np.abs(got[k].astype(np.float64) - want[k]), initial=0.0))
             for k in want}
    if atol:
        differ = {k: d for k, d in diffs.items() if not d <= atol}
    else:
        differ = {k: diffs[k] for k in want
                  if got[k].dtype != want[k].dtype or not np.array_equal(got[k], want[k])}
    assert not differ, f"differ (largest absolute difference): {differ}"


def message_with_notes(error: BaseException) -> str:
    """An exception's message with its notes: all it tells a user."""
    return "\n".join([str(error), *getattr(error, "__notes__", ())])
