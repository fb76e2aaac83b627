"""What a step hands back, and what hooks see and return: pure data, no TensorFlow.

A hook is any object with some of ``on_micro_batch(micro)``,
``on_step(mean, result)`` and ``on_applied(result)`` (see :class:`Hook`).
Every array reachable from these objects is read-only (see
:mod:`hostavg.core.gradients`): to change a gradient, return a new mapping from
the hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hostavg.core.gradients import Gradients
from hostavg.core.errors import ArgumentError, short
from hostavg.core import display, schema
from hostavg.core.optional import pandas
from hostavg.core.stats import StepStats

__all__ = ["Culprit", "FIT_METHODS", "HOOK_METHODS", "Drop", "Hook", "MicroBatch", "Outlier",
           "STEP_METHODS", "Search", "StepResult", "check_quantity", "evolved"]


def evolved(record, **changes):
    """``dataclasses.replace(record, **changes)`` for the engine's records (frozen dataclasses
    that hold what they were given and derive nothing in ``__init__``): the same record, with
    the same objects in the fields not changed, made without running ``__init__`` field by
    field (a StepResult's replace cost a step about 10 microseconds, of the roughly 300 that
    hostavg's Python adds to a step of one small micro-batch). TypeError for a name that is not
    a field."""
    fields = record.__dict__
    unknown = changes.keys() - fields.keys()
    if unknown:
        raise TypeError(f"{type(record).__name__} has no field {', '.join(sorted(unknown))}")
    new = object.__new__(type(record))
    new.__dict__.update(fields)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class Drop:
    """Returned by a hook's ``on_micro_batch``: leave this micro-batch out of the step (or by a
    :class:`Search`'s ``then``: compute the step again without it).

    Attributes:
      reason: recorded as the micro-batch's ``dropped``.
    """

    reason: str = "dropped by a hook"


@dataclass(frozen=True)
class Outlier:
    """Why a micro-batch stands out among those of the last steps (``MicroBatch.outlier``).

    Attributes:
      quantity: ``"loss"`` or ``"grad_norm"``, the one that stands out.
      value: the micro-batch's value of it.
      median: the median of that quantity over the micro-batches it was judged against.
      factor: ``value / median``.
      alone: whether its step had no other micro-batch to judge it against: it is then an
        outlier only where its search finds a sample that stands out alone (a step of one
        micro-batch whose every sample rose is the step's, not a micro-batch's).
    """

    quantity: str
    value: float
    median: float
    factor: float
    alone: bool = False

    def __str__(self) -> str:
        said = "loss" if self.quantity == "loss" else "gradient norm"
        return f"{said} {short(self.value)}, {short(self.factor)}x the median {short(self.median)}"


@dataclass(frozen=True)
class Search:
    """Returned by a hook's ``on_micro_batch``: once every micro-batch of the step has run, at
    the step's weights before the apply, look for this micro-batch's culprit samples as
    ``judge`` says (each sample computed alone, what the computes assign restored).

    First ``still(micro)`` is asked, where given: the micro-batch's :class:`Outlier` now
    that the step's other micro-batches are known, or None to search nothing (a step whose
    micro-batches rose together). Where the search finds no culprit of an outlier judged
    ``alone``, that is the end of it. Else the engine keeps what it found as
    ``MicroBatch.culprits`` and the outlier as ``MicroBatch.outlier``, then calls ``then(micro)`` with that
    MicroBatch, still before the apply (on a step whose every micro-batch was dropped
    too). ``then`` may return a :class:`Drop`: the step is computed again from its start
    without that micro-batch (hooks see every micro-batch again; the searches are not run
    again). An exception it raises fails the step with nothing applied.

    Attributes:
      judge: what a culprit is (a judge of :mod:`hostavg.engine.culprits`).
      outlier: why the micro-batch is searched, or None.
      then: called with the searched MicroBatch, or None.
      still: asked with the micro-batch once the step's every micro-batch has run, or None.
    """

    judge: object
    outlier: Outlier | None = None
    then: Callable[[MicroBatch], Drop | None] | None = None
    still: Callable[[MicroBatch], Outlier | None] | None = None


@dataclass(frozen=True)
class Culprit:
    """A sample that makes its micro-batch's loss or gradients non-finite.

    Found after a micro-batch was non-finite (see :mod:`hostavg.engine.culprits`):
    first the samples whose inputs hold NaN or Inf, else each sample computed
    alone.

    Attributes:
      sample: its position among the step's samples (as ``MicroBatch.start``).
      row: its row in the data set, where the step was told the rows
        (``fit`` tells them); else None.
      reason: what is wrong with it, e.g. ``"x holds NaN in column 2"`` or
        ``"finite inputs, non-finite loss"``.
      loss, grad_norm: its loss and gradient norm computed alone, where the search
        computed it (an outlier's culprits); else None.
    """

    sample: int
    row: int | None
    reason: str
    loss: float | None = field(default=None, compare=False)
    grad_norm: float | None = field(default=None, compare=False)

    def __str__(self) -> str:
        where = f"sample {self.sample} of the step" if self.row is None else f"data row {self.row}"
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step; hooks receive it before it is accumulated.

    Attributes:
      index: its position in the step, from 0.
      size: its number of samples (its weight in the mean).
      loss: its mean loss.
      grads: its :class:`Gradients`. Hooks always see them; on a StepResult they are kept
        in ``accumulate="stack"`` and None in "sum", which keeps none per micro-batch.
      start: the index of its first sample among the step's (it covered start:start + size).
      step: the global step the step will have after its apply.
      dropped: why a hook dropped it (see :class:`hostavg.hooks.Drop`), or None.
      rows: the row indices, in the data set, of its samples (a read-only
        int64 array of ``size``), where the caller said them (``fit`` does
        for a dict of arrays and a ``tf.data.Dataset``); else None.
      culprits: for a micro-batch whose own loss or gradients were non-finite, or that drove
        an apply non-finite (``overflows``), and that a hook dropped
        (:class:`~hostavg.hooks.SkipNonFinite`), the :class:`Culprit` samples that make it so,
        sorted (empty when no sample is non-finite alone); None for every other one, and in
        what ``on_micro_batch`` hooks see (the samples are looked at once every micro-batch
        has run). For one a hook asked to search (:class:`Search`), those that stand out.
      outlier: for a micro-batch a hook judged an :class:`Outlier` and searched, why (also
        as the hooks see it again, in a step computed again without it); else None.
      fetched: the values of the tensors the step was asked to fetch
        (``step(..., fetches=[...])``, TF1), computed in this micro-batch's
        own session call, before the step's update, in the order asked (None
        for an operation); read-only. () where nothing was asked.
      skipped: the :class:`Culprit` samples a hook left out of it (``sample``: their place
        in the step as given; :class:`~hostavg.hooks.SkipBadSamples`); ``size``, ``start``
        and ``rows`` are of what remained. () where none was.
    """

    index: int
    size: int
    loss: float
    grads: Gradients | None
    start: int = 0
    step: int = 0
    dropped: str | None = None
    rows: np.ndarray | None = field(default=None, repr=False, compare=False)
    culprits: tuple | None = field(default=None, repr=False, compare=False)
    fetched: tuple = field(default=(), repr=False, compare=False)
    overflows: str | None = field(default=None, repr=False, compare=False)
    outlier: Outlier | None = field(default=None, repr=False, compare=False)
    skipped: tuple = field(default=(), repr=False, compare=False)

    def __repr__(self) -> str:
        return display.summary("MicroBatch", {"index": self.index, "size": self.size,
                                              "loss": self.loss, "start": self.start,
                                              "step": self.step, "dropped": self.dropped})


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
      loss: the sample-weighted mean loss over the accumulated micro-batches,
        sum_i n_i loss_i / sum_i n_i (None if every micro-batch was dropped).
      grads: the :class:`Gradients` that were applied, or given to an
        optimizer that skipped them (None if every micro-batch was dropped).
      micro: one :class:`MicroBatch` per micro-batch, in order, dropped ones too.
      step: the global step after the apply (unchanged if skipped).
      size: samples accumulated, sum_i n_i over micro-batches not dropped.
      stats: the step's :class:`~hostavg.stats.StepStats` (``grad_norm`` NaN
        and no estimates if every micro-batch was dropped).
      skipped: why nothing was applied, or None: every micro-batch was dropped
        (then ``loss`` and ``grads`` are None), or the optimizer skipped a
        non-finite mean (a Keras ``LossScaleOptimizer``: ``loss`` and the mean
        in ``grads`` are the step's, the scale was lowered).
      info: what hooks reported, by key (e.g. norms before clipping).
      update_ratios, weight_norms: name -> |w_after - w_before| / |w_before| (about 1e-3 is
        usual, 0: it did not move) and |w_before| of each trained variable, measured in the
        apply's own call (update_ratios_every); else None.
      learning_rate: the optimizer's learning rate at this apply (a schedule's
        value), or None where the optimizer exposes none, or before the apply.
      fetched: each micro-batch's :attr:`MicroBatch.fetched` (this rank's): ``fetched[i][j]``.
      distributions: ``"gradient"``, ``"weight"``, ``"update"`` -> variable -> nine
        percentiles (:mod:`hostavg.core.distributions`) where kept (distributions_every).
      statistics: name -> each user statistic (``Trainer(statistics=...)``), read-only (empty in on_step).
      weights, updates: name -> each variable after the apply and after minus before
        (read-only), where ``distributions`` were kept, else None; kept by no History.
      proven: whether the host proved this apply finite, so that it ran unchecked, keeping
        nothing to undo with (``check_applied``; docs: performance, "Proven applies").
    """

    loss: float | None
    grads: Gradients | None
    micro: tuple
    step: int
    size: int
    stats: StepStats | None = None
    skipped: str | None = None
    info: dict = field(default_factory=dict)
    update_ratios: dict | None = None
    learning_rate: float | None = None
    fetched: tuple = ()
    distributions: dict | None = None
    statistics: Mapping = field(default_factory=dict)
    weights: Mapping | None = field(default=None, repr=False, compare=False)
    updates: Mapping | None = field(default=None, repr=False, compare=False)
    weight_norms: dict | None = None
    proven: bool = False

    @property
    def dropped(self) -> tuple:
        """Indices of the micro-batches that hooks dropped."""
        return tuple(m.index for m in self.micro if m.dropped is not None)

    def __repr__(self) -> str:
        return display.summary("StepResult", {
            "step": self.step, "loss": self.loss, "size": self.size, "micro_batches": len(self.micro),
            "grad_norm": None if self.stats is None else self.stats.grad_norm,
            "dropped": self.dropped or None, "skipped": self.skipped})

    def _verdicts(self) -> list[str]:
        """What went wrong in the step, a line each: why it was skipped, each dropped
        micro-batch with its reason and culprit samples, the samples left out of each;
        [] for a step that went as asked."""
        lines = [] if self.skipped is None else [f"skipped: {self.skipped}"]
        for m in self.micro:
            if m.dropped is not None:
                lines.append(f"micro-batch {m.index} dropped: {m.dropped}{_few(m.culprits)}")
            if m.skipped:
                lines.append(f"micro-batch {m.index}: {len(m.skipped)} sample"
                             f"{'s' * (len(m.skipped) > 1)} left out{_few(m.skipped)}")
        return lines

    def _repr_html_(self) -> str:
        columns = schema.micro_columns(schema.read(self, schema.MICRO), self.statistics)
        rows = [[m.index, m.start, m.size, *(v[i] for v in columns.values()), m.dropped or ""]
                for i, m in enumerate(self.micro)]
        st = self.stats
        mean = {"loss": self.loss, "norm": None if st is None else st.grad_norm}
        rows.append(["mean", "", self.size, *(mean.get(c) for c in columns), ""])
        caption = (f"Step {self.step}: loss {display.number(self.loss)} over {self.size} samples "
                   f"in {len(self.micro)} micro-batches")
        if st is not None and st.b_simple is not None:
            caption += f"; B_simple {display.number(st.b_simple)}, norm test " \
                       f"{display.number(st.norm_test)}"
        return display.html(caption, ["micro-batch", "start", "size", *columns, "dropped"], rows,
                            self._verdicts())

    def micro_table(self):
        """A pandas DataFrame indexed by micro-batch ``index``: its ``start``, ``size``, each
        per-micro-batch quantity (:data:`hostavg.core.schema.MICRO`: ``loss``,
        ``norm_before_clip`` with :class:`~hostavg.hooks.ClipMicroBatchNorm`, ``norm``,
        ``cosine`` with the mean in "stack" mode) and per-micro-batch statistic the step
        holds, ``dropped``, and where known ``rows`` (its data rows) and ``culprits`` (a
        dropped one's, in words).
        """
        pd = pandas("micro_table")
        columns = schema.micro_columns(schema.read(self, schema.MICRO), self.statistics)
        table = pd.DataFrame({"index": [m.index for m in self.micro],
                              "start": [m.start for m in self.micro],
                              "size": [m.size for m in self.micro], **columns,
                              "dropped": [m.dropped for m in self.micro]}).set_index("index")
        if any(m.rows is not None for m in self.micro):
            table["rows"] = [None if m.rows is None else m.rows.tolist() for m in self.micro]
        if any(m.culprits is not None for m in self.micro):
            table["culprits"] = [None if m.culprits is None else [str(c) for c in m.culprits]
                                 for m in self.micro]
        return table

    def variable_table(self):
        """A pandas DataFrame, one row per trained variable: the applied mean gradient's norm
        (``grad_norm``), the update-to-weight ratio (``update_ratio``), and each micro-batch's
        gradient norm for that variable (columns ``micro 0``, ``micro 1``, ...).

        Example::

            res = trainer.step(sess, feeds)
            res.variable_table().sort_values("update_ratio")
        """
        pd = pandas("variable_table")
        st = self.stats
        names = list(st.variable_norms) if st and st.variable_norms else list(self.grads or ())
        table = pd.DataFrame({"grad_norm": [st.variable_norms.get(n, math.nan) for n in names],
                              "update_ratio": [(self.update_ratios or {}).get(n, math.nan)
                                               for n in names]},
                             index=pd.Index(names, name="variable"))
        for m, norms in zip(self.micro, (st.micro_variable_norms or ()) if st else ()):
            table[f"micro {m.index}"] = [norms.get(n, math.nan) for n in names]
        return table


class Hook(Protocol):
    """The one hook protocol: an object with any of these methods, registered with
    ``Trainer(hooks=[...])`` or ``fit(callbacks=[...])``; each method is called wherever
    the object is registered.

    Per step (by the trainer, inside every step, fit's or yours): ``on_micro_batch(micro)``
    before each micro-batch is accumulated (returns None, replacement gradients, a :class:`Drop`
    or a :class:`Search`; ``drops = False`` on a hook that never drops spares a snapshot before
    each compute; ``reads_model = False`` on one that reads only ``micro`` lets the
    micro-batches compute in one call first), ``on_step(mean, result)`` before the apply (None
    or a replacement mean), ``on_step_batch(batch, result)`` after them, with the step's
    micro-batches at its weights (:class:`~hostavg.engine.products.StepBatch`), returning None
    or a mapping for ``result.info``; ``wants_update_ratios(step)``: True has that apply measure
    ``update_ratios`` and ``weight_norms``; ``frozen(step, names)``: those of the trained
    ``names`` that apply leaves as they were, with their optimizer slots (both get the global
    step after the apply); ``skip_samples(found)`` where samples ``found`` (:class:`Culprit`)
    fail the step: those it returns are left out, the step computed again
    (:class:`~hostavg.hooks.SkipBadSamples`); once the apply succeeded (never for a step that
    failed or was skipped) ``on_applied_batch(batch, result)`` of the hooks whose
    ``on_step_batch`` returned a mapping, then ``on_applied(result)``.

    Per fit (by ``fit``): ``on_resume(step)``, ``on_train_begin()`` (may return the epoch
    training starts at), ``on_epoch_begin(epoch)``, ``on_batch_begin(batch)``,
    ``on_batch_end(batch, logs)``, ``on_epoch_end(epoch, logs)``, ``on_train_end(history)``,
    and ``close()`` however fit ends. ``on_step_end(step, result)`` is deprecated: fit still
    calls it, warning, naming ``on_applied``. See docs/explanation/step.md for what each gets.

    Hooks run in the order given, the trainer's before fit's callbacks; an
    exception raised in a step-level method propagates as it is, with a note
    naming the hook and the micro-batch; raised before the apply, nothing is
    applied; raised in ``on_applied``, the step was applied.
    """

    def on_micro_batch(self, micro: MicroBatch) -> Mapping | Drop | Search | None: ...

    def on_step(self, mean: Gradients, result: StepResult) -> Mapping | None: ...

    def on_step_batch(self, batch, result: StepResult) -> Mapping | None: ...

    def on_applied_batch(self, batch, result: StepResult) -> Mapping | None: ...

    def on_applied(self, result: StepResult) -> None: ...

    def wants_update_ratios(self, step: int) -> bool: ...

    def frozen(self, step: int, names: tuple) -> Collection[str]: ...

    def skip_samples(self, found: tuple) -> tuple: ...

    def on_resume(self, step: int) -> None: ...

    def on_train_begin(self) -> int | None: ...

    def on_epoch_begin(self, epoch: int) -> None: ...

    def on_batch_begin(self, batch: int) -> None: ...

    def on_batch_end(self, batch: int, logs: dict) -> None: ...

    def on_epoch_end(self, epoch: int, logs: dict) -> None: ...

    def on_train_end(self, history) -> None: ...

    def close(self) -> None: ...


#: The hook methods a step calls (the trainer), and those fit calls.
STEP_METHODS = ("on_micro_batch", "on_step", "on_step_batch", "on_applied_batch", "on_applied",
                "wants_update_ratios", "frozen", "skip_samples")
FIT_METHODS = ("on_resume", "on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end",
               "on_epoch_end", "on_train_end", "close", "on_step_end")
#: Any of these makes an object a hook.
HOOK_METHODS = STEP_METHODS + FIT_METHODS


#: What a per-variable view shows: each variable's gradient norm, or |update| / |weights|.
QUANTITIES = ("grad_norm", "update_ratio")


def check_quantity(quantity: str) -> None:
    if quantity not in QUANTITIES:
        raise ArgumentError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")


def _few(found) -> str:
    """``"; data row 9: ...; ... and 2 more"``: the first three of ``found`` (Culprits), or ""."""
    if not found:
        return ""
    return "; " + "; ".join(map(str, found[:3])) + (
        f" and {len(found) - 3} more" if len(found) > 3 else "")
