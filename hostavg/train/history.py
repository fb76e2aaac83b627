"""History: what fit did, step by step and epoch by epoch."""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import numpy as np

from hostavg.core import distributions
from hostavg.core.errors import HostavgError
from hostavg.core.optional import pandas
from hostavg.core.results import check_quantity

__all__ = ["BOOKKEEPING", "History", "StepLog"]


class StepLog(NamedTuple):
    """One optimizer step of fit, with the statistics the plots need.

    Attributes:
      epoch: the epoch it belongs to, from 0.
      step: the global step after it.
      loss: its sample-weighted mean loss (NaN if every micro-batch was dropped; a step
        its optimizer skipped, loss scaling, keeps its loss, as Keras reports it).
      size: its number of samples.
      samples: samples seen by fit so far, this step's included.
      grad_norm: the applied mean gradient's norm (NaN if skipped).
      g2, trace_sigma, b_simple, norm_test: the step's own estimates
        (:class:`~hostavg.StepStats`; None with fewer than 2 micro-batches).
      learning_rate: the optimizer's learning rate at the apply, or None.
      micro_norms: each micro-batch's gradient norm, as accumulated.
      micro_norms_before_clip: the same before
        :class:`~hostavg.hooks.ClipMicroBatchNorm` clipped them, or None.
      variable_norms: per trained variable (in :attr:`History.variables`'
        order) the applied mean gradient's norm.
      update_ratios: per trained variable, |update| / |weights| of the apply.
      dropped: the indices of the micro-batches hooks dropped
        (:class:`~hostavg.hooks.SkipNonFinite`), in order.
      nonfinite_rows: the data rows of those dropped micro-batches' culprit
        samples (``MicroBatch.culprits``: the samples that made them
        non-finite), sorted; () where none was found or the rows are unknown.
      micro_losses: each micro-batch's mean loss, dropped ones too, in order.
      distributions: ``StepResult.distributions`` (quantity -> variable -> nine
        percentiles) on steps that kept them (``distributions_every``), else None.
    """

    epoch: int
    step: int
    loss: float
    size: int
    samples: int
    grad_norm: float = math.nan
    g2: float | None = None
    trace_sigma: float | None = None
    b_simple: float | None = None
    norm_test: float | None = None
    learning_rate: float | None = None
    micro_norms: tuple = ()
    micro_norms_before_clip: tuple | None = None
    variable_norms: tuple = ()
    update_ratios: tuple = ()
    dropped: tuple = ()
    nonfinite_rows: tuple = ()
    micro_losses: tuple = ()
    distributions: dict | None = None


#: The keys of an epoch's logs that are fit's bookkeeping, not measurements (left out of
#: :attr:`History.history` and of what Keras callbacks see).
BOOKKEEPING = ("epoch", "samples", "steps")

#: StepLog's per-step scalars, as :meth:`History.to_pandas` shows them.
_SCALARS = ("epoch", "step", "loss", "size", "samples", "grad_norm", "g2", "trace_sigma",
            "b_simple", "norm_test", "learning_rate")
#: StepLog's per-step tuples, as :meth:`History.to_pandas` shows them.
_TUPLES = ("micro_norms", "micro_losses", "dropped", "nonfinite_rows")


class History:
    """The record fit returns, and keeps in its checkpoints.

    Memory: per step, a few numbers plus two per micro-batch and two per
    trained variable (and 27 per variable on steps that keep distributions).

    Attributes:
      steps: one :class:`StepLog` per optimizer step.
      epochs: one dict per finished epoch: "epoch", "loss" (sample-weighted
        mean over its steps that had samples, those an optimizer skipped too,
        as Keras counts them), "samples", "steps", the training metrics
        (a Keras model's compiled metrics), and "val_loss" plus
        "val_<metric>" where validation data was given. :attr:`history` and
        :attr:`epoch` show them as Keras's History does.
      variables: the trained variables' names, the order of each StepLog's
        ``variable_norms`` and ``update_ratios``.
      stopped: why a callback stopped training (a StopTraining message), or None.
    """

    def __init__(self):
        self.steps: list[StepLog] = []
        self.epochs: list[dict] = []
        self.variables: tuple = ()
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
        st = result.stats
        if not self.variables:
            self.variables = tuple(st.variable_norms)
        ratios = result.update_ratios or {}
        before = result.info.get("micro_norms_before_clip")
        culprits = sorted(c.row for m in result.micro if m.culprits for c in m.culprits
                          if c.row is not None)
        log = StepLog(epoch, result.step, math.nan if result.loss is None else result.loss,
                      result.size, self.samples + result.size, st.grad_norm, st.g2,
                      st.trace_sigma, st.b_simple, st.norm_test, result.learning_rate,
                      tuple(st.micro_norms), None if before is None else tuple(before),
                      tuple(st.variable_norms.get(n, math.nan) for n in self.variables),
                      tuple(ratios.get(n, math.nan) for n in self.variables),
                      result.dropped, tuple(culprits), tuple(m.loss for m in result.micro),
                      result.distributions)
        self.steps.append(log)
        return log

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

    def to_pandas(self, which: str = "steps"):
        """A pandas DataFrame of the ``"steps"`` (one row per step: its scalars,
        ``micro_norms``, ``micro_losses``, ``dropped`` (the micro-batches hooks dropped) and
        ``nonfinite_rows`` (their culprit rows, :meth:`nonfinite_rows`)) or the
        ``"epochs"``; per-variable values: :meth:`variable_norms`."""
        if which not in ("steps", "epochs"):
            raise HostavgError(f"which must be 'steps' or 'epochs', got {which!r}")
        pd = pandas("History.to_pandas")
        if which == "steps":
            columns = (*_SCALARS, *_TUPLES)
            return pd.DataFrame([[getattr(s, c) for c in columns] for s in self.steps],
                                columns=columns)
        return pd.DataFrame(self.epochs)

    def variable_norms(self, quantity: str = "grad_norm"):
        """One row per step (indexed by global step), one column per trained variable.

        ``quantity``: ``"grad_norm"`` (the applied mean gradient's norm) or
        ``"update_ratio"`` (|update| / |weights|), as in
        :meth:`hostavg.inspect.record.RecordReader.variable_norms`.
        """
        check_quantity(quantity)
        pd = pandas("History.variable_norms")
        field = "variable_norms" if quantity == "grad_norm" else "update_ratios"
        return pd.DataFrame([getattr(s, field) or [math.nan] * len(self.variables)
                             for s in self.steps], columns=list(self.variables),
                            index=pd.Index([s.step for s in self.steps], name="step"))

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
        """The History as JSON (what a checkpoint holds); an array a metric logged (Keras's
        F1Score, one value per class) becomes a list."""
        return json.dumps({"steps": self.steps, "epochs": self.epochs,
                           "variables": self.variables, "stopped": self.stopped},
                          default=_plain)

    @classmethod
    def from_json(cls, text: str) -> History:
        """The History :meth:`to_json` wrote; HostavgError if ``text`` is not one."""
        try:
            data = json.loads(text)
            history = cls()
            history.steps = [StepLog(*(tuple(v) if isinstance(v, list) else v for v in s))
                             for s in data["steps"]]
            history.epochs, history.stopped = data["epochs"], data["stopped"]
            history.variables = tuple(data.get("variables", ()))
        except (TypeError, ValueError, KeyError) as e:
            raise HostavgError(f"not a History's JSON ({type(e).__name__}: {e}): "
                               f"{str(text)[:80]!r}") from None
        if not isinstance(history.epochs, list) or not all(isinstance(e, dict) for e in history.epochs) \
                or not isinstance(history.stopped, (str, type(None))):
            raise HostavgError(f"not a History's JSON: epochs must be a list of dicts and stopped "
                               f"a string or null: {str(text)[:80]!r}")
        return history

    def __repr__(self) -> str:
        last = f", last loss {self.steps[-1].loss:.4g}" if self.steps else ""
        return (f"History({len(self.steps)} steps, {len(self.epochs)} epochs, "
                f"{self.samples} samples{last}{', stopped' if self.stopped else ''})")


def _plain(value):
    """``value`` as JSON can hold it: a NumPy array as a list, a NumPy number as a number."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
