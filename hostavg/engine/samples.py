"""Each sample of a batch computed alone, chunk by chunk (:meth:`Engine.per_sample`).

The first pass over chunks (of ``chunk_size`` samples, or as many as :data:`DEFAULT_CHUNK_BYTES`
of gradients hold) computes each sample's loss and squared gradient norm |g_i|^2 and adds the
K finite samples' gradients to a float64 sum, whose mean M is their mean gradient; the
second computes g_i . M. The cosines with M and with the others' mean, (K M - g_i) / (K -
1), follow (:func:`~hostavg.core.stats.cosines_from_dots`): no sample's gradient outlives
its chunk. A batch of one chunk needs no second pass: its call also dots each gradient with
their sum S = K M (divided by its largest entry), where those dots cover every finite
sample and the host's bound on their rounding (:meth:`_PerSample._own_holds`) allows.
A :class:`~hostavg.engine.protocols.Vectorized` backend computes a chunk in one call per
pass; elsewhere (or where vectorizing fails: a warning says why), and for a sample whose
squared norm is too small to trust (:attr:`_PerSample.floor`), each sample alone, its norm
and dot in float64. Both passes start from the same state: a chunk meets the same random
draws in each. Where a cosine to the rest would magnify the vectorized rounding past 1e-6
(one sample dominating), the batch is computed again, each sample alone (:data:`ROUNDING`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from hostavg.core.accumulator import Accumulator
from hostavg.core.blas import need_one_blas_thread
from hostavg.core.errors import HostavgError, warn
from hostavg.core.gradients import SparseGradient, squared_norm
from hostavg.core.split import sample_count, take
from hostavg.core.stats import cosines_from_dots
from hostavg.engine.batches import prepare_one
from hostavg.engine.culprits import refusal
from hostavg.engine.protocols import NotVectorized, SampleStats

__all__ = ["DEFAULT_CHUNK_BYTES", "default_chunk_size", "per_sample"]

#: A backend's vectorized sums, squared norms and dots round (in the variables' dtype): a
#: cosine to the rest is off by about ROUNDING epsilons of that dtype times
#: :func:`_amplification`'s bound (float32: 1.5e-8 times it, measured on an MLP where one
#: sample's inputs were 10 times the others'). Where that would pass TOLERANCE, every value
#: is computed again from each sample alone, its squared norm and dot in float64 on the host.
ROUNDING, TOLERANCE = 1 / 6, 1e-6

#: Bytes of per-sample gradients one chunk may hold unless ``chunk_size`` says how many
#: samples: as many samples as fit (at least one), each one's gradient counted whole in its
#: variables' dtypes (a tapped layer's is never formed). Activations are not counted: a
#: chunk is at most the batch, and holds about what a compute of it would.
DEFAULT_CHUNK_BYTES = 64 * 2 ** 20


class _Part(NamedTuple):
    """Samples of a chunk whose loss and gradient were finite, for the second pass.

    Attributes:
      feed: their prepared feed, to compute together; None: each computes alone.
      samples: their places in the batch, in the feed's order.
      given: their chunk as given and each one's place in it (for computing alone).
      grads: their gradients where kept (a batch of one chunk, computed alone), else None.
      dotted: whether their g_i . M came with the first pass (with their sum).
    """

    feed: Any
    samples: list
    given: tuple
    grads: list | None
    dotted: bool = False


def default_chunk_size(spec) -> int:
    """Samples per chunk unless told: as many as :data:`DEFAULT_CHUNK_BYTES` holds of
    gradients of ``spec`` (name -> shape and dtype), at least one. 64 MiB: 330 samples of a
    50,000-parameter float32 model, 8 of a 2-million-parameter one."""
    size = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in spec.values())
    return max(1, DEFAULT_CHUNK_BYTES // max(size, 1))


def per_sample(engine, backend, chunks: list, rows) -> SampleStats:
    """The samples of ``chunks`` (consecutive pieces of a batch, of data ``rows``: a read-only
    int64 array, or None) computed alone; see the module docstring. Changes nothing."""
    return _PerSample(engine, backend, chunks, rows).stats()


class _PerSample:
    """One call of :func:`per_sample`: its columns, filled chunk by chunk."""

    def __init__(self, engine, backend, chunks: list, rows):
        self.engine, self.backend, self.chunks, self.rows = engine, backend, chunks, rows
        self.own = False  # whether the first pass dots with its one chunk's own sum
        # a backend without sample_sums computes one sample per call by design: no warning
        self.vectorizing = hasattr(backend, "sample_sums")
        self._refusal = ""  # what the framework said when it last refused a call of several
        # a vectorized value's rounding, relatively, as it shows in a cosine to the rest
        self.rounding = ROUNDING * max(float(ml_dtypes.finfo(s.dtype).eps)
                                       for s in engine.spec.values())
        # what a sum of products or squares over a sample's gradient may lose, at most, where
        # they fall below the dtype's smallest normal (flushed to 0 by XLA on a CPU)
        self.floor = sum(math.prod(s.shape) for s in engine.spec.values()) * max(
            float(ml_dtypes.finfo(s.dtype).smallest_normal) for s in engine.spec.values())
        self._columns()

    def _columns(self) -> None:
        """Empty columns, mean and errors, for a pass over every chunk."""
        n = sum(_size(c) for c in self.chunks)
        self.losses, self.sq, self.dots = (np.full(n, math.nan) for _ in range(3))
        self.errors = [None] * n
        self.acc = Accumulator(self.engine.spec, accumulate="sum", accum_dtype=np.float64)

    def stats(self) -> SampleStats:
        with self.engine.leaving_no_trace(self.backend, "per_sample") as snapshot:
            finite, gbar_sq, rounded = self._passes(snapshot)
            if rounded and len(finite) > 1 and _amplification(
                    self.dots[finite], self.sq[finite], gbar_sq) * self.rounding > TOLERANCE:
                # a sample's cosine to the rest would be mostly rounding (one sample's gradient
                # dominating the others'): every value again from each sample alone, in float64
                self.vectorizing = False
                self.backend.restore(snapshot)
                self._columns()
                finite, gbar_sq, _ = self._passes(snapshot)
        cosines, to_rest = (np.full(len(self.losses), math.nan) for _ in range(2))
        if len(finite) == 1:
            cosines[finite] = 1.0  # its own mean; no others
        elif finite:
            cosines[finite], to_rest[finite] = cosines_from_dots(
                self.dots[finite], self.sq[finite], gbar_sq, np.ones(len(finite)))
        return SampleStats(*(tuple(column.tolist()) for column in (  # float64: Python floats
            self.losses, np.sqrt(self.sq), cosines, to_rest)), tuple(self.errors))

    def _passes(self, snapshot) -> tuple[list, float, bool]:
        """Every pass over every chunk, from ``snapshot``'s state: (the finite samples,
        |mean|^2, whether any chunk computed together: its values rounded in the variables'
        dtype, also where vectorizing stopped after it)."""
        # a batch of one chunk: its call dots with its own sum (else the second pass, with M)
        self.own = self.vectorizing and len(self.chunks) == 1 and len(self.losses) > 1
        parts, start = [], 0
        for chunk in self.chunks:
            parts += self._first(chunk, start)
            start += _size(chunk)
        finite = sorted(i for part in parts for i in part.samples)
        rounded = any(part.feed is not None for part in parts)
        if not finite:
            return finite, math.nan, rounded
        mean = self.acc.mean()
        gbar_sq = math.fsum(squared_norm(v) for v in mean.values())
        if not self._own_holds(parts, gbar_sq, len(finite)):
            parts = [part._replace(dotted=False) for part in parts]
        later = [part for part in parts if not part.dotted]
        if later:
            along = _along(mean) if self.vectorizing else None
            self.backend.restore(snapshot)  # the second pass meets the first one's state
            for part in later:
                self._second(part, mean, along)
        return finite, gbar_sq, rounded

    def _own_holds(self, parts: list, gbar_sq: float, k: int) -> bool:
        """Whether the dots the first pass took with its one chunk's own sum S may stand in
        every cosine: taken for all ``k`` finite samples (a sample computed alone leaves S
        short of it, and K with it), finite, and their rounding (:func:`_amplification`,
        |M|^2 ``gbar_sq``) within :data:`TOLERANCE`. The call dots with S divided by its
        largest entry, per variable, so no product falls below the dtype's normals for want
        of S's scale."""
        dotted = [i for part in parts if part.dotted for i in part.samples]
        if not dotted or k < 2:
            return True  # nothing dotted, or one sample: its cosine is 1 whatever its dot
        dots, sq = self.dots[dotted], self.sq[dotted]
        return len(dotted) == k and bool(np.isfinite(dots).all()) and \
            self.rounding * _amplification(dots, sq, gbar_sq) <= TOLERANCE

    def _stop(self, why: str) -> None:
        """Computes each sample alone from now on, and warns once why."""
        self.vectorizing = False
        warn(UserWarning(f"per_sample computes each sample alone, one call each: {why}"))

    # --- First pass: losses, squared norms, the sum of the finite gradients ------------------

    def _first(self, chunk, start: int) -> list[_Part]:
        """The first pass over ``chunk`` (its first sample the batch's sample ``start``): the
        :class:`_Part` of its finite samples, computed together or alone."""
        n = _size(chunk)
        together, alone = self._prepared(chunk, start, list(range(n)))
        parts = []
        refused = None
        if together is not None:
            feed, places = together
            part, low = self._together(chunk, start, feed, places)
            if part is None:
                alone, refused = sorted(alone + places), places
            else:
                alone = sorted(alone + low)
                if part.samples:
                    parts.append(part)
        if alone:
            parts.append(self._alone(chunk, start, alone, keep=len(self.chunks) == 1))
        if refused and self.vectorizing and all(self.errors[start + p] is None for p in refused):
            # no sample was to blame: the vectorized form itself does not run here (a kernel
            # this machine's framework lacks), and would fail again on every chunk
            self._stop(f"the call of several samples failed where each alone computes "
                       f"({self._refusal})")
        return parts

    def _prepared(self, chunk, start: int, places: list) -> tuple:
        """((the prepared feed of the samples at ``places`` of ``chunk``, their places) or None,
        the places of those that compute alone): a sample the framework refuses (a target
        out of range) computes alone, so that its row says why as it would alone."""
        if not self.vectorizing:
            return None, places
        feed = take(chunk, np.asarray(places))
        try:
            return (prepare_one(self.backend, feed, None, "per_sample", start)[0], places), []
        except HostavgError as e:
            refused = {places[c.sample - start] for c in getattr(e, "culprits", ())}
            if not refused or len(refused) == len(places):
                return None, places
            rest = [p for p in places if p not in refused]
            together, alone = self._prepared(chunk, start, rest)
            return together, sorted(alone + list(refused))

    def _together(self, chunk, start: int, feed, places: list) -> tuple:
        """The samples at ``places`` of ``chunk`` computed in one call (``feed``, prepared):
        (the :class:`_Part` of the finite ones, the places of those to compute alone: a
        squared norm so small that what its squares lost flushing below the dtype's normals
        could show, at most :attr:`floor`); (None, []) where the call failed (then each
        computes alone: a sample's compute error is its row's)."""
        out = self._sums(feed)
        if out is None:
            return None, []
        samples = [start + p for p in places]
        self.losses[samples], self.sq[samples] = out.losses, out.sq_norms
        finite = np.isfinite(out.losses) & np.isfinite(out.sq_norms)
        low = finite & ~(np.asarray(out.sq_norms) * self.rounding >= self.floor)
        low, places = ([p for p, keep in zip(places, mask) if keep]
                       for mask in (low, finite & ~low))
        if places and len(places) < len(samples):  # the sum again, of the rest alone
            feed = prepare_one(self.backend, take(chunk, np.asarray(places)), None,
                               "per_sample", start)[0]
            out = self._sums(feed)
            if out is None:
                return None, []
        if not places:
            return _Part(feed, [], (chunk, []), None), low
        sums = {n: np.asarray(s, np.float64) for n, s in out.sums.items()}
        self.acc.add_checked({n: s / len(places) for n, s in sums.items()},
                             float(len(places)), None, 0.0)
        dotted = out.dots is not None
        if dotted:  # g_i . S / K = g_i . M
            self.dots[[start + p for p in places]] = np.asarray(out.dots, np.float64) / len(places)
        return _Part(feed, [start + p for p in places], (chunk, places), None, dotted), low

    def _sums(self, feed):
        """``backend.sample_sums(feed)`` (dotted with their own sum where the batch is this one
        chunk), or None where it failed (see :meth:`_together`)."""
        try:
            return self.backend.sample_sums(feed, True) if self.own \
                else self.backend.sample_sums(feed)
        except NotVectorized as e:
            self._stop(str(e))
        except HostavgError as e:
            self._refusal = refusal(e)
        return None

    def _alone(self, chunk, start: int, places: list, keep: bool) -> _Part:
        """The samples at ``places`` of ``chunk`` each computed alone: the :class:`_Part` of
        the finite ones (their gradients kept with ``keep``); a failed one's row says why."""
        finite, grads = [], []
        for p in places:
            g = self._one(chunk, start, p)
            if g is None:
                continue
            i = start + p
            # in float64, as the dots: a dominant sample's cosine to the rest is exact
            self.losses[i], self.sq[i] = g.loss, math.fsum(map(_squares64, g.values()))
            if math.isfinite(self.sq[i]) and math.isfinite(g.loss):
                self.acc.add_checked(dict(g), 1.0, None, 0.0)
                finite.append(p)
                grads.append(g if keep else None)
        return _Part(None, [start + p for p in finite], (chunk, finite), grads if keep else None)

    def _one(self, chunk, start: int, p: int):
        """The gradients of sample ``p`` of ``chunk`` computed alone, or None (its error noted)."""
        i = start + p
        row = None if self.rows is None else self.rows[i:i + 1]
        where = f"per_sample, sample {i}" + ("" if row is None else f" (data row {row[0]})")
        try:
            feed, n = prepare_one(self.backend, take(chunk, slice(p, p + 1)), None, where, i,
                                  row)
            return self.engine._compute(self.backend, feed, n, where)[0]
        except HostavgError as e:
            self.errors[i] = str(e)
            return None

    # --- Second pass: g_i . M -----------------------------------------------------------------

    def _second(self, part: _Part, mean, along) -> None:
        """g_i . ``mean`` of each sample of ``part``, into :attr:`dots` (NaN where a sample
        that computed in the first pass fails in this one); ``along``: :func:`_along` of it."""
        if part.feed is not None and self.vectorizing:
            top, direction = along
            try:
                self.dots[part.samples] = top * np.asarray(
                    self.backend.sample_dots(part.feed, direction), np.float64)
                return
            except NotVectorized as e:
                self._stop(str(e))
            except HostavgError:
                pass
        chunk, places = part.given
        for i, p, g in zip(part.samples, places, part.grads or [None] * len(places)):
            g = g if g is not None else self._one(chunk, i - p, p)
            if g is not None:
                self.dots[i] = math.fsum(_dot(g[n], m) for n, m in mean.items())


def _size(chunk) -> int:
    return sample_count(chunk, "per_sample")


def _amplification(dots, sq, gbar_sq: float) -> float:
    """How many times its inputs' relative rounding a cosine to the rest can be off, at most
    over the samples: with K samples, S = K mean and r_i = |S - g_i|^2 = K^2 |mean|^2
    - 2 K g_i . mean + |g_i|^2, the numerator K g_i . mean - |g_i|^2 is off by up to
    (K |g_i . mean| + |g_i|^2) rounding, over |g_i| sqrt(r_i), and the denominator's r_i by
    up to (K^2 |mean|^2 + |g_i|^2) (whose share of r_i a cosine of 1 at most carries); inf
    where an r_i is not above 0. 1.5 on 256 samples of the bench's MLP, 12 on 8 of a small
    one; 3,000 where one of those 8 has inputs 10 times the others'."""
    k = len(dots)
    whole = k * k * gbar_sq
    rest = whole - 2 * k * dots + sq
    with np.errstate(invalid="ignore", divide="ignore"):
        a = (k * np.abs(dots) + sq) / np.sqrt(sq * rest) + (whole + sq) / rest
    a[~(rest > 0)] = math.inf
    a[~(sq > 0)] = 0.0  # a gradient of 0: its cosines are NaN whatever the rounding
    return float(np.max(a))


def _along(mean) -> tuple[float, dict]:
    """(a, name -> mean / a as a dense float64 array), a the mean's largest magnitude (1 where
    that is 0 or not finite): a backend forms g_i . (mean / a) in the variables' dtype, which
    neither overflows nor flushes to 0 where g_i and mean do not, and a times it is g_i . mean."""
    dense = {n: _dense(v) for n, v in mean.items()}
    top = max((float(np.max(np.abs(v), initial=0.0)) for v in dense.values()), default=0.0)
    top = top if math.isfinite(top) and top > 0 else 1.0
    return top, {n: v / top for n, v in dense.items()}


def _squares64(value) -> float:
    """The squared norm of a gradient (dense, or a SparseGradient's rows summed), in float64."""
    need_one_blas_thread()
    flat = np.ravel(value.coalesce().values if isinstance(value, SparseGradient) else value)
    flat = flat.astype(np.float64)
    return float(np.dot(flat, flat))


def _dense(value) -> np.ndarray:
    """A mean's value as a float64 array of its variable's shape."""
    return value.to_dense() if isinstance(value, SparseGradient) else np.asarray(value, np.float64)


def _dot(g, m) -> float:
    """g . m of one variable's gradient and mean, each dense or a SparseGradient (the mean's
    rows sorted and unique, every row of g among them), in float64."""
    need_one_blas_thread()
    if isinstance(g, SparseGradient):
        g = g.coalesce()
        if isinstance(m, SparseGradient):
            m = m.values[np.searchsorted(m.indices, g.indices)]
        else:
            m = np.asarray(m)[g.indices]
        g = g.values
    elif isinstance(m, SparseGradient):
        g, m = np.asarray(g)[m.indices], m.values
    return float(np.dot(np.ravel(g).astype(np.float64), np.ravel(m).astype(np.float64)))
