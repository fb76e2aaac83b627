"""CPython's private APIs that hostavg uses, each detected at import, each with a public fallback.

``_signal.getsignal`` and ``_signal.signal``, of the C module under
:mod:`signal`, behind :func:`get_handler` and :func:`set_handler`: the step
engine's signal guard (:mod:`hostavg.engine.signals`) swaps the SIGINT and
SIGTERM handlers around every step, and :mod:`signal`'s wrappers convert each
number and handler to an enum and back in Python on the way; ``_signal``
takes and gives plain ints. Detected when ``_signal.getsignal`` agrees with
:func:`signal.getsignal` for both signals.

With ``HOSTAVG_PUBLIC_API_ONLY=1`` set before hostavg is imported, both are
:mod:`signal`'s own functions (see :mod:`hostavg.compat`).
"""

from __future__ import annotations

import signal

from hostavg.compat import choose

__all__ = ["get_handler", "set_handler"]


try:
    import _signal
except ImportError:  # not CPython: detection fails, and the public functions serve
    _signal = None


def _signal_works() -> bool:
    return all(_signal.getsignal(s) == signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM))


def _get_handler_private(signum: int):
    """The handler of ``signum``, by ``_signal.getsignal`` (SIG_DFL and SIG_IGN as plain ints)."""
    return _signal.getsignal(signum)


def _get_handler_public(signum: int):
    """The handler of ``signum``, by :func:`signal.getsignal` (SIG_DFL and SIG_IGN as
    ``signal.Handlers``, which equal those ints)."""
    return signal.getsignal(signum)


def _set_handler_private(signum: int, handler) -> None:
    """Makes ``handler`` (a callable, or SIG_DFL or SIG_IGN as :func:`get_handler` gives them)
    the handler of ``signum``, by ``_signal.signal``."""
    _signal.signal(signum, handler)


def _set_handler_public(signum: int, handler) -> None:
    """Makes ``handler`` (a callable, or SIG_DFL or SIG_IGN as :func:`get_handler` gives them)
    the handler of ``signum``, by :func:`signal.signal`."""
    signal.signal(signum, handler)


get_handler = choose("_signal.getsignal", _get_handler_private, _get_handler_public, _signal_works)
set_handler = choose("_signal.signal", _set_handler_private, _set_handler_public, _signal_works)
