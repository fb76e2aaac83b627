"""What fit shows while it trains: a progress bar, a line per epoch, or nothing (:data:`PROGRESS_MODES`)."""

from __future__ import annotations

import sys
import time

import numpy as np

from hostavg.core.errors import ArgumentError
from hostavg.core.stats import NoiseScale
from hostavg.train.history import BOOKKEEPING

__all__ = ["PROGRESS_MODES", "Progress", "VERBOSE", "checked_progress", "checked_verbose",
           "in_notebook"]

#: What fit shows while it trains: True: a progress bar on a terminal or in Jupyter, nothing
#: elsewhere; "always": a bar anywhere; "epoch": one line per epoch on stdout; "auto": a bar
#: on a terminal or in Jupyter, one line per epoch elsewhere; False: nothing.
PROGRESS_MODES = (True, False, "always", "epoch", "auto")

#: fit's ``verbose`` on every face, as Keras's: each value -> what fit shows
#: (:data:`PROGRESS_MODES`): "auto" a bar on a terminal or in Jupyter and one line per epoch
#: elsewhere, 0 nothing, 1 a bar, 2 one line per epoch.
VERBOSE = {"auto": "auto", 0: False, 1: "always", 2: "epoch"}


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (ipykernel loaded, stderr not a terminal), where
    a display updated in place shows progress."""
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    return "ipykernel" in sys.modules and not tty


def checked_verbose(verbose):
    """Keras's ``verbose``: "auto", 0, 1 or 2 (a bool as 0 or 1)."""
    if verbose not in VERBOSE or isinstance(verbose, float):
        raise ArgumentError(f"verbose must be 'auto', 0, 1 or 2, got {verbose!r}")
    return int(verbose) if not isinstance(verbose, str) else verbose


def checked_progress(progress):
    """fit's ``progress``, one of :data:`PROGRESS_MODES` (a NumPy bool too)."""
    if not (isinstance(progress, (bool, np.bool_)) or (isinstance(progress, str)
                                                        and progress in PROGRESS_MODES)):
        raise ArgumentError(f"progress must be True, False, 'always', 'epoch' or 'auto', "
                            f"got {progress!r}")
    return progress


class Progress:
    """What fit shows of each epoch (see :data:`PROGRESS_MODES`).

    A bar: on a terminal, a tqdm bar on stderr, with the last step's loss
    and gradient norm (``grad_norm``: the applied mean's), the running noise
    scale (``B_simple``: :class:`~hostavg.NoiseScale`'s, over every step of
    fit with two micro-batches or more; absent before one) and samples/s; in Jupyter, one line of text, updated in place at most every
    half second, so a saved notebook keeps one final line per epoch. Either
    ends on the epoch's results (its loss and metrics, the last gradient
    norm and noise scale, then validation's). A line per epoch: printed on stdout when the
    epoch ends, with its steps, time and results.
    """

    def __init__(self, progress):
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        self.jupyter = in_notebook()
        interactive = tty or self.jupyter
        self.enabled = progress == "always" or (progress in (True, "auto") and interactive)
        self.lines = progress == "epoch" or (progress == "auto" and not interactive)
        self._bar = self._line = None
        self._started = None
        self._noise, self._postfix = NoiseScale(), {}

    def start(self, desc, total):
        if self.lines:
            self._desc, self._started, self._n = desc, time.perf_counter(), 0
        if not self.enabled:
            return
        self._t0, self._samples, self._postfix = time.perf_counter(), 0, {}
        if self.jupyter:
            from IPython.display import display
            self._desc, self._total, self._n, self._shown = desc, total, 0, 0.0
            self._line = display({"text/plain": self._text()}, raw=True, display_id=True)
        else:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit="step", leave=True)

    def update(self, result):
        if self.lines:
            self._n += 1
        if not self.enabled or (self._bar is None and self._line is None):
            return
        self._samples += result.size
        rate = self._samples / max(time.perf_counter() - self._t0, 1e-9)
        self._postfix = {"loss": "skipped" if result.skipped else f"{result.loss:.4f}"}
        if result.stats is not None:
            if not result.skipped:  # a skipped step's estimate would poison the average
                self._noise.on_step(None, result)
            self._postfix["grad_norm"] = f"{result.stats.grad_norm:.4g}"
        if self._noise.b_simple is not None:
            self._postfix["B_simple"] = f"{self._noise.b_simple:.4g}"
        self._postfix["samples/s"] = f"{rate:.0f}"
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(1)
        else:
            self._n += 1
            if time.perf_counter() - self._shown > 0.5:
                self._line.update({"text/plain": self._text()}, raw=True)

    def close(self, logs):
        if logs:
            said = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in logs.items()
                    if k not in BOOKKEEPING}  # the bar says the steps
            kept = {k: self._postfix[k] for k in ("grad_norm", "B_simple") if k in self._postfix}
            self._postfix = {**{k: v for k, v in said.items() if not k.startswith("val_")},
                             **kept, **{k: v for k, v in said.items() if k.startswith("val_")}}
            if self.lines and self._started is not None:
                shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in logs.items() if k not in BOOKKEEPING)
                print(f"{self._desc}: {self._n} steps in "
                      f"{time.perf_counter() - self._started:.1f} s, {shown}", flush=True)
        self._started = None
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.close()
        elif self._line is not None:
            self._line.update({"text/plain": self._text()}, raw=True)
        self._bar = self._line = None

    def _text(self) -> str:
        from tqdm import tqdm
        self._shown = time.perf_counter()
        postfix = ", ".join(f"{k}={v}" for k, v in self._postfix.items())
        return tqdm.format_meter(self._n, self._total, self._shown - self._t0, prefix=self._desc,
                                 unit="step", postfix=postfix or None)  # never cut
