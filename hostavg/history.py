"""History: what fit did, step by step and epoch by epoch."""

from __future__ import annotations

import json
from typing import NamedTuple

from hostavg.errors import HostavgError

__all__ = ["History", "StepLog"]


class StepLog(NamedTuple):
    """One optimizer step of fit.

    Attributes:
      epoch: the epoch it belongs to, from 0.
      step: the global step after it.
      loss: its sample-weighted mean loss.
      size: its number of samples.
      samples: samples seen by fit so far, this step's included.
    """

    epoch: int
    step: int
    loss: float
    size: int
    samples: int


class History:
    """The record fit returns, and keeps in its checkpoints.

    Attributes:
      steps: one :class:`StepLog` per optimizer step.
      epochs: one dict per finished epoch: "epoch", "loss" (sample-weighted
        mean over its steps), "samples", "steps", and "val_loss" plus
        "val_<metric>" where validation data was given.
      stopped: why a callback stopped training (a StopTraining message), or None.
    """

    def __init__(self):
        self.steps: list[StepLog] = []
        self.epochs: list[dict] = []
        self.stopped: str | None = None

    @property
    def samples(self) -> int:
        """Samples seen so far."""
        return self.steps[-1].samples if self.steps else 0

    def to_pandas(self, which: str = "steps"):
        """A pandas DataFrame of the ``"steps"`` (one row per step) or the ``"epochs"``."""
        if which not in ("steps", "epochs"):
            raise HostavgError(f"which must be 'steps' or 'epochs', got {which!r}")
        try:
            import pandas as pd
        except ImportError:
            raise HostavgError("History.to_pandas needs pandas: pip install pandas") from None
        if which == "steps":
            return pd.DataFrame(self.steps, columns=StepLog._fields)
        return pd.DataFrame(self.epochs)

    def to_json(self) -> str:
        return json.dumps({"steps": self.steps, "epochs": self.epochs, "stopped": self.stopped})

    @classmethod
    def from_json(cls, text: str) -> History:
        """The History :meth:`to_json` wrote; HostavgError if ``text`` is not one."""
        try:
            data = json.loads(text)
            history = cls()
            history.steps = [StepLog(*s) for s in data["steps"]]
            history.epochs, history.stopped = data["epochs"], data["stopped"]
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
