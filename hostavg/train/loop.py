"""The training loop behind ``Trainer.fit``: batches, micro-batches, epochs, checkpoints.

The loop knows no framework: it drives a :class:`Run` (a trainer bound to a
TF1 session, or a Keras trainer) over the :class:`~hostavg.train.sources.BatchSource`
a face built, and evaluates the :class:`~hostavg.train.sources.Validation` it
was given. A face checks fit's arguments first (:func:`fit_arguments`), then
builds its source, then calls :func:`fit`, which runs named pieces around a
:class:`FitState` (the position in the data, the History, the steps saved) and
a :class:`FitPlan` (what it was asked to do): :func:`resume`,
:func:`train_begin`, :func:`train_epoch`, :func:`train_step` and :func:`checkpoint`.

Every batch is weighted by its real number of samples. fit's position is the
epoch and the samples (and batches) taken in it; a checkpoint stores it with
the seed and the batch size, and a resumed run continues at that sample bit
for bit. A step and its bookkeeping are one: a signal that arrives once the
step's apply has begun waits until fit has counted the step.

See docs/guides/training.md for the kinds of data, resuming, random state and
MPI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hostavg.core.blas import in_one_blas_thread
from hostavg.core.check import RandomOp
from hostavg.core.errors import (ArgumentError, HostavgError, StepError, flag, non_negative_int,
                                  object_list, positive_int, warn, within_step)
from hostavg.core.results import FIT_METHODS, HOOK_METHODS, StepResult
from hostavg.core.split import Cut, as_arrays, feed_size, pieces, take
from hostavg.engine.hooks import name_of
from hostavg.engine.signals import hold, region, release, sigterm_as_exit
from hostavg.train.agreement import shared_seed
from hostavg.train.callbacks import StopTraining
from hostavg.train.checkpoint import CheckpointDir
from hostavg.train.history import History
from hostavg.train.progress import Progress, checked_progress
from hostavg.train.sources import BatchSource, Validation, refuse_endless

__all__ = ["FitArguments", "FitPlan", "FitState", "ResumeWarning", "Run", "check_sizes",
           "checkpoint", "fit", "fit_arguments", "resume", "train_begin", "train_epoch",
           "train_step"]


class Run(Protocol):
    """What fit needs of a trainer bound to where its values live (a TF1 session, a Keras model)."""

    #: The trainer's MPI communicator, or None.
    comm: Any
    #: The trainer's hooks (fit calls their fit-level methods too).
    hooks: tuple
    #: The backend's advice, whose words fit's messages use (:attr:`Backend.advice
    #: <hostavg.engine.protocols.Backend.advice>`).
    advice: Mapping[str, str]

    def gather(self, what: str, obj) -> list:
        """Every process's ``obj`` (one alone), when every one is at ``what``; over MPI a
        HostavgError on every rank when some rank is elsewhere."""

    def random_ops(self) -> Sequence[RandomOp]:
        """The random ops a micro-batch's compute runs (:meth:`Backend.random_ops
        <hostavg.engine.protocols.Backend.random_ops>`)."""

    def hooked(self, extra: tuple):
        """A context within which the trainer's steps call ``extra``'s step-level hook methods too."""

    def step(self, micro_batches: list, sizes: list | None = None, rows: list | None = None
             ) -> StepResult:
        """One optimizer step over ``micro_batches`` (of ``sizes`` samples and holding the data
        ``rows``, where given)."""

    def global_step(self) -> int:
        """The global step now."""

    def save(self, path, fit: dict) -> None:
        """Writes a checkpoint holding ``fit``'s state (see :mod:`hostavg.train.checkpoint`)."""

    def restore(self, path) -> dict | None:
        """Loads a checkpoint; returns the fit state it holds, or None."""

    def evaluate(self, validation: Validation) -> dict:
        """The results by name ("loss", metrics) over ``validation``'s chunks; changes nothing."""

    def reset_metrics(self) -> None:
        """Starts the training metrics afresh (at each epoch's start)."""

    def metrics(self) -> dict:
        """The training metrics over the epoch's steps so far, by name ({} where there are none)."""

    def stop_requested(self) -> str | None:
        """Why training should end after this step, the epoch's end still run (a Keras
        callback set ``model.stop_training``), or None."""

    def abandon(self, error: BaseException) -> None:
        """fit ends with ``error`` (over MPI, a rank leaving alone ends the job)."""


#: How many steps in a row may have every micro-batch dropped (by hooks such as
#: :class:`~hostavg.hooks.SkipNonFinite`) before fit stops with an error naming their culprit
#: rows: a run that learns nothing goes no further.
EMPTY_STEPS = 5


@dataclasses.dataclass(frozen=True)
class FitArguments:
    """fit's arguments, checked by :func:`fit_arguments` before a face reads any data.

    Attributes:
      batch_size, epochs, seed, drop_remainder, progress, checkpoint_dir,
        checkpoint_every, keep_checkpoints, blocks, initial_epoch, steps_per_epoch:
        fit's arguments, checked (see :meth:`hostavg.Trainer.fit`).
      cut: how each batch is cut into micro-batches (fit's or the trainer's
        ``micro_batch_size``, or the trainer's ``micro_batches``).
      callbacks: fit's hooks, after the trainer's.
      validation_freq: as :func:`~hostavg.train.sources.checked_validation_freq` checked it.
    """

    batch_size: int | None
    cut: Cut
    epochs: int
    seed: int | None
    drop_remainder: bool
    progress: Any
    callbacks: tuple
    checkpoint_dir: Any
    checkpoint_every: int | None
    keep_checkpoints: int
    blocks: dict | None
    initial_epoch: int
    steps_per_epoch: int | None
    validation_freq: int | frozenset


def fit_arguments(*, batch_size, cut: Cut, validation_freq, epochs=1, seed=None,
                  drop_remainder=False, callbacks=(), progress=True, checkpoint_dir=None,
                  checkpoint_every=None, keep_checkpoints=3, blocks=None, initial_epoch=0,
                  steps_per_epoch=None) -> FitArguments:
    """fit's arguments, checked: sizes that fit together, a seed that is an integer >= 0, flags
    that are bools, no ``checkpoint_every`` without ``checkpoint_dir``, hooks as callbacks.

    ``batch_size`` is None for a source that gives its own batches; ``blocks``: {key: b} for
    arrays of b blocks of the samples (see :mod:`hostavg.core.split`); ``validation_freq``
    is already checked.
    """
    check_sizes(batch_size, cut, epochs, checkpoint_every)
    checked_progress(progress)
    drop_remainder = flag("drop_remainder", drop_remainder)
    seed = None if seed is None else non_negative_int("seed", seed)
    initial_epoch = non_negative_int("initial_epoch", initial_epoch)
    if steps_per_epoch is not None:
        steps_per_epoch = positive_int("steps_per_epoch", steps_per_epoch)
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ArgumentError(f"checkpoint_every={checkpoint_every} needs checkpoint_dir, the folder "
                            f"to write the checkpoints to")
    callbacks = object_list("callbacks", callbacks, HOOK_METHODS, "hostavg.EarlyStopping()")
    return FitArguments(
        batch_size=batch_size, cut=cut, epochs=epochs, seed=seed, drop_remainder=drop_remainder,
        progress=progress, callbacks=callbacks, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, blocks=blocks,
        initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
        validation_freq=validation_freq)


@in_one_blas_thread  # the callbacks' too: see hostavg.core.blas
def fit(run: Run, source: BatchSource, validation: Validation | None,
        arguments: FitArguments) -> History:
    """Trains ``run`` over the batches of ``source``, evaluating ``validation`` (None: none) at
    the epochs it makes due; see :meth:`hostavg.Trainer.fit`.

    Epochs: fit trains epochs ``initial_epoch`` to ``epochs - 1`` (as Keras
    counts them). An epoch is one pass over the data, or, with
    ``steps_per_epoch``, that many steps, continuing the pass where the
    previous epoch stopped: an epoch then ends early where the pass ends, and
    the next starts a new pass. The data's order depends on (seed, pass).

    Before anything trains, ``source`` is refused where it cannot give each
    epoch a batch and an end: a one-shot iterator for more than one epoch, an
    endless source without ``steps_per_epoch``, data of no batch.
    """
    source = _checked_source(source, arguments)
    hooks = _fit_methods(run.hooks + arguments.callbacks)
    checkpoints = CheckpointDir(arguments.checkpoint_dir, arguments.keep_checkpoints) \
        if arguments.checkpoint_dir is not None else None
    state = FitState(epoch=arguments.initial_epoch, data_pass=arguments.initial_epoch,
                     seed=arguments.seed)
    latest = None if checkpoints is None else checkpoints.latest()
    if latest is not None:
        resume(run, latest, hooks, state)
    rank, size = (run.comm.Get_rank(), run.comm.Get_size()) if run.comm is not None else (0, 1)
    plan = FitPlan(
        **vars(arguments), rank=rank, size=size,
        num_batches=source.num_batches(arguments.drop_remainder), hooks=hooks,
        # rank 0 writes the checkpoints; every rank reads them when resuming
        checkpoints=checkpoints if rank == 0 else None, validation=validation)
    state.seed = shared_seed(state.seed, _agreed(plan, state, source.n),
                             None if run.comm is None else run.gather)
    if state.history.stopped is not None or state.epoch >= plan.epochs:
        return state.history
    state.global_step = run.global_step()
    if plan.checkpoints is not None:  # a folder without a checkpoint gets the start, seed and
        # all: a run killed before its first checkpoint then resumes as itself, as one killed later
        state.saved_step = state.global_step if latest is not None else checkpoint(run, plan, state)
    bar = Progress(plan.progress if rank == 0 else False)
    # A signal that arrives from a step's apply on waits until the step is counted (release).
    with sigterm_as_exit(), region(), run.hooked(plan.callbacks):
        try:
            train_begin(hooks, state)
            while state.epoch < plan.epochs:
                if train_epoch(run, source, plan, state, bar):
                    break
        except StopTraining as e:
            state.history.stopped = str(e) or "stopped by a callback"
        except BaseException as error:
            _abandon(run, plan, state, bar, error)
            raise
    bar.close(None)
    try:
        if plan.checkpoints is not None:
            checkpoint(run, plan, state)
        for hook in hooks["on_train_end"]:
            hook(state.history)
    finally:
        _close(hooks)
    return state.history


@dataclasses.dataclass
class FitState:
    """What fit changes as it trains: where it is in the data, its History, its steps.

    Attributes:
      epoch: the epoch under way (from 0, as Keras counts them).
      data_pass: the passes over the data begun; the same as ``epoch``
        without ``steps_per_epoch``. The data's order depends on (seed, pass).
      batch: the batches taken from the pass so far.
      samples: the samples taken from the pass so far.
      seed: the seed of the data's order (None until fit draws one or takes rank 0's).
      history: the History fit returns.
      global_step: the global step the last step left (for error messages).
      saved_step: the global step of the newest checkpoint fit wrote or
        resumed from, or None.
      batches: the batches of the pass under way (continued from epoch to
        epoch), or None when the next batch starts a new iteration.
    """

    epoch: int
    data_pass: int
    batch: int = 0
    samples: int = 0
    seed: int | None = None
    history: History = dataclasses.field(default_factory=History)
    global_step: int = 0
    saved_step: int | None = None
    batches: Any = None

    def saved(self, batch_size) -> dict:
        """The fit state a checkpoint holds (see :mod:`hostavg.train.checkpoint`)."""
        return {"epoch": self.epoch, "batch": self.batch, "samples": self.samples,
                "pass": self.data_pass, "batch_size": batch_size, "seed": self.seed,
                "history": self.history.to_json()}

    def next_pass(self) -> None:
        """Moves to the start of the next pass over the data."""
        self.data_pass, self.batch, self.samples = self.data_pass + 1, 0, 0


@dataclasses.dataclass(frozen=True)
class FitPlan(FitArguments):
    """What fit was asked to do (its :class:`FitArguments`), with what it learned of the run.

    Attributes:
      rank, size: this process's rank and the number of processes (0 and 1 alone).
      num_batches: the batches of a pass, or None where the source cannot tell.
      hooks: the fit-level hook methods by name (see :func:`_fit_methods`).
      checkpoints: where this process writes checkpoints, or None (no
        ``checkpoint_dir``, or a rank other than 0).
      validation: what fit evaluates at the end of an epoch, and after which; or None.
    """

    rank: int
    size: int
    num_batches: int | None
    hooks: dict
    checkpoints: CheckpointDir | None
    validation: Validation | None


def _checked_source(source: BatchSource, arguments: FitArguments) -> BatchSource:
    """``source``, once it is known to give a batch in each of the epochs, and each epoch to end."""
    refuse_endless(source, arguments.steps_per_epoch)
    if source.one_shot and arguments.epochs > 1:
        raise ArgumentError(
            f"data is a one-shot iterator, which serves one epoch, but fit was asked for "
            f"epochs={arguments.epochs}; pass a list, or a callable that returns a new iterable "
            f"for every epoch")
    n, batch_size = source.n, arguments.batch_size  # n: None where the source cannot tell
    if n == 0 or (arguments.drop_remainder and n is not None and n < batch_size):
        raise ArgumentError(f"data holds {n} samples, so an epoch has no batch of "
                            f"batch_size {batch_size}{' (drop_remainder)' if n else ''}; "
                            f"fit needs at least one batch")
    return source


def resume(run: Run, latest, hooks: dict, state: FitState) -> None:
    """Restores the checkpoint ``latest`` into ``run`` and its fit state into ``state``; calls
    the hooks' ``on_resume``; warns (:class:`ResumeWarning`) where the model runs random ops
    whose state no checkpoint holds."""
    saved = run.restore(latest)
    if saved is not None:
        state.epoch, state.batch, state.samples, state.seed = (
            saved[k] for k in ("epoch", "batch", "samples", "seed"))
        state.data_pass = saved.get("pass", state.epoch)  # none in 0.1.0: a pass per epoch
        state.history = History.from_json(saved["history"])
    resumed = run.global_step()
    for on_resume in hooks["on_resume"]:
        on_resume(resumed)
    unsaved = [f"{op.api} ({op.tensor!r})" for op in run.random_ops() if not op.saved]
    if unsaved:
        warn(ResumeWarning(
            f"fit resumed from {latest}, but the model runs stateful random ops "
            f"({_few(unsaved)}) whose state lives in the {run.advice['target_name']}, which no "
            f"checkpoint holds: from here on they draw other numbers (dropout masks, noise) "
            f"than a run never stopped would, so this run will not end with its weights bit "
            f"for bit. {run.advice['exact_random']}"))


def _agreed(plan: FitPlan, state: FitState, samples) -> dict:
    """What every rank must run fit alike with (over MPI): its data's size, arguments, position."""
    return {"samples": samples, "batches per epoch": plan.num_batches,
            "batch_size": plan.batch_size, "micro-batches": str(plan.cut),
            "epochs": plan.epochs, "drop_remainder": plan.drop_remainder,
            "steps_per_epoch": plan.steps_per_epoch,
            "position (epoch, pass, batch, samples)": (state.epoch, state.data_pass, state.batch,
                                                       state.samples),
            "stopped": state.history.stopped is not None}


def checkpoint(run: Run, plan: FitPlan, state: FitState) -> int:
    """Writes a checkpoint of ``run`` at its global step, holding ``state``; returns the step."""
    global_step = run.global_step()
    saved = state.saved(plan.batch_size)
    with within_step():  # fit's own path: no argument of the caller's now
        plan.checkpoints.save(global_step, lambda path: run.save(path, saved))
    return global_step


def train_begin(hooks: dict, state: FitState) -> None:
    """Calls the hooks' ``on_train_begin``; one that returns an epoch has restored a backup
    taken at that epoch's start (the weights: what a checkpoint held from there on is undone),
    so ``state`` moves back to it."""
    for on_train_begin in hooks["on_train_begin"]:
        moved = on_train_begin()
        if moved is not None:
            state.epoch = state.data_pass = non_negative_int("the epoch on_train_begin returned",
                                                             moved)
            state.batch = state.samples = 0
            state.history.steps = [s for s in state.history.steps if s.epoch < state.epoch]
            state.history.epochs = [e for e in state.history.epochs if e["epoch"] < state.epoch]


def train_epoch(run: Run, source: BatchSource, plan: FitPlan, state: FitState,
                bar: Progress) -> bool:
    """Trains the epoch ``state.epoch``, then validates and logs it; returns whether training
    stops there (a callback asked to)."""
    hooks = plan.hooks
    run.reset_metrics()
    for on_epoch_begin in hooks["on_epoch_begin"]:
        on_epoch_begin(state.epoch)
    total = plan.steps_per_epoch if plan.steps_per_epoch is not None else plan.num_batches
    bar.start(f"epoch {state.epoch + 1}/{plan.epochs}", total)
    steps, pass_ended = _epoch_steps(run, source, plan, state, bar)
    # Over MPI every rank ends the epoch here, or all raise: none waits for another.
    run.gather(f"the end of epoch {state.epoch + 1} of fit", state.batch)
    if not steps:
        raise ArgumentError(
            f"epoch {state.epoch} trained no step: the data gave {state.batch} batches"
            f"{', every one shorter than batch_size and dropped (drop_remainder)' if state.batch else ''}"
            f"; fit needs at least one batch per epoch")
    logs = _epoch_logs(state.history, state.epoch)
    logs.update(run.metrics())
    if plan.validation is not None and plan.validation.due(state.epoch):
        logs.update({f"val_{k}": v for k, v in run.evaluate(plan.validation).items()})
    bar.close(logs)
    hold()  # the epoch's logs and the next position, together
    state.history.epochs.append(logs)
    state.epoch += 1
    if pass_ended:
        state.next_pass()
    release()
    for hook in hooks["on_epoch_end"]:
        hook(state.epoch - 1, logs)
    stop = run.stop_requested()
    if stop is not None:
        state.history.stopped = stop
    return stop is not None


def _epoch_steps(run: Run, source: BatchSource, plan: FitPlan, state: FitState, bar: Progress
                 ) -> tuple[int, bool]:
    """Steps through the epoch's batches: (the epoch's steps, whether its pass ended)."""
    done = [s for s in state.history.steps if s.epoch == state.epoch]  # resumed mid-epoch
    steps, loss = len(done), _RunningLoss(done)
    fresh = False  # whether this epoch began a pass (one that gives no batch ends the epoch)
    while plan.steps_per_epoch is None or steps < plan.steps_per_epoch:
        if state.batches is None:
            state.batches = iter(source.batches(state.data_pass, state.seed, state.batch,
                                                state.samples))
        item = next(state.batches, None)
        if item is None:  # the pass is over: the epoch ends, or starts the next pass
            state.batches = None
            if steps or fresh or plan.steps_per_epoch is None:
                return steps, True
            state.next_pass()
            fresh = True
            continue
        if not train_step(run, plan, state, bar, item, steps, loss):
            continue  # dropped (drop_remainder)
        steps += 1
        if run.stop_requested() is not None:
            break
    return steps, False


def train_step(run: Run, plan: FitPlan, state: FitState, bar: Progress, item: tuple,
               steps: int, loss: _RunningLoss) -> bool:
    """Trains one step on the batch ``item`` (feed, data rows), the epoch's ``steps``-th; counts
    it in ``state``, ``loss`` and the hooks. Returns False for a short batch dropped
    (drop_remainder) untrained."""
    hooks = plan.hooks
    feed, rows = item
    with _context(f"fit, epoch {state.epoch + 1}/{plan.epochs}, batch {state.batch + 1}"
                  f"{'' if plan.num_batches is None else f'/{plan.num_batches}'}, "
                  f"global step {state.global_step}"):
        feed = as_arrays(feed, "the batch")  # once, not in each micro-batch cut from it
        n = feed_size(feed, "the batch", plan.blocks)
        if plan.drop_remainder and n < plan.batch_size:
            state.batch, state.samples = state.batch + 1, state.samples + n
            return False
        for on_batch_begin in hooks["on_batch_begin"]:
            on_batch_begin(steps)
        try:
            result = run.step(*_micro_batches(feed, n, plan.cut, plan.rank, plan.size,
                                              plan.blocks, rows))
        except Exception as error:
            if getattr(error, "applied", None) is not None:  # an on_applied hook raised
                _count(state, n, error.applied)  # so that a checkpoint holds the step whole
            raise
    log = _count(state, n, result)
    _refuse_empty_steps(state.history.steps, result)
    bar.update(result)
    if (plan.checkpoints is not None and plan.checkpoint_every
            and result.step % plan.checkpoint_every == 0):
        state.saved_step = checkpoint(run, plan, state)
    for hook in hooks["on_step_end"]:
        hook(result.step, result)
    loss.add(log)
    if hooks["on_batch_end"]:  # the running logs cost metric reads: only if wanted
        logs = {"loss": loss.mean(), **run.metrics()}
        for on_batch_end in hooks["on_batch_end"]:
            on_batch_end(steps, logs)
    return True


def _count(state: FitState, n: int, result):
    """Counts the step ``result`` of a batch of ``n`` samples, applied, in ``state``: its
    position, global step and History; returns its History log."""
    state.batch, state.samples = state.batch + 1, state.samples + n
    state.global_step = result.step
    log = state.history.add(state.epoch, result)
    release()
    return log


def _abandon(run: Run, plan: FitPlan, state: FitState, bar: Progress,
             error: BaseException) -> None:
    """fit ends with ``error``: hands it the history, checkpoints the last completed step (a
    step is atomic), closes the hooks and tells ``run``."""
    with contextlib.suppress(AttributeError):  # an exception type with __slots__
        error.history = state.history  # the loss curve up to the failure, to see what led to it
    bar.close(None)
    try:
        if plan.checkpoints is not None and run.global_step() != state.saved_step:
            checkpoint(run, plan, state)
    finally:
        _close(plan.hooks)
    run.abandon(error)  # over MPI, a rank leaving alone ends the job


def _refuse_empty_steps(steps: list, result) -> None:
    """Raises HostavgError once every micro-batch of the last :data:`EMPTY_STEPS` steps was
    dropped, naming their culprit rows (``.culprit_rows``) and the last reason."""
    last = steps[-EMPTY_STEPS:]
    if len(last) < EMPTY_STEPS or any(s.size for s in last):
        return
    rows = sorted({r for s in last for r in s.nonfinite_rows})
    error = StepError(
        f"every micro-batch of the last {EMPTY_STEPS} steps was dropped, so nothing was trained "
        f"since global step {result.step}: "
        + (f"the data rows {rows[:20]}{' ...' if len(rows) > 20 else ''} made them non-finite "
           f"(the exception's .culprit_rows holds all); remove them from the data"
           if rows else f"no one data row is to blame; the last reason: "
                        f"{result.micro[-1].dropped}"))
    error.culprit_rows = rows
    raise error


class _RunningLoss:
    """The epoch's loss so far: the sample-weighted mean over its steps that count (see
    :func:`_counts`), as ``on_batch_end``'s logs show it."""

    def __init__(self, done: list):
        self.total = math.fsum(s.loss * s.size for s in done if _counts(s))
        self.samples = sum(s.size for s in done if _counts(s))

    def add(self, log) -> None:
        if _counts(log):
            self.total, self.samples = self.total + log.loss * log.size, self.samples + log.size

    def mean(self) -> float:
        return self.total / self.samples if self.samples else math.nan


def _counts(log) -> bool:
    """Whether a step's loss counts in its epoch's running mean: it had samples (not every
    micro-batch dropped). A step the optimizer skipped counts, non-finite or not, as in
    Keras's fit, whose loss tracker sees every batch."""
    return bool(log.size)


class ResumeWarning(UserWarning):
    """fit resumed a model whose random state no checkpoint holds: it will not end bit for bit
    like a run never stopped."""


def _few(items: list, shown: int = 3) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more"
                                       if len(items) > shown else "")


def _close(hooks: dict) -> None:
    """Closes every hook that can be (TensorBoard flushes its file, Record drops a step never applied)."""
    for close in hooks["close"]:
        close()


class _context:
    """Within the block, an exception is said to have happened at ``where``.

    A HostavgError's message starts with ``where``; any other exception gets
    a note.
    """

    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, HostavgError):
            error.args = (f"{self.where}: {error.args[0] if error.args else ''}", *error.args[1:])
        elif isinstance(error, Exception):
            error.add_note(f"hostavg: in {self.where}")
        return False


def _fit_methods(hooks) -> dict:
    """The fit-level methods of the trainer's hooks and fit's callbacks, looked up once:
    name -> bound methods, the trainer's first. Warns of each deprecated ``on_step_end``."""
    for hook in hooks:
        if callable(getattr(hook, "on_step_end", None)):
            warn(DeprecationWarning(
                f"{name_of(hook)}.on_step_end(step, result) is deprecated; define "
                f"on_applied(result) instead (result.step is the global step), or "
                f"on_batch_end(batch, logs) to run once the step is checkpointed"))
    return {n: [getattr(h, n) for h in hooks if callable(getattr(h, n, None))] for n in FIT_METHODS}


def _micro_batches(batch, n: int, cut: Cut, rank: int, size: int,
                   blocks: dict | None, rows) -> tuple[list, list, list | None]:
    """This rank's micro-batches of a batch of ``n`` samples (its contiguous share, cut up),
    their sizes, and their data rows (None where the source can't tell)."""
    lo, hi = n * rank // size, n * (rank + 1) // size
    if lo == hi:
        return [], [], None if rows is None else []
    share = batch if size == 1 else take(batch, slice(lo, hi), n, blocks)
    sizes = cut.sizes(hi - lo)
    ends = list(itertools.accumulate(sizes))
    micro_rows = None if rows is None else [rows[lo + end - b:lo + end]
                                            for end, b in zip(ends, sizes)]
    return pieces(share, sizes, hi - lo, blocks), sizes, micro_rows


def check_sizes(batch_size, cut: Cut, epochs=1, checkpoint_every=None) -> None:
    """Raises HostavgError unless the sizes make sense together (``batch_size`` None: the data
    gives its own batches)."""
    if batch_size is not None:
        positive_int("batch_size", batch_size)
    positive_int("epochs", epochs)
    if checkpoint_every is not None:
        positive_int("checkpoint_every", checkpoint_every)
    if batch_size is not None and cut.size is not None and cut.size > batch_size:
        raise ArgumentError(
            f"micro_batch_size ({cut.size}) is larger than batch_size ({batch_size}); "
            f"a batch is cut into micro-batches, so use micro_batch_size <= batch_size")
    if batch_size is not None and cut.count is not None and cut.count > batch_size:
        raise ArgumentError(
            f"micro_batches ({cut.count}) is more than batch_size ({batch_size}); a batch is cut "
            f"into micro-batches of at least one sample, so use micro_batches <= batch_size")


def _epoch_logs(history: History, epoch: int) -> dict:
    """The epoch's bookkeeping and its loss: the sample-weighted mean over its steps (see
    :func:`_counts`)."""
    steps = [s for s in history.steps if s.epoch == epoch]
    samples = sum(s.size for s in steps)
    counted = sum(s.size for s in steps if _counts(s))
    loss = sum(s.loss * s.size for s in steps if _counts(s)) / counted if counted else math.nan
    return {"epoch": epoch, "loss": loss, "samples": samples, "steps": len(steps)}
