"""Built-in trainer hooks: skip non-finite micro-batches, clip, record, log to TensorBoard.

A hook is any object with some of ``on_micro_batch(micro)``,
``on_step(mean, result)`` and ``on_applied(result)``
(:class:`hostavg.results.Hook`); pass them as ``hostavg.Trainer(...,
hooks=[...])``. Everything a hook is given is read-only: to change
gradients, return new ones. Pure NumPy: TensorFlow is imported only when a
:class:`TensorBoard` hook writes its first step. They run in the order given;
:class:`Record` and :class:`TensorBoard` write in ``on_applied``, so they
record what was applied wherever they are listed (a :class:`Record` listed
after a hook that replaces micro-batch gradients stores the replacements).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.gradients import SparseGradient, nonfinite_entries
from hostavg.inspect.record import _SCALARS, RecordWriter, jsonable
from hostavg.core.results import Drop
from hostavg.core.stats import NoiseScale, NoiseScaleEstimate

__all__ = ["ClipGlobalNorm", "ClipMicroBatchNorm", "Drop", "Record", "SkipNonFinite", "TensorBoard"]


class SkipNonFinite:
    """Drops micro-batches whose loss or gradients hold NaN or Inf, instead of raising.

    The step goes on with the others (sample-weighted as usual); the dropped
    ones are in ``result.dropped`` with the reason in ``micro[i].dropped``. If
    every micro-batch is dropped the step is skipped: nothing is applied, the
    global step stays, and ``result.skipped`` says so.
    """

    def on_micro_batch(self, record):
        grads = record.grads
        parts = []
        bad = [name for name, v in grads.items()
               if any(nonfinite_entries(v, grads.sq_norms.get(name)))]
        if bad:
            parts.append("gradients in " + ", ".join(map(repr, bad)))
        if not math.isfinite(record.loss):
            parts.append(f"loss {record.loss}")
        return Drop("non-finite " + " and ".join(parts)) if parts else None


def _scaled(grads, factor: float) -> dict:
    return {name: SparseGradient(v.indices, v.values * factor, v.dense_shape)
            if isinstance(v, SparseGradient) else np.asarray(v) * factor
            for name, v in grads.items()}


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise HostavgError(f"{name} must be a finite number > 0, got {value!r}")


class ClipMicroBatchNorm:
    """Scales each micro-batch's gradients to global norm at most ``max_norm`` before accumulation.

    This is the per-micro-batch clipping of differentially private training
    (with noise added separately). The norms before clipping are reported in
    ``result.info["micro_norms_before_clip"]``, one per micro-batch in step
    order, NaN for a micro-batch that an earlier hook dropped; tables
    (``micro_table``) and :func:`hostavg.plot.micro_norms` show them beside
    the clipped norms.
    """

    def __init__(self, max_norm: float):
        _positive("max_norm", max_norm)
        self.max_norm = float(max_norm)
        self._norms, self._step = {}, None

    def on_micro_batch(self, record):
        if record.step != self._step or record.index in self._norms:  # a new step, or a retry
            self._norms, self._step = {}, record.step
        norm = record.grads.global_norm()
        self._norms[record.index] = norm
        if norm > self.max_norm:
            return _scaled(record.grads, self.max_norm / norm)
        return None

    def on_step(self, mean, result):
        result.info["micro_norms_before_clip"] = tuple(self._norms.get(m.index, math.nan)
                                                       for m in result.micro)


class ClipGlobalNorm:
    """Scales the mean gradient to global norm at most ``max_norm`` before it is applied.

    The norm before clipping is reported in ``result.info["grad_norm_before_clip"]``;
    ``result.stats.grad_norm`` is the norm applied.
    """

    def __init__(self, max_norm: float):
        _positive("max_norm", max_norm)
        self.max_norm = float(max_norm)

    def on_step(self, mean, result):
        norm = mean.global_norm()
        result.info["grad_norm_before_clip"] = norm
        return _scaled(mean, self.max_norm / norm) if norm > self.max_norm else None


class Record:
    """Appends every ``every``-th applied step to an on-disk record (see :mod:`hostavg.record`).

    Records the applied mean, the step's statistics (per variable and per
    micro-batch too), the update-to-weight ratios and the learning rate, each
    micro-batch's loss, size, sample range and data rows, and with
    ``micro=True`` each micro-batch's gradients, streamed to disk as they
    come: memory stays O(parameters) however long training runs. A step is
    committed only once its apply succeeded (``on_applied``): a step that
    failed or was rolled back leaves nothing. Read it back with
    :func:`hostavg.load_record`.

    A folder that already holds steps at or after the first one this record
    writes belongs to another run (a notebook cell run twice, a model trained
    again from scratch): the first step raises HostavgError naming the
    folder, unless ``overwrite=True``, which deletes those steps. Continuing
    the same model (its global step beyond every recorded step) appends; a
    resumed ``fit`` continues the record, replacing what the interrupted run
    wrote after its checkpoint.

    Args:
      path: the record's folder (created if missing).
      every: record steps whose global step is a multiple of this.
      micro: also record each micro-batch's gradients.
      overwrite: delete another run's steps instead of refusing the folder.
    """

    def __init__(self, path, every: int = 1, micro: bool = True, overwrite: bool = False):
        positive_int("every", every)
        self.path, self.every, self.micro = Path(path), every, bool(micro)
        self.overwrite = bool(overwrite)
        self._writer = RecordWriter(self.path)
        self._open = None  # (step, last micro-batch index) of the step being written
        self._recorded = []
        self._last = None  # the last step committed (or resumed from)

    def _begin(self, step: int) -> None:
        if self._last is None or step <= self._last:
            self._claim(step)
        self._writer.begin(step)
        self._recorded = []

    def _claim(self, step: int) -> None:
        """Refuses (or with overwrite, clears) steps at or after ``step``: another run's."""
        later = self._writer.steps(since=step)
        if later and not self.overwrite:
            shown = ", ".join(map(str, later[:3])) + (", ..." if len(later) > 3 else "")
            raise HostavgError(
                f"Record: the folder {str(self.path)!r} already holds {len(later)} steps at or after "
                f"step {step}, the first this run writes ({shown}): another run's, such as a cell "
                f"run twice. Pick another folder, or pass Record(..., overwrite=True) to delete "
                f"them")
        self._writer.delete(later)
        self._last = step - 1

    def on_micro_batch(self, record):
        if record.step % self.every:
            return None
        # A new step, or the same step run again after a failure: start its file afresh.
        if self._open is None or self._open[0] != record.step or record.index <= self._open[1]:
            self._begin(record.step)
        self._open = (record.step, record.index)
        if self.micro:
            self._writer.write(f"micro/{record.index}", record.grads)
            self._recorded.append(record.index)
        return None

    def on_applied(self, result):
        """Commits the step: the applied mean and everything known about the step."""
        if result.step % self.every:
            return None
        if self._open is None or self._open[0] != result.step:
            self._begin(result.step)  # every micro-batch went before this hook saw it
        self._open = None
        mean = result.grads
        self._writer.write("mean", mean)
        stats = result.stats
        self._writer.finish(result.step, {
            "loss": result.loss, "size": result.size,
            "stats": {**{k: getattr(stats, k) for k in _SCALARS},
                      "micro_norms": stats.micro_norms, "cosines": stats.cosines,
                      "variable_norms": stats.variable_norms,
                      "micro_variable_norms": stats.micro_variable_norms},
            "update_ratios": result.update_ratios, "learning_rate": result.learning_rate,
            "info": jsonable(result.info),
            "micro": [{"index": m.index, "start": m.start, "size": m.size, "loss": m.loss,
                       "dropped": m.dropped, "recorded": m.index in self._recorded,
                       "rows": None if m.rows is None else m.rows.tolist()}
                      for m in result.micro],
            "variables": {name: {"sparse": isinstance(v, SparseGradient), "shape": list(v.shape)}
                          for name, v in mean.items()}})
        self._last = result.step
        return None

    def on_resume(self, step: int) -> None:
        """fit resumed from a checkpoint at global step ``step``: what was recorded after it is redone."""
        self._writer.abort()
        self._writer.delete(self._writer.steps(since=step + 1))
        self._open, self._last = None, step

    def close(self) -> None:
        """Discards the unfinished file of a step that never applied (fit calls it when it ends)."""
        self._writer.abort()
        self._open = None


class TensorBoard:
    """Writes scalars every applied step and gradient histograms every ``histograms_every`` steps.

    Scalars, under ``hostavg/``: ``loss``, ``grad_norm``, ``learning_rate``
    (where the optimizer exposes it), ``b_simple`` (the running noise-scale
    estimate, :class:`hostavg.NoiseScale` with ``beta``; one step's own
    estimate swings wildly and is ``b_simple_one_step``), ``g2`` and
    ``trace_sigma`` (one step's), the batch-size tests where the step has
    them, and ``dropped``. Per variable: ``grad_norm/<variable>`` (the applied
    mean gradient's norm) and ``update_ratio/<variable>`` (|update| /
    |weights|). Per epoch of ``fit``: ``epoch/<name>`` for the epoch's loss and
    validation results, at the epoch's last step. Histograms, under
    ``gradients/<variable>``: the applied mean gradient's values (a sparse
    variable's touched rows).

    Only applied steps are written (``on_applied``). Written with
    TensorFlow's own summary writer (``tf.summary.create_file_writer``) in a
    small graph and session of the hook's own, so it works inside or outside
    the model's graph context. ``fit`` closes it when it ends, which flushes
    every step to disk; after a hand-written loop call :meth:`close` (a later
    step opens a new event file).

    Raises:
      HostavgError: when made without the ``tensorboard`` package installed.
    """

    def __init__(self, logdir, histograms_every: int = 100, beta: float = 0.99):
        positive_int("histograms_every", histograms_every)
        if importlib.util.find_spec("tensorboard") is None:
            raise HostavgError("the TensorBoard hook writes for TensorBoard, which is not "
                               "installed: pip install tensorboard (or pip install "
                               "'hostavg[inspect]')")
        self.logdir, self.histograms_every = str(logdir), histograms_every
        self.noise_scale = NoiseScale(beta)
        self._graph = None
        self._last_step = 0

    def _open(self):
        import tensorflow as tf
        v1 = tf.compat.v1
        self._graph = tf.Graph()
        with self._graph.as_default():
            self._writer = tf.summary.create_file_writer(self.logdir)
            self._step = v1.placeholder(tf.int64, ())
            self._flush, self._close = self._writer.flush(), self._writer.close()
            init = self._writer.init()
        self._ops = {}  # (kind, tag) -> (placeholder, summary op), made on first use
        self._sess = v1.Session(graph=self._graph)
        self._sess.run(init)

    def _write(self, step: int, scalars: dict, histograms: dict = None) -> None:
        """Writes ``scalars`` (tag -> float, None left out) and ``histograms`` (tag -> array) at ``step``."""
        if self._graph is None:
            self._open()
        feed, fetches = {self._step: step}, []
        for kind, values in (("scalar", scalars), ("histogram", histograms or {})):
            for tag, value in values.items():
                if value is None:
                    continue
                placeholder, op = self._ops.get((kind, tag)) or self._add(kind, tag)
                feed[placeholder] = value
                fetches.append(op)
        self._sess.run(fetches, feed)
        self._last_step = step

    def _add(self, kind: str, tag: str):
        import tensorflow as tf
        with self._graph.as_default(), self._writer.as_default(), tf.summary.record_if(True):
            placeholder = tf.compat.v1.placeholder(tf.float64, () if kind == "scalar" else (None,))
            op = getattr(tf.summary, kind)(tag, placeholder, step=self._step)
        self._ops[(kind, tag)] = (placeholder, op)
        return placeholder, op

    def on_applied(self, result):
        st = result.stats
        if st.trace_sigma is not None:
            self.noise_scale.update(NoiseScaleEstimate(st.g2, st.trace_sigma, st.b_simple),
                                    result.step)
        scalars = {f"hostavg/{k}": getattr(st, k) for k in _SCALARS if k != "b_simple"}
        scalars.update({"hostavg/loss": result.loss, "hostavg/dropped": len(result.dropped),
                        "hostavg/learning_rate": result.learning_rate,
                        "hostavg/b_simple": self.noise_scale.b_simple,
                        "hostavg/b_simple_one_step": st.b_simple})
        scalars.update({f"grad_norm/{n}": v for n, v in st.variable_norms.items()})
        scalars.update({f"update_ratio/{n}": v for n, v in (result.update_ratios or {}).items()})
        histograms = {}
        if result.step % self.histograms_every == 0:
            histograms = {f"gradients/{name}": np.ravel(v.values if isinstance(v, SparseGradient)
                                                        else v)
                          for name, v in result.grads.items()}
        self._write(result.step, scalars, histograms)

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        """fit's epoch results (loss, val_loss, val_<metric>) as ``epoch/<name>``, at the epoch's last step."""
        self._write(self._last_step, {f"epoch/{k}": float(v) for k, v in logs.items()
                                      if k != "epoch" and isinstance(v, (int, float))})

    def flush(self) -> None:
        """Makes everything written so far visible to readers."""
        if self._graph is not None:
            self._sess.run(self._flush)

    def close(self) -> None:
        """Flushes and closes the event file (fit calls it when it ends); a later step opens a new one."""
        if self._graph is not None:
            self._sess.run(self._close)
            self._sess.close()
            self._graph = None
