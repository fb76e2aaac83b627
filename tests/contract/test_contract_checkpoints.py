"""Checkpoints: a round trip restores every variable exactly, a stranger's is refused, and a
fit stopped by an exception resumes to the weights of one never stopped, bit for bit."""

import pytest
from backends import BATCH, SIZES, same
from models import AfterStep, FailAt, batches

import hostavg

#: fit over 100 samples in batches of 32 (the last of 4) cut into micro-batches of 8:
#: 4 steps an epoch, 8 in all.
FIT = {"batch_size": 32, "micro_batch_size": 8, "epochs": 2, "seed": 3, "progress": False}
SAMPLES = 100


class Steps(AfterStep):
    """A fit callback that notes the global step after each step fit counts."""

    def __init__(self):
        self.seen = []

    def after(self, step):
        self.seen.append(step)


class StopAt(AfterStep):
    """A fit callback that raises StopTraining("enough") after global step ``step``."""

    def __init__(self, step):
        self.step = step

    def after(self, step):
        if step == self.step:
            raise hostavg.StopTraining("enough")


class FailApplied:
    """A hook whose ``on_applied`` raises RuntimeError("stopped on purpose") at global step
    ``step``: the step was applied, and fit has not counted it yet."""

    def __init__(self, step):
        self.step = step

    def on_applied(self, result):
        if result.step == self.step:
            raise RuntimeError("stopped on purpose")


#: Where a fit fails at step 5: after fit counted the step, or in an on_applied hook.
FAILS = {"after-the-step": FailAt, "in-on-applied": FailApplied}


@pytest.mark.parametrize("fail", FAILS.values(), ids=FAILS.keys())
def test_a_fit_resumed_after_an_exception_equals_an_uninterrupted_fit(backend, tmp_path, fail):
    data = batches(6, 1, SAMPLES)[0]
    straight = backend.make("batchnorm")
    straight.fit(data, **FIT)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        backend.make("batchnorm").fit(data, checkpoint_dir=tmp_path, callbacks=[fail(5)],
                                      **FIT)
    resumed = backend.make("batchnorm")  # as a new process would: another model, from the files
    steps = Steps()
    history = resumed.fit(data, checkpoint_dir=tmp_path, callbacks=[steps], **FIT)
    assert steps.seen == [6, 7, 8]  # it resumed: a fresh start would also end equal
    same(resumed.values(), straight.values())
    assert [s.step for s in history.steps] == list(range(1, 9))
    assert [s.size for s in history.steps] == [32, 32, 32, 4] * 2


def test_a_hook_raising_in_on_applied_leaves_a_checkpoint_of_one_step(backend, tmp_path):
    """The step whose on_applied hook raised was applied: fit counts it before the exception
    leaves, so the checkpoint written on the way out holds its weights, its position and its
    History, together."""
    data = batches(6, 1, SAMPLES)[0]
    failed = backend.make("batchnorm")
    with pytest.raises(RuntimeError, match="stopped on purpose") as raised:
        failed.fit(data, checkpoint_dir=tmp_path, callbacks=[FailApplied(5)], **FIT)
    assert [s.step for s in raised.value.history.steps] == [1, 2, 3, 4, 5]
    newest = sorted(tmp_path.glob("ckpt-*.npz"))[-1]
    assert newest.name == "ckpt-0000000005.npz"
    held = backend.make("batchnorm")
    fit = held.restore(newest)
    same(held.values(), failed.values())
    assert (fit["epoch"], fit["batch"], fit["samples"]) == (1, 1, 32)
    assert [s.step for s in hostavg.History.from_json(fit["history"]).steps] == [1, 2, 3, 4, 5]


def test_a_fit_stopped_by_a_callback_stays_stopped(backend, tmp_path):
    data = batches(6, 1, SAMPLES)[0]
    first = backend.make("batchnorm")
    history = first.fit(data, checkpoint_dir=tmp_path, callbacks=[StopAt(5)], **FIT)
    assert history.stopped == "enough" and len(history.steps) == 5
    again = backend.make("batchnorm")
    steps = Steps()
    history = again.fit(data, checkpoint_dir=tmp_path, callbacks=[steps], **FIT)
    assert steps.seen == [] and history.stopped == "enough" and len(history.steps) == 5
    same(again.values(), first.values())


def test_save_restore_round_trips_every_variable_and_refuses_another_model(backend, tmp_path):
    data = batches(7, 3, BATCH)
    a = backend.make("batchnorm")
    for d in data[:2]:
        a.step(a.cut(d, SIZES))
    a.save(tmp_path / "ck.npz")
    b = backend.make("batchnorm")
    assert b.restore(tmp_path / "ck.npz") is None  # not written by fit: no fit state
    same(b.values(), a.values())
    ra, rb = (face.step(face.cut(data[2], SIZES)) for face in (a, b))
    assert ra.step == rb.step == 3
    same(b.values(), a.values())

    other = backend.make("embedding")
    other.step(other.cut(batches(7, 1, BATCH, sparse=True)[0], SIZES))
    before = other.values()
    with pytest.raises(hostavg.HostavgError, match="different model"):
        other.restore(tmp_path / "ck.npz")
    same(other.values(), before)
