"""The one trainer contract: every trainer method written once, over the engine's Backend protocol.

``hostavg.Trainer`` (a TF1 graph and its session) and ``hostavg.keras.Trainer``
(a Keras 3 model) are thin faces of :class:`BaseTrainer`: they check their
framework's arguments, make the backend, and turn the data as their users give
it (feed dicts, ``(x, y[, sample_weight])`` tuples) into the backend's feeds.
Everything else is here, once: compute, accumulator, apply, step, fit,
evaluate, check, per_sample, save, restore and step_together, with the same
meaning, arguments and results on every face.

A face whose values live in one object for the trainer's life (a Keras model)
passes the same backend to every call; a face whose values live in an object
given per call (a TF1 session) binds a backend per call.

Framework-free: nothing here imports TensorFlow, Keras or JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hostavg.core.accumulator import ACCUMULATE_MODES, Accumulator, as_accum_dtype
from hostavg.core.check import ADVICE, CheckReport
from hostavg.core.errors import HostavgError, flag, positive_int
from hostavg.core.gradients import Gradients
from hostavg.core.optional import pandas
from hostavg.core.results import StepResult
from hostavg.core.split import sample_count, split, take
from hostavg.engine.hooks import normalize_hooks
from hostavg.engine.protocols import Average, Backend, HostAverage
from hostavg.engine.step import Engine
from hostavg.train import checkpoint
from hostavg.train.history import History
from hostavg.train.loop import fit as fit_loop

__all__ = ["BaseTrainer", "Bound", "entries"]


class BaseTrainer:
    """What every trainer face shares: the engine, its settings, and each method's meaning.

    Args (keyword arguments of every face):
      accumulate: one of :data:`~hostavg.ACCUMULATE_MODES`: "sum" keeps a
        running sum (memory of one gradient), "stack" keeps every micro-batch's
        gradients (``StepResult.micro[i].grads``, and the statistics that need them).
      accum_dtype: the host accumulation dtype (e.g. "float64"); None keeps
        each variable's dtype.
      hooks: objects with any of the hook methods (:class:`~hostavg.core.results.Hook`):
        per step ``on_micro_batch``, ``on_step``, ``on_applied``; per fit
        ``on_epoch_end``, ``on_train_end``, ``on_resume``, ``close``.
      comm: an mpi4py communicator, to train over several processes
        (:mod:`hostavg.engine.mpi`); None: this process alone.
      update_ratios_every: measure ``StepResult.update_ratios``
        (|w_after - w_before| / |w_before| per variable) in the apply of every
        step whose global step is a multiple of this (1: every step); None:
        never. Measuring costs about one more apply.
      overlap: compute micro-batch i + 1 in a worker thread while the host
        shows micro-batch i to the hooks, checks it and adds it; the same
        results bit for bit (see :class:`~hostavg.engine.step.Engine`).
      average: where the mean is computed when ``comm`` is None (a face's own
        :class:`~hostavg.engine.protocols.Average`); default NumPy on the host.

    Attributes:
      hooks: the hooks, in the order they run.
      comm: the communicator, or None.
      accumulate, accum_dtype, update_ratios_every, overlap: as given
        (``accum_dtype`` as a NumPy dtype or None).
    """

    def __init__(self, *, accumulate: str = "sum", accum_dtype=None, hooks=(), comm=None,
                 update_ratios_every: int | None = None, overlap: bool = False,
                 average: Average | None = None):
        if accumulate not in ACCUMULATE_MODES:
            raise HostavgError(f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
        self.accumulate = accumulate
        self.accum_dtype = as_accum_dtype(accum_dtype)
        self.hooks = normalize_hooks(hooks)
        self.update_ratios_every = None if update_ratios_every is None else positive_int(
            "update_ratios_every", update_ratios_every)
        self.overlap = flag("overlap", overlap)
        self.comm = comm
        if comm is not None:
            from hostavg.engine.mpi import Distributed  # mpi4py is imported on use only
            average = Distributed(comm)
        self._average = average or HostAverage()
        self._engine: Engine | None = None

    # --- The engine -------------------------------------------------------------------------

    def _make_engine(self, spec) -> Engine:
        self._engine = Engine(spec, accumulate=self.accumulate, accum_dtype=self.accum_dtype,
                              hooks=self.hooks, average=self._average,
                              update_ratios_every=self.update_ratios_every, overlap=self.overlap)
        return self._engine

    def _engine_for(self, backend: Backend, sample, what: str) -> Engine:
        """The engine; made on the first data a backend prepares, where the backend learns its
        variables from data (a Keras model traces its gradient function on ``sample``, or on
        what ``sample()`` returns where it is a function: read only when needed)."""
        if self._engine is None:
            backend.prepare(sample() if callable(sample) else sample, None, what)
            self._make_engine(backend.spec)
        return self._engine

    def _ready(self, what: str) -> Engine:
        if self._engine is None:
            raise HostavgError(
                f"{what} needs the trained variables, which the trainer learns from the first "
                f"batch: run compute (or step, fit, evaluate) on a batch first")
        return self._engine

    @property
    def spec(self) -> dict:
        """name -> :class:`~hostavg.VariableSpec` of every trained variable."""
        return self._ready("trainer.spec").spec

    # --- The methods, once ------------------------------------------------------------------

    def _compute(self, backend: Backend, feed, size: int | None) -> Gradients:
        return self._engine_for(backend, feed, "compute").compute(backend, feed, size)

    def _accumulator(self, reducer=None) -> Accumulator:
        return Accumulator(self._ready("accumulator()").spec, accumulate=self.accumulate,
                           accum_dtype=self.accum_dtype, reducer=reducer)

    def _apply(self, backend: Backend, grads: Mapping, feed: Mapping) -> int:
        return self._ready("apply()").apply(backend, grads, feed)

    def _step(self, backend: Backend, feeds: Sequence, sizes, rows) -> StepResult:
        return self._for_step(backend, feeds).step(backend, feeds, sizes, rows)

    def _for_step(self, backend: Backend, feeds) -> Engine:
        if self._engine is None:  # the face checked that ``feeds`` is a list of batches
            if not feeds:
                raise HostavgError("step got no micro-batches; pass at least one batch")
            return self._engine_for(backend, feeds[0], f"step, micro-batch 0 of {len(feeds)}")
        return self._engine

    def _check(self, backend: Backend, data, micro_batch_size: int,
               blocks: Mapping | None = None) -> CheckReport:
        positive_int("micro_batch_size", micro_batch_size)
        n = sample_count(data, "check", blocks)
        if not n:
            leaves = [getattr(k, "name", k) for k in data] if isinstance(data, Mapping) else []
            said = ("arrays of 0 samples" if n == 0 else
                    f"only scalars: {', '.join(map(repr, leaves))}" if leaves else "an empty feed")
            raise HostavgError(f"check: the feed holds no array of samples to cut into "
                               f"micro-batches ({said}). {ADVICE[backend.framework]['no_samples']}")
        engine = self._engine_for(backend, data, "check")
        return engine.check(backend, data, split(data, micro_batch_size, blocks=blocks), n)

    def _per_sample(self, backend: Backend, data):
        pd = pandas("per_sample")
        samples = split(data, 1)
        found = self._engine_for(backend, samples[0] if samples else data, "per_sample") \
            .per_sample(backend, samples)
        return pd.DataFrame({"loss": found.losses, "norm": found.norms, "cosine": found.cosines},
                            index=pd.RangeIndex(len(found.losses), name="sample"))

    def _evaluate(self, backend: Backend, data, batch_size: int, metrics=None) -> dict:
        """The loss (and metrics) over ``data`` in chunks of ``batch_size``, sample-weighted; what
        the forward pass assigns (a counter, moving statistics in training mode) is restored."""
        positive_int("batch_size", batch_size)
        chunks = split(data, batch_size)
        engine = self._engine_for(backend, take(chunks[0], slice(0, 1)) if chunks else data,
                                  "evaluate")
        with engine.leaving_no_trace(backend, "evaluate"):
            return backend.evaluate(chunks, metrics)

    def _fit(self, backend: Backend, source, validate, **kwargs) -> History:
        """fit over ``source`` (a callable returning the batch source, after the arguments are
        checked); ``validate(epoch)`` gives the epoch's validation results."""
        return fit_loop(Bound(self, backend, validate), source, **kwargs)

    def _save(self, backend: Backend, path, fit: dict | None = None) -> None:
        checkpoint.save(backend, path, fit=fit)

    def _restore(self, backend: Backend, path) -> dict | None:
        return checkpoint.restore(backend, path)

    # --- What fit asks a face between steps (a face with training metrics overrides them) --

    def _reset_metrics(self, backend: Backend) -> None:
        """Starts the training metrics afresh (at each epoch's start in fit); none here."""

    def _training_metrics(self, backend: Backend) -> dict:
        """The training metrics since :meth:`_reset_metrics`, by name (fit's epoch logs); none here."""
        return {}

    def _stop_requested(self) -> str | None:
        """Why fit should end after this step, the epoch's end still run (the framework's own
        stop flag), or None."""
        return None

    def _part(self, backend: Backend, feeds, sizes) -> tuple:
        """This trainer's entry of a :func:`step_together`."""
        return self._for_step(backend, feeds), backend, feeds, sizes


class Bound:
    """A trainer bound to its backend, as fit drives it (:class:`hostavg.train.loop.Run`)."""

    def __init__(self, trainer: BaseTrainer, backend: Backend, validate):
        self.trainer, self.backend, self.validate = trainer, backend, validate
        self.comm, self.hooks = trainer.comm, trainer.hooks

    def gather(self, what: str, obj) -> list:
        return self.trainer._average.gather(what, obj)

    def random_ops(self) -> tuple:
        return tuple(self.backend.random_ops())

    def hooked(self, extra: tuple):
        return self.trainer._ready("fit").hooked(extra)

    def step(self, micro_batches: list, sizes: list | None = None, rows: list | None = None
             ) -> StepResult:
        return self.trainer._step(self.backend, micro_batches, sizes, rows)

    def global_step(self) -> int:
        return self.backend.global_step()

    def save(self, path, fit: dict) -> None:
        self.trainer._save(self.backend, path, fit)

    def restore(self, path) -> dict | None:
        return self.trainer._restore(self.backend, path)

    def reset_metrics(self) -> None:
        self.trainer._reset_metrics(self.backend)

    def metrics(self) -> dict:
        return self.trainer._training_metrics(self.backend)

    def stop_requested(self) -> str | None:
        return self.trainer._stop_requested()

    def abandon(self, error: BaseException) -> None:
        if self.trainer._engine is not None:
            self.trainer._engine.abandon(error)


def entries(steps, kind: type, call: str) -> list[tuple]:
    """``steps`` checked as ``(trainer, batches)`` or ``(trainer, batches, sizes)`` of ``kind``:
    ``(trainer, batches, sizes)`` each."""
    if isinstance(steps, Mapping) or not isinstance(steps, Sequence) or not steps:
        raise HostavgError(f"{call} takes a non-empty list of (trainer, batches) pairs, got "
                           f"{steps!r}")
    out = []
    for entry in steps:
        if not isinstance(entry, tuple) or len(entry) not in (2, 3) or not isinstance(entry[0], kind):
            raise HostavgError(f"{call} takes (trainer, batches) or (trainer, batches, sizes) per "
                               f"trainer, each trainer a {kind.__module__}.{kind.__qualname__}; "
                               f"got {entry!r}")
        out.append(entry if len(entry) == 3 else (*entry, None))
    return out
