"""The curvature numerics on explicit matrices (hostavg.core.curvature), and the engine's
accumulation of Hessian-vector products over micro-batches (hostavg.engine.products) over a
framework-free backend whose Hessian is a given matrix per micro-batch."""

import numpy as np
import pytest

import hostavg
from hostavg.core import curvature
from hostavg.core.curvature import CurvatureSettings
from hostavg.core.gradients import VariableSpec
from hostavg.engine.step import Engine


def symmetric(dim: int, seed: int, top: float = 0.0) -> np.ndarray:
    """A random symmetric matrix, its first diagonal entry raised by ``top`` (a spectral gap)."""
    a = np.random.default_rng(seed).normal(0, 1, (dim, dim))
    a = (a + a.T) / 2
    a[0, 0] += top
    return a


@pytest.mark.parametrize("sign", [1, -1])
def test_lanczos_finds_the_eigenvalues_of_largest_magnitude(sign):
    a = sign * symmetric(60, 0, top=20)
    want = np.linalg.eigvalsh(a)
    want = want[np.argsort(-np.abs(want))][:2]
    values, vectors, converged, used = curvature.lanczos(lambda v: a @ v, 60, 2, 60, 1e-6,
                                                         np.random.default_rng(1))
    np.testing.assert_allclose(values, want, rtol=1e-6)
    assert converged and used < 60  # stopped at the tolerance, before the last iteration
    for value, u in zip(values, vectors):
        assert np.linalg.norm(a @ u - value * u) < 1e-4 * abs(value)
        assert np.linalg.norm(u) == pytest.approx(1)


def test_lanczos_stops_on_an_invariant_subspace_and_at_its_iterations():
    a = np.diag([5.0, -3.0, 1.0])
    values, _, converged, used = curvature.lanczos(lambda v: a @ v, 3, 3, 20, 1e-9,
                                                   np.random.default_rng(0))
    np.testing.assert_allclose(values, [5.0, -3.0, 1.0], atol=1e-10)
    assert converged and used == 3
    _, _, converged, used = curvature.lanczos(lambda v: symmetric(50, 3) @ v, 50, 1, 4, 1e-9,
                                              np.random.default_rng(0))
    assert not converged and used == 4


def test_hutchinson_is_exact_on_a_diagonal_and_within_its_error_elsewhere():
    d = np.diag([1.0, -2.0, 7.5])
    trace, stderr = curvature.hutchinson(lambda v: d @ v, 3, 5, np.random.default_rng(0))
    assert (trace, stderr) == (6.5, 0.0)  # z^T D z = tr D for every z of +-1
    a = symmetric(40, 2)
    trace, stderr = curvature.hutchinson(lambda v: a @ v, 40, 200, np.random.default_rng(0))
    assert abs(trace - np.trace(a)) < 3 * stderr
    # the stderr is the probes' spread: Var(z^T A z) = 2 sum_{i != j} a_ij^2 for Rademacher z
    spread = np.sqrt(2 * (np.sum(a * a) - np.sum(np.diag(a) ** 2)) / 200)
    assert stderr == pytest.approx(spread, rel=0.2)


def test_flat_and_unflat_are_inverse():
    spec = {"w": VariableSpec((2, 3), np.dtype("float32"), False), "b": VariableSpec((), np.dtype("float32"), False)}
    values = {"w": np.arange(6.0).reshape(2, 3), "b": np.array(7.0)}
    v = curvature.flat(spec, values)
    np.testing.assert_array_equal(v, [0, 1, 2, 3, 4, 5, 7])
    back = curvature.unflat(spec, v)
    assert {k: a.shape for k, a in back.items()} == {"w": (2, 3), "b": ()}
    np.testing.assert_array_equal(back["w"], values["w"])


@pytest.mark.parametrize("settings,message", [
    (dict(top=2, iterations=1), r"iterations must be >= top \(2\), got 1"),
    (dict(trace_samples=-1), "trace_samples must be an integer >= 0, got -1"),
    (dict(tolerance=1.5), "tolerance must be < 1 .relative., got 1.5"),
    (dict(tolerance=float("nan")), "tolerance must be a finite number > 0, got nan"),
    (dict(seed=True), "seed must be an integer >= 0, got True"),
    (dict(trace_samples=0, top=0), "nothing to measure"),
])
def test_settings_are_checked(settings, message):
    with pytest.raises(hostavg.ArgumentError, match=message):
        CurvatureSettings(**settings)


class MatrixBackend:
    """A backend of one variable ``w`` (3 entries) whose micro-batch ``{"n": n, "a": A}`` has the
    Hessian ``A * (1 + draws)``: ``draws`` counts the products since the last restore, as a
    random layer's seed state moves with each forward pass."""

    spec = {"w": VariableSpec((3,), np.dtype("float32"), False)}
    advice = {"batches_name": "feeds", "batch_name": "feed"}
    increment = 1

    def __init__(self):
        self.draws = 0

    def prepare(self, feed, size, what):
        return feed, feed["n"]

    def random_ops(self):
        return ()

    def hvp(self, feed, vector):
        self.draws += 1
        return float(feed["n"]), {"w": feed["a"] * self.draws @ vector["w"]}

    def snapshot(self):
        return self.draws

    def restore(self, snapshot):
        self.draws = snapshot


def test_the_engine_weights_micro_batches_by_samples_and_fixes_the_state():
    a, b = symmetric(3, 0), symmetric(3, 1)
    feeds = [{"n": 1, "a": a}, {"n": 3, "a": b}]
    backend = MatrixBackend()
    engine = Engine(backend.spec)
    # the state moves within a product (the second micro-batch draws after the first), but
    # every product starts from the same state: one operator, (1 a + 3 (2 b)) / 4
    operator = (a + 3 * 2 * b) / 4
    v = np.array([1.0, -2.0, 0.5])
    got = engine.hvp(backend, feeds, {"w": v})
    np.testing.assert_allclose(got["w"], operator @ v, rtol=1e-6)
    assert got["w"].dtype == np.float32 and got.loss == (1 * 1 + 3 * 3) / 4 and got.size == 4
    assert backend.draws == 0  # restored
    found = engine.curvature(backend, feeds, CurvatureSettings(trace_samples=0, top=3,
                                                               iterations=3))
    want = np.linalg.eigvalsh(operator)
    np.testing.assert_allclose(found.top_eigenvalues, want[np.argsort(-np.abs(want))], rtol=1e-9)
    assert found.products == 3 and found.loss == 2.5 and backend.draws == 0


@pytest.mark.parametrize("quadratic,alpha", [
    ((1.0, -1.0, 0.25), 1.0),   # (t - 0.5)^2: the step lands at the start's height again
    ((1.0, -2.0, 1.0), 0.0),    # (t - 1)^2: at the minimum
    ((1.0, -4.0, 4.0), -0.5),   # (t - 2)^2: half way to it
    ((1.0, 1.0, 0.0), 3.0),     # t^2 + t: uphill from a minimum behind the start, at -1/2
    ((-1.0, 1.0, 0.0), np.nan),  # concave: no minimum along the step
])
def test_step_quality_on_exact_quadratics(quadratic, alpha):
    a, b, c = quadratic
    got = curvature.step_quality(c, b, a + b + c, 2 * a + b)
    np.testing.assert_allclose(got, alpha, atol=1e-12)
