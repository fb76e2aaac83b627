"""The TensorBoard hook: scalars every applied step, gradient histograms every so many.

TensorFlow's summary writer is imported when the hook writes its first step.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from hostavg.core.errors import HostavgError, positive_int
from hostavg.core.files import folder
from hostavg.core.gradients import SparseGradient
from hostavg.core.stats import NoiseScale, NoiseScaleEstimate
from hostavg.inspect.record import SCALARS

__all__ = ["TensorBoard"]


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
        self.logdir = str(folder(logdir, "TensorBoard: logdir", "the event files"))
        self.histograms_every = histograms_every
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
        scalars = {f"hostavg/{k}": getattr(st, k) for k in SCALARS if k != "b_simple"}
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
