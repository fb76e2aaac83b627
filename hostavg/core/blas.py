"""NumPy's BLAS in one thread while hostavg works, so that it leaves the cores to the framework.

hostavg's host arithmetic (squared norms, dots, a stack's statistics) calls NumPy's BLAS on
vectors of tens of thousands of entries or more, where OpenBLAS splits a call over threads,
which then wait for the next call spinning a while before they sleep (MKL's likewise). The
framework's next call, a few microseconds later, finds those cores busy: on 2 cores,
one ``per_sample`` of 256 convnet samples took 142 ms instead of 85 (Keras on TensorFlow),
and a ``compute`` of them right after one 32 ms instead of 18. The arrays are small enough
that one thread loses little: 6 us for 65,536 float32 products.

:func:`one_blas_thread` holds the loaded BLAS libraries at one thread (``threadpoolctl``)
from the first entry to the last exit of any thread (it counts them), then gives back the
number they had. A user's BLAS call from another thread meanwhile runs in one thread too.
"""

from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["one_blas_thread", "in_one_blas_thread"]

_LOCK = threading.Lock()
#: depth: the holds open now, over every thread; counts: (library, its thread count before
#: the first of them) per BLAS library, until given back; libraries: threadpoolctl's, found once.
_held = {"depth": 0, "counts": None, "libraries": None}


@contextlib.contextmanager
def one_blas_thread():
    """Within the block (and any other thread's), NumPy's BLAS runs in one thread.

    A KeyboardInterrupt while a hold is taken gives the count back at once; one while it is
    given back (Python runs the handler between two bytecodes) can leave it at one, which
    the next hold gives back first, and one just as the last hold starts to close (before
    it is counted closed) leaves the holds counted open: BLAS then stays at one thread."""
    counted = False
    try:
        with _LOCK:
            if _held["depth"] == 0:
                _give_back()  # what an interrupted hold left
                _hold()
            # one line: nothing runs a signal's handler between the two stores
            _held["depth"], counted = _held["depth"] + 1, True
        yield
    finally:
        with _LOCK:
            if counted:
                _held["depth"] -= 1
            if _held["depth"] == 0:
                _give_back()


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
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with one_blas_thread():
            return method(*args, **kwargs)
    return wrapped
