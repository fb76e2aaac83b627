"""Every per-step quantity, declared once: its name, its kind, and how a step's result gives it.

What shows a step is derived from :data:`QUANTITIES`: the rows of a History
(:class:`~hostavg.StepLog`, its tables, its JSON), the Record on disk and
``load_record``, the TensorBoard hook's tags, and the plots. A new fact about
a step is one :class:`Quantity` here plus the code that computes it.

User statistics (``Trainer(statistics={name: fn})``) go through the same
kinds: :class:`UserStatistics` calls each ``fn(result)`` once per step (after
the mean and the ``on_step`` hooks, before the apply) and keeps its value in
``StepResult.statistics``; every view reads them there. A value's plain form
tells its kind (:func:`kind_of`): a float per step, a tuple of k floats per
micro-batch, a dict variable -> float per variable. Pure Python and NumPy.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from hostavg.core.errors import ArgumentError, StepError
from hostavg.core.gradients import freeze
from hostavg.core.optional import pandas

__all__ = ["HISTORY", "Kind", "MICRO", "QUANTITIES", "Quantity", "UserStatistics", "by_name", "frame",
           "kind_of", "micro_columns", "plain", "read"]


class Kind(enum.Enum):
    """What one step's value of a quantity is."""

    #: A number (or None where not measured that step).
    STEP = "step"
    #: A tuple of numbers, one per micro-batch of the step (dropped ones too), in order.
    MICRO = "micro"
    #: A mapping trained variable -> number.
    VARIABLE = "variable"
    #: A tuple, one mapping variable -> number per micro-batch (dropped ones too).
    MICRO_VARIABLE = "micro_variable"
    #: A sorted tuple of integers (micro-batch indices, data rows).
    INDICES = "indices"
    #: A tuple, one read-only int64 array of data rows per micro-batch (dropped ones too; None
    #: where unknown), or None where the step was not told any.
    ROWS = "rows"
    #: A tuple of mappings, one per event of the step (an outlier's culprit row).
    RECORDS = "records"
    #: "gradient", "weight", "update" -> variable -> nine percentiles
    #: (:mod:`hostavg.core.distributions`), or None on steps that kept none.
    DISTRIBUTION = "distribution"

    @property
    def said(self) -> str:
        """The kind in words: "a number per step", "a number per micro-batch", ..."""
        return {"micro": "a number per micro-batch",
                "micro_variable": "a number per micro-batch and variable",
                "indices": "a list of indices", "rows": "data rows per micro-batch",
                "records": "a list of events",
                "distribution": "percentiles per variable"}.get(self.value,
                                                                f"a number per {self.value}")


@dataclass(frozen=True)
class Quantity:
    """One per-step quantity.

    Attributes:
      name: its name in every view (a History column, a Record key, a plot's label).
      kind: what one step's value is.
      read: the value of a :class:`~hostavg.StepResult`, in its plain form (:func:`plain`).
      doc: what it is, in a sentence (the docs' table of quantities shows it).
      history: kept in History (and so in checkpoints); a Record keeps every quantity.
      tag: its TensorBoard tag (a scalar per step, ``<tag>/<variable>`` per
        variable, a histogram of the micro-batches' values, the length of
        indices); None: not written there.
      column: a per-micro-batch quantity's column in the tables of micro-batches
        (``micro_table``); default its name.
    """

    name: str
    kind: Kind
    read: Callable[[Any], Any]
    doc: str
    history: bool = True
    tag: str | None = None
    column: str | None = None


def _stat(name: str) -> Callable:
    return lambda r: None if r.stats is None else getattr(r.stats, name)


def _info(key: str) -> Callable:
    return lambda r: r.info.get(key)


def _cosines(r) -> tuple | None:
    """Each micro-batch's cosine with the mean, NaN for a dropped one (stack only)."""
    found = None if r.stats is None else r.stats.cosines
    if found is None:
        return None
    kept = iter(found)
    return tuple(math.nan if m.dropped is not None else next(kept) for m in r.micro)


def _nonfinite_rows(r) -> tuple:
    return tuple(sorted(c.row for m in r.micro if m.culprits for c in m.culprits
                        if c.row is not None))


def _micro_rows(r) -> tuple | None:
    """Each micro-batch's data rows, or None where the step was not told them."""
    if all(m.rows is None for m in r.micro):
        return None
    return tuple(m.rows for m in r.micro)


def _outliers(r) -> tuple:
    """One mapping per culprit row of each outlier micro-batch (one with row None where none
    stood out alone): micro_batch, row, its loss and grad_norm alone, factor, quantity."""
    return tuple({"micro_batch": m.index, "row": c.row if c else None,
                  "loss": c.loss if c else None, "grad_norm": c.grad_norm if c else None,
                  "factor": m.outlier.factor, "quantity": m.outlier.quantity}
                 for m in r.micro if m.outlier is not None for c in (m.culprits or (None,)))


def _skipped_rows(r) -> tuple:
    """One mapping per sample left out of a micro-batch (SkipBadSamples): micro_batch, sample
    (its position among the step's samples as given), row, reason."""
    return tuple({"micro_batch": m.index, "sample": c.sample, "row": c.row, "reason": c.reason}
                 for m in r.micro for c in m.skipped)


S, M, V, I = Kind.STEP, Kind.MICRO, Kind.VARIABLE, Kind.INDICES

#: The built-in quantities, in the order tables show them.
QUANTITIES = (
    Quantity("step", S, lambda r: r.step, "the global step after the step's apply"),
    Quantity("loss", S, lambda r: math.nan if r.loss is None else r.loss,
             "the sample-weighted mean loss over the accumulated micro-batches (NaN if every "
             "micro-batch was dropped)", tag="hostavg/loss"),
    Quantity("size", S, lambda r: r.size, "samples accumulated"),
    Quantity("grad_norm", S, lambda r: math.nan if r.stats is None else r.stats.grad_norm,
             "L2 norm of the applied mean gradient (NaN if skipped)", tag="hostavg/grad_norm"),
    Quantity("g2", S, _stat("g2"), "unbiased estimate of |G|^2 (2 micro-batches or more)",
             tag="hostavg/g2"),
    Quantity("trace_sigma", S, _stat("trace_sigma"),
             "unbiased estimate of tr(Sigma), the per-sample gradient covariance's trace",
             tag="hostavg/trace_sigma"),
    Quantity("b_simple", S, _stat("b_simple"),
             "the step's own simple noise scale tr(Sigma) / |G|^2, in samples",
             tag="hostavg/b_simple_one_step"),
    Quantity("norm_test", S, _stat("norm_test"), "the norm test (above 1: the batch is small)",
             tag="hostavg/norm_test"),
    Quantity("inner_product_test", S, _stat("inner_product_test"),
             "the inner-product test (accumulate='stack')", tag="hostavg/inner_product_test"),
    Quantity("orthogonality_test", S, _stat("orthogonality_test"),
             "the orthogonality test (accumulate='stack')", tag="hostavg/orthogonality_test"),
    Quantity("gsnr", S, _stat("gsnr"), "the gradient signal-to-noise ratio (accumulate='stack')",
             tag="hostavg/gsnr"),
    Quantity("learning_rate", S, lambda r: r.learning_rate,
             "the optimizer's learning rate at the apply, or None", tag="hostavg/learning_rate"),
    Quantity("grad_norm_before_clip", S, _info("grad_norm_before_clip"),
             "the mean gradient's norm before ClipGlobalNorm clipped it, or None",
             tag="hostavg/grad_norm_before_clip"),
    *(Quantity(name, S, _info(name), f"{doc} (hooks.Curvature), or None",
               tag=f"hostavg/{name}") for name, doc in (
        ("hessian_trace", "Hutchinson's estimate of the Hessian's trace on the step's batch"),
        ("hessian_top_eigenvalue", "the Hessian's eigenvalue of largest magnitude there"),
        ("sharpness", "top eigenvalue x learning rate / 2: above 1 gradient descent diverges "
                      "along the top direction"),
        ("alpha", "Cockpit's step quality: -1 stays, 0 lands at the minimum along the "
                  "update, +1 overshoots"),
        ("distance", "|w - w0| after the apply, w0 the weights at fit's start"),
        ("update_norm", "|update| of the apply"))),
    Quantity("micro_sizes", M, lambda r: tuple(m.size for m in r.micro),
             "each micro-batch's number of samples"),
    Quantity("micro_rows", Kind.ROWS, _micro_rows,
             "each micro-batch's data rows, where the step was told them (fit is), or None"),
    Quantity("micro_losses", M, lambda r: tuple(m.loss for m in r.micro),
             "each micro-batch's mean loss", tag="hostavg/micro_losses", column="loss"),
    Quantity("micro_norms_before_clip", M, _info("micro_norms_before_clip"),
             "each micro-batch's gradient norm before ClipMicroBatchNorm clipped it, or None",
             tag="hostavg/micro_norms_before_clip", column="norm_before_clip"),
    Quantity("micro_norms", M, lambda r: () if r.stats is None else r.stats.micro_norms,
             "each micro-batch's gradient norm, as accumulated", tag="hostavg/micro_norms",
             column="norm"),
    Quantity("cosines", M, _cosines,
             "each micro-batch's cosine with the mean, NaN for a dropped one "
             "(accumulate='stack'), or None", tag="hostavg/cosines", column="cosine"),
    Quantity("variable_norms", V, lambda r: {} if r.stats is None else r.stats.variable_norms,
             "per trained variable, the applied mean gradient's norm", tag="grad_norm"),
    Quantity("update_ratios", V, lambda r: r.update_ratios,
             "per trained variable, |update| / |weights| of the apply "
             "(update_ratios_every), or None", tag="update_ratio"),
    Quantity("weight_norms", V, lambda r: r.weight_norms,
             "per trained variable, |weights| before the apply, where update_ratios were "
             "measured, or None", tag="weight_norm"),
    Quantity("micro_variable_norms", Kind.MICRO_VARIABLE,
             lambda r: None if r.stats is None else r.stats.micro_variable_norms,
             "per micro-batch and trained variable, its gradient's norm (None over MPI)",
             history=False),
    Quantity("dropped", I, lambda r: r.dropped,
             "the indices of the micro-batches hooks dropped", tag="hostavg/dropped"),
    Quantity("nonfinite_rows", I, _nonfinite_rows,
             "the data rows of the dropped micro-batches' culprit samples",
             tag="hostavg/nonfinite_rows"),
    Quantity("outliers", Kind.RECORDS, _outliers,
             "each outlier micro-batch's culprit rows (WatchOutliers): micro_batch, row, its "
             "loss and grad_norm alone, factor (the micro-batch's over the median), quantity"),
    Quantity("skipped_rows", Kind.RECORDS, _skipped_rows,
             "each sample left out of the step (SkipBadSamples): micro_batch, sample, row, "
             "reason"),
    Quantity("diagnoses", Kind.RECORDS, lambda r: r.info.get("diagnoses", ()),
             "each verdict Diagnose first reached at this step: kind, variables, evidence, "
             "advice"),
    Quantity("distributions", Kind.DISTRIBUTION, lambda r: r.distributions,
             "quantity -> variable -> nine percentiles (distributions_every), or None"),
)

#: The quantities a History keeps, in order.
HISTORY = tuple(q for q in QUANTITIES if q.history)
#: The per-micro-batch quantities, in the order the tables of micro-batches show them (but
#: ``micro_sizes``: those tables show each micro-batch's ``size`` beside its ``start``).
MICRO = tuple(q for q in QUANTITIES if q.kind is Kind.MICRO and q.name != "micro_sizes")

_BY_NAME = {q.name: q for q in QUANTITIES}


def by_name(name: str) -> Quantity | None:
    """The built-in quantity ``name``, or None."""
    return _BY_NAME.get(name)


def read(result, quantities: Sequence[Quantity] = QUANTITIES) -> dict:
    """name -> plain value of each of ``quantities`` (every built-in one) of ``result`` (a
    StepResult)."""
    return {q.name: plain(q.kind, q.read(result)) for q in quantities}


def plain(kind: Kind, value):
    """``value`` in the plain form of ``kind``, the form every view keeps: floats (None kept),
    tuples, dicts."""
    if value is None:
        return None
    if kind is Kind.STEP:
        return _number(value)
    if kind is Kind.MICRO:
        return tuple(_number(v) for v in value)
    if kind is Kind.VARIABLE:
        return {str(n): _number(v) for n, v in value.items()}
    if kind is Kind.MICRO_VARIABLE:
        return tuple(None if m is None else {str(n): _number(v) for n, v in m.items()}
                     for m in value)
    if kind is Kind.INDICES:
        return tuple(int(i) for i in value)
    if kind is Kind.ROWS:  # read-only int64 arrays: 8 bytes a sample, not a Python int's 36
        return tuple(None if rows is None else freeze(np.asarray(rows, np.int64)) for rows in value)
    if kind is Kind.RECORDS:
        return tuple(MappingProxyType(dict(event)) for event in value)
    return value


def _number(value):
    """An int stays an int (a step, a size), anything else is a float; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return float(value)


def micro_columns(values: Mapping, statistics: Mapping = MappingProxyType({})) -> dict:
    """column -> per-micro-batch values, for a table of one step's micro-batches: each
    per-micro-batch quantity the step holds (``values``: :func:`read`'s), then each
    per-micro-batch user statistic (``statistics``) by its name."""
    out = {q.column or q.name: values[q.name] for q in MICRO if values.get(q.name) is not None}
    out.update({n: v for n, v in statistics.items() if kind_of(v) is Kind.MICRO})
    return out


def kind_of(value) -> Kind:
    """The kind of a user statistic's plain value: a float, a tuple (per micro-batch), a dict
    (per variable)."""
    if isinstance(value, Mapping):
        return Kind.VARIABLE
    if isinstance(value, tuple):
        return Kind.MICRO
    return Kind.STEP


class UserStatistics:
    """The statistics a trainer was given, ``{name: fn}``, each ``fn(result)`` once per step.

    ``fn`` receives the step's :class:`~hostavg.StepResult` after the mean and
    the ``on_step`` hooks, before the apply (``update_ratios`` and
    ``learning_rate`` are None then), and returns a real number (per step), a
    sequence of one real number per micro-batch of the step (per micro-batch,
    dropped ones too), or a mapping trained variable's name -> real number
    (per variable; variables left out are NaN). A statistic keeps the kind of
    its first value.
    """

    def __init__(self, statistics):
        if statistics is None:
            statistics = {}
        if not isinstance(statistics, Mapping):
            raise ArgumentError(f"statistics must be a mapping {{name: fn}} (fn(result) -> a "
                                f"number, k numbers or {{variable: number}}), got {statistics!r}")
        for name, fn in statistics.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ArgumentError(f"statistics: a name must be a Python identifier (it becomes "
                                    f"a column, a key and a TensorBoard tag), got {name!r}")
            if name in _BY_NAME:
                raise ArgumentError(f"statistics: {name!r} is the name of a built-in quantity of "
                                    f"a step; give the statistic another name")
            if not callable(fn):
                raise ArgumentError(f"statistics[{name!r}] must be a function of the step's "
                                    f"result, got {fn!r}")
        self.functions = dict(statistics)
        self._kinds: dict[str, Kind] = {}

    def __bool__(self) -> bool:
        return bool(self.functions)

    def compute(self, result, variables: Sequence[str]) -> Mapping:
        """name -> plain value of each statistic of ``result``, read-only; HostavgError naming the
        statistic that raised or returned what is none of the three kinds."""
        out = {}
        for name, fn in self.functions.items():
            try:
                value = fn(result)
            except Exception as e:  # noqa: BLE001 - a user's function: named, then raised
                raise StepError(f"statistic {name!r} raised {type(e).__name__}: {e}; "
                                f"nothing was applied") from e
            out[name] = self._checked(name, value, len(result.micro), variables)
        return MappingProxyType(out)

    def _checked(self, name: str, value, k: int, variables: Sequence[str]):
        kind, plain_value = _user_value(value, k, variables)
        if kind is None:
            raise StepError(
                f"statistic {name!r} returned {_shown(value)}: a statistic returns a real number "
                f"(per step), {k} real numbers (one per micro-batch of this step) or a mapping "
                f"from trained variable names to real numbers; nothing was applied")
        first = self._kinds.setdefault(name, kind)
        if first is not kind:
            raise StepError(f"statistic {name!r} returned {kind.said} ({_shown(value)}) after "
                            f"{first.said} on earlier steps; a statistic keeps one kind; "
                            f"nothing was applied")
        return plain_value


def _user_value(value, k: int, variables: Sequence[str]) -> tuple[Kind | None, Any]:
    """(kind, plain value) of a statistic's return value; (None, None) where it is none."""
    if isinstance(value, Mapping):
        known = set(variables)
        if not all(n in known and _real(v) for n, v in value.items()):
            return None, None
        return Kind.VARIABLE, {n: float(value[n]) if n in value else math.nan for n in variables}
    if _real(value):
        return Kind.STEP, float(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        return None, None
    items = list(np.ravel(value)) if isinstance(value, np.ndarray) else list(value)
    if np.ndim(value) != 1 or len(items) != k or not all(_real(v) for v in items):
        return None, None
    return Kind.MICRO, tuple(float(v) for v in items)


def _real(value) -> bool:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def frame(name: str, kind: Kind, steps: Sequence[tuple], where: str, variables=()):
    """A pandas DataFrame indexed by step of one quantity, from ``(step, value)`` pairs (None
    values left out): one column ``name`` (per step), one per micro-batch index (per
    micro-batch; NaN where a step had fewer) or one per variable (per variable)."""
    pd = pandas(where)
    kept = [(step, value) for step, value in steps if value is not None]
    index = pd.Index([step for step, _ in kept], name="step")
    if kind is Kind.STEP:
        return pd.DataFrame({name: [float(v) for _, v in kept]}, index=index)
    if kind is Kind.MICRO:
        width = max((len(v) for _, v in kept), default=0)
        return pd.DataFrame([list(v) + [math.nan] * (width - len(v)) for _, v in kept],
                            index=index, columns=pd.RangeIndex(width, name="micro_batch"))
    if kind is Kind.VARIABLE:
        names = list(variables) or list(dict.fromkeys(n for _, v in kept for n in v))
        return pd.DataFrame([[v.get(n, math.nan) for n in names] for _, v in kept], index=index,
                            columns=pd.Index(names, name="variable"))
    raise ArgumentError(f"{where}: {name!r} is {kind.said}, which has no table over steps here")
