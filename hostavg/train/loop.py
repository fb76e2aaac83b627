"""The training loop behind ``Trainer.fit``: batches, micro-batches, epochs, checkpoints.

The loop knows no framework: it drives a :class:`Run` (a trainer bound to a
TF1 session, or a Keras trainer) over a source of batches
(:class:`ArraySource`, :class:`IterableSource`, or a face's own). :func:`fit`
checks its arguments, then runs named pieces around a :class:`FitState` (the
position in the data, the History, the steps saved) and a :class:`FitPlan`
(what it was asked to do): :func:`resume`, :func:`train_begin`,
:func:`train_epoch`, :func:`train_step` and :func:`checkpoint`.

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
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hostavg.train.callbacks import StopTraining
from hostavg.train.checkpoint import CheckpointDir
from hostavg.core.check import RandomOp
from hostavg.core.errors import HostavgError, flag, non_negative_int, object_list, positive_int
from hostavg.core.results import FIT_METHODS, HOOK_METHODS
from hostavg.train.history import BOOKKEEPING, History
from hostavg.core.results import StepResult
from hostavg.engine.hooks import name_of
from hostavg.engine.signals import hold, region, release
from hostavg.core.split import Cut, feed_size, split, take

__all__ = ["ArraySource", "FitPlan", "FitState", "IterableSource", "PROGRESS_MODES", "ResumeWarning",
           "Run", "check_sizes", "checkpoint", "fit", "refuse_endless", "resume", "train_begin",
           "train_epoch", "train_step"]


class Run(Protocol):
    """What fit needs of a trainer bound to where its values live (a TF1 session, a Keras model)."""

    #: The trainer's MPI communicator, or None.
    comm: Any
    #: The trainer's hooks (fit calls their fit-level methods too).
    hooks: tuple

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

    def validate(self, epoch: int) -> dict:
        """The validation results by name ("loss", metrics) at the end of ``epoch`` (from 0), or
        {} without validation data (or none due then)."""

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

#: What fit shows while it trains: True: a progress bar on a terminal or in Jupyter, nothing
#: elsewhere; "always": a bar anywhere; "epoch": one line per epoch on stdout; "auto": a bar
#: on a terminal or in Jupyter, one line per epoch elsewhere; False: nothing.
PROGRESS_MODES = (True, False, "always", "epoch", "auto")


def fit(run: Run, source, *, batch_size, cut: Cut, epochs=1, seed=None,
        drop_remainder=False, callbacks=(), progress=True, checkpoint_dir=None,
        checkpoint_every=None, keep_checkpoints=3, blocks=None, initial_epoch=0,
        steps_per_epoch=None) -> History:
    """Trains ``run`` over the batches of ``source``; see :meth:`hostavg.Trainer.fit`.

    ``source`` is a callable that returns the batch source (called after
    the arguments are checked), with ``n`` (its samples, None where unknown or
    where it gives its own batches), ``one_shot`` (it serves one pass only),
    ``endless`` (its passes are known never to end), ``num_batches(drop_remainder)``
    and ``batches(data_pass, seed, batch, samples)``. ``batch_size`` is None for a
    source that gives its own batches; ``cut`` cuts each batch into micro-batches.
    ``blocks``: {key: b} for arrays of b blocks of the samples (see
    :mod:`hostavg.core.split`).

    Epochs: fit trains epochs ``initial_epoch`` to ``epochs - 1`` (as Keras
    counts them). An epoch is one pass over the data, or, with
    ``steps_per_epoch``, that many steps, continuing the pass where the
    previous epoch stopped: an epoch then ends early where the pass ends, and
    the next starts a new pass. The data's order depends on (seed, pass).

    Every argument is checked before anything trains: a seed that is no
    integer >= 0, flags that are not bools, ``checkpoint_every`` without
    ``checkpoint_dir``, a one-shot iterator for more than one epoch, an endless
    source without ``steps_per_epoch``.
    """
    check_sizes(batch_size, cut, epochs, checkpoint_every)
    drop_remainder, seed, initial_epoch, steps_per_epoch = _checked_arguments(
        progress, drop_remainder, seed, initial_epoch, steps_per_epoch, checkpoint_every,
        checkpoint_dir)
    source = _checked_source(source(), epochs, batch_size, drop_remainder, steps_per_epoch)
    callbacks = object_list("callbacks", callbacks, HOOK_METHODS, "hostavg.EarlyStopping()")
    hooks = _fit_methods(run.hooks + callbacks)
    checkpoints = CheckpointDir(checkpoint_dir, keep_checkpoints) \
        if checkpoint_dir is not None else None
    state = FitState(epoch=initial_epoch, data_pass=initial_epoch, seed=seed)
    latest = None if checkpoints is None else checkpoints.latest()
    if latest is not None:
        resume(run, latest, hooks, state)
    rank, size = (run.comm.Get_rank(), run.comm.Get_size()) if run.comm is not None else (0, 1)
    plan = FitPlan(
        batch_size=batch_size, cut=cut, epochs=epochs,
        drop_remainder=drop_remainder, steps_per_epoch=steps_per_epoch,
        checkpoint_every=checkpoint_every, blocks=blocks, rank=rank, size=size,
        num_batches=source.num_batches(drop_remainder), hooks=hooks,
        # rank 0 writes the checkpoints; every rank reads them when resuming
        checkpoints=checkpoints if rank == 0 else None)
    state.seed = _shared_seed(run, plan, state, source.n)
    if state.history.stopped is not None or state.epoch >= epochs:
        return state.history
    state.global_step = run.global_step()
    if plan.checkpoints is not None:  # a folder without a checkpoint gets the start, seed and
        # all: a run killed before its first checkpoint then resumes as itself, as one killed later
        state.saved_step = state.global_step if latest is not None else checkpoint(run, plan, state)
    bar = _Progress(progress if rank == 0 else False)
    # A signal that arrives from a step's apply on waits until the step is counted (release).
    with _sigterm_as_exit(), region(), run.hooked(callbacks):
        try:
            train_begin(hooks, state)
            while state.epoch < epochs:
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
class FitPlan:
    """What fit was asked to do, fixed once its arguments are checked.

    Attributes:
      batch_size, epochs, drop_remainder, steps_per_epoch, checkpoint_every,
        blocks: fit's arguments, checked.
      cut: how each batch is cut into micro-batches (fit's or the trainer's
        ``micro_batch_size``, or the trainer's ``micro_batches``).
      rank, size: this process's rank and the number of processes (0 and 1 alone).
      num_batches: the batches of a pass, or None where the source cannot tell.
      hooks: the fit-level hook methods by name (see :func:`_fit_methods`).
      checkpoints: where this process writes checkpoints, or None (no
        ``checkpoint_dir``, or a rank other than 0).
    """

    batch_size: int | None
    cut: Cut
    epochs: int
    drop_remainder: bool
    steps_per_epoch: int | None
    checkpoint_every: int | None
    blocks: dict | None
    rank: int
    size: int
    num_batches: int | None
    hooks: dict
    checkpoints: CheckpointDir | None


def _checked_arguments(progress, drop_remainder, seed, initial_epoch, steps_per_epoch,
                       checkpoint_every, checkpoint_dir) -> tuple:
    """fit's flags and counts, checked: (drop_remainder, seed, initial_epoch, steps_per_epoch)."""
    if not (isinstance(progress, (bool, np.bool_)) or (isinstance(progress, str)
                                                        and progress in PROGRESS_MODES)):
        raise HostavgError(f"progress must be True, False, 'always', 'epoch' or 'auto', "
                           f"got {progress!r}")
    drop_remainder = flag("drop_remainder", drop_remainder)
    seed = None if seed is None else non_negative_int("seed", seed)
    initial_epoch = non_negative_int("initial_epoch", initial_epoch)
    if steps_per_epoch is not None:
        steps_per_epoch = positive_int("steps_per_epoch", steps_per_epoch)
    if checkpoint_every is not None and checkpoint_dir is None:
        raise HostavgError(f"checkpoint_every={checkpoint_every} needs checkpoint_dir, the folder "
                           f"to write the checkpoints to")
    return drop_remainder, seed, initial_epoch, steps_per_epoch


def _checked_source(source, epochs: int, batch_size, drop_remainder: bool, steps_per_epoch):
    """``source``, once it is known to give a batch in each of ``epochs`` epochs, and each
    epoch to end."""
    refuse_endless(source, steps_per_epoch)
    if source.one_shot and epochs > 1:
        raise HostavgError(
            f"data is a one-shot iterator, which serves one epoch, but fit was asked for "
            f"epochs={epochs}; pass a list, or a callable that returns a new iterable for every "
            f"epoch")
    n = source.n  # None where the source cannot tell (an iterable of batches)
    if n == 0 or (drop_remainder and n is not None and n < batch_size):
        raise HostavgError(f"data holds {n} samples, so an epoch has no batch of "
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
        state.data_pass = saved.get("pass", state.epoch)  # earlier versions: one pass per epoch
        state.history = History.from_json(saved["history"])
    resumed = run.global_step()
    for on_resume in hooks["on_resume"]:
        on_resume(resumed)
    unsaved = [f"{op.api} ({op.tensor!r})" for op in run.random_ops() if not op.saved]
    if unsaved:
        warnings.warn(
            f"fit resumed from {latest}, but the model runs stateful random ops "
            f"({_few(unsaved)}) whose state lives in the session, which no "
            f"checkpoint holds: from here on they draw other numbers (dropout masks, noise) "
            f"than a run never stopped would, so this run will not end with its weights bit "
            f"for bit. Stateless random ops (tf.random.stateless_*) seeded by the global step "
            f"resume exactly", ResumeWarning, stacklevel=5)  # the face's fit's caller


def _shared_seed(run: Run, plan: FitPlan, state: FitState, samples) -> int:
    """The seed of the data's order: ``state.seed``, else a fresh one; over MPI rank 0's, once
    every rank is known to run fit alike (else a HostavgError on every rank, before any rank
    trains or returns: no rank may wait for another)."""
    seed = state.seed if state.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
    if run.comm is None:
        return seed
    return _rank_0_seed_once_ranks_match(run, seed, {
        "samples": samples, "batches per epoch": plan.num_batches,
        "batch_size": plan.batch_size, "micro-batches": str(plan.cut),
        "epochs": plan.epochs, "drop_remainder": plan.drop_remainder,
        "steps_per_epoch": plan.steps_per_epoch,
        "position (epoch, pass, batch, samples)": (state.epoch, state.data_pass, state.batch,
                                                   state.samples),
        "stopped": state.history.stopped is not None})


def checkpoint(run: Run, plan: FitPlan, state: FitState) -> int:
    """Writes a checkpoint of ``run`` at its global step, holding ``state``; returns the step."""
    global_step = run.global_step()
    saved = state.saved(plan.batch_size)
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


def train_epoch(run: Run, source, plan: FitPlan, state: FitState, bar: _Progress) -> bool:
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
        raise HostavgError(
            f"epoch {state.epoch} trained no step: the data gave {state.batch} batches"
            f"{', every one shorter than batch_size and dropped (drop_remainder)' if state.batch else ''}"
            f"; fit needs at least one batch per epoch")
    logs = _epoch_logs(state.history, state.epoch)
    logs.update(run.metrics())
    logs.update({f"val_{k}": v for k, v in run.validate(state.epoch).items()})
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


def _epoch_steps(run: Run, source, plan: FitPlan, state: FitState, bar: _Progress
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


def train_step(run: Run, plan: FitPlan, state: FitState, bar: _Progress, item: tuple,
               steps: int, loss: _RunningLoss) -> bool:
    """Trains one step on the batch ``item`` (feed, data rows), the epoch's ``steps``-th; counts
    it in ``state``, ``loss`` and the hooks. Returns False for a short batch dropped
    (drop_remainder) untrained."""
    hooks = plan.hooks
    feed, rows = item
    with _context(f"fit, epoch {state.epoch + 1}/{plan.epochs}, batch {state.batch + 1}"
                  f"{'' if plan.num_batches is None else f'/{plan.num_batches}'}, "
                  f"global step {state.global_step}"):
        n = feed_size(feed, "the batch", plan.blocks)
        if plan.drop_remainder and n < plan.batch_size:
            state.batch, state.samples = state.batch + 1, state.samples + n
            return False
        for on_batch_begin in hooks["on_batch_begin"]:
            on_batch_begin(steps)
        result = run.step(*_micro_batches(feed, n, plan.cut, plan.rank, plan.size, plan.blocks,
                                          rows))
    state.batch, state.samples = state.batch + 1, state.samples + n
    state.global_step = result.step
    log = state.history.add(state.epoch, result)
    release()
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


def _abandon(run: Run, plan: FitPlan, state: FitState, bar: _Progress,
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
    error = HostavgError(
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


def _rank_0_seed_once_ranks_match(run: Run, seed: int, settings: dict) -> int:
    """Rank 0's ``seed``, once every rank's fit ``settings`` (its data's size, arguments and
    position) are the same; else a HostavgError on every rank, before anything trains."""
    everyone = run.gather("the start of fit", (seed, settings))
    differ = [f"{key} " + ", ".join(f"{s[key]!r} on rank {r}" for r, (_, s) in enumerate(everyone))
              for key in settings if len({repr(s[key]) for _, s in everyone}) > 1]
    if differ:
        raise HostavgError(
            f"the ranks run fit with different data or arguments, so nothing was trained on any: "
            f"{'; '.join(differ)}. fit splits each batch between the ranks: give every rank the "
            f"same data, arguments and checkpoint_dir")
    return everyone[0][0]


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
            warnings.warn(f"{name_of(hook)}.on_step_end(step, result) is deprecated; define "
                          f"on_applied(result) instead (result.step is the global step), or "
                          f"on_batch_end(batch, logs) to run once the step is checkpointed",
                          DeprecationWarning, stacklevel=5)  # the face's fit's caller
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
    return split(share, cut.size, micro_batches=cut.count, blocks=blocks), sizes, micro_rows


def check_sizes(batch_size, cut: Cut, epochs=1, checkpoint_every=None) -> None:
    """Raises HostavgError unless the sizes make sense together (``batch_size`` None: the data
    gives its own batches)."""
    if batch_size is not None:
        positive_int("batch_size", batch_size)
    positive_int("epochs", epochs)
    if checkpoint_every is not None:
        positive_int("checkpoint_every", checkpoint_every)
    if batch_size is not None and cut.size is not None and cut.size > batch_size:
        raise HostavgError(
            f"micro_batch_size ({cut.size}) is larger than batch_size ({batch_size}); "
            f"a batch is cut into micro-batches, so use micro_batch_size <= batch_size")
    if batch_size is not None and cut.count is not None and cut.count > batch_size:
        raise HostavgError(
            f"micro_batches ({cut.count}) is more than batch_size ({batch_size}); a batch is cut "
            f"into micro-batches of at least one sample, so use micro_batches <= batch_size")


def refuse_endless(source, steps_per_epoch) -> None:
    """Raises HostavgError for a source known never to end (a dataset's ``.repeat()``) without
    ``steps_per_epoch``: its first epoch would never end."""
    if source.endless and steps_per_epoch is None:
        raise HostavgError(
            "the data never ends (a dataset of infinite cardinality: .repeat() without a "
            "count), so without steps_per_epoch the first epoch would never end; pass "
            "steps_per_epoch=, the number of steps (batches) per epoch")


def _epoch_logs(history: History, epoch: int) -> dict:
    """The epoch's bookkeeping and its loss: the sample-weighted mean over its steps (see
    :func:`_counts`)."""
    steps = [s for s in history.steps if s.epoch == epoch]
    samples = sum(s.size for s in steps)
    counted = sum(s.size for s in steps if _counts(s))
    loss = sum(s.loss * s.size for s in steps if _counts(s)) / counted if counted else math.nan
    return {"epoch": epoch, "loss": loss, "samples": samples, "steps": len(steps)}


class ArraySource:
    """A batch of arrays (a feed dict, or a tuple (x, y)) cut into batches by (shuffled) index.

    The order depends only on (seed, epoch).
    """

    one_shot = endless = False

    def __init__(self, data, batch_size, shuffle, blocks=None):
        self.shuffle = flag("shuffle", shuffle)
        self.data = data
        self.n = feed_size(data, "data", blocks)
        self.batch_size, self.blocks = batch_size, blocks

    def num_batches(self, drop_remainder):
        return self.n // self.batch_size if drop_remainder else -(-self.n // self.batch_size)

    def batches(self, epoch, seed, batch, samples):
        """(batch, data rows) of the epoch's batches from sample ``samples`` of its order on
        (``batch`` is unused)."""
        order = np.random.default_rng([seed, epoch]).permutation(self.n) if self.shuffle \
            else np.arange(self.n)
        for start in range(samples, self.n, self.batch_size):
            rows = order[start:start + self.batch_size]
            yield take(self.data, rows if self.shuffle else slice(start, start + self.batch_size),
                       self.n, self.blocks), rows


class IterableSource:
    """The batches of an iterable (or of a callable returning one per epoch), each made ready by
    ``conform(batch, what)``; its rows are the iterable's own, so fit can't tell them."""

    n = None  # how many samples its batches hold is unknown until read
    endless = False  # an iterable may never end, but nothing tells beforehand

    def __init__(self, data, conform):
        self.data, self.conform = data, conform

    @property
    def one_shot(self) -> bool:
        """Whether ``data`` is an iterator (a generator), which serves one epoch only."""
        return not callable(self.data) and iter(self.data) is self.data

    def num_batches(self, drop_remainder):
        return len(self.data) if hasattr(self.data, "__len__") else None

    def batches(self, epoch, seed, batch, samples):
        """The epoch's batches from batch ``batch`` on: the iterable's own, so samples are not counted."""
        it = iter(self.data() if callable(self.data) else self.data)
        for i, feed in enumerate(it):
            if i >= batch:  # which rows of the user's data a batch holds, fit can't tell
                yield self.conform(feed, f"batch {i} of epoch {epoch}"), None


class _Progress:
    """What fit shows of each epoch (see :data:`PROGRESS_MODES`).

    A bar: on a terminal, a tqdm bar on stderr, with the step's loss and
    samples/s; in Jupyter, one line of text, updated in place at most every
    half second, so a saved notebook keeps one final line per epoch. Either
    ends on the epoch's results. A line per epoch: printed on stdout when the
    epoch ends, with its steps, time and results.
    """

    def __init__(self, progress):
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        self.jupyter = "ipykernel" in sys.modules and not tty
        interactive = tty or self.jupyter
        self.enabled = progress == "always" or (progress in (True, "auto") and interactive)
        self.lines = progress == "epoch" or (progress == "auto" and not interactive)
        self._bar = self._line = None
        self._started = None

    def start(self, desc, total):
        if self.lines:
            self._desc, self._started, self._n = desc, time.perf_counter(), 0
        if not self.enabled:
            return
        self._t0, self._samples, self._postfix = time.perf_counter(), 0, {}
        if self.jupyter:
            from IPython.display import display
            self._desc, self._total, self._n, self._shown = desc, total, 0, 0.0
            self._line = display({"text/plain": self._text()}, raw=True, display_id=True)
        else:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit="step", leave=True)

    def update(self, result):
        if self.lines:
            self._n += 1
        if not self.enabled or (self._bar is None and self._line is None):
            return
        self._samples += result.size
        rate = self._samples / max(time.perf_counter() - self._t0, 1e-9)
        self._postfix = {"loss": "skipped" if result.skipped else f"{result.loss:.4f}",
                         "samples/s": f"{rate:.0f}"}
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(1)
        else:
            self._n += 1
            if time.perf_counter() - self._shown > 0.5:
                self._line.update({"text/plain": self._text()}, raw=True)

    def close(self, logs):
        if logs:
            self._postfix = {k: f"{v:.4g}" if isinstance(v, float) else v
                             for k, v in logs.items() if k != "epoch"}
            if self.lines and self._started is not None:
                shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in logs.items() if k not in BOOKKEEPING)
                print(f"{self._desc}: {self._n} steps in "
                      f"{time.perf_counter() - self._started:.1f} s, {shown}", flush=True)
        self._started = None
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.close()
        elif self._line is not None:
            self._line.update({"text/plain": self._text()}, raw=True)
        self._bar = self._line = None

    def _text(self) -> str:
        from tqdm import tqdm
        self._shown = time.perf_counter()
        postfix = ", ".join(f"{k}={v}" for k, v in self._postfix.items())
        return tqdm.format_meter(self._n, self._total, self._shown - self._t0, prefix=self._desc,
                                 unit="step", postfix=postfix or None, ncols=120)


class _sigterm_as_exit:
    """Within the block, SIGTERM raises SystemExit(143) so fit can checkpoint and unwind."""

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        return False
