"""per_sample's norms and sums at Dense and convolution layers from their inputs and the loss's
gradient at their outputs (hostavg.keras.layer_taps), on the process's Keras backend: the same
table as each sample computed alone on models where a layer is tapped (convolutions strided,
dilated, padded "same" unevenly, causal) and where one must not be (its kernel tied to another
layer, the layer called twice, on a rank-3 input or on rows folded into the batch, a
regularizer), and which layers the traced function taps."""

import threading
import time
import warnings

import keras
import numpy as np
import pytest

import hostavg.keras
from hostavg.keras.layer_taps import LayerTaps
from test_per_sample import COLUMNS, brute_force


@pytest.fixture
def tapped(monkeypatch):
    """The layer names each per-sample "sums" (or "both": sums and dots) function is built
    with, in order: the last is
    what per_sample's function taps (TensorFlow builds again without the layers whose weights
    the loss reads elsewhere; both build again untapped where a tapped one fails)."""
    if keras.backend.backend() == "jax":
        from hostavg.keras.jax import KerasJaxBackend as Backend
    else:
        from hostavg.keras.tensorflow import KerasBackend as Backend
    seen, original = [], Backend._sample_function

    def spy(self, first, kind, taps=None, *rest):
        if kind != "dots":
            seen.append(sorted(layer.name for layer in taps.layers) if taps else [])
        return original(self, first, kind, taps, *rest)
    monkeypatch.setattr(Backend, "_sample_function", spy)
    return seen


class Tied(keras.layers.Layer):
    """Logits from another layer's kernel, transposed (a tied output embedding)."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.dense.kernel))


def _mlp():
    return keras.Sequential([keras.Input((12,)),
                             keras.layers.Dense(16, activation="tanh", name="hidden"),
                             keras.layers.Dense(8, activation="relu", use_bias=False,
                                                name="no_bias"),
                             keras.layers.Dense(3, name="out")])


def _tied():
    x = keras.Input((12,))
    embed = keras.layers.Dense(12, name="embed")  # (12, 12): its transpose maps back
    h = keras.layers.Dense(12, activation="tanh", name="hidden")(embed(x))
    out = keras.layers.Dense(3, name="out")(Tied(embed, name="tied")(h))
    return keras.Model(x, out)


def _shared():
    x = keras.Input((12,))
    twice = keras.layers.Dense(12, activation="tanh", name="twice")
    return keras.Model(x, keras.layers.Dense(3, name="out")(twice(twice(x))))


def _sequence():
    x = keras.Input((12,))
    h = keras.layers.Reshape((3, 4))(x)
    h = keras.layers.Dense(5, activation="tanh", name="per_step")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(keras.layers.Flatten()(h)))


class Folded(keras.layers.Layer):
    """A Dense on a sample's 3 rows of 4, folded into the batch: (n, 12) -> (3n, 4) -> (n, 15)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5, activation="tanh", name="folded")

    def call(self, x):
        return keras.ops.reshape(self.dense(keras.ops.reshape(x, (-1, 4))), (-1, 15))


def _folded():
    x = keras.Input((12,))
    return keras.Model(x, keras.layers.Dense(3, name="out")(Folded()(x)))


def _one_kernel():
    """Two Dense layers holding one kernel variable: its gradient is both theirs."""
    x = keras.Input((12,))
    first, second = keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(12, name="second")
    first.build((None, 12))
    second.build((None, 12))
    object.__setattr__(second, "_kernel", first._kernel)  # (Keras's tracking bypassed)
    return keras.Model(x, keras.layers.Dense(3, name="out")(second(first(x))))


class Cell(keras.layers.Layer):
    """An RNN cell with a Dense inside: called in a loop's body (lax.scan on JAX)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense, self.state_size = keras.layers.Dense(6, activation="tanh", name="cell"), 6

    def build(self, shape):
        self.dense.build((None, 10))

    def call(self, x, states):
        h = self.dense(keras.ops.concatenate([x, states[0]], -1))
        return h, [h]


def _recurrent():
    x = keras.Input((12,))
    h = keras.layers.RNN(Cell())(keras.layers.Reshape((3, 4))(x))
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def _regularized():
    return keras.Sequential([keras.Input((12,)),
                             keras.layers.Dense(16, activation="tanh", name="decayed",
                                                kernel_regularizer=keras.regularizers.L2(0.1)),
                             keras.layers.Dense(3, name="out")])


def _active():
    """An activity regularizer: a loss the layer adds on its output (tapped: delta has it)."""
    return keras.Sequential([
        keras.Input((12,)), keras.layers.Dense(8, activation="tanh", name="hidden",
                                               activity_regularizer=keras.regularizers.L2(0.3)),
        keras.layers.Dense(3, name="out")])


def _embedded():
    x = keras.Input((4,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(10, 3, name="embedding")(x))
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def _convolved():
    """Convolutions padded "same" (with a stride: one more row and column after than
    before), strided "valid" with an oblong kernel, dilated, without a bias."""
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="same"),
        keras.layers.Conv2D(3, (3, 2), strides=2, use_bias=False, name="strided"),
        keras.layers.Conv2D(3, 2, dilation_rate=2, padding="same", activation="tanh",
                            name="dilated"),
        keras.layers.Conv2D(2, 3, strides=2, padding="same", name="uneven"),
        keras.layers.Flatten(), keras.layers.Dense(3, name="out")])


def _convolved_1d():
    return keras.Sequential([
        keras.Input((10, 3)),
        keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="relu",
                            name="causal"),
        keras.layers.Conv1D(2, 2, strides=2, name="valid"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3, name="out")])


def _siamese():
    """One Conv2D called on the image and on it flipped: the second call reads the kernel."""
    x = keras.Input((6, 6, 1))
    conv = keras.layers.Conv2D(3, 3, activation="relu", name="twice")
    h = keras.layers.Concatenate()([conv(x), conv(keras.ops.flip(x, axis=2))])
    return keras.Model(x, keras.layers.Dense(3, name="out")(keras.layers.Flatten()(h)))


CASES = {  # model, the layers the traced function taps
    "mlp": (_mlp, ["hidden", "no_bias", "out"]),
    "tied": (_tied, ["hidden", "out"]),
    "shared": (_shared, ["out"]),
    "sequence": (_sequence, ["out"]),
    "folded": (_folded, ["out"]),
    "regularized": (_regularized, ["out"]),
    "active": (_active, ["hidden", "out"]),
    "one kernel": (_one_kernel, ["out"]),
    # JAX: a tapped call in a loop's body fails (its input escapes lax.scan), so untapped;
    # TensorFlow: the cell's weights count as read elsewhere, and then each sample computes
    # alone anyway (tf.vectorized_map cannot convert the RNN's loop)
    "recurrent": (_recurrent, [] if keras.backend.backend() == "jax" else ["out"]),
    # on TensorFlow an Embedding's gradient is rows: each sample computes alone, untapped
    "embedded": (_embedded, ["out"] if keras.backend.backend() == "jax" else []),
    "convolved": (_convolved, ["dilated", "out", "same", "strided", "uneven"]),
    "convolved 1d": (_convolved_1d, ["causal", "out", "valid"]),
    "siamese": (_siamese, ["out"]),
}


@pytest.mark.parametrize("case", CASES)
def test_per_sample_is_each_sample_alone_and_taps_only_what_it_may(case, tapped):
    _check(case, keras.optimizers.SGD(0.1), tapped)


def test_a_loss_scale_is_divided_out_of_the_tapped_layers_too(tapped):
    _check("mlp", keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                      initial_scale=2.0 ** 10), tapped)


def _check(case, optimizer, tapped):
    """per_sample of CASES[case] in chunks equals each sample alone, and taps its layers."""
    make, taps = CASES[case]
    keras.utils.set_random_seed(1)
    model = make()
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), optimizer)
    rng = np.random.default_rng(4)
    x = (rng.integers(0, 10, (11, 4)).astype(np.int32) if case == "embedded"
         else rng.normal(size=(11, *model.input_shape[1:])).astype(np.float32))
    y = rng.integers(0, 3, 11).astype(np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if taps and case != "recurrent" else "ignore",
                              UserWarning)  # vectorized
        table = trainer.per_sample(x, y, chunk_size=4)
    want = brute_force(trainer, x, y, np.ones(len(x), np.float32))
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), want, rtol=1e-6, atol=1e-6)
    assert (tapped[-1] if tapped else []) == taps
    assert all("call" not in vars(layer) for layer in model._flatten_layers())


class _OwnConv(keras.layers.Conv2D):
    """A Conv2D subclass: its call may differ, so it is not tapped."""


def test_untapped_convolutions_whose_gradients_mostly_cancel_are_each_sample_alone(tapped):
    """Nothing tapped: each kernel's per-sample gradients are formed, and their sum gives the
    mean. 64 samples whose gradients mostly cancel (their mean a tenth of each): on JAX the
    gradient of the losses' sum (XLA's batched convolution gradient) rounded the mean to 3e-6
    of itself and cosines 2.3e-6 off (an outside review); the sum of the formed gradients is
    the brute force's to 3e-7."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8, 8, 2)),
                              _OwnConv(4, 3, padding="same", activation="tanh"),
                              _OwnConv(3, 3, strides=2, padding="same"),
                              keras.layers.GlobalAveragePooling2D()])
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanSquaredError(),
                                    keras.optimizers.SGD(0.1))
    x = np.random.default_rng(4).normal(size=(64, 8, 8, 2)).astype(np.float32)
    y = np.random.default_rng(5).normal(size=(64, 3)).astype(np.float32)
    table = trainer.per_sample(x, y, chunk_size=64)
    want = brute_force(trainer, x, y, np.ones(64, np.float32))
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), want, rtol=1e-6, atol=1e-6)
    assert tapped[-1] == []


def test_a_sample_whose_tapped_gradient_overflows_is_left_out_as_alone(tapped):
    """A linear regression's sample whose loss is finite (its residual squared, 2e38) and
    whose gradient 2 r x (9e38) is not, in float32: its norm Inf and cosines NaN as alone, the
    others' those of the mean without it (its |a|^2 |delta|^2 in float64 was finite, and its
    Inf entered the mean: every other cosine NaN)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")])
    model.set_weights([np.full((4, 1), 0.5, np.float32), np.zeros(1, np.float32)])
    trainer = hostavg.keras.Trainer(model, keras.losses.MeanSquaredError(),
                                    keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 1)).astype(np.float32)
    x[2, 0] = 3e19
    keep, ones = np.delete(np.arange(6), 2), np.ones(6, np.float32)
    want = brute_force(trainer, x[keep], y[keep], ones[keep])
    for chunk_size in (1, 6):
        table = trainer.per_sample(x, y, chunk_size=chunk_size)
        assert np.isinf(table["norm"][2]) and table.loc[2, ["cosine", "cosine_to_rest"]].isna().all()
        np.testing.assert_allclose(table.drop(index=2)[COLUMNS].to_numpy(float), want,
                                   rtol=1e-6, atol=1e-6)
    assert tapped[-1] == ["out"]


def test_only_a_plain_dense_or_convolution_of_trained_weights_is_a_candidate():
    class Sub(keras.layers.Dense):
        pass

    images = keras.Sequential([
        keras.Input((6, 6, 4)), keras.layers.Conv2D(4, 3, name="plain"),
        keras.layers.Conv2D(4, 3, groups=2, name="grouped"),
        keras.layers.Conv2D(4, 1, name="decayed", bias_regularizer=keras.regularizers.L2(0.1)),
        keras.layers.SeparableConv2D(4, 1, name="separable"),
        keras.layers.Conv2DTranspose(4, 1, name="transposed"),
        keras.layers.DepthwiseConv2D(1, name="depthwise"), keras.layers.Flatten(),
        keras.layers.Dense(2, name="last")])
    assert [layer.name for layer in LayerTaps(images, images.trainable_variables).layers] == [
        "plain", "last"]

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="plain"),
                              Sub(4, name="subclass"), keras.layers.Dense(4, name="frozen"),
                              keras.layers.Dense(4, name="lora"),
                              keras.layers.Dense(4, name="half", dtype="mixed_float16"),
                              keras.layers.Dense(2, name="last")])
    model.get_layer("frozen").trainable = False
    model.get_layer("lora").enable_lora(2)
    taps = LayerTaps(model, model.trainable_variables)
    assert [layer.name for layer in taps.layers] == ["plain", "last"]
    assert [model.trainable_variables[i].path.split("/", 1)[1]
            for i in sorted(taps.indices())] == ["plain/kernel", "plain/bias", "last/kernel",
                                                 "last/bias"]


def test_a_tapped_layer_is_its_own_again_after_a_call_that_raises():
    model = _mlp()
    taps = LayerTaps(model, model.trainable_variables)
    with pytest.raises(RuntimeError, match="in the middle"):
        with taps.tapped(lambda v: v.value, lambda j, z: z, [None] * len(taps)):
            assert all("call" in vars(layer) for layer in taps.layers)
            raise RuntimeError("in the middle")
    assert all("call" not in vars(layer) for layer in model.layers)
    model(np.zeros((2, 12), np.float32))


def test_two_threads_tapping_one_model_each_get_each_sample_alone():
    """Two trainers of one model, per_sample in two threads at once (a review saw one thread
    restore the other's call and then fail to find its own): each table is each sample
    alone, none falls back, and no layer keeps a call of its own."""
    keras.utils.set_random_seed(1)
    model = _mlp()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(11, 12)).astype(np.float32)
    y = rng.integers(0, 3, 11).astype(np.int32)

    def trainer():
        return hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), keras.optimizers.SGD(0.1))
    tables, trainers = {}, {c: trainer() for c in (4, 3, 5, 2)}  # (compile is not threadsafe)

    def run(chunk_size):
        tables[chunk_size] = trainers[chunk_size].per_sample(x, y, chunk_size=chunk_size)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=run, args=(c,)) for c in trainers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not [w for w in said if "per_sample" in str(w.message)]
    want = brute_force(trainers[4], x, y, np.ones(len(x), np.float32))
    assert sorted(tables) == [2, 3, 4, 5]
    for table in tables.values():
        np.testing.assert_allclose(table[COLUMNS].to_numpy(float), want, rtol=1e-6, atol=1e-6)
    assert all("call" not in vars(layer) for layer in model._flatten_layers())


def test_taps_of_two_threads_take_turns():
    """A second thread's taps wait for the first's to be restored: else each would replace
    the other's call mid-trace (JAX's probe and trace would then disagree)."""
    model = _mlp()
    taps = LayerTaps(model, model.trainable_variables)
    inside, order = threading.Event(), []

    def tap(name, wait):
        if wait:
            inside.wait()
        with taps.tapped(lambda v: v.value, lambda j, z: z, [None] * len(taps)):
            order.append(f"{name} in")
            inside.set()
            time.sleep(0.2)  # (the other thread would enter here)
            order.append(f"{name} out")
    threads = [threading.Thread(target=tap, args=("first", False)),
               threading.Thread(target=tap, args=("second", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == ["first in", "first out", "second in", "second out"]
    assert all("call" not in vars(layer) for layer in model.layers)
