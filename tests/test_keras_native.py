"""hostavg.keras as a Keras user drives it, against Keras's own fit, train_on_batch and evaluate
on a twin model (the same initial weights): compile, fit's arguments and data, Keras callbacks,
the History, mixed precision, distribution strategies, evaluation metrics (issue 20); on
Keras's TensorFlow backend, and on JAX (CI's KERAS_BACKEND=jax step runs it there, .ci/run)."""

import csv
import itertools
import re
import warnings

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from models import CLASSES, FEATURES, HIDDEN, FailAt
from models import keras_model as build

import hostavg
import hostavg.keras

N, BATCH, MICRO = 200, 64, 16
#: This file runs on Keras's TensorFlow backend, and on JAX (.ci/run).
ON_TENSORFLOW = keras.backend.backend() == "tensorflow"


def logits_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(model=None, **kw):
    """``model`` (default: the MLP of tests/models.py) compiled as a Keras user would."""
    model = build() if model is None else model
    model.compile(**{"optimizer": keras.optimizers.Adam(0.01), "loss": logits_loss(),
                     "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")], **kw})
    return model


def data(seed=0, n=N):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    return x, y


def weights(model) -> list:
    return [v.numpy() for v in model.variables]


def assert_close(got: list, want: list, atol: float = 1e-5):
    assert len(got) == len(want)
    worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(got, want))
    assert worst <= atol, worst


def assert_history(got: dict, want: dict, rel: float = 1e-5):
    """Keras's History.history against ours: the same names, one value per epoch, equal."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=rel, abs=1e-6), name


# --- 1. The model as compiled ------------------------------------------------------------------


def two_outputs(seed=0):
    """A functional model with two named outputs: a class ("label") and a number ("size")."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(HIDDEN, activation="tanh", name="hidden")(x)
    return keras.Model(x, {"label": keras.layers.Dense(CLASSES, name="label")(h),
                           "size": keras.layers.Dense(1, name="size")(h)})


def two_outputs_compiled(seed=0):
    model = two_outputs(seed)
    model.compile(optimizer="adam",
                  loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "size": "mse"},
                  loss_weights={"label": 2.0, "size": 0.5},
                  metrics={"label": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
                           "size": ["mae"]})
    return model


def test_a_compiled_model_trains_with_its_strings_dicts_and_loss_weights_as_keras_fit():
    """Every batch and micro-batch of one size: Keras weights each output's loss tracker by the
    batch's static size, which a function traced for any size does not know (Keras's own
    counts a batch of another size, traced anew with the size open, once)."""
    x, y = data(1, n=256)
    targets = {"label": y, "size": x[:, :1] * 2.0}
    val = (x[:40], {"label": y[:40], "size": x[:40, :1] * 2.0})
    twin = two_outputs_compiled()
    want = twin.fit(x, targets, batch_size=BATCH, epochs=2, shuffle=False, validation_data=val,
                    validation_batch_size=BATCH, verbose=0)
    model = two_outputs_compiled()
    trainer = hostavg.keras.Trainer(model)
    assert isinstance(trainer.optimizer, keras.optimizers.Adam) and trainer.loss is model.loss
    history = trainer.fit(x, targets, batch_size=BATCH, micro_batch_size=MICRO, epochs=2,
                          shuffle=False, validation_data=val, validation_batch_size=BATCH,
                          verbose=0)
    assert_history(history.history, want.history)
    assert history.epoch == want.epoch == [0, 1]
    assert_close(weights(model), weights(twin))
    assert int(model.optimizer.iterations.numpy()) == int(twin.optimizer.iterations.numpy()) == 8
    assert {"label_loss", "size_loss", "label_acc", "size_mae", "val_size_mae"} <= set(
        history.history)


def regularized(seed=0):
    keras.utils.set_random_seed(seed)
    return compiled(keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="tanh",
                           kernel_regularizer=keras.regularizers.L2(0.1)),
        keras.layers.Dense(CLASSES, bias_regularizer=keras.regularizers.L1(0.05))]))


def test_weight_regularizers_train_as_keras_fit_and_per_sample_vectorizes():
    """A regularizer reads its variable in the scope hostavg builds the loss and metrics in
    (on JAX that scope had no values: every compute failed "the model cannot run on this
    batch"). The step is Keras's own, regularization included; per_sample computes without
    falling back (a sample alone's loss has the whole regularization, as Keras's has)."""
    x, y = data(2, n=128)
    twin = regularized()
    want = twin.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = regularized()
    history = hostavg.keras.Trainer(model).fit(x, y, batch_size=BATCH, micro_batch_size=MICRO,
                                               epochs=2, shuffle=False, verbose=0)
    assert_history(history.history, want.history)
    assert_close(weights(model), weights(twin))
    trainer = hostavg.keras.Trainer(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        table = trainer.per_sample(x[:6], y[:6], chunk_size=4)
    alone = [trainer.compute(x[i:i + 1], y[i:i + 1]) for i in range(6)]
    np.testing.assert_allclose(table["loss"], [g.loss for g in alone], rtol=1e-6)

def test_explicit_arguments_win_and_the_compiled_metrics_stay():
    x, y = data(2)
    model = compiled(optimizer="sgd", loss="mse")
    trainer = hostavg.keras.Trainer(model, logits_loss(), keras.optimizers.Adam(0.01))
    assert model.optimizer is trainer.optimizer and isinstance(trainer.optimizer,
                                                               keras.optimizers.Adam)
    history = trainer.fit(x, y, batch_size=BATCH, micro_batch_size=MICRO, shuffle=False,
                          verbose=0)
    twin = compiled()
    want = twin.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert_history(history.history, want.history)
    assert_close(weights(model), weights(twin))
    strings = hostavg.keras.Trainer(build(), "sparse_categorical_crossentropy", "rmsprop")
    assert isinstance(strings.optimizer, keras.optimizers.RMSprop)


def test_a_refused_loss_or_optimizer_leaves_the_compiled_model_as_it_was():
    """What the model keeps from compile is checked before it is compiled again."""
    model = compiled(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                      reduction="sum"))
    optimizer, loss = model.optimizer, model.loss
    with pytest.raises(hostavg.HostavgError, match=r"reduction='sum'"):
        hostavg.keras.Trainer(model, optimizer=keras.optimizers.SGD(0.1))
    assert model.optimizer is optimizer and model.loss is loss
    model = compiled(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2))
    optimizer = model.optimizer
    with pytest.raises(hostavg.HostavgError, match="gradient_accumulation_steps=2"):
        hostavg.keras.Trainer(model, loss=logits_loss())
    assert model.optimizer is optimizer


def test_an_ema_optimizer_ends_fit_with_its_averages_as_keras_fit_without_callbacks():
    """Keras's fit finalizes the optimizer's variable values at its end, whatever its callbacks:
    an EMA optimizer's averages become the weights."""
    x, y = data(3)

    def make():
        return compiled(optimizer=keras.optimizers.Adam(0.01, use_ema=True))
    model, twin = make(), make()
    hostavg.keras.Trainer(model).fit(x, y, batch_size=BATCH, micro_batch_size=MICRO,
                                     shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert_close(weights(model), weights(twin))


def test_an_uncompiled_model_is_compiled_so_save_load_evaluate_and_predict_work(tmp_path):
    x, y = data(3)
    model = build()
    trainer = hostavg.keras.Trainer(model, logits_loss(), keras.optimizers.Adam(0.01))
    assert model.compiled and model.optimizer is trainer.optimizer
    trainer.fit(x, y, batch_size=BATCH, micro_batch_size=MICRO, epochs=2, verbose=0)
    model.save(tmp_path / "model.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(tmp_path / "model.keras")
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)], caught
    assert int(loaded.optimizer.iterations.numpy()) == 8
    assert_close(weights(loaded.optimizer), weights(model.optimizer), atol=0)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    assert loaded.evaluate(x, y, verbose=0) == pytest.approx(trainer.evaluate(x, y)["loss"],
                                                              rel=1e-6)


def test_compile_with_metrics_only_saves_the_optimizer_that_trained(tmp_path):
    """The README's way: compile(metrics=...) (so compile's default RMSprop), then the trainer's
    loss and Adam: model.save keeps the Adam, not the RMSprop nothing trained."""
    x, y = data(4)
    model = build()
    model.compile(metrics=["accuracy"])
    trainer = hostavg.keras.Trainer(model, logits_loss(), keras.optimizers.Adam(0.01))
    trainer.fit(x, y, batch_size=BATCH, micro_batch_size=MICRO, verbose=0)
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)], caught
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 4


class PenalisedLoss(keras.Model):
    """Keras's customisation point: compute_loss, here the compiled loss plus a weight penalty
    and a running metric the loss updates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.penalty = keras.metrics.Mean(name="penalty")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        penalty = 0.01 * keras.ops.sum(keras.ops.square(self.trainable_weights[0]))
        self.penalty.update_state(penalty)
        return loss + penalty


def penalised(seed=0):
    twin = build(seed)
    return PenalisedLoss(twin.inputs, twin.outputs)


def test_a_model_overriding_compute_loss_is_trained_through_it():
    x, y = data(5)
    model, twin = compiled(penalised()), compiled(penalised())
    trainer = hostavg.keras.Trainer(model)
    for start in range(0, N, BATCH):
        twin.train_on_batch(x[start:start + BATCH], y[start:start + BATCH])
        trainer.step(hostavg.split((x[start:start + BATCH], y[start:start + BATCH]), MICRO))
    assert_close(weights(model), weights(twin))


@pytest.mark.parametrize("loss", [logits_loss(), "sparse_categorical_crossentropy"],
                         ids=["Loss", "string"])
def test_a_target_out_of_range_is_refused_before_any_compute_naming_its_data_row(loss):
    """Keras's own fit fails inside the compute on TensorFlow, naming no sample, and trains on
    it silently on JAX; hostavg refuses it on the host on both, and nothing changes."""
    x, y = data(7)
    y[9] = 15  # of 3 classes
    model = compiled(loss=loss)
    trainer = hostavg.keras.Trainer(model)
    before = weights(model)
    with pytest.raises(hostavg.HostavgError) as e:  # one step of all N samples, shuffled
        trainer.fit(x, y, batch_size=N, micro_batch_size=MICRO, seed=3, verbose=0)
    assert list(e.value.culprit_rows) == [9]
    said = f"data row 9: y holds 15; the model's output '{model.output_names[0]}' has 3 " \
           f"classes (0..2)"
    assert "1 sample holds a target out of range of its sparse categorical loss" in str(e.value)
    assert said in str(e.value), str(e.value)
    assert_close(weights(model), before, atol=0)  # the optimizer's iterations too: 0
    assert int(model.optimizer.iterations.numpy()) == 0

    y[[20, 30, 41]] = [-1, 3, 5]  # micro-batch 1 of 4
    with pytest.raises(hostavg.HostavgError) as e:  # no data rows: places in the batch
        trainer.step(hostavg.split((x[16:64], y[16:64]), MICRO))
    assert str(e.value).startswith("step, micro-batch 0 of 3: 2 samples hold")  # the first
    assert [(c.sample, c.row) for c in e.value.culprits] == [(4, None), (14, None)]  # 20, 30
    assert e.value.culprit_rows == [] and "sample 4 of the batch: y holds -1" in str(e.value)
    assert_close(weights(model), before, atol=0)
    y[[9, 20, 30, 41]] = [2, 2, 0, 1]
    trainer.step(hostavg.split((x[:64], y[:64].astype(np.float32)), MICRO))  # floats as Keras


def test_only_the_targets_of_a_sparse_loss_are_checked_each_against_its_output():
    """Two outputs: only "label"'s sparse loss checks its targets (against its 3 classes), with
    its ignore_class allowed; "size"'s mse takes any number."""
    x, y = data(8, n=64)
    model = two_outputs()
    model.compile(optimizer="adam", loss={
        "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1),
        "size": "mse"})
    trainer = hostavg.keras.Trainer(model)
    y[5] = -1
    trainer.compute(x, {"label": y, "size": x[:, :1] * 100.0})
    y[7] = 3
    with pytest.raises(hostavg.HostavgError, match=r"compute: 1 sample holds .*\n  sample 7 of "
                                                   r"the batch: y\['label'\] holds 3; the model's "
                                                   r"output 'label' has 3 classes \(0\.\.2, and "
                                                   r"ignore_class -1\)$"):
        trainer.compute(x, {"label": y, "size": x[:, :1]})


# --- 2. fit's arguments and data -----------------------------------------------------------


def fit_pair(x, y=None, *, keras_x=None, keras_y=None, epochs=2, keras_kw=None, **kw):
    """(our History and model, Keras's History and twin) after fitting the same data alike."""
    twin = compiled()
    want = twin.fit(x if keras_x is None else keras_x, y if keras_y is None else keras_y,
                    epochs=epochs, verbose=0, **{**kw, **(keras_kw or {})})
    model = compiled()
    trainer = hostavg.keras.Trainer(model)
    got = trainer.fit(x, y, micro_batch_size=MICRO, epochs=epochs, verbose=0, **kw)
    return got, model, want, twin


def test_fit_without_batch_size_takes_keras_default_of_32():
    x, y = data(6)
    got, model, want, twin = fit_pair(x, y, shuffle=False)
    assert [s.size for s in got.steps[:7]] == [32] * 6 + [8]
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


@pytest.mark.parametrize("kind", ["pandas", "tensors"])
def test_pandas_and_tensors_train_as_the_arrays_they_hold(kind):
    x, y = data(7)
    if kind == "pandas":
        fx, fy = pd.DataFrame(x, columns=list("abcdef")), pd.Series(y)
    else:
        fx, fy = tf.constant(x), tf.constant(y)
    arrays = hostavg.keras.Trainer(compiled()).fit(x, y, batch_size=BATCH, micro_batch_size=MICRO,
                                                   seed=1, verbose=0)
    model = compiled()
    other = hostavg.keras.Trainer(model).fit(fx, fy, batch_size=BATCH, micro_batch_size=MICRO,
                                             seed=1, verbose=0)
    assert [s.loss for s in other.steps] == [s.loss for s in arrays.steps]


def dataset(x, y, batch=BATCH):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch=BATCH):
        super().__init__()
        self.x, self.y, self.batch, self.epochs_ended = x, y, batch, 0

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        return self.x[i * self.batch:(i + 1) * self.batch], self.y[i * self.batch:(i + 1) * self.batch]

    def on_epoch_end(self):
        self.epochs_ended += 1


def test_a_tf_data_dataset_gives_one_step_per_element_as_keras_fit():
    x, y = data(8)
    got, model, want, twin = fit_pair(dataset(x, y), validation_data=dataset(x[:50], y[:50], 20))
    assert [s.size for s in got.steps] == [64, 64, 64, 8] * 2
    assert len(got.steps[0].micro_norms) == 4
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_a_py_dataset_gives_one_step_per_batch_in_a_seeded_order():
    x, y = data(9)
    got, model, want, twin = fit_pair(Batches(x, y), shuffle=False)
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))
    ordered = Batches(x, y)
    hostavg.keras.Trainer(compiled()).fit(ordered, micro_batch_size=MICRO, epochs=2, verbose=0)
    assert ordered.epochs_ended == 2  # after each pass
    a, b = (hostavg.keras.Trainer(compiled()).fit(Batches(x, y), micro_batch_size=MICRO, seed=5,
                                                  epochs=2, verbose=0) for _ in range(2))
    assert [s.loss for s in a.steps] == [s.loss for s in b.steps]
    assert [s.size for s in a.steps] != [64, 64, 64, 8] * 2  # shuffled: the short one moves


def test_class_weight_and_validation_split_as_keras_fit():
    x, y = data(10)
    got, model, want, twin = fit_pair(x, y, batch_size=BATCH, shuffle=False,
                                      class_weight={0: 0.5, 1: 2.0, 2: 1.0}, validation_split=0.25)
    assert sum(s.size for s in got.steps) == 2 * 150
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_steps_per_epoch_continues_the_data_and_ends_an_epoch_where_it_does_as_keras():
    """200 samples in batches of 64 are 4 batches: epochs of 3 steps take 3, then the last
    (the data ends there), then 3 of a new pass."""
    x, y = data(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's "Your input ran out of data"
        got, model, want, twin = fit_pair(x, y, batch_size=BATCH, shuffle=False, epochs=3,
                                          steps_per_epoch=3)
    assert [len([s for s in got.steps if s.epoch == e]) for e in range(3)] == [3, 1, 3]
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_initial_epoch_and_an_endless_dataset_with_steps_per_epoch():
    x, y = data(12)
    endless = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
    got, model, want, twin = fit_pair(endless, epochs=4, initial_epoch=2, steps_per_epoch=5)
    assert got.epoch == want.epoch == [2, 3]
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_an_endless_dataset_without_steps_per_epoch_is_refused_before_anything_changes():
    """Refused before a batch is read: the weights, the step, and the dataset's reshuffles are
    as they were, so fitting it then with steps_per_epoch trains as Keras's fit does."""
    x, y = data(12)

    def endless():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=4).repeat().batch(BATCH)

    model, ds = compiled(), endless()
    before = weights(model)
    trainer = hostavg.keras.Trainer(model, micro_batch_size=MICRO)
    with pytest.raises(hostavg.HostavgError, match=r"^the data never ends \(a dataset of infinite "
                                                   r"cardinality.*; pass steps_per_epoch="):
        trainer.fit(ds, epochs=2, verbose=0)
    assert int(model.optimizer.iterations) == 0
    assert_close(weights(model), before, atol=0)
    ours, theirs = BatchLosses(), BatchLosses()
    trainer.fit(ds, epochs=2, steps_per_epoch=5, verbose=0, callbacks=[ours])
    twin = compiled()
    twin.fit(endless(), epochs=2, steps_per_epoch=5, verbose=0, callbacks=[theirs])
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=1e-5)
    assert_close(weights(model), weights(twin))


def reshuffled(n=N, seed=3):
    """A dataset that reshuffles on every iterator, seeded: each pass another order."""
    x, y = data(20)
    return tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).shuffle(n, seed=seed).batch(BATCH)


def per_batch(running: list, sizes: list) -> list:
    """Each batch's own loss, from one epoch's running means as fit reports them (Keras's loss
    tracker weighs each batch by its samples)."""
    totals = [mean * seen for mean, seen in zip(running, itertools.accumulate(sizes))]
    return [(total - before) / n for total, before, n in zip(totals, [0.0, *totals[:-1]], sizes)]


@pytest.mark.parametrize("kw", [{}, {"steps_per_epoch": 3}, {"validation_steps": 2}],
                         ids=["passes", "steps_per_epoch", "validation_steps"])
def test_a_reshuffling_dataset_trains_in_the_order_keras_fit_reads_it(kw):
    """Over 3 epochs, each batch's loss as in Keras's fit (Keras opens an iterator per pass,
    and more: hostavg opens the same ones); validation on a reshuffling dataset too."""
    theirs = BatchLosses()
    twin = compiled(optimizer=keras.optimizers.SGD(0.1))
    want = twin.fit(reshuffled(), epochs=3, verbose=0, callbacks=[theirs],
                    validation_data=reshuffled(150, 5), **kw)
    model = compiled(optimizer=keras.optimizers.SGD(0.1))
    got = hostavg.keras.Trainer(model, micro_batch_size=MICRO).fit(
        reshuffled(), epochs=3, verbose=0, validation_data=reshuffled(150, 5), **kw)
    epochs = [[s for s in got.steps if s.epoch == e] for e in range(3)]
    running = [theirs.losses[sum(map(len, epochs[:e])):][:len(epochs[e])] for e in range(3)]
    keras_losses = [loss for e in range(3)
                    for loss in per_batch(running[e], [s.size for s in epochs[e]])]
    np.testing.assert_allclose([s.loss for s in got.steps], keras_losses, rtol=1e-4)
    assert_history(got.history, want.history, rel=1e-4)
    assert_close(weights(model), weights(twin))


@pytest.mark.parametrize("cut", [{"micro_batch_size": 16}, {"micro_batches": 3}],
                         ids=["micro_batch_size", "micro_batches"])
def test_a_published_fit_call_runs_unchanged_once_model_fit_is_the_trainers(tmp_path, cut):
    """``model.fit(ds, epochs=..., callbacks=[...], validation_data=val_ds)`` as keras-io
    programs write it; the one change: ``model.fit`` becomes ``Trainer(model, <cut>).fit``. The
    same History, weights and files as Keras's own fit, a reshuffling dataset included."""
    def published(fit, folder):
        folder.mkdir()
        return fit(reshuffled(), epochs=4, validation_data=reshuffled(150, 5), callbacks=[
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=2,
                                          restore_best_weights=True),
            keras.callbacks.ModelCheckpoint(str(folder / "best.keras"), save_best_only=True),
            keras.callbacks.CSVLogger(str(folder / "log.csv"))])

    twin, model = compiled(), compiled()
    want = published(twin.fit, tmp_path / "keras")
    got = published(hostavg.keras.Trainer(model, **cut).fit, tmp_path / "ours")
    assert_history(got.history, want.history, rel=1e-4)
    assert_close(weights(model), weights(twin))
    rows = [list(csv.DictReader(open(tmp_path / name / "log.csv"))) for name in ("ours", "keras")]
    assert [sorted(r) for r in rows[0]] == [sorted(r) for r in rows[1]]
    assert_close(weights(keras.models.load_model(tmp_path / "ours" / "best.keras")),
                 weights(keras.models.load_model(tmp_path / "keras" / "best.keras")))


class MicroSizes:
    """Each step's micro-batch sizes, as applied."""

    def __init__(self):
        self.sizes = []

    def on_applied(self, result):
        self.sizes.append([m.size for m in result.micro])


class EvaluatedChunks(keras.callbacks.Callback):
    """How many chunks each evaluation announces."""

    def __init__(self):
        super().__init__()
        self.chunks = 0

    def on_test_batch_begin(self, batch, logs=None):
        self.chunks += 1


def test_micro_batches_cut_each_batch_into_k_for_fit_its_validation_and_check():
    """micro_batches=3: 64 samples in 22, 21, 21, the last batch's 8 in 3, 3, 2 (as
    hostavg.split cuts them); validation in chunks of ceil(64 / 3) = 22; the same weights as
    Keras's fit; check cuts as fit does; fit's own micro_batch_size wins."""
    x, y = data(21)
    sizes, chunks = MicroSizes(), EvaluatedChunks()
    model, twin = compiled(), compiled()
    trainer = hostavg.keras.Trainer(model, micro_batches=3, hooks=[sizes])
    assert (trainer.micro_batch_size, trainer.micro_batches) == (None, 3)
    got = trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[chunks],
                      validation_data=(x[:50], y[:50]))
    want = twin.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                    validation_data=(x[:50], y[:50]))
    assert sizes.sizes == [[22, 21, 21]] * 3 + [[3, 3, 2]] and chunks.chunks == 3
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))
    assert trainer.check(x[:10], y[:10]).micro_batches == 3
    trainer.fit(x, y, batch_size=BATCH, micro_batch_size=32, verbose=0, epochs=1)
    assert sizes.sizes[-4:] == [[32, 32]] * 3 + [[8]]


def test_micro_batch_size_and_micro_batches_together_are_refused_naming_both():
    for cut in ({"micro_batch_size": 8, "micro_batches": 2}, {"micro_batches": 0}):
        with pytest.raises(hostavg.HostavgError, match="micro_batches"):
            hostavg.keras.Trainer(compiled(), **cut)
    with pytest.raises(hostavg.HostavgError, match=r"^give micro_batch_size or micro_batches, "
                                                   r"not both; got micro_batch_size=8, "
                                                   r"micro_batches=2$"):
        hostavg.keras.Trainer(compiled(), micro_batch_size=8, micro_batches=2)
    x, y = data(22)
    with pytest.raises(hostavg.HostavgError, match=r"micro_batches \(65\) is more than "
                                                   r"batch_size \(64\)"):
        hostavg.keras.Trainer(compiled(), micro_batches=65).fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(hostavg.HostavgError, match=r"fit needs micro_batch_size: .* or "
                                                   r"micro_batch_size or micro_batches to the "
                                                   r"trainer"):
        hostavg.keras.Trainer(compiled()).fit(x, y, verbose=0)


def shown(text: str) -> str:
    """What a progress display printed, with its colours, backspaces, numbers and time units
    masked: its layout."""
    text = re.sub(r"\x1b\[[0-9;]*m|\x08", "", text)
    return re.sub(r"N(ms|us|s)/step", "T/step", re.sub(r"\d+(\.\d+)?", "N", text))


def test_verbose_shows_keras_progress_bar_as_model_fit(capsys):
    """verbose=2: Keras's one line per epoch, as model.fit prints it; 1 and "auto": Keras's
    Progbar (steps, time per step, metrics); 0: nothing. hostavg's own display stays off."""
    x, y = data(13)
    kw = dict(batch_size=BATCH, epochs=2, validation_data=(x[:20], y[:20]))
    trainer = hostavg.keras.Trainer(compiled(), micro_batch_size=MICRO)
    trainer.fit(x, y, verbose=2, **kw)
    ours = capsys.readouterr()
    compiled().fit(x, y, verbose=2, **kw)
    assert ours.err == "" and shown(ours.out) == shown(capsys.readouterr().out)
    assert shown(ours.out).splitlines() == [
        "Epoch N/N", "N/N - Ns - T/step - accuracy: N - loss: N - val_accuracy: N - val_loss: N"] * 2
    for verbose in (1, "auto"):
        trainer.fit(x, y, verbose=verbose, **kw)
        out = capsys.readouterr().out
        assert out.startswith("Epoch 1/2\n") and "━" in out, out
        last = out.splitlines()[-1].split("\r")[-1]
        assert shown(last).startswith("N/N ━") and "4/4" in last and " - loss: " in last, last
        assert shown(last).endswith(" T/step - accuracy: N - loss: N - val_accuracy: N - "
                                    "val_loss: N"), last
    trainer.fit(x, y, verbose=0, **kw)
    assert capsys.readouterr() == ("", "")
    trainer.fit(x, y, verbose=1, progress="epoch", **kw)  # hostavg's own display, where asked
    assert capsys.readouterr().out.startswith("epoch 1/2: 4 steps in ")


def test_progress_always_swaps_keras_bar_for_hostavgs_with_norm_and_noise_scale(capsys):
    """The option: fit(progress="always") shows hostavg's bar (the last gradient norm, the
    running noise scale) in place of Keras's; History's keys stay Keras's."""
    x, y = data(13)
    kw = dict(batch_size=BATCH, epochs=2, validation_data=(x[:20], y[:20]))
    model = compiled()
    history = hostavg.keras.Trainer(model, micro_batch_size=MICRO).fit(x, y, progress="always",
                                                                       **kw)
    ours = capsys.readouterr()
    bars = [line.split("\r")[-1] for line in ours.err.split("\n") if line]
    assert ours.out == "" and len(bars) == 2 and "━" not in ours.err
    assert f"grad_norm={history.steps[-1].grad_norm:.4g}" in bars[-1] and "B_simple=" in bars[-1]
    keras_model = compiled()
    keras_model.fit(x, y, verbose=0, **kw)
    assert sorted(model.history.history) == sorted(keras_model.history.history)


def test_fit_argument_errors_are_found_before_training():
    x, y = data(14)
    trainer = hostavg.keras.Trainer(compiled())
    cases = [
        (dict(x=dataset(x, y), batch_size=32), "batch_size=32 with a .*Dataset, whose elements "
                                               "are the batches: leave batch_size None"),
        (dict(x=dataset(x, y), y=y), "y and sample_weight come from the"),
        (dict(x=dataset(x, y), validation_split=0.1), "validation_split needs arrays"),
        (dict(x=x, y=y, validation_split=1.5), r"validation_split must be a number in \[0, 1\)"),
        (dict(x=x, y=y, validation_data=(x[:5],)), "validation_data must be"),
        (dict(x=x, y=y, validation_data=(x[:5], y[:4])), "arrays have different lengths"),
        (dict(x=x, y=y, class_weight=[1, 2]), "class_weight must be a dict"),
        (dict(x=x, y=y, sample_weight=np.ones(N), class_weight={0: 1}), "class_weight and "
                                                                        "sample_weight together"),
        (dict(x=[x, x], y=y), r"^fit, data: the model cannot run on this batch \(ValueError: "
                              r".*2 input tensors"),  # two inputs, for a one-input model
        (dict(x=x, y=y, verbose=3), "verbose must be 'auto', 0, 1 or 2, got 3"),
        (dict(x=x, y=y, initial_epoch=-1), "initial_epoch must be an integer >= 0, got -1"),
        (dict(x=x, y=y, steps_per_epoch=0), "steps_per_epoch must be an integer >= 1, got 0"),
    ]
    before = weights(trainer.model)
    for kw, match in cases:
        with pytest.raises(hostavg.HostavgError, match=match):
            trainer.fit(micro_batch_size=MICRO, **{"batch_size": BATCH, **kw}
                        if not keras_data_kind(kw) else {**kw})
    assert_close(weights(trainer.model), before, atol=0)


def keras_data_kind(kw) -> bool:
    return isinstance(kw.get("x"), tf.data.Dataset)


def two_in_two_out():
    """Keras's most common multi-input, multi-output form: inputs and outputs in lists,
    compiled with a list of losses, loss weights and metrics per output."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="tanh", name="h")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], [keras.layers.Dense(3, name="label")(h),
                                 keras.layers.Dense(1, name="size")(h)])
    model.compile(optimizer="adam", loss=[logits_loss(), "mse"], loss_weights=[1.0, 0.5],
                  metrics=[["accuracy"], ["mae"]])
    return model


def test_lists_of_inputs_and_targets_train_as_keras_fit_takes_them():
    # Equal batches: Keras's own per-output losses ("label_loss") are means over batches, each
    # weighing 1 whatever its size (its evaluate gives other values with another batch_size).
    n = 3 * BATCH
    rng = np.random.default_rng(24)
    xa, xb = rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32)
    y1, y2 = rng.integers(0, 3, n).astype(np.int32), rng.normal(size=(n, 1)).astype(np.float32)
    model, twin = two_in_two_out(), two_in_two_out()
    trainer = hostavg.keras.Trainer(model)
    got = trainer.fit([xa, xb], [y1, y2], batch_size=BATCH, micro_batch_size=MICRO, epochs=2,
                      shuffle=False, verbose=0, validation_data=([xa, xb], (y1, y2)),
                      validation_batch_size=BATCH)
    want = twin.fit([xa, xb], [y1, y2], batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                    validation_data=([xa, xb], (y1, y2)))
    assert_close(weights(model), weights(twin))
    assert_history(got.history, want.history)
    # A tf.data pipeline of tuples, as keras-io's multi-input examples write it.
    model, twin = two_in_two_out(), two_in_two_out()
    pipeline = tf.data.Dataset.from_tensor_slices(((xa, xb), (y1, y2))).batch(BATCH)
    hostavg.keras.Trainer(model).fit(pipeline, micro_batch_size=MICRO, verbose=0)
    twin.fit(pipeline, verbose=0)
    assert_close(weights(model), weights(twin))
    # compute, check and evaluate take them too.
    assert trainer.compute([xa[:8], xb[:8]], [y1[:8], y2[:8]]).size == 8
    assert trainer.check([xa[:32], xb[:32]], [y1[:32], y2[:32]], micro_batch_size=8).ok
    assert trainer.evaluate([xa, xb], [y1, y2]) == pytest.approx(
        trainer.model.evaluate([xa, xb], [y1, y2], return_dict=True, verbose=0), rel=1e-6)


def test_validation_freq_steps_and_one_callback_alone_as_keras_fit():
    x, y = data(25)
    model, twin = compiled(), compiled()
    seen, want_seen = [], []

    def logger(into):
        return keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: into.append(sorted(logs)))
    got = hostavg.keras.Trainer(model).fit(
        x, y, batch_size=BATCH, micro_batch_size=MICRO, epochs=4, shuffle=False, verbose=0,
        validation_data=(x[:100], y[:100]), validation_batch_size=25, validation_steps=2,
        validation_freq=[2, 4], callbacks=logger(seen))
    want = twin.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                    validation_data=(x[:100], y[:100]), validation_batch_size=25,
                    validation_steps=2, validation_freq=[2, 4], callbacks=logger(want_seen))
    assert seen == want_seen  # validation at the end of epochs 2 and 4 only
    assert got.history["val_loss"][1::2] == pytest.approx(want.history["val_loss"], rel=1e-5)
    assert got.history["val_loss"][0::2] == [None, None]  # Keras's History leaves them out
    assert twin.evaluate(x[:50], y[:50], return_dict=True, verbose=0)["loss"] == pytest.approx(
        want.history["val_loss"][-1], rel=1e-6)  # two steps of 25: the first 50 samples
    with pytest.raises(hostavg.HostavgError, match=r"^validation_freq must be an integer >= 1, "
                                                   r"got 0$"):
        hostavg.keras.Trainer(model).fit(x, y, micro_batch_size=MICRO, validation_freq=0,
                                         validation_data=(x, y))


def test_a_metric_of_several_values_is_logged_as_keras_logs_it(tmp_path):
    """F1Score gives one value per class: an array in the History, as in Keras's, and in the
    checkpoint's History as a list."""
    x, y = data(26)
    onehot = np.eye(CLASSES, dtype=np.float32)[y]

    def make():
        return compiled(loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                        metrics=[keras.metrics.F1Score(threshold=0.5)])
    model, twin = make(), make()
    got = hostavg.keras.Trainer(model).fit(x, onehot, batch_size=BATCH, micro_batch_size=MICRO,
                                           shuffle=False, verbose=0, checkpoint_dir=tmp_path)
    want = twin.fit(x, onehot, batch_size=BATCH, shuffle=False, verbose=0)
    assert sorted(got.history) == sorted(want.history) == ["f1_score", "loss"]
    np.testing.assert_allclose(got.history["f1_score"][0], want.history["f1_score"][0], rtol=1e-5)
    assert got.history["f1_score"][0].shape == (CLASSES,)
    assert not got.history["f1_score"][0].flags.writeable
    assert hostavg.History.from_json(got.to_json()).history["f1_score"][0] == pytest.approx(
        list(want.history["f1_score"][0]), rel=1e-5)


def test_a_masked_loss_is_the_full_batchs_when_micro_batches_weigh_their_unmasked_tokens():
    """Keras averages a loss over masked outputs over the unmasked entries: a micro-batch's over
    its own. Weighted by their sample counts the micro-batches differ from the full batch (check
    says why); weighted by their unmasked tokens (sizes=), the step is train_on_batch's."""
    rng = np.random.default_rng(27)
    tokens = rng.integers(1, 20, (32, 8)).astype(np.int32)
    for row, length in enumerate(rng.integers(1, 9, 32)):
        tokens[row, length:] = 0
    labels = rng.integers(0, 3, (32, 8)).astype(np.int32)

    def make():
        keras.utils.set_random_seed(0)
        ids = keras.Input((8,), dtype="int32")
        h = keras.layers.Dense(8, activation="tanh")(keras.layers.Embedding(20, 6, mask_zero=True)(ids))
        model = keras.Model(ids, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=logits_loss())
        return model
    model, twin = make(), make()
    trainer = hostavg.keras.Trainer(model)
    report = trainer.check(tokens[:16], labels[:16], micro_batch_size=4)
    assert not report.ok and "a loss over masked outputs" in report.cause
    for start in (0, 16):
        parts = hostavg.split((tokens[start:start + 16], labels[start:start + 16]), 4)
        trainer.step(parts, sizes=[int(np.count_nonzero(x)) for x, _ in parts])
        twin.train_on_batch(tokens[start:start + 16], labels[start:start + 16])
    assert_close(weights(model), weights(twin), atol=1e-6)


# --- 3. Keras callbacks, as model.fit calls them --------------------------------------------


class Recorder(keras.callbacks.Callback):
    """Notes every call Keras's fit makes, with its logs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def note(self, *call, logs=None):
        self.calls.append((*call, dict(logs or {})))

    def on_train_begin(self, logs=None):
        self.note("train_begin", logs=logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.note("epoch_begin", epoch, logs=logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.note("batch_begin", batch, logs=logs)

    def on_train_batch_end(self, batch, logs=None):
        self.note("batch_end", batch, logs=logs)

    def on_test_begin(self, logs=None):
        self.note("test_begin", logs=logs)

    def on_test_batch_begin(self, batch, logs=None):
        self.note("test_batch_begin", batch, logs=logs)

    def on_test_batch_end(self, batch, logs=None):
        self.note("test_batch_end", batch, logs=logs)

    def on_test_end(self, logs=None):
        self.note("test_end", logs=logs)

    def on_epoch_end(self, epoch, logs=None):
        self.note("epoch_end", epoch, logs=logs)

    def on_train_end(self, logs=None):
        self.note("train_end", logs=logs)


def fit_callbacks(make, epochs=3, x=None, y=None, **kw):
    """(our History, model, callbacks; Keras's History, twin, callbacks) after fitting alike with
    the callbacks ``make()`` gives, validating on 40 samples in chunks of 20."""
    if x is None:
        x, y = data(20)
    kw = {"batch_size": BATCH, "shuffle": False, "validation_data": (x[:40], y[:40]),
          "validation_batch_size": 20, "epochs": epochs, "verbose": 0, **kw}
    twin, theirs = compiled(), make()
    want = twin.fit(x, y, callbacks=theirs, **kw)
    model, ours = compiled(), make()
    got = hostavg.keras.Trainer(model).fit(x, y, micro_batch_size=MICRO, callbacks=ours, **kw)
    return got, model, ours, want, twin, theirs


def test_keras_callbacks_are_called_in_model_fits_order_with_its_logs():
    got, model, (ours,), want, twin, (theirs,) = fit_callbacks(lambda: [Recorder()], epochs=2)
    assert [c[:-1] for c in ours.calls] == [c[:-1] for c in theirs.calls]
    for a, b in zip(ours.calls, theirs.calls):
        assert sorted(a[-1]) == sorted(b[-1]), a[:-1]
        for name in b[-1]:
            assert a[-1][name] == pytest.approx(b[-1][name], rel=1e-5, abs=1e-6), (a[:-1], name)
    assert ours.model is model and ours.params["epochs"] == 2 and ours.params["steps"] == 4


def test_early_stopping_restores_the_best_weights_and_stops_as_in_model_fit():
    def make():
        return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05,
                                              restore_best_weights=True)]
    got, model, _, want, twin, _ = fit_callbacks(make, epochs=10)
    assert got.epoch == want.epoch and len(got.epoch) < 10
    assert "model.stop_training" in got.stopped
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_reduce_lr_on_plateau_sets_the_optimizer_and_logs_learning_rate_as_in_model_fit():
    def make():
        return [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                  min_delta=10.0)]
    got, model, _, want, twin, _ = fit_callbacks(make)
    assert got.history["learning_rate"] == want.history["learning_rate"]  # before reducing
    assert want.history["learning_rate"] == pytest.approx([0.01, 0.01, 0.005])
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.0025)
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_model_checkpoint_and_csv_logger_write_what_model_fit_writes(tmp_path):
    def make():
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        return [keras.callbacks.ModelCheckpoint(str(run / "m-{epoch:02d}.keras")),
                keras.callbacks.ModelCheckpoint(str(run / "best.weights.h5"), monitor="val_loss",
                                                save_best_only=True, save_weights_only=True),
                keras.callbacks.CSVLogger(str(run / "log.csv"))]
    fit_callbacks(make)
    theirs, ours = tmp_path / "run0", tmp_path / "run1"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) == [
        "best.weights.h5", "log.csv", "m-01.keras", "m-02.keras", "m-03.keras"]
    for name in ("m-01.keras", "m-03.keras"):
        a, b = (keras.models.load_model(run / name) for run in (ours, theirs))
        assert_close(weights(a), weights(b))
        assert int(a.optimizer.iterations.numpy()) == int(b.optimizer.iterations.numpy())
    rows = [list(csv.DictReader(open(run / "log.csv"))) for run in (ours, theirs)]
    assert [sorted(r) for r in rows[0]] == [sorted(r) for r in rows[1]]
    for a, b in zip(*rows):
        for name in b:
            assert float(a[name]) == pytest.approx(float(b[name]), rel=1e-5, abs=1e-6), name


def test_tensorboard_writes_the_scalars_model_fit_writes(tmp_path):
    def make():
        return [keras.callbacks.TensorBoard(str(tmp_path / f"tb{len(list(tmp_path.iterdir()))}"))]
    fit_callbacks(make, epochs=2)

    def tags(run):
        found = set()
        for event in (tmp_path / run).rglob("events.out.tfevents.*"):
            for e in tf.compat.v1.train.summary_iterator(str(event)):
                found |= {(event.parent.name, v.tag) for v in e.summary.value}
        return found
    assert tags("tb1") == tags("tb0") and ("validation", "epoch_loss") in tags("tb1")


def test_backup_and_restore_resumes_at_the_epoch_after_its_backup_as_in_model_fit(tmp_path):
    x, y = data(21)

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("crash")

    def run(fit, backup):
        with pytest.raises(RuntimeError, match="crash"):
            fit(callbacks=[keras.callbacks.BackupAndRestore(str(backup)), Crash()])
        return fit(callbacks=[keras.callbacks.BackupAndRestore(str(backup))])

    kw = dict(batch_size=BATCH, shuffle=False, epochs=4, verbose=0)
    twin = compiled()
    want = run(lambda **c: twin.fit(x, y, **kw, **c), tmp_path / "theirs")
    model = compiled()
    trainer = hostavg.keras.Trainer(model)
    got = run(lambda **c: trainer.fit(x, y, micro_batch_size=MICRO, **kw, **c), tmp_path / "ours")
    assert got.epoch == want.epoch == [2, 3]  # the backup was taken as epoch 1 ended
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))
    assert not (tmp_path / "ours").exists()  # deleted when training ended, as Keras does


def test_backup_and_restore_beside_a_checkpoint_dir_undoes_the_steps_after_its_backup(tmp_path):
    """A crash mid-epoch 2 with both: the checkpoint holds that epoch's first steps, the backup
    the end of epoch 1; the backup's weights win, and the history forgets what they undo, so
    the run ends as one never stopped, each step once."""
    x, y = data(22)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 6:  # epoch 2 (index 1), its 2nd step
                raise RuntimeError("crash")

    kw = dict(batch_size=BATCH, micro_batch_size=MICRO, shuffle=True, seed=5, epochs=3,
              verbose=0)
    straight = hostavg.keras.Trainer(compiled()).fit(x, y, **kw)
    model = compiled()
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="crash"):
        hostavg.keras.Trainer(model).fit(
            x, y, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, **kw,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Crash()])
    resumed = compiled()
    got = hostavg.keras.Trainer(resumed).fit(
        x, y, checkpoint_dir=tmp_path / "ckpt", **kw,
        callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert [(s.epoch, s.step) for s in got.steps] == [(s.epoch, s.step) for s in straight.steps]
    assert got.history["loss"] == pytest.approx(straight.history["loss"], rel=1e-6)
    assert int(resumed.optimizer.iterations.numpy()) == 3 * 4


def test_a_lambda_callback_and_stop_training_in_a_batch_end_the_epoch_as_model_fit():
    def make():
        seen = []

        def stop(batch, logs):
            seen.append(("batch", batch))
            if batch == 1:
                seen[-1] += ("stop",)
                callback.model.stop_training = True
        callback = keras.callbacks.LambdaCallback(
            on_train_batch_end=stop, on_epoch_end=lambda epoch, logs: seen.append(("epoch", epoch,
                                                                                  sorted(logs))))
        callback.seen = seen
        return [callback]
    got, model, (ours,), want, twin, (theirs,) = fit_callbacks(make)
    assert ours.seen == theirs.seen == [("batch", 0), ("batch", 1, "stop"), (
        "epoch", 0, ["accuracy", "loss", "val_accuracy", "val_loss"])]
    assert got.epoch == want.epoch == [0] and len(got.steps) == 2
    assert_history(got.history, want.history)
    assert_close(weights(model), weights(twin))


def test_fit_leaves_its_history_on_the_model_as_keras_fit_does():
    """Keras's fit leaves the History it returns on ``model.history`` (programs read
    ``model.history.history["loss"]`` after fit; callbacks read it in on_train_end); a fit
    stopped by an error leaves the epochs it finished, and one refused before training leaves
    ``model.history`` as it was. hostavg's fit leaves the History it returns, alike."""

    class Seen(keras.callbacks.Callback):
        def __init__(self, fail_in_epoch=None):
            super().__init__()
            self.fail_in_epoch, self.seen = fail_in_epoch, None

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == self.fail_in_epoch:
                raise RuntimeError("stopped on purpose")

        def on_train_end(self, logs=None):
            self.seen = list(self.model.history.epoch)

    got, model, (ours,), want, twin, (theirs,) = fit_callbacks(lambda: [Seen()], epochs=2)
    assert twin.history is want and model.history is got
    assert_history(model.history.history, twin.history.history)
    assert model.history.epoch == twin.history.epoch == [0, 1]
    assert ours.seen == theirs.seen == [0, 1]

    x, y = data(21)
    twin, model = compiled(), compiled()
    trainer = hostavg.keras.Trainer(model)
    for fail_in_epoch, epochs in ((1, [0]), (0, [])):
        for fit, kw in ((twin.fit, {}), (trainer.fit, {"micro_batch_size": MICRO})):
            with pytest.raises(RuntimeError, match="stopped on purpose"):
                fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                    callbacks=[Seen(fail_in_epoch)], **kw)
        assert model.history.epoch == twin.history.epoch == epochs
        assert_history(model.history.history, twin.history.history)
    before, theirs = model.history, twin.history
    with pytest.raises(ValueError):
        twin.fit(x, y[:10], verbose=0)
    with pytest.raises(hostavg.HostavgError):
        trainer.fit(x, y[:10], verbose=0)
    assert model.history is before and twin.history is theirs


def test_keras_callbacks_and_hostavg_hooks_run_side_by_side():
    x, y = data(22)
    seen = []

    class Hook:
        def on_applied(self, result):
            seen.append(("hook", result.step))

    history = hostavg.keras.Trainer(compiled()).fit(
        x, y, batch_size=100, micro_batch_size=50, verbose=0, callbacks=[
            Hook(), keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, logs: seen.append(("keras", b)))])
    assert seen == [("hook", 1), ("keras", 0), ("hook", 2), ("keras", 1)]
    assert history.history.keys() == {"loss", "accuracy"}


# --- 5. Mixed precision: the LossScaleOptimizer, as Keras drives it ---------------------------


@pytest.fixture
def mixed_float16():
    """The mixed_float16 dtype policy within the test (compile then makes a LossScaleOptimizer)."""
    before = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy(before)


def mixed_model(optimizer=None):
    keras.utils.set_random_seed(0)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(HIDDEN, activation="tanh", name="hidden")(x)
    logits = keras.layers.Activation("linear", dtype="float32")(keras.layers.Dense(CLASSES)(h))
    model = keras.Model(x, logits)
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss=logits_loss())
    return model


def scale_state(optimizer) -> tuple:
    return (float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy()),
            int(optimizer.iterations.numpy()))


def test_a_loss_scale_optimizer_skips_a_non_finite_step_and_grows_its_scale_as_train_on_batch(
        mixed_float16):
    def optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                   initial_scale=2.0**12, dynamic_growth_steps=2)
    model, twin = mixed_model(optimizer()), mixed_model(optimizer())
    applied = []
    trainer = hostavg.keras.Trainer(model, hooks=[type("Seen", (), {
        "on_applied": lambda self, result: applied.append(result.step)})()])
    x, y = data(30, 6 * BATCH)
    states = []
    for i in range(6):
        xs, ys = x[i * BATCH:(i + 1) * BATCH].copy(), y[i * BATCH:(i + 1) * BATCH]
        if i == 3:
            xs[37, 0] = np.nan  # in micro-batch 2
        twin.train_on_batch(xs, ys)
        result = trainer.step(hostavg.split((xs, ys), MICRO))
        states.append((scale_state(model.optimizer), scale_state(twin.optimizer)))
        assert (result.skipped is not None) == (i == 3)
        if i == 3:
            assert result.skipped == ("the LossScaleOptimizer skipped the step: the gradients "
                                      "were not finite at loss scale 8192, which it lowered to "
                                      "4096") and result.step == 3
    assert [ours for ours, _ in states] == [theirs for _, theirs in states] == [
        (4096.0, 1, 1), (8192.0, 0, 2), (8192.0, 1, 3), (4096.0, 0, 3), (4096.0, 1, 4),
        (8192.0, 0, 5)]
    assert applied == [1, 2, 3, 4, 5]  # not the skipped step
    assert_close(weights(model), weights(twin), atol=1e-4)  # float16 sums over other batches


class BatchLosses(keras.callbacks.Callback):
    """The running loss fit reports after each batch."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def test_mixed_precision_fit_counts_a_skipped_steps_loss_as_keras_fit(mixed_float16):
    """A step the LossScaleOptimizer skips still counts in the running loss, as Keras's loss
    tracker counts every batch (the Inf saturates tanh: the loss is finite, the gradients not)."""
    model, twin = mixed_model(), mixed_model()
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = data(31, 4 * BATCH)
    x[BATCH + 3, 1] = np.inf  # batch 1
    ours, theirs = BatchLosses(), BatchLosses()
    history = hostavg.keras.Trainer(model).fit(x, y, batch_size=BATCH, micro_batch_size=MICRO,
                                               shuffle=False, verbose=0, callbacks=[ours])
    want = twin.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[theirs])
    assert [s.step for s in history.steps] == [1, 1, 2, 3]
    assert scale_state(model.optimizer) == scale_state(twin.optimizer) == (2.0**14, 2, 3)
    assert np.isfinite(history.steps[1].loss) and history.steps[1].size == BATCH
    assert history.history["loss"] == pytest.approx(want.history["loss"], rel=1e-4)
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=1e-4)


def test_mixed_precision_scales_each_micro_batch_by_its_share_so_it_overflows_as_keras(
        mixed_float16):
    """At a scale where float16 overflows in some steps (not from the inputs), each
    micro-batch's loss is scaled by its share of the batch too, so the backward pass meets
    the whole batch's per-sample scale: the steps skipped, the scale and the losses are
    Keras's fit's, and TerminateOnNaN sees finite losses as in Keras."""
    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid", dtype="float32")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
        model.optimizer.build(model.trainable_variables)
        model.optimizer.dynamic_scale.assign(2.0**27)
        return model
    rng = np.random.default_rng(5)
    x = rng.normal(size=(48, 6)).astype(np.float32)
    y = rng.integers(0, 2, (48, 1)).astype(np.float32)
    model, twin = make(), make()
    ours, theirs = BatchLosses(), BatchLosses()
    history = hostavg.keras.Trainer(model).fit(
        x, y, batch_size=8, micro_batch_size=4, epochs=2, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN(), ours])
    want = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.TerminateOnNaN(), theirs])
    assert history.epoch == want.epoch == [0, 1]
    assert len({s.step for s in history.steps}) < len(history.steps)  # some step was skipped
    assert scale_state(model.optimizer) == scale_state(twin.optimizer)
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=1e-4)
    assert_close(weights(model), weights(twin), atol=1e-3)  # float16 sums over other batches


def test_an_optimizer_with_a_fixed_loss_scale_factor_steps_as_train_on_batch():
    """Keras scales the loss by loss_scale_factor and its apply divides the gradients by it."""
    def make():
        return compiled(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, loss_scale_factor=64.0))
    model, twin = make(), make()
    trainer = hostavg.keras.Trainer(model)
    x, y = data(35)
    for start in range(0, N, BATCH):
        twin.train_on_batch(x[start:start + BATCH], y[start:start + BATCH])
        trainer.step(hostavg.split((x[start:start + BATCH], y[start:start + BATCH]), MICRO))
    assert_close(weights(model), weights(twin))


# --- 6. Distribution strategies ---------------------------------------------------------------


@pytest.mark.skipif(not ON_TENSORFLOW, reason="tf.distribute is TensorFlow's")
def test_a_distribution_strategy_is_refused_naming_it_and_pointing_at_comm():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        inside = compiled()
        with pytest.raises(hostavg.HostavgError, match=r"runs inside a OneDeviceStrategy scope.* "
                                                       r"pass comm= \(an mpi4py communicator"):
            hostavg.keras.Trainer(build(), logits_loss(), keras.optimizers.Adam())
    trainer = hostavg.keras.Trainer(compiled())
    x, y = data(32)
    with strategy.scope():
        for call in (lambda: trainer.evaluate(x, y), lambda: trainer.step([(x[:8], y[:8])])):
            with pytest.raises(hostavg.HostavgError, match="OneDeviceStrategy"):
                call()
    with pytest.raises(hostavg.HostavgError, match=r"for a model made in a OneDeviceStrategy "
                                                   r"scope"):
        hostavg.keras.Trainer(inside)
    x, y = data(32)
    trainer = hostavg.keras.Trainer(compiled())
    with strategy.scope(), pytest.raises(hostavg.HostavgError, match="OneDeviceStrategy"):
        trainer.fit(x, y, batch_size=BATCH, micro_batch_size=MICRO, verbose=0)


@pytest.mark.skipif(ON_TENSORFLOW, reason="keras.distribution is JAX's")
def test_a_keras_distribution_is_refused_naming_it_and_pointing_at_comm():
    trainer, (x, y) = hostavg.keras.Trainer(compiled()), data(32)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        with pytest.raises(hostavg.HostavgError, match=r"runs under a keras.distribution "
                                                       r"DataParallel.* pass comm= \(an mpi4py"):
            hostavg.keras.Trainer(compiled())
        for call in (lambda: trainer.evaluate(x, y), lambda: trainer.step([(x[:8], y[:8])])):
            with pytest.raises(hostavg.HostavgError, match="DataParallel"):
                call()
    finally:
        keras.distribution.set_distribution(None)
    hostavg.keras.Trainer(compiled())  # once unset


# --- 7. Evaluation: the metrics Keras itself updates -------------------------------------------


def test_evaluate_equals_keras_evaluate_with_sample_weights_and_weighted_metrics():
    x, y = data(33)
    w = np.random.default_rng(33).uniform(0.1, 2.0, N).astype(np.float32)

    def make():
        return compiled(weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")])
    model, twin = make(), make()
    got = hostavg.keras.Trainer(model).evaluate(x, y, batch_size=50, sample_weight=w)
    want = twin.evaluate(x, y, batch_size=50, sample_weight=w, return_dict=True, verbose=0)
    assert sorted(got) == sorted(want) == ["accuracy", "loss", "wacc"]
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-6), name
    ds = hostavg.keras.Trainer(make()).evaluate(tf.data.Dataset.from_tensor_slices(
        (x, y, w)).batch(50))
    assert ds == pytest.approx(got, rel=1e-6)


class OwnMetrics(keras.Model):
    """keras-io's custom evaluation: its own metrics and test_step; and one metric that nothing
    ever updates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")
        self.unused = keras.metrics.Mean(name="unused")

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae, self.unused]

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(self.compute_loss(y=y, y_pred=y_pred, training=False))
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnMetricsJax(OwnMetrics):
    """The same on JAX, where test_step is stateless (keras-io's custom_train_step_in_jax)."""

    def test_step(self, state, data):
        trainable, untrained, metric_values = state
        x, y = data
        y_pred, untrained = self.stateless_call(trainable, untrained, x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred, training=False)
        with keras.StatelessScope(state_mapping=list(zip(self.metrics_variables,
                                                         metric_values))) as scope:
            self.loss_tracker.update_state(loss)
            self.mae.update_state(y, y_pred)
            logs = {m.name: m.result() for m in self.metrics}
        return logs, (trainable, untrained,
                      [scope.get_current_value(v) for v in self.metrics_variables])


def test_evaluation_reports_what_a_models_own_test_step_updates_and_nothing_else():
    x, y = data(34)
    target = x[:, :1] * 2.0

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        model = (OwnMetrics if ON_TENSORFLOW else OwnMetricsJax)(inputs,
                                                                 keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        return model
    model, twin = make(), make()
    got = hostavg.keras.Trainer(model).evaluate(x, target, batch_size=N)
    want = twin.evaluate(x, target, batch_size=N, return_dict=True, verbose=0)
    assert want["unused"] == 0.0  # Keras reports a metric nothing updated
    assert got == pytest.approx({"loss": want["loss"], "mae": want["mae"]}, rel=1e-6)
    assert got["mae"] > 0.1


def test_steps_per_epoch_resumes_from_a_checkpoint_mid_pass_bit_for_bit(tmp_path):
    """The checkpoint holds the pass over the data besides the epoch: a run stopped in epoch 1
    (which continues epoch 0's pass) resumes at the same batch of the same pass."""
    x, y = data(23)

    def fit(trainer, callbacks=(), ckpt=None):
        return trainer.fit(x, y, batch_size=32, micro_batch_size=MICRO, epochs=3,
                           steps_per_epoch=4, seed=2, verbose=0, callbacks=list(callbacks),
                           checkpoint_dir=ckpt, checkpoint_every=None if ckpt is None else 1)
    straight = hostavg.keras.Trainer(compiled(build(names=False)))
    want = fit(straight)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        fit(hostavg.keras.Trainer(compiled(build(names=False))), [FailAt(5)], tmp_path)
    resumed = hostavg.keras.Trainer(compiled(build(names=False)))
    got = fit(resumed, ckpt=tmp_path)
    assert [s.loss for s in got.steps] == [s.loss for s in want.steps]
    assert_close(weights(resumed.model), weights(straight.model), atol=0)
    assert got.history["loss"] == want.history["loss"]  # the steps' own, checkpointed
    # The metrics' state is not checkpointed: the resumed epoch's covers its steps after resuming.
    assert got.history["accuracy"][0::2] == want.history["accuracy"][0::2]


# --- Messages that name what to change (issue 40 item 11) -------------------------------------


def test_a_model_without_a_loss_is_told_to_give_one():
    """Keras's 'No loss to compute' at the first batch (a model may add its loss in its forward
    pass, which only running it shows): the error names the loss, not x and y."""
    model = build()
    trainer = hostavg.keras.Trainer(model, optimizer=keras.optimizers.Adam(0.01))
    x, y = data()
    with pytest.raises(hostavg.ArgumentError) as raised:
        trainer.step(hostavg.split((x[:32], y[:32]), 16))
    assert str(raised.value) == (
        f"step, micro-batch 0 of 2: model {model.name!r} has no loss: it is compiled without "
        f"one, none was given, and its forward pass adds none (add_loss); pass loss= (such as "
        f"'sparse_categorical_crossentropy') or compile the model with one")


def test_one_loss_for_two_outputs_names_the_output_whose_target_does_not_fit():
    model = two_outputs()
    trainer = hostavg.keras.Trainer(model, keras.losses.CategoricalCrossentropy(from_logits=True),
                                    keras.optimizers.Adam(0.01))
    x, y = data()
    targets = {"label": np.eye(CLASSES, dtype=np.float32)[y[:16]],
               "size": np.ones((16, 2), np.float32)}
    with pytest.raises(hostavg.ArgumentError) as raised:
        trainer.compute(x[:16], targets)
    said = str(raised.value)
    assert said.startswith("compute: the model cannot run on this batch ("), said
    assert said.endswith(
        f"; model {model.name!r} has 2 outputs ('label', 'size') and one loss, which Keras "
        f"applies to each of them: output 'size' gives shape (None, 1), its target (16, 2). "
        f"Give each output a target of its shape, or each output its own loss (a dict by output "
        f"name)"), said


def test_the_check_of_a_batch_norm_model_keeps_each_remedy_with_its_cause():
    trainer = hostavg.keras.Trainer(build(batch_norm=True), logits_loss(),
                                    keras.optimizers.SGD(0.1))
    x, y = data()
    report = trainer.check(x[:64], y[:64], micro_batch_size=16)
    assert not report.ok
    assert report.cause == (
        "the micro-batches see something the whole batch does not: an op that computes over the "
        "batch (each micro-batch's own statistics instead of the batch's), such as "
        "keras.layers.BatchNormalization, which in training normalises each micro-batch by its "
        "own statistics; or a loss over masked outputs (after Embedding(mask_zero=True) or "
        "Masking), which Keras averages over each micro-batch's own unmasked entries: weigh each "
        "micro-batch by its unmasked entries, step(batches, sizes=[...]), and the step is the "
        "full batch's. Where nothing makes them agree, expect a k-micro-batch step to differ "
        "from a full-batch step; larger micro-batches make it smaller")
