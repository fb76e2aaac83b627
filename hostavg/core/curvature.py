"""The curvature of a loss from its Hessian-vector products alone: trace and top eigenvalues. NumPy only.

Everything here works on a function ``product(v) -> H v`` of flat float64 vectors
(the engine flattens a batch's products, :mod:`hostavg.engine.products`), so that it
can be checked on an explicit matrix:

* the trace by Hutchinson's estimator, ``tr H = E[z^T H z]`` over Rademacher
  vectors ``z`` (entries +-1), with the standard error of the mean of the samples;
* the eigenvalues of largest magnitude by Lanczos's method with full
  reorthogonalisation: ``j`` products span a Krylov space, whose tridiagonal
  matrix ``T_j`` has Ritz values ``theta`` converging to H's extreme eigenvalues;
  it stops once each wanted one's residual ``|beta_j s_j|`` (beta_j the next
  off-diagonal, s_j the last entry of theta's eigenvector of T_j) is within
  ``tolerance * |theta|``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from hostavg.core.blas import need_one_blas_thread
from hostavg.core.errors import ArgumentError, non_negative_int, positive_int, positive_number
from hostavg.core.gradients import SparseGradient, VariableSpec, freeze

__all__ = ["Curvature", "CurvatureSettings", "flat", "hutchinson", "lanczos", "measure",
           "step_quality", "unflat"]

Product = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class CurvatureSettings:
    """How :meth:`~hostavg.engine.step.Engine.curvature` measures, checked once.

    Attributes:
      trace_samples: Rademacher probes of the trace (0: no trace).
      top: how many eigenvalues of largest magnitude (0: none).
      iterations: the most Lanczos products (>= top).
      tolerance: the relative residual at which an eigenvalue counts as found (> 0).
      seed: of the probes and the Lanczos start.
    """

    trace_samples: int = 16
    top: int = 1
    iterations: int = 20
    tolerance: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        for name in ("trace_samples", "top", "seed"):
            object.__setattr__(self, name, non_negative_int(name, getattr(self, name)))
        object.__setattr__(self, "iterations", positive_int("iterations", self.iterations))
        if not (self.trace_samples or self.top):
            raise ArgumentError("trace_samples and top are both 0: nothing to measure")
        if self.iterations < self.top:
            raise ArgumentError(f"iterations must be >= top ({self.top}), got {self.iterations}")
        tolerance = positive_number("tolerance", self.tolerance)
        if tolerance >= 1:
            raise ArgumentError(f"tolerance must be < 1 (relative), got {self.tolerance!r}")
        object.__setattr__(self, "tolerance", tolerance)


@dataclass(frozen=True)
class Curvature:
    """The curvature of a batch's mean loss at the weights it was measured at.

    Attributes:
      loss: the batch's sample-weighted mean loss.
      trace: Hutchinson's estimate of the Hessian's trace (NaN with no probe).
      trace_stderr: its standard error (std of the probes / sqrt(probes); NaN below 2).
      top_eigenvalues: the ``top`` eigenvalues of largest magnitude, largest first (a
        negative one is a direction of negative curvature).
      eigenvectors: one read-only mapping (variable name -> array of its shape, unit norm
        over all variables together) per eigenvalue.
      converged: whether every eigenvalue met the tolerance within ``iterations``.
      products: the Hessian-vector products of the whole batch it took.
    """

    loss: float
    trace: float
    trace_stderr: float
    top_eigenvalues: tuple
    eigenvectors: tuple
    converged: bool
    products: int


def flat(spec, values: Mapping) -> np.ndarray:
    """``values`` (name -> array of its variable's shape, or SparseGradient) as one float64
    vector, in the order of ``spec``'s names (a spec, or a list of names)."""
    return np.concatenate([np.asarray(v.to_dense() if isinstance(v, SparseGradient) else v,
                                      np.float64).ravel()
                           for v in (values[name] for name in spec)])


def unflat(spec: Mapping[str, VariableSpec], vector: np.ndarray) -> dict:
    """The inverse of :func:`flat`: name -> a float64 array of each variable's shape."""
    out, start = {}, 0
    for name, s in spec.items():
        size = math.prod(s.shape)
        out[name] = vector[start:start + size].reshape(s.shape)
        start += size
    return out


def step_quality(loss_before: float, slope_before: float, loss_after: float,
                 slope_after: float) -> float:
    """Cockpit's alpha: where a step lands on the quadratic ``q(t) = a t^2 + b t + c`` fitted
    (least squares) along it to the loss and its directional derivative before it (t = 0)
    and after it (t = 1): ``alpha = (1 - t*) / |t*|``, t* = -b / 2a the fit's minimum, so -1
    stays, 0 lands at the minimum, +1 overshoots to the starting height. NaN where the fit
    has no minimum (a <= 0)."""
    need_one_blas_thread()
    design = np.array([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    (a, b, _), *_ = np.linalg.lstsq(
        design, np.array([loss_before, loss_after, slope_before, slope_after]), rcond=None)
    if not a > 0 or b == 0:
        return math.nan
    minimum = -b / (2 * a)
    return float((1 - minimum) / abs(minimum))


def hutchinson(product: Product, dim: int, samples: int, rng: np.random.Generator
               ) -> tuple[float, float]:
    """(the trace estimate, its standard error) from ``samples`` Rademacher probes."""
    if samples == 0:
        return math.nan, math.nan
    need_one_blas_thread()
    probes = [float(z @ product(z)) for z in
              (rng.choice(np.array([-1.0, 1.0]), dim) for _ in range(samples))]
    stderr = float(np.std(probes, ddof=1) / math.sqrt(samples)) if samples > 1 else math.nan
    return float(np.mean(probes)), stderr


def lanczos(product: Product, dim: int, top: int, iterations: int, tolerance: float,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, bool, int]:
    """(the ``top`` Ritz values of largest magnitude, largest first; their Ritz vectors as
    rows; whether all met ``tolerance``; the products used), from a random unit start."""
    need_one_blas_thread()
    if top == 0:
        return np.zeros(0), np.zeros((0, dim)), True, 0
    q = rng.standard_normal(dim)
    basis, alphas, betas, last = [q / np.linalg.norm(q)], [], [], min(iterations, dim)
    while True:
        w = product(basis[-1])
        alphas.append(float(w @ basis[-1]))
        q = np.array(basis)
        for _ in range(2):  # twice is enough (Parlett's "twice is enough")
            w = w - q.T @ (q @ w)
        beta = float(np.linalg.norm(w))
        theta, s = np.linalg.eigh(np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1))
        wanted = np.argsort(-np.abs(theta), kind="stable")[:top]
        done = len(alphas) >= top and bool(np.all(
            beta * np.abs(s[-1, wanted]) <= tolerance * np.abs(theta[wanted])))
        invariant = beta <= 1e-12 * max(1.0, float(np.max(np.abs(theta))))
        if done or invariant or len(alphas) == last:
            return theta[wanted], s[:, wanted].T @ q, done or invariant, len(alphas)
        betas.append(beta)
        basis.append(w / beta)


def measure(product: Product, spec: Mapping[str, VariableSpec], settings: CurvatureSettings
            ) -> Curvature:
    """The :class:`Curvature` of the operator ``product`` over ``spec``'s variables (its
    ``loss`` NaN: the caller knows it)."""
    dim = sum(math.prod(s.shape) for s in spec.values())
    count = [0]

    def counted(v: np.ndarray) -> np.ndarray:
        count[0] += 1
        return product(v)

    rng = np.random.default_rng(settings.seed)
    trace, stderr = hutchinson(counted, dim, settings.trace_samples, rng)
    values, vectors, converged, _ = lanczos(counted, dim, settings.top, settings.iterations,
                                            settings.tolerance, rng)
    return Curvature(math.nan, trace, stderr, tuple(map(float, values)),
                     tuple(MappingProxyType({n: freeze(a) for n, a in unflat(spec, v).items()})
                           for v in vectors), converged, count[0])
