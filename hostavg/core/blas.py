"""NumPy's BLAS in one thread while hostavg works, so that it leaves the cores to the framework.

hostavg's host arithmetic (squared norms, dots, a stack's statistics) calls NumPy's BLAS on
vectors of tens of thousands of entries or more, where OpenBLAS splits a call over threads,
which then wait for the next call spinning a while before they sleep (MKL's likewise). The
framework's next call finds those cores busy: on 2 cores one ``per_sample`` of 256 convnet
samples took 142 ms instead of 85 (Keras on TensorFlow). One thread loses little on such
arrays: 6 us for 65,536 float32 products.

:func:`one_blas_thread` holds the loaded BLAS libraries at one thread (``threadpoolctl``)
from the first entry to the last exit of any thread (it counts them), then gives back the
number they had; fit holds it throughout. A step, a compute and the trainer's other calls
open a :func:`blas_region` instead, where the hold starts at the first
:func:`need_one_blas_thread` (before each hook, and in the host arithmetic that calls BLAS)
and ends with the region: setting the count down and back cost a step that needs neither
30-130 us (paired, one process; steps of 0.6-1 ms: one micro-batch, or sparse rows).
A user's BLAS call from another thread while a hold lasts runs in one thread too.
"""

from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["blas_region", "in_blas_region", "in_one_blas_thread", "need_one_blas_thread",
           "one_blas_thread"]

_LOCK = threading.Lock()
#: regions: the blocks open now (blas_region, one_blas_thread), over every thread; held:
#: whether BLAS is held at one thread; counts: (library, its thread count before the hold) per
#: BLAS library, until given back; libraries: threadpoolctl's, found once.
_held = {"regions": 0, "held": False, "counts": None, "libraries": None}


@contextlib.contextmanager
def one_blas_thread():
    """Within the block (and any other thread's), NumPy's BLAS runs in one thread: a
    :func:`blas_region` that needs it at once.

    A KeyboardInterrupt while a hold is taken gives the count back at once; one while it is
    given back (Python runs the handler between two bytecodes) can leave it at one, which
    the next hold gives back first, and one just as the last block starts to close (before
    it is counted closed) leaves the blocks counted open: BLAS then stays at one thread."""
    with blas_region():
        need_one_blas_thread()
        yield


@contextlib.contextmanager
def blas_region():
    """A block within which (and within the others open meanwhile, in any thread) the first
    :func:`need_one_blas_thread` holds NumPy's BLAS at one thread; the last open block's
    end gives the count back. A block that needs none leaves the count alone."""
    counted = False
    try:
        with _LOCK:
            # one line: nothing runs a signal's handler between the two stores
            _held["regions"], counted = _held["regions"] + 1, True
        yield
    finally:
        with _LOCK:
            if counted:
                _held["regions"] -= 1
            if _held["regions"] == 0:
                _held["held"] = False
                _give_back()


def need_one_blas_thread() -> None:
    """From now until the open blocks (:func:`blas_region`) end, NumPy's BLAS runs in one
    thread; where none is open, nothing. Called before each hook, and by hostavg's host
    arithmetic before it calls BLAS."""
    if _held["held"] or not _held["regions"]:  # (unlocked: the locked test below decides)
        return
    with _LOCK:
        if _held["regions"] and not _held["held"]:
            _give_back()  # what an interrupted hold left
            _hold()
            _held["held"] = True


def _hold() -> None:
    """Records each BLAS library's thread count, then sets it to one."""
    if _held["libraries"] is None:
        from threadpoolctl import ThreadpoolController  # its scan of the libraries: once
        _held["libraries"] = ThreadpoolController().select(user_api="blas").lib_controllers
    _held["counts"] = [(lib, lib.get_num_threads()) for lib in _held["libraries"]]
    _as_controller(lambda: [lib.set_num_threads(1) for lib in _held["libraries"]])


def _give_back() -> None:
    """Sets each BLAS library's thread count back to what :func:`_hold` recorded, if anything."""
    counts = _held["counts"]
    if counts is not None:
        _as_controller(lambda: [lib.set_num_threads(n) for lib, n in counts if n is not None])
        _held["counts"] = None


def _as_controller(action) -> None:
    """``action()`` with this thread free to set the counts: threadpoolctl lets only the
    thread that set OpenBLAS's (pthreads) count first set it, the others' calls doing
    nothing, where a hold's first entry and last exit may be different threads."""
    def clear():
        for lib in _held["libraries"]:
            getattr(type(lib), "clear_controlling_thread", lambda force: None)(force=True)
    clear()
    try:
        action()
    finally:
        clear()


def in_one_blas_thread(method):
    """``method`` run within :func:`one_blas_thread` (a decorator)."""
    return _run_within(one_blas_thread, method)


def in_blas_region(method):
    """``method`` run within :func:`blas_region` (a decorator)."""
    return _run_within(blas_region, method)


def _run_within(context, method):
    """``method`` run within ``context()``, a context manager."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with context():
            return method(*args, **kwargs)
    return wrapped
