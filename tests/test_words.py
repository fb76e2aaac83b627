"""The framework-free layers' messages on each face, in its users' words: a TF1 program reads
feed dicts, sessions and graphs; a Keras user batches and models (hostavg.core.words)."""

import re

import keras
import numpy as np
import pytest
from models import keras_model, v1
from test_trainer import Case, unchanged

import hostavg
import hostavg.keras
from hostavg.core.check import CAUSES
from hostavg.core.words import WORDS
from hostavg.keras import advice as keras_advice
from hostavg.tf1 import advice as tf1_advice

ON_TENSORFLOW = keras.backend.backend() == "tensorflow"
#: Every advice a backend carries, by who carries it.
ADVICE = {"tf1": tf1_advice.ADVICE,
          "tf1 naming its switches": tf1_advice.advice_for({"keep_prob:0": ("dropout",)}),
          "keras": keras_advice.ADVICE, "keras train_step": keras_advice.TRAIN_STEP_ADVICE}
#: TF1's nouns, which a Keras user does not think in.
TF1_NOUNS = re.compile(r"\b(feeds?|feed dicts?|sess|sessions?|graphs?|placeholders?|train op|"
                       r"tf\.\w+)\b", re.IGNORECASE)


@pytest.mark.parametrize("who", sorted(ADVICE))
def test_every_advice_says_every_cause_and_every_word(who):
    assert set(ADVICE[who]) == set(CAUSES) | set(WORDS)


def test_a_keras_user_reads_no_tf1_noun_and_a_tf1_user_reads_tf1_s():
    for advice in (keras_advice.ADVICE, keras_advice.TRAIN_STEP_ADVICE):
        said = {key: advice[key] for key in WORDS if TF1_NOUNS.search(advice[key])}
        assert not said, said
    tf1 = tf1_advice.ADVICE
    assert (tf1["batch_name"], tf1["target_name"], tf1["model_name"], tf1["mean_op"]) == (
        "feed dict", "session", "graph", "tf.reduce_mean")


def _keras_trainer():
    model = keras_model()
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 6)).astype(np.float32), rng.integers(0, 3, 12)
    return trainer, x, y


def test_a_step_of_no_micro_batch_asks_for_one_in_the_face_s_words():
    case = Case()
    case.trainer.step(case.sess, case.feeds)  # the engine is made: its own message
    unchanged(case, lambda: case.trainer.step(case.sess, []),
              r"^step got no micro-batches; pass at least one feed dict$")
    trainer, x, y = _keras_trainer()
    trainer.step([(x, y)])
    with pytest.raises(hostavg.HostavgError,
                       match=r"^step got no micro-batches; pass at least one batch$"):
        trainer.step([])


def test_a_loss_the_graph_leaves_unshaped_is_reduced_with_tf_reduce_mean():
    graph = v1.Graph()
    with graph.as_default():
        x = v1.placeholder(np.float32, None, name="x")  # no rank: the loss's is unknown too
        w = v1.Variable(np.ones(3, np.float32), name="w")
        trainer = hostavg.Trainer(v1.reduce_sum(x * w, -1), v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    with pytest.raises(hostavg.HostavgError, match=r"^compute: the loss has shape \(4,\), not a "
                                                   r"scalar; reduce it with tf\.reduce_mean$"):
        trainer.compute(sess, {x: np.ones((4, 3), np.float32)})


class _FixedBatch(keras.layers.Layer):
    """Broadcasts its input against a constant of 12 rows: a batch size fixed in the model."""

    def call(self, x):
        return x * keras.ops.ones((12, 1))

    def compute_output_shape(self, shape):
        return shape


def test_a_keras_model_that_fixes_the_batch_size_is_called_a_model():
    """On JAX the shape error comes while the compute for the new shape is traced, in the step."""
    inputs = keras.Input((3,))
    trainer = hostavg.keras.Trainer(keras.Model(inputs, keras.layers.Dense(2)(
        _FixedBatch()(inputs))), "mse", keras.optimizers.SGD(0.1))
    x, y = np.ones((12, 3), np.float32), np.ones((12, 2), np.float32)
    trainer.step([(x, y)])
    with pytest.raises(hostavg.HostavgError,
                       match=r"^step, micro-batch 0 of 3 \(samples 0:4\): the model likely fixes "
                             r"the batch size: it builds a shape from the full batch \(12 rows\) "
                             r"where the micro-batch has 4 \(keras\.ops\.reshape"):
        trainer.step(hostavg.split((x, y), 4))
    assert trainer.step([(x, y)]).step == 2  # nothing applied: the second step is step 2
