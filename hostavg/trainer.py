"""The Trainer: compute a micro-batch's gradients, accumulate them on the host, apply the mean."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from hostavg.accumulator import ACCUMULATE_MODES, Accumulator, as_accum_dtype
from hostavg.errors import HostavgError
from hostavg.gradients import Gradients, check_finite, conform
from hostavg.graph import Wiring, load_variables, resolve_feed
from hostavg.split import feed_size, split
from hostavg.stats import StepStats, step_stats

v1 = tf.compat.v1

__all__ = ["AVERAGE_MODES", "Drop", "MicroBatch", "StepResult", "Trainer"]

#: "host": the mean is computed with NumPy. "graph": the averaging runs in the
#: session, as a division of the fed running sum ("sum") or a weighted reduce
#: over a fed stack of micro-batch gradients ("stack").
AVERAGE_MODES = ("host", "graph")


@dataclass(frozen=True)
class Drop:
    """Returned by a hook's ``on_micro_batch``: leave this micro-batch out of the step.

    Attributes:
      reason: recorded as the micro-batch's ``dropped``.
    """

    reason: str = "dropped by a hook"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step; hooks receive it before it is accumulated.

    Attributes:
      index: its position in the step, from 0.
      size: its number of samples (its weight in the mean).
      loss: its mean loss.
      grads: its :class:`Gradients`. Hooks always see them; on a StepResult
        they are kept in ``accumulate="stack"`` and None in "sum", which keeps
        no per-micro-batch gradients.
      start: the index of its first sample within the step's samples
        (it covered samples start:start + size).
      step: the global step the step will have after its apply.
      dropped: why a hook dropped it (see :class:`hostavg.hooks.Drop`), or None.
    """

    index: int
    size: int
    loss: float
    grads: Gradients | None
    start: int = 0
    step: int = 0
    dropped: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    Attributes:
      loss: the sample-weighted mean loss over the accumulated micro-batches,
        sum_i n_i loss_i / sum_i n_i (None if the step was skipped).
      grads: the :class:`Gradients` that were applied (None if skipped).
      micro: one :class:`MicroBatch` per micro-batch, in order, dropped ones too.
      step: the global step after the apply (unchanged if skipped).
      size: samples accumulated, sum_i n_i over micro-batches not dropped.
      stats: the step's :class:`~hostavg.stats.StepStats` (``grad_norm`` NaN
        and no estimates if skipped).
      skipped: why nothing was applied (every micro-batch was dropped), or None.
      info: what hooks reported, by key (e.g. norms before clipping).
    """

    loss: float | None
    grads: Gradients | None
    micro: tuple
    step: int
    size: int
    stats: StepStats | None = None
    skipped: str | None = None
    info: dict = field(default_factory=dict)

    @property
    def dropped(self) -> tuple:
        """Indices of the micro-batches that hooks dropped."""
        return tuple(m.index for m in self.micro if m.dropped is not None)

    def micro_table(self):
        """A pandas DataFrame, one row per micro-batch: index, start, size, loss, norm, cosine, dropped.

        ``cosine`` (with the mean) is filled in "stack" mode only.
        """
        try:
            import pandas as pd
        except ImportError:
            raise HostavgError("micro_table needs pandas: pip install pandas") from None
        cos = iter(self.stats.cosines) if self.stats and self.stats.cosines else None
        norms = self.stats.micro_norms if self.stats else [math.nan] * len(self.micro)
        return pd.DataFrame([{
            "index": m.index, "start": m.start, "size": m.size, "loss": m.loss, "norm": norm,
            "cosine": next(cos) if cos is not None and m.dropped is None else math.nan,
            "dropped": m.dropped} for m, norm in zip(self.micro, norms)]).set_index("index")


class _Tally(NamedTuple):
    """A step's bookkeeping: this process's, or (with comm) every rank's together.

    weights, sq_norms: of each accumulated micro-batch; norms, losses: of each
    micro-batch, dropped ones too; total: sum of the weights; loss_sum:
    sum_i w_i loss_i (None if a loss was missing); size: samples accumulated;
    global_step: before the apply (None where no micro-batch ran).
    """

    weights: list
    sq_norms: list
    norms: list
    losses: list
    total: float
    loss_sum: float | None
    size: int
    global_step: int | None


class Trainer:
    """Trains a ``tf.compat.v1`` graph with gradients averaged on the host.

    One optimizer step runs k micro-batches through forward and backward,
    fetching each one's gradients to NumPy; their sample-weighted mean
    ``sum_i n_i g_i / sum_i n_i`` (g_i: the gradient of micro-batch i's MEAN
    loss, n_i: its samples) is fed back through the gradient tensors to the
    optimizer's train op, which runs once. That equals one step on the
    concatenated batch, for any optimizer, and the global step grows by one.

    Build the trainer before ``global_variables_initializer()``: it creates the
    optimizer's slots and, if missing, the global step.

    Args:
      loss: scalar tensor, the MEAN of the per-sample losses of a micro-batch.
      optimizer: a ``tf.compat.v1.train.Optimizer``.
      var_list: the variables to train; default the trainable variables the
        loss reaches. Variables whose gradient is None are left out and untouched.
      accumulate: one of :data:`~hostavg.accumulator.ACCUMULATE_MODES`.
      average: one of :data:`AVERAGE_MODES`.
      accum_dtype: host accumulation dtype (e.g. "float64"); None keeps each
        variable's dtype.
      global_step: the variable the train op increments; default the graph's
        global step, created if missing.
      hooks: objects with ``on_micro_batch(record)`` and/or
        ``on_step(mean, result)``, called in order (see :mod:`hostavg.hooks`).
        ``on_micro_batch`` gets each :class:`MicroBatch` (with its gradients)
        before it is accumulated and returns None (keep it), a mapping of
        replacement gradients, or a :class:`Drop`. ``on_step`` gets the mean
        and the :class:`StepResult` before the apply and returns None or a
        replacement mean.

    Attributes:
      graph: the loss's graph; sessions passed in must run it.
      loss: the loss tensor.
      spec: name -> :class:`~hostavg.VariableSpec` of every trained variable.
      global_step: the global step variable.
      train_op: the optimizer's apply op, fed through the gradient tensors.
      hooks: the hooks, in the order they run.
      comm: the communicator, or None.

    Example::

        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(1e-3))
        sess.run(v1.global_variables_initializer())
        res = trainer.step(sess, hostavg.split({x: xb, y: yb}, 32))
    """

    def __init__(self, loss, optimizer, var_list=None, *, accumulate: str = "sum",
                 average: str = "host", accum_dtype=None, global_step=None, hooks=(),
                 comm=None):
        if not isinstance(loss, tf.Tensor) or not hasattr(loss, "graph"):
            raise HostavgError(
                f"loss must be a scalar tensor of a tf.compat.v1 graph, got {loss!r}; "
                f"build the model inside `with tf.Graph().as_default():`")
        if loss.shape.rank not in (None, 0):
            raise HostavgError(
                f"loss must be a scalar (the mean over the micro-batch's samples), got "
                f"shape {loss.shape}; reduce it with tf.reduce_mean")
        if not isinstance(optimizer, v1.train.Optimizer):
            raise HostavgError(
                f"optimizer must be a tf.compat.v1.train.Optimizer (e.g. "
                f"tf.compat.v1.train.AdamOptimizer), got {type(optimizer).__name__}")
        if average not in AVERAGE_MODES:
            raise HostavgError(f"average must be one of {AVERAGE_MODES}, got {average!r}")
        if accumulate not in ACCUMULATE_MODES:
            raise HostavgError(
                f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
        if var_list is not None and not list(var_list):
            raise HostavgError("var_list is empty: there is nothing to train")
        if comm is not None and average == "graph":
            raise HostavgError("average='graph' cannot be combined with comm=: with several "
                               "processes the mean is the MPI reduction of the host sums")
        if comm is not None:
            from hostavg.mpi import Distributed  # multi-worker sits above the trainer: imported on use
            self._dist = Distributed(comm)
        else:
            self._dist = None
        self.comm = comm
        self._synchronized = weakref.WeakSet()
        hooks = list(hooks)
        for hook in hooks:
            if not (callable(getattr(hook, "on_micro_batch", None))
                    or callable(getattr(hook, "on_step", None))):
                raise HostavgError(f"hook {hook!r} has neither on_micro_batch nor on_step")
        self.hooks = tuple(hooks)
        self._micro_hooks = [h.on_micro_batch for h in hooks
                             if callable(getattr(h, "on_micro_batch", None))]
        self._step_hooks = [h.on_step for h in hooks if callable(getattr(h, "on_step", None))]
        self.accumulate = accumulate
        self.average = average
        self.accum_dtype = as_accum_dtype(accum_dtype)
        self._wiring = Wiring(loss, optimizer, var_list, global_step,
                              accumulate=accumulate, average=average,
                              accum_dtype=self.accum_dtype)
        self.graph = self._wiring.graph
        self.loss = loss
        self.spec = self._wiring.spec
        self.global_step = self._wiring.global_step
        self.train_op = self._wiring.train_op
        # step's own, reused: its buffers are allocated once; step passes the reducer per call.
        self._step_accumulator = Accumulator(self.spec, accumulate=accumulate,
                                             accum_dtype=self.accum_dtype)

    def accumulator(self, sess=None) -> Accumulator:
        """A new, empty :class:`~hostavg.Accumulator` for this trainer's variables and settings.

        Args:
          sess: with ``average="graph"``, the session its mean() runs in
            (required there, ignored otherwise).
        """
        if self.average == "graph" and sess is None:
            raise HostavgError("average='graph' computes the mean in a session: pass it, as "
                               "trainer.accumulator(sess)")
        return Accumulator(self.spec, accumulate=self.accumulate, accum_dtype=self.accum_dtype,
                           reducer=self._reducer(sess) if self.average == "graph" else None)

    def compute(self, sess, feed_dict: Mapping, *, size: int | None = None) -> Gradients:
        """Runs one micro-batch forward and backward and fetches its gradients.

        Also runs the graph's UPDATE_OPS (batch-norm moving statistics). Changes
        no trained variable and not the global step.

        Args:
          sess: a session running the trainer's graph.
          feed_dict: {placeholder or its name: value} for one micro-batch.
          size: its number of samples; default the length of its arrays.

        Returns:
          :class:`Gradients` (read-only arrays) with ``.loss``, ``.size`` and
          ``.sq_norms`` (each gradient's squared norm, reduced in the session).
        """
        self._check_session(sess)
        feed = resolve_feed(self.graph, feed_dict, "compute")
        return self._compute(sess, feed, self._size(feed, size, "compute"), "compute")[0]

    def apply(self, sess, grads: Mapping) -> int:
        """Feeds ``grads`` through the gradient tensors and runs the train op once.

        No forward or backward pass runs. ``grads`` is a :class:`Gradients` or
        any mapping with exactly the keys of :attr:`spec` (say, a dict a user
        edited); values are cast to each variable's dtype.

        Returns:
          the global step after the apply (one more than before).

        Raises:
          HostavgError: for missing or extra keys, a wrong shape, a dtype that
            does not cast within its kind, or non-finite values; nothing is
            applied then.
        """
        self._check_session(sess)
        values = conform(self.spec, grads, what="apply", cast=True)
        known = getattr(grads, "sq_norms", {})  # valid for values that conform passed through
        check_finite(values, "apply", known={n: q for n, q in known.items() if values[n] is grads[n]})
        return self._wiring.apply(sess, values)

    def step(self, sess, feeds: Sequence[Mapping]) -> StepResult:
        """One optimizer step over the micro-batches ``feeds``: compute, add, apply.

        The step is atomic: if any micro-batch fails (bad feed, non-finite
        gradient or loss, an error in the session) nothing is applied, and
        variables that UPDATE_OPS changed are restored, so the model, the
        optimizer's slots and the global step are as they were.

        Args:
          sess: a session running the trainer's graph.
          feeds: a sequence of feed dicts, one per micro-batch, e.g.
            ``hostavg.split(feed_dict, micro_batch_size)``. With ``comm``,
            this rank's micro-batches (possibly none); the step's mean, loss,
            size and statistics are over every rank's, ``micro`` lists this
            rank's, and if any rank fails, every rank raises the same error
            naming it, with nothing applied anywhere.
        """
        self._check_session(sess)
        if isinstance(feeds, Mapping) or not isinstance(feeds, (Sequence, np.ndarray)):
            raise HostavgError(
                f"step takes a list of feed dicts, one per micro-batch, got "
                f"{type(feeds).__name__}; cut one big feed with hostavg.split(feed, micro_batch_size)")
        if not len(feeds) and self._dist is None:
            raise HostavgError("step got no micro-batches; pass at least one feed dict")
        if self._dist is not None:
            self._synchronize(sess)
        acc = self._step_accumulator
        acc.reset()
        state = self._wiring.state
        saved = state.save(sess) if state else None
        micro, norms = [], []
        stack = [] if self.accumulate == "stack" and self._dist is None else None
        try:
            try:
                global_step = self._local(sess, feeds, acc, micro, norms, stack)
                error = None
            except Exception as e:  # noqa: BLE001 - with comm, every rank must hear of it
                if self._dist is None:
                    raise
                error, global_step = e, None
            tally = _Tally(acc.weights, acc.sq_norms, norms, [m.loss for m in micro],
                           acc.total_weight, acc.loss_sum,
                           sum(m.size for m in micro if m.dropped is None), global_step)
            if self._dist is not None:
                tally = self._agree(sess, error, tally)
            if not tally.total:
                if state:
                    state.restore(sess, saved)
                return StepResult(None, None, tuple(micro), tally.global_step, 0,
                                  StepStats(math.nan, tuple(tally.norms), tuple(tally.losses), {}),
                                  skipped=f"all {len(tally.norms)} micro-batches were dropped; "
                                          f"nothing was applied")
            if self._dist is not None:
                mean = acc.mean(self._dist.reducer(self.spec, tally.total))
            else:
                mean = acc.mean(self._reducer(sess) if self.average == "graph" else None)
            stats = step_stats(mean, tally.weights, tally.sq_norms, tally.norms, tally.losses, stack)
            mean = Gradients(mean, loss=None if tally.loss_sum is None else tally.loss_sum / tally.total,
                             size=tally.total,
                             sq_norms={n: v * v for n, v in stats.variable_norms.items()})
            result = StepResult(mean.loss, mean, tuple(micro), tally.global_step + 1, tally.size,
                                stats)
            for hook in self._step_hooks:
                new = hook(mean, result)
                if new is not None:
                    mean = Gradients(conform(self.spec, new, what="on_step hook"),
                                     loss=mean.loss, size=mean.size)
                    result = replace(result, grads=mean, stats=result.stats.applied(mean))
            result = replace(result, step=self.apply(sess, mean))
        except BaseException:
            if state:
                state.restore(sess, saved)
            raise
        return result

    def _local(self, sess, feeds, acc, micro, norms, stack) -> int | None:
        """Computes and accumulates this process's micro-batches; returns the global step before the apply."""
        prepared, start = [], 0
        for i, feed_dict in enumerate(feeds):
            what = f"micro-batch {i} of {len(feeds)}"
            feed = resolve_feed(self.graph, feed_dict, f"step, {what}")
            n = self._size(feed, None, f"step, {what}")
            prepared.append((feed, n, start, f"{what} (samples {start}:{start + n})"))
            start += n
        global_step = None
        for i, (feed, n, start, what) in enumerate(prepared):
            try:
                g, global_step = self._compute(sess, feed, n, what)
                record = self._micro_hooks_on(MicroBatch(i, n, g.loss, g, start, global_step + 1))
                if record.dropped is None:
                    acc.add(record.grads)
            except HostavgError as e:
                raise HostavgError(f"step, {what}: "
                                   f"{str(e).removeprefix(f'micro-batch {i}: ')}") from None
            except (tf.errors.OpError, ValueError, TypeError) as e:
                raise HostavgError(
                    f"step, {what}: the session failed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0]}); check that micro-batch's feed") from e
            if record.dropped is None:
                if stack is not None:
                    stack.append(record.grads)
                norms.append(math.sqrt(acc.sq_norms[-1]))
            else:
                norms.append(record.grads.global_norm())
            micro.append(record if self.accumulate == "stack" else replace(record, grads=None))
        return global_step

    def _agree(self, sess, error, tally: _Tally) -> _Tally:
        """With comm: every rank's tally together, or, if any rank failed, one error on every rank."""
        message = None if error is None else str(error) if isinstance(error, HostavgError) \
            else f"{type(error).__name__}: {error}"
        reports = self._dist.gather((message, tally))
        failed = [f"rank {r}: {m}" for r, (m, _) in enumerate(reports) if m is not None]
        if failed:
            raise HostavgError(f"the step failed on {len(failed)} of {len(reports)} ranks and nothing "
                               f"was applied on any: {' | '.join(failed)}") from error
        tallies = [t for _, t in reports]
        loss_sums = [t.loss_sum for t in tallies]
        steps = [t.global_step for t in tallies if t.global_step is not None]
        return _Tally(*([x for t in tallies for x in getattr(t, f)]
                        for f in ("weights", "sq_norms", "norms", "losses")),
                      math.fsum(t.total for t in tallies),
                      None if None in loss_sums else math.fsum(loss_sums),
                      sum(t.size for t in tallies),
                      steps[0] if steps else int(sess.run(self.global_step)))

    def _synchronize(self, sess) -> None:
        """With comm, the first time a session steps: every variable takes rank 0's value."""
        if sess in self._synchronized:
            return
        variables = self.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
        load_variables(sess, variables, self._dist.broadcast(sess.run(variables)))
        self._synchronized.add(sess)

    def evaluate(self, sess, data: Mapping, *, batch_size: int, metrics: Mapping | None = None) -> dict:
        """The loss (and ``metrics``) over ``data``, sample-weighted, without training.

        Runs no gradient, no UPDATE_OPS, changes nothing.

        Args:
          data: {placeholder: array}, evaluated in chunks of ``batch_size`` samples.
          metrics: name -> scalar tensor, each the MEAN of a per-sample quantity
            over the chunk (e.g. accuracy), combined like the loss.

        Returns:
          {"loss": ..., **{name: ...}} as floats.
        """
        self._check_session(sess)
        metrics = dict(metrics or {})
        if "loss" in metrics:
            raise HostavgError("metrics may not be named 'loss': that name holds the loss")
        fetches = {"loss": self.loss, **metrics}
        totals, count = dict.fromkeys(fetches, 0.0), 0
        for chunk in split(resolve_feed(self.graph, data, "evaluate"), batch_size):
            n = feed_size(chunk)
            for name, value in sess.run(fetches, chunk).items():
                if np.ndim(value) != 0:
                    raise HostavgError(f"evaluate: metric {name!r} has shape {np.shape(value)}, "
                                       f"not a scalar; give the mean over the batch")
                totals[name] += n * float(value)
            count += n
        return {name: total / count for name, total in totals.items()}

    def fit(self, sess, data, *, batch_size: int, micro_batch_size: int, epochs: int = 1,
            shuffle: bool = True, seed: int | None = None, drop_remainder: bool = False,
            validation_data: Mapping | None = None, metrics: Mapping | None = None,
            inputs=None, callbacks=(), progress=True, checkpoint_dir=None,
            checkpoint_every: int | None = None, keep_checkpoints: int = 3):
        """Trains over ``data`` for ``epochs``: batches of ``batch_size`` samples, each one step.

        Each batch is cut into micro-batches of ``micro_batch_size`` samples and
        applied as one optimizer step (:meth:`step`); a short last batch is
        weighted by its real sample count, or dropped with ``drop_remainder``.
        ``data`` is a dict ``{placeholder: array}``, an iterable of batch feed
        dicts (or a callable returning one per epoch), or a ``tf.data.Dataset``
        of single samples with ``inputs=`` naming the placeholder of each
        element key; see :mod:`hostavg.loop`.

        Args:
          shuffle, seed: a dict's samples are reordered each epoch by a
            permutation drawn from (seed, epoch): the same seed gives the same
            order on every run. None draws a seed (kept in checkpoints).
          validation_data: {placeholder: array}, evaluated at each epoch's end
            (:meth:`evaluate`, in chunks of micro_batch_size) into the epoch's
            "val_loss" and "val_<metric>" for each of ``metrics``.
          callbacks: objects with any of ``on_step_end(step, result)``,
            ``on_epoch_end(epoch, logs)``, ``on_train_end(history)``; raising
            :class:`~hostavg.StopTraining` ends training cleanly.
          progress: True shows a tqdm bar on a terminal or in Jupyter,
            "always" shows it anywhere, False never.
          checkpoint_dir: where to write checkpoints (:meth:`save`) every
            ``checkpoint_every`` steps, at the end, and when an exception,
            KeyboardInterrupt or SIGTERM stops fit (at the last completed
            step); the newest ``keep_checkpoints`` are kept. If it already holds
            one, fit resumes from the newest: weights, optimizer, global step,
            position, seed and history, so an interrupted and resumed run ends
            with the weights of an uninterrupted one, bit for bit. A run that
            finished or was stopped by a callback does not train further.

        Returns:
          the :class:`~hostavg.History`.
        """
        from hostavg.loop import fit
        return fit(self, sess, data, batch_size=batch_size, micro_batch_size=micro_batch_size,
                   epochs=epochs, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder,
                   validation_data=validation_data, metrics=metrics, inputs=inputs,
                   callbacks=callbacks, progress=progress, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints)

    def save(self, sess, path) -> None:
        """Writes every variable of the graph (model, optimizer slots, global step) to ``path``.

        One ``.npz`` file written atomically; see :mod:`hostavg.checkpoint`.
        """
        self._check_session(sess)
        from hostavg.checkpoint import save
        save(self.graph, sess, path)

    def restore(self, sess, path) -> dict | None:
        """Loads a checkpoint written by :meth:`save` or :meth:`fit`; returns fit's state or None.

        Raises:
          HostavgError: if it was written by a different model; nothing changes then.
        """
        self._check_session(sess)
        from hostavg.checkpoint import restore
        return restore(self.graph, sess, path)

    def _micro_hooks_on(self, record: MicroBatch) -> MicroBatch:
        for hook in self._micro_hooks:
            out = hook(record)
            if isinstance(out, Drop):
                return replace(record, dropped=out.reason)
            if out is not None:
                grads = Gradients(conform(self.spec, out, what="on_micro_batch hook"),
                                  loss=record.loss, size=record.size)
                record = replace(record, grads=grads)
        return record

    def _compute(self, sess, feed: dict, n: int, what: str) -> tuple[Gradients, int]:
        loss, values, global_step, sq_norms = self._wiring.compute(sess, feed)
        if np.ndim(loss) != 0:
            raise HostavgError(
                f"{what}: the loss has shape {np.shape(loss)}, not a scalar; reduce it with tf.reduce_mean")
        return Gradients(values, loss=float(loss), size=n, sq_norms=sq_norms), global_step

    def _size(self, feed: dict, size, what: str) -> int:
        n = feed_size(feed, what) if size is None else size
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise HostavgError(f"{what}: a micro-batch must hold at least 1 sample, got {n!r}")
        return int(n)

    def _reducer(self, sess):
        if self._wiring.reducer is None:
            return None
        self._check_session(sess)
        return self._wiring.reducer.bind(sess)

    def _check_session(self, sess) -> None:
        graph = getattr(sess, "graph", None)
        if graph is not self.graph:
            raise HostavgError(
                f"the session runs another graph than the trainer's (got {sess!r}); "
                f"create it with tf.compat.v1.Session(graph=loss.graph)")

    def __repr__(self) -> str:
        return (f"Trainer(variables={len(self.spec)}, accumulate={self.accumulate!r}, "
                f"average={self.average!r}, accum_dtype={self.accum_dtype})")
