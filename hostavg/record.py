"""An on-disk record of training steps: the mean gradient, each micro-batch's, and statistics.

Format (version 1): a folder holding one file per recorded step,
``step-<global step, 10 digits>.npz``, a NumPy zip archive that loads with
``allow_pickle=False``:

* ``meta``: a JSON string: ``format``, ``step``, ``loss``, ``size``,
  ``stats`` (the step's scalar statistics and ``micro_norms``/``cosines``
  lists), ``micro`` (per micro-batch: ``index``, ``start``, ``size``, ``loss``,
  ``dropped``, ``recorded``) and ``variables`` (name -> ``{"sparse": bool,
  "shape": [...]}``);
* ``mean/<name>``: the applied mean gradient of a dense variable, or
  ``mean/<name>/indices`` and ``mean/<name>/values`` for a sparse one;
* ``micro/<i>/<name>`` (and ``.../indices``, ``.../values``): micro-batch i's
  gradients, when recorded with ``micro=True``.

A step's file is written under a hidden temporary name, micro-batch by
micro-batch (so memory stays O(parameters)), and renamed into place only once
complete and flushed to disk: a crash mid-write leaves every earlier step
readable, and a reader never sees a partial step. Temporaries of killed writers
are deleted when the next writer starts (:mod:`hostavg.files`). A step's file
damaged on disk raises HostavgError naming it when read; the other steps stay
readable.
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

from hostavg.errors import HostavgError
from hostavg.files import remove_stale, temporary
from hostavg.gradients import Gradients, SparseGradient

__all__ = ["RecordedStep", "RecordReader", "RecordWriter", "load_record"]

FORMAT = 1
_NAME = re.compile(r"^step-(\d+)\.npz$")
_SCALARS = ("grad_norm", "g2", "trace_sigma", "b_simple", "norm_test", "inner_product_test",
            "orthogonality_test", "gsnr")


class RecordWriter:
    """Writes one step at a time into a record folder (used by :class:`hostavg.hooks.Record`)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        remove_stale(self.path, _NAME)
        self._zip = self._tmp = None

    def begin(self, step: int) -> None:
        """Starts step ``step``'s file, discarding any step begun and never finished."""
        self.abort()
        self._tmp = temporary(self.path / f"step-{step:010d}.npz")
        self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED, allowZip64=True)

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
        self._array("meta", np.array(json.dumps({"format": FORMAT, "step": step, **meta},
                                                default=_jsonable)))
        self._zip.close()
        with open(self._tmp, "rb+") as f:
            os.fsync(f.fileno())
        final = self.path / f"step-{step:010d}.npz"
        os.replace(self._tmp, final)
        self._zip = self._tmp = None
        return final

    def abort(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._tmp.unlink(missing_ok=True)
        self._zip = self._tmp = None

    def _array(self, key: str, array) -> None:
        with self._zip.open(key + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)


@contextmanager
def _reading(path: Path):
    """Turns what reading a damaged step file raises into a HostavgError naming the file."""
    try:
        yield
    except HostavgError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        raise HostavgError(f"the record's file {path} is damaged ({type(e).__name__}: {e}); the "
                           f"other steps stay readable: delete it, or read around it") from None


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
        ``micro_norms`` and ``cosines``).
      micro: per micro-batch: index, start, size, loss, dropped, recorded.
    """

    def __init__(self, path: Path):
        self.path = path
        with _reading(path):
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"][()]))
            self.step, self.loss, self.size = meta["step"], meta["loss"], meta["size"]
            self.stats, self.micro = dict(meta["stats"]), list(meta["micro"])
            self._variables = dict(meta["variables"])

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
        with _reading(self.path), np.load(self.path, allow_pickle=False) as z:
            values = {}
            for name, var in self._variables.items():
                if var["sparse"]:
                    values[name] = SparseGradient(z[f"{prefix}/{name}/indices"],
                                                  z[f"{prefix}/{name}/values"], var["shape"])
                else:
                    values[name] = z[f"{prefix}/{name}"]
        return Gradients(values, **kw)

    def __repr__(self) -> str:
        return f"RecordedStep(step={self.step}, loss={self.loss}, micro={len(self.micro)})"


class RecordReader:
    """The steps of a record folder, oldest first; see :func:`load_record`."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise HostavgError(f"no record at {self.path}: not a folder")
        found = sorted((int(m.group(1)), p) for p in self.path.iterdir()
                       if (m := _NAME.match(p.name)))
        self.steps = [s for s, _ in found]
        self._paths = dict(found)

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
        """One row per step: step, loss, size, and the scalar statistics."""
        pd = _pandas()
        return pd.DataFrame([{"step": s.step, "loss": s.loss, "size": s.size,
                              **{k: s.stats.get(k) for k in _SCALARS}} for s in self]
                            ).set_index("step")

    def micro_table(self):
        """One row per (step, micro-batch): start, size, loss, norm, dropped."""
        pd = _pandas()
        rows = []
        for s in self:
            norms = s.stats.get("micro_norms") or [math.nan] * len(s.micro)
            rows += [{"step": s.step, "index": m["index"], "start": m["start"], "size": m["size"],
                      "loss": m["loss"], "norm": norm, "dropped": m["dropped"]}
                     for m, norm in zip(s.micro, norms)]
        return pd.DataFrame(rows).set_index(["step", "index"])

    def __repr__(self) -> str:
        return f"RecordReader({str(self.path)!r}, {len(self.steps)} steps)"


def load_record(path) -> RecordReader:
    """Opens a record written by :class:`hostavg.hooks.Record`; gradients load lazily, per step."""
    return RecordReader(path)


def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise HostavgError("this table needs pandas: pip install pandas") from None
    return pd
