"""The calling thread's floating-point state as TensorFlow's own threads keep theirs.

TensorFlow's inter-op and intra-op pool threads flush denormal floats to zero (x86's FTZ
and DAZ bits of MXCSR) and round to nearest, each for its whole life. A session call whose
ops run in the thread that calls (``session_threads="caller"``) would otherwise compute them
in Python's state: denormal inputs and results kept, so values below about 1.2e-38 (float32)
differ from ``sess.run``'s. :func:`like_the_pool` runs a call with the calling thread's
MXCSR as the pool's and puts it back after, through glibc's ``fegetenv``/``fesetenv``
(``fenv_t`` on x86-64 ends with MXCSR); the exception flags raised within the call go
with the state the call ran in. Checked once, on first use, by denormal NumPy products in
the scope; where that cannot be done (not 64-bit x86 Linux with glibc) it is None, and the
difference stays (documented with ``session_threads``).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import struct
import sys

import numpy as np

__all__ = ["like_the_pool"]

#: MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits, which TensorFlow's
#: ``port::ScopedFlushDenormal`` sets in its threads; and its rounding control (bits 13-14),
#: 00 for to-nearest (``port::ScopedSetRound(FE_TONEAREST)``).
FLUSH, ROUNDING = 0x8040, 0x6000


class _Env(ctypes.Structure):
    """glibc's ``fenv_t`` on x86-64: the x87 environment (28 bytes), then MXCSR."""

    _fields_ = [("x87", ctypes.c_uint8 * 28), ("mxcsr", ctypes.c_uint32)]


def _calling(libm):
    """``run(function, *args)``: ``function(*args)`` with the calling thread's MXCSR as the
    pool threads', put back after (also where it raises)."""
    get, put, copy = libm.fegetenv, libm.fesetenv, _Env.from_buffer_copy

    def run(function, *args):
        saved = _Env()
        if get(saved) != 0:
            raise OSError("fegetenv failed")
        flushed = copy(saved)
        flushed.mxcsr = (saved.mxcsr | FLUSH) & ~ROUNDING
        try:  # (set inside: an interrupt between the two must still find the restore)
            put(flushed)
            return function(*args)
        finally:
            put(saved)
    return run


@functools.cache
def _flushing():
    """What :func:`like_the_pool` gives, or None where this platform has nothing that works
    (checked: a float32 denormal times 1 is 0 within it, and MXCSR as before after it)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") \
            or struct.calcsize("P") != 8:
        return None
    libm = None
    for name in ("libm.so.6", None):  # (by name: find_library would start a subprocess)
        try:
            libm = ctypes.CDLL(name)
            libm.fegetenv.argtypes = libm.fesetenv.argtypes = [ctypes.POINTER(_Env)]
            break
        except (OSError, AttributeError):
            libm = None
    if libm is None:
        return None
    tiny, one, large = np.float32(1e-40), np.float32(1.0), np.float32(1e30)
    before, after = _Env(), _Env()
    try:
        libm.fegetenv(ctypes.byref(before))
        # FTZ: a denormal result is 0; DAZ: a denormal input is 0 (1e-40 * 1e30 is normal)
        inside = _calling(libm)(lambda: (float(tiny * one), float(tiny * large)))
        libm.fegetenv(ctypes.byref(after))
    except OSError:
        return None
    status = 0x3F  # (MXCSR's sticky exception flags: what the products themselves may set)
    if inside != (0.0, 0.0) or (after.mxcsr & ~status) != (before.mxcsr & ~status):
        return None  # not flushed within, or not put back after
    return _calling(libm)


def like_the_pool():
    """``run(function, *args)``, which calls ``function(*args)`` with the calling thread
    flushing denormal floats to zero and rounding to nearest, as TensorFlow's pool threads
    do, and puts the thread's own state back after (about 3 microseconds); None where this
    platform offers none (see the module docstring)."""
    return _flushing()
