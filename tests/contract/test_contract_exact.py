"""An accumulated step is the framework's own full-batch step, on every backend.

Tolerance: 1e-5 absolute on every variable (weights, optimizer state) after 3
steps in float32. The mean sums the micro-batch gradients in another order
than the framework's whole-batch reduction, so the two differ by rounding:
at most 1.2e-7 here (one or two ulps of weights near 1), on both backends;
1e-5 leaves room for other hardware and kernels (oneDNN, a GPU). A wrong
weighting is far outside it: the unweighted mean of the 5, 11 and 16 samples'
gradients moves some variable by 4.5e-4 to 0.1 in every case here.
"""

import functools

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import OPTIMIZERS, batches

import hostavg

STEPS = 3
ATOL = 1e-5


@functools.cache
def oracle(backend, model: str, optimizer: str) -> dict:
    """The full-batch steps over the batches of seed 0, once for both accumulate modes."""
    return backend.oracle(model, optimizer, batches(0, STEPS, BATCH, sparse=model == "embedding"))


#: (model, optimizer, accumulate, micro-batch sizes): both models with every optimizer in
#: "sum" mode over unequal micro-batches, and with Adam in "stack" mode (the mode only changes
#: how the mean is formed before an optimizer sees it; the two means are equal bit for bit,
#: below); and the MLP over equal micro-batches, which the accumulator adds without scaling
#: (a path of dense gradients alone).
CASES = [(model, optimizer, "sum", SIZES) for model in ("mlp", "embedding")
         for optimizer in sorted(OPTIMIZERS)] + [
    ("mlp", "adam", "stack", SIZES), ("embedding", "adam", "stack", SIZES),
    ("mlp", "adam", "sum", (BATCH // 2, BATCH // 2))]
IDS = [f"{m}-{o}-{a}" + ("-equal" if s != SIZES else "") for m, o, a, s in CASES]


@pytest.mark.parametrize("model,optimizer,accumulate,sizes", CASES, ids=IDS)
def test_an_accumulated_step_equals_the_full_batch_step(backend, model, optimizer, accumulate,
                                                        sizes):
    data = batches(0, STEPS, BATCH, sparse=model == "embedding")
    want = oracle(backend, model, optimizer)
    face = backend.make(model, optimizer, accumulate=accumulate)
    results = [face.step(face.cut(d, sizes)) for d in data]
    same(face.values(), want, atol=ATOL, skip=face.assigned())
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert results[-1].size == BATCH
    assert [m.size for m in results[-1].micro] == list(sizes)
    assert all((m.grads is not None) == (accumulate == "stack") for m in results[-1].micro)
    sparse = {name for name, s in face.trainer.spec.items() if s.sparse}
    assert len(sparse) == (model == "embedding" and backend.sparse_rows)
    if sparse:  # the mean stays sparse: the unique ids of the last batch
        (name,) = sparse
        mean = results[-1].grads[name]
        assert isinstance(mean, hostavg.SparseGradient)
        ids = data[-1]["ids"]
        assert len(np.unique(ids)) < ids.size  # ids repeat within the batch
        np.testing.assert_array_equal(mean.indices, np.unique(ids))


@pytest.mark.parametrize("model,interactive,stepped", [("mlp", "sum", "stack"),
                                                       ("embedding", "stack", "sum")])
def test_compute_add_mean_apply_is_a_step_in_either_mode_bit_for_bit(backend, model, interactive,
                                                                      stepped):
    data = batches(1, 1, BATCH, sparse=model == "embedding")[0]
    a, b = backend.make(model, accumulate=interactive), backend.make(model, accumulate=stepped)
    grads = [a.compute(m) for m in a.cut(data, SIZES)]
    acc = a.accumulator()
    for g in grads:
        acc.add(g)
    mean = acc.mean()
    assert mean.size == BATCH
    assert a.apply(mean) == 1
    res = b.step(b.cut(data, SIZES))
    if stepped == "stack":  # each micro-batch's gradients as compute gives them
        for m, g in zip(res.micro, grads):
            assert m.grads.keys() == g.keys() and m.loss == g.loss and m.size == g.size
            for name in g:
                np.testing.assert_array_equal(m.grads[name], g[name])
    assert res.loss == pytest.approx(mean.loss, rel=1e-12)
    assert res.grads.keys() == mean.keys()
    for name in mean:
        got, want = res.grads[name], mean[name]
        if isinstance(want, hostavg.SparseGradient):
            np.testing.assert_array_equal(got.indices, want.indices)
            got, want = got.values, want.values
        np.testing.assert_array_equal(got, want)
    same(a.values(), b.values())


def test_compute_assigns_exactly_the_rollback_variables_and_hands_out_read_only_gradients(
        backend):
    face = backend.make("batchnorm")
    data = batches(2, 1, BATCH)[0]
    face.step(face.cut(data, SIZES))
    before = face.values()
    g = face.compute(face.cut(data, SIZES)[1])
    assert g.size == SIZES[1] and np.isfinite(g.loss) and g.loss > 0
    assert g.keys() == face.trainer.spec.keys()
    for value in g.values():
        assert not value.flags.writeable
    after = face.values()
    moved = {name for name in before if not np.array_equal(after[name], before[name])}
    assert moved == face.assigned() != set()  # moving statistics and the counter, nothing else


def test_apply_takes_an_edited_dict_and_runs_no_forward_pass(backend):
    face = backend.make("batchnorm")
    data = batches(2, 1, BATCH)[0]
    g = face.compute(face.cut(data, SIZES)[0])
    edited = {name: np.array(value) * 0.5 for name, value in g.items()}  # writable copies
    before = face.values()
    assert face.apply(edited) == 1
    after = face.values()
    for name in face.assigned():  # no forward pass: no moving statistic, no counter moved
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert all(not np.array_equal(after[name], before[name]) for name in face.trainer.spec)


def test_an_overlapped_step_is_the_plain_step_bit_for_bit(backend):
    data = batches(3, 2, BATCH)
    plain, overlapped = backend.make("batchnorm"), backend.make("batchnorm", overlap=True)
    for d in data:
        a, b = (face.step(face.cut(d, SIZES)) for face in (plain, overlapped))
        assert a.loss == b.loss
    same(overlapped.values(), plain.values())
