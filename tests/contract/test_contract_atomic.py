"""A step that fails changes nothing, and its error says which micro-batch (and data rows) failed.

The model is the batch-norm one: besides weights, optimizer state and the
step, its forward pass assigns moving statistics and a counter, which a
failed step must put back. Everything is compared bit for bit.
"""

import numpy as np
import pytest
from backends import BATCH, SIZES, message_with_notes, same
from models import FEATURES, batches, cuts

import hostavg
from hostavg.hooks import SkipNonFinite


class RaiseAt:
    """A hook whose ``on_micro_batch`` raises RuntimeError at micro-batch 1, once armed."""

    armed = False

    def on_micro_batch(self, micro):
        if self.armed and micro.index == 1:
            raise RuntimeError("hook failed on purpose")


#: How micro-batch 1 of 3 fails: what is raised, and a word of its message.
FAILURES = {
    "nan-input": (hostavg.HostavgError, "non-finite gradients"),
    "hook-raises": (RuntimeError, "hook failed on purpose"),
    "wrong-shape": (hostavg.HostavgError, "shape"),
}


def failing(face, hook, failure: str, data: dict) -> list:
    """``data`` cut into SIZES, micro-batch 1 of them made to fail as ``failure`` says."""
    if failure == "nan-input":
        data = dict(data, x=data["x"].copy())
        data["x"][SIZES[0] + 3, 2] = np.nan
    micro = face.cut(data, SIZES)
    if failure == "hook-raises":
        hook.armed = True
    if failure == "wrong-shape":
        second = cuts(BATCH, SIZES)[1]
        micro[1] = face.cut({"x": np.ones((SIZES[1], FEATURES - 1), np.float32),
                             "y": data["y"][second]}, SIZES[1:2])[0]
    return micro


#: The data rows of the step's micro-batches, as fit passes them.
ROWS = [np.random.default_rng(5).permutation(1000)[:BATCH][s] for s in cuts(BATCH, SIZES)]


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_step_changes_nothing_and_names_its_micro_batch_and_rows(backend, failure):
    hook = RaiseAt()
    face = backend.make("batchnorm", hooks=[hook])
    data = batches(4, 2, BATCH)
    face.step(face.cut(data[0], SIZES))  # slots, step, moving statistics: all non-trivial
    micro = failing(face, hook, failure, data[1])
    before = face.values()
    kind, word = FAILURES[failure]
    with pytest.raises(kind) as raised:
        face.step(micro, rows=ROWS)
    same(face.values(), before)
    text = message_with_notes(raised.value)
    assert word in text and "micro-batch 1 of 3" in text, text
    assert f"data rows [{ROWS[1][0]}, {ROWS[1][1]}, " in text, text
    np.testing.assert_array_equal(raised.value.rows, ROWS[1])
    hook.armed = False
    assert face.step(face.cut(data[1], SIZES)).step == 2  # and the trainer steps on


def test_an_error_found_while_preparing_names_rows(backend):
    face = backend.make()
    with pytest.raises(hostavg.HostavgError) as raised:
        face.step(failing(face, None, "wrong-shape", batches(5, 1, BATCH)[0]), rows=ROWS)
    assert f"data rows [{ROWS[1][0]}, {ROWS[1][1]}, " in str(raised.value), str(raised.value)
    np.testing.assert_array_equal(getattr(raised.value, "rows", None), ROWS[1])


def test_a_step_whose_every_micro_batch_is_dropped_is_skipped_and_changes_nothing(backend):
    face = backend.make("batchnorm", hooks=[SkipNonFinite()])
    data = batches(6, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    before = face.values()
    poisoned = dict(data[1], x=np.full_like(data[1]["x"], np.nan))
    res = face.step(face.cut(poisoned, SIZES))
    assert res.skipped and res.dropped == (0, 1, 2) and res.step == 1
    same(face.values(), before)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_dropped_micro_batch_leaves_nothing_behind(backend, overlap):
    """What a micro-batch's forward pass assigned (moving statistics, the counter) goes with it
    when a hook drops it: the model is as after the step over the other micro-batches (with
    overlap, micro-batch 2 computed meanwhile from micro-batch 1's statistics is redone)."""
    data = batches(11, 1, BATCH)[0]
    data["x"][SIZES[0] + 2, 0] = np.nan  # in micro-batch 1
    face = backend.make("batchnorm", hooks=[SkipNonFinite()], overlap=overlap)
    assert face.step(face.cut(data, SIZES)).dropped == (1,)
    others = backend.make("batchnorm")
    micro = others.cut(data, SIZES)
    others.step([micro[0], micro[2]])
    same(face.values(), others.values())


def test_an_apply_that_goes_non_finite_raises_naming_the_slots_and_changes_nothing(backend):
    """apply checks what it wrote as step does: gradients of 1e30 are finite, but Adam's second
    moment of them (1e60) overflows float32; the update is undone and apply raises, naming it."""
    face = backend.make("batchnorm")
    data = batches(4, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    grads = face.compute(face.cut(data[1], SIZES)[0])
    before = face.values()  # after the compute, which moved the moving statistics
    huge = {name: np.full(np.shape(g), 1e30, np.float32) for name, g in grads.items()}
    with pytest.raises(hostavg.StepError) as raised:
        face.apply(huge)
    same(face.values(), before)
    said = str(raised.value)
    assert said.startswith("apply: it made ") and face.second_moment in said.split("non-finite")[0]
    assert said.endswith(" non-finite (NaN or Inf), so it was undone: the weights, the "
                         "optimizer's state and the global step are as before the apply. Look at "
                         "what produced these gradients: scale them down, or clip them."), said
    assert raised.value.culprit_rows == []
    assert face.apply(grads) == 2  # and it applies on


@pytest.mark.parametrize("skipping", [False, True], ids=["plain", "skip-non-finite"])
def test_a_weight_non_finite_before_the_step_is_named_instead_of_every_sample(backend, skipping):
    """A NaN already in a weight makes every micro-batch non-finite, every sample of it too: the
    step names the weight, blames no sample, and fails with SkipNonFinite too (dropping
    micro-batches cannot help)."""
    face = backend.make("batchnorm", hooks=[SkipNonFinite()] if skipping else [])
    data = batches(4, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    kernel = face.values()["out/kernel"].copy()
    kernel[2, 1] = np.nan
    face.set("out/kernel", kernel)
    before = face.values()
    with pytest.raises(hostavg.StepError) as raised:
        face.step(face.cut(data[1], SIZES), rows=ROWS)
    same(face.values(), before, skip=("out/kernel",))
    np.testing.assert_array_equal(face.values()["out/kernel"], kernel)  # (NaN where it was)
    said = str(raised.value)
    assert raised.value.culprits == () and raised.value.culprit_rows == [], said
    assert said.startswith("step: the weights were not finite before the step ('out/kernel' "
                           "holds 1 of 24 entries non-finite: 1 NaN, 0 Inf), so every micro-batch "
                           "computed from them is"), said
    assert "no sample is to blame" in said and "data row" not in said, said


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "rmsprop", "adam"])
def test_a_sparse_apply_that_goes_non_finite_in_its_rows_is_undone_bit_for_bit(backend, optimizer):
    """The checked apply keeps of an embedding table what the update can change (its touched
    rows, where the optimizer writes only those): an update that overflows one touched row
    (its weight, or its slot: float max squared under Adagrad, RMSProp and Adam) is undone bit
    for bit, the touched rows and their slots, and no other row of any variable moved."""
    face = backend.make("embedding", optimizer)
    data = batches(4, 2, BATCH, sparse=True)
    face.step(face.cut(data[0], SIZES))  # slots, step: all non-trivial
    grads = face.compute(face.cut(data[1], SIZES)[0])
    name, = [n for n, g in grads.items() if len(np.shape(g)) == 2 and np.shape(g)[0] == 50]
    g = grads[name]
    top = np.finfo(np.float32).max
    if isinstance(g, hostavg.SparseGradient):
        rows = np.unique(g.indices)
        huge = hostavg.SparseGradient(g.indices, np.full_like(g.values, top), g.dense_shape)
    else:  # a dense gradient (JAX): its touched rows are those not zero
        rows = np.flatnonzero(np.any(g != 0, axis=1))
        huge = np.where(np.any(g != 0, axis=1, keepdims=True), top, 0 * g).astype(g.dtype)
    assert 0 < len(rows) < 50
    table = face.values()[name].copy()
    table[rows[0]] = -top  # finite: SGD and Momentum overflow it; the others, a slot
    face.set(name, table)
    before = face.values()
    with pytest.raises(hostavg.StepError) as raised:
        face.apply(dict(grads, **{name: huge}))
    same(face.values(), before)
    assert "so it was undone" in str(raised.value), str(raised.value)
    assert face.apply(grads) == 2  # and it applies on
