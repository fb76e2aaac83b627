"""A step of one micro-batch, computed and applied in one call, is the step computed apart.

Where nothing must see a step's gradient before its apply (no hook that looks before it, no
statistics, no measured apply), a backend that can (hostavg.engine.protocols.Fused; TF1)
runs the compute and the apply of a step of one micro-batch in one call, the apply gated on
the device by what the host-side proof allows. Such a step must be the step computed and
applied apart, bit for bit, results and state: a hook that looks and changes nothing makes
every step run apart. A micro-batch the gate refuses (a NaN, a gradient larger than the
proof allows) is computed again apart: the same error naming the same rows, the same state
kept, or the same checked apply.
"""

import numpy as np
import pytest
from backends import BATCH, message_with_notes, same
from models import batches

import hostavg
from hostavg.compat import public_api_only

QUIET = {"watch_outliers": False, "diagnose": False}


class Looking:
    """Looks at every micro-batch before the apply and changes nothing: its trainer's steps
    are computed and applied apart."""

    drops = False

    def on_micro_batch(self, micro):
        return None


def twins(backend, model="mlp", optimizer="adam", **kw):
    """Two trainers of the same model from the same weights: the second's steps run apart."""
    return (backend.make(model, optimizer, **QUIET, **kw),
            backend.make(model, optimizer, hooks=[Looking()], **QUIET, **kw))


def assert_same_step(a, b):
    """Two StepResults of the same step: every number the same, bit for bit."""
    assert (a.step, a.loss, a.size, a.proven, a.learning_rate, a.skipped) == \
        (b.step, b.loss, b.size, b.proven, b.learning_rate, b.skipped)
    assert a.stats == b.stats  # each statistic's field
    assert (a.stats.weights, a.stats.sq_norms, a.stats.mean_sq_norm) == \
        (b.stats.weights, b.stats.sq_norms, b.stats.mean_sq_norm)
    assert (a.grads.loss, a.grads.size, a.grads.sq_norms) == \
        (b.grads.loss, b.grads.size, b.grads.sq_norms)
    assert [(m.index, m.size, m.loss, m.start, m.step, m.dropped) for m in a.micro] == \
        [(m.index, m.size, m.loss, m.start, m.step, m.dropped) for m in b.micro]
    pairs = [(a.grads, b.grads)] + [(m.grads, n.grads) for m, n in zip(a.micro, b.micro)]
    if a.stats.stack is not None:
        pairs += list(zip(a.stats.stack, b.stats.stack))
    for x_grads, y_grads in pairs:
        assert (x_grads is None) == (y_grads is None)
        for name in x_grads or ():
            x, y = x_grads[name], y_grads[name]
            if isinstance(x, hostavg.SparseGradient):
                np.testing.assert_array_equal(x.indices, y.indices)
                x, y = x.values, y.values
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd", "momentum"])
@pytest.mark.parametrize("model", ["mlp", "embedding", "batchnorm"])
def test_a_step_of_one_micro_batch_is_the_step_computed_and_applied_apart(
        backend, model, optimizer, check):
    one, apart = twins(backend, model, optimizer, check_applied=check)
    results = []
    for d in batches(0, 5, BATCH, sparse=model == "embedding"):
        a, b = one.step([one.native(d)]), apart.step([apart.native(d)])
        assert_same_step(a, b)
        results.append(a)
        same(one.values(), apart.values())
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    if check and not (backend.id == "tf1" and public_api_only()):
        assert [r.proven for r in results] == [False] + [True] * 4


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_a_step_of_one_micro_batch_in_stack_mode_keeps_its_gradient_as_the_step_apart(
        backend, model):
    """Stack mode keeps each micro-batch's gradient in its record and the statistics' stack:
    the step applied in its compute's call keeps the same arrays' values."""
    one, apart = twins(backend, model, accumulate="stack")
    for d in batches(1, 3, BATCH, sparse=model == "embedding"):
        a, b = one.step([one.native(d)]), apart.step([apart.native(d)])
        assert a.micro[0].grads is not None and a.stats.stack is not None
        assert_same_step(a, b)
        same(one.values(), apart.values())


def test_a_non_finite_sample_fails_the_step_naming_its_row_and_changes_nothing(backend):
    """The gate refuses the NaN: nothing applied, moving statistics put back, the row named."""
    one, apart = twins(backend, "batchnorm")
    data = batches(4, 3, BATCH)
    for face in (one, apart):
        face.step([face.native(data[0])])
        face.step([face.native(data[1])])
    poisoned = dict(data[2], x=data[2]["x"].copy())
    poisoned["x"][7, 1] = np.nan
    rows = np.arange(100, 100 + BATCH)
    said = []
    for face in (one, apart):
        before = face.values()
        with pytest.raises(hostavg.StepError) as raised:
            face.step([face.native(poisoned)], rows=[rows])
        same(face.values(), before)
        said.append(message_with_notes(raised.value))
        assert "data row 107" in said[-1], said[-1]
    assert said[0] == said[1]
    for face in (one, apart):  # and both step on alike
        result = face.step([face.native(data[2])])
    same(one.values(), apart.values())
    assert result.step == 3


def test_a_gradient_larger_than_the_proof_allows_is_applied_apart(backend):
    """A micro-batch whose gradient is about 1e6 times the last one's: the gate refuses it
    (the proof allowed a few times the last), so it is computed again and applied apart,
    proven by its own norm: the same step as computed apart."""
    one, apart = twins(backend)
    data = batches(6, 3, BATCH)
    loud = dict(data[2], x=data[2]["x"] * np.float32(1e6))
    results = []
    for d in (data[0], data[1], loud, data[1]):
        a, b = one.step([one.native(d)]), apart.step([apart.native(d)])
        assert_same_step(a, b)
        results.append(a)
        same(one.values(), apart.values())
    if not (backend.id == "tf1" and public_api_only()):
        assert [r.proven for r in results] == [False, True, True, True]


def test_trainers_stepped_together_both_compute_before_either_applies(backend):
    """step_together of two trainers of one micro-batch each: neither applies in its compute's
    call, so the second computes from the weights the first did."""
    a, b = backend.pair(**QUIET)
    c, d = backend.pair(**QUIET)
    for data in batches(12, 3, BATCH):
        backend.step_together([(a, [a.native(data)]), (b, [b.native(data)])])
        means = [face.mean([face.native(data)]) for face in (c, d)]  # both from the same weights
        for face, mean in zip((c, d), means):
            face.apply(mean)
    same(a.values(), c.values())
    same(b.values(), d.values())
