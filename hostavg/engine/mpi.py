"""Multi-worker training over MPI, through mpi4py: one reduction of the host sums per step.

Imported only when a Trainer gets ``comm=``. Each rank accumulates its own
micro-batches on the host as usual; then, per optimizer step, one small
``allgather`` of each rank's bookkeeping (or its error: then every rank
raises), one ``Allreduce`` of the dense weighted sums, and an
``Allgatherv`` of each sparse variable's touched rows. Every rank then
applies the same mean, so all ranks keep identical weights. The "stack"-only
statistics are None.

The first step of each session compares the ranks' variables before rank
0's values are broadcast; an uncaught exception on any rank calls
``MPI_Abort``, so no rank waits forever.

See docs/guides/mpi.md for the collectives, the first step and faults.
"""

from __future__ import annotations

import atexit
import math
import sys
import traceback
import weakref

import numpy as np

from hostavg.core.accumulator import Reduction, aligned_empty, stack_sum, weighted_rows
from hostavg.engine.protocols import Tally
from hostavg.core.errors import ArgumentError, HostavgError, StepError
from hostavg.core.gradients import coalesce_rows

__all__ = ["Distributed"]


class Distributed:
    """The engine's :class:`~hostavg.engine.protocols.Average` across MPI ranks: a trainer's communicator.

    Attributes:
      comm: the mpi4py communicator.
      rank, size: this process's rank and the number of ranks.
    """

    #: Each rank holds its own micro-batches only.
    sees_every_micro_batch = False
    passes_one_through = False  # the mean is every rank's

    def __init__(self, comm):
        try:
            from mpi4py import MPI
        except ImportError:
            raise ArgumentError("comm= needs mpi4py: pip install 'hostavg[mpi]'") from None
        if not isinstance(comm, MPI.Comm):
            raise ArgumentError(f"comm must be an mpi4py communicator such as MPI.COMM_WORLD, "
                                f"got {type(comm).__name__}")
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._synchronized = weakref.WeakSet()
        abort_on_uncaught_exception(comm)

    def begin(self, backend) -> None:
        """The first time a target (a session) steps, the ranks agree on the variables, then
        every variable takes rank 0's value."""
        if _left is not None:
            _abort(self.comm, f"left a step on its own ({_describe(_left)}) and steps again, "
                              f"while the other ranks may still wait in that one", 1)
        if backend.target in self._synchronized:
            return
        values = backend.variables()
        forms = self.gather(backend, f"the first step of a {backend.advice['target_name']}", (
            {name: _form(np.shape(v), np.asarray(v).dtype) for name, v in values.items()},
            {name: _form(s.shape, s.dtype) + (" sparse" if s.sparse else "")
             for name, s in backend.spec.items()}))
        differences = [d for kind, i in (("variable", 0), ("trained variable", 1))
                       for r in range(1, self.size)
                       for d in _differences(kind, forms[0][i], forms[r][i], r)]
        if differences:
            raise StepError(
                f"the ranks' models differ, so nothing was changed on any: "
                f"{'; '.join(differences[:6])}{' ...' if len(differences) > 6 else ''}. Build the "
                f"same {backend.advice['model_name']} and Trainer on every rank")
        names = sorted(values)
        backend.assign(dict(zip(names, self.broadcast([values[n] for n in names]))))
        self._synchronized.add(backend.target)

    def combine(self, backend, tally: Tally | None, error: BaseException | None) -> Tally:
        """Every rank's tally together; if any rank failed, the same error on every rank: an
        ArgumentError where every failed rank's was one (its call was refused), else a
        StepError."""
        message = None if error is None else str(error) if isinstance(error, HostavgError) \
            else f"{type(error).__name__}: {error}"
        if error is not None and getattr(error, "__notes__", None):
            message += " (" + "; ".join(error.__notes__) + ")"
        refused = isinstance(error, ArgumentError)
        reports = self.gather(backend, "a step", (message, refused, tally))
        failed = [(f"rank {r}: {m}", a) for r, (m, a, _) in enumerate(reports) if m is not None]
        if failed:
            kind = ArgumentError if all(a for _, a in failed) else StepError
            raise kind(f"the step failed on {len(failed)} of {len(reports)} ranks and nothing was "
                       f"applied on any: {' | '.join(m for m, _ in failed)}") from error
        tallies = [t for _, _, t in reports]
        loss_sums = [t.loss_sum for t in tallies]
        steps = [t.global_step for t in tallies if t.global_step is not None]
        return Tally(*([x for t in tallies for x in getattr(t, f)]
                       for f in ("weights", "sq_norms", "norms", "losses")),
                     math.fsum(t.total for t in tallies),
                     None if None in loss_sums else math.fsum(loss_sums),
                     sum(t.size for t in tallies),
                     steps[0] if steps else None,
                     _shared_apply_feed([t.apply_feed for t in tallies], backend.advice))

    def abandon(self, error: BaseException) -> None:
        """A KeyboardInterrupt or SystemExit leaving a step or fit is this rank's alone: the job
        ends when this process exits (or at its next step)."""
        global _left
        if not isinstance(error, Exception) and _left is None and self.size > 1:
            _left = error

    def gather(self, backend, what: str, obj) -> list:
        """Every rank's ``obj`` (small, pickled), in rank order.

        Raises HostavgError on every rank when some rank is not at ``what``
        (such as the first step of a session while another runs a step).
        """
        reports = self.comm.allgather((what, obj))
        if any(w != what for w, _ in reports):
            raise StepError(
                f"the ranks are out of step: "
                f"{', '.join(f'rank {r} is at {w}' for r, (w, _) in enumerate(reports))}; every "
                f"rank must make the same calls (fit: on the same data, with the same "
                f"arguments), with {backend.advice['target_name']}s made alike")
        return [o for _, o in reports]

    def broadcast(self, arrays: list) -> list:
        """Rank 0's ``arrays``, on every rank (others pass arrays of the same shapes and dtypes)."""
        out = [np.array(a, order="C") for a in arrays]  # 0-d stays 0-d
        for a in out:
            self.comm.Bcast(a, root=0)
        return out

    def reducer(self, backend, total: float):
        """A reducer (see :class:`~hostavg.core.accumulator.Reduction`) for the global mean over ``total`` weight."""
        spec = backend.spec

        def reduce(r: Reduction) -> dict:
            out = {}
            dense = [n for n, s in spec.items() if not s.sparse]
            for dtype in sorted({r.dtypes[n] for n in dense}, key=str):
                names = [n for n in dense if r.dtypes[n] == dtype]
                sizes = [math.prod(spec[n].shape) for n in names]
                flat = np.zeros(sum(sizes), dtype)
                offsets = np.cumsum([0] + sizes)
                for name, a, b in zip(names, offsets[:-1], offsets[1:]):
                    value = _local_value(r, name)
                    if value is not None:
                        np.multiply(value.ravel(), r.scale, out=flat[a:b], dtype=dtype)
                self.comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
                for name, a, b in zip(names, offsets[:-1], offsets[1:]):
                    out[name] = np.divide(flat[a:b].reshape(spec[name].shape), total,
                                          out=aligned_empty(spec[name].shape, dtype))
            for name, (indices, values, relative) in r.rows.items():  # weights w / scale
                unique, summed = weighted_rows(indices, values, relative * (r.scale or 0.0),
                                               r.dtypes[name])
                unique, summed = coalesce_rows(*self._gather_rows(unique, summed))
                out[name] = (unique, np.divide(summed, total, out=summed))
            return out
        return reduce

    def _gather_rows(self, indices: np.ndarray, values: np.ndarray):
        counts = np.asarray(self.comm.allgather(len(indices)))
        row = values.shape[1:]
        all_indices = np.empty(counts.sum(), np.int64)
        self.comm.Allgatherv(np.ascontiguousarray(indices, np.int64), [all_indices, counts])
        all_values = np.empty((counts.sum(),) + row, values.dtype)
        self.comm.Allgatherv(np.ascontiguousarray(values),
                             [all_values, counts * max(1, math.prod(row))])
        return all_indices, all_values


def _form(shape, dtype) -> str:
    return f"{tuple(shape)} {np.dtype(dtype).name}"


def _differences(kind: str, first: dict, other: dict, rank: int) -> list[str]:
    """How rank ``rank``'s ``other`` (name -> form) differs from rank 0's ``first``."""
    return ([f"rank {rank} lacks {kind} {n!r} ({f})" for n, f in first.items() if n not in other]
            + [f"rank {rank} has {kind} {n!r} ({f}), which rank 0 lacks"
               for n, f in other.items() if n not in first]
            + [f"{kind} {n!r} is {other[n]} on rank {rank}, {f} on rank 0"
               for n, f in first.items() if n in other and other[n] != f])


def _shared_apply_feed(feeds: list, advice) -> dict | None:
    """The apply feed of the ranks that ran micro-batches, which must be the same on each
    (``advice``: the backend's, whose words the error takes)."""
    given = [(r, f) for r, f in enumerate(feeds) if f is not None]
    if not given:
        return None
    (r0, first), differ = given[0], []
    for r, feed in given[1:]:
        differ += [f"{n!r} on ranks {r0} and {r}" for n in first.keys() | feed.keys()
                   if n not in first or n not in feed or not np.array_equal(first[n], feed[n])]
    if differ:
        raise StepError(f"the ranks give different values to {', '.join(differ)}, which "
                        f"{advice['apply_reader']} reads; nothing was applied on any. Give "
                        f"every rank the same value")
    return first


def _local_value(r: Reduction, name: str) -> np.ndarray | None:
    """This rank's sum_i w_i g_i / scale for a dense variable, or None if it added nothing."""
    if r.scale is None:
        return None
    if name in r.sums:
        return r.sums[name]
    return stack_sum(r.stacks[name], r.weights, r.dtypes[name])


_installed = False
#: The KeyboardInterrupt or SystemExit with which this rank left a step or fit alone, if it did.
_left: BaseException | None = None


def abort_on_uncaught_exception(comm) -> None:
    """Makes an uncaught exception, and an exit after a rank left a step alone, abort the whole MPI job.

    Without it a rank that dies of an exception finalizes MPI and exits, while
    the others wait forever in the step's next collective. SystemExit never
    reaches ``sys.excepthook``, so a hook at exit ends the job for a rank that
    left a step or fit with one (see :meth:`Distributed.abandon`).
    """
    global _installed
    if _installed or comm.Get_size() == 1:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        traceback.print_exception(kind, value, tb)
        _abort(comm, "failed", 1)
        previous(kind, value, tb)

    def at_exit():
        if _left is not None:
            code = _left.code if isinstance(_left, SystemExit) and isinstance(_left.code, int) \
                and _left.code else 130 if isinstance(_left, KeyboardInterrupt) else 1
            _abort(comm, f"left a step or fit on its own ({_describe(_left)})", code)

    sys.excepthook = hook
    atexit.register(at_exit)
    _installed = True


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}{f': {error}' if str(error) else ''}"


def _abort(comm, what: str, code: int) -> None:
    """Says that this rank ``what`` and ends every rank of the job with exit status ``code``."""
    try:
        sys.stderr.write(f"hostavg: rank {comm.Get_rank()} of {comm.Get_size()} {what}; "
                         f"aborting the MPI job\n")
        sys.stderr.flush()
    finally:
        comm.Abort(code)
