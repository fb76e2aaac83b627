"""An on-disk record of training steps: the mean gradient, each micro-batch's, and statistics.

Format (version 3): a folder holding one file per recorded step,
``step-<global step, 10 digits>.npz``, a NumPy zip archive that loads with
``allow_pickle=False``: ``meta`` (a JSON string: every quantity of
:data:`hostavg.core.schema.QUANTITIES` and user statistic by name with its
kind, each micro-batch's bookkeeping, the variables), ``mean/<name>`` (the
applied mean gradient; ``.../indices`` and ``.../values`` for a sparse one)
and, recorded with ``micro=True``, ``micro/<i>/<name>``. Versions 1 and 2
still read.

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

from hostavg.core import display, distributions, schema
from hostavg.core.dtypes import decode, encode
from hostavg.core.errors import ArgumentError, HostavgError, flag, positive_int
from hostavg.core.files import folder, read_array, remove_stale, temporary
from hostavg.core.gradients import Gradients, SparseGradient
from hostavg.core.optional import pandas
from hostavg.core.results import check_quantity

__all__ = ["FORMAT", "Record", "RecordedStep", "RecordReader", "RecordWriter", "load_record"]

FORMAT = 3
_NAME = re.compile(r"^step-(\d+)\.npz$")
#: Format 2's statistics, kept under "stats" by their StepStats names.
_STATS_2 = ("grad_norm", "g2", "trace_sigma", "b_simple", "norm_test", "inner_product_test",
            "orthogonality_test", "gsnr", "micro_norms", "variable_norms", "micro_variable_norms")


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
        raise ArgumentError(f"the record's file {path} is damaged ({type(e).__name__}: {e}); the "
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
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"cannot write {type(value).__name__} to a record")


def _format_2(meta: dict, micro: list, info: dict) -> tuple[dict, dict]:
    """A format 1 or 2 step's meta as format 3's values and kinds (what it lacks as None)."""
    stats = meta["stats"]
    cosines = stats.get("cosines")
    if cosines is not None:
        kept = iter(cosines)
        cosines = [math.nan if m["dropped"] is not None else next(kept) for m in micro]
    values = {"step": meta["step"], "loss": meta["loss"], "size": meta["size"],
              **{k: stats.get(k) for k in _STATS_2}, "cosines": cosines,
              "update_ratios": meta.get("update_ratios"),
              "learning_rate": meta.get("learning_rate"),
              "distributions": meta.get("distributions"),
              "micro_losses": [m["loss"] for m in micro],
              "micro_norms_before_clip": info.get("micro_norms_before_clip"),
              "grad_norm_before_clip": info.get("grad_norm_before_clip"),
              "dropped": [m["index"] for m in micro if m["dropped"] is not None],
              "nonfinite_rows": []}
    return values, {q.name: q.kind for q in schema.QUANTITIES}


class RecordedStep:
    """One recorded step; its gradients are read from disk only when asked for.

    Attributes:
      step, loss, size: the global step, mean loss and samples.
      values: name -> value of every quantity (:data:`hostavg.core.schema.QUANTITIES`)
        and user statistic the step holds, in its plain form.
      kinds: name -> :class:`~hostavg.core.schema.Kind` of each of ``values``.
      statistics: name -> value of each user statistic.
      info: what hooks reported that JSON can hold.
      micro: per micro-batch: index, start, size, loss, dropped, recorded, rows.
    """

    def __init__(self, path: Path):
        self.path = path
        with _reading(path):
            with zipfile.ZipFile(path) as z:
                meta = json.loads(str(read_array(z, "meta")[()]))
            self.micro, self.info = list(meta["micro"]), meta.get("info", {})
            if meta.get("format", 1) >= 3:
                values = meta["values"]
                self.kinds = {n: schema.Kind(k) for n, k in meta["kinds"].items()}
            else:
                values, self.kinds = _format_2(meta, self.micro, self.info)
            self.values = {n: schema.plain(self.kinds[n], v) for n, v in values.items()}
            self.step, self.loss, self.size = (self.values[k] for k in ("step", "loss", "size"))
            self._variables = dict(meta["variables"])
            self._encoded = dict(meta.get("encoded", {}))
        self.statistics = {n: v for n, v in self.values.items() if schema.by_name(n) is None}

    @property
    def stats(self) -> dict:
        """The statistics by their :class:`~hostavg.StepStats` names (a view of ``values``;
        ``cosines`` NaN for a dropped micro-batch)."""
        return {k: self.values.get(k) for k in (*_STATS_2, "cosines")}

    @property
    def update_ratios(self) -> dict | None:
        """name -> |update| / |weights| of the apply, or None."""
        return self.values.get("update_ratios")

    @property
    def learning_rate(self) -> float | None:
        """The optimizer's learning rate at the apply, or None."""
        return self.values.get("learning_rate")

    @property
    def distributions(self) -> dict | None:
        """quantity -> variable -> nine percentiles, or None (not kept that step)."""
        return self.values.get("distributions")

    @property
    def mean(self) -> Gradients:
        """The mean gradient that was applied."""
        return self._grads("mean", loss=self.loss, size=self.size)

    def micro_grads(self, index: int) -> Gradients:
        """Micro-batch ``index``'s gradients (recorded with ``micro=True``)."""
        if not 0 <= index < len(self.micro) or not self.micro[index]["recorded"]:
            raise ArgumentError(
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
        return display.summary("RecordedStep", {"step": self.step, "loss": self.loss,
                                                "size": self.size, "micro": len(self.micro)})


class RecordReader:
    """The steps of a record folder, oldest first; see :func:`load_record`."""

    def __init__(self, path):
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentError(f"load_record takes a record's folder (str or os.PathLike), got "
                                f"{path!r}")
        self.path = Path(path)
        if not self.path.is_dir():
            raise ArgumentError(f"no record at {self.path}: not a folder")
        self._paths = dict(sorted(_listing(self.path).items()))
        self.steps = list(self._paths)

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return (self[s] for s in self.steps)

    def __getitem__(self, step: int) -> RecordedStep:
        if step not in self._paths:
            raise ArgumentError(f"step {step} is not in the record {self.path}; it holds "
                                f"{len(self.steps)} steps, from {self.steps[:1]} to {self.steps[-1:]}")
        return RecordedStep(self._paths[step])

    def to_pandas(self):
        """One row per step, indexed by ``step``: every per-step quantity
        (:data:`hostavg.core.schema.QUANTITIES`: loss, size, grad_norm, ..., learning_rate,
        grad_norm_before_clip) and per-step user statistic (NaN where a step lacks it)."""
        pd = pandas("this table")
        steps = list(self)
        names = [q.name for q in schema.QUANTITIES if q.kind is schema.Kind.STEP] + list(
            dict.fromkeys(n for s in steps for n, v in s.statistics.items()
                          if s.kinds[n] is schema.Kind.STEP))
        return pd.DataFrame([[s.values.get(n) for n in names] for s in steps],
                            columns=names).set_index("step")

    def micro_table(self):
        """One row per micro-batch, indexed by (``step``, micro-batch ``index``): as
        :meth:`hostavg.StepResult.micro_table` (``start``, ``size``, each per-micro-batch
        quantity and statistic the step holds, ``dropped``, ``rows`` where known)."""
        pd = pandas("this table")
        rows = []
        for s in self:
            columns = schema.micro_columns(s.values, s.statistics)
            for i, m in enumerate(s.micro):
                row = {"step": s.step, "index": m["index"], "start": m["start"],
                       "size": m["size"], **{c: v[i] for c, v in columns.items()},
                       "dropped": m["dropped"]}
                if m.get("rows") is not None:
                    row["rows"] = m["rows"]
                rows.append(row)
        return pd.DataFrame(rows).set_index(["step", "index"])

    def statistic(self, name: str):
        """One quantity or user statistic over the recorded steps, as
        :meth:`hostavg.History.statistic`: a pandas DataFrame indexed by step."""
        steps = list(self)
        kinds = [s.kinds[name] for s in steps if name in s.kinds]
        if not kinds:
            known = sorted({n for s in steps for n in s.kinds})
            raise ArgumentError(f"RecordReader.statistic: no quantity or statistic {name!r} in "
                                f"the record {str(self.path)!r}; it holds {known}")
        return schema.frame(name, kinds[0], [(s.step, s.values.get(name)) for s in steps],
                            "RecordReader.statistic")

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
            raise ArgumentError(f"micro=True tabulates each micro-batch's gradient norms, "
                                f"quantity='grad_norm'; got quantity={quantity!r}")
        rows, index = [], []
        for s in self:
            if micro:
                for m, norms in zip(s.micro, s.values.get("micro_variable_norms") or ()):
                    rows.append(norms)
                    index.append((s.step, m["index"]))
            else:
                rows.append(s.values.get("variable_norms" if quantity == "grad_norm"
                                         else "update_ratios") or {})
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
        return display.shortened(f"RecordReader({str(self.path)!r}, {len(self.steps)} steps)")

    def _repr_html_(self) -> str:
        shown, hidden = display.ends(self.steps)
        rows = []
        for number in shown:  # read lazily: the steps a table shows, not the whole record
            s = self[number]
            rows.append([s.step, s.loss, s.size, s.values.get("grad_norm"), len(s.micro),
                         sum(m["recorded"] for m in s.micro)])
        return display.html(f"Record at {self.path}: {len(self)} steps",
                            ["step", "loss", "size", "grad_norm", "micro-batches",
                             "gradients recorded"] if rows else [], rows, hidden=hidden)


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

    reads_model = False  # it writes the record's gradients alone
    drops = False  # nor does it drop a micro-batch: no snapshot before each compute

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
            raise ArgumentError(
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
        values = {**schema.read(result), **result.statistics}
        self._writer.finish(result.step, {
            "values": values,
            "kinds": {**{q.name: q.kind.value for q in schema.QUANTITIES},
                      **{n: schema.kind_of(v).value for n, v in result.statistics.items()}},
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
