"""hostavg.keras.Trainer(batch_norm="step"): every BatchNormalization layer's moving statistics
move once per step by the whole batch's moments of the inputs it saw: for the first, as Keras's
own full-batch train_on_batch moves them; "micro" keeps Keras's per-micro-batch behaviour; the
gradients are the same in both."""

import keras
import numpy as np
import pytest

import hostavg
import hostavg.keras
from hostavg.hooks import SkipNonFinite

FEATURES, SIZES = 6, (5, 12, 3, 20)


def build(seed=0):
    """A nested Sequential (Dense, BatchNormalization "bn") -> Dense "mid" -> BatchNormalization
    "bn2" -> logits; momentum 0.8 and 0.5, so that the statistics move visibly in a step."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    inner = keras.Sequential([keras.layers.Dense(8, activation="tanh", name="hidden"),
                              keras.layers.BatchNormalization(momentum=0.8, name="bn")],
                             name="inner")
    h = keras.layers.BatchNormalization(momentum=0.5, name="bn2")(
        keras.layers.Dense(5, name="mid")(inner(inputs)))
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def first(model) -> list:
    """The first batch-norm layer's moving mean and variance: its inputs, x through one Dense,
    are the same whether the batch is cut or not."""
    bn = model.get_layer("inner").get_layer("bn")
    return [bn.moving_mean.numpy(), bn.moving_variance.numpy()]


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(steps=3, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.normal(2.0, 3.0, (sum(SIZES), FEATURES)).astype(np.float32),
             rng.integers(0, 3, sum(SIZES)).astype(np.int32)) for _ in range(steps)]


def cut(x, y):
    bounds = np.cumsum((0,) + SIZES)
    return [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def moving(model) -> list:
    return [v.numpy() for v in model.non_trainable_variables]


def trainer(mode, **kw):
    return hostavg.keras.Trainer(build(), loss(), keras.optimizers.SGD(0.1), batch_norm=mode, **kw)


def keras_full_batch(batches) -> keras.Model:
    """The oracle: Keras's own train_on_batch on each whole batch."""
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    for x, y in batches:
        model.train_on_batch(x, y)
    return model


def assert_moving_equal(got: list, want: list):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_step_moves_the_statistics_as_keras_full_batch_train_on_batch(overlap):
    batches = data()
    step, micro = trainer("step", overlap=overlap), trainer("micro")
    twin = keras_full_batch([])
    for x, y in batches:
        twin.set_weights(step.model.get_weights())  # from where hostavg's step starts
        twin.train_on_batch(x, y)
        step.step(cut(x, y))
        micro.step(cut(x, y))
        assert_moving_equal(first(step.model), first(twin))
    # "micro" moves them k times a step: far from the full-batch step's.
    assert max(np.max(np.abs(a - b)) for a, b in zip(moving(micro.model), moving(step.model))) > 0.1
    # Each micro-batch is normalised by its own moments either way: the same gradients.
    for a, b in zip(step.model.trainable_variables, micro.model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_each_layer_moves_by_the_whole_batchs_moments_of_the_inputs_it_saw():
    """By hand: mm' = a mm + (1 - a) M, mv' = a mv + (1 - a) V with M and V over the whole batch
    of each layer's inputs as the micro-batches' forward passes make them (the deeper layer's
    inputs went through the first layer normalised micro-batch by micro-batch)."""
    (x, y), = data(1)
    t = trainer("step")
    probe = build()
    probe.set_weights(t.model.get_weights())
    hidden = probe.get_layer("inner").get_layer("hidden")
    into_bn = np.tanh(x.astype(np.float64) @ hidden.kernel.numpy() + hidden.bias.numpy())
    mid = keras.Model(probe.input, probe.get_layer("mid").output)
    into_bn2 = np.concatenate([mid(xb, training=True).numpy() for xb, _ in cut(x, y)])
    t.step(cut(x, y))
    for bn, inputs, a in ((t.model.get_layer("inner").get_layer("bn"), into_bn, 0.8),
                          (t.model.get_layer("bn2"), into_bn2.astype(np.float64), 0.5)):
        np.testing.assert_allclose(bn.moving_mean.numpy(), (1 - a) * inputs.mean(0), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(bn.moving_variance.numpy(), a + (1 - a) * inputs.var(0),
                                   rtol=1e-5)


def test_a_dropped_micro_batch_leaves_its_moments_out_and_a_failed_step_moves_nothing():
    (x, y), (x2, y2) = data(2)
    bad = x.copy()
    bad[6, 1] = np.nan  # micro-batch 1: samples 5:17
    t = trainer("step", hooks=[SkipNonFinite()])
    res = t.step(cut(bad, y))
    assert res.dropped == (1,)
    kept = np.r_[0:5, 17:40]
    assert_moving_equal(first(t.model), first(keras_full_batch([(x[kept], y[kept])])))

    plain = trainer("step")
    before = moving(plain.model)
    with pytest.raises(hostavg.HostavgError, match="micro-batch 1 of 4"):
        plain.step(cut(bad, y))
    for a, b in zip(moving(plain.model), before):
        np.testing.assert_array_equal(a, b)
    plain.step(cut(x2, y2))  # nothing of the failed step is left to move them
    assert_moving_equal(first(plain.model), first(keras_full_batch([(x2, y2)])))


def test_compute_leaves_them_alone_and_apply_moves_them_once_check_and_evaluate_not_at_all():
    (x, y), = data(1)
    t = trainer("step")
    t.evaluate(x, y, batch_size=10)
    start = moving(t.model)
    grads = [t.compute(*b) for b in cut(x, y)]
    for a, b in zip(moving(t.model), start):
        np.testing.assert_array_equal(a, b)
    acc = t.accumulator()
    for g in grads:
        acc.add(g)
    assert not t.check(x, y, micro_batch_size=10).ok  # batch norm over micro-batches; what it ran is forgotten
    t.apply(acc.mean())
    assert_moving_equal(first(t.model), first(keras_full_batch([(x, y)])))


def test_batch_norm_modes_are_checked():
    with pytest.raises(hostavg.HostavgError, match=r"batch_norm must be one of \('micro', 'step'\), "
                                                   r"got 'whole'"):
        trainer("whole")
    with pytest.raises(hostavg.HostavgError, match="with comm= each rank sees only its own"):
        trainer("step", comm=object())
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, keras.layers.Dense(3)(
        keras.layers.BatchNormalization(renorm=True, name="renormed")(inputs)))
    t = hostavg.keras.Trainer(model, loss(), keras.optimizers.SGD(0.1), batch_norm="step")
    (x, y), = data(1)
    with pytest.raises(hostavg.HostavgError, match="layer 'renormed' has renorm=True"):
        t.step(cut(x, y))
    assert "batch_norm='step'" in repr(trainer("step"))
