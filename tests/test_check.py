"""trainer.check's verdict (hostavg.core.check.diagnose): hand-made gradients, then real models."""

import numpy as np
import pytest

from hostavg.core.check import CAUSES, FLOOR, TOLERANCE, RandomOp, diagnose, shows_fixed_batch
from hostavg.core.words import WORDS
from hostavg.keras.common import CompiledModel
from hostavg.tf1 import advice as tf1

#: Each backend's advice (its ``advice``: every Keras backend's is CompiledModel's; the TF1
#: backend's is tf1.ADVICE naming the graph's training-mode switches), by the framework whose
#: words it uses.
ADVICE = {"keras": CompiledModel.advice, "tf1": tf1.ADVICE}
TF1 = ADVICE["tf1"]


def grads(**arrays):
    return {name: np.asarray(value, np.float32) for name, value in arrays.items()}


def test_round_off_in_a_variable_whose_true_gradient_is_zero_passes():
    whole = grads(w=[3.0, 4.0], key_bias=[0.0, 0.0])
    mean = grads(w=[3.0, 4.0], key_bias=[1e-8, -2e-8])  # round-off: 4e-9 of |W| = 5
    report = diagnose(whole, whole, mean, 4, TF1)
    assert report.ok, report
    assert report.max_rel_diff["key_bias"] == pytest.approx(np.sqrt(5e-16) / (FLOOR * 5), rel=1e-3)


def test_a_difference_above_the_floor_in_a_small_variable_still_fails():
    # |whole['b']| = 1e-5 |W|: a sum loss scales it by 1/4 as every other variable.
    whole = grads(w=[3.0, 4.0], b=[5e-5])
    mean = {n: v / 4 for n, v in whole.items()}
    report = diagnose(whole, whole, mean, 4, TF1)
    assert not report.ok
    assert report.max_rel_diff["b"] > TOLERANCE[np.dtype("float32")]
    assert "4 times the micro-batch mean" in report.cause and "tf.reduce_mean" in report.cause


def test_no_scale_is_claimed_where_the_gradients_agree_in_size():
    # One variable differs, the whole gradient's size does not: not "1 times".
    whole = grads(w=[300.0, 400.0], b=[1.0, 0.0])
    mean = grads(w=[300.0, 400.0], b=[0.9, 0.1])
    report = diagnose(whole, whole, mean, 4, TF1)
    assert not report.ok and "times" not in report.cause
    assert "batch" in report.cause


@pytest.mark.parametrize("framework", sorted(ADVICE))
def test_the_advice_speaks_the_framework_of_the_user(framework):
    whole = grads(w=[3.0, 4.0])
    noisy = grads(w=[3.5, 4.0])
    advice = ADVICE[framework]
    random = diagnose(whole, noisy, noisy, 2, advice).cause
    scaled = diagnose(whole, whole, {"w": whole["w"] / 2}, 2, advice).cause
    batch = diagnose(whole, whole, grads(w=[4.0, 3.0]), 2, advice).cause
    if framework == "keras":
        assert "Dropout" in random and "keep_prob" not in random
        assert "sum_over_batch_size" in scaled and "tf.reduce_mean" not in scaled
        assert "BatchNormalization" in batch
    else:
        assert "keep_prob" in random and "Dropout" not in random
        assert "tf.reduce_mean" in scaled
        assert "batch_normalization" in batch


def test_the_random_ops_a_backend_found_are_named_with_the_advice_for_their_kind():
    whole, noisy = grads(w=[3.0, 4.0]), grads(w=[3.5, 4.0])
    found = [RandomOp("tf.nn.dropout", "dropout/random_uniform/RandomUniform:0", "random"),
             RandomOp("tf.random.normal", "z/RandomStandardNormal:0", "draw")]
    cause = diagnose(whole, noisy, noisy, 2, TF1, found).cause
    assert ("random ops in training mode: tf.nn.dropout ('dropout/random_uniform/RandomUniform:0'), "
            "tf.random.normal ('z/RandomStandardNormal:0'). Turn them off") in cause
    assert "keep_prob" in cause and "feed 'z/RandomStandardNormal:0' a fixed array" in cause
    many = diagnose(whole, noisy, noisy, 2, TF1, [found[1]._replace(tensor=f"z{i}:0")
                                                    for i in range(5)]).cause
    assert "('z2:0') and 2 more. No feed turns them off" in many and "keep_prob" not in many


def test_a_deterministic_keras_transformer_block_passes_the_check():
    """An attention key's bias has a true gradient of zero (the softmax cancels it): its
    difference is round-off, which the floor lets pass; a dropout twin fails naming Dropout."""
    import keras

    import hostavg.keras

    def block(dropout: float):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6, 8))
        attended = keras.layers.MultiHeadAttention(2, 4, dropout=dropout)(inputs, inputs)
        hidden = keras.layers.LayerNormalization()(inputs + attended)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(hidden))
        model = keras.Model(inputs, outputs)
        return hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), keras.optimizers.SGD(0.1))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6, 8)).astype(np.float32), rng.integers(0, 3, 32)
    report = block(0.0).check(x, y, micro_batch_size=8)
    assert report.ok, report
    noisy = block(0.5).check(x, y, micro_batch_size=8)
    assert not noisy.ok and "Dropout" in noisy.cause and "keep_prob" not in noisy.cause


def test_flags_that_are_not_bools_are_refused_before_anything_happens(tmp_path):
    """A string "False" is truthy: taken as a bool it deleted another run's record steps."""
    import hostavg

    with pytest.raises(hostavg.HostavgError, match=r"^overwrite must be True or False, got 'False'"):
        hostavg.hooks.Record(tmp_path / "rec", overwrite="False")
    with pytest.raises(hostavg.HostavgError, match=r"^micro must be True or False, got 1"):
        hostavg.hooks.Record(tmp_path / "rec", micro=1)
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("message,n,whole,fixed", [
    ("Incompatible shapes: [3,3] vs. [12,3]", 3, 12, True),
    ("Input to reshape is a tensor with 9 values, but the requested shape has 36", 3, 12, True),
    ("Input to reshape is a tensor with 42 values, but the requested shape has 170", 42, 170, True),
    ("Incompatible shapes: [3,3] vs. [5,3]", 3, 12, False),
    ("Incompatible shapes: [12,3] vs. [12,4]", 12, 12, False),  # the whole batch: not this
])
def test_a_shape_error_in_the_ratio_of_micro_batch_to_batch_shows_a_fixed_batch_size(
        message, n, whole, fixed):
    assert shows_fixed_batch(message, n, whole) is fixed


def test_the_tf1_advice_that_names_a_graph_s_switches_advises_on_every_cause():
    named = tf1.advice_for({"keep_prob:0": ("dropout",), "training:0": ("batch norm",)})
    assert set(named) == set(CAUSES) | set(WORDS)
    assert "'keep_prob:0' switches dropout here" in named["random"]
    assert named["batch"].endswith("here switched by 'training:0'")
