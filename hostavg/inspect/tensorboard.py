"""The TensorBoard hook: scalars every applied step, histograms of gradients, weights and updates.

Written with the ``tensorboard`` package's protocol buffers and its record
writer (the TFRecord framing and checksums, ``tensorboard.summary.writer.
record_writer``), into a file this hook opens itself: no graph, no session, and
TensorFlow is never imported (TensorBoard's ``EventFileWriter`` reaches files
through ``tensorboard.compat.tf``, which imports TensorFlow where installed).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import time

import numpy as np

from hostavg.core import schema
from hostavg.core.errors import ArgumentError, flag, positive_int
from hostavg.core.files import folder
from hostavg.core.gradients import SparseGradient
from hostavg.core.schema import Kind
from hostavg.core.stats import NOISE_SCALE_BETA, NoiseScale, NoiseScaleEstimate

__all__ = ["HISTOGRAM_BUCKETS", "HISTOGRAMS_EVERY", "TensorBoard"]

#: Buckets of equal width between the smallest and the largest value, per histogram
#: (as ``tf.summary.histogram`` makes them).
HISTOGRAM_BUCKETS = 30
#: The default ``histograms_every``: often enough that a run of a few dozen steps shows its
#: gradients' distributions over time, seldom enough that the few passes over the gradients
#: on the host a histogram costs stay a small part of training (the performance page).
HISTOGRAMS_EVERY = 10
#: What names an event file (as TensorBoard's own writers name them).
_EVENTS = "events.out.tfevents."
#: Numbers the event files this process opens (two in one second keep their names apart), zero-
#: padded: TensorBoard reads a folder's files in name order, in which "10" sorts before "9".
_FILES = itertools.count()


class TensorBoard:
    """Writes scalars every applied step, and histograms of gradients, weights and updates.

    Tags (docs/guides/inspecting.md lists them): every applied step, each
    quantity of :data:`hostavg.core.schema.QUANTITIES` that has a tag, the
    running noise scale ``hostavg/b_simple`` and each user statistic
    (``statistics/<name>``); per epoch of ``fit``, ``epoch/*``; every
    ``histograms_every`` steps, ``gradients/<variable>`` histograms; on the
    steps that keep distributions (the trainer's ``distributions_every``),
    ``gradients/``, ``weights/`` and ``updates/<variable>`` histograms. The
    event file is flushed after every step.

    Only applied steps are written (``on_applied``); ``fit`` closes the hook,
    a hand-written loop calls :meth:`close` (a later step opens a new file).

    A folder that already holds event files belongs to another run (a cell
    run twice): the first write raises HostavgError naming the folder, as
    :class:`~hostavg.hooks.Record` does, unless ``overwrite=True``, which
    deletes them; a resumed ``fit`` (``on_resume``) appends. ``beta`` is the
    running noise scale's, :data:`~hostavg.core.stats.NOISE_SCALE_BETA` as
    :class:`hostavg.NoiseScale`'s and :func:`hostavg.plot.noise_scale`'s.

    Example::

        board = hostavg.hooks.TensorBoard("runs/tb")
        trainer = hostavg.Trainer(loss, optimizer, hooks=[board])
        # tensorboard --logdir runs/tb; or, in Python:
        # EventAccumulator("runs/tb").Reload().Scalars("hostavg/loss")

    Raises:
      HostavgError: when made without the ``tensorboard`` package installed.
    """

    def __init__(self, logdir, histograms_every: int = HISTOGRAMS_EVERY,
                 beta: float = NOISE_SCALE_BETA, overwrite: bool = False):
        positive_int("histograms_every", histograms_every)
        self.overwrite = flag("overwrite", overwrite)
        if importlib.util.find_spec("tensorboard") is None:
            raise ArgumentError("the TensorBoard hook writes for TensorBoard, which is not "
                                "installed: pip install tensorboard (or pip install "
                                "'hostavg[inspect]')")
        self.logdir = str(folder(logdir, "TensorBoard: logdir", "the event files"))
        self.histograms_every = histograms_every
        self.noise_scale = NoiseScale(beta)
        self._writer = None
        self._last_step = 0
        self._claimed = False  # whether the folder is this run's (written to, or resumed)

    def _write(self, step: int, scalars: dict, histograms: dict | None = None) -> None:
        """Writes ``scalars`` (tag -> number, None left out) and ``histograms`` (tag -> array) at
        ``step`` as one event, and flushes the file."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        if self._writer is None:
            self._writer = self._open(Event)
        values = [Summary.Value(tag=tag, simple_value=float(value))
                  for tag, value in scalars.items() if value is not None]
        values += [Summary.Value(tag=tag, histo=_histogram(array))
                   for tag, array in (histograms or {}).items()]
        self._writer.write(Event(wall_time=time.time(), step=step,
                                 summary=Summary(value=values)).SerializeToString())
        self._writer.flush()
        self._last_step = step

    def _open(self, event):
        """A new event file's record writer, its first record the file version; the folder
        claimed first (another run's event files refused, or with overwrite deleted)."""
        from tensorboard.summary.writer.record_writer import RecordWriter
        if not self._claimed:
            used = sorted(p for p in os.listdir(self.logdir) if p.startswith(_EVENTS))
            if used and not self.overwrite:
                raise ArgumentError(
                    f"TensorBoard: the folder {self.logdir!r} already holds {len(used)} event "
                    f"file{'s' if len(used) != 1 else ''} ({used[0]}{', ...' if len(used) > 1 else ''}): "
                    f"another run's, which TensorBoard would mix with this one. Pick another "
                    f"folder (one per run, such as runs/tb/<name>), or pass TensorBoard(..., "
                    f"overwrite=True) to delete them")
            for name in used:
                os.remove(os.path.join(self.logdir, name))
            self._claimed = True
        now = time.time()
        path = os.path.join(self.logdir, f"{_EVENTS}{int(now):010d}.{socket.gethostname()}."
                                         f"{os.getpid()}.{next(_FILES):06d}.hostavg")
        writer = RecordWriter(open(path, "xb"))  # noqa: SIM115 - closed by close()
        writer.write(event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        return writer

    def on_resume(self, step: int) -> None:
        """fit resumed from a checkpoint: the folder's event files are this run's, appended to."""
        self._claimed = True

    def on_applied(self, result):
        st = result.stats
        if st.trace_sigma is not None:
            self.noise_scale.update(NoiseScaleEstimate(st.g2, st.trace_sigma, st.b_simple),
                                    result.step)
        scalars, histograms = {"hostavg/b_simple": self.noise_scale.b_simple}, {}
        values = schema.read(result, _WRITTEN)
        for q in _WRITTEN:
            _add(q.tag, q.kind, values[q.name], scalars, histograms)
        for name, value in result.statistics.items():
            _add(f"statistics/{name}", schema.kind_of(value), value, scalars, histograms)
        kept = result.weights is not None  # a step that kept distributions (distributions_every)
        if kept or result.step % self.histograms_every == 0:
            histograms.update({f"gradients/{name}": v.values if isinstance(v, SparseGradient)
                               else v for name, v in result.grads.items()})
        if kept:
            for kind, values in (("weights", result.weights), ("updates", result.updates)):
                histograms.update({f"{kind}/{name}": v for name, v in values.items()})
        self._write(result.step, scalars, histograms)

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        """fit's epoch results (loss, samples, steps, val_loss, val_<metric>) as ``epoch/<name>``,
        at the epoch's last step."""
        self._write(self._last_step, {f"epoch/{k}": float(v) for k, v in logs.items()
                                      if k != "epoch" and isinstance(v, (int, float))})

    def flush(self) -> None:
        """Makes everything written so far visible to readers (every step already is)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file (fit calls it when it ends); a later step opens a new one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


#: The quantities written every applied step: those with a tag.
_WRITTEN = tuple(q for q in schema.QUANTITIES if q.tag is not None)


def _add(tag: str, kind: Kind, value, scalars: dict, histograms: dict) -> None:
    """One step's ``value`` of a quantity of ``kind`` as TensorBoard summaries: a scalar per
    step, ``<tag>/<variable>`` scalars per variable, a histogram of a per-micro-batch one (its
    finite values), the number of indices."""
    if value is None:
        return
    if kind is Kind.STEP:
        scalars[tag] = value
    elif kind is Kind.VARIABLE:
        scalars.update({f"{tag}/{name}": v for name, v in value.items()})
    elif kind is Kind.MICRO:
        finite = np.asarray(value, np.float64)
        if np.isfinite(finite).any():
            histograms[tag] = finite[np.isfinite(finite)]
    elif kind is Kind.INDICES:
        scalars[tag] = len(value)


def _histogram(values) -> object:
    """A ``HistogramProto`` of ``values``: count, sum, sum of squares, range, and
    :data:`HISTOGRAM_BUCKETS` buckets of equal width (one where every value is the same)."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto
    flat = np.ravel(np.asarray(values, np.float64))
    if not flat.size:
        return HistogramProto()
    low, high = float(flat.min()), float(flat.max())
    if low == high:
        counts, edges = np.array([flat.size]), np.array([low - 0.5, high + 0.5])
    else:
        counts, edges = np.histogram(flat, HISTOGRAM_BUCKETS, (low, high))
    return HistogramProto(min=low, max=high, num=flat.size, sum=float(flat.sum()),
                          sum_squares=float(flat @ flat), bucket_limit=edges[1:].tolist(),
                          bucket=counts.astype(float).tolist())
