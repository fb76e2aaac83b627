"""Built-in trainer hooks: skip non-finite micro-batches, clip, record, log to TensorBoard.

A hook is any object with ``on_micro_batch(micro)`` and/or
``on_step(mean, result)`` (:class:`hostavg.results.Hook`); pass them as
``hostavg.Trainer(..., hooks=[...])``. Everything a hook is given is
read-only: to change gradients, return new ones. Pure NumPy: TensorFlow is
imported only when a :class:`TensorBoard` hook writes its first step.
They run in the order given, so put :class:`Record` and :class:`TensorBoard`
after the hooks that change gradients, to see what is applied.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hostavg.errors import HostavgError, positive_int
from hostavg.gradients import SparseGradient, nonfinite_entries
from hostavg.record import _SCALARS, RecordWriter
from hostavg.results import Drop

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
    ``result.info["micro_norms_before_clip"]``, one per micro-batch.
    """

    def __init__(self, max_norm: float):
        _positive("max_norm", max_norm)
        self.max_norm = float(max_norm)
        self._norms = []

    def on_micro_batch(self, record):
        if record.index == 0:
            self._norms = []
        norm = record.grads.global_norm()
        self._norms.append(norm)
        if norm > self.max_norm:
            return _scaled(record.grads, self.max_norm / norm)
        return None

    def on_step(self, mean, result):
        result.info["micro_norms_before_clip"] = tuple(self._norms)


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
    """Appends every ``every``-th step to an on-disk record (see :mod:`hostavg.record`).

    Records the applied mean, the step's statistics, each micro-batch's loss,
    size and sample range, and with ``micro=True`` each micro-batch's
    gradients, streamed to disk as they come: memory stays O(parameters) however
    long training runs. Read it back with :func:`hostavg.load_record`.

    Args:
      path: the record's folder (created if missing; steps already there stay).
      every: record steps whose global step is a multiple of this.
      micro: also record each micro-batch's gradients.
    """

    def __init__(self, path, every: int = 1, micro: bool = True):
        positive_int("every", every)
        self.path, self.every, self.micro = Path(path), every, bool(micro)
        self._writer = RecordWriter(self.path)
        self._open = None  # (step, last micro-batch index) of the step being written
        self._recorded = []

    def _begin(self, step: int) -> None:
        self._writer.begin(step)
        self._recorded = []

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

    def on_step(self, mean, result):
        if result.step % self.every:
            return None
        if self._open is None or self._open[0] != result.step:
            self._begin(result.step)  # every micro-batch went before this hook saw it
        self._open = None
        self._writer.write("mean", mean)
        stats = result.stats
        self._writer.finish(result.step, {
            "loss": result.loss, "size": result.size,
            "stats": {**{k: getattr(stats, k) for k in _SCALARS},
                      "micro_norms": stats.micro_norms, "cosines": stats.cosines},
            "micro": [{"index": m.index, "start": m.start, "size": m.size, "loss": m.loss,
                       "dropped": m.dropped, "recorded": m.index in self._recorded}
                      for m in result.micro],
            "variables": {name: {"sparse": isinstance(v, SparseGradient), "shape": list(v.shape)}
                          for name, v in mean.items()}})
        return None


class TensorBoard:
    """Writes scalars every step and gradient histograms every ``histograms_every`` steps.

    Scalars, under ``hostavg/``: ``loss``, ``grad_norm``, the noise-scale
    estimates and the batch-size tests where the step has them, and
    ``dropped``. Histograms, under ``gradients/<variable>``: the applied mean
    gradient's values (a sparse variable's touched rows). Written with
    TensorFlow's own summary writer (``tf.summary.create_file_writer``), in a
    small graph and session of the hook's own, so it works inside or outside
    the model's graph context.
    """

    def __init__(self, logdir, histograms_every: int = 100):
        positive_int("histograms_every", histograms_every)
        self.logdir, self.histograms_every = str(logdir), histograms_every
        self._graph = None

    def _build(self, names):
        import tensorflow as tf
        v1 = tf.compat.v1
        self._graph = tf.Graph()
        with self._graph.as_default():
            writer = tf.summary.create_file_writer(self.logdir)
            self._step = v1.placeholder(tf.int64, ())
            tags = (*_SCALARS, "loss", "dropped")
            self._scalars = {k: v1.placeholder(tf.float64, ()) for k in tags}
            self._hists = {n: v1.placeholder(tf.float64, (None,)) for n in names}
            with writer.as_default(), tf.summary.record_if(True):
                self._scalar_ops = {k: tf.summary.scalar(f"hostavg/{k}", ph, step=self._step)
                                    for k, ph in self._scalars.items()}
                self._hist_ops = [tf.summary.histogram(f"gradients/{n}", ph, step=self._step)
                                  for n, ph in self._hists.items()]
            self._flush = writer.flush()
            init = writer.init()
        self._sess = tf.compat.v1.Session(graph=self._graph)
        self._sess.run(init)

    def on_step(self, mean, result):
        if self._graph is None:
            self._build(list(mean))
        values = {k: getattr(result.stats, k) for k in _SCALARS}
        values.update(loss=result.loss, dropped=len(result.dropped))
        present = {k: v for k, v in values.items() if v is not None}
        feed = {self._step: result.step, **{self._scalars[k]: v for k, v in present.items()}}
        fetches = [self._scalar_ops[k] for k in present]
        if result.step % self.histograms_every == 0:
            fetches += self._hist_ops
            for name, v in mean.items():
                feed[self._hists[name]] = np.ravel(v.values if isinstance(v, SparseGradient) else v)
        self._sess.run(fetches, feed)
        return None

    def flush(self) -> None:
        """Makes everything written so far visible to readers."""
        if self._graph is not None:
            self._sess.run(self._flush)
