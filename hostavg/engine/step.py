"""The step engine: one optimizer step over k micro-batches, for any framework. Pure NumPy.

A step (:meth:`Engine.step`) takes the rollback snapshot, checks every
micro-batch's feed, computes each micro-batch (shown to the
``on_micro_batch`` hooks, checked finite, added to the accumulator), has the
averaging turn the sums into the sample-weighted mean (over MPI, one error on
every rank), makes the statistics and the StepResult and runs the
``on_step`` hooks, applies the mean once, and hands the result to the
``on_applied`` hooks. If anything before the apply fails, the snapshot is
restored and the error propagates: the model, the optimizer's state and the
global step are as they were.

The engine knows no framework: what it needs of one is a
:class:`~hostavg.engine.protocols.Backend`, and where the mean is computed an
:class:`~hostavg.engine.protocols.Average`. A trainer runs one step at a time.

See docs/explanation/step.md for the order in detail, non-finite steps,
signals and threads.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from hostavg.core.accumulator import Accumulator
from hostavg.core.blas import in_blas_region
from hostavg.core import distributions
from hostavg.core.curvature import Curvature, CurvatureSettings
from hostavg.core.check import CheckReport, diagnose, fixed_batch_hint, shows_fixed_batch
from hostavg.core.dtypes import accumulation_dtype
from hostavg.core.errors import (ArgumentError, HostavgError, StepError, flag, positive_int,
                                 within_step)
from hostavg.core.gradients import (INPUTS_HINT, Gradients, VariableSpec, check_finite, conform,
                                    freeze, nonfinite_entries, squared_norm)
from hostavg.core.gradients import squared_norms as _sq_norms
from hostavg.core.results import Drop, MicroBatch, Search, StepResult, evolved
from hostavg.core.schema import UserStatistics
from hostavg.core.split import sample_count, split
from hostavg.core.stats import StepStats, step_stats
from hostavg.engine import culprits, frozen, samples
from hostavg.engine.batches import Prepared, prepare, prepare_one, row_indices
from hostavg.engine.hooks import call, methods, name_of, normalize_hooks
from hostavg.engine.overflow import overflowed, undone
from hostavg.engine.overlap import Ahead, Together, worker
from hostavg.engine.proof import Proof
from hostavg.engine.products import Operator, StepBatch, measured
from hostavg.engine.protocols import ApplyRequest, Average, Backend, HostAverage, SampleStats, Tally
from hostavg.engine.signals import hold, region
from hostavg.engine.skipping import Skipping

__all__ = ["Engine", "step_together"]

#: What a non-finite mean of finite micro-batches means, accumulated in a narrower dtype.
OVERFLOW_HINT = ("Every micro-batch's gradients were finite, so their weighted sum overflowed the "
                 "accumulation dtype: accumulate in float64 with accum_dtype='float64'.")
#: The same, accumulated in float64 already: the mean itself is beyond the variables' range.
CAST_HINT = ("Every micro-batch's gradients were finite and were summed in float64, so the "
             "mean itself is beyond the range of the variables' dtype: scale the loss down, or "
             "clip the gradients (hostavg.hooks.ClipGlobalNorm).")

class Engine:
    """Runs steps (and lone computes and applies) of one trainer over a :class:`Backend`.

    Args:
      spec: name -> :class:`VariableSpec` of every trained variable.
      accumulate: one of :data:`~hostavg.core.accumulator.ACCUMULATE_MODES`.
      accum_dtype: the host accumulation dtype, or None (each variable's).
      hooks: see :class:`~hostavg.core.results.Hook`.
      average: an :class:`Average`; default :class:`HostAverage`.
      update_ratios_every: measure the update-to-weight ratios in the applies
        of steps whose global step (after the apply) is a multiple of this, and
        where a hook's ``wants_update_ratios`` asks; None: only there. Measuring
        costs about one more apply.
      distributions_every: keep ``StepResult.distributions`` (the percentiles of
        each variable's applied mean gradient, weights after and update) for
        steps whose global step is a multiple of this; None: never. The apply
        of such a step returns every weight and update to the host.
      overlap: compute micro-batch i + 1 in a worker thread while this one
        shows micro-batch i to the hooks, checks it and adds it (the framework
        releases the GIL while it computes, NumPy while it adds large arrays).
        The same arithmetic in the same order: the same results. Errors still
        name the micro-batch they came from; on one, the computation in flight
        is waited for before anything is restored. Hooks then run while the
        next micro-batch computes (a hook must not expect the model idle).
        Host memory: one more micro-batch's gradients at a time.
      statistics: the trainer's :class:`~hostavg.core.schema.UserStatistics`, computed on
        each step's result after the ``on_step`` hooks (into ``StepResult.statistics``).
    """

    def __init__(self, spec: Mapping[str, VariableSpec], *, accumulate: str = "sum",
                 accum_dtype=None, hooks=(), average: Average | None = None,
                 update_ratios_every: int | None = None, overlap: bool = False,
                 distributions_every: int | None = None, statistics: UserStatistics | None = None):
        hooks = normalize_hooks(hooks)
        self.statistics = statistics or UserStatistics(None)
        self.spec = spec
        self.hooks = hooks
        self.average = average or HostAverage()
        self._look_up_hooks(hooks)
        self.update_ratios_every = 0 if update_ratios_every is None else positive_int(
            "update_ratios_every", update_ratios_every)
        self.distributions_every = 0 if distributions_every is None else positive_int(
            "distributions_every", distributions_every)
        self._keep_micro = accumulate == "stack"
        # The step's own accumulator: its buffers are allocated once and reused.
        self._acc = Accumulator(spec, accumulate=accumulate, accum_dtype=accum_dtype)
        # Sums already in float64 (a wider accumulation, or float64 variables) cannot be
        # widened further: the mean itself is beyond the variables' range.
        widest = all(accumulation_dtype(s.dtype, self._acc.accum_dtype).itemsize >= 8
                     for s in spec.values())
        self._overflow_hint = CAST_HINT if widest else OVERFLOW_HINT
        # The mean of one micro-batch is its gradient exactly: no accumulation dtype rounds it.
        self._exact_one = all(np.can_cast(s.dtype, accumulation_dtype(s.dtype,
                                                                      self._acc.accum_dtype))
                              for s in spec.values())
        self._busy = threading.Lock()
        # target -> its Proof (None: its backend proves nothing), kept as long as the target.
        self._proofs = weakref.WeakKeyDictionary()
        self.overlap = flag("overlap", overlap)
        self._worker = None  # made on the first overlapped step

    def proof_of(self, backend: Backend) -> Proof | None:
        """The :class:`~hostavg.engine.proof.Proof` of ``backend``'s target, made on its first
        apply; None where the backend proves nothing (:class:`Bounded`)."""
        target = backend.target
        if target not in self._proofs:
            bound = getattr(backend, "update_bound", lambda: None)()
            self._proofs[target] = None if bound is None else Proof(bound, self.spec,
                                                                    target=target)
        return self._proofs[target]

    def forget_bounds(self) -> None:
        """Forgets what the host knows of the weights' and slots' magnitudes (the variables were
        set from outside the step: a checkpoint, a broadcast): the next apply is checked on
        the device and measures them again."""
        self._proofs.clear()

    def _look_up_hooks(self, hooks) -> None:
        """Each step-level hook method looked up once: (hook, bound method) per method."""
        self._micro_hooks = methods(hooks, "on_micro_batch")
        # A hook that says it never drops (``drops = False``) needs no snapshot before each compute.
        self._may_drop = any(getattr(hook, "drops", True) for hook, _ in self._micro_hooks)
        # One that says it reads only the record (``reads_model = False``) lets the step's
        # micro-batches compute in one call (:class:`~hostavg.engine.protocols.Many`) before
        # it sees the first: the model's moving state is then the last one's.
        self._reads_model = any(getattr(hook, "reads_model", True)
                                for hook, _ in self._micro_hooks)
        self._step_hooks = methods(hooks, "on_step")
        self._applied_hooks = methods(hooks, "on_applied")
        self._ratio_hooks = methods(hooks, "wants_update_ratios")
        self._freeze_hooks = methods(hooks, "frozen")
        self._batch_hooks = methods(hooks, "on_step_batch")
        self._sample_hooks = methods(hooks, "skip_samples")
        # A hook that sees a step before its apply, or asks what the apply measures.
        self._before_apply = bool(self._micro_hooks or self._step_hooks or self._ratio_hooks
                                  or self._freeze_hooks or self._batch_hooks
                                  or self._sample_hooks)

    @contextlib.contextmanager
    def hooked(self, extra: Sequence):
        """Within the block, steps call ``extra``'s step-level methods too, after the
        trainer's own hooks (fit's callbacks: one hook protocol wherever registered)."""
        if not extra:
            yield
            return
        self._look_up_hooks(self.hooks + tuple(extra))
        try:
            yield
        finally:
            self._look_up_hooks(self.hooks)

    @in_blas_region
    def compute(self, backend: Backend, feed, size: int | None = None) -> Gradients:
        """One micro-batch's :class:`Gradients` (read-only), with ``.loss``, ``.size``, ``.sq_norms``."""
        feed, n = backend.prepare(feed, size, "compute")
        return self._compute(backend, feed, n, "compute")[0]

    @in_blas_region
    def apply(self, backend: Backend, grads: Mapping, feed: Mapping) -> int:
        """Checks ``grads`` (keys, shapes, dtypes, finite), then applies them fed ``feed``
        (:meth:`Backend.apply_feed`); returns the new global step. An apply the backend found
        non-finite (and undid) raises StepError naming the variables it made so."""
        values, sq = self._checked(grads, "apply", "Look at what produced these values.")
        applied, _ = _proven_apply(self, backend, values, sq, feed, ApplyRequest())
        if applied.nonfinite:
            raise StepError(f"{undone('apply', applied.nonfinite, 'apply')} Look at what produced "
                            f"these gradients: scale them down, or clip them.")
        return applied.global_step

    @in_blas_region
    def check(self, backend: Backend, feed, micro_feeds: Sequence,
              size: int | None = None) -> CheckReport:
        """Runs ``feed`` whole (twice) and as ``micro_feeds`` from the same weights, and compares.

        ``size``: the whole feed's number of samples, where its arrays can't
        tell (blocks). Changes nothing: no apply runs, and the rollback
        variables (moving statistics) are restored afterwards. See
        :mod:`hostavg.core.check`.
        """
        with self.leaving_no_trace(backend, "check"):
            whole_feed, n = backend.prepare(feed, size, "check, the whole batch")
            whole, again = (self._compute(backend, whole_feed, n, "check, the whole batch")[0]
                            for _ in range(2))
            acc = Accumulator(self.spec, accum_dtype=np.float64)
            for batch in prepare(backend, micro_feeds, None, "check"):
                where = f"check, {batch.where}"
                g = self._compute(backend, batch.feed, batch.size, where, n)[0]
                acc.add_checked(dict(g), float(batch.size), g.loss, check_finite(
                    g, where, g.loss, g.sq_norms,
                    loss_hint=_loss_hint(g.loss, batch.size, n, backend.advice)))
            mean = acc.mean()
        return diagnose(whole, again, mean, len(micro_feeds), backend.advice,
                        backend.random_ops())

    @contextlib.contextmanager
    def leaving_no_trace(self, backend: Backend, call: str):
        """Within the block no step of this trainer runs, and afterwards what the computes
        assigned (moving statistics) is as before: for calls that only look. Gives the
        snapshot it restores."""
        if not self._busy.acquire(blocking=False):
            raise StepError(f"{call}: a step of this trainer is running; call it between steps")
        try:
            snapshot = backend.snapshot()
            try:
                yield snapshot
            finally:
                backend.restore(snapshot)
        finally:
            self._busy.release()

    @in_blas_region
    def hvp(self, backend: Backend, micro_feeds: Sequence, vectors: Mapping) -> Gradients:
        """H v of the batch cut into ``micro_feeds``, for ``vectors`` (:mod:`~hostavg.engine.products`);
        changes nothing."""
        with self._operator(backend, micro_feeds, "hvp") as product:
            return product.gradients(product(product.vector(vectors)))

    @in_blas_region
    def curvature(self, backend: Backend, micro_feeds: Sequence,
                  settings: CurvatureSettings) -> Curvature:
        """The :class:`~hostavg.core.curvature.Curvature` of the batch cut into ``micro_feeds``,
        measured as ``settings`` say; changes nothing."""
        with self._operator(backend, micro_feeds, "curvature") as product:
            return measured(product, settings)

    @contextlib.contextmanager
    def _operator(self, backend: Backend, micro_feeds: Sequence, call: str):
        """Within the block, the :class:`~hostavg.engine.products.Operator` of the batch cut
        into ``micro_feeds``; afterwards what its products assigned is as before."""
        with self.leaving_no_trace(backend, call) as snapshot:
            yield Operator(backend, prepare(backend, micro_feeds, None, call), self.spec,
                           snapshot, call)

    def _checked(self, grads: Mapping, what: str, hint: str, mine: bool = False,
                 finite: bool = True) -> tuple[dict, dict | None]:
        """``grads`` conformed to the variables' dtypes and (with ``finite``) checked finite,
        ready to apply; and their squared norms by name (None without ``finite``), which the
        host-side proof of the apply reads (:mod:`~hostavg.engine.proof`).

        ``mine``: ``grads`` is a mean this engine's accumulator made (conformed and
        frozen already); only a cast from the accumulation dtype remains to check.
        """
        if mine and all(np.dtype(v.dtype) == self.spec[n].dtype for n, v in grads.items()):
            values = dict(grads)
        else:
            values = conform(self.spec, grads, what=what, cast=True)
        if not finite:  # the optimizer skips a non-finite update itself
            return values, None
        known = getattr(grads, "sq_norms", {})  # trusted for the values conform kept as they were
        sq = {n: known[n] if n in known and values[n] is grads[n] else squared_norm(v)
              for n, v in values.items()}
        check_finite(values, what, known=sq, hint=hint)
        return values, sq

    def _returned(self, grads: Mapping, what: str) -> dict:
        """Gradients a hook returned while a step runs, conformed (:func:`conform`); a StepError
        where they do not fit: they are none of the call's arguments."""
        with within_step():
            return conform(self.spec, grads, what=what)

    @in_blas_region
    def per_sample(self, backend: Backend, data, rows=None,
                   chunk_size: int | None = None) -> SampleStats:
        """Each sample of the batch ``data`` (of data ``rows``, or None) computed alone: its
        loss, gradient norm and cosines with the mean gradient and with the others' mean, or
        the error its compute raised. Changes nothing.

        Computed ``chunk_size`` samples at a time (None: as many as
        :data:`~hostavg.engine.samples.DEFAULT_CHUNK_BYTES` of their gradients hold), per
        chunk one call per pass where the backend is
        :class:`~hostavg.engine.protocols.Vectorized` (a batch of one chunk: one call, unless
        a sample is not finite, computes alone, or its dot could not be trusted), else
        one per sample and pass (:mod:`hostavg.engine.samples`): host memory for the mean
        gradient alone. The
        mean of the samples' gradients is the batch's mean gradient (for a loss that is a
        mean over samples; ``check`` says whether it is); samples whose loss or gradient is
        not finite, or whose compute failed, are left out of it. No apply runs, and the
        rollback variables (moving statistics) are restored afterwards.
        """
        chunk_size = samples.default_chunk_size(self.spec) if chunk_size is None \
            else positive_int("chunk_size", chunk_size)
        chunks = split(data, chunk_size)
        n = sum(sample_count(c, "per_sample") for c in chunks)
        rows = None if rows is None else _distinct(row_indices(rows, n, "per_sample"))
        return samples.per_sample(self, backend, chunks, rows)

    def step(self, backend: Backend, feeds: Sequence, sizes: Sequence[int] | None = None,
             rows: Sequence | None = None) -> StepResult:
        """One optimizer step over the micro-batches ``feeds`` (see the module docstring).

        ``rows``: one array per feed of the data set's row indices of its
        samples (kept as ``MicroBatch.rows`` and named in errors), or None. (Its BLAS region is
        :func:`step_together`'s.)
        """
        return step_together([(self, backend, feeds, sizes, rows)])[0]

    def abandon(self, error: BaseException) -> None:
        """Tells the averaging that the loop around the steps ends with ``error`` (see :meth:`Average.abandon`)."""
        self.average.abandon(error)

    def _step(self, backend, snapshot, feeds, sizes, rows, flagged: Mapping,
              lone: bool = True) -> Pending:
        """Steps 2-5 of a step from ``snapshot``: its :class:`Pending` apply. ``flagged``: index
        -> :class:`~hostavg.engine.overflow.Overflow` of the micro-batches that drove an
        earlier try of this step's apply non-finite. ``lone``: no other trainer's step is
        computed before this one is applied (else no apply runs in a compute's call)."""
        acc, log = self._acc, _StepLog(self._keep_micro, flagged)
        batches = []
        acc.reset()
        micro = log.micro
        try:
            batches, apply_feed, global_step, log = self._tried(backend, snapshot, feeds, sizes,
                                                                 rows, log, lone)
            micro = log.micro
            error, tally = None, _tally(acc, log, global_step, apply_feed)
        except Exception as e:  # noqa: BLE001 - over MPI every rank must hear of it
            error, tally = e, None
        tally = self.average.combine(backend, tally, error)
        if not tally.norms:
            raise ArgumentError(f"step got no micro-batches; pass at least one "
                                f"{backend.advice['batch_name']}")
        global_step = backend.global_step() if tally.global_step is None else tally.global_step
        if not tally.total:
            return Pending(self, backend, snapshot, StepResult(
                None, None, tuple(micro), global_step, 0,
                StepStats(math.nan, tuple(tally.norms), tuple(tally.losses), {}),
                skipped=f"all {len(tally.norms)} micro-batches were dropped; nothing was applied",
                fetched=tuple(m.fetched for m in micro)), None, None, batches)

        mean, known = self._mean(backend, tally, log)
        every = self.average.sees_every_micro_batch
        stats = step_stats(mean, tally.weights, tally.sq_norms, tally.norms, tally.losses,
                           log.kept if every else None, log.var_sq if every else None, known)
        mean = Gradients(mean, loss=None if tally.loss_sum is None else tally.loss_sum / tally.total,
                         size=tally.total,
                         sq_norms={n: v * v for n, v in stats.variable_norms.items()})
        after = global_step + backend.increment
        result = StepResult(mean.loss, mean, tuple(micro), after, tally.size, stats,
                            fetched=tuple(m.fetched for m in micro))
        what, hint, mine = "step, the mean", self._overflow_hint, True
        # The micro-batches were finite: a non-finite mean overflowed the sum. Said so here,
        # before an on_step hook (a clip) turns it into something else and takes the blame;
        # unless the optimizer skips a non-finite step itself (loss scaling). (A mean its
        # compute's call applied is the micro-batch's gradients, checked as those.)
        if backend.nonfinite == "refuse" and log.lone is None:
            check_finite(mean, what, known=mean.sq_norms, hint=hint)
        for hook, on_step in self._step_hooks:
            new = call(hook, on_step, (mean, result), f"on_step of step {after}")
            if new is not None:
                what = f"step, the mean that on_step hook {name_of(hook)} returned"
                hint = "Look at that hook."
                mean = Gradients(self._returned(new, what), loss=mean.loss, size=mean.size)
                result = replace(result, grads=mean, stats=result.stats.applied(mean))
                mine = False
        if self.statistics:
            result = replace(result, statistics=self.statistics.compute(result, tuple(self.spec)))
        checked, sq = (dict(mean), mean.sq_norms) if log.lone is not None else \
            self._checked(mean, what, hint, mine, finite=backend.nonfinite == "refuse")
        return Pending(self, backend, snapshot, result, checked, tally.apply_feed, batches,
                       *self._measured(backend, batches, result, after), sq_norms=sq,
                       fused=log.fused)

    def _mean(self, backend, tally: Tally, log: _StepLog) -> tuple:
        """The step's mean and its squared norm per variable where known (else None): the one
        micro-batch's gradients as they are where its compute's call applied them and they are
        their own mean (``log.lone``; such a step has no hook before its apply and no
        statistics: :meth:`_fusing`), else the accumulator's."""
        if log.lone is not None:
            return log.lone[0], log.var_sq[0]
        reducer = self.average.reducer(backend, tally.total)
        mean = self._acc.mean(reducer)
        # One accumulated micro-batch of the step's whole weight, averaged by NumPy: the mean
        # is its gradient itself (the factor w/w is exactly 1 and skipped), whose squared norms
        # are known already; not where the accumulation dtype is narrower than that gradient's
        # (a hook may return float64 for a float32 variable), which rounds it, or overflows it
        # to Inf. (A reducer in the session computes (w g) / w, which may overflow.)
        if self.average.sees_every_micro_batch and reducer is None and len(tally.weights) == 1:
            sq, dtypes = log.added[0]
            return mean, {n: q for n, q in sq.items()
                          if np.can_cast(dtypes[n], mean[n].dtype, casting="safe")}
        return mean, None

    def _measured(self, backend, batches: list, result: StepResult, step: int) -> tuple:
        """Shows the step's own micro-batches to the ``on_step_batch`` hooks, at the step's
        weights: (the :class:`~hostavg.engine.products.StepBatch`, the hooks that measured on
        it, which their ``on_applied_batch`` follows); what each returned goes into
        ``result.info``."""
        if not self._batch_hooks:
            return None, ()
        batch = StepBatch(backend, [b for b in batches if b.feed is not None], self.spec,
                          lambda b: self._compute(
            backend, b.feed, b.size, f"a measure of step {step}, {b.where}")[0])
        measuring = []
        for hook, on_step_batch in self._batch_hooks:
            found = call(hook, on_step_batch, (batch, result), f"on_step_batch of step {step}")
            if found is not None:
                result.info.update(found)
                measuring.append(hook)
        return batch, tuple(measuring)

    def _tried(self, backend, snapshot, feeds, sizes, rows, log: _StepLog, lone: bool) -> tuple:
        """The step's micro-batches prepared and :meth:`_computed`: (them, what the apply is fed,
        the global step, the log). Where samples it names fail it and ``skip_samples`` hooks
        choose to leave some of them out, it is tried again from ``snapshot`` without them
        (:mod:`~hostavg.engine.skipping`), until no more are left out."""
        skipping = Skipping(feeds, sizes, rows) if self._sample_hooks else None
        while True:
            try:
                batches = prepare(backend, feeds, sizes, rows=rows,
                                  emptied=frozenset() if skipping is None else skipping.emptied)
                held = [b.feed for b in batches if b.feed is not None]
                apply_feed = backend.apply_feed(held, "step") if held else None
                log.fused = self._fusing(backend, snapshot, batches, apply_feed, log) if lone \
                    else None
                global_step, log = self._computed(backend, snapshot, batches, log)
            except HostavgError as e:
                if skipping is None or not skipping.leave_out(e, self._chosen(e)):
                    raise
                backend.restore(snapshot)
                self._acc.reset()
                feeds, sizes, rows, log = skipping.feeds, skipping.sizes, skipping.rows, \
                    _StepLog(self._keep_micro, log.flagged)
                continue
            if skipping is not None:
                log.micro = [replace(m, skipped=skipping.skipped[m.index]) for m in log.micro]
            return batches, apply_feed, global_step, log

    def _fusing(self, backend, snapshot, batches: list[Prepared], apply_feed,
                log: _StepLog) -> _Fused | None:
        """Where the step's one micro-batch is computed and applied in one call
        (:class:`~hostavg.engine.protocols.Fused`), its :class:`_Fused` (what its apply is
        allowed); else None. Only where nothing must see the gradient before the apply (no
        hook that looks before it, no statistics, no measured apply, no earlier try) and
        the mean is that gradient itself; an apply that checks is allowed what its proof
        gives (:meth:`Proof.allowance <hostavg.engine.proof.Proof.allowance>`)."""
        if (len(batches) != 1 or batches[0].feed is None or log.flagged or self._before_apply
                or self.statistics or self.update_ratios_every or self.distributions_every
                or not self._exact_one or not self.average.passes_one_through
                or backend.nonfinite != "refuse" or not getattr(backend, "fuses", False)):
            return None
        allowance = math.inf
        if backend.checks:
            proof = self.proof_of(backend)
            allowance = None if proof is None else proof.allowance(apply_feed)
        return None if allowance is None else _Fused(allowance, snapshot)

    def _chosen(self, error: HostavgError) -> tuple:
        """The culprit samples of ``error`` that the ``skip_samples`` hooks leave out: what any
        of them returns (each a subset of ``error.culprits``); () where none names any."""
        found = tuple(getattr(error, "culprits", None) or ())
        if not found:
            return ()
        chosen = []
        for hook, skip in self._sample_hooks:
            picked = tuple(call(hook, skip, (found,), "skip_samples") or ())
            if any(c not in found for c in picked):
                raise StepError(f"skip_samples hook {name_of(hook)} returned samples that are not "
                                f"among those it was given; return some of them: "
                                f"{picked!r}") from error
            chosen += [c for c in picked if c not in chosen]
        return tuple(chosen)

    def _computed(self, backend, snapshot, batches: list[Prepared], log: _StepLog) -> tuple:
        """:meth:`_micro_batches`, and again from ``snapshot`` without those a search's hook
        dropped, if any: (the global step, the log of the computation kept)."""
        global_step = self._micro_batches(backend, batches, log)
        if log.dropping:
            backend.restore(snapshot)
            self._acc.reset()
            log = log.again()
            global_step = self._micro_batches(backend, batches, log)
        return global_step, log

    def _micro_batches(self, backend, batches: list[Prepared], log: _StepLog) -> int:
        """Computes, shows to the hooks and accumulates each micro-batch, noting them in ``log``;
        returns the global step.

        A micro-batch a hook drops takes what its forward pass assigned with it (moving
        statistics): with ``on_micro_batch`` hooks, each compute is preceded by a snapshot of
        the rollback variables, restored when its micro-batch is dropped (a computation in
        flight, which ran after it, is then computed again).

        Once every micro-batch has run, the culprit samples of each one whose own loss or
        gradients were non-finite are looked for (:mod:`hostavg.engine.culprits`): named in the
        error of the one that failed the step, kept as ``MicroBatch.culprits`` of dropped ones.
        """
        keep = self._may_drop or bool(log.searched)
        whole = sum(batch.size for batch in batches)
        pool, together = self._takers(backend, batches, whole, keep, log)

        def run(i):
            batch = batches[i]
            if batch.feed is None:  # every sample left out: nothing to compute
                return None, None
            with _said_of(backend, batch.size, f"step, {batch.where}", whole):
                out = None if together is None else together.take(i)
            if out is not None:
                return None, self._checked_out(backend, out, batch.size, f"step, {batch.where}")
            try:
                before = backend.snapshot() if keep else None
            except HostavgError as e:
                raise type(e)(f"step, {batch.where}: {e}") from e.__cause__
            return before, self._compute(backend, batch.feed, batch.size, f"step, {batch.where}",
                                         whole, log.fused)

        global_step = None
        try:
            with contextlib.closing(Ahead(pool, run, len(batches))) as ahead:
                for i, batch in enumerate(batches):
                    try:
                        try:
                            before, computed = ahead.take(i)
                        except HostavgError as e:
                            # the framework's, unless a shape fixed in the graph is the cause
                            log.raised = i if e.__cause__ is not None \
                                and not getattr(e, "fixed_batch", False) else None
                            raise
                        if computed is None:
                            global_step = self._left_out(i, batch, backend, log, global_step)
                            continue
                        global_step = self._micro_batch(i, batch, computed, backend, log, whole)
                        if log.micro[-1].dropped is not None and before is not None:
                            ahead.redo(lambda: backend.restore(before))
                    except Exception as e:
                        with contextlib.suppress(AttributeError):  # a type with __slots__
                            e.micro_batch, e.start = i, batch.start
                            if batch.rows is not None:
                                e.rows = batch.rows  # every data row of the micro-batch that failed
                        raise
        except HostavgError as e:
            self._name_culprits(e, backend, batches, log, together)
            raise
        finally:
            if together is not None:
                together.close()
        for i in log.search:
            try:
                found = self._search(backend).find(batches[i])[0]
                log.micro[i] = replace(log.micro[i], culprits=found)
            except Exception as failed:  # noqa: BLE001 - the step goes on; the reason says why
                log.micro[i] = replace(log.micro[i], dropped=(
                    f"{log.micro[i].dropped} (looking for the samples that made it non-finite "
                    f"failed: {type(failed).__name__}: {failed})"))
        if log.searched is None:  # the step's first computation: its searches
            for i, hook, asked in log.asked:
                self._searched(backend, batches[i], log, i, hook, asked)
        return global_step

    def _name_culprits(self, error: HostavgError, backend, batches: list[Prepared],
                       log: _StepLog, together: Together | None) -> None:
        """Names in ``error`` the samples of the micro-batch that failed the step (its own
        non-finite values, or the framework's error), searched from the state its compute left
        (restored where a call computed it with those after it)."""
        if log.failed is not None:
            state = None if together is None else together.state_after(log.failed)
            if state is not None:
                backend.restore(state)
            self._search(backend).name(error, batches[log.failed])
        elif log.raised is not None:
            self._search(backend).name(error, batches[log.raised], culprits.Failing(HostavgError))

    def _takers(self, backend, batches: list[Prepared], whole: int, keep: bool,
                log: _StepLog) -> tuple:
        """How the step's computes are taken: (the worker that computes one ahead, with
        ``overlap``, or None; a :class:`Together` where ``backend`` computes several in one
        call (:class:`~hostavg.engine.protocols.Many`), or None). Several in one call only
        where no micro-batch needs a snapshot of its own (``keep``: a hook may drop it), no
        ``on_micro_batch`` hook may read the model (it would see the state the call's last
        compute left), none is computed ahead, and the step is not one compute-and-apply
        call."""
        pool = None
        if self.overlap and len(batches) > 1:
            if self._worker is None:
                self._worker = worker()
            pool = self._worker
        compute_many = getattr(backend, "compute_many", None)
        if compute_many is None or keep or self._reads_model or pool is not None \
                or log.fused is not None or len(batches) < 2 or not whole:
            return pool, None
        return pool, Together(compute_many, [b.feed for b in batches],
                              [b.size / whole for b in batches])

    def _left_out(self, i: int, batch: Prepared, backend, log: _StepLog,
                  global_step: int | None) -> int:
        """Notes micro-batch ``i``, whose every sample was left out, dropped (no hook sees it);
        returns the global step."""
        if global_step is None:
            global_step = backend.global_step()
        log.norms.append(math.nan)
        log.var_sq.append(dict.fromkeys(self.spec, math.nan))
        log.micro.append(MicroBatch(i, 0, math.nan, None, batch.start,
                                    global_step + backend.increment,
                                    dropped="every sample of it was left out", rows=batch.rows))
        return global_step

    def _searched(self, backend, batch: Prepared, log: _StepLog, i: int, hook,
                  asked: Search) -> None:
        """Runs the :class:`Search` that ``hook`` asked for on micro-batch ``i``, unless its
        ``still`` finds no outlier now: its culprits (none where computing its samples alone
        fails; then nothing, for an outlier judged ``alone``) and outlier kept in its
        MicroBatch, then ``asked.then`` called with that MicroBatch (a :class:`Drop` it
        returns noted in ``log.dropping``)."""
        outlier = asked.outlier
        if asked.still is not None:
            outlier = call(hook, asked.still, (log.micro[i],), f"the search of {batch.where}")
            if outlier is None:
                return
        try:
            found = self._search(backend).find(batch, asked.judge)[0]
        except HostavgError:  # a sample the framework refuses alone: no row to name
            found = ()
        if not found and outlier is not None and outlier.alone:
            return
        log.micro[i] = replace(log.micro[i], culprits=found, outlier=outlier)
        if asked.then is not None:
            out = call(hook, asked.then, (log.micro[i],), f"the search of {batch.where}")
            if isinstance(out, Drop) and log.micro[i].dropped is None:
                log.dropping[i] = out.reason

    def _search(self, backend) -> culprits.CulpritSearch:
        """The culprit search over ``backend``'s micro-batches: each part computed as a step
        computes a micro-batch."""
        def compute(feed, size: int, what: str) -> tuple[float, float]:
            g = self._compute(backend, feed, size, what)[0]
            return g.loss, math.fsum(_sq_norms(g).values())
        return culprits.CulpritSearch(backend, compute)

    def _shown(self, record: MicroBatch, where: str, log: _StepLog) -> tuple:
        """Shows ``record`` to the ``on_micro_batch`` hooks, noting in ``log`` the searches they
        ask for; (its gradients as the hooks left them, why one dropped it or None, the last
        hook that replaced them or None)."""
        grads, changed_by = record.grads, None
        for hook, on_micro_batch in self._micro_hooks:
            out = call(hook, on_micro_batch, (record,), f"on_micro_batch of {where}")
            if isinstance(out, Drop):
                return grads, out.reason, changed_by
            if isinstance(out, Search):
                log.asked.append((record.index, hook, out))
            elif out is not None:
                changed_by = hook
                grads = Gradients(self._returned(out, f"step, {where}, on_micro_batch hook "
                                                      f"{name_of(hook)}'s gradients"),
                                  loss=record.loss, size=record.size)
                record = replace(record, grads=grads)
        return grads, None, changed_by

    def _micro_batch(self, i, batch: Prepared, computed, backend, log: _StepLog, whole: int) -> int:
        """Shows micro-batch ``i`` (``computed``) to the hooks, checks it and accumulates it
        (``whole``: the step's samples); returns the global step."""
        n, start, where, rows = batch.size, batch.start, batch.where, batch.rows
        g, global_step, fetched = computed
        step = global_step + backend.increment
        own = _sq_norms(g)
        if not log.weighed and not math.isfinite(g.loss + math.fsum(own.values())):
            log.weighed = _check_weights(backend)  # a NaN weight, not a sample, is to blame
        grads, dropped, changed_by = g, None, None
        flag = log.flagged.get(i)
        found, outlier, again = (None if flag is None else flag.culprits), None, None
        if log.searched and i in log.searched:  # searched in the step's first computation
            found, outlier, again = log.searched[i]
        if self._micro_hooks:
            grads, dropped, changed_by = self._shown(MicroBatch(
                i, n, g.loss, g, start, step, rows=rows, fetched=fetched,
                overflows=None if flag is None else flag.reason, outlier=outlier), where, log)
        dropped = dropped or again
        sq = own if grads is g else _sq_norms(grads)
        log.var_sq.append(sq)

        def nonfinite() -> bool:
            """Whether its own values, as computed (before any hook), are non-finite in a way
            its samples may explain: not a loss alone on a micro-batch smaller than the batch,
            which points at a batch size fixed in the graph (each sample alone would be too)."""
            grads_ok = math.isfinite(math.fsum(own.values()))
            if grads_ok and _loss_hint(g.loss, n, whole, backend.advice) is not None:
                return False
            return not (grads_ok and math.isfinite(g.loss))

        if dropped is None and flag is not None:
            raise flag.error  # no hook dropped what drove the apply non-finite before
        if dropped is None:
            hint = INPUTS_HINT if changed_by is None else (
                f"They were finite before on_micro_batch hook {name_of(changed_by)} "
                f"replaced them: look at that hook." if math.isfinite(g.global_norm())
                else INPUTS_HINT)
            if backend.nonfinite == "refuse":
                try:
                    sq_norm = check_finite(grads, f"step, {where}", g.loss, sq, hint,
                                           _loss_hint(g.loss, n, whole, backend.advice))
                except HostavgError:
                    if nonfinite():
                        log.failed = i
                    raise
            else:  # the backend's optimizer skips a non-finite step (loss scaling)
                sq_norm = math.fsum(sq.values())
            self._add(grads, n, g.loss, sq, sq_norm, log)
            log.norms.append(math.sqrt(sq_norm) if math.isfinite(sq_norm) else grads.global_norm())
            if log.kept is not None:
                log.kept.append(grads)
        else:
            log.norms.append(math.sqrt(math.fsum(sq.values())))
            if nonfinite():
                log.search.append(i)
        log.micro.append(MicroBatch(i, n, g.loss, grads if self._keep_micro else None, start, step,
                                    dropped=dropped, rows=rows, fetched=fetched,
                                    culprits=found, outlier=outlier))
        return global_step

    def _add(self, grads: Gradients, n: int, loss: float, sq: dict, sq_norm: float,
             log: _StepLog) -> None:
        """Adds a checked micro-batch of ``n`` samples (``sq``: its squared norm per variable,
        ``sq_norm`` their sum) to the accumulator, or keeps it as ``log.lone`` where its
        compute's call applied it and it is its own mean (:meth:`_mean`)."""
        fused = log.fused
        if fused is not None and fused.applied is not None and self._acc.own_mean(grads):
            log.lone = grads, sq_norm
            return
        self._acc.add_checked(grads.as_dict(), float(n), loss, sq_norm)
        log.added.append((sq, {name: value.dtype for name, value in grads.items()}))

    def _fused_compute(self, backend, feed, n: int, where: str, fused: _Fused) -> tuple:
        """:meth:`_compute` of a step's one micro-batch, applied in the same call where the
        backend's gate lets it (``fused.applied``), else applied apart after it (None); where
        the call failed, what it assigned is restored and the micro-batch computed again
        alone, whose error names it. From this call on, a signal waits for the step
        (:func:`~hostavg.engine.signals.hold`)."""
        hold()
        done = backend.compute_apply(feed, fused.allowance)
        if done is None:
            backend.restore(fused.snapshot)
            return self._compute(backend, feed, n, where, n)
        computed, fused.applied = done
        return self._checked_out(backend, computed, n, where)

    def _compute(self, backend, feed, n: int, where: str, whole: int | None = None,
                 fused: _Fused | None = None) -> tuple[Gradients, int, tuple]:
        """Micro-batch ``where``'s gradients, the global step and what else it fetched.
        ``whole``: the samples of the batch it was cut from; an error that shows a shape built
        from them says so. ``fused``: a step's one micro-batch, computed and applied in one
        call (:meth:`_fused_compute`)."""
        if fused is not None:
            return self._fused_compute(backend, feed, n, where, fused)
        with _said_of(backend, n, where, whole):
            out = backend.compute(feed, n / whole if whole else 1.0)
        return self._checked_out(backend, out, n, where)

    def _checked_out(self, backend, out, n: int, where: str) -> tuple[Gradients, int, tuple]:
        """:meth:`_gradients` of ``out``, micro-batch ``where``'s computation, its loss
        refused unless a scalar."""
        if np.ndim(out.loss) != 0:
            raise StepError(f"{where}: the loss has shape {np.shape(out.loss)}, not a scalar; "
                            f"reduce it with {backend.advice['mean_op']}")
        return self._gradients(out, n)

    @staticmethod
    def _gradients(out, n: int) -> tuple[Gradients, int, tuple]:
        """(the :class:`Gradients` of ``out``, a :class:`Computed` of ``n`` samples, its global
        step, what else it fetched)."""
        return Gradients(out.grads, loss=float(out.loss), size=n, sq_norms=out.sq_norms), \
            out.global_step, out.fetched


class _Fused:
    """A step of one micro-batch computed and applied in one call (:meth:`Engine._fusing`).

    Attributes:
      allowance: the gradient bound under which the apply runs in the compute's call.
      snapshot: the step's rollback snapshot, restored where it does not.
      applied: what that apply reported, once it ran; else None.
    """

    __slots__ = ("allowance", "snapshot", "applied")

    def __init__(self, allowance: float, snapshot):
        self.allowance, self.snapshot, self.applied = allowance, snapshot, None


class _StepLog:
    """What a step's micro-batches leave behind, in order.

    Attributes:
      micro: each one's MicroBatch (gradients kept in "stack" mode only).
      norms: each one's gradient norm (dropped ones too).
      var_sq: each one's squared norm per variable (dropped ones too).
      added: of each accumulated one, (squared norm per variable, dtype per
        variable): not its gradients, so that "sum" mode keeps none beyond its add.
      kept: the accumulated ones' gradients in "stack" mode, else None.
      search: the dropped ones whose own loss or gradients were non-finite: their
        culprit samples are looked for once every micro-batch has run.
      asked: (index, hook, :class:`~hostavg.core.results.Search`) of each one a hook asked
        to search, run once every micro-batch has run.
      weighed: whether the weights were found finite (looked at once a micro-batch's own
        values are not).
      failed: the one whose own non-finite values failed the step, or None.
      raised: the one whose compute raised the framework's error, or None.
      flagged: index -> :class:`~hostavg.engine.overflow.Overflow` of those that drove an
        earlier try of the step's apply non-finite.
      searched: index -> (culprits, outlier, why it is dropped or None) of each one the
        hooks' searches found in the step's first computation, where this is the step
        computed again without those a search's ``then`` dropped; else None.
      dropping: index -> why, of each one a search's ``then`` dropped (the step is then
        computed again without them).
      fused: the :class:`_Fused` of a step whose one micro-batch is computed and applied
        in one call, or None.
      lone: (its gradients, their squared norm) where that call applied it and they are
        their own mean (:meth:`~hostavg.core.accumulator.Accumulator.own_mean`): not added
        to the accumulator, they are the step's mean as they are (:meth:`Engine._mean`); else
        None.
    """

    __slots__ = ("micro", "norms", "var_sq", "added", "kept", "search", "asked", "weighed",
                 "failed", "raised", "flagged", "searched", "dropping", "fused", "lone")

    def __init__(self, keep: bool, flagged: Mapping, searched: Mapping | None = None):
        self.micro, self.norms, self.var_sq, self.added, self.search = [], [], [], [], []
        self.asked, self.dropping = [], {}
        self.kept = [] if keep else None
        self.failed = self.raised = None
        self.weighed, self.flagged, self.searched = False, flagged, searched
        self.fused = self.lone = None

    def again(self) -> _StepLog:
        """The log of the step computed again without the micro-batches ``dropping`` names."""
        searched = {m.index: (m.culprits, m.outlier, self.dropping.get(m.index))
                    for m in self.micro if m.outlier is not None}
        return _StepLog(self.kept is not None, self.flagged, searched)


@in_blas_region
def step_together(steps: Sequence[tuple]) -> list[StepResult]:
    """Steps several trainers from the same weights: every step is computed before any is applied.

    ``steps`` holds ``(engine, backend, feeds, sizes)`` or ``(engine, backend,
    feeds, sizes, rows)`` per trainer, such as a GAN's discriminator and
    generator: both gradients are taken from the weights as they are now,
    then the means are applied in order (a simultaneous update). Atomic like
    one step: if any computation, hook or check fails, every snapshot is
    restored and nothing is applied; a signal arriving once the applies have
    begun waits until they are done. Once every apply succeeded, each engine's
    ``on_applied`` hooks get its final result.

    An apply that fails once earlier ones went through (a session failing, an
    apply found non-finite and undone) cannot undo them: its error says which
    stay applied (their rollback variables keep the values their computes
    left, and no ``on_applied`` hook hears of them); the others are restored.

    An apply that went non-finite before any other went through (a lone step,
    or the first trainer's), where the step is averaged on this host, has
    every step tried again from its snapshot, the micro-batches that drove it
    shown to their ``on_micro_batch`` hooks with ``MicroBatch.overflows`` set:
    if one drops them, the steps go on without them (again, for each try that
    goes non-finite); else the error is raised.

    Returns:
      one :class:`~hostavg.StepResult` per entry, in order (``[]`` for no entry: nothing runs).
    """
    if not steps:
        return []
    out = _try(steps, {})
    while isinstance(out, Retry):
        out = _try(steps, out.flagged)
    return out


class Pending(NamedTuple):
    """One engine's step, computed and checked, waiting for its apply.

    Attributes:
      engine, backend: whose step it is.
      snapshot: the backend's rollback snapshot, taken before the step.
      result: the step's result before the apply.
      mean: the checked mean to apply, or None where every micro-batch was dropped.
      feed: what the apply is fed (:meth:`Backend.apply_feed`; None where no micro-batch ran).
      batches: the step's micro-batches (:class:`~hostavg.engine.batches.Prepared`), for
        the culprit search of an apply gone non-finite.
      measure, measuring: the step's :class:`~hostavg.engine.products.StepBatch`, and the
        hooks that measured on it before the apply (``on_step_batch``), which measure on it
        again after (``on_applied_batch``); None and () where none did.
      sq_norms: name -> the squared norm of ``mean``'s value, where it was checked finite.
      fused: the step's :class:`_Fused` where its one micro-batch was computed in a call
        that may apply it too (its ``applied``: the apply went through there); else None.
    """

    engine: Engine
    backend: Backend
    snapshot: Any
    result: StepResult
    mean: dict | None
    feed: dict | None
    batches: list
    measure: StepBatch | None = None
    measuring: tuple = ()
    sq_norms: dict | None = None
    fused: _Fused | None = None


class Retry(NamedTuple):
    """A try's decision that the steps must be tried again from their snapshots (an apply went
    non-finite and was undone before any other went through).

    Attributes:
      flagged: entry of ``steps`` -> (index -> :class:`~hostavg.engine.overflow.Overflow`) of
        each micro-batch that drove a try non-finite, this try's too: shown to the
        ``on_micro_batch`` hooks flagged, and left out where one drops it.
    """

    flagged: Mapping


def _try(steps: Sequence[tuple], flagged: Mapping) -> list[StepResult] | Retry:
    """One try of :func:`step_together`, the micro-batches ``flagged`` by earlier tries: every
    step's result, or the :class:`Retry` of steps whose first apply went non-finite."""
    held, taken, pending, results = [], [], [], []
    try:
        with region():
            try:
                for k, (engine, backend, feeds, sizes, *rows) in enumerate(steps):
                    if not engine._busy.acquire(blocking=False):
                        raise StepError(
                            "another step of this trainer is running (in another thread, a hook "
                            "called step, or it is listed twice); a trainer runs one step at a "
                            "time: use one trainer per thread")
                    held.append(engine)
                    engine.average.begin(backend)
                    snapshot = backend.snapshot()
                    taken.append((backend, snapshot))
                    pending.append(engine._step(backend, snapshot, feeds, sizes,
                                                rows[0] if rows else None, flagged.get(k, {}),
                                                lone=len(steps) == 1))
                hold()  # from here on a signal waits for the steps to be returned whole
                for k, one in enumerate(pending):
                    applied = _applied(one, k, results, len(pending))
                    if not isinstance(applied, StepResult):  # its snapshot is restored
                        _restore(taken, None)
                        return Retry({**flagged, k: {**flagged.get(k, {}),
                                                     **{o.index: o for o in applied}}})
                    results.append(applied)
            except BaseException as error:
                _restore(taken[len(results):], error)  # an apply that went through stays
                for engine in held:
                    engine.average.abandon(error)
                raise
    finally:
        for engine in held:
            engine._busy.release()
    for engine, one, result in zip(held, pending, results):
        if result.skipped is None:
            _measured_after(one, result)
            for hook, on_applied in engine._applied_hooks:
                call(hook, on_applied, (result,), f"on_applied of step {result.step}",
                     applied=result)
    return results


def _measured_after(pending: Pending, result: StepResult) -> None:
    """Shows the step's micro-batches, at the weights after its apply, to the hooks that
    measured on them before it (``on_applied_batch``); what each returns goes into
    ``result.info``."""
    for hook in pending.measuring:
        after = getattr(hook, "on_applied_batch", None)
        if callable(after):
            found = call(hook, after, (pending.measure, result),
                         f"on_applied_batch of step {result.step}", applied=result)
            result.info.update(found or {})


def _restore(taken: list, error: BaseException | None) -> None:
    """Restores each (backend, snapshot) of ``taken``, the last first; a restore that fails
    is a note of ``error`` (the step's own, the one to see), or raises where there is none."""
    for backend, snapshot in reversed(taken):
        try:
            backend.restore(snapshot)
        except Exception as failed:  # noqa: BLE001 - the step's own error is the one to see
            if error is None:
                raise
            error.add_note(f"hostavg: restoring the variables the micro-batches assign "
                           f"failed too ({type(failed).__name__}: {failed}); they may "
                           f"hold this step's values")


def _applied(pending: Pending, k: int, results: list, n: int) -> StepResult | list:
    """:func:`_apply` of entry ``k`` of ``n``, ``results`` those applied before it: the entries
    can be tried again where none was. An error once some were says which stay applied."""
    try:
        return _apply(pending, retry=not results)
    except Exception as error:
        if not results:
            raise
        them = "trainer 1" if k == 1 else f"trainers {', '.join(map(str, range(1, k)))} and {k}"
        said = (f"step_together, trainer {k + 1} of {n}: the appl{'y' if k == 1 else 'ies'} of "
                f"{them} before it went through and stay{'s' if k == 1 else ''} applied (no "
                f"on_applied hook heard of {'it' if k == 1 else 'them'}); this trainer's and "
                f"those after it were not applied")
        if isinstance(error, HostavgError):
            error.args = (f"{said}. {error.args[0]}", *error.args[1:])
        else:
            error.add_note(f"hostavg: {said}")
        raise


def _apply(pending: Pending, retry: bool) -> StepResult | list:
    """Applies one engine's checked mean (restores a skipped step's snapshot); the final result.
    An apply the backend found non-finite (and undid) has the snapshot restored and raises its
    :func:`~hostavg.engine.overflow.overflowed` error, or, where the step can be tried again
    (``retry``: no other apply went through), is averaged on this host and has
    ``on_micro_batch`` hooks that may drop what drove it, returns its
    :class:`~hostavg.engine.overflow.Overflow` list. The variables the ``frozen`` hooks name
    are put back after it (:mod:`~hostavg.engine.frozen`)."""
    engine, backend = pending.engine, pending.backend
    if pending.mean is None:  # skipped: every micro-batch was dropped
        backend.restore(pending.snapshot)
        return pending.result
    every, seen, after = engine.update_ratios_every, engine.distributions_every, pending.result.step
    asked = any(call(hook, wants, (after,), f"wants_update_ratios of step {after}")
                for hook, wants in engine._ratio_hooks)
    kept_distributions = bool(seen) and after % seen == 0
    held = frozen.held(backend, frozen.named(engine._freeze_hooks, after, engine.spec))
    request = ApplyRequest(ratios=asked or (bool(every) and after % every == 0),
                           values=kept_distributions or bool(pending.measuring))
    applied, proven = _proven_apply(engine, backend, pending.mean, pending.sq_norms, pending.feed,
                                    request, pending.fused)
    if held is not None and not applied.nonfinite:  # (an apply gone non-finite undid itself)
        applied = held.put_back(backend, applied)
    if applied.nonfinite:
        backend.restore(pending.snapshot)  # the samples are computed from the state before the step
        error, overflows = overflowed(engine._search(backend), pending.result, applied.nonfinite,
                                      pending.batches)
        if overflows and retry and engine._may_drop and engine.average.sees_every_micro_batch:
            return overflows
        raise error
    kept = applied.weights is not None and applied.skipped is None
    return evolved(pending.result, step=applied.global_step,
                   update_ratios=None if applied.skipped else applied.update_ratios,
                   weight_norms=None if applied.skipped else applied.weight_norms,
                   learning_rate=applied.learning_rate, skipped=applied.skipped,
                   proven=proven,
                   distributions=distributions.of_step(pending.mean, applied.weights,
                                                       applied.updates)
                   if kept and kept_distributions else None,
                   weights=_frozen(applied.weights) if kept else None,
                   updates=_frozen(applied.updates) if kept else None)


def _proven_apply(engine: Engine, backend: Backend, mean: dict, sq_norms: dict | None, feed,
                  request: ApplyRequest, fused: _Fused | None = None) -> tuple:
    """(what ``backend.apply`` of ``mean`` asked for ``request`` did, whether it ran unchecked
    since the host proved it finite): proven applies run unchecked, the others checked and
    measuring the bounds again (:mod:`~hostavg.engine.proof`); the bounds move with every apply
    that went through. (A backend may check a proven apply all the same, as Keras does one
    that measures the update ratios: it then measures.) An apply that ran in its compute's
    call (``fused.applied``) was proven by its allowance: the bounds move by its gradient."""
    proof = engine.proof_of(backend)
    if fused is not None and fused.applied is not None:
        if proof is not None:
            proof.settled(mean, sq_norms, feed)
            proof.applied(None)
        return fused.applied, proof is not None
    proven = proof is not None and proof.proves(mean, sq_norms, feed)
    applied = backend.apply(mean, feed, request._replace(
        proven=proven, magnitudes=proof is not None and not proven))
    if proof is not None and not applied.nonfinite and applied.skipped is None:
        proof.applied(applied.magnitudes)
    return applied, proven and applied.magnitudes is None


@contextlib.contextmanager
def _said_of(backend: Backend, n: int, where: str, whole: int | None):
    """What a compute of micro-batch ``where`` (``n`` of the batch's ``whole`` samples) raises,
    said of it; where the error shows a shape built from the whole batch, that cause first
    (``fixed_batch``: no one sample is to blame)."""
    try:
        yield
    except HostavgError as e:
        said = f"{where}: {e}"
        if whole is not None and shows_fixed_batch(str(e), n, whole):
            # the cause first; what the framework refused after, without its advice
            # (refused's: "check that micro-batch's feed"), which the cause makes wrong
            said = (f"{where}: {fixed_batch_hint(n, whole, backend.advice)} "
                    f"{_capital(getattr(e, 'fact', str(e)))}.")
            error = type(e)(said)
            error.fixed_batch = True  # not traced to rows
            raise error from e.__cause__
        raise type(e)(said) from e.__cause__


def _tally(acc: Accumulator, log: _StepLog, global_step: int, apply_feed) -> Tally:
    """The :class:`Tally` of a step's micro-batches: the accumulator's, or ``log.lone``'s."""
    micro = log.micro
    size = sum(m.size for m in micro if m.dropped is None)
    if log.lone is None:
        return Tally(acc.weights, acc.sq_norms, log.norms, [m.loss for m in micro],
                     acc.total_weight, acc.loss_sum, size, global_step, apply_feed)
    weight, loss = float(size), micro[0].loss  # as the accumulator adds one micro-batch
    return Tally([weight], [log.lone[1]], log.norms, [loss], weight, 0.0 + weight * loss,
                 size, global_step, apply_feed)


def _frozen(values: Mapping) -> Mapping:
    """``values`` (name -> an array the apply read back) read-only, without a copy."""
    return MappingProxyType({name: freeze(value) for name, value in values.items()})


def _distinct(rows: np.ndarray) -> np.ndarray:
    """``rows``, each given once: ArgumentError naming the first row given twice."""
    seen = {}
    for i, row in enumerate(rows.tolist()):
        if row in seen:
            raise ArgumentError(
                f"per_sample: rows must be distinct, since they index the table (table.loc[row]): "
                f"row {row} is given for samples {seen[row]} and {i}; give each sample its own "
                f"data row, or rows=None to index the table by sample")
        seen[row] = i
    return rows


def _check_weights(backend: Backend) -> bool:
    """Raises StepError naming the trained variables of ``backend`` that hold NaN or Inf: every
    micro-batch computed from them is non-finite, and no sample is to blame; else True."""
    bad = []
    for name, value in backend.weights().items():
        nan, inf = nonfinite_entries(value)
        if nan + inf:
            bad.append(f"{name!r} holds {nan + inf} of {np.size(value)} entries non-finite: "
                       f"{nan} NaN, {inf} Inf")
    if bad:
        raise StepError(
            f"step: the weights were not finite before the step ({'; '.join(bad)}), so every "
            f"micro-batch computed from them is non-finite and no sample is to blame; nothing "
            f"was applied. They were made so outside a checked step (an assign, a restore, an "
            f"apply with check_applied=False): set them from a checkpoint of finite weights.")
    return True


def _loss_hint(loss: float, n: int, whole: int, advice: Mapping[str, str]) -> str | None:
    """What a loss that alone is NaN, on a micro-batch of ``n`` of ``whole`` samples, points
    at: a batch size fixed in the graph (an empty slice's mean is NaN, its gradient 0). Not an
    infinite loss: that overflowed (a run diverging, a sample too large), which its samples
    explain."""
    if n == whole or not math.isnan(loss):
        return None
    return _capital(fixed_batch_hint(n, whole, advice))


def _capital(text: str) -> str:
    """``text`` as a sentence: its first letter capital."""
    return text[:1].upper() + text[1:]


