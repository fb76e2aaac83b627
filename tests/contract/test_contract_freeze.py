"""Freeze leaves the variables it names AND their optimizer slots bit for bit as before each frozen
step, on every backend; every other variable trains as the framework's own full-batch step of a
model where the frozen ones are not trained (tolerance: test_contract_exact's, 1e-5 after 3
steps); zeroing a gradient instead does not freeze under Adam.

The MLP's hidden layer is frozen ("hidden/*": its kernel and bias): its slots are the values'
names that hold "hidden/" (TF1: "hidden/kernel/Adam") or begin "optimizer/hidden_" (Keras:
"optimizer/hidden_kernel_momentum").
"""

import re

import numpy as np
import pytest
from backends import BATCH, SIZES, message_with_notes, same
from models import batches

import hostavg
from hostavg.hooks import Freeze, SkipNonFinite

ATOL = 1e-5
FROZEN = ("hidden/kernel", "hidden/bias")
QUIET = {"watch_outliers": False, "diagnose": False}


def frozen_keys(values: dict) -> set:
    """The names in ``values`` of the hidden layer's variables and of their slots."""
    return {k for k in values if k.startswith(("hidden/", "optimizer/hidden_"))}


def no_weight_decay_in_tf1(backend, optimizer):
    if optimizer == "adamw" and backend.id == "tf1":
        pytest.skip("tf.compat.v1.train has no optimizer with weight decay")


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "adamw"])
def test_freezing_every_step_keeps_the_layer_and_its_slots_and_trains_the_rest_as_the_framework(
        backend, optimizer):
    no_weight_decay_in_tf1(backend, optimizer)
    face = backend.make("mlp", optimizer, hooks=[Freeze("hidden/*")], **QUIET)
    before = face.values()
    data = batches(0, 3, BATCH)
    results = [face.step(face.cut(d, SIZES)) for d in data]
    got = face.values()
    want = backend.oracle("mlp", optimizer, data, untrained=FROZEN)
    slots = set(got) - set(want)  # the frozen variables' slots, which the oracle never made
    assert slots == frozen_keys(got) - set(FROZEN) and len(slots) == 2 * (
        1 + (optimizer != "momentum")), slots
    same({k: got[k] for k in want}, want, atol=ATOL, skip=face.assigned())
    for name in FROZEN:  # (want holds their initial values, untrained)
        assert np.array_equal(got[name], before[name]), name
    for name in slots:  # TF1 makes them with the initializer; Keras at the first apply
        assert np.array_equal(got[name], before.get(name, np.zeros_like(got[name]))), name
    assert [r.step for r in results] == [1, 2, 3]


def test_freezing_chosen_steps_keeps_the_layer_and_its_slots_as_before_those_steps(backend):
    """steps={2, 3}: steps 1 and 4 train the layer; 2 and 3 leave it and Adam's moments of it as
    step 1 left them, bit for bit, while the rest and the optimizer's counters move."""
    face = backend.make("mlp", "adam", hooks=[Freeze(["hidden/kernel", "hidden/b*"], steps={2, 3})],
                        update_ratios_every=1, **QUIET)
    data = batches(1, 4, BATCH)
    first = face.step(face.cut(data[0], SIZES))
    after_first = face.values()
    keys = frozen_keys(after_first)
    assert len(keys) == 6 and all(np.any(after_first[k]) for k in keys - {"hidden/bias"})
    frozen = [face.step(face.cut(d, SIZES)) for d in data[1:3]]
    now = face.values()
    for k in keys:
        assert np.array_equal(now[k], after_first[k]), k
    assert all(not np.array_equal(now[k], after_first[k]) for k in now
               if k not in keys and ("out/" in k or "out_" in k or "iteration" in k
                                     or k in ("global_step", "beta1_power", "beta2_power")))
    last = face.step(face.cut(data[3], SIZES))
    moved = face.values()
    assert all(not np.array_equal(moved[k], now[k]) for k in keys), keys
    assert [r.step for r in (first, *frozen, last)] == [1, 2, 3, 4]
    for r in (first, last):
        assert all(r.update_ratios[n] > 0 for n in FROZEN)
    for r in frozen:
        assert all(r.update_ratios[n] == 0 for n in FROZEN)
        assert all(r.update_ratios[n] > 0 for n in ("out/kernel", "out/bias"))


class ZeroHidden:
    """Zeroes the hidden layer's mean gradient before the apply of step 2: the docs' old
    "freeze"."""

    def on_step(self, mean, result):
        if result.step != 2:
            return None
        return {n: np.zeros_like(g) if n in FROZEN else g for n, g in mean.items()}


@pytest.mark.parametrize("hook", [ZeroHidden, lambda: Freeze("hidden/*", steps={2})],
                         ids=["zero", "freeze"])
def test_zeroing_a_gradient_moves_the_variable_under_adam_and_freezing_does_not(backend, hook):
    """After an Adam step, m and v of the layer are not 0: a zero gradient still moves it by
    lr m_hat / (sqrt(v_hat) + eps) (about the learning rate, 1e-2, per entry) and decays its
    moments; Freeze leaves both."""
    data = batches(2, 2, BATCH)
    face = backend.make("mlp", "adam", hooks=[hook()], **QUIET)
    face.step(face.cut(data[0], SIZES))
    before = face.values()
    face.step(face.cut(data[1], SIZES))
    now = face.values()
    kept = [np.array_equal(now[k], before[k]) for k in sorted(frozen_keys(before))]
    assert kept == [hook is not ZeroHidden] * 6, kept
    if hook is ZeroHidden:
        assert 1e-3 < np.max(np.abs(now["hidden/kernel"] - before["hidden/kernel"])) <= 1.1e-2


def test_a_pattern_that_matches_nothing_or_a_name_not_trained_is_refused_and_changes_nothing(
        backend):
    class Names:
        def frozen(self, step, names):
            return ("hidden/kernel", "no/such")

    data = batches(3, 1, BATCH)[0]
    for hook, said in ((Freeze(["hidden/*", "hiden/*"]), "Freeze: 'hiden/*' matches no trained "
                        "variable; the trained variables: ['"),
                       (Names(), "hook Names's frozen(1) named ['no/such'], which is not "
                        "trained; nothing was applied. The trained variables: ['")):
        face = backend.make("mlp", "adam", hooks=[hook], **QUIET)
        before = face.values()
        with pytest.raises(hostavg.ArgumentError, match="^" + re.escape(said)) as raised:
            face.step(face.cut(data, SIZES))
        assert "hidden/kernel" in str(raised.value) and "out/bias" in str(raised.value)
        assert "nothing was applied" in message_with_notes(raised.value)
        now = face.values()  # (Keras builds its optimizer's slots, zeros, in the first step)
        same({k: now[k] for k in before}, before)
        assert not any(np.any(now[k]) for k in set(now) - set(before))


class Huge:
    """Gives micro-batch 1 gradients of 1e30: finite, but Adam's second moment of them
    overflows float32, so the apply goes non-finite and is undone."""

    def on_micro_batch(self, micro):
        if micro.index == 1:
            return {n: np.full(np.shape(g), 1e30, np.float32) for n, g in micro.grads.items()}
        return None


@pytest.mark.parametrize("skipping", [False, True], ids=["undone", "retried"])
def test_an_apply_undone_or_retried_without_what_blew_it_up_leaves_the_frozen_ones_too(
        backend, skipping):
    """Undone (check_applied): every variable as before the step. Retried by SkipNonFinite
    without micro-batch 1: the step over micro-batches 0 and 2 with the layer frozen, bit for
    bit."""
    hooks = [Huge(), *([SkipNonFinite()] if skipping else []), Freeze("hidden/*")]
    face = backend.make("mlp", "adam", hooks=hooks, **QUIET)
    data = batches(4, 2, BATCH)
    face.step(face.cut(data[0], [BATCH]))  # (micro-batch 1 of none: Adam's moments begin)
    before = face.values()
    micro = face.cut(data[1], SIZES)
    if not skipping:
        with pytest.raises(hostavg.StepError, match="non-finite"):
            face.step(micro)
        same(face.values(), before)
        return
    assert face.step(micro).dropped == (1,)
    plain = backend.make("mlp", "adam", hooks=[Freeze("hidden/*")], **QUIET)
    plain.step(plain.cut(data[0], [BATCH]))
    kept = plain.cut(data[1], SIZES)
    plain.step([kept[0], kept[2]])
    same(face.values(), plain.values())
    for k in frozen_keys(before):
        assert np.array_equal(face.values()[k], before[k]), k


class Raises:
    """Raises RuntimeError in ``method`` once armed."""

    armed = False

    def __init__(self, method):
        setattr(self, method, self.fail)

    def fail(self, *args):
        if self.armed:
            raise RuntimeError("on purpose")


@pytest.mark.parametrize("method", ["on_step", "on_applied"])
def test_a_hook_that_fails_before_the_apply_leaves_everything_and_after_it_the_frozen_ones(
        backend, method):
    failing = Raises(method)
    face = backend.make("mlp", "adam", hooks=[Freeze("hidden/*"), failing], **QUIET)
    data = batches(5, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    before = face.values()
    failing.armed = True
    with pytest.raises(RuntimeError, match="on purpose"):
        face.step(face.cut(data[1], SIZES))
    now = face.values()
    if method == "on_step":
        same(now, before)
        return
    assert all(np.array_equal(now[k], before[k]) for k in frozen_keys(before))
    assert not np.array_equal(now["out/kernel"], before["out/kernel"])  # applied


def test_the_result_reports_the_frozen_ones_unmoved_and_the_history_is_otherwise_the_same(
        backend):
    """update ratios 0, weights after the apply those before, updates 0, for the frozen ones;
    fit's History with Freeze(steps={2}) equals one without it up to step 2's loss (computed
    before its apply), its other update ratios measured alike."""
    face = backend.make("mlp", "adam", hooks=[Freeze("hidden/*")], update_ratios_every=1,
                        distributions_every=1, **QUIET)
    before = face.values()
    result = face.step(face.cut(batches(6, 1, BATCH)[0], SIZES))
    for name in FROZEN:
        assert result.update_ratios[name] == 0.0
        assert np.array_equal(result.weights[name], before[name])
        assert not np.any(result.updates[name]) and result.updates[name].shape == before[name].shape
        assert result.weight_norms[name] == pytest.approx(np.linalg.norm(before[name]), rel=1e-6)
        assert not np.any(result.distributions["update"][name])
    assert all(result.update_ratios[n] > 0 and np.any(result.updates[n])
               for n in ("out/kernel", "out/bias"))
    assert np.linalg.norm(result.grads["hidden/kernel"]) > 0  # still computed and reported

    data = batches(7, 1, 4 * BATCH)[0]
    histories = [backend.make("mlp", "adam", hooks=hooks, update_ratios_every=1, **QUIET).fit(
        data, batch_size=BATCH, micro_batch_size=16, epochs=1, shuffle=False, progress=False)
        for hooks in ([Freeze("hidden/*", steps={2})], [])]
    (frozen, plain), out = [h.variable_norms("update_ratio") for h in histories], \
        ["out/kernel", "out/bias"]
    losses = [h.to_pandas()["loss"].tolist() for h in histories]
    assert list(frozen.index) == list(plain.index) == [1, 2, 3, 4]
    assert losses[0][:2] == losses[1][:2] and losses[0][2] != losses[1][2]
    assert frozen.loc[1].equals(plain.loc[1])
    assert (frozen.loc[2, list(FROZEN)] == 0).all() and (plain.loc[2, list(FROZEN)] > 0).all()
    np.testing.assert_allclose(frozen.loc[2, out], plain.loc[2, out], rtol=1e-6)
