"""NumPy's BLAS in one thread while hostavg works, so that it leaves the cores to the framework.

hostavg's host arithmetic (squared norms, dots, a stack's statistics) calls NumPy's BLAS on
vectors of tens of thousands of entries or more, where OpenBLAS splits a call over threads,
which then wait for the next call spinning a while before they sleep (MKL's likewise). The
framework's next call, a few microseconds later, finds those cores busy: on 2 cores,
one ``per_sample`` of 256 convnet samples took 140 ms instead of 80, and one ``compute`` of
them 32 ms instead of 18 (Keras on TensorFlow, ``hostavg bench --per-sample``). The arrays
are small enough that one thread loses little: 6 us for 65,536 float32 products.

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
_held = {"depth": 0, "limiter": None, "controller": None}


@contextlib.contextmanager
def one_blas_thread():
    """Within the block (and any other thread's), NumPy's BLAS runs in one thread."""
    with _LOCK:
        if _held["depth"] == 0:
            if _held["controller"] is None:
                from threadpoolctl import ThreadpoolController  # its scan of libraries: once
                _held["controller"] = ThreadpoolController()
            _held["limiter"] = _as_controller(
                lambda: _held["controller"].limit(limits=1, user_api="blas"))
        _held["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _held["depth"] -= 1
            if _held["depth"] == 0:
                _as_controller(_held["limiter"].restore_original_limits)
                _held["limiter"] = None


def _as_controller(action):
    """``action()`` with this thread free to set the limits: threadpoolctl lets only the
    thread that set OpenBLAS's (pthreads) limits first set them, the others' calls doing
    nothing, where the holds' first entry and last exit may be different threads."""
    def clear():
        for lib in _held["controller"].lib_controllers:
            getattr(type(lib), "clear_controlling_thread", lambda force: None)(force=True)
    clear()
    try:
        return action()
    finally:
        clear()


def in_one_blas_thread(method):
    """``method`` run within :func:`one_blas_thread` (a decorator)."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with one_blas_thread():
            return method(*args, **kwargs)
    return wrapped
