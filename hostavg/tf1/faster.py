"""The faster of two calls that compute the same thing, chosen by timing their first calls.

``session_threads="auto"`` (the TF1 trainer's default) has a session call made twice, to
run its ops in the session's inter-op pool or in the calling thread, which give the same
values (:mod:`hostavg.tf1.denormals`). Which is faster depends on the model and the
machine: the calling thread saves the hand-off to the pool and back, the pool runs large
independent ops side by side. :class:`Faster` times both on the call's own first uses and
keeps the faster, so the choice is made on the machine and model that pay for it.
"""

from __future__ import annotations

import statistics
import threading
import time

__all__ = ["Faster"]


class Faster:
    """``first`` or ``second``, whichever took less time on the first calls.

    Calls alternate between the two: :attr:`WARM` calls of each untimed (the
    first calls of a session call build its executor), then :attr:`TIMED` of
    each timed; from then on every call goes to the one whose median time was
    lower, ``first`` on a tie (the usual way goes first: the pool). A call that
    raises counts towards no median.
    Safe to call from several threads; their calls then time each other's too.

    Attributes:
      chosen: None while timing; then ``first`` or ``second``.
      medians: (first's, second's) median seconds, once chosen.
    """

    WARM = 2
    TIMED = 5

    def __init__(self, first, second):
        self._runs = (first, second)
        self._times = ([], [])
        self._calls = 0
        self._lock = threading.Lock()
        self.chosen = None
        self.medians = None

    def __call__(self, *args):
        chosen = self.chosen
        if chosen is not None:
            return chosen(*args)
        with self._lock:
            i, self._calls = self._calls, self._calls + 1
        which = i % 2
        start = time.perf_counter()
        out = self._runs[which](*args)
        took = time.perf_counter() - start
        if i >= 2 * self.WARM:
            self._timed(which, took)
        return out

    def _timed(self, which: int, took: float) -> None:
        with self._lock:
            times = self._times
            times[which].append(took)
            if self.chosen is None and min(map(len, times)) >= self.TIMED:
                self.medians = tuple(map(statistics.median, times))
                self.chosen = self._runs[self.medians[1] < self.medians[0]]
