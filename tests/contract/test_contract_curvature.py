"""Hessian-vector products and curvature on every face, against the exact Hessian.

The oracle is framework-free: the model every face builds (models.build's MLP, tanh hidden
layer, mean softmax cross-entropy; its embedding variant) in NumPy float64 at the face's
own weights and data, its gradient by hand, its Hessian by central differences of that
exact gradient (step 1e-4: truncation ~1e-8 h^2-relative, rounding ~1e-12). Every face is
compared with the same oracle, so the faces agree with each other (the JAX face in its own
process, KERAS_BACKEND=jax) to within twice the tolerance.

Tolerances, relative in the norm over every variable: 1e-5 against the exact product
(float32 arithmetic rounds each op at 6e-8; a product sums ~100 of them); 1e-6 between
4 micro-batches and the whole batch (the same float32 values summed in float64 in another
grouping). A product off by a factor (the unweighted mean of the micro-batches, a loss
that is a sum) is off by far more.
"""

import numpy as np
import pytest
from backends import BATCH, same
from models import batches

import hostavg
import hostavg.hooks

ATOL_EXACT, ATOL_MICRO = 1e-5, 1e-6


def _roles(spec) -> dict:
    """Each of the model's parts -> its variable's name on the face."""
    return {("embedding" if name.startswith("embedding") else name): name for name in spec}


def loss_and_gradient(w: dict, data: dict) -> tuple[float, dict]:
    """The model's mean loss and exact gradient, in float64, by role."""
    if "ids" in data:
        x = w["embedding"][data["ids"]].mean(axis=1)
    else:
        x = data["x"].astype(np.float64)
    h = np.tanh(x @ w["hidden/kernel"] + w["hidden/bias"])
    z = h @ w["out/kernel"] + w["out/bias"]
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n, y = len(data["y"]), data["y"]
    loss = float(-np.mean(np.log(p[np.arange(n), y])))
    dz = p.copy()
    dz[np.arange(n), y] -= 1
    dz /= n
    da = (dz @ w["out/kernel"].T) * (1 - h * h)
    g = {"hidden/kernel": x.T @ da, "hidden/bias": da.sum(0), "out/kernel": h.T @ dz,
         "out/bias": dz.sum(0)}
    if "ids" in data:
        g["embedding"] = np.zeros_like(w["embedding"])
        dx = da @ w["hidden/kernel"].T / data["ids"].shape[1]
        for j in range(data["ids"].shape[1]):
            np.add.at(g["embedding"], data["ids"][:, j], dx)
    return loss, g


def exact_hessian(face, data: dict) -> np.ndarray:
    """The Hessian of the face's model at its weights, over the flat variables in spec order."""
    spec, roles = face.trainer.spec, _roles(face.trainer.spec)
    values = face.values()
    w = {role: values[name].astype(np.float64) for role, name in roles.items()}
    order = [role for role in roles]
    sizes = [w[r].size for r in order]
    flat = np.concatenate([w[r].ravel() for r in order])

    def gradient(v):
        parts = np.split(v, np.cumsum(sizes)[:-1])
        g = loss_and_gradient({r: p.reshape(w[r].shape) for r, p in zip(order, parts)}, data)[1]
        return np.concatenate([g[r].ravel() for r in order])

    eps, columns = 1e-4, []
    for i in range(len(flat)):
        e = np.zeros_like(flat)
        e[i] = eps
        columns.append((gradient(flat + e) - gradient(flat - e)) / (2 * eps))
    hessian = np.array(columns).T
    assert list(spec) == [roles[r] for r in order]
    return (hessian + hessian.T) / 2


def _flat(face, values) -> np.ndarray:
    return np.concatenate([np.asarray(values[n], np.float64).ravel() for n in face.trainer.spec])


def _vectors(face, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 1, s.shape).astype(np.float32)
            for name, s in face.trainer.spec.items()}


def _relative(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_hvp_is_the_exact_hessian_times_v(backend, model):
    data = batches(0, 1, BATCH, sparse=model == "embedding")[0]
    face = backend.make(model, "sgd")
    face.compute(face.native(data))  # the trainer learns its variables
    v = _vectors(face, 1)
    got = face.hvp(data, v)
    hessian = exact_hessian(face, data)
    assert isinstance(got, hostavg.Gradients)
    assert list(got) == list(face.trainer.spec)
    assert all(isinstance(p, np.ndarray) and p.shape == face.trainer.spec[n].shape
               for n, p in got.items())  # dense, an embedding's too
    assert _relative(_flat(face, got), hessian @ _flat(face, v)) < ATOL_EXACT
    assert got.loss == pytest.approx(loss_and_gradient(
        {r: face.values()[n].astype(np.float64) for r, n in _roles(face.trainer.spec).items()},
        data)[0], rel=1e-6)
    assert got.size == BATCH


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_hvp_over_micro_batches_is_the_whole_batch_product(backend, model):
    data = batches(0, 1, BATCH, sparse=model == "embedding")[0]
    face = backend.make(model, "sgd")
    face.compute(face.native(data))
    v = _vectors(face, 2)
    whole = face.hvp(data, v)
    micro = face.hvp(data, v, micro_batch_size=9)  # 4 micro-batches: 9, 9, 9 and 5 samples
    assert _relative(_flat(face, micro), _flat(face, whole)) < ATOL_MICRO
    # the trainer's own cut serves where the call gives none
    face.trainer.micro_batches = 3  # 11, 11 and 10 samples
    assert _relative(_flat(face, face.hvp(data, v)), _flat(face, whole)) < ATOL_MICRO


def test_a_sparse_gradient_serves_as_the_vector(backend):
    data = batches(0, 1, BATCH, sparse=True)[0]
    face = backend.make("embedding", "sgd")
    g = face.compute(face.native(data))  # an embedding's gradient as rows on TF
    dense = {n: (v.to_dense() if isinstance(v, hostavg.SparseGradient) else v)
             for n, v in g.items()}
    same(dict(face.hvp(data, g)), dict(face.hvp(data, dense)))


def test_curvature_matches_the_exact_spectrum(backend):
    data = batches(0, 1, BATCH)[0]
    face = backend.make("mlp", "sgd")
    face.compute(face.native(data))
    eigenvalues = np.linalg.eigvalsh(exact_hessian(face, data))
    by_magnitude = eigenvalues[np.argsort(-np.abs(eigenvalues))]
    assert abs(by_magnitude[1]) < 0.9 * abs(by_magnitude[0])  # a spectral gap
    found = face.curvature(data, trace_samples=64, top=2, iterations=40, tolerance=1e-4)
    assert isinstance(found, hostavg.Curvature)
    assert abs(found.trace - eigenvalues.sum()) < 3 * found.trace_stderr
    assert found.top_eigenvalues[0] == pytest.approx(by_magnitude[0], rel=1e-3)
    assert found.top_eigenvalues[1] == pytest.approx(by_magnitude[1], rel=1e-3)
    assert found.converged and found.products <= 64 + 40
    top = found.eigenvectors[0]
    assert list(top) == list(face.trainer.spec)
    u = _flat(face, top)
    assert np.linalg.norm(u) == pytest.approx(1, rel=1e-6)
    hessian = exact_hessian(face, data)
    assert np.linalg.norm(hessian @ u - by_magnitude[0] * u) < 1e-2 * abs(by_magnitude[0])
    with pytest.raises(ValueError, match="read-only"):
        top[next(iter(top))][...] = 0


@pytest.mark.parametrize("model", ["batchnorm", "embedding"])
def test_hvp_and_curvature_change_nothing(backend, model):
    data = batches(0, 2, BATCH, sparse=model == "embedding")
    face = backend.make(model, "adam")
    face.step(face.cut(data[0], 8))  # optimizer state, moving statistics and step not initial
    before = face.values()
    face.hvp(data[1], _vectors(face, 3), micro_batch_size=8)
    face.curvature(data[1], trace_samples=2, top=1, iterations=3, micro_batch_size=8)
    same(face.values(), before)


def test_random_layers_see_one_operator_or_are_refused(backend):
    data = batches(0, 1, BATCH)[0]
    face = backend.make("dropout", "sgd")
    face.compute(face.native(data))
    v = _vectors(face, 4)
    if backend.id == "tf1":  # a session's random ops draw anew at every call
        with pytest.raises(hostavg.ArgumentError, match=r"random ops .*tf\.nn\.dropout"):
            face.hvp(data, v)
        return
    before = face.values()
    first = face.hvp(data, v, micro_batch_size=8)
    same(dict(face.hvp(data, v, micro_batch_size=8)), dict(first))  # the same masks again
    same(face.values(), before)  # the seed states too


def test_vectors_and_settings_are_checked(backend):
    data = batches(0, 1, BATCH)[0]
    face = backend.make("mlp", "sgd")
    face.compute(face.native(data))
    v = _vectors(face, 5)
    name = next(iter(v))
    with pytest.raises(hostavg.ArgumentError, match=rf"hvp: vectors.*missing \['{name}'\]"):
        face.hvp(data, {k: x for k, x in v.items() if k != name})
    with pytest.raises(hostavg.ArgumentError, match=r"hvp: vectors.*shape \(2,\)"):
        face.hvp(data, {**v, name: np.zeros(2)})
    with pytest.raises(hostavg.HostavgError, match="hvp: vectors.*NaN"):
        face.hvp(data, {**v, name: np.full(v[name].shape, np.nan)})
    with pytest.raises(hostavg.ArgumentError, match=r"iterations must be >= top \(3\), got 2"):
        face.curvature(data, top=3, iterations=2)
    with pytest.raises(hostavg.ArgumentError, match="tolerance must be a finite number > 0, got 0"):
        face.curvature(data, tolerance=0)
    with pytest.raises(hostavg.ArgumentError, match="nothing to measure"):
        face.curvature(data, trace_samples=0, top=0)


def _weights(face) -> dict:
    values = face.values()
    return {name: values[name].astype(np.float64) for name in face.trainer.spec}


def _dense(g) -> dict:
    return {n: (v.to_dense() if isinstance(v, hostavg.SparseGradient) else np.asarray(v))
            for n, v in g.items()}


def test_the_curvature_hook_measures_before_the_apply_and_where_the_step_landed(backend):
    data = batches(0, 2, BATCH)
    hook = hostavg.hooks.Curvature(every=1, trace_samples=4, top=1, iterations=10)
    face = backend.make("mlp", "sgd", hooks=[hook])
    start = None
    for d in data:
        before = face.compute(face.native(d))
        w0 = _weights(face)
        start = w0 if start is None else start
        want = face.curvature(d, trace_samples=4, top=1, iterations=10, micro_batch_size=8)
        result = face.step(face.cut(d, 8))
        w1, after = _weights(face), face.compute(face.native(d))
        u = _flat(face, {n: w1[n] - w0[n] for n in w1})
        # the quadratic a t^2 + b t + c through (0, L0), (1, L1) with slopes g0.u and g1.u
        # at t = 0 and 1, by least squares; alpha = (1 - t*) / |t*| at its minimum t*
        (a, b, _), *_ = np.linalg.lstsq(
            np.array([[0, 0, 1], [1, 1, 1], [0, 1, 0], [2, 1, 0]], float),
            [before.loss, after.loss, _flat(face, _dense(before)) @ u,
             _flat(face, _dense(after)) @ u], rcond=None)
        info = result.info
        assert info["alpha"] == pytest.approx((1 + b / (2 * a)) / abs(b / (2 * a)), rel=1e-4)
        assert info["update_norm"] == pytest.approx(np.linalg.norm(u), rel=1e-6)
        assert info["distance"] == pytest.approx(
            np.linalg.norm(_flat(face, {n: w1[n] - start[n] for n in w1})), rel=1e-6)
        assert info["hessian_top_eigenvalue"] == pytest.approx(want.top_eigenvalues[0], rel=1e-6)
        assert info["hessian_trace"] == pytest.approx(want.trace, rel=1e-6)
        assert info["sharpness"] == pytest.approx(want.top_eigenvalues[0] * 0.1 / 2, rel=1e-6)


@pytest.mark.parametrize("model,size", [("batchnorm", 8), ("embedding", 8), ("mlp", BATCH)])
def test_the_curvature_hook_leaves_the_step_as_it_was(backend, model, size):
    """Bit for bit, over micro-batches and over one (whose mean is its gradient itself, a
    buffer the measures' computes must leave alone), and what the steps returned too."""
    data = batches(0, 2, BATCH, sparse=model == "embedding")
    plain = backend.make(model, "adam")
    measured = backend.make(model, "adam", hooks=[hostavg.hooks.Curvature(
        every=2, trace_samples=2, top=1, iterations=3)])
    for d in data:
        want = plain.step(plain.cut(d, size))
        result = measured.step(measured.cut(d, size))
        same(_dense(result.grads), _dense(want.grads))
    same(measured.values(), plain.values())  # weights, optimizer, moving statistics, step
    assert result.step == 2 and result.info["hessian_top_eigenvalue"] is not None


def test_the_curvature_quantities_reach_the_history(backend):
    data = batches(0, 1, BATCH)[0]
    face = backend.make("mlp", "sgd", micro_batch_size=8, hooks=[hostavg.hooks.Curvature(
        every=2, trace_samples=2, top=1, iterations=3)])
    table = face.fit(data, batch_size=BATCH, epochs=4, verbose=0).to_pandas()
    for name in ("hessian_trace", "hessian_top_eigenvalue", "sharpness", "alpha", "distance",
                 "update_norm"):
        assert table[name].isna().tolist() == [True, False, True, False], name
