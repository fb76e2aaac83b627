"""How a step's computations are taken: one ahead, micro-batch i + 1 computing in a worker thread
while the host takes micro-batch i (``overlap=True``), or each in turn in the caller's thread,
several of them in one call where the backend can (:class:`Together`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from hostavg.core.errors import HostavgError

__all__ = ["Ahead", "Together", "worker"]


def worker() -> ThreadPoolExecutor:
    """A one-thread executor: what it is given runs in order."""
    return ThreadPoolExecutor(1, thread_name_prefix="hostavg-compute")


class Ahead:
    """``run(i)`` for i = 0 .. n - 1, taken in order; given a pool, ``run(i + 1)`` computes in
    it while the caller takes result i (one result ahead, no more).

    Closing it (the step failed, or ended) waits for the computation in flight, so that
    nothing is restored under a running computation.
    """

    def __init__(self, pool: ThreadPoolExecutor | None, run, n: int):
        self.pool, self.run, self.n = pool, run, n
        self._pending = None  # (index, future) of the computation in flight

    def take(self, i: int):
        """Result ``i`` (raising what ``run(i)`` raised); starts ``run(i + 1)`` in the pool."""
        if self.pool is None:
            return self.run(i)
        if self._pending is None:
            self._pending = (i, self.pool.submit(self.run, i))
        _, future = self._pending
        self._pending = None
        result = future.result()
        if i + 1 < self.n:
            self._pending = (i + 1, self.pool.submit(self.run, i + 1))
        return result

    def redo(self, then) -> None:
        """Calls ``then()`` once nothing computes; the result in flight (computed before
        ``then`` ran) is thrown away and computed again after it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            _wait(pending[1])
        then()
        if pending is not None:
            self._pending = (pending[0], self.pool.submit(self.run, pending[0]))

    def close(self) -> None:
        if self._pending is not None:
            self._pending = None
            # The worker runs what it is given in order: once this no-op has run, nothing
            # submitted before it is running (whatever an interrupt left unassigned).
            _wait(self.pool.submit(_nothing))


class Together:
    """Micro-batches computed several in one call (:class:`~hostavg.engine.protocols.Many`):
    ``take(i)`` gives computation ``i``, from the call that computed it, which it makes
    where none has; None where it is to be computed alone.

    A call computes from micro-batch i on as many in a row as the backend takes (none left
    out). Where one fails, the step's remaining micro-batches are computed alone: nothing
    was assigned, and one at a time the failure is named by its micro-batch. A call that
    computed micro-batch i computed those after it too: :meth:`state_after` gives the state
    as i's compute left it.
    """

    def __init__(self, compute_many, feeds: list, shares: list):
        self._many, self._feeds, self._shares = compute_many, feeds, shares
        self._done = {}  # index -> its computation, not yet taken
        self._states = {}  # index -> the function that gives the state its compute left
        self._off = False

    def state_after(self, i: int):
        """The rollback snapshot as computation ``i`` left it, where a call of several made it
        (one made alone left it in the model); else None."""
        state = self._states.get(i)
        return None if state is None else state()

    def take(self, i: int):
        if i in self._done:
            return _read(self._done.pop(i))
        if self._off:
            return None
        end = i
        while end < len(self._feeds) and self._feeds[end] is not None:
            end += 1
        if end - i < 2:
            return None
        try:
            outs = self._many(self._feeds[i:end], self._shares[i:end])
        except HostavgError:
            outs = ()
        if not outs:
            self._off = True
            return None
        self._keep(i, outs)
        del outs  # a failure read below keeps this frame in its traceback, not the others
        return _read(self._done.pop(i))

    def _keep(self, i: int, outs) -> None:
        for j, (computed, state) in enumerate(outs, start=i):
            self._done[j], self._states[j] = computed, state

    def close(self) -> None:
        """Lets go of the computations not taken and their states: a failed step's error,
        which a user may keep, then holds none of their gradients through its traceback."""
        self._done.clear()
        self._states.clear()


def _read(computed):
    """A computation a call of several gave: computed, or a function that reads it."""
    return computed() if callable(computed) else computed


def _nothing() -> None:
    pass


def _wait(future) -> None:
    """Waits until ``future`` is done (its outcome is not wanted); an interrupt meanwhile
    is raised once it is, so that nothing is restored under a running computation."""
    interrupted = None
    while not future.done():
        try:
            futures_wait([future])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            interrupted = e
    if interrupted is not None:
        raise interrupted
