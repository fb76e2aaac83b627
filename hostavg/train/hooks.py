"""Built-in trainer hooks that steer a step: skip non-finite micro-batches or bad samples, clip,
watch outliers, freeze variables.

The hooks that write what happened, :class:`~hostavg.inspect.record.Record`
and :class:`~hostavg.inspect.tensorboard.TensorBoard`, live in
:mod:`hostavg.inspect`; ``hostavg.hooks`` holds them all.

A hook is any object with some of ``on_micro_batch(micro)``,
``on_step(mean, result)`` and ``on_applied(result)``
(:class:`hostavg.core.results.Hook`); pass them as ``hostavg.Trainer(...,
hooks=[...])``. Everything a hook is given is read-only: to change
gradients, return new ones. Pure NumPy: TensorFlow is imported only when a
:class:`TensorBoard` hook writes its first step. They run in the order given;
:class:`Record` and :class:`TensorBoard` write in ``on_applied``, so they
record what was applied wherever they are listed (a :class:`Record` listed
after a hook that replaces micro-batch gradients stores the replacements).
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections import deque
from dataclasses import replace

import numpy as np

from hostavg.core.errors import (ArgumentError, StepError, non_negative_int, positive_int,
                                 positive_number, warn)
from hostavg.core.gradients import SparseGradient, nonfinite_entries
from hostavg.core.results import Drop, Outlier, Search
from hostavg.engine.culprits import LISTED, Contribution

__all__ = ["ClipGlobalNorm", "ClipMicroBatchNorm", "Drop", "FACTOR", "Freeze", "OUTLIER_ACTIONS",
           "OutlierWarning", "SkipBadSamples", "SkipNonFinite", "WARMUP", "WatchOutliers"]


class SkipNonFinite:
    """Drops micro-batches whose loss or gradients hold NaN or Inf, or whose contribution made
    the step's apply non-finite (``MicroBatch.overflows``), instead of raising.

    The step goes on with the others (sample-weighted as usual; a step whose
    apply went non-finite is tried again without the micro-batch that drove
    it); the dropped ones are in ``result.dropped`` with the reason in
    ``micro[i].dropped``. If every micro-batch is dropped the step is skipped:
    nothing is applied, the global step stays, and ``result.skipped`` says so.
    ``fit`` stops with an error naming the rows once every micro-batch of
    5 steps in a row (``hostavg.train.loop.EMPTY_STEPS``) was dropped.
    """

    reads_model = False  # it judges the record alone

    def on_micro_batch(self, record):
        if record.overflows is not None:
            return Drop(f"its contribution made the apply non-finite: {record.overflows}")
        grads = record.grads
        parts = []
        bad = [name for name, v in grads.items()
               if any(nonfinite_entries(v, grads.sq_norms.get(name)))]
        if bad:
            parts.append("gradients in " + ", ".join(map(repr, bad)))
        if not math.isfinite(record.loss):
            parts.append(f"loss {record.loss}")
        return Drop("non-finite " + " and ".join(parts)) if parts else None


class SkipBadSamples:
    """Leaves out of a step each sample that fails it alone, instead of raising or dropping its
    whole micro-batch: a sample whose inputs hold NaN or Inf, whose target the loss refuses (a
    label out of range of a sparse categorical cross-entropy), whose loss or gradients are
    non-finite computed alone, or that the framework refuses to compute alone.

    The step is then computed again from its start without them: its mean is the
    sample-weighted mean over the samples that remain, which equals the full-batch step on
    exactly those samples. The samples left out are in ``MicroBatch.skipped``
    (``result.micro[i].skipped``) and ``History.skipped_rows()`` (step, micro-batch, data
    row, reason); a micro-batch none of whose samples remain is dropped, and a step with
    none at all is skipped as :class:`SkipNonFinite`'s is.

    What it cannot name it leaves to the step: a micro-batch that is non-finite as a whole
    (batch norm over NaN-free samples that overflows), or an apply that went non-finite,
    still raises (with :class:`SkipNonFinite` also given, such a micro-batch is dropped
    whole, and one of a non-finite sample too: list ``SkipBadSamples`` alone). Cost: none
    for a step without a bad sample; for each micro-batch with bad samples, the search that
    names them (their inputs looked at, or each sample computed alone) and one more
    computation of the step up to that micro-batch.
    """

    drops = False  # it leaves samples out through the step's retries, never a micro-batch

    def skip_samples(self, found: tuple) -> tuple:
        """Every one of the culprit samples ``found``: all are left out."""
        return found


def _scaled(grads, factor: float) -> dict:
    return {name: SparseGradient(v.indices, v.values * factor, v.dense_shape)
            if isinstance(v, SparseGradient) else np.asarray(v) * factor
            for name, v in grads.items()}


class ClipMicroBatchNorm:
    """Scales each micro-batch's gradients to global norm at most ``max_norm`` before accumulation.

    This is the per-micro-batch clipping of differentially private training
    (with noise added separately). The norms before clipping are reported in
    ``result.info["micro_norms_before_clip"]``, one per micro-batch in step
    order, NaN for a micro-batch that an earlier hook dropped; tables
    (``micro_table``) and :func:`hostavg.plot.micro_norms` show them beside
    the clipped norms.
    """

    reads_model = False  # it scales the record's gradients alone
    drops = False  # and replaces them, never drops them: no snapshot before each compute

    def __init__(self, max_norm: float):
        self.max_norm = positive_number("max_norm", max_norm)
        self._norms, self._step = {}, None

    def on_micro_batch(self, record):
        if record.step != self._step or record.index in self._norms:  # a new step, or a retry
            self._norms, self._step = {}, record.step
        norm = record.grads.global_norm()
        self._norms[record.index] = norm
        if norm > self.max_norm:
            return _scaled(record.grads, self.max_norm / norm)
        return None

    def on_step(self, mean, result):
        result.info["micro_norms_before_clip"] = tuple(self._norms.get(m.index, math.nan)
                                                       for m in result.micro)


class ClipGlobalNorm:
    """Scales the mean gradient to global norm at most ``max_norm`` before it is applied.

    The norm before clipping is reported in ``result.info["grad_norm_before_clip"]``;
    ``result.stats.grad_norm`` is the norm applied.
    """

    def __init__(self, max_norm: float):
        self.max_norm = positive_number("max_norm", max_norm)

    def on_step(self, mean, result):
        norm = mean.global_norm()
        result.info["grad_norm_before_clip"] = norm
        return _scaled(mean, self.max_norm / norm) if norm > self.max_norm else None


class OutlierWarning(UserWarning):
    """A micro-batch stood out (:class:`WatchOutliers`): its step, loss, norm and rows."""


#: How many times the medians make a micro-batch an outlier, by default: over what healthy runs
#: reach and under what a bad row makes. Measured with the rule itself, the highest over each
#: run: the tests' models over 200 steps of Adam 1.3-1.7x in loss, 2-3x in gradient norm; the
#: tests' digits MLP (micro-batches of 16, 8 a step, Adam at 1e-2) 8x in loss and 4x in norm
#: over 14 epochs, 34x in loss and 17x in norm over 100 (its loss near 0.002, where a
#: micro-batch holding one sample not yet fit is many times its step's others). A row of
#: digits scaled by 1e4 makes 77-2,800x in loss and 3,000-31,000x in norm.
FACTOR = 50.0
#: What :class:`WatchOutliers` does with an outlier micro-batch.
OUTLIER_ACTIONS = ("warn", "skip", "raise")
#: Steps whose micro-batches :class:`WatchOutliers` holds before it judges any: fewer make the
#: median one unlucky draw; more leave the first steps unwatched, where a bad row's spike may be
#: its only one (on digits, Keras's MLP spikes at row 500 at step 4 and learns it away).
WARMUP = 3


class WatchOutliers:
    """Names the micro-batches whose loss or gradient norm stands out, and their culprit rows;
    in every trainer's hooks by default (``watch_outliers=False`` turns it off).

    A micro-batch is an outlier where its loss or gradient norm is over ``factor`` times the
    median of that quantity over the micro-batches of the last ``window`` steps (judged once
    :data:`WARMUP` steps are held) AND over ``factor`` times the median of its own step's
    other micro-batches: a step whose micro-batches rose together (a learning rate too high)
    is the step's, not a micro-batch's. A step of one micro-batch has no others: it is an
    outlier only where a sample of it stands out alone.

    An outlier's samples are computed alone at the step's weights, before its apply (a
    :class:`~hostavg.core.results.Search` with
    :class:`~hostavg.engine.culprits.Contribution`); those whose loss or gradient norm is
    over ``factor`` times the median of its samples' are its culprits, the largest first
    (``MicroBatch.culprits``, ``History.outliers()``). A healthy step costs a few medians
    and no framework call. ``action``: ``"warn"`` (an :class:`OutlierWarning` per outlier
    micro-batch), ``"skip"`` (warn, and compute the step again without it) or ``"raise"``
    (a StepError before the apply: nothing changes).
    """

    #: Its own arithmetic calls NumPy's BLAS only through hostavg's, which holds it at one
    #: thread (:mod:`hostavg.core.blas`): calling it takes no hold of its own.
    _hostavg_no_blas = True

    drops = False  # it drops through its searches (the step computed again), never at once
    reads_model = False  # it judges the record alone

    def __init__(self, factor: float = FACTOR, window: int = 20, action: str = "warn"):
        self.factor = positive_number("factor", factor)
        if self.factor <= 1:
            raise ArgumentError(f"factor must be > 1 (times the median: at 1, half of all "
                                f"micro-batches would be outliers), got {factor!r}")
        self.window = positive_int("window", window)
        if action not in OUTLIER_ACTIONS:
            raise ArgumentError(f"action must be one of {OUTLIER_ACTIONS}, got {action!r}")
        self.action = action
        self._past = deque(maxlen=self.window)  # per step: (its losses, its norms)
        self._step, self._now, self._medians = None, {}, None

    def on_micro_batch(self, micro):
        if micro.step != self._step or micro.index == 0:  # a new step, or a try again
            self._next(micro.step)
        loss, norm = micro.loss, micro.grads.global_norm()
        if not (math.isfinite(loss) and math.isfinite(norm)) or micro.overflows is not None:
            return None  # SkipNonFinite's to judge
        if micro.outlier is not None:
            return None  # judged in the step's first computation, which this one repeats
        self._now[micro.index] = (loss, norm)
        if self._medians is None:
            return None
        outlier = self._judged((loss, norm), self._medians)
        if outlier is None:
            return None
        return Search(Contribution(self.factor), outlier, self._found, self._still)

    def _next(self, step: int) -> None:
        """Starts the micro-batches of global step ``step``: the last step's join the window
        (unless ``step`` is tried again), and the medians are taken once."""
        if step != self._step and self._now:
            self._past.append(tuple(zip(*self._now.values())))
        self._step, self._now = step, {}
        if len(self._past) >= min(WARMUP, self.window):
            self._medians = tuple(statistics.median([v for s in self._past for v in s[k]])
                                  for k in (0, 1))  # on a few hundred floats, NumPy's is slower

    def _judged(self, values: tuple, medians: tuple) -> Outlier | None:
        """The :class:`Outlier` that (loss, norm) ``values`` make of a micro-batch against
        ``medians``, or None."""
        for quantity, value, median in zip(("loss", "grad_norm"), values, medians):
            if median > 0 and value > self.factor * median:
                return Outlier(quantity, value, median, value / median)
        return None

    def _still(self, micro) -> Outlier | None:
        """The outlier ``micro`` is once its step's every micro-batch ran: over ``factor`` times
        the median of its step's others too (None where it is not); left out of the window."""
        values = self._now.pop(micro.index)
        others = list(zip(*self._now.values()))
        if others and self._judged(values, tuple(map(statistics.median, others))) is None:
            self._now[micro.index] = values
            return None
        outlier = self._judged(values, self._medians)
        return outlier if others else replace(outlier, alone=True)

    def _found(self, micro) -> Drop | None:
        """Warns, or raises, naming the searched outlier ``micro`` and its culprit rows; drops
        it where ``action`` is "skip"."""
        against = "the only one of its step" if micro.outlier.alone else "its step's others"
        said = (f"step {micro.step}, micro-batch {micro.index} ({micro.size} samples) is an "
                f"outlier: {micro.outlier}, over the micro-batches of the last "
                f"{len(self._past)} steps and {against} (WatchOutliers(factor={self.factor:g}))")
        found = micro.culprits or ()
        lines = "".join(f"\n  {c}" for c in found[:LISTED]) if found else \
            "\n  no sample of it stands out alone: it is large as a whole"
        if self.action == "raise":
            raise StepError(f"{said}; nothing was applied. The samples that stand out:{lines}\n"
                            f"Look at those rows, or pass WatchOutliers(action='skip') to drop "
                            f"such micro-batches.")
        done = "dropped" if self.action == "skip" else "kept"
        warn(OutlierWarning(f"{said}; {done}. The samples that stand out:{lines}"))
        return Drop(f"an outlier: {micro.outlier}") if self.action == "skip" else None


class Freeze:
    """Leaves trained variables AND their optimizer slots exactly as they were, at every step or
    at chosen steps, on every optimizer.

    At a frozen step the variables ``variables`` names and every optimizer variable of theirs
    (Adam's m and v, a momentum, RMSprop's and Adagrad's accumulators, ...) are bit for bit as
    before the step; every other variable trains as without the hook. The optimizer's counters
    (iterations, TF1 Adam's beta powers, the global step) advance as usual, so Adam's bias
    correction counts the frozen steps too (unlike PyTorch's per-parameter step). The frozen
    variables' gradients are still computed and reported, and count where the optimizer looks
    at every gradient at once (Keras's ``global_clipnorm``); the step's ``update_ratios`` and
    ``updates`` are 0 for them. Zeroing a gradient does not freeze: momentum and Adam's
    moments keep moving the variable. Costs, at a frozen step only, a read and an assign of
    the frozen variables and their slots.

    Args:
      variables: names of trained variables (keys of ``trainer.spec``) or ``fnmatch``
        patterns ("hidden/*"); a string is one. A pattern that matches no trained variable is
        an ArgumentError at the first step.
      steps: None (every step), or the global steps to freeze, as ``StepResult.step`` reports
        them: the global step after the apply (what ``wants_update_ratios`` is given), so
        ``steps={1}`` freezes a new trainer's first step.

    Example::

        trainer = hostavg.Trainer(loss, opt, hooks=[hostavg.hooks.Freeze("out/*", steps={1, 2})])
    """

    def __init__(self, variables, steps=None):
        patterns = (variables,) if isinstance(variables, str) else tuple(variables)
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise ArgumentError(f"variables must be a name or pattern, or a non-empty list of "
                                f"them (strings), got {variables!r}")
        self.variables = patterns
        self.steps = None if steps is None else frozenset(
            non_negative_int("each of steps", s) for s in _collection("steps", steps))
        self._matched = {}  # the trained names -> those the patterns match

    def frozen(self, step: int, names: tuple) -> tuple:
        """The trained ``names`` frozen at global step ``step`` (after the apply)."""
        if self.steps is not None and step not in self.steps:
            return ()
        if names not in self._matched:
            for pattern in self.variables:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                    raise ArgumentError(f"Freeze: {pattern!r} matches no trained variable; the "
                                        f"trained variables: {list(names)}")
            self._matched[names] = tuple(n for n in names
                                         if any(fnmatch.fnmatchcase(n, p) for p in self.variables))
        return self._matched[names]


def _collection(name: str, value) -> tuple:
    """``value``, a collection of steps (a set, list, range; not a string or a lone number), as a
    tuple; ArgumentError naming ``name`` for anything else."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ArgumentError(f"{name} must be None or a collection of global steps (such as "
                            f"{{1, 2}} or range(10)), got {value!r}")
    return tuple(value)
