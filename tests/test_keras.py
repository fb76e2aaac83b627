"""hostavg.keras.Trainer against Keras's own full-batch step, and its promises: atomic steps,
batch-norm statistics per micro-batch, sparse embeddings, hooks, checkpoints, fit, errors."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from models import CLASSES, FEATURES, HIDDEN, batches, cuts, keras_model
from models import keras_model as build

import hostavg
import hostavg.keras

STEPS, BATCH = 8, 40
EQUAL, UNEQUAL = (10, 10, 10, 10), (5, 12, 3, 20)

#: The five optimizers every exactness test runs, as in the TF1 tests.
OPTIMIZERS = {
    "sgd": lambda **kw: keras.optimizers.SGD(0.1, **kw),
    "momentum": lambda **kw: keras.optimizers.SGD(0.05, momentum=0.9, **kw),
    "adam": lambda **kw: keras.optimizers.Adam(0.01, **kw),
    "rmsprop": lambda **kw: keras.optimizers.RMSprop(0.01, **kw),
    "adagrad": lambda **kw: keras.optimizers.Adagrad(0.1, **kw),
}


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def xy(d):
    return d["ids" if "ids" in d else "x"], d["y"]


def values(model, optimizer) -> list:
    """Every variable: the model's, then the optimizer's (slots, iterations)."""
    return [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]


def assert_close(got: list, want: list, atol: float):
    assert len(got) == len(want)
    worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(got, want))
    assert worst <= atol, worst


def keras_steps(optimizer, data, *, accumulation=None, sizes=None, **model_kw):
    """The oracle: Keras's own train_on_batch on each whole batch (or on each micro-batch,
    with gradient_accumulation_steps)."""
    model = build(**model_kw)
    kw = {"gradient_accumulation_steps": accumulation} if accumulation else {}
    model.compile(optimizer=OPTIMIZERS[optimizer](**kw), loss=loss())
    for d in data:
        x, y = xy(d)
        w = d.get("w")
        if accumulation:
            for s in cuts(BATCH, sizes):
                model.train_on_batch(x[s], y[s])
        else:
            model.train_on_batch(x, y, sample_weight=w)
    return model


def hostavg_steps(optimizer, data, sizes, **model_kw):
    model = build(**model_kw)
    trainer = hostavg.keras.Trainer(model, loss(), OPTIMIZERS[optimizer]())
    results = []
    for d in data:
        x, y = xy(d)
        parts = (x, y) if "w" not in d else (x, y, d["w"])
        results.append(trainer.step([tuple(p[s] for p in parts) for s in cuts(BATCH, sizes)]))
    return model, trainer, results


# --- Exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_equal_micro_batches_equal_keras_gradient_accumulation(optimizer):
    data = batches(1, STEPS, BATCH)
    want = keras_steps(optimizer, data, accumulation=len(EQUAL), sizes=EQUAL)
    model, trainer, _ = hostavg_steps(optimizer, data, EQUAL)
    assert_close([v.numpy() for v in model.variables], [v.numpy() for v in want.variables],
                 atol=1e-5)
    assert int(trainer.optimizer.iterations.numpy()) == int(want.optimizer.iterations.numpy())


def dense_full_batch(optimizer, data):
    """The mathematically defined full-batch step of the embedding model: the gradient of the
    whole batch's mean loss, the table's densified, applied by the optimizer."""
    model = build(sparse=True)
    opt = OPTIMIZERS[optimizer]()
    opt.build(model.trainable_variables)
    for d in data:
        x, y = xy(d)
        with tf.GradientTape() as tape:
            value = loss()(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip([tf.convert_to_tensor(g) for g in grads], model.trainable_variables))
    return model, opt


def test_keras_train_on_batch_differs_from_the_dense_step_when_ids_repeat():
    """Why hostavg feeds unique rows back: Keras's sparse Adam squares each row it is given."""
    data = batches(2, STEPS, BATCH, sparse=True)
    want, _ = dense_full_batch("adam", data)
    keras_own = keras_steps("adam", data, sparse=True)
    table = "embedding/embeddings"
    diff = np.max(np.abs(keras_own.get_layer("embedding").embeddings.numpy()
                         - want.get_layer("embedding").embeddings.numpy()))
    assert diff > 1e-3, (table, diff)


def test_sample_weights_and_regularisation_equal_keras():
    rng = np.random.default_rng(5)
    data = [{**d, "w": rng.uniform(0.1, 2.0, BATCH).astype(np.float32)}
            for d in batches(3, STEPS, BATCH)]
    kw = {"regularizer": keras.regularizers.L2(0.01)}
    want = keras_steps("adam", data, **kw)
    model, trainer, results = hostavg_steps("adam", data, UNEQUAL, **kw)
    assert model.losses  # the L2 term is in every micro-batch's loss
    assert_close(values(model, trainer.optimizer), values(want, want.optimizer), atol=1e-5)


def test_a_multi_input_model_takes_a_dict_of_arrays():
    def two_inputs():
        keras.utils.set_random_seed(0)
        a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
        h = keras.layers.Dense(HIDDEN, activation="tanh", name="hidden")(
            keras.layers.Concatenate()([a, b]))
        return keras.Model({"a": a, "b": b}, keras.layers.Dense(CLASSES, name="out")(h))

    rng = np.random.default_rng(0)
    data = [({"a": rng.normal(size=(BATCH, 4)).astype(np.float32),
              "b": rng.normal(size=(BATCH, 2)).astype(np.float32)},
             rng.integers(0, CLASSES, BATCH)) for _ in range(3)]
    want, model = two_inputs(), two_inputs()
    want.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(0.01))
    for x, y in data:
        want.train_on_batch(x, y)
        res = trainer.step(hostavg.split((x, y), 16))
    assert [m.size for m in res.micro] == [16, 16, 8]
    assert_close([v.numpy() for v in model.variables], [v.numpy() for v in want.variables], 1e-5)


def test_batch_norm_statistics_update_per_micro_batch_and_a_failed_step_restores_them():
    data = batches(5, 2, BATCH)
    model = build(batch_norm=True, dropout=True, frozen=True)
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(0.01))
    twin = build(batch_norm=True, dropout=True, frozen=True)
    micro = hostavg.split(xy(data[0]), 10)
    for x, _ in micro:  # Keras's own training-mode calls, one per micro-batch
        twin(x, training=True)
    trainer.step(micro)
    bn, twin_bn = model.get_layer("bn"), twin.get_layer("bn")
    np.testing.assert_allclose(bn.moving_mean.numpy(), twin_bn.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), twin_bn.moving_variance.numpy(),
                               rtol=1e-6)
    rollback = {v.path for v in trainer.rollback_variables}
    # Not the frozen backbone; the dropout's seed state is named by a process-wide counter.
    assert {p for p in rollback if p.startswith("bn/")} == {"bn/moving_mean", "bn/moving_variance"}
    (seed,) = rollback - {"bn/moving_mean", "bn/moving_variance"}
    assert seed.endswith("/seed_generator_state"), rollback

    before = [v.numpy() for v in model.variables + trainer.optimizer.variables]
    x, y = xy(data[1])
    x = x.copy()
    x[33, 2] = np.nan
    with pytest.raises(hostavg.HostavgError,
                       match=r"^step, micro-batch 3 of 4 \(samples 30:40\): non-finite gradients "
                             r"in 'hidden/kernel' .* and the loss is nan\. Nothing was applied"):
        trainer.step(hostavg.split((x, y), 10))
    after = [v.numpy() for v in model.variables + trainer.optimizer.variables]
    for u, v in zip(before, after):
        np.testing.assert_array_equal(u, v)


def test_the_first_step_restores_what_it_assigned_too():
    """The rollback set is learnt while the first step prepares, before anything runs."""
    model = build(batch_norm=True)
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(0.01))
    x, y = xy(batches(6, 1, BATCH)[0])
    x = x.copy()
    x[-1, 0] = np.inf
    before = [v.numpy() for v in model.variables]
    with pytest.raises(hostavg.HostavgError, match="micro-batch 3 of 4"):
        trainer.step(hostavg.split((x, y), 10))
    for u, v in zip(before, model.variables):
        np.testing.assert_array_equal(u, v.numpy())


def test_stack_mode_keeps_each_micro_batch_and_stats_use_them():
    model = build()
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.SGD(0.1), accumulate="stack",
                                    accum_dtype="float64")
    res = trainer.step(hostavg.split(xy(batches(8, 1, BATCH)[0]), 10))
    assert all(m.grads is not None for m in res.micro)
    assert all(v.dtype == np.float64 for v in res.grads.values())
    assert len(res.stats.cosines) == 4 and res.stats.gsnr is not None
    table = res.micro_table()
    assert list(table["size"]) == [10, 10, 10, 10]


def test_one_compiled_gradient_function_serves_every_micro_batch_size():
    model = build()
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.SGD(0.1))
    x, y = xy(batches(9, 1, BATCH)[0])
    for sizes in (EQUAL, UNEQUAL, (40,), (1, 39)):
        trainer.step([(x[s], y[s]) for s in cuts(BATCH, sizes)])
    assert len(trainer._backend._computes) == 1
    trainer.step([(x[:20].astype(np.float64), y[:20])])  # another dtype: another function
    assert len(trainer._backend._computes) == 2


# --- Checkpoints, fit, evaluate --------------------------------------------------------------


def test_save_and_restore_round_trip_into_a_model_keras_named_differently(tmp_path):
    data = batches(10, 3, BATCH)
    a = build(names=False)
    ta = hostavg.keras.Trainer(a, loss(), keras.optimizers.Adam(0.01))
    for d in data[:2]:
        ta.step(hostavg.split(xy(d), 10))
    ta.save(tmp_path / "ck.npz")
    b = build(names=False)  # the same layers under Keras's next automatic names
    assert [v.path for v in b.variables] != [v.path for v in a.variables]
    tb = hostavg.keras.Trainer(b, loss(), keras.optimizers.Adam(0.01))
    assert tb.restore(tmp_path / "ck.npz") is None
    assert_close(values(b, tb.optimizer), values(a, ta.optimizer), atol=0)
    ra, rb = (t.step(hostavg.split(xy(data[2]), 10)) for t in (ta, tb))
    assert ra.step == rb.step == 3
    assert_close(values(b, tb.optimizer), values(a, ta.optimizer), atol=0)

    other = build(batch_norm=True)
    with pytest.raises(hostavg.HostavgError, match="was written by a different model: missing"):
        hostavg.keras.Trainer(other, loss(), keras.optimizers.Adam(0.01)).restore(
            tmp_path / "ck.npz")


def test_fit_equals_a_loop_of_steps_and_evaluate_equals_keras_evaluate(tmp_path):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(250, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)
    model = build()
    model.compile(metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(0.01))
    history = trainer.fit(x, y, batch_size=96, micro_batch_size=32, epochs=2, shuffle=False,
                          validation_data=(x[:50], y[:50]), progress=False)
    assert [s.size for s in history.steps] == [96, 96, 58] * 2
    assert [s.step for s in history.steps] == list(range(1, 7))
    assert {"val_loss", "val_accuracy"} <= set(history.epochs[-1])

    twin = build()
    twin_trainer = hostavg.keras.Trainer(twin, loss(), keras.optimizers.Adam(0.01))
    for _ in range(2):
        for start in range(0, 250, 96):
            twin_trainer.step(hostavg.split((x[start:start + 96], y[start:start + 96]), 32))
    for u, v in zip(model.variables, twin.variables):
        np.testing.assert_array_equal(u.numpy(), v.numpy())

    got = trainer.evaluate(x, y, batch_size=64)
    twin.compile(loss=loss(), metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    want = twin.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-7)
    assert history.epochs[-1]["val_loss"] == pytest.approx(
        trainer.evaluate(x[:50], y[:50], batch_size=32)["loss"], rel=1e-12)


def test_fit_resumes_from_its_checkpoints_bit_for_bit(tmp_path):
    rng = np.random.default_rng(12)
    x = rng.normal(size=(200, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def run(epochs, ckpt=None, trainer=None):
        if trainer is None:
            trainer = hostavg.keras.Trainer(build(names=False), loss(), keras.optimizers.Adam(0.01))
        trainer.fit(x, y, batch_size=64, micro_batch_size=16, epochs=epochs, seed=3,
                    progress=False, checkpoint_dir=ckpt)
        return trainer

    straight = run(3)
    run(1, tmp_path / "ck")
    resumed = run(3, tmp_path / "ck")
    assert len(list((tmp_path / "ck").iterdir())) == 3  # the start, after epoch 1, the end
    assert_close(values(resumed.model, resumed.optimizer),
                 values(straight.model, straight.optimizer), atol=0)


# --- Errors ---------------------------------------------------------------------------------


def test_constructor_errors():
    model = build()
    with pytest.raises(hostavg.HostavgError, match="model must be a keras.Model, got str"):
        hostavg.keras.Trainer("model", loss(), keras.optimizers.Adam())
    with pytest.raises(hostavg.HostavgError, match="optimizer must be a keras.optimizers.Optimizer"
                                                   ".* got AdamOptimizer; a tf.compat.v1"):
        hostavg.keras.Trainer(model, loss(), tf.compat.v1.train.AdamOptimizer(0.1))
    with pytest.raises(hostavg.HostavgError, match="gradient_accumulation_steps=4, but hostavg "
                                                   "accumulates on the host"):
        hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(gradient_accumulation_steps=4))
    with pytest.raises(hostavg.HostavgError, match="gradient_accumulation_steps=2, but hostavg "
                                                   "accumulates on the host"):
        hostavg.keras.Trainer(model, loss(), keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(gradient_accumulation_steps=2)))
    summed = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    with pytest.raises(hostavg.HostavgError, match=re.escape(
            "has reduction='sum', but hostavg needs the micro-batch MEAN")):
        hostavg.keras.Trainer(model, summed, keras.optimizers.Adam())
    with pytest.raises(hostavg.HostavgError, match=r"loss must be a keras.losses.Loss, a loss's "
                                                   r"name .* or a dict or list of them per "
                                                   r"output; got 42"):
        hostavg.keras.Trainer(model, {"out": 42}, keras.optimizers.Adam())
    with pytest.raises(hostavg.HostavgError, match="optimizer 'adamm' is not the name of a Keras "
                                                   "optimizer"):
        hostavg.keras.Trainer(model, loss(), "adamm")
    with pytest.raises(hostavg.HostavgError, match="optimizer: model 'functional.*' is not "
                                                   "compiled with one and none was given"):
        hostavg.keras.Trainer(build(), loss())
    with pytest.raises(hostavg.HostavgError, match=r"accumulate must be one of \('sum', 'stack'\)"):
        hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(), accumulate="mean")
    with pytest.raises(hostavg.HostavgError, match="accum_dtype must be a floating-point"):
        hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(), accum_dtype="int8")


def test_batch_errors_name_the_micro_batch_and_change_nothing():
    model = build()
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.Adam(0.01))
    with pytest.raises(hostavg.HostavgError, match=r"trainer.spec needs the trained variables, "
                                                   r"which the trainer learns from the first batch"):
        trainer.spec
    with pytest.raises(hostavg.HostavgError, match="accumulator"):
        trainer.accumulator()
    x, y = xy(batches(13, 1, BATCH)[0])
    with pytest.raises(hostavg.HostavgError, match=r"step takes a list of batches, one per "
                                                   r"micro-batch, got one batch .*hostavg\.split"):
        trainer.step((x, y))
    with pytest.raises(hostavg.HostavgError, match="step got no micro-batches"):
        trainer.step([])
    trainer.step(hostavg.split((x, y), 20))
    with pytest.raises(hostavg.HostavgError, match=r"step takes a list of \(x, y\) batches, one "
                                                   r"per micro-batch, got dict"):
        trainer.step({"x": x, "y": y})
    before = [v.numpy() for v in model.variables + trainer.optimizer.variables]
    bad = hostavg.split((x, y), 10)
    bad[2] = (np.ones((10, 5), np.float32), y[:10])
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 2 of 4: the model cannot "
                                                   r"run on this batch \(ValueError: Input 0 .*"
                                                   r"expected shape=\(None, 6\), found shape="
                                                   r"\(None, 5\)\); check its x and y"):
        trainer.step(bad)
    with pytest.raises(hostavg.HostavgError, match=r"micro-batch 1 of 2: arrays have different "
                                                   r"lengths along axis 0"):
        trainer.step([(x[:10], y[:10]), (x[:10], y[:9])])
    with pytest.raises(hostavg.HostavgError, match=r"a batch is a tuple \(x, y\) or \(x, y, "
                                                   r"sample_weight\), got dict"):
        trainer.step([{"x": x, "y": y}])
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 1: 40 samples hold "
                                                   r"a target out of range .*\n  sample 0 of the "
                                                   r"batch: y holds 7; .* 3 classes \(0\.\.2\)"):
        trainer.step([(x, np.full(BATCH, 7))])  # a label past the 3 classes, refused on the host
    own = hostavg.keras.Trainer(build(), lambda y, logits: keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True), keras.optimizers.Adam(0.01))  # a function: not checked
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 1 \(samples 0:40\): "
                                                   r"TensorFlow refused the compute \("
                                                   r"InvalidArgumentError: .*\); check that "
                                                   r"micro-batch's x and y"):
        own.step([(x, np.full(BATCH, 7))])
    with pytest.raises(hostavg.HostavgError, match=r"^check: the batch holds no array of samples to "
                                                   r"cut into micro-batches \(arrays of 0 samples\)\. "
                                                   r"check runs one batch whole and in micro-batches: "
                                                   r"give it x and y of at least one sample each"):
        trainer.check(x[:0], y[:0], micro_batch_size=10)
    g = {name: np.array(v) for name, v in trainer.compute(x, y).items()}
    del g["out/bias"]
    with pytest.raises(hostavg.HostavgError, match=re.escape("missing ['out/bias']")):
        trainer.apply(g)
    after = [v.numpy() for v in model.variables + trainer.optimizer.variables]
    for u, v in zip(before, after):
        np.testing.assert_array_equal(u, v)


def test_a_plain_callable_loss_is_reduced_as_keras_reduces_it():
    """A function's per-sample losses are averaged over the micro-batch (weighted by sample
    weights), as compile's sum_over_batch_size does; one giving the mean already works too."""
    def per_sample(y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    def mean_loss(y_true, y_pred):
        return keras.ops.mean(per_sample(y_true, y_pred))

    rng = np.random.default_rng(14)
    data = [{**d, "w": rng.uniform(0.1, 2.0, BATCH).astype(np.float32)}
            for d in batches(14, 2, BATCH)]
    a, b, c = build(), build(), build()
    ta = hostavg.keras.Trainer(a, mean_loss, keras.optimizers.Adam(0.01))
    tb = hostavg.keras.Trainer(b, loss(), keras.optimizers.Adam(0.01))
    tc = hostavg.keras.Trainer(c, per_sample, keras.optimizers.Adam(0.01))
    for d in data:
        ta.step(hostavg.split(xy(d), 10))
        tb.step(hostavg.split((*xy(d), d["w"]), 10))
        tc.step(hostavg.split((*xy(d), d["w"]), 10))
    want = keras_steps("adam", data)
    assert_close([v.numpy() for v in b.variables], [v.numpy() for v in want.variables], atol=1e-5)
    assert_close([v.numpy() for v in c.variables], [v.numpy() for v in b.variables], atol=1e-6)
    unweighted = keras_steps("adam", [{k: v for k, v in d.items() if k != "w"} for d in data])
    assert_close([v.numpy() for v in a.variables], [v.numpy() for v in unweighted.variables],
                 atol=1e-5)


def test_validation_data_of_the_wrong_shape_is_refused_before_training():
    """Issue 24 item 13: it was found after a whole epoch trained."""
    model = build()
    trainer = hostavg.keras.Trainer(model, loss(), keras.optimizers.SGD(0.1))
    x, y = xy(batches(0, 1, BATCH)[0])
    before = [v.numpy() for v in model.variables]
    with pytest.raises(hostavg.HostavgError, match=r"^fit, validation_data: "):
        trainer.fit(x, y, batch_size=20, micro_batch_size=10, progress=False,
                    validation_data=(x[:, :2], y))
    for u, v in zip(before, model.variables):
        np.testing.assert_array_equal(u, v.numpy())


# --- The Keras face's batches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras_trainer():
    import keras
    import hostavg.keras
    return hostavg.keras.Trainer(keras_model(), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))


def test_keras_refuses_ragged_lists_naming_them(keras_trainer):
    # ValueError: setting an array element with a sequence (NumPy's own).
    with pytest.raises(hostavg.HostavgError, match=r"^compute: x cannot be made an array "
                                                   r"\(setting an array element"):
        keras_trainer.compute([[1.0] * 6, [1.0] * 5], np.zeros(2, np.int32))


def test_keras_refuses_complex_inputs_as_the_tf1_face_does(keras_trainer):
    # Cast to float32 silently, imaginary part dropped.
    x = np.ones((4, 6), np.complex64) * 1j
    with pytest.raises(hostavg.HostavgError, match=r"^compute: x holds complex values \(complex64\), "
                                                   r"whose imaginary part the model would drop; "
                                                   r"pass real arrays$"):
        keras_trainer.compute(x, np.zeros(4, np.int32))


def test_keras_multi_output_model_with_one_target_array_says_so():
    # "Structures don't have the same nested structure" / "Expected any non-tensor type".
    # Compiled with one loss, a two-output model needs a target per output, as in Keras.
    import keras
    import hostavg.keras
    x = keras.Input((6,))
    model = keras.Model(x, [keras.layers.Dense(3)(x), keras.layers.Dense(3)(x)])
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))
    with pytest.raises(hostavg.HostavgError, match=r"^compute: the model cannot run on this batch "
                                                   r"\(KeyError: .*in the `loss` argument.*\); "
                                                   r"check its x and y against the model's inputs "
                                                   r"and the loss$"):
        trainer.compute(np.ones((4, 6), np.float32), np.zeros(4, np.int32))


# --- fit checks what it is given before an epoch trains (item 13) -------------------------------


def test_keras_input_of_the_wrong_width_names_the_layer_not_keras_arguments():
    # "(ValueError: • kwargs=<class 'inspect._empty'>)": the last line of Keras's arguments.
    import keras
    import hostavg.keras
    model = keras.Sequential([keras.layers.Dense(8, name="first"), keras.layers.Dense(3)])
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))
    y = np.zeros(8, np.int32)
    trainer.compute(np.ones((8, 6), np.float32), y)
    with pytest.raises(hostavg.HostavgError, match=r"^compute: the model cannot run on this batch "
                       r"\(ValueError: Input 0 with name 'None' of layer 'first' is incompatible "
                       r"with the layer: expected axis -1 of input shape to have value 6, but "
                       r"received input with shape \(None, 4\)\); check its x and y"):
        trainer.compute(np.ones((8, 4), np.float32), y)
