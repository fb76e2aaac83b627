"""Ctrl-C and SIGTERM during a step: the step is applied completely or not at all.

Python runs a signal's handler in the main thread, between two bytecodes: the
KeyboardInterrupt of a Ctrl-C (or the SystemExit that fit makes of SIGTERM)
comes out wherever the main thread is, also just after the session call that
applied a step and before anyone has taken note of it. Two calls keep a step
whole:

* :func:`region` spans a step (in fit: the step and its bookkeeping);
* :func:`hold`, called just before the apply, makes SIGINT and SIGTERM wait
  until the region ends; they are then delivered, in order, to the handlers
  they were meant for.

Before the hold a signal acts at once, as it always did (the step is then
rolled back: nothing was applied). Regions nest: an inner one joins the outer
one, which delivers. Off the main thread both do nothing, since signals
interrupt only the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

__all__ = ["hold", "region"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Region:
    def __init__(self):
        self.previous = {}  # signal number -> the handler it had before the region
        self.pending = []
        self.holding = False


_open: list[_Region] = []  # the main thread's open region (at most one: inner ones join it)


@contextmanager
def region():
    """A block at whose end the signals :func:`hold` kept waiting are delivered."""
    if _open or threading.current_thread() is not threading.main_thread():
        yield
        return
    here = _Region()
    _open.append(here)  # before our handler is in place, which reads it
    try:
        for signum in _SIGNALS:
            handler = signal.getsignal(signum)
            if handler is not None:  # None: set outside Python, and we could not put it back
                here.previous[signum] = handler
                signal.signal(signum, _handler)
        yield
    finally:
        for signum, handler in here.previous.items():
            signal.signal(signum, handler)
        _open.pop()
        for signum in here.pending:
            signal.raise_signal(signum)  # its own handler runs now, as it would have then


def hold() -> None:
    """From now to the end of the open region, SIGINT and SIGTERM wait (a no-op outside one)."""
    if _open and threading.current_thread() is threading.main_thread():
        _open[-1].holding = True


def _handler(signum, frame):
    here = _open[-1]
    if here.holding:
        here.pending.append(signum)
        return
    previous = here.previous[signum]
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:  # the default action: end the process, now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
