"""History: what fit did, step by step and epoch by epoch.

A step's row (:class:`StepLog`) holds fit's bookkeeping and every quantity of
:data:`hostavg.core.schema.HISTORY` by name, derived from that declaration:
its fields, :meth:`History.to_pandas`'s columns, :meth:`History.statistic` and
the JSON a checkpoint holds (named fields, ``"format": 2``; the positional rows
of version 0.1.0, format 1, still read).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from hostavg.core import display, distributions, schema
from hostavg.core.errors import ArgumentError
from hostavg.core.optional import pandas
from hostavg.core.results import check_quantity
from hostavg.core.schema import Kind

__all__ = ["BOOKKEEPING", "FORMAT", "History", "StepLog"]

#: The format of the JSON :meth:`History.to_json` writes: steps as objects of named fields.
FORMAT = 2
#: A StepLog's fields in format 1 (version 0.1.0's checkpoints), each step a list in this order.
FORMAT_1 = ("epoch", "step", "loss", "size", "samples", "grad_norm", "g2", "trace_sigma",
            "b_simple", "norm_test", "learning_rate", "micro_norms", "micro_norms_before_clip",
            "variable_norms", "update_ratios", "dropped", "nonfinite_rows", "micro_losses",
            "distributions")
#: What a field of each kind holds where a step has no value: tuples stay tuples.
_EMPTY = {Kind.MICRO: (), Kind.VARIABLE: (), Kind.INDICES: (), Kind.RECORDS: ()}
#: The kinds whose values a StepLog (and its JSON) keeps as tuples: per variable, in
#: :attr:`History.variables`' order.
_TUPLES = (Kind.MICRO, Kind.VARIABLE, Kind.INDICES)

_Row = NamedTuple("_Row", [("epoch", int), ("samples", int),
                           *((q.name, object) for q in schema.HISTORY), ("statistics", dict)])
_Row.__new__.__defaults__ = (*(_EMPTY.get(q.kind) for q in schema.HISTORY), MappingProxyType({}))


class StepLog(_Row):
    """One optimizer step of fit: ``epoch`` (from 0), ``samples`` (seen by fit so far, this
    step's included), each quantity of :data:`hostavg.core.schema.HISTORY` by name (the docs'
    table of quantities), and ``statistics`` (name -> the value of each user statistic).

    Per-variable values (``variable_norms``, ``update_ratios``, a per-variable
    statistic) are tuples in :attr:`History.variables`' order, NaN where not
    measured. Example: ``log.loss``, ``log.micro_norms``, ``log.statistics["trace"]``.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return display.summary("StepLog", {"epoch": self.epoch, "step": self.step,
                                           "loss": self.loss, "size": self.size,
                                           "samples": self.samples, "grad_norm": self.grad_norm,
                                           "dropped": self.dropped or None})


#: The keys of an epoch's logs that are fit's bookkeeping, not measurements (left out of
#: :attr:`History.history` and of what Keras callbacks see).
BOOKKEEPING = ("epoch", "samples", "steps")

_KINDS = {q.name: q.kind for q in schema.HISTORY}


class History:
    """The record fit returns, and keeps in its checkpoints.

    Memory: per step, a few numbers plus three per micro-batch and two per
    trained variable (and 27 per variable on steps that keep distributions),
    and one integer per sample where fit knows the data rows (``micro_rows``).

    Attributes:
      steps: one :class:`StepLog` per optimizer step.
      epochs: one dict per finished epoch: "epoch", "loss" (sample-weighted
        mean over its steps that had samples, those an optimizer skipped too,
        as Keras counts them), "samples", "steps", the training metrics
        (a Keras model's compiled metrics), and "val_loss" plus
        "val_<metric>" where validation data was given. :attr:`history` and
        :attr:`epoch` show them as Keras's History does.
      variables: the trained variables' names, the order of each StepLog's
        per-variable values.
      statistics: name -> :class:`~hostavg.core.schema.Kind` of each user statistic seen.
      stopped: why a callback stopped training (a StopTraining message), or None.
    """

    def __init__(self):
        self.steps: list[StepLog] = []
        self.epochs: list[dict] = []
        self.variables: tuple = ()
        self.statistics: dict[str, Kind] = {}
        self.stopped: str | None = None

    @property
    def samples(self) -> int:
        """Samples seen so far."""
        return self.steps[-1].samples if self.steps else 0

    @property
    def history(self) -> dict:
        """Keras's view: name -> one value per finished epoch, in order, for every quantity the
        epochs logged ("loss", training metrics, "val_*", and what callbacks added, such as
        "learning_rate"), without fit's bookkeeping ("epoch", "samples", "steps": see
        :attr:`epochs`). An epoch that lacks a name has None there.

        Example::

            history.history["val_loss"]  # [0.91, 0.64, 0.52]
        """
        names = dict.fromkeys(k for e in self.epochs for k in e if k not in BOOKKEEPING)
        return {name: [e.get(name) for e in self.epochs] for name in names}

    @property
    def epoch(self) -> list:
        """Keras's view: the index (from 0) of each finished epoch, in order."""
        return [e["epoch"] for e in self.epochs]

    def add(self, epoch: int, result) -> StepLog:
        """Appends a StepLog of the :class:`~hostavg.StepResult` ``result``; returns it."""
        if not self.variables and result.stats is not None:
            self.variables = tuple(result.stats.variable_norms)
        values = {q.name: self._kept(q.kind, schema.plain(q.kind, q.read(result)))
                  for q in schema.HISTORY}
        statistics = {}
        for name, value in result.statistics.items():
            kind = self.statistics.setdefault(name, schema.kind_of(value))
            statistics[name] = self._kept(kind, value)
        log = StepLog(epoch, self.samples + result.size, **values,
                      statistics=MappingProxyType(statistics))
        self.steps.append(log)
        return log

    def _kept(self, kind: Kind, value):
        """A plain value as a StepLog keeps it: per variable a tuple in :attr:`variables`' order."""
        if kind is Kind.VARIABLE:
            return tuple((value or {}).get(n, math.nan) for n in self.variables)
        return value

    def _kind(self, name: str, where: str) -> Kind:
        """The kind of the quantity or user statistic ``name``; HostavgError naming the known ones."""
        kind = self.statistics.get(name) or _KINDS.get(name)
        if kind is None:
            raise ArgumentError(f"{where}: no quantity or statistic {name!r}; the quantities are "
                                f"{list(_KINDS)}, the statistics {list(self.statistics)}")
        return kind

    def statistic(self, name: str):
        """One quantity or user statistic over the steps: a pandas DataFrame indexed by global step.

        One column ``name`` for a per-step value, one per micro-batch index
        for a per-micro-batch one (NaN where a step had fewer), one per trained
        variable for a per-variable one; steps without a value are left out.

        Example::

            history.statistic("micro_norms").max(axis=1)   # each step's largest micro-batch norm
        """
        kind = self._kind(name, "History.statistic")
        user = name in self.statistics
        pairs = []
        for s in self.steps:
            value = s.statistics.get(name) if user else getattr(s, name)
            if kind is Kind.VARIABLE and value is not None:
                value = dict(zip(self.variables, value))
            pairs.append((s.step, value))
        return schema.frame(name, kind, pairs, "History.statistic", self.variables)

    def nonfinite_rows(self) -> np.ndarray:
        """The data rows that made micro-batches non-finite, sorted, each once: the culprit
        samples (``MicroBatch.culprits``) of every micro-batch a hook dropped
        (:class:`~hostavg.hooks.SkipNonFinite`) in fit so far.

        After one epoch, every row of the data whose sample alone is non-finite
        (its inputs hold NaN or Inf, or its loss or gradients are NaN or Inf
        when it is computed alone) that fit met: a dropped micro-batch holds
        only its culprits here, not its other rows. A micro-batch that is
        non-finite only as a whole (batch norm over an odd micro-batch, a sum
        that overflows) names no row; it is still in ``dropped``. Over MPI,
        each rank's History holds its own micro-batches' rows.

        Example::

            history = trainer.fit(..., callbacks=[hostavg.hooks.SkipNonFinite()])
            bad = history.nonfinite_rows()      # say, array([ 313,  737, 1234])
            clean = np.delete(x, bad, axis=0)
        """
        rows = [r for s in self.steps for r in s.nonfinite_rows]
        return np.unique(np.asarray(rows, np.int64))

    def micro_table(self):
        """One row per micro-batch of every step, indexed by (``step``, ``micro_batch``, its
        index in the step, from 0): ``size``, ``rows`` (its data rows, a list, or None where
        unknown: not told, or read back from JSON, which holds no rows), ``loss``, ``grad_norm`` (as accumulated; NaN for a dropped one over MPI) and
        ``dropped`` (whether a hook dropped it).

        Example::

            table = history.micro_table()
            table.loc[37]                           # step 37's micro-batches
            table.sort_values("loss").tail(3).rows  # the rows of the three largest losses
        """
        pd = pandas("History.micro_table")
        rows = [(s.step, i, _at(s.micro_sizes, i), _rows(s.micro_rows, i), _at(s.micro_losses, i),
                 _at(s.micro_norms, i), i in s.dropped)
                for s in self.steps for i in range(len(s.micro_losses))]
        return pd.DataFrame(rows, columns=["step", "micro_batch", "size", "rows", "loss",
                                           "grad_norm", "dropped"]).set_index(
            ["step", "micro_batch"])

    def outliers(self):
        """The outlier micro-batches' culprit rows (:class:`~hostavg.hooks.WatchOutliers`), a
        pandas DataFrame of one row each, in step order, the largest first within a
        micro-batch: ``step``, ``micro_batch``, ``row`` (its data row; None where no sample
        stood out alone, or the rows are unknown), ``loss`` and ``grad_norm`` (the row's,
        computed alone at that step's weights), ``factor`` (the micro-batch's ``quantity``
        over the median of the last steps' micro-batches) and ``quantity`` (``"loss"`` or
        ``"grad_norm"``).
        """
        return self._records("outliers", ["step", "micro_batch", "row", "loss", "grad_norm",
                                          "factor", "quantity"])

    def skipped_rows(self):
        """The samples :class:`~hostavg.hooks.SkipBadSamples` left out, a pandas DataFrame of
        one row each, in step order: ``step``, ``micro_batch``, ``sample`` (its position among
        its step's samples), ``row`` (its data row; None where the rows are unknown) and
        ``reason`` (what is wrong with it, e.g. ``"x holds NaN in column 2"``).
        """
        return self._records("skipped_rows", ["step", "micro_batch", "sample", "row", "reason"])

    def diagnoses(self):
        """The verdicts :class:`~hostavg.hooks.Diagnose` reached, a pandas DataFrame of one row
        each, in step order: ``step`` (first reached), ``kind`` (one of
        :data:`~hostavg.train.diagnose.DIAGNOSES`), ``variables`` (a tuple, from the input side;
        empty for ``"exploding"``), ``evidence`` (the numbers) and ``advice``.
        """
        return self._records("diagnoses", ["step", "kind", "variables", "evidence", "advice"])

    def _records(self, name: str, columns: list):
        """A pandas DataFrame of the records of quantity ``name`` of every step (a
        :attr:`~hostavg.core.schema.Kind.RECORDS` one), ``step`` first, then ``columns``."""
        pd = pandas(f"History.{name}")
        return pd.DataFrame([{"step": s.step, **event} for s in self.steps
                             for event in getattr(s, name)], columns=columns)

    def to_pandas(self, which: str = "steps"):
        """A pandas DataFrame of the ``"steps"`` or the ``"epochs"``.

        Steps: one row per step, a column per per-step and per-micro-batch
        quantity of :data:`hostavg.core.schema.HISTORY` (``loss``,
        ``grad_norm``, ..., ``micro_norms``, ``micro_losses``; ``dropped`` the
        micro-batches hooks dropped, ``nonfinite_rows`` their culprit rows) and
        per-step user statistic, after ``epoch`` and ``samples``. Per variable:
        :meth:`variable_norms`, :meth:`statistic`.
        """
        if which not in ("steps", "epochs"):
            raise ArgumentError(f"which must be 'steps' or 'epochs', got {which!r}")
        pd = pandas("History.to_pandas")
        if which == "epochs":
            return pd.DataFrame(self.epochs)
        names = ["epoch", "step", "loss", "size", "samples"] + [
            q.name for q in schema.HISTORY if q.name not in ("step", "loss", "size")
            and q.kind in (Kind.STEP, Kind.MICRO, Kind.INDICES)]
        user = [n for n, kind in self.statistics.items() if kind is Kind.STEP]
        return pd.DataFrame([[getattr(s, c) for c in names] + [s.statistics.get(n) for n in user]
                             for s in self.steps], columns=names + user)

    def variable_norms(self, quantity: str = "grad_norm"):
        """One row per step (indexed by global step), one column per trained variable.

        ``quantity``: ``"grad_norm"`` (the applied mean gradient's norm) or
        ``"update_ratio"`` (|update| / |weights|), as in
        :meth:`hostavg.inspect.record.RecordReader.variable_norms`.
        """
        check_quantity(quantity)
        return self.statistic("variable_norms" if quantity == "grad_norm" else "update_ratios")

    def distributions(self, variable: str, quantity: str = "gradient"):
        """The distribution of one variable's ``quantity`` over steps, as TensorBoard draws it.

        A pandas DataFrame indexed by global step, of the steps that kept
        distributions (a trainer made with ``distributions_every=N``: every
        N-th), one column per percentile of
        :data:`~hostavg.core.distributions.PERCENTILES` (0, 6.68, 15.87,
        30.85, 50, 69.15, 84.13, 93.32, 100). ``quantity``: ``"gradient"`` (the
        applied mean gradient), ``"weight"`` (the weights after the step) or
        ``"update"`` (weights after minus before). Drawn by
        :func:`hostavg.plot.distributions`.

        Raises:
          HostavgError: for an unknown quantity or variable, or when no step
            kept distributions.

        Example::

            history.distributions("dense/kernel", "update")[50]  # the median update per step
        """
        return distributions.table([(s.step, s.distributions) for s in self.steps], variable,
                                   quantity, "History.distributions")

    def to_json(self) -> str:
        """The History as JSON (what a checkpoint holds): ``"format": 2``, each step an object of
        named fields; an array a metric logged (Keras's F1Score, one value per class) becomes a
        list. Without the micro-batches' data rows (``micro_rows`` is null): one integer per
        sample would grow every checkpoint by the data set's size each epoch (a
        :class:`~hostavg.inspect.record.Record` keeps them, a step at a time)."""
        unsaved = {q.name: None for q in schema.HISTORY if q.kind is Kind.ROWS}
        return json.dumps({"format": FORMAT, "steps": [{**s._asdict(), **unsaved}
                                                       for s in self.steps],
                           "epochs": self.epochs, "variables": self.variables,
                           "statistics": {n: k.value for n, k in self.statistics.items()},
                           "stopped": self.stopped}, default=_plain)

    @classmethod
    def from_json(cls, text: str) -> History:
        """The History :meth:`to_json` wrote, or version 0.1.0 wrote (format 1: positional
        rows); HostavgError if ``text`` is not one."""
        try:
            data = json.loads(text)
            form = data.get("format", 1)
            if form not in (1, FORMAT):
                raise ValueError(f"format {form!r}; this version reads formats 1 and {FORMAT}")
            history = cls()
            history.statistics = {n: Kind(k) for n, k in data.get("statistics", {}).items()}
            history.steps = [history._row(_format_1(s) if form == 1 else s)
                             for s in data["steps"]]
            history.epochs, history.stopped = data["epochs"], data["stopped"]
            history.variables = tuple(data.get("variables", ()))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ArgumentError(f"not a History's JSON ({type(e).__name__}: {e}): "
                                f"{str(text)[:80]!r}") from None
        if not isinstance(history.epochs, list) or not all(isinstance(e, dict) for e in history.epochs) \
                or not isinstance(history.stopped, (str, type(None))):
            raise ArgumentError(f"not a History's JSON: epochs must be a list of dicts and stopped "
                                f"a string or null: {str(text)[:80]!r}")
        return history

    def _row(self, fields: dict) -> StepLog:
        """A StepLog of a step's JSON fields (fields a newer version added are left out)."""
        values = {n: _tuple(_KINDS[n], v) for n, v in fields.items() if n in _KINDS}
        statistics = {n: _tuple(self.statistics[n], v)
                      for n, v in fields.get("statistics", {}).items()}
        return StepLog(fields["epoch"], fields["samples"], **values,
                       statistics=MappingProxyType(statistics))

    def __repr__(self) -> str:
        last = f", last loss {self.steps[-1].loss:.4g}" if self.steps else ""
        return display.shortened(f"History({len(self.steps)} steps, {len(self.epochs)} epochs, "
                                 f"{self.samples} samples{last}"
                                 f"{', stopped' if self.stopped else ''})")

    def _repr_html_(self) -> str:
        caption = f"History: {len(self.steps)} steps, {len(self.epochs)} epochs, {self.samples} samples"
        lines = [] if self.stopped is None else [f"stopped: {self.stopped}"]
        if self.steps:
            last = self.steps[-1]
            lines.append(f"last step {last.step}: loss {display.number(last.loss)}, gradient norm "
                         f"{display.number(last.grad_norm)}")
        dropped = sum(len(s.dropped) for s in self.steps)
        if dropped:
            lines.append(f"{dropped} micro-batches dropped; rows that made them non-finite: "
                         f"{display.shortened(str(self.nonfinite_rows().tolist()), 80)}")
        names = ["epoch", *dict.fromkeys(k for e in self.epochs for k in e if k != "epoch")]
        rows = [[e.get(n) for n in names] for e in self.epochs]
        return display.html(caption, names if rows else [], rows, lines)


def _format_1(row) -> dict:
    """A format-1 step (a positional list of :data:`FORMAT_1`'s fields; earlier 0.1.0 commits
    wrote fewer, their first ones) by name."""
    if not isinstance(row, list) or not 5 <= len(row) <= len(FORMAT_1):
        raise TypeError(f"a format-1 step is a list of 5 to {len(FORMAT_1)} fields, got "
                        f"{row!r}"[:200])
    return dict(zip(FORMAT_1, row))


def _at(values: tuple, i: int) -> float:
    return values[i] if i < len(values) else math.nan


def _rows(rows: tuple | None, i: int) -> list | None:
    """Micro-batch ``i``'s data rows as a list, or None where unknown."""
    return None if rows is None or rows[i] is None else rows[i].tolist()


def _tuple(kind: Kind, value):
    """A JSON value as a StepLog keeps it: lists of the tuple kinds as tuples, a distribution's
    percentiles as tuples."""
    if kind in (Kind.ROWS, Kind.RECORDS) and value is not None:
        return schema.plain(kind, value)
    if kind is Kind.DISTRIBUTION and value is not None:
        return {q: {n: tuple(p) for n, p in by_variable.items()} for q, by_variable in value.items()}
    return tuple(value) if kind in _TUPLES and isinstance(value, list) else value


def _plain(value):
    """``value`` as JSON can hold it: a NumPy array as a list, a NumPy number as a number, a
    read-only mapping as an object."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
