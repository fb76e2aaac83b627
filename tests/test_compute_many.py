"""Several micro-batches of a step computed in one call (``hostavg.engine.protocols.Many``).

The engine's side (:class:`hostavg.engine.overlap.Together`) is tested here on plain
functions. Keras's JAX backend computes a step's micro-batches by one ``jax.lax.scan`` of
its compute (:meth:`KerasJaxBackend.compute_many`); those tests run in CI's
``KERAS_BACKEND=jax`` step (see .ci/run) and hold it to the same step computed one
micro-batch a call: the weights, the optimizer's state, the moving statistics, the dropout
seed's state, the metrics, each micro-batch's gradients; bit for bit on a dense model, to
float32 rounding where XLA compiles the scan's body otherwise (a weight regularizer: an
ulp), and the error of a failed step, its culprits, what a hook sees. Only small computes
without a convolution compute several a call; any other's calls are dispatched in turn before
the first is read (JAX's asynchronous dispatch), and held to the same.
"""

import time

import keras
import numpy as np
import pytest
from models import BATCH, batches, keras_model

import hostavg
import hostavg.keras
from hostavg.core.gradients import is_frozen
from hostavg.engine.overlap import Together

ON_JAX = keras.backend.backend() == "jax"
jax_only = pytest.mark.skipif(not ON_JAX, reason="Keras runs on TensorFlow in this process; "
                                                 "CI's KERAS_BACKEND=jax step runs these")
SIZES = [10, 10, 10, 10]


# --- The engine's side, framework-free ------------------------------------------------------

class Calls:
    """A ``compute_many`` that takes at most ``most`` feeds a call and notes each call; raises
    a HostavgError where ``fails``."""

    def __init__(self, most: int = 10, fails: bool = False):
        self.most, self.fails, self.calls = most, fails, []

    def __call__(self, feeds, shares):
        self.calls.append((list(feeds), list(shares)))
        if self.fails:
            raise hostavg.StepError("the framework refused")
        return [(("computed", f, s), lambda f=f: ("after", f))
                for f, s in zip(feeds[:self.most], shares)]


def test_together_computes_from_the_first_asked_as_many_as_the_backend_takes():
    many = Calls(most=2)
    together = Together(many, ["a", "b", "c", "d", "e"], [0.1, 0.2, 0.3, 0.2, 0.2])
    got = [together.take(i) for i in range(5)]
    assert got[:4] == [("computed", f, s) for f, s in zip("abcd", [0.1, 0.2, 0.3, 0.2])]
    assert got[4] is None  # one left: computed alone
    assert [c[0] for c in many.calls] == [list("abcde"), list("cde")]
    assert [together.state_after(i) for i in range(5)] == [("after", f) for f in "abcd"] + [None]


def test_together_stops_at_a_micro_batch_left_out():
    many = Calls()
    together = Together(many, ["a", "b", None, "c", "d", None, "e"], [0.2] * 7)
    assert [together.take(i) is not None for i in (0, 1, 3, 4, 6)] == [True] * 4 + [False]
    assert [c[0] for c in many.calls] == [["a", "b"], ["c", "d"]]


def test_after_a_failed_call_every_micro_batch_left_computes_alone():
    """A call that fails assigned nothing: one at a time, the failure is named by its
    micro-batch; the step does not try the call again."""
    many = Calls(fails=True)
    together = Together(many, ["a", "b", "c"], [1 / 3] * 3)
    assert [together.take(i) for i in range(3)] == [None] * 3
    assert len(many.calls) == 1


def test_a_computation_given_as_a_function_is_read_as_it_is_taken():
    """A backend may return before its computes are done: each is read as the engine takes it,
    in order, so that those after it still compute while it is added."""
    read = []

    def many(feeds, shares):
        return [(lambda f=f: read.append(f) or ("computed", f), lambda f=f: ("after", f))
                for f in feeds]
    together = Together(many, ["a", "b", "c"], [1 / 3] * 3)
    assert together.take(0) == ("computed", "a") and read == ["a"]
    assert together.take(1) == ("computed", "b") and read == ["a", "b"]
    assert together.state_after(2) == ("after", "c") and read == ["a", "b"]


def test_a_backend_that_takes_none_leaves_each_to_compute_alone():
    many = Calls(most=0)
    together = Together(many, ["a", "b", "c"], [1 / 3] * 3)
    assert [together.take(i) for i in range(3)] == [None] * 3
    assert len(many.calls) == 1


# --- Keras on JAX --------------------------------------------------------------------------

def trainer_of(accumulate="stack", **kw):
    model = keras_model(seed=0, batch_norm=True, dropout=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return hostavg.keras.Trainer(model, accumulate=accumulate, **kw)


#: How a step's micro-batches compute: what of hostavg.keras.jax is set for each.
MODES = {"scan": {}, "in turn": {"TOGETHER_FLOPS": 0}, "one a call": {"TOGETHER_BYTES": 0}}


def computing(monkeypatch, mode: str) -> None:
    for name, value in MODES[mode].items():
        monkeypatch.setattr(f"hostavg.keras.jax.{name}", value)


class Spy:
    """Counts the backend's computes: one micro-batch a call, several a call (and whether
    those are read as they are taken: ``lazy``)."""

    def __init__(self, trainer, monkeypatch):
        backend, self.one, self.many, self.lazy = trainer._backend, [], [], []
        compute, compute_many = backend.compute, backend.compute_many

        def one(feed, share=1.0):
            self.one.append(share)
            return compute(feed, share)

        def many(feeds, shares):
            out = compute_many(feeds, shares)
            self.many.append(len(out))
            self.lazy.append(all(callable(computed) for computed, _ in out) and bool(out))
            return out
        monkeypatch.setattr(backend, "compute", one)
        monkeypatch.setattr(backend, "compute_many", many)


def state(trainer) -> dict:
    """Every variable's value by its position and its path less the numbers Keras appends to
    a name it has seen (two models have their own seed generators)."""
    model = trainer.model
    return {f"{i} {where}/{v.path.split('/')[-1]}": np.array(v.value)
            for where, variables in (("model", model.variables),
                                     ("optimizer", model.optimizer.variables),
                                     ("metric", model.metrics_variables))
            for i, v in enumerate(variables)}


def stepped(monkeypatch, mode: str, data) -> tuple:
    computing(monkeypatch, mode)
    trainer = trainer_of()
    spy = Spy(trainer, monkeypatch)
    results = [trainer.step(hostavg.split((d["x"], d["y"]), 10)) for d in data]
    monkeypatch.undo()
    return trainer, spy, results


@jax_only
@pytest.mark.parametrize("mode", ["scan", "in turn"])
def test_a_step_computed_in_one_call_is_the_step_one_call_a_micro_batch_bit_for_bit(
        monkeypatch, mode):
    data = batches(0, 3, BATCH)
    together, spy, results = stepped(monkeypatch, mode, data)
    assert spy.one == [] and spy.many == [4, 4, 4]
    assert spy.lazy == [mode == "in turn"] * 3
    apart, spy_apart, results_apart = stepped(monkeypatch, "one a call", data)
    assert len(spy_apart.one) == 12 and spy_apart.many == [0, 0, 0]
    a, b = state(together), state(apart)
    assert a.keys() == b.keys() and any("seed_generator" in k for k in a)
    assert any("moving_mean" in k for k in a) and any(" metric/" in k for k in a)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for got, want in zip(results, results_apart):
        assert got.loss == want.loss
        assert [m.loss for m in got.micro] == [m.loss for m in want.micro]
        for m, n in zip(got.micro, want.micro):
            for name in m.grads:
                np.testing.assert_array_equal(m.grads[name], n.grads[name], err_msg=name)


@jax_only
def test_a_regularized_step_in_one_call_is_the_step_one_call_a_micro_batch_to_rounding(
        monkeypatch):
    """XLA may compile a weight regularizer's sum otherwise within the scan than alone: a
    ulp or so apart, never more."""
    layers = keras.layers
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, (40, 6)).astype(np.float32), rng.integers(0, 3, 40)

    def stepped_l2(one_a_call: bool):
        if one_a_call:
            monkeypatch.setattr("hostavg.keras.jax.TOGETHER_BYTES", 0)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = layers.Dense(16, activation="tanh", name="hidden")(inputs)
        h = layers.Dense(8, kernel_regularizer="l2", name="regularized")(h)
        model = keras.Model(inputs, layers.Dense(3, name="out")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        trainer = hostavg.keras.Trainer(model, accumulate="stack")
        spy = Spy(trainer, monkeypatch)
        results = [trainer.step(hostavg.split((x, y), 10)) for _ in range(3)]
        monkeypatch.undo()
        return trainer, spy.many, results

    (together, many, results), (apart, _, results_apart) = stepped_l2(False), stepped_l2(True)
    assert many == [4, 4, 4]
    a, b = state(together), state(apart)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for got, want in zip(results, results_apart):
        for m, n in zip(got.micro, want.micro):
            assert m.loss == pytest.approx(n.loss, rel=1e-6)
            for name in m.grads:
                np.testing.assert_allclose(m.grads[name], n.grads[name], rtol=1e-5, atol=1e-6,
                                           err_msg=name)


@jax_only
@pytest.mark.parametrize("large", ["convolution", "flops"])
def test_a_large_or_convolving_compute_is_dispatched_in_turn(monkeypatch, large):
    """XLA's CPU runs a convolution inside the scan's loop several times slower, and a large
    compute gains little from a dispatch saved: each micro-batch has a call of its own, all
    made before the first is read."""
    layers = keras.layers
    rng = np.random.default_rng(6)
    x, y = rng.normal(0, 1, (32, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, 32)
    inputs = keras.Input((6, 6, 1))
    if large == "convolution":  # a tiny one: a few thousand operations
        h = layers.Flatten()(layers.Conv2D(2, 3)(inputs))
    else:
        monkeypatch.setattr("hostavg.keras.jax.TOGETHER_FLOPS", 1000)
        h = layers.Dense(8)(layers.Flatten()(inputs))
    model = keras.Model(inputs, layers.Dense(3)(h))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    trainer = hostavg.keras.Trainer(model)
    spy = Spy(trainer, monkeypatch)
    trainer.step(hostavg.split((x, y), 8))
    assert spy.many == [4] and spy.lazy == [True] and spy.one == []


@jax_only
def test_micro_batches_of_another_shape_compute_apart(monkeypatch):
    """The last micro-batch of 30 samples cut by 12 has 6: the first two compute in one call,
    it in one of its own."""
    (data,) = batches(1, 1, 30)
    trainer = trainer_of()
    spy = Spy(trainer, monkeypatch)
    result = trainer.step(hostavg.split((data["x"], data["y"]), 12))
    assert spy.many == [2] and spy.one == [pytest.approx(6 / 30)]
    assert [m.size for m in result.micro] == [12, 12, 6]


@jax_only
def test_large_gradients_compute_one_a_call(monkeypatch):
    gradient = sum(np.asarray(v).nbytes for v in trainer_of().model.trainable_variables)
    monkeypatch.setattr("hostavg.keras.jax.TOGETHER_BYTES", 2 * gradient - 1)
    trainer = trainer_of()
    spy = Spy(trainer, monkeypatch)
    (data,) = batches(2, 1, BATCH)
    trainer.step(hostavg.split((data["x"], data["y"]), 10))
    assert spy.many == [0] and len(spy.one) == 4


@jax_only
@pytest.mark.parametrize("mode", ["scan", "in turn"])
def test_gradients_handed_out_are_read_only_rows_of_no_one_elses_buffer(monkeypatch, mode):
    """Nor are they written again by the steps after (whose computes donate earlier
    gradient buffers to XLA)."""
    computing(monkeypatch, mode)
    trainer = trainer_of()
    data = batches(3, 3, BATCH)
    result = trainer.step(hostavg.split((data[0]["x"], data[0]["y"]), 10))
    kept = [{name: np.array(g) for name, g in m.grads.items()} for m in result.micro]
    for m in result.micro:
        for name, g in m.grads.items():
            assert is_frozen(g), name
            with pytest.raises(ValueError):
                g[...] = 0
    for d in data[1:]:
        trainer.step(hostavg.split((d["x"], d["y"]), 10))
    for m, k in zip(result.micro, kept):
        for name, g in m.grads.items():
            np.testing.assert_array_equal(g, k[name], err_msg=name)


@jax_only
@pytest.mark.parametrize("mode", ["scan", "in turn"])
def test_a_nan_in_the_third_micro_batch_is_named_there_and_nothing_moves(monkeypatch, mode):
    computing(monkeypatch, mode)
    trainer = trainer_of(accumulate="sum")
    (warm,) = batches(4, 1, BATCH)
    trainer.step(hostavg.split((warm["x"], warm["y"]), 10))
    before = state(trainer)
    (data,) = batches(5, 1, BATCH)
    data["x"][23, 1] = np.nan
    spy = Spy(trainer, monkeypatch)
    with pytest.raises(hostavg.StepError) as caught:
        trainer.step(hostavg.split((data["x"], data["y"]), 10))
    assert caught.value.micro_batch == 2 and "sample 23 of the step" in str(caught.value)
    assert spy.many[:1] == [4]
    after = state(trainer)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


@jax_only
@pytest.mark.parametrize("mode", ["scan", "in turn"])
def test_a_nan_under_jax_debug_nans_is_named_by_its_micro_batch_and_sample(monkeypatch, mode):
    """JAX raises a FloatingPointError where a compiled call's output is NaN: a failure as it
    runs, named by its micro-batch and sample as a non-finite gradient is, also where the
    scan of these shapes ran before; nothing moves."""
    import jax
    computing(monkeypatch, mode)
    trainer = trainer_of(accumulate="sum")
    (warm, data) = batches(4, 2, BATCH)
    trainer.step(hostavg.split((warm["x"], warm["y"]), 10))
    before = state(trainer)
    data["x"][23, 1] = np.nan
    with jax.debug_nans(True), pytest.raises(hostavg.StepError) as caught:
        trainer.step(hostavg.split((data["x"], data["y"]), 10))
    assert caught.value.micro_batch == 2 and "sample 23 of the step" in str(caught.value)
    assert "JAX failed in the compute (invalid value (nan) encountered in" in str(caught.value)
    after = state(trainer)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


#: How a step of computes dispatched in turn fails, and at which micro-batch (of 4 in one
#: call; of 8, 4 a call, for the second call's, made with buffers the first left to reuse).
FAILURES = {"its own NaN": 0, "a failure as it runs": 0, "a failure as its call is made": 2,
            "a failure as the second call's is made": 5}


@jax_only
@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_step_held_by_its_error_holds_no_other_computes_gradients(monkeypatch, failure):
    """While the error a user keeps (a notebook keeps the last one) is held, with its
    traceback, no gradients of the step's other computes live on: neither those dispatched
    and not taken nor those taken before it (freed, or donated to the culprit search's), nor
    the buffers a failed call was to reuse; only the two sets the backend keeps to reuse."""
    import gc
    import weakref

    import jax
    computing(monkeypatch, "in turn")
    trainer = tripwired() if failure.endswith("made") else trainer_of(accumulate="sum")
    second = failure.startswith("a failure as the second")
    (warm, data) = batches(5, 2, 2 * BATCH if second else BATCH)
    trainer.step(hostavg.split((warm["x"], warm["y"]), 10))
    backend, outputs, x = trainer._backend, [], data["x"].copy()
    if second:  # four computes a call
        monkeypatch.setattr("hostavg.keras.jax.TOGETHER_BYTES", 4 * sum(
            int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in backend.spec.values()))
    called, compute_many, wait = backend._called, backend.compute_many, jax.block_until_ready

    def calling(function, *arguments):  # within compute_many: the computes in turn
        out = called(function, *arguments)
        if len(out) == 5:  # their gradients third
            outputs.append([weakref.ref(g) for g in out[2]])
        return out

    def many(feeds, shares):
        monkeypatch.setattr(backend, "_called", calling)
        try:
            return compute_many(feeds, shares)
        finally:
            monkeypatch.setattr(backend, "_called", called)

    def failing(out):
        raise jax.errors.JaxRuntimeError("INTERNAL: the device failed")
    monkeypatch.setattr(backend, "compute_many", many)
    if failure == "its own NaN":
        x[3, 1] = np.nan
    elif failure == "a failure as it runs":
        monkeypatch.setattr(jax, "block_until_ready", failing)
    else:
        x[10 * FAILURES[failure] + 5, 0] = 1e4  # the Tripwire's
    with pytest.raises(hostavg.StepError) as caught:
        trainer.step(hostavg.split((x, data["y"]), 10))
    monkeypatch.setattr(jax, "block_until_ready", wait)

    def held() -> list:
        gc.collect()
        kept = {id(g) for gradients in backend._ring for g in gradients}  # (the backend's own)
        return [j for j, refs in enumerate(outputs) if j != FAILURES[failure] and any(
            ref() is not None and not ref().is_deleted() and id(ref()) not in kept
            for ref in refs)]
    assert caught.value.micro_batch == FAILURES[failure]
    assert len(outputs) >= FAILURES[failure] and held() == []  # (a failed call made none)


def failing_at(monkeypatch, mode: str, nth: int):
    """The StepError of a step whose ``nth`` wait for a JAX result fails (a run-time failure
    JAX raises where the result is waited for), the state before and after it."""
    import jax
    computing(monkeypatch, mode)
    trainer = trainer_of(accumulate="sum")
    (warm, data) = batches(4, 2, BATCH)
    trainer.step(hostavg.split((warm["x"], warm["y"]), 10))
    before, waits, wait = state(trainer), [], jax.block_until_ready

    def failing(x):
        waits.append(1)
        if len(waits) == nth:
            raise jax.errors.JaxRuntimeError("INTERNAL: the device failed")
        return wait(x)
    monkeypatch.setattr(jax, "block_until_ready", failing)
    spy = Spy(trainer, monkeypatch)
    with pytest.raises(hostavg.StepError) as caught:
        trainer.step(hostavg.split((data["x"], data["y"]), 10))
    monkeypatch.undo()
    return caught.value, spy, before, state(trainer)


@jax_only
def test_a_compute_dispatched_in_turn_that_fails_as_it_runs_is_named_and_nothing_moves(
        monkeypatch):
    """Micro-batch 2's failure shows where its result is waited for, after its call and
    those after it were made: the step raises what one call a micro-batch raises, and
    leaves no trace."""
    error, spy, before, after = failing_at(monkeypatch, "in turn", 3)
    alone, _, _, _ = failing_at(monkeypatch, "one a call", 3)
    assert spy.many[:1] == [4] and spy.lazy[:1] == [True]
    assert error.micro_batch == alone.micro_batch == 2
    assert str(error) == str(alone)
    assert str(error).startswith("step, micro-batch 2 of 4 (samples 20:30): JAX failed in the "
                                 "compute (INTERNAL: the device failed)")
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


class Tripwire(keras.layers.Layer):
    """Raises on the host, where JAX's CPU runs a callback as the call is made, for a whole
    micro-batch (10 samples, not a search's few) with an input over 1e3; notes each run."""

    runs = []

    def call(self, x):
        import jax

        def check(v):
            if v.shape[0] == 10 and np.any(np.asarray(v) > 1e3):
                Tripwire.runs.append(1)
                raise RuntimeError("tripwire")
        jax.debug.callback(check, x)
        return x


def tripwired():
    """A trainer (sums, SGD) of a small model whose Tripwire refuses an input over 1e3."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="tanh")(Tripwire()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return hostavg.keras.Trainer(model, accumulate="sum")


@jax_only
def test_a_compute_that_fails_as_its_call_is_made_runs_once_and_is_named(monkeypatch):
    def failed(mode: str):
        computing(monkeypatch, mode)
        trainer = tripwired()
        (warm, data) = batches(4, 2, BATCH)
        trainer.step(hostavg.split((warm["x"], warm["y"]), 10))
        before, x = state(trainer), data["x"].copy()
        x[25, 0] = 1e4
        Tripwire.runs.clear()
        with pytest.raises(hostavg.StepError) as caught:
            trainer.step(hostavg.split((x, data["y"]), 10))
        monkeypatch.undo()
        after = state(trainer)
        for name in before:
            np.testing.assert_array_equal(before[name], after[name], err_msg=name)
        return caught.value, len(Tripwire.runs)

    (error, runs), (alone, runs_alone) = failed("in turn"), failed("one a call")
    assert runs == runs_alone == 1
    assert error.micro_batch == alone.micro_batch == 2 and str(error) == str(alone)
    assert str(error).startswith("step, micro-batch 2 of 4 (samples 20:30): ")


@jax_only
def test_a_scan_that_fails_as_it_runs_on_bad_data_is_tried_again_on_the_next_step(monkeypatch):
    """A run-time failure of a step's first scan (a sample the model refuses) is the data's,
    not the scan's: the step fails by name as computes dispatched in turn do, and the next
    step of these shapes computes in one scan again; a second such failure of a scan that
    never ran leaves them in turn for good (a failure only the scan meets costs no more)."""
    trainer = tripwired()
    spy = Spy(trainer, monkeypatch)
    data = batches(4, 4, BATCH)
    bad = [d["x"].copy() for d in data]
    for x in bad:
        x[25, 0] = 1e4
    with pytest.raises(hostavg.StepError) as caught:
        trainer.step(hostavg.split((bad[0], data[0]["y"]), 10))
    assert caught.value.micro_batch == 2
    trainer.step(hostavg.split((data[1]["x"], data[1]["y"]), 10))
    assert spy.many == [3, 4] and spy.lazy == [True, False]  # in turn, then scanned
    trainer = tripwired()
    spy = Spy(trainer, monkeypatch)
    for x, d in zip(bad[:2], data[:2]):
        with pytest.raises(hostavg.StepError):
            trainer.step(hostavg.split((x, d["y"]), 10))
    trainer.step(hostavg.split((data[2]["x"], data[2]["y"]), 10))
    assert spy.many == [3, 3, 4] and spy.lazy == [True, True, True]  # for good


@jax_only
def test_gradients_are_viewed_before_another_compute_may_donate_them(monkeypatch):
    """A lone compute of another thread donates the ring's buffers: were a compute's arrays
    there before NumPy viewed them, JAX could delete them first."""
    import hostavg.keras.jax as on_jax
    computing(monkeypatch, "in turn")
    trainer = trainer_of()
    backend, host, seen = trainer._backend, on_jax._host, []

    def viewing(array):
        seen.append(any(array is held for grads in backend._ring for held in grads))
        return host(array)
    monkeypatch.setattr(on_jax, "_host", viewing)
    for d in batches(9, 2, BATCH):
        trainer.step(hostavg.split((d["x"], d["y"]), 10))
        trainer.compute(d["x"][:10], d["y"][:10])
    assert len(seen) > 8 and not any(seen) and backend.reuses_buffers


@jax_only
def test_a_scan_that_does_not_trace_leaves_the_computes_dispatched_in_turn(monkeypatch):
    """Tried once per compute and count: the trainer then dispatches each micro-batch's
    compute in turn, and does not try the scan again."""
    import jax
    tried = []

    def refused(*args, **kwargs):
        tried.append(1)
        raise NotImplementedError("no scan here")
    trainer = trainer_of()
    monkeypatch.setattr(jax.lax, "scan", refused)
    spy = Spy(trainer, monkeypatch)
    for data in batches(6, 2, BATCH):
        trainer.step(hostavg.split((data["x"], data["y"]), 10))
    assert tried == [1] and spy.many == [4, 4] and spy.lazy == [True, True] and spy.one == []


@jax_only
@pytest.mark.parametrize("mode", ["scan", "in turn"])
def test_the_samples_of_a_failed_micro_batch_are_searched_from_the_state_its_compute_left(
        monkeypatch, mode):
    """A finite input that overflows behind a dropout: whether a sample is non-finite alone
    depends on the masks the search draws, so it must draw them from the seed state that
    micro-batch's compute left, not the state after the call's last micro-batch."""
    rng = np.random.default_rng(2)
    data = [(rng.normal(0, 1, (40, 6)).astype(np.float32), rng.integers(0, 3, 40).astype(np.int32))
            for _ in range(3)]
    data[2][0][25, 1] = 3e38
    layers = keras.layers

    def failed(mode: str):
        computing(monkeypatch, mode)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        h = layers.Dense(16, activation="tanh", name="hidden")(layers.Dropout(0.5)(inputs))
        h = layers.Dropout(0.3)(layers.BatchNormalization(name="bn")(h))
        model = keras.Model(inputs, layers.Dense(3, name="out")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        trainer = hostavg.keras.Trainer(model)
        for d in data[:2]:
            trainer.step(hostavg.split(d, 10))
        with pytest.raises(hostavg.StepError) as caught:
            trainer.step(hostavg.split(data[2], 10))
        monkeypatch.undo()
        return caught.value, state(trainer)

    (error, after), (alone, after_alone) = failed(mode), failed("one a call")
    assert error.micro_batch == alone.micro_batch == 2
    assert str(error) == str(alone) and error.culprits == alone.culprits
    for name in after:
        np.testing.assert_array_equal(after[name], after_alone[name], err_msg=name)


class Seen:
    """An ``on_micro_batch`` hook that reads the model's non-trainable values (the dropout
    seed's state): unless it says otherwise, it must see them as its micro-batch left them."""

    drops = False

    def __init__(self, model, reads_model=None):
        self.model, self.seen = model, []
        if reads_model is not None:
            self.reads_model = reads_model

    def on_micro_batch(self, micro):
        self.seen.append([np.asarray(v).copy() for v in self.model.non_trainable_variables])


@jax_only
@pytest.mark.parametrize("reads_model", [None, False])
def test_a_hook_that_may_read_the_model_sees_it_as_its_micro_batch_left_it(monkeypatch,
                                                                          reads_model):
    (data,) = batches(7, 1, BATCH)

    def seen(one_a_call: bool):
        if one_a_call:
            monkeypatch.setattr("hostavg.keras.jax.TOGETHER_BYTES", 0)
        trainer = trainer_of()
        hook = Seen(trainer.model, reads_model)
        trainer = hostavg.keras.Trainer(trainer.model, hooks=[hook])
        spy = Spy(trainer, monkeypatch)
        trainer.step(hostavg.split((data["x"], data["y"]), 10))
        monkeypatch.undo()
        return hook.seen, spy.many

    (together, many), (apart, _) = seen(False), seen(True)
    if reads_model is None:  # it may read the model: one compute a call
        assert many == []
        for a, b in zip(together, apart):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    else:  # it said it reads only the record: one call, and the model as the last left it
        assert many == [4]
        assert all(np.array_equal(x, y) for x, y in zip(together[0], apart[-1]))


@jax_only
def test_hostavgs_hooks_that_never_drop_nor_read_the_model_leave_the_step_one_call(
        monkeypatch, tmp_path):
    """Record and ClipMicroBatchNorm say so (``drops = False``, ``reads_model = False``): a
    hook that may drop needs a snapshot before each compute, which one call cannot give."""
    (data,) = batches(7, 1, BATCH)
    trainer = trainer_of()
    hooks = [hostavg.hooks.Record(tmp_path / "run"), hostavg.hooks.ClipMicroBatchNorm(1e6)]
    trainer = hostavg.keras.Trainer(trainer.model, hooks=hooks)
    spy = Spy(trainer, monkeypatch)
    trainer.step(hostavg.split((data["x"], data["y"]), 10))
    assert spy.many == [4] and spy.one == []
    assert [h.drops for h in hooks] == [False, False]
    assert getattr(hostavg.hooks.SkipNonFinite(), "drops", True)  # which drops


@jax_only
def test_a_model_that_refuses_a_new_micro_batch_size_is_refused_by_name():
    """The scan is traced per shape: a model that traces at 10 samples and refuses 12 gets the
    ArgumentError of a compute one a call, naming the micro-batch."""
    layers = keras.layers

    class AtMostTen(layers.Layer):
        def call(self, x):
            if isinstance(x.shape[0], int) and x.shape[0] > 10:
                raise ValueError(f"batches of at most 10, got {x.shape[0]}")
            return x

    inputs = keras.Input((6,))
    model = keras.Model(inputs, layers.Dense(3)(AtMostTen()(layers.Dense(8)(inputs))))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    trainer = hostavg.keras.Trainer(model)
    (data,) = batches(8, 1, 48)
    trainer.step(hostavg.split((data["x"][:40], data["y"][:40]), 10))
    before = state(trainer)
    with pytest.raises(hostavg.ArgumentError, match=r"^step, micro-batch 0 of 4 \(samples 0:12\): "
                                                     r"the model cannot run on this micro-batch "
                                                     r"\(ValueError: batches of at most 10"):
        trainer.step(hostavg.split((data["x"], data["y"]), 12))
    after = state(trainer)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def jitted_results_calls(backend, monkeypatch) -> list:
    """Notes each call of the backend's jitted metric results (a call apart from the scan)."""
    calls, results_function = [], backend._results_function

    def noted(variables):
        key, results, metrics = results_function(variables)
        jitted, plain, _ = backend._results[key]
        if not getattr(jitted, "noted", False):
            def call(values):
                calls.append(len(values))
                return jitted(values)
            call.noted = True
            backend._results[key] = (call, plain, metrics)
        return key, results, metrics
    monkeypatch.setattr(backend, "_results_function", noted)
    return calls


def keras_own_results(trainer) -> dict:
    from hostavg.keras.common import CompiledModel
    return CompiledModel.training_results(trainer._backend)


@jax_only
def test_a_steps_metric_results_come_from_its_scan_and_are_keras_own(monkeypatch):
    """The scan returns the metrics' results on the values it leaves: read after the step, they
    are each metric's own ``result()`` bit for bit, with no call of their own; where the
    metric variables hold other values since (a reset, a rolled-back step), they are computed
    anew from those."""
    trainer = trainer_of()
    backend = trainer._backend
    calls = jitted_results_calls(backend, monkeypatch)
    spy = Spy(trainer, monkeypatch)
    data = batches(3, 3, BATCH)
    trainer.step(hostavg.split((data[0]["x"], data[0]["y"]), 10))
    got, want = backend.training_results(), keras_own_results(trainer)
    assert spy.many == [4] and calls == [] and got == want and 0 < got["accuracy"] < 1
    trainer.model.reset_metrics()
    assert backend.training_results() == keras_own_results(trainer) == {"accuracy": 0.0}
    assert len(calls) == 1

    trainer.step(hostavg.split((data[1]["x"], data[1]["y"]), 10))
    kept = backend.training_results()
    bad = {k: v.copy() for k, v in data[2].items()}
    bad["x"][25, 0] = np.nan  # micro-batch 2 of the scan fails: the step rolls back
    with pytest.raises(hostavg.StepError):
        trainer.step(hostavg.split((bad["x"], bad["y"]), 10))
    assert backend.training_results() == keras_own_results(trainer) == kept
    assert len(calls) == 2


@jax_only
def test_the_learning_rate_is_read_once_until_its_value_changes(monkeypatch):
    """The proof's learning rate is the variable's: the apply reports it, and it is read on
    the host only where the variable's value is not the array the last apply left (a callback
    that sets it), to be seen at the next step."""
    from hostavg.keras.common import CompiledModel
    reads, read = [], CompiledModel._rate_bound
    monkeypatch.setattr(CompiledModel, "_rate_bound",
                        lambda self, feed: reads.append(read(self, feed)) or reads[-1])
    trainer = trainer_of()
    backend = trainer._backend
    for d in batches(3, 3, BATCH):
        trainer.step(hostavg.split((d["x"], d["y"]), 10))
        assert backend._rate_bound(None) == np.float32(0.01)
    assert reads == []
    trainer.model.optimizer.learning_rate.assign(0.25)
    assert backend._rate_bound(None) == 0.25 and reads == [0.25]
    assert backend._rate_bound(None) == 0.25 and len(reads) == 1
    (d,) = batches(6, 1, BATCH)
    trainer.step(hostavg.split((d["x"], d["y"]), 10))
    assert backend._rate_bound(None) == 0.25 and len(reads) == 1


@jax_only
@pytest.mark.parametrize("check_applied", [True, False])
def test_a_schedule_given_for_the_rate_after_steps_is_what_the_next_apply_uses(check_applied):
    """``optimizer.learning_rate = schedule`` (Keras's setter) after steps of a variable rate:
    the next step applies at the schedule's rate and reports it, checked or not."""
    model = keras_model(seed=0)
    model.compile(optimizer=keras.optimizers.SGD(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = hostavg.keras.Trainer(model, check_applied=check_applied)
    data = batches(3, 4, BATCH)
    for d in data[:3]:
        trainer.step(hostavg.split((d["x"], d["y"]), 10))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    model.optimizer.learning_rate = schedule
    result = trainer.step(hostavg.split((data[3]["x"], data[3]["y"]), 10))
    assert result.learning_rate == pytest.approx(float(schedule(3)))
    assert int(model.optimizer.iterations) == 4


class Untraced(keras.metrics.Mean):
    """A metric whose ``result()`` reads its value on the host: it cannot trace."""

    def result(self):
        return float(np.asarray(super().result()))


class OwnTrainStep(keras.Model):
    """A model with its own stateless ``train_step``, which updates a metric of its own."""

    def train_step(self, state, data):
        import jax
        trainable, non_trainable, optimizer_values, metric_values = state
        x, y = data

        def loss_of(values):
            y_pred, new = self.stateless_call(values, non_trainable, x, training=True)
            return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
                y, y_pred, from_logits=True)), new
        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        trainable, optimizer_values = self.optimizer.stateless_apply(optimizer_values, grads,
                                                                     trainable)
        with keras.StatelessScope(state_mapping=list(zip(self.metrics_variables,
                                                         metric_values))) as scope:
            self.tracker.update_state(loss)
        metric_values = [scope.get_current_value(v) for v in self.metrics_variables]
        return {"loss": loss}, (trainable, non_trainable, optimizer_values, metric_values)


@jax_only
@pytest.mark.filterwarnings("ignore:The structure of `inputs`:UserWarning")
@pytest.mark.parametrize("metric", [keras.metrics.Mean, Untraced])
def test_a_model_with_its_own_train_step_computes_a_step_in_one_call(monkeypatch, metric):
    """Its logs are its train_step's own: the scan computes no metric results, so a metric
    whose ``result()`` cannot trace leaves the step one call."""
    base = keras_model(seed=0)
    model = OwnTrainStep(base.inputs, base.outputs)
    model.tracker = metric(name="tracker")
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    trainer = hostavg.keras.Trainer(model, accumulate="stack")
    spy = Spy(trainer, monkeypatch)
    for d in batches(3, 2, BATCH):
        result = trainer.step(hostavg.split((d["x"], d["y"]), 10))
    assert spy.many == [4, 4] and spy.one == [] and np.isfinite(result.loss)


@jax_only
@pytest.mark.filterwarnings("ignore:The structure of `inputs`:UserWarning")
def test_a_model_with_its_own_train_step_dispatched_in_turn_is_its_step_one_a_call(monkeypatch):
    """Its logs too: each read as the engine takes its micro-batch, the last one's kept."""
    def stepped(mode: str):
        computing(monkeypatch, mode)
        base = keras_model(seed=0, dropout=True)
        model = OwnTrainStep(base.inputs, base.outputs)
        model.tracker = keras.metrics.Mean(name="tracker")
        model.compile(optimizer=keras.optimizers.SGD(0.01))
        trainer = hostavg.keras.Trainer(model, accumulate="stack")
        spy = Spy(trainer, monkeypatch)
        results = [trainer.step(hostavg.split((d["x"], d["y"]), 10)) for d in batches(3, 2, BATCH)]
        logs = trainer._backend.training_results()
        monkeypatch.undo()
        return state(trainer), spy, results, logs

    (a, spy, results, logs), (b, _, results_apart, logs_apart) = \
        stepped("in turn"), stepped("one a call")
    assert spy.many == [4, 4] and spy.lazy == [True, True] and spy.one == []
    assert logs == logs_apart and set(logs) == {"loss"}
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for got, want in zip(results, results_apart):
        assert [m.loss for m in got.micro] == [m.loss for m in want.micro]


@jax_only
def test_a_compute_beside_an_apply_of_another_thread_reads_values_the_apply_left_alone():
    """An apply donates the old weights' buffers (JAX deletes those arrays): a compute of
    another thread that has read them makes its call before the apply may start."""
    import threading
    trainer = trainer_of(accumulate="sum")
    backend = trainer._backend
    (data,) = batches(10, 1, BATCH)
    x, y = data["x"][:10], data["y"][:10]
    trainer.step(hostavg.split((data["x"], data["y"]), 10))
    grads = {name: np.array(g) for name, g in trainer.compute(x, y).items()}
    read, values, errors, computed = threading.Event(), backend._values, [], []

    def reading():  # the compute's read of the values, then a pause before its call
        out = values()
        read.set()
        time.sleep(0.5)  # an apply of the other thread now would donate what it read
        return out

    def compute():
        try:
            computed.append(trainer.compute(x, y))
        except Exception as e:  # noqa: BLE001 - the assertion shows it
            errors.append(e)
    backend._values = reading
    lone = threading.Thread(target=compute)
    lone.start()
    assert read.wait(timeout=30)
    backend._values = values
    trainer.apply(grads)
    lone.join(timeout=30)
    assert errors == [] and len(computed) == 1
