"""An on-disk record of training steps: the mean gradient, each micro-batch's, and statistics.

Format (version 2): a folder holding one file per recorded step,
``step-<global step, 10 digits>.npz``, a NumPy zip archive that loads with
``allow_pickle=False``: ``meta`` (a JSON string: the step, loss, statistics,
each micro-batch's bookkeeping, the variables), ``mean/<name>`` (the applied
mean gradient; ``.../indices`` and ``.../values`` for a sparse one) and,
recorded with ``micro=True``, ``micro/<i>/<name>``.

A step's file is written under a temporary name and renamed into place once
complete, so a reader never sees a partial step; a damaged file raises
HostavgError naming it when read.

See docs/guides/inspecting.md for every key of ``meta`` and the guarantees.
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from hostavg.core import distributions
from hostavg.core.dtypes import decode, encode
from hostavg.core.errors import HostavgError, flag, positive_int
from hostavg.core.files import folder, read_array, remove_stale, temporary
from hostavg.core.gradients import Gradients, SparseGradient
from hostavg.core.optional import pandas
from hostavg.core.results import check_quantity

__all__ = ["SCALARS", "Record", "RecordedStep", "RecordReader", "RecordWriter", "load_record"]

FORMAT = 2
_NAME = re.compile(r"^step-(\d+)\.npz$")
SCALARS = ("grad_norm", "g2", "trace_sigma", "b_simple", "norm_test", "inner_product_test",
            "orthogonality_test", "gsnr")


class RecordWriter:
    """Writes one step at a time into a record folder (used by :class:`hostavg.hooks.Record`)."""

    def __init__(self, path):
        self.path = folder(path, "Record: path", "the record")
        remove_stale(self.path, _NAME)
        self._zip = self._tmp = None

    def begin(self, step: int) -> None:
        """Starts step ``step``'s file, discarding any step begun and never finished."""
        self.abort()
        self._tmp = temporary(self.path / f"step-{step:010d}.npz")
        self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._encoded = {}

    def write(self, prefix: str, grads: Mapping) -> None:
        """Adds gradients under ``prefix`` (``"mean"`` or ``"micro/<i>"``)."""
        for name, value in grads.items():
            if isinstance(value, SparseGradient):
                self._array(f"{prefix}/{name}/indices", value.indices)
                self._array(f"{prefix}/{name}/values", value.values)
            else:
                self._array(f"{prefix}/{name}", value)

    def finish(self, step: int, meta: dict) -> Path:
        """Writes ``meta``, closes, flushes and renames the step's file into place."""
        encoded = {"encoded": self._encoded} if self._encoded else {}
        self._array("meta", np.array(json.dumps({"format": FORMAT, "step": step, **meta,
                                                 **encoded}, default=_jsonable)))
        self._zip.close()
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = self.path / f"step-{step:010d}.npz"
        os.replace(self._tmp, final)
        self._zip = self._tmp = None
        return final

    def steps(self, since: int = 0) -> list[int]:
        """The steps in the folder, oldest first, from ``since`` on."""
        return sorted(s for s in _listing(self.path) if s >= since)

    def delete(self, steps) -> None:
        """Removes those steps' files."""
        for step in steps:
            (self.path / f"step-{step:010d}.npz").unlink(missing_ok=True)

    def abort(self) -> None:
        """Discards the step begun and not finished, if any."""
        if self._zip is not None:
            self._zip.close()
            self._tmp.unlink(missing_ok=True)
        self._zip = self._tmp = None

    def _array(self, key: str, array) -> None:
        array, name = encode(np.asarray(array))
        if name is not None:
            self._encoded[key] = name
        with self._zip.open(key + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, array, allow_pickle=False)


@contextmanager
def _reading(path: Path):
    """Turns what reading a damaged step file raises into a HostavgError naming the file."""
    try:
        yield
    except HostavgError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged zip or .npy header raises a dozen types
        raise HostavgError(f"the record's file {path} is damaged ({type(e).__name__}: {e}); the "
                           f"other steps stay readable: delete it, or read around it") from None


def _listing(path: Path) -> dict:
    """step -> file of every finished step in a record folder."""
    return {int(m.group(1)): p for p in path.iterdir() if (m := _NAME.match(p.name))}


def jsonable(info: dict) -> dict:
    """The entries of ``info`` that a record's JSON can hold (numbers, strings, lists of them)."""
    out = {}
    for key, value in info.items():
        try:
            json.dumps(value, default=_jsonable)
        except (TypeError, ValueError):
            continue
        out[str(key)] = value
    return out


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} to a record")


class RecordedStep:
    """One recorded step; its gradients are read from disk only when asked for.

    Attributes:
      step, loss, size: the global step, mean loss and samples.
      stats: the step's statistics (a dict with StepStats' scalar names,
        ``micro_norms``, ``cosines``, ``variable_norms`` and
        ``micro_variable_norms``).
      update_ratios: name -> |update| / |weights| of the apply (or None).
      learning_rate: the optimizer's learning rate at the apply (or None).
      distributions: quantity -> variable -> nine percentiles
        (``StepResult.distributions``), or None (not kept that step).
      info: what hooks reported (``micro_norms_before_clip``, ...).
      micro: per micro-batch: index, start, size, loss, dropped, recorded, rows.
    """

    def __init__(self, path: Path):
        self.path = path
        with _reading(path):
            with zipfile.ZipFile(path) as z:
                meta = json.loads(str(read_array(z, "meta")[()]))
            self.step, self.loss, self.size = meta["step"], meta["loss"], meta["size"]
            self.stats, self.micro = dict(meta["stats"]), list(meta["micro"])
            self.update_ratios = meta.get("update_ratios")
            self.learning_rate = meta.get("learning_rate")
            self.distributions = meta.get("distributions")  # absent from older records
            self.info = meta.get("info", {})
            self._variables = dict(meta["variables"])
            self._encoded = dict(meta.get("encoded", {}))

    @property
    def mean(self) -> Gradients:
        """The mean gradient that was applied."""
        return self._grads("mean", loss=self.loss, size=self.size)

    def micro_grads(self, index: int) -> Gradients:
        """Micro-batch ``index``'s gradients (recorded with ``micro=True``)."""
        if not 0 <= index < len(self.micro) or not self.micro[index]["recorded"]:
            raise HostavgError(
                f"step {self.step} has no gradients recorded for micro-batch {index}; it has "
                f"{len(self.micro)} micro-batches, recorded: "
                f"{[m['index'] for m in self.micro if m['recorded']]} (Record(..., micro=True))")
        m = self.micro[index]
        return self._grads(f"micro/{index}", loss=m["loss"], size=m["size"])

    def _grads(self, prefix: str, **kw) -> Gradients:
        with _reading(self.path), zipfile.ZipFile(self.path) as z:
            values = {}
            for name, var in self._variables.items():
                shape = tuple(var["shape"])
                if var["sparse"]:
                    indices, rows = (self._array(z, f"{prefix}/{name}/{part}")
                                     for part in ("indices", "values"))
                    if indices.ndim != 1 or rows.shape != indices.shape + shape[1:]:
                        raise ValueError(f"{name!r} has {indices.shape} indices and {rows.shape} "
                                         f"rows; its metadata says rows of shape {shape[1:]}")
                    values[name] = SparseGradient(indices, rows, shape)
                else:
                    values[name] = self._array(z, f"{prefix}/{name}")
                    if values[name].shape != shape:
                        raise ValueError(f"{name!r} has shape {values[name].shape}; its metadata "
                                         f"says {shape}")
        return Gradients(values, **kw)

    def _array(self, archive, key: str) -> np.ndarray:
        return decode(read_array(archive, key), self._encoded.get(key))

    def __repr__(self) -> str:
        return f"RecordedStep(step={self.step}, loss={self.loss}, micro={len(self.micro)})"


class RecordReader:
    """The steps of a record folder, oldest first; see :func:`load_record`."""

    def __init__(self, path):
        if not isinstance(path, (str, os.PathLike)):
            raise HostavgError(f"load_record takes a record's folder (str or os.PathLike), got "
                               f"{path!r}")
        self.path = Path(path)
        if not self.path.is_dir():
            raise HostavgError(f"no record at {self.path}: not a folder")
        self._paths = dict(sorted(_listing(self.path).items()))
        self.steps = list(self._paths)

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return (self[s] for s in self.steps)

    def __getitem__(self, step: int) -> RecordedStep:
        if step not in self._paths:
            raise HostavgError(f"step {step} is not in the record {self.path}; it holds "
                               f"{len(self.steps)} steps, from {self.steps[:1]} to {self.steps[-1:]}")
        return RecordedStep(self._paths[step])

    def to_pandas(self):
        """One row per step: step, loss, size, learning_rate, the scalar statistics, and
        ``grad_norm_before_clip`` where :class:`~hostavg.hooks.ClipGlobalNorm` reported it."""
        pd = pandas("this table")
        rows = []
        for s in self:
            row = {"step": s.step, "loss": s.loss, "size": s.size,
                   "learning_rate": s.learning_rate, **{k: s.stats.get(k) for k in SCALARS}}
            if "grad_norm_before_clip" in s.info:
                row["grad_norm_before_clip"] = s.info["grad_norm_before_clip"]
            rows.append(row)
        return pd.DataFrame(rows).set_index("step")

    def micro_table(self):
        """One row per (step, micro-batch): start, size, loss, norm, dropped; and where known,
        ``norm_before_clip`` (:class:`~hostavg.hooks.ClipMicroBatchNorm`) and ``rows``."""
        pd = pandas("this table")
        rows = []
        for s in self:
            norms = s.stats.get("micro_norms") or [math.nan] * len(s.micro)
            before = s.info.get("micro_norms_before_clip")
            for i, (m, norm) in enumerate(zip(s.micro, norms)):
                row = {"step": s.step, "index": m["index"], "start": m["start"],
                       "size": m["size"], "loss": m["loss"], "norm": norm,
                       "dropped": m["dropped"]}
                if before is not None:
                    row["norm_before_clip"] = before[i]
                if m.get("rows") is not None:
                    row["rows"] = m["rows"]
                rows.append(row)
        return pd.DataFrame(rows).set_index(["step", "index"])

    def variable_norms(self, quantity: str = "grad_norm", micro: bool = False):
        """One row per step (or per step and micro-batch), one column per trained variable.

        Args:
          quantity: ``"grad_norm"``, the norm of each variable's applied mean
            gradient; or ``"update_ratio"``, |update| / |weights| of the apply.
          micro: with ``"grad_norm"``, one row per (step, micro-batch) of
            each micro-batch's gradient norm per variable instead.

        Example::

            record = hostavg.load_record("runs/record")
            record.variable_norms().tail()            # a variable stuck at 0 stands out
        """
        pd = pandas("this table")
        check_quantity(quantity)
        micro = flag("micro", micro)
        if micro and quantity != "grad_norm":
            raise HostavgError(f"micro=True tabulates each micro-batch's gradient norms, "
                               f"quantity='grad_norm'; got quantity={quantity!r}")
        rows, index = [], []
        for s in self:
            if micro:
                for m, norms in zip(s.micro, s.stats.get("micro_variable_norms") or ()):
                    rows.append(norms)
                    index.append((s.step, m["index"]))
            else:
                rows.append((s.stats.get("variable_norms") if quantity == "grad_norm"
                             else s.update_ratios) or {})
                index.append(s.step)
        names = ["step", "index"] if micro else ["step"]
        return pd.DataFrame(rows, index=pd.MultiIndex.from_tuples(index, names=names)
                            if micro else pd.Index(index, name="step"))

    def distributions(self, variable: str, quantity: str = "gradient"):
        """One variable's distribution over the recorded steps that kept one, as
        :meth:`hostavg.History.distributions`: indexed by step, a column per percentile."""
        return distributions.table([(s.step, s.distributions) for s in self], variable,
                                   quantity, "RecordReader.distributions")

    def __repr__(self) -> str:
        return f"RecordReader({str(self.path)!r}, {len(self.steps)} steps)"


def load_record(path) -> RecordReader:
    """Opens a record written by :class:`hostavg.hooks.Record`; gradients load lazily, per step."""
    return RecordReader(path)


class Record:
    """Appends every ``every``-th applied step to an on-disk record (see :mod:`hostavg.inspect.record`).

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
        self.micro, self.overwrite = flag("micro", micro), flag("overwrite", overwrite)
        self._writer = RecordWriter(path)
        self.path, self.every = self._writer.path, every
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
                f"Record: the folder {str(self.path)!r} already holds {len(later)} "
                f"step{'s' if len(later) != 1 else ''} at or after "
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
            "stats": {**{k: getattr(stats, k) for k in SCALARS},
                      "micro_norms": stats.micro_norms, "cosines": stats.cosines,
                      "variable_norms": stats.variable_norms,
                      "micro_variable_norms": stats.micro_variable_norms},
            "update_ratios": result.update_ratios, "learning_rate": result.learning_rate,
            "distributions": result.distributions,
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
