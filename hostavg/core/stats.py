"""Statistics of micro-batch gradients: noise scale, batch-size tests, agreement. Pure NumPy.

Notation, shared by every function here: ``G`` is a (k, D) array whose row i is
micro-batch i's gradient g_i (the gradient of its MEAN loss), flattened; ``b``
holds the k micro-batch sizes (or weights); B = sum_i b_i and
Gbar = sum_i b_i g_i / B, the gradient of the whole batch. Everything is
computed in float64.

* S = sum_i b_i |g_i - Gbar|^2 / (k - 1) estimates tr(Sigma);
* g2 = |Gbar|^2 - S / B estimates |G_true|^2;
* b_simple = S / g2 is the "simple noise scale" of McCandlish et al. (2018).

Single-step estimates are noisy: average over steps (:class:`NoiseScale`).

See docs/explanation/computes.md for the model behind them and the batch-size
tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from hostavg.core import display
from hostavg.core.blas import need_one_blas_thread
from hostavg.core.errors import ArgumentError, short
from hostavg.core.gradients import BLOCK, SparseGradient, global_norm, squared_norm

__all__ = [
    "NOISE_SCALE_BETA",
    "NoiseScale",
    "NoiseScaleEstimate",
    "StepStats",
    "cosines",
    "cosines_from_dots",
    "cosines_to_rest",
    "flatten",
    "from_sums",
    "gsnr",
    "inner_product_test",
    "noise_scale",
    "norm_test",
    "orthogonality_test",
    "pairwise_cosines",
    "step_stats",
    "update_ratio",
]

GSNR_EPS = 1e-5
#: The running noise scale's decay per step, wherever one is kept (:class:`NoiseScale`, the
#: TensorBoard hook, :func:`hostavg.plot.noise_scale`): bias-corrected averages over about the
#: last 10 steps, which follow a short run and still smooth one step's noise.
NOISE_SCALE_BETA = 0.9

#: Below this share of |S|^2 + |b_i g_i|^2, the others' squared sum is rounding (see
#: :func:`cosines_to_rest`).
REST_EPS = 1e-10


@dataclass(frozen=True)
class StepStats:
    """Statistics of one optimizer step, on every StepResult as ``result.stats``.

    Estimates that need two micro-batches are None when fewer were
    accumulated; those marked "stack" are None in ``accumulate="sum"`` and, in
    "stack" mode, computed when first read. Dropped micro-batches (see hooks)
    count in ``micro_norms`` and ``micro_losses`` only. See
    docs/explanation/computes.md for what each costs.

    Attributes:
      grad_norm: L2 norm of the applied mean gradient.
      micro_norms: (k,) each micro-batch's gradient norm, as accumulated.
      micro_losses: (k,) each micro-batch's loss.
      variable_norms: name -> L2 norm of that variable's applied mean gradient.
      micro_variable_norms: (k,) per micro-batch (dropped ones too), name ->
        L2 norm of its gradient for that variable, as accumulated; the
        session already reduced them, so they cost nothing. None over MPI
        (each rank holds its own micro-batches only).
      g2, trace_sigma, b_simple: :func:`noise_scale`'s estimates.
      norm_test: :func:`norm_test`.
      inner_product_test, orthogonality_test, gsnr: stack only.
      cosines: (k_accumulated,) each accumulated micro-batch's cosine with the
        mean; stack only.
      cosines_to_rest: (k_accumulated,) each accumulated micro-batch's cosine
        with the weighted mean of the OTHERS (:func:`cosines_to_rest`), which
        it does not sway however large it is; stack only.
      pairwise_cosines: (k_accumulated, k_accumulated) the cosine between
        every two accumulated micro-batches' gradients, g_i . g_j / (|g_i| |g_j|)
        over every variable (a read-only float64 array; 1 on the diagonal, NaN
        in the row and column of a gradient of norm 0); stack only. The same as
        ``hostavg.stats.pairwise_cosines(hostavg.stats.flatten(grads)[0])``.
    """

    grad_norm: float
    micro_norms: tuple
    micro_losses: tuple
    variable_norms: dict
    micro_variable_norms: tuple | None = None
    g2: float | None = None
    trace_sigma: float | None = None
    b_simple: float | None = None
    norm_test: float | None = None
    stack: tuple | None = field(default=None, repr=False, compare=False)
    weights: tuple | None = field(default=None, repr=False, compare=False)
    mean: Mapping | None = field(default=None, repr=False, compare=False)
    sq_norms: tuple | None = field(default=None, repr=False, compare=False)
    mean_sq_norm: float | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return display.summary("StepStats", {
            "grad_norm": self.grad_norm, "micro_batches": len(self.micro_norms), "g2": self.g2,
            "trace_sigma": self.trace_sigma, "b_simple": self.b_simple,
            "norm_test": self.norm_test, "stack": "yes" if self.stack is not None else None})

    def _repr_html_(self) -> str:
        names = ("grad_norm", "g2", "trace_sigma", "b_simple", "norm_test", "inner_product_test",
                 "orthogonality_test", "gsnr")
        found = [(n, getattr(self, n)) for n in names]
        columns = {"loss": self.micro_losses, "norm": self.micro_norms}
        if self.cosines is not None and len(self.cosines) == len(self.micro_norms):
            columns["cosine"] = self.cosines  # (with a dropped one, they do not line up)
        rows = [[i, *values] for i, values in enumerate(zip(*columns.values()))]
        caption = "; ".join(f"{n} {display.number(v)}" for n, v in found if v is not None)
        return display.html(f"StepStats: {caption}", ["micro-batch", *columns], rows)

    def applied(self, mean: Mapping) -> StepStats:
        """These statistics with ``grad_norm`` and ``variable_norms`` of ``mean``, the mean a hook applied instead.

        The estimates stay those of the accumulated mean.
        """
        return replace(self, **_norms(mean, {})[0])

    @cached_property
    def _moments(self):
        if self.stack is None or len(self.stack) < 2:
            return None
        return _stack_moments(self.stack, self.weights, self.mean, self.sq_norms,
                              self.mean_sq_norm)

    @cached_property
    def inner_product_test(self) -> float | None:
        m = self._moments
        if m is None:
            return None
        v = float(m.b @ (m.dots - m.gbar_sq) ** 2) / (len(m.b) - 1)
        return math.sqrt(v / (m.B * m.gbar_sq ** 2)) if m.gbar_sq > 0 else math.inf

    @cached_property
    def orthogonality_test(self) -> float | None:
        m = self._moments
        if m is None:
            return None
        if m.gbar_sq == 0:
            return math.inf
        v = float(m.b @ (m.sq - m.dots ** 2 / m.gbar_sq)) / (len(m.b) - 1)
        return math.sqrt(max(v, 0.0) / (m.B * m.gbar_sq))

    @cached_property
    def gsnr(self) -> float | None:
        return None if self._moments is None else self._moments.gsnr

    @cached_property
    def cosines(self) -> tuple | None:
        m = self._moments
        return None if m is None else tuple(cosines_from_dots(m.dots, m.sq, m.gbar_sq, m.b)[0])

    @cached_property
    def cosines_to_rest(self) -> tuple | None:
        m = self._moments
        return None if m is None else tuple(cosines_from_dots(m.dots, m.sq, m.gbar_sq, m.b)[1])

    @cached_property
    def pairwise_cosines(self) -> np.ndarray | None:
        if self.stack is None or len(self.stack) < 2:
            return None
        gram = np.zeros((len(self.stack), len(self.stack)))
        for _, rows in _variable_rows(self.stack, self.mean):
            _blocked_gram(rows, gram)
        norms = np.sqrt(np.diag(gram))
        with np.errstate(invalid="ignore", divide="ignore"):
            out = gram / np.outer(norms, norms)
        out.flags.writeable = False
        return out


class _Moments(NamedTuple):
    b: np.ndarray  # (k,) weights
    B: float
    dots: np.ndarray  # (k,) g_i . Gbar
    sq: np.ndarray  # (k,) |g_i|^2
    gbar_sq: float
    gsnr: float


def _stack_moments(stack, weights, mean, sq_norms, gbar_sq: float) -> _Moments:
    """What the stack-only estimates need, streamed variable by variable.

    The same quantities as :func:`flatten` then the functions above, without
    the (k, D) float64 copy (see :func:`_blocked_moments`). Gbar is the
    accumulated mean; a sparse variable counts its touched rows, and its
    untouched coordinates add 0 to GSNR's sum.
    """
    b = np.asarray(weights, np.float64)
    dots = np.zeros(len(b))
    gsnr_sum = 0.0
    coordinates = sum(math.prod(m.dense_shape) if isinstance(m, SparseGradient) else m.size
                      for m in mean.values())
    for gbar, rows in _variable_rows(stack, mean):
        gsnr_sum += _blocked_moments(gbar, rows, b, dots)
    return _Moments(b, float(b.sum()), dots, np.asarray(sq_norms, np.float64), gbar_sq,
                    gsnr_sum / coordinates)


def _variable_rows(stack, mean):
    """Per variable, (Gbar, [g_i]) flattened, aligned coordinate by coordinate.

    A sparse variable gives the rows the mean touched (every row some
    accumulated micro-batch touched), each micro-batch's coalesced rows
    scattered onto them; its other rows are 0 in every g_i and add nothing.
    """
    for name, m in mean.items():
        if isinstance(m, SparseGradient):
            gbar = m.values
            rows = []
            for g in stack:
                c = g[name].coalesce()
                full = np.zeros_like(gbar)
                full[np.searchsorted(m.indices, c.indices)] = c.values
                rows.append(full)
        else:
            gbar, rows = np.asarray(m), [g[name] for g in stack]
        yield np.ravel(gbar), [np.ravel(r) for r in rows]


def _blocked_moments(gbar: np.ndarray, rows: list, b: np.ndarray, dots: np.ndarray) -> float:
    """Adds g_i . Gbar to ``dots``; returns this variable's sum over coordinates of Gbar_j^2 / (sigma_j^2 + eps).

    Works through blocks of 65,536 coordinates so that every buffer stays in
    cache (fresh arrays the size of a variable cost page faults on each step).
    sum_i b_i (g_ij - Gbar_j)^2 is taken as sum_i b_i g_ij^2 - B Gbar_j^2 in
    float64, the first sum kept as b_0 * sum_i (b_i / b_0) g_ij^2 so that equal
    weights need no multiply.
    """
    need_one_blas_thread()
    k, B = len(b), float(b.sum())
    squares, tmp = np.empty(BLOCK), np.empty(BLOCK)
    total = 0.0
    for start in range(0, gbar.size, BLOCK):
        gb64 = gbar[start:start + BLOCK].astype(np.float64)
        n = len(gb64)
        acc, r = squares[:n], tmp[:n]
        acc[:] = 0.0
        for i, row in enumerate(rows):
            np.copyto(r, row[start:start + BLOCK])  # float64: products of float32 cannot overflow
            dots[i] += float(np.dot(r, gb64))
            np.square(r, out=r)
            if b[i] != b[0]:
                r *= b[i] / b[0]
            acc += r
        sq = gb64 * gb64
        spread = np.maximum(b[0] * acc - B * sq, 0.0) / (k - 1)
        total += float(np.sum(sq / (spread + GSNR_EPS)))
    return total




def _blocked_gram(rows: list, gram: np.ndarray) -> None:
    """Adds sum over coordinates of g_i g_j to ``gram`` (k, k), in float64 blocks of
    :data:`~hostavg.core.gradients.BLOCK` coordinates (k of them at a time stay in cache)."""
    need_one_blas_thread()
    size = rows[0].size
    block = np.empty((len(rows), min(BLOCK, size)))
    for start in range(0, size, BLOCK):
        n = min(BLOCK, size - start)
        part = block[:, :n]
        for i, row in enumerate(rows):
            np.copyto(part[i], row[start:start + n])
        gram += part @ part.T


def step_stats(mean: Mapping, weights: Sequence[float], sq_norms: Sequence[float],
               micro_norms: Sequence[float], micro_losses: Sequence[float],
               stack: Sequence[Mapping] | None = None,
               micro_variable_sq_norms: Sequence[Mapping] | None = None,
               mean_sq_norms: Mapping[str, float] | None = None) -> StepStats:
    """A step's :class:`StepStats`.

    Args:
      mean: the accumulated mean, name -> array or SparseGradient.
      weights: b_i of the k accumulated micro-batches.
      sq_norms: |g_i|^2 of the k accumulated micro-batches.
      micro_norms: |g_i| of every micro-batch of the step, dropped ones included.
      micro_losses: the loss of every micro-batch of the step, dropped ones included.
      stack: the k accumulated micro-batches' gradients ("stack" mode), or None.
      micro_variable_sq_norms: per micro-batch (dropped ones included), name ->
        squared norm of its gradient for that variable; or None.
      mean_sq_norms: name -> squared norm of ``mean``'s gradient for that
        variable where already known (the mean of one micro-batch is its
        gradient); None: computed here.
    """
    norms, gbar_sq = _norms(mean, mean_sq_norms or {})
    per_variable = None if micro_variable_sq_norms is None else tuple(
        {name: math.sqrt(q) for name, q in sq.items()} for sq in micro_variable_sq_norms)
    base = dict(**norms, micro_norms=tuple(micro_norms), micro_losses=tuple(micro_losses),
                micro_variable_norms=per_variable,
                stack=None if stack is None else tuple(stack), weights=tuple(weights),
                mean=mean, sq_norms=tuple(sq_norms), mean_sq_norm=gbar_sq)
    k = len(weights)
    if k < 2:
        return StepStats(**base)
    B = math.fsum(weights)
    est = from_sums(math.fsum(w * q for w, q in zip(weights, sq_norms)), B, gbar_sq, k)
    return StepStats(**base, g2=est.g2, trace_sigma=est.trace_sigma, b_simple=est.b_simple,
                     norm_test=_norm_test(est.trace_sigma, B, gbar_sq))


def _norms(mean: Mapping, known: Mapping) -> tuple[dict, float]:
    """StepStats' grad_norm and variable_norms of ``mean``, and its squared norm."""
    sq = {name: known[name] if name in known else squared_norm(v) for name, v in mean.items()}
    return {"grad_norm": global_norm(mean, sq),
            "variable_norms": {n: global_norm({n: v}, sq) for n, v in mean.items()}}, \
        math.fsum(sq.values())


class NoiseScaleEstimate(NamedTuple):
    """One step's noise-scale estimate (see the module docstring).

    Attributes:
      g2: unbiased estimate of |G_true|^2; may be negative.
      trace_sigma: unbiased estimate of tr(Sigma), the per-sample gradient
        covariance's trace.
      b_simple: trace_sigma / g2, in samples.
    """

    g2: float
    trace_sigma: float
    b_simple: float


def _check(G, b) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    need_one_blas_thread()
    G = np.asarray(G, np.float64)
    b = np.asarray(b, np.float64)
    if G.ndim != 2:
        raise ArgumentError(f"G must be a (k, D) array of flattened gradients, got shape {G.shape}")
    if b.shape != (G.shape[0],):
        raise ArgumentError(f"b must hold one size per row of G: shape ({G.shape[0]},), got {b.shape}")
    if G.shape[0] < 2:
        raise ArgumentError(f"these estimates need at least 2 micro-batches, got {G.shape[0]}")
    if not (np.isfinite(b).all() and (b > 0).all()):
        raise ArgumentError(f"b must be finite and > 0, got {b}")
    B = float(b.sum())
    return G, b, B, b @ G / B


def noise_scale(G, b) -> NoiseScaleEstimate:
    """The simple noise scale's parts from one step's micro-batch gradients.

    Example:
      >>> est = noise_scale([[1.0, 0.0], [3.0, 0.0]], [1, 1])
      >>> est.trace_sigma, est.g2   # S = (1 + 1) / 1, g2 = 4 - 2 / 2
      (2.0, 3.0)
    """
    G, b, B, gbar = _check(G, b)
    S = _spread(G, b, gbar)
    g2 = float(gbar @ gbar) - S / B
    return NoiseScaleEstimate(g2, S, S / g2 if g2 != 0 else math.inf)


def from_sums(weighted_sq_norms: float, B: float, gbar_sq: float, k: int) -> NoiseScaleEstimate:
    """:func:`noise_scale` from running sums, without the stack: O(1) memory.

    Args:
      weighted_sq_norms: sum_i b_i |g_i|^2.
      B: sum_i b_i.
      gbar_sq: |Gbar|^2.
      k: number of micro-batches, >= 2.

    Uses sum_i b_i |g_i - Gbar|^2 = sum_i b_i |g_i|^2 - B |Gbar|^2.
    """
    S = (weighted_sq_norms - B * gbar_sq) / (k - 1)
    g2 = gbar_sq - S / B
    return NoiseScaleEstimate(g2, S, S / g2 if g2 != 0 else math.inf)


def norm_test(G, b) -> float:
    """sqrt(S / (B |Gbar|^2)): the norm test; above 1, the batch is too small for its norm."""
    G, b, B, gbar = _check(G, b)
    return _norm_test(_spread(G, b, gbar), B, float(gbar @ gbar))


def _norm_test(S, B, gbar_sq) -> float:
    return math.sqrt(max(S, 0.0) / (B * gbar_sq)) if gbar_sq > 0 else math.inf


def inner_product_test(G, b) -> float:
    """sqrt(V_ip / (B |Gbar|^4)), V_ip = sum_i b_i (g_i . Gbar - |Gbar|^2)^2 / (k - 1)."""
    G, b, B, gbar = _check(G, b)
    sq = float(gbar @ gbar)
    v = float(b @ (G @ gbar - sq) ** 2) / (len(b) - 1)
    return math.sqrt(v / (B * sq * sq)) if sq > 0 else math.inf


def orthogonality_test(G, b) -> float:
    """sqrt(V_orth / (B |Gbar|^2)), V_orth = sum_i b_i (|g_i|^2 - (g_i . Gbar)^2 / |Gbar|^2) / (k - 1)."""
    G, b, B, gbar = _check(G, b)
    sq = float(gbar @ gbar)
    if sq == 0:
        return math.inf
    v = float(b @ (np.einsum("ij,ij->i", G, G) - (G @ gbar) ** 2 / sq)) / (len(b) - 1)
    return math.sqrt(max(v, 0.0) / (B * sq))


def gsnr(G, b) -> float:
    """Mean over coordinates j of Gbar_j^2 / (sigma_j^2 + 1e-5), sigma_j^2 = sum_i b_i (g_ij - Gbar_j)^2 / (k - 1)."""
    G, b, B, gbar = _check(G, b)
    var = b @ (G - gbar) ** 2 / (len(b) - 1)
    return float(np.mean(gbar ** 2 / (var + GSNR_EPS)))


def cosines(G, b) -> np.ndarray:
    """(k,) each micro-batch's cosine with Gbar (NaN where a norm is 0)."""
    G, b, B, gbar = _check(G, b)
    with np.errstate(invalid="ignore", divide="ignore"):
        return G @ gbar / (np.linalg.norm(G, axis=1) * np.linalg.norm(gbar))


def cosines_to_rest(G, b) -> np.ndarray:
    """(k,) each row's cosine with the b-weighted mean of the OTHER rows.

    With S = B Gbar, the others sum to S - b_i g_i, so every cosine comes from
    g_i . Gbar and |g_i|^2 (O(k D), no k x k products):
    cos_i = (B g_i . Gbar - b_i |g_i|^2) / (|g_i| |S - b_i g_i|),
    |S - b_i g_i|^2 = B^2 |Gbar|^2 - 2 B b_i g_i . Gbar + b_i^2 |g_i|^2.
    NaN where a norm is 0, or where the others' sum is below 1e-5 of
    sqrt(|S|^2 + |b_i g_i|^2): float64 cannot tell it from rounding there.

    Example:
      >>> cosines_to_rest([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [1, 1, 1])  # row 0: [1, 2]
      array([0.4472136, 0.4472136, 1.       ])
    """
    G, b, B, gbar = _check(G, b)
    return _to_rest(G @ gbar, np.einsum("ij,ij->i", G, G), float(gbar @ gbar), b)


def cosines_from_dots(dots, sq_norms, gbar_sq: float, b) -> tuple[np.ndarray, np.ndarray]:
    """(each row's cosine with Gbar, :func:`cosines_to_rest`) from g_i . Gbar, |g_i|^2,
    |Gbar|^2 and b_i alone: (k,) float64 each, without G. The first is
    g_i . Gbar / (|g_i| |Gbar|), NaN where a norm is 0.

    Example:
      >>> cosines_from_dots([0.5, 0.5], [1.0, 1.0], 0.5, [1, 1])  # rows [1, 0] and [0, 1]
      (array([0.70710678, 0.70710678]), array([0., 0.]))
    """
    dots, sq, b = (np.asarray(a, np.float64) for a in (dots, sq_norms, b))
    with np.errstate(invalid="ignore", divide="ignore"):
        return dots / (np.sqrt(sq) * math.sqrt(gbar_sq)), _to_rest(dots, sq, gbar_sq, b)


def _to_rest(dots: np.ndarray, sq: np.ndarray, gbar_sq: float, b: np.ndarray) -> np.ndarray:
    """:func:`cosines_to_rest` from g_i . Gbar, |g_i|^2, |Gbar|^2 and b_i."""
    B = float(b.sum())
    whole, own = B * B * gbar_sq, b * b * sq
    rest_sq = whole - 2 * B * b * dots + own
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (B * dots - b * sq) / np.sqrt(sq * rest_sq)
    out[~(rest_sq > REST_EPS * (whole + own))] = np.nan
    return np.clip(out, -1.0, 1.0)


def pairwise_cosines(G) -> np.ndarray:
    """(k, k) cosine between every two rows of G."""
    need_one_blas_thread()
    G = np.asarray(G, np.float64)
    norms = np.linalg.norm(G, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (G @ G.T) / np.outer(norms, norms)


def _spread(G, b, gbar) -> float:
    need_one_blas_thread()
    d = G - gbar
    return float(b @ np.einsum("ij,ij->i", d, d)) / (len(b) - 1)


def flatten(grads: Sequence[Mapping]) -> tuple[np.ndarray, int]:
    """Stacks k micro-batches' gradients into G (k, D') for the functions above.

    Dense variables are flattened whole. A sparse variable contributes only the
    rows that some micro-batch touched (duplicates summed): every other row is
    zero in every g_i, so norms, dot products and cosines are unchanged.

    Returns:
      (G, D): G in float64, and D the full number of coordinates (dense size
      of every variable), which :func:`gsnr` averages over when the caller
      rescales by D' / D.
    """
    names = list(grads[0])
    blocks, total = [], 0
    for name in names:
        values = [g[name] for g in grads]
        if isinstance(values[0], SparseGradient):
            total += math.prod(values[0].dense_shape)
            union = np.unique(np.concatenate([v.indices for v in values]))
            row = math.prod(values[0].dense_shape[1:])
            block = np.zeros((len(values), len(union), row))
            for i, v in enumerate(values):
                c = v.coalesce()
                block[i, np.searchsorted(union, c.indices)] = c.values.reshape(len(c.indices), row)
            blocks.append(block.reshape(len(values), -1))
        else:
            total += values[0].size
            blocks.append(np.stack([np.ravel(v) for v in values]).astype(np.float64))
    return np.concatenate(blocks, axis=1), total


class NoiseScale:
    """A running estimate of the simple noise scale B_simple = tr(Sigma) / |G|^2 over steps.

    One step's estimates are noisy, and |G|^2's can be negative; this keeps
    bias-corrected exponential moving averages of tr(Sigma) and |G|^2
    separately (as McCandlish et al. advise) and reports their ratio.

    Use it as a trainer hook (``hooks=[hostavg.NoiseScale()]``), or call
    :meth:`update` with each step's estimate.

    B_simple is an upper estimate of the critical batch size, not the critical batch size
    itself (McCandlish et al. 2018, section 2.2: it equals B_crit only where the Hessian is a
    multiple of the identity); a sweep measures B_crit (docs: "The noise scale").

    Attributes:
      beta: the averages' decay per step (default :data:`NOISE_SCALE_BETA`).
      trace_sigma, g2: the bias-corrected averages (None before any update).
      b_simple: trace_sigma / g2; NaN where that is no noise scale (:attr:`nan_reason` says
        why: the averaged |G|^2 not > 0 yet); None before any update.
      nan_reason: why ``b_simple`` is NaN, or None where it is a number.
      history: (step, b_simple) after each update.
    """

    def __init__(self, beta: float = NOISE_SCALE_BETA):
        if not 0 <= beta < 1:
            raise ArgumentError(f"beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self._s = self._g2 = 0.0
        self._n = 0
        self.history: list[tuple[int, float]] = []

    def update(self, estimate: NoiseScaleEstimate, step: int | None = None) -> float:
        """Folds one step's estimate in; returns the running b_simple."""
        self._n += 1
        self._s = self.beta * self._s + (1 - self.beta) * estimate.trace_sigma
        self._g2 = self.beta * self._g2 + (1 - self.beta) * estimate.g2
        value = self.b_simple
        self.history.append((self._n if step is None else step, value))
        return value

    @property
    def trace_sigma(self) -> float | None:
        return self._s / (1 - self.beta ** self._n) if self._n else None

    @property
    def g2(self) -> float | None:
        return self._g2 / (1 - self.beta ** self._n) if self._n else None

    @property
    def b_simple(self) -> float | None:
        if not self._n:
            return None
        return math.nan if self.nan_reason else self._s / self._g2

    @property
    def nan_reason(self) -> str | None:
        finite = math.isfinite(self._s) and math.isfinite(self._g2)
        if not self._n or (finite and self._g2 > 0 and self._s >= 0):
            return None
        if not finite:
            return (f"a step's estimate was not finite (averages: trace_sigma "
                    f"{short(self.trace_sigma)}, g2 {short(self.g2)})")
        if self._s < 0:
            return f"the averaged trace_sigma is {short(self.trace_sigma)}, below 0"
        return (f"the averaged |G|^2 (g2) is {short(self.g2)}, not > 0: the micro-batches' spread "
                f"still hides the mean gradient; it needs more steps, or more samples per step")

    def on_step(self, mean, result) -> None:
        """The hook: updates from ``result.stats`` when the step had two micro-batches or more."""
        if result.stats.trace_sigma is not None:
            self.update(NoiseScaleEstimate(result.stats.g2, result.stats.trace_sigma,
                                           result.stats.b_simple), result.step)

    def __repr__(self) -> str:
        return f"NoiseScale(beta={self.beta}, b_simple={self.b_simple}, updates={self._n})"


def update_ratio(update_sq: float, weight_sq: float) -> float:
    """|update| / |weights| from their squared L2 norms: 0 where nothing moved, inf where
    weights of norm 0 moved (``StepResult.update_ratios``).

    Example:
      >>> update_ratio(1.0, 4.0), update_ratio(0.0, 0.0), update_ratio(1.0, 0.0)
      (0.5, 0.0, inf)
    """
    if update_sq == 0:
        return 0.0
    return math.sqrt(update_sq / weight_sq) if weight_sq > 0 else math.inf
