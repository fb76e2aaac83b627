"""Ctrl-C and SIGTERM: a step applied completely or not at all, and SIGTERM as an exit fit unwinds from.

Within :func:`sigterm_as_exit` (fit's loop) SIGTERM raises SystemExit, so that
fit checkpoints on its way out. Python runs a signal's handler in the main
thread, between two bytecodes: the KeyboardInterrupt of a Ctrl-C (or that
SystemExit) comes out wherever the main thread is, also just after the session
call that applied a step and before anyone has taken note of it. Three calls
keep a step whole:

* :func:`region` spans a step (in fit: the whole loop);
* :func:`hold`, called just before the apply, makes SIGINT and SIGTERM wait;
* :func:`release` (in fit: once the step is counted), or the end of the
  region, delivers them, in order, to the handlers they were meant for.

Before the hold a signal acts at once, as it always did (the step is then
rolled back: nothing was applied). Regions nest: an inner one joins the outer one. Off the main
thread all of them do nothing, since signals interrupt only the main thread.
A region swaps the handlers at its first hold and puts them back at its end,
through :func:`hostavg.compat.python.set_handler` and ``get_handler``
(CPython's ``_signal`` where it works, else :mod:`signal`'s own functions).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

from hostavg.compat.python import get_handler, set_handler

__all__ = ["held", "hold", "region", "release", "sigterm_as_exit"]

_SIGNALS = (int(signal.SIGINT), int(signal.SIGTERM))


class _Region:
    def __init__(self):
        self.previous = {}  # signal number -> its handler before the region's first hold
        self.pending = []
        self.holding = False

    def handle(self, signum, frame):
        """The handler while the region holds its signals: one waits, or goes on at once."""
        if self.holding:
            self.pending.append(signum)
            return
        previous = self.previous[signum]
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # the default action: end the process, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


_open: list[_Region] = []  # the main thread's open region (at most one: inner ones join it)


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_as_exit():
    """Within the block, SIGTERM raises SystemExit(143) (128 + its number) in the main thread."""
    previous = signal.signal(signal.SIGTERM, _exit) if _main() else None
    try:
        yield
    finally:
        if previous is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, previous)


def _exit(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def region():
    """A block at whose end the signals that :func:`hold` kept waiting are delivered."""
    if _open or not _main():
        yield
        return
    here = _Region()
    try:
        _open.append(here)  # inside: a Ctrl-C just after it still closes the region
        yield
    finally:
        # What arrives from here on waits (no call comes before this, so no handler runs
        # first), until the handlers are back: a Ctrl-C halfway through had left the region
        # open, which then swallowed every later one (an outside review).
        here.holding = True
        try:
            if _open and _open[-1] is here:
                _open.pop()
            _put_back(list(here.previous.items()))
        finally:
            pending, here.pending = here.pending, []
            _deliver(pending)  # each to its own handler, as it would have then


def _put_back(handlers: list) -> None:
    """Sets each (signal number, handler) of ``handlers``, each also where setting one before
    it let a signal's handler raise."""
    if handlers:
        try:
            set_handler(*handlers[0])
        finally:
            _put_back(handlers[1:])


def _deliver(signals: list) -> None:
    """Raises each of ``signals`` again, in order, to whatever handles it now, each also where
    an earlier one's handler raised (the last raised carries the others as its context)."""
    if signals:
        try:
            signal.raise_signal(signals[0])
        finally:
            _deliver(signals[1:])


def hold() -> None:
    """From now until :func:`release` or the region's end, SIGINT and SIGTERM wait (outside a region: nothing)."""
    if not _open or not _main():
        return
    here = _open[-1]
    here.holding = True
    if not here.previous:
        for signum in _SIGNALS:
            handler = get_handler(signum)
            if handler is not None:  # None: set outside Python, and we could not put it back
                here.previous[signum] = handler
                set_handler(signum, here.handle)


@contextmanager
def held():
    """Within the block SIGINT and SIGTERM wait (in the main thread), as a file is written: a
    KeyboardInterrupt or SystemExit raised inside numpy's zip writer came out as zipfile's
    ValueError. Those that waited act as the block ends, or, inside a hold not yet released
    (a step's apply), where that one is."""
    with region():
        outer = bool(_open) and _main() and _open[-1].holding
        hold()
        try:
            yield
        finally:
            if not outer:
                release()


def release() -> None:
    """Signals act at once again; those that waited are delivered now."""
    if not _open or not _main():
        return
    here = _open[-1]
    here.holding = False
    pending, here.pending = here.pending, []
    _deliver(pending)  # to the region's handler, which no longer holds
