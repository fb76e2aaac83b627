"""hostavg.keras on Keras's JAX backend: what is JAX's own.

Keras's backend is fixed per process. CI runs the contract suite, Keras's own
faces of tests/test_keras_native.py, a model's own stateless train_step
(tests/test_keras_train_step.py), the non-finite checks (tests/test_overflow.py)
and this file on JAX as a step of its own (see .ci/run); there the tests marked ``jax_only``
run: dense embedding gradients, host buffers reused without overwriting what
is still held, variables the loss does not depend on left untrained, the bench.
Under the test run's TensorFlow, the slow tests start processes with
``KERAS_BACKEND=jax``: one steps a model in a fresh process and finds
TensorFlow never imported, one runs benchmarks/gpu.py with tiny sizes.
"""

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from models import BATCH, ENV, VOCAB, batches, keras_model

import hostavg
import hostavg.keras

ON_JAX = keras.backend.backend() == "jax"
ROOT = Path(__file__).parents[1]
#: Tests of this file that need Keras on JAX in this process.
jax_only = pytest.mark.skipif(not ON_JAX, reason="Keras runs on TensorFlow in this process; "
                                                 "CI's KERAS_BACKEND=jax step runs these")


def run_on_jax(args: list, timeout: int) -> subprocess.CompletedProcess:
    pytest.importorskip("jax")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**ENV, "KERAS_BACKEND": "jax"}, timeout=timeout)


#: A step, evaluate, check, save and restore on JAX, then whether TensorFlow was imported.
NO_TENSORFLOW = """
import sys, tempfile
import keras, numpy as np
import hostavg, hostavg.keras
inputs = keras.Input((6,))
model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)))
trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                keras.optimizers.Adam(0.01), update_ratios_every=1)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 3, 32).astype(np.int32)
result = trainer.step(hostavg.split((x, y), 8))
assert result.step == 1 and result.update_ratios, result
trainer.evaluate(x, y, batch_size=16)
assert trainer.check(x, y, micro_batch_size=8).ok
with tempfile.TemporaryDirectory() as folder:
    trainer.save(folder + "/ck.npz")
    trainer.restore(folder + "/ck.npz")
print(sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
"""


@pytest.mark.slow  # a fresh process
@pytest.mark.skipif(ON_JAX, reason="the process on TensorFlow runs it")
def test_a_step_on_jax_imports_no_tensorflow():
    out = run_on_jax(["-c", NO_TENSORFLOW], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.slow  # a fresh process; about 40 s
@pytest.mark.skipif(ON_JAX, reason="the process on TensorFlow runs it")
def test_the_gpu_benchmark_runs_on_the_cpu_with_tiny_sizes(tmp_path):
    out = run_on_jax(["benchmarks/gpu.py", "--sizes", "tiny", "--repeats", "1", "--json",
                      str(tmp_path / "gpu.json")], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert not result["tensorflow_imported"]
    assert [p["host_memory"] for p in result["parts"]] == ["host", "host"]
    assert all(p["reuses_buffers"] for p in result["parts"])
    for step in result["steps"]:
        assert set(step["median_s"]) == {"hostavg-keras", "hostavg-keras-overlap", "keras-accum"}
        assert max(step["max_weight_diff"].values()) < 1e-5, step["max_weight_diff"]
    assert "| mlp-300k micro=32 k=4 | 4 |" in out.stdout


def trainer(model, **kw):
    return hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.Adam(0.01), **kw)


@jax_only
def test_an_embeddings_gradient_is_dense_on_jax():
    t = trainer(keras_model(sparse=True))
    d = batches(0, 1, 12, sparse=True)[0]
    g = t.compute(d["ids"], d["y"])
    table = t.model.get_layer("embedding").embeddings.path
    assert not t.spec[table].sparse
    assert isinstance(g[table], np.ndarray) and g[table].shape == (VOCAB, 6)
    untouched = np.setdiff1d(np.arange(VOCAB), d["ids"])
    assert not g[table][untouched].any() and g[table].any()


@jax_only
def test_gradients_land_in_reused_host_buffers_but_never_over_ones_still_held():
    t = trainer(keras_model())
    micro = [(d["x"], d["y"]) for d in batches(1, 6, 8)]
    first = t.compute(*micro[0])
    name = next(iter(t.spec))
    held, kept = first[name], np.array(first[name])
    addresses = []
    for m in micro[1:]:  # each dropped at once, as "sum" mode drops it once added
        addresses.append(t.compute(*m)[name].ctypes.data)
    assert len(set(addresses[1:])) <= 2  # two sets of buffers serve every compute
    assert held.ctypes.data not in addresses  # still held: never written again
    np.testing.assert_array_equal(held, kept)
    assert not held.flags.writeable


class Unused(keras.Model):
    """A Dense layer out, and a trainable one the loss never reaches."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(3, name="out")
        self.unused = keras.layers.Dense(4, name="unused")

    def build(self, shape):
        self.out.build(shape)
        self.unused.build(shape)

    def call(self, x):
        return self.out(x)


@jax_only
def test_a_variable_the_loss_does_not_depend_on_is_not_trained():
    model = Unused()
    t = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              keras.optimizers.AdamW(0.01, weight_decay=0.5))
    d = batches(2, 1, 16)[0]
    micro = hostavg.split((d["x"], d["y"]), 8)
    t.compute(*micro[0])  # builds the model
    before = [v.numpy() for v in model.unused.weights]
    t.step(micro)
    assert sorted(t.spec) == sorted(v.path for v in model.out.weights)
    for a, b in zip(before, model.unused.weights):  # AdamW would decay them on a zero gradient
        np.testing.assert_array_equal(a, b.numpy())


@jax_only
def test_bench_runs_the_keras_implementations_on_jax_against_keras_accumulation(tmp_path, capsys):
    from hostavg.cli.main import main
    out = tmp_path / "bench.json"
    assert main(["bench", "--grid", "smallest", "--no-memory", "--repeats", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["keras_backend"] == "jax"
    (config,) = result["configs"]
    assert set(config["median_s"]) == {"hostavg-keras", "keras-accum"}
    assert config["baseline"] == "keras-accum" and config["ratio_to_baseline"]["keras-accum"] == 1
    assert max(config["max_weight_diff"].values()) < 1e-5, config["max_weight_diff"]
    assert main(["bench", "--grid", "smallest", "--implementations", "hostavg-keras,in-graph"]) != 0
    assert "implementations ['in-graph'] are TF1 graphs" in capsys.readouterr().err


def test_a_keras_backend_without_a_hostavg_backend_is_refused_by_name(monkeypatch):
    model = keras_model()
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(hostavg.HostavgError, match=r"^hostavg.keras runs on Keras's tensorflow or "
                                                   r"jax backend, got 'torch'; set KERAS_BACKEND "
                                                   r"to one of them before importing keras$"):
        trainer(model)


def metric_trainer(*metrics):
    model = keras_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=list(metrics),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return hostavg.keras.Trainer(model)


@jax_only
def test_training_metrics_computed_in_one_call_are_keras_own_results():
    """The results of every compiled metric in one jitted call equal each metric's own
    ``result()``, bit for bit."""
    from hostavg.keras.common import CompiledModel
    t = metric_trainer("accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2),
                       keras.metrics.SparseCategoricalCrossentropy(from_logits=True))
    d = batches(0, 1, BATCH)[0]
    t.step(hostavg.split((d["x"], d["y"]), 10))
    backend = t._backend
    got, want = backend.training_results(), CompiledModel.training_results(backend)
    assert got.keys() == want.keys() and len(got) == 3
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)



def test_the_step_counts_from_optimizer_iterations_as_the_program_set_it():
    """The global step is read from ``optimizer.iterations`` where its value changed (on JAX
    only then: a JAX array never changes) and reported from the apply's own outputs."""
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    optimizer = keras.optimizers.SGD(0.1)
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), optimizer, update_ratios_every=1)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)
    steps = []
    for _ in range(3):
        before = [np.array(v) for v in model.trainable_variables]
        steps.append(trainer.step(hostavg.split((x, y), 8)))
        for v, w in zip(model.trainable_variables, before):  # |update| / |weights|, by hand
            with np.errstate(divide="ignore"):  # (the bias starts at 0: an infinite ratio)
                moved = np.linalg.norm(np.array(v) - w) / np.linalg.norm(w)
            assert steps[-1].update_ratios[v.path] == pytest.approx(moved, rel=1e-5)
    assert [r.step for r in steps] == [1, 2, 3]
    assert all(r.learning_rate == pytest.approx(0.1) for r in steps)
    optimizer.iterations.assign(41)  # as a restored checkpoint or the program itself would
    assert trainer.step(hostavg.split((x, y), 8)).step == 42
    assert int(optimizer.iterations.value) == 42



class ShapeScale(keras.layers.Layer):
    """Scales by 1 / (batch - 3), computed by NumPy as JAX traces it: raises for a batch of 3."""

    def call(self, x):
        if not isinstance(x.shape[0], int):  # Keras's symbolic build
            return x
        with np.errstate(all="raise"):
            return x * float(np.float32(1.0) / np.float32(x.shape[0] - 3))


def small(layer=None, optimizer=None):
    """A trainer of a small regression model (``layer`` first, where given; SGD(0.01) where no
    ``optimizer``), 20 rows of data, and a reader of its weights' and optimizer's values
    (copies: a NumPy view held of a variable would keep JAX from donating its buffer, as a
    user's program does not)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(layer(inputs) if layer else inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 4)).astype("float32"), rng.normal(size=(20, 1)).astype("float32")
    return (hostavg.keras.Trainer(model), (x, y),
            lambda: [np.array(v.value) for v in model.variables + model.optimizer.variables])


def assert_unchanged(before: list, after: list):
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


@jax_only
def test_a_floating_point_error_of_the_model_as_it_is_traced_is_the_models():
    """NumPy's FloatingPointError in the model's code, as JAX traces a new micro-batch size,
    refuses the micro-batch as the model's (not a failure as the call runs: that is JAX's
    FloatingPointError under jax_debug_nans only)."""
    trainer, data, values = small(ShapeScale())
    trainer.step(hostavg.split(data, 5))
    before = values()
    with pytest.raises(hostavg.ArgumentError, match="the model cannot run on this micro-batch "
                                                   r"\(FloatingPointError: divide by zero"):
        trainer.step(hostavg.split(data, 3))
    assert_unchanged(before, values())


@jax_only
@pytest.mark.parametrize("flag, rate", [("debug_nans", "nan"), ("debug_infs", "inf")])
def test_an_apply_gone_non_finite_under_jaxs_debug_flag_leaves_the_state_as_it_was(flag, rate):
    """Under jax_debug_nans (or _infs), JAX calls a compiled call with a non-finite output again
    op by op, on the same inputs: a donating apply's are gone by then. The apply then donates
    nothing; the step fails naming JAX's operation, the state is as before, the next step runs."""
    import jax  # (under TensorFlow this file imports no JAX)
    trainer, data, values = small()
    trainer.step(hostavg.split(data, 2))  # its apply compiled without the flag
    trainer.model.optimizer.learning_rate.assign(float(rate))
    before = values()
    with getattr(jax, flag)(True), pytest.raises(
            hostavg.StepError, match=rf"JAX failed in the apply \(invalid value \({rate}\)"):
        trainer.step(hostavg.split(data, 2))
    assert_unchanged(before, values())
    trainer.model.optimizer.learning_rate.assign(0.01)
    assert trainer.step(hostavg.split(data, 2)).step == 2


@jax_only
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_schedule_set_in_the_rate_variables_place_is_followed_and_read_by_the_applies(
        optimizer):
    """A schedule set as ``optimizer.learning_rate`` mid-run (Keras allows it once built, and
    untracks the rate variable: the optimizer's variables after it move up one) is followed
    as Keras's own fit follows it, slots too; after the step that finds it, the host no longer
    evaluates it (about 2 ms each): the compiled apply gives its next value."""
    def model():
        trainer, data, _ = small(optimizer={
            "sgd": lambda: keras.optimizers.SGD(0.01),
            "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer]())
        return trainer.model, data
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)
    keras_own, data = model()
    for i in range(5):
        keras_own.fit(*data, batch_size=20, epochs=1, verbose=0, shuffle=False)
        if i == 0:
            keras_own.optimizer.learning_rate = schedule
    mine, _ = model()
    trainer = hostavg.keras.Trainer(mine)
    calls = []

    class Counted(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            calls.append(step)
            return schedule(step)
    for i in range(5):
        trainer.step(hostavg.split(data, 10))
        if i == 0:
            mine.optimizer.learning_rate = Counted()
        if i == 2:
            calls.clear()
    assert calls == []  # (the last two steps)
    for a, b in zip(mine.variables + mine.optimizer.variables,
                    keras_own.variables + keras_own.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.array(a.value), np.array(b.value), rtol=1e-6, atol=1e-7)
