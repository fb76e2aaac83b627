"""The overlapped step's worker: micro-batch i + 1 computes in a thread while the host takes micro-batch i."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

__all__ = ["overlapped", "worker"]


def worker() -> ThreadPoolExecutor:
    """A one-thread executor: what it is given runs in order."""
    return ThreadPoolExecutor(1, thread_name_prefix="hostavg-compute")


def overlapped(pool: ThreadPoolExecutor, compute, batches):
    """Yields ``compute(batch)`` of each of ``batches`` in order, computing the next one in
    ``pool`` meanwhile.

    Closing it early (the step failed) waits for the computation in flight.
    """
    finished = False
    try:
        pending = pool.submit(compute, batches[0])
        for i in range(len(batches)):
            done = pending.result()
            if i + 1 < len(batches):
                pending = pool.submit(compute, batches[i + 1])
            yield done
        finished = True
    finally:
        if not finished:
            # The worker runs what it is given in order: once this no-op has run, nothing
            # submitted before it is running (whatever an interrupt left unassigned).
            _wait(pool.submit(_nothing))


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
