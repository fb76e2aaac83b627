"""A Keras model's own ``train_step``, run per micro-batch (issue 31, item 2), against Keras's own
full-batch ``fit`` on a twin model (the same initial weights): keras-io's custom-loop
classifier, a VAE, a self-supervised loss; the refusal of a step that applies two optimizers;
check's word on a step whose loss is not a mean over samples. On Keras's TensorFlow backend,
and on JAX (tests/test_keras_jax.py runs this file there): each model's ``train_step`` is
written as keras-io writes it for that backend (a GradientTape; a stateless step)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hostavg
import hostavg.keras

ON_JAX = keras.backend.backend() == "jax"
FEATURES, BATCH, SIZES = 6, 32, (5, 11, 16)
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}


def data(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)


def values(model) -> list:
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v.value) for v in model.variables]


def assert_close(got: list, want: list, atol=1e-5):
    worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(got, want))
    assert worst <= atol, worst


def cut(*arrays, sizes=SIZES) -> list:
    """The batch ``arrays`` as micro-batches of ``sizes``: [(x, y), ...]."""
    ends = np.cumsum(sizes)
    return [tuple(a[end - n:end] for a in arrays) for n, end in zip(sizes, ends)]


# --- keras-io's "customizing what happens in fit": compute_loss, the compiled metrics -------


class Classifier(keras.Model):
    """keras-io's custom-loop classifier, as its guide for the backend writes it."""

    if ON_JAX:
        def compute_loss_and_updates(self, trainable, untrained, x, y, training=False):
            y_pred, untrained = self.stateless_call(trainable, untrained, x, training=training)
            return self.compute_loss(x, y, y_pred), (y_pred, untrained)

        def train_step(self, state, data):
            import jax
            trainable, untrained, optimizer_values, metric_values = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (y_pred, untrained)), grads = grad_fn(trainable, untrained, x, y, True)
            trainable, optimizer_values = self.optimizer.stateless_apply(
                optimizer_values, grads, trainable)
            new, logs = [], {}
            for metric in self.metrics:
                own = metric_values[len(new):len(new) + len(metric.variables)]
                own = metric.stateless_update_state(own, loss) if metric.name == "loss" else \
                    metric.stateless_update_state(own, y, y_pred)
                logs[metric.name] = metric.stateless_result(own)
                new += own
            return logs, (trainable, untrained, optimizer_values, new)
    else:
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}


def classifier(optimizer: str):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = Classifier(inputs, keras.layers.Dense(3)(hidden))
    model.compile(OPTIMIZERS[optimizer](),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    return model


# --- Models whose train_step computes its own loss: one step per backend ----------------------


class OwnLoop(keras.Model):
    """A model whose ``train_step`` differentiates ``self.loss_of(x)`` (a scalar of
    ``keras.ops``) and applies it with ``apply_gradients``, as keras-io's VAE and
    self-supervised examples do; "loss" in its logs is a Mean tracker's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    if ON_JAX:
        def train_step(self, state, data):
            import jax
            trainable, untrained, optimizer_values, metric_values = state

            def loss(trainable):
                mapping = list(zip(self.trainable_variables, trainable)) + \
                    list(zip(self.non_trainable_variables, untrained))
                with keras.StatelessScope(state_mapping=mapping):
                    return self.loss_of(data)

            value, grads = jax.value_and_grad(loss)(trainable)
            trainable, optimizer_values = self.optimizer.stateless_apply(
                optimizer_values, grads, trainable)
            metric_values = self.tracker.stateless_update_state(metric_values, value)
            return ({"loss": self.tracker.stateless_result(metric_values)},
                    (trainable, untrained, optimizer_values, metric_values))
    else:
        def train_step(self, data):
            with tf.GradientTape() as tape:
                loss = self.loss_of(data)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}


class VAE(OwnLoop):
    """keras-io's VAE: an encoder to (z_mean, z_log_var), a sample z = z_mean + exp(z_log_var /
    2) * eps, a decoder. ``eps`` is each sample's own (a fixed function of its inputs), so a
    sample draws the same wherever it is. ``kl``: "mean" (over samples: exact) or "sum" (over
    the batch, keras-io's own: the batch's size in the loss)."""

    def __init__(self, kl="mean", **kwargs):
        super().__init__(**kwargs)
        self.kl = kl
        self.encoder = keras.layers.Dense(4)
        self.decoder = keras.layers.Dense(FEATURES)

    def call(self, x):
        return self.decoder(self.encoder(x)[:, :2])

    def loss_of(self, x):
        ops = keras.ops
        z_mean, z_log_var = ops.split(self.encoder(x), 2, axis=1)
        eps = ops.sin(ops.sum(x, axis=1, keepdims=True) * 7.0 + ops.arange(2, dtype="float32"))
        reconstruction = self.decoder(z_mean + ops.exp(0.5 * z_log_var) * eps)
        rec = ops.mean(ops.sum(ops.square(x - reconstruction), axis=1))
        kl = -0.5 * ops.sum(1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var), axis=1)
        return rec + (ops.mean(kl) if self.kl == "mean" else ops.sum(kl))


class SelfSupervised(OwnLoop):
    """Two views of each sample (scaled, shifted) through one encoder; the loss pulls the
    views together: ``negatives=False``: 1 - cos(z1_i, z2_i) averaged over samples (BYOL-style,
    exact); True: InfoNCE, whose negatives are the batch's other samples."""

    def __init__(self, negatives=False, **kwargs):
        super().__init__(**kwargs)
        self.negatives = negatives
        self.encoder = keras.layers.Dense(5, activation="tanh")
        self.head = keras.layers.Dense(5)

    def call(self, x):
        return self.head(self.encoder(x))

    def loss_of(self, x):
        ops = keras.ops
        z1 = ops.normalize(self(x * 0.8), axis=1)
        z2 = ops.normalize(self(x + 0.3), axis=1)
        if not self.negatives:
            return ops.mean(1.0 - ops.sum(z1 * z2, axis=1))
        logits = ops.matmul(z1, ops.transpose(z2)) / 0.5
        labels = ops.arange(ops.shape(x)[0])
        return ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                                     from_logits=True))


def own_loop(kind: str, optimizer: str, **kwargs):
    keras.utils.set_random_seed(5)
    model = {"vae": VAE, "self_supervised": SelfSupervised}[kind](**kwargs)
    model(np.zeros((1, FEATURES), np.float32))
    model.compile(OPTIMIZERS[optimizer]())
    return model


# --- Exactness: a step of unequal micro-batches equals Keras's fit on the full batch ----------


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_custom_loop_classifier_steps_as_kerass_fit_on_the_full_batch(optimizer):
    x, y = data()
    keras_model, model = classifier(optimizer), classifier(optimizer)
    keras_model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    trainer = hostavg.keras.Trainer(model)
    for _ in range(3):
        result = trainer.step(cut(x, y))
    assert_close(values(model), values(keras_model))
    assert int(model.optimizer.iterations) == 3 and result.step == 3
    assert [m.size for m in result.micro] == list(SIZES)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["vae", "self_supervised"])
def test_a_train_step_with_its_own_loss_steps_as_kerass_fit_on_the_full_batch(kind, optimizer):
    x, _ = data(1)
    keras_model, model = own_loop(kind, optimizer), own_loop(kind, optimizer)
    keras_model.fit(x, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    whole = float(keras.ops.convert_to_numpy(own_loop(kind, optimizer).loss_of(x)))
    trainer = hostavg.keras.Trainer(model)
    first = trainer.step([(part, None) for part, in cut(x)])
    for _ in range(2):
        trainer.step([(part, None) for part, in cut(x)])
    assert_close(values(model), values(keras_model))
    assert int(model.optimizer.iterations) == 3
    # each micro-batch's loss is its own (the tracker's increment): their mean is the batch's
    assert first.loss == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_fit_with_a_micro_batch_size_that_does_not_divide_equals_kerass_fit(optimizer):
    x, y = data(2, n=2 * BATCH)
    keras_model, model = classifier(optimizer), classifier(optimizer)
    want = keras_model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    got = hostavg.keras.Trainer(model).fit(x, y, batch_size=BATCH, micro_batch_size=10,
                                           epochs=2, shuffle=False, verbose=0)
    assert_close(values(model), values(keras_model))
    # the train_step's logs are fit's training metrics, as Keras's fit reports them
    assert sorted(got.history) == sorted(want.history) == ["accuracy", "loss"]
    assert all(len(got.history[k]) == 2 for k in got.history)


def test_the_micro_batch_loss_is_what_it_added_to_the_loss_tracker():
    x, y = data(4)
    model = classifier("sgd")
    probe = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    want = [float(probe(b, model.predict(a, verbose=0))) for a, b in cut(x, y)]
    result = hostavg.keras.Trainer(model).step(cut(x, y))
    np.testing.assert_allclose([m.loss for m in result.micro], want, rtol=1e-5)
    assert result.loss == pytest.approx(float(probe(y, classifier("sgd").predict(x, verbose=0))),
                                        rel=1e-5)


class KerasOwnStep(keras.Model):
    """A train_step that is Keras's own, called by an override."""

    def train_step(self, *args):
        return super().train_step(*args)


def test_kerass_own_train_step_called_by_an_override_steps_as_the_compiled_model():
    """Issue 24, item 15 refused such a model; it now runs its train_step, Keras's own."""
    x, y = data(9)
    model, plain = classifier("adam"), classifier("adam")
    model = KerasOwnStep(model.inputs, model.outputs)
    model.compile(keras.optimizers.Adam(0.01), plain.loss, metrics=["accuracy"])
    plain.compile(keras.optimizers.Adam(0.01), plain.loss, metrics=["accuracy"])
    own, compiled = hostavg.keras.Trainer(model), hostavg.keras.Trainer(plain)
    for _ in range(2):
        got, want = own.step(cut(x, y)), compiled.step(cut(x, y))
    assert_close(values(model), values(plain))
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    assert [m.loss for m in got.micro] == pytest.approx([m.loss for m in want.micro], rel=1e-6)


# --- check: which train_steps are exact ----------------------------------------------------


@pytest.mark.parametrize("kind, kwargs, cause", [
    ("vae", {"kl": "sum"}, "summed over samples"),
    ("self_supervised", {"negatives": True}, "compares the samples of the batch"),
])
def test_check_flags_a_train_step_whose_loss_is_not_a_mean_over_samples(kind, kwargs, cause):
    x, _ = data(5)
    model = own_loop(kind, "sgd", **kwargs)
    before = values(model)
    report = hostavg.keras.Trainer(model).check(x, micro_batch_size=8)
    assert not report.ok and cause in report.cause, report
    assert_close(values(model), before, atol=0)
    assert hostavg.keras.Trainer(own_loop(kind, "sgd")).check(x, micro_batch_size=8).ok


# --- Refused: a train_step that updates twice ----------------------------------------------


class GAN(keras.Model):
    """keras-io's GAN shape: a discriminator and a generator, each applied by its own optimizer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.layers.Dense(FEATURES)
        self.discriminator = keras.layers.Dense(1)
        self.d_optimizer = keras.optimizers.Adam(0.01)
        self.g_optimizer = keras.optimizers.Adam(0.01)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.discriminator(self.generator(x))

    def losses_of(self, x):
        ops = keras.ops
        fake = self.discriminator(self.generator(x))
        real = self.discriminator(x)
        return ops.mean(ops.softplus(fake) + ops.softplus(-real)), ops.mean(ops.softplus(-fake))

    if ON_JAX:
        def train_step(self, state, data):
            import jax
            trainable, untrained, optimizer_values, metric_values = state

            def loss(trainable, which):
                with keras.StatelessScope(state_mapping=list(zip(self.trainable_variables,
                                                                 trainable))):
                    return self.losses_of(data)[which]
            for which, optimizer in enumerate((self.d_optimizer, self.g_optimizer)):
                grads = jax.grad(loss)(trainable, which)
                trainable, _ = optimizer.stateless_apply([v.value for v in optimizer.variables],
                                                         grads, trainable)
            return {"loss": loss(trainable, 0)}, (trainable, untrained, optimizer_values,
                                                  metric_values)
    else:
        def train_step(self, data):
            for which, optimizer in enumerate((self.d_optimizer, self.g_optimizer)):
                with tf.GradientTape() as tape:
                    loss = self.losses_of(data)[which]
                grads = tape.gradient(loss, self.trainable_variables)
                optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}


def gan(optimizer=None):
    keras.utils.set_random_seed(7)
    model = GAN()
    model(np.zeros((1, FEATURES), np.float32))
    for o in (model.d_optimizer, model.g_optimizer):
        o.build(model.trainable_variables)
    if optimizer is not None:
        model.compile(optimizer)
    return model


def test_a_gan_compiled_with_no_optimizer_is_refused_pointing_at_step_together():
    model = gan()
    before = values(model)
    with pytest.raises(hostavg.HostavgError, match=r"holds model.d_optimizer and "
                                                   r"model.g_optimizer .*second update would "
                                                   r"need the first's result.*step_together"):
        hostavg.keras.Trainer(model)
    assert_close(values(model), before, atol=0)


def test_a_train_step_applying_two_optimizers_is_refused_with_nothing_changed():
    model = gan(model_optimizer := keras.optimizers.Adam(0.01))
    x, _ = data(6)
    trainer = hostavg.keras.Trainer(model)
    before = values(model)
    with pytest.raises(hostavg.HostavgError, match=r"applies model.d_optimizer then "
                                                   r"model.g_optimizer.*step_together"):
        trainer.step([(part, None) for part, in cut(x)])
    with pytest.raises(hostavg.HostavgError, match="second update would need the first's result"):
        trainer.fit(x, batch_size=16, micro_batch_size=8, verbose=0)
    assert_close(values(model), before, atol=0)
    assert [int(o.iterations) for o in (model_optimizer, model.d_optimizer, model.g_optimizer)] \
        == [0, 0, 0]


def test_a_failed_step_restores_what_the_train_step_assigned():
    x, y = data(8)
    model = classifier("adam")
    trainer = hostavg.keras.Trainer(model)
    trainer.step(cut(x, y))
    before = values(model)
    bad = x.copy()
    bad[20] = np.nan
    with pytest.raises(hostavg.HostavgError, match="micro-batch 2 of 3") as caught:
        trainer.step(cut(bad, y))
    assert_close(values(model), before, atol=0)  # weights, optimizer slots, metric states
    assert caught.value.culprits  # the culprit sample, found as for a compiled model


def test_hvp_and_curvature_refuse_a_model_with_its_own_train_step_with_nothing_changed():
    x, _ = data(5)
    model = own_loop("vae", "sgd")
    trainer = hostavg.keras.Trainer(model)
    g = trainer.compute(x)
    before = values(model)
    for call in (lambda: trainer.hvp(x, vectors=g), lambda: trainer.curvature(x)):
        with pytest.raises(hostavg.ArgumentError, match=r"hvp: model .* trains by its own "
                                                        r"train_step, whose loss hostavg cannot"):
            call()
    assert_close(values(model), before, atol=0)
