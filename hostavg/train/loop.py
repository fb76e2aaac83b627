"""The training loop behind ``Trainer.fit``: batches, micro-batches, epochs, checkpoints.

The loop knows no framework: it drives a :class:`Run` (a trainer bound to a
TF1 session, or a Keras trainer) over a source of batches. A Keras trainer's
data is arrays ``(x, y)`` or ``(x, y, sample_weight)``, cut by
:class:`ArraySource`. For the TF1 trainer, three kinds of ``data`` exist:

* a Mapping ``{placeholder: array}``, every array of one length N: each epoch
  is cut into batches of ``batch_size`` samples (shuffled with ``seed`` when
  ``shuffle``), each batch into micro-batches of ``micro_batch_size``;
* an iterable of batches, each a feed dict (a list, or a callable that returns
  a fresh iterable each epoch; a one-shot generator serves one epoch only);
  ``shuffle`` does not apply, the order is the iterable's;
* a ``tf.data.Dataset`` of single samples made in eager mode (outside
  ``graph.as_default()``), with ``inputs=`` mapping each element's keys (for
  dict elements) or positions (for tuples) to placeholders; fit shuffles it
  with ``seed`` and batches it.

Every batch is weighted by its real number of samples, a short last batch too.
Data that gives no batch (no samples, or only batches that ``drop_remainder``
drops) is refused: an epoch must train at least one step.

fit's position is the epoch and, within it, the samples (and batches) taken
from the data so far. A checkpoint stores it with the seed and the batch size;
a resumed run continues at that sample of the same epoch's order, with the
same batch size bit for bit like a run that was never stopped, with another
at the same sample all the same (an iterable's batches are its own: it
continues at the next of them). A step and its bookkeeping are one: a Ctrl-C
or SIGTERM that arrives once the step's apply has begun waits until fit has
counted the step (see :mod:`hostavg.engine.signals`), so the position saved on the way
out always matches the global step. A checkpoint folder that holds no
checkpoint gets one of the start (weights, seed, position) before the first
step, so a run killed before its first checkpoint resumes as itself too (and
a :class:`~hostavg.hooks.Record` continues its record).

Which programs resume bit for bit: those whose random state is in their
variables or their seed. Stateful random ops of a TF1 graph
(``tf.nn.dropout``'s RandomUniform, noise, candidate samplers) keep their
state in the session's kernels, which no checkpoint can hold: a resumed run
draws other numbers from them than an uninterrupted one, and fit warns
(:class:`ResumeWarning`) when it resumes such a model
(:attr:`hostavg.core.check.RandomOp.saved`). Keras 3 keeps its random state
in variables (SeedGenerator), which checkpoints hold, as does
``tf.random.Generator``.

With a trainer made with ``comm=`` (several MPI processes), every rank runs
fit on the same data: each batch is split into contiguous shares, one per
rank, so each sample is seen once per epoch overall and one step averages
over the whole batch. The seed is rank 0's; only rank 0 shows progress and
writes checkpoints, and every rank resumes from them (the checkpoint folder
must be one that every rank reads, such as a shared file system).
Validation runs on every rank over all of the validation data. No rank waits
for another forever: before training the ranks compare their data's size,
arguments and position, and at every epoch's end they meet; a rank that
differs (data of another size, an iterable with fewer batches, a checkpoint
another rank does not see) makes every rank raise the same HostavgError.
"""

from __future__ import annotations

import contextlib
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
from hostavg.core.split import feed_size, split, take

__all__ = ["ArraySource", "IterableSource", "PROGRESS_MODES", "ResumeWarning", "Run", "check_sizes",
           "fit"]


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


#: What fit shows while it trains: True: a progress bar on a terminal or in Jupyter, nothing
#: elsewhere; "always": a bar anywhere; "epoch": one line per epoch on stdout; "auto": a bar
#: on a terminal or in Jupyter, one line per epoch elsewhere; False: nothing.
PROGRESS_MODES = (True, False, "always", "epoch", "auto")


def fit(run: Run, source, *, batch_size, micro_batch_size, epochs=1, seed=None,
        drop_remainder=False, callbacks=(), progress=True, checkpoint_dir=None,
        checkpoint_every=None, keep_checkpoints=3, blocks=None, initial_epoch=0,
        steps_per_epoch=None) -> History:
    """Trains ``run`` over the batches of ``source``; see :meth:`hostavg.Trainer.fit`.

    ``source`` is a callable that returns the batch source (called after
    the arguments are checked), with ``n`` (its samples, None where unknown or
    where it gives its own batches), ``one_shot`` (it serves one pass only),
    ``num_batches(drop_remainder)`` and ``batches(data_pass, seed, batch,
    samples)``. ``batch_size`` is None for a source that gives its own batches.
    ``blocks``: {key: b} for arrays of b blocks of the samples (see
    :mod:`hostavg.core.split`).

    Epochs: fit trains epochs ``initial_epoch`` to ``epochs - 1`` (as Keras
    counts them). An epoch is one pass over the data, or, with
    ``steps_per_epoch``, that many steps, continuing the pass where the
    previous epoch stopped: an epoch then ends early where the pass ends, and
    the next starts a new pass. The data's order depends on (seed, pass).

    Every argument is checked before anything trains: a seed that is no
    integer >= 0, flags that are not bools, ``checkpoint_every`` without
    ``checkpoint_dir``, a one-shot iterator for more than one epoch.
    """
    check_sizes(batch_size, micro_batch_size, epochs, checkpoint_every)
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
    source = source()
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
    callbacks = object_list("callbacks", callbacks, HOOK_METHODS, "hostavg.EarlyStopping()")
    hooks = _fit_methods(run.hooks + callbacks)
    ckpt = CheckpointDir(checkpoint_dir, keep_checkpoints) if checkpoint_dir is not None else None

    history, epoch, batch, samples = History(), initial_epoch, 0, 0
    data_pass = epoch  # passes over the data begun; the same as epochs without steps_per_epoch
    latest = None if ckpt is None else ckpt.latest()
    if latest is not None:
        state = run.restore(latest)
        if state is not None:
            epoch, batch, samples, seed = (state[k] for k in ("epoch", "batch", "samples", "seed"))
            data_pass = state.get("pass", epoch)  # checkpoints of earlier versions: one per epoch
            history = History.from_json(state["history"])
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
                f"resume exactly", ResumeWarning, stacklevel=4)  # the face's fit's caller
    comm = run.comm
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**63)
    if comm is not None:  # before any rank trains, or returns: no rank may wait for another
        seed = _agree(run, seed, {
            "samples": n, "batches per epoch": source.num_batches(drop_remainder),
            "batch_size": batch_size, "micro_batch_size": micro_batch_size, "epochs": epochs,
            "drop_remainder": drop_remainder, "steps_per_epoch": steps_per_epoch,
            "position (epoch, pass, batch, samples)": (epoch, data_pass, batch, samples),
            "stopped": history.stopped is not None})
    if rank != 0:
        ckpt = None  # rank 0 writes the checkpoints; every rank reads them when resuming
    if history.stopped is not None or epoch >= epochs:
        return history

    def checkpoint():
        step = run.global_step()
        state = {"epoch": epoch, "batch": batch, "samples": samples, "pass": data_pass,
                 "batch_size": batch_size, "seed": seed, "history": history.to_json()}
        ckpt.save(step, lambda path: run.save(path, state))
        return step

    global_step = run.global_step()
    saved_step = None
    if ckpt is not None:  # a folder without a checkpoint gets the start, seed and all: a run
        # killed before its first checkpoint then resumes as itself, as a run killed later does
        saved_step = global_step if latest is not None else checkpoint()
    num_batches = source.num_batches(drop_remainder)
    total = steps_per_epoch if steps_per_epoch is not None else num_batches
    bar = _Progress(progress if rank == 0 else False)
    batch_logs = bool(hooks["on_batch_end"])  # the running logs cost metric reads: only if wanted
    # A signal that arrives from a step's apply on waits until the step is counted (release).
    with _sigterm_as_exit(), region(), run.hooked(callbacks):
        try:
            for on_train_begin in hooks["on_train_begin"]:
                moved = on_train_begin()
                if moved is not None:  # a hook restored a backup taken at the start of that epoch
                    epoch = data_pass = non_negative_int("the epoch on_train_begin returned", moved)
                    batch = samples = 0  # and the weights: what a checkpoint held from there on
                    history.steps = [s for s in history.steps if s.epoch < epoch]  # is undone
                    history.epochs = [e for e in history.epochs if e["epoch"] < epoch]
            passes = None  # the batches of the pass under way, continued from epoch to epoch
            while epoch < epochs:
                run.reset_metrics()
                for on_epoch_begin in hooks["on_epoch_begin"]:
                    on_epoch_begin(epoch)
                bar.start(f"epoch {epoch + 1}/{epochs}", total)
                done = [s for s in history.steps if s.epoch == epoch]  # resumed mid-epoch
                steps = len(done)
                loss_sum = math.fsum(s.loss * s.size for s in done if _counts(s))
                loss_n = sum(s.size for s in done if _counts(s))
                pass_ended = fresh = False
                while steps_per_epoch is None or steps < steps_per_epoch:
                    if passes is None:
                        passes = iter(source.batches(data_pass, seed, batch, samples))
                    item = next(passes, None)
                    if item is None:  # the pass is over: the epoch ends, or starts the next pass
                        passes = None
                        if steps or fresh or steps_per_epoch is None:
                            pass_ended = True
                            break
                        data_pass, batch, samples, fresh = data_pass + 1, 0, 0, True
                        continue
                    feed, rows = item
                    with _context(f"fit, epoch {epoch + 1}/{epochs}, batch {batch + 1}"
                                  f"{'' if num_batches is None else f'/{num_batches}'}, "
                                  f"global step {global_step}"):
                        n = feed_size(feed, "the batch", blocks)
                        if drop_remainder and n < batch_size:
                            batch, samples = batch + 1, samples + n
                            continue
                        for on_batch_begin in hooks["on_batch_begin"]:
                            on_batch_begin(steps)
                        result = run.step(*_micro_batches(feed, n, micro_batch_size, rank, size,
                                                          blocks, rows))
                    batch, samples = batch + 1, samples + n
                    global_step = result.step
                    log = history.add(epoch, result)
                    release()
                    bar.update(result)
                    if ckpt is not None and checkpoint_every and result.step % checkpoint_every == 0:
                        saved_step = checkpoint()
                    for hook in hooks["on_step_end"]:
                        hook(result.step, result)
                    if _counts(log):
                        loss_sum, loss_n = loss_sum + log.loss * log.size, loss_n + log.size
                    if batch_logs:
                        logs = {"loss": loss_sum / loss_n if loss_n else math.nan, **run.metrics()}
                        for on_batch_end in hooks["on_batch_end"]:
                            on_batch_end(steps, logs)
                    steps += 1
                    if run.stop_requested() is not None:
                        break
                # Over MPI every rank ends the epoch here, or all raise: none waits for another.
                run.gather(f"the end of epoch {epoch + 1} of fit", batch)
                if not steps:
                    raise HostavgError(
                        f"epoch {epoch} trained no step: the data gave {batch} batches"
                        f"{', every one shorter than batch_size and dropped (drop_remainder)' if batch else ''}"
                        f"; fit needs at least one batch per epoch")
                logs = _epoch_logs(history, epoch)
                logs.update(run.metrics())
                logs.update({f"val_{k}": v for k, v in run.validate(epoch).items()})
                bar.close(logs)
                hold()  # the epoch's logs and the next position, together
                history.epochs.append(logs)
                epoch += 1
                if pass_ended:
                    data_pass, batch, samples = data_pass + 1, 0, 0
                release()
                for hook in hooks["on_epoch_end"]:
                    hook(epoch - 1, logs)
                stop = run.stop_requested()
                if stop is not None:
                    history.stopped = stop
                    break
        except StopTraining as e:
            history.stopped = str(e) or "stopped by a callback"
        except BaseException as error:
            with contextlib.suppress(AttributeError):  # an exception type with __slots__
                error.history = history  # the loss curve up to the failure, to see what led to it
            bar.close(None)
            try:
                if ckpt is not None and run.global_step() != saved_step:
                    checkpoint()  # the last completed step: a step is atomic
            finally:
                _close(hooks)
            run.abandon(error)  # over MPI, a rank leaving alone ends the job
            raise
    bar.close(None)
    try:
        if ckpt is not None:
            checkpoint()
        for hook in hooks["on_train_end"]:
            hook(history)
    finally:
        _close(hooks)
    return history


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


def _agree(run: Run, seed: int, settings: dict) -> int:
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


def _micro_batches(batch, n: int, micro_batch_size: int, rank: int, size: int,
                   blocks: dict | None, rows) -> tuple[list, list, list | None]:
    """This rank's micro-batches of a batch of ``n`` samples (its contiguous share, cut up),
    their sizes, and their data rows (None where the source can't tell)."""
    lo, hi = n * rank // size, n * (rank + 1) // size
    if lo == hi:
        return [], [], None if rows is None else []
    share = batch if size == 1 else take(batch, slice(lo, hi), n, blocks)
    starts = range(0, hi - lo, micro_batch_size)
    sizes = [min(micro_batch_size, hi - lo - start) for start in starts]
    micro_rows = None if rows is None else [rows[lo + a:lo + a + b] for a, b in zip(starts, sizes)]
    return split(share, micro_batch_size, blocks=blocks), sizes, micro_rows


def check_sizes(batch_size, micro_batch_size, epochs=1, checkpoint_every=None) -> None:
    """Raises HostavgError unless the sizes make sense together (``batch_size`` None: the data
    gives its own batches)."""
    if batch_size is not None:
        positive_int("batch_size", batch_size)
    positive_int("micro_batch_size", micro_batch_size)
    positive_int("epochs", epochs)
    if checkpoint_every is not None:
        positive_int("checkpoint_every", checkpoint_every)
    if batch_size is not None and micro_batch_size > batch_size:
        raise HostavgError(
            f"micro_batch_size ({micro_batch_size}) is larger than batch_size ({batch_size}); "
            f"a batch is cut into micro-batches, so use micro_batch_size <= batch_size")


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

    one_shot = False

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
