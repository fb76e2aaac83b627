"""Trainers stepped together, and who hears of a step: hooks and fit callbacks."""

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import batches

import hostavg
from hostavg.hooks import SkipNonFinite

#: fit over 40 samples in batches of 16 cut into micro-batches of 8, twice:
#: micro-batches 2, 2 and 1 an epoch, 6 steps in all.
FIT = {"batch_size": 16, "micro_batch_size": 8, "epochs": 2, "seed": 0, "progress": False}
STEPS, MICRO_BATCHES = list(range(1, 7)), 10


class Calls:
    """Notes every hook method called on it, with the step or epoch it was called for."""

    def __init__(self):
        self.calls = []

    def on_micro_batch(self, micro):
        self.calls.append(("on_micro_batch", micro.step))

    def on_step(self, mean, result):
        self.calls.append(("on_step", result.step))

    def on_applied(self, result):
        self.calls.append(("on_applied", result.step))

    def on_train_begin(self):
        self.calls.append(("on_train_begin", None))

    def on_epoch_begin(self, epoch):
        self.calls.append(("on_epoch_begin", epoch))

    def on_batch_begin(self, batch):
        self.calls.append(("on_batch_begin", batch))

    def on_batch_end(self, batch, logs):
        self.calls.append(("on_batch_end", (batch, sorted(logs))))

    def on_epoch_end(self, epoch, logs):
        self.calls.append(("on_epoch_end", epoch))

    def on_train_end(self, *args):
        self.calls.append(("on_train_end", None))

    def close(self):
        self.calls.append(("close", None))

    def of(self, method: str) -> list:
        return [at for name, at in self.calls if name == method]


def test_stepping_together_equals_computing_both_then_applying_both(backend):
    data = batches(12, 1, BATCH)[0]
    a, b = backend.pair()
    results = backend.step_together([(a, a.cut(data, SIZES)), (b, b.cut(data, SIZES))])
    c, d = backend.pair()
    means = [face.mean(face.cut(data, SIZES)) for face in (c, d)]  # both from the same weights
    for face, mean in zip((c, d), means):
        face.apply(mean)
    same(a.values(), c.values())
    same(b.values(), d.values())
    for result, mean in zip(results, means):
        assert result.size == BATCH
        for name in mean:
            np.testing.assert_array_equal(result.grads[name], mean[name])
    assert results[0].step == 1


def test_stepping_an_empty_list_together_returns_no_result_and_changes_nothing(backend):
    """A loop whose list of active trainers is empty this round gets [] (one result per
    trainer); what is no list of (trainer, batches) pairs is still refused."""
    a, b = backend.pair()
    before = a.values()
    assert together(backend, a, []) == []
    same(a.values(), before)
    call = "hostavg.step_together" if backend.id == "tf1" else "hostavg.keras.step_together"
    for wrong in (None, {}, a.trainer):
        with pytest.raises(hostavg.ArgumentError, match=r"^step_together takes a list of "
                                                        r"\(trainer, batches\) pairs, got "):
            together(backend, a, wrong)
    same(a.values(), before)


def together(backend, face, steps):
    """``step_together`` called with ``steps`` as they are (``backend.step_together`` takes faces)."""
    if backend.id == "tf1":
        return hostavg.step_together(face.sess, steps)
    return hostavg.keras.step_together(steps)


class Blow:
    """A hook that makes micro-batch 1's gradients 1e30 times larger, once armed: finite, but
    Adam's second moment of them (1e60) overflows float32, so the apply goes non-finite."""

    armed = False

    def on_micro_batch(self, micro):
        if self.armed and micro.index == 1:
            return {name: np.asarray(g) * np.float32(1e30) for name, g in micro.grads.items()}
        return None


def blowing_pair(backend):
    """Two trainers that step together (:meth:`Backend.pair`), each with a :class:`Blow` hook
    before SkipNonFinite, stepped once (slots and step non-trivial), and the next batch."""
    hooks = [Blow(), Blow()]
    a, b = backend.pair(hooks=[[hook, SkipNonFinite()] for hook in hooks])
    data = batches(14, 2, BATCH)
    backend.step_together([(a, a.cut(data[0], SIZES)), (b, b.cut(data[0], SIZES))])
    return a, b, hooks, data[1]


def test_stepping_together_retries_without_the_micro_batch_that_blew_the_first_apply_up(backend):
    """The first trainer's apply goes non-finite before any apply went through: every trainer is
    tried again from the same weights, without that micro-batch, as a lone step is."""
    a, b, hooks, data = blowing_pair(backend)
    twin_a, twin_b, _, _ = blowing_pair(backend)
    hooks[0].armed = True
    results = backend.step_together([(a, a.cut(data, SIZES)), (b, b.cut(data, SIZES))])
    assert results[0].dropped == (1,) and results[1].dropped == ()
    micro = twin_a.cut(data, SIZES)
    backend.step_together([(twin_a, [micro[0], micro[2]]), (twin_b, twin_b.cut(data, SIZES))])
    same(a.values(), twin_a.values())
    same(b.values(), twin_b.values())


def test_stepping_together_says_which_applies_stay_when_a_later_one_blows_up(backend):
    """The second trainer's apply goes non-finite once the first's went through, which cannot be
    undone: the second is as before the step, the first applied, and the error says so."""
    a, b, hooks, data = blowing_pair(backend)
    twin, _, _, _ = blowing_pair(backend)
    hooks[1].armed = True
    before = b.values()
    with pytest.raises(hostavg.StepError) as raised:
        backend.step_together([(a, a.cut(data, SIZES)), (b, b.cut(data, SIZES))])
    said = str(raised.value)
    assert "so it was undone" in said, said
    assert said.startswith("step_together, trainer 2 of 2: the apply of trainer 1 before it "
                           "went through and stays applied (no on_applied hook heard of it); "
                           "this trainer's and those after it were not applied. step, the "
                           "apply: it made "), said
    twin.step(twin.cut(data, SIZES))  # what the first trainer's apply did: its step, alone
    same(a.values(), twin.values())  # (TF1: the whole graph, the second trainer's too)
    if backend.id != "tf1":
        same(b.values(), before)


def fit_data():
    return batches(13, 1, 40)[0]


def test_hooks_and_fit_callbacks_get_every_hook_method(backend):
    """An object's hook methods are called wherever it is registered: in the trainer's hooks
    or in fit's callbacks."""
    hook, callback = Calls(), Calls()
    face = backend.make(hooks=[hook])
    assert face.trainer.hooks[0] is hook  # then the default WatchOutliers
    face.fit(fit_data(), callbacks=[callback], **FIT)
    for heard in (hook, callback):
        assert heard.of("on_applied") == STEPS
        assert len(heard.of("on_step")) == len(STEPS)
        assert len(heard.of("on_micro_batch")) == MICRO_BATCHES
        assert heard.of("on_train_begin") == [None]
        assert heard.of("on_epoch_begin") == heard.of("on_epoch_end") == [0, 1]
        assert heard.of("on_batch_begin") == [0, 1, 2] * 2
        assert [b for b, _ in heard.of("on_batch_end")] == [0, 1, 2] * 2
        assert heard.of("on_train_end") == [None]
        assert heard.of("close") == [None]
        names = [name for name, _ in heard.calls if not name.startswith("on_micro") and
                 name not in ("on_step", "on_applied")]
        assert names[:4] == ["on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end"]
        assert names[-2:] == ["on_train_end", "close"]


def test_the_history_reads_as_keras_history(backend):
    """history.history: name -> one value per epoch, without fit's bookkeeping; history.epoch."""
    face = backend.make()
    history = face.fit(fit_data(), **FIT)
    assert history.epoch == [0, 1]
    assert "loss" in history.history and not {"epoch", "samples", "steps"} & set(history.history)
    for name, values in history.history.items():
        assert values == [e[name] for e in history.epochs]
