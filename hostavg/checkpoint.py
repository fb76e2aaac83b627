"""Checkpoints: every variable of the model, plus fit's position, in one atomic file.

Format: one NumPy ``.npz`` file (loads with ``allow_pickle=False``). Each
variable (model weights, optimizer slots, the global step) is the array
``var/<name>``: for a TF1 graph, each global variable by ``var.op.name``; for a
Keras model, ``model/<i>`` and ``optimizer/<i>`` by position (see
:mod:`hostavg.keras`); the array ``meta`` is a JSON string with the format
version, each variable's shape and dtype, and, when fit wrote it, fit's
position (epoch, batch, seed) and its History.

Atomic: the file is written under a temporary name in the same folder,
flushed to disk, then renamed into place, so a crash while saving never leaves
a file under a checkpoint's name. Only names ``ckpt-<global step>.npz`` count as
checkpoints of a folder.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import tensorflow as tf

from hostavg.errors import HostavgError, positive_int
from hostavg.graph import load_variables

v1 = tf.compat.v1

__all__ = ["CheckpointDir", "read", "restore", "save", "write"]

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")


def write(path, values: Mapping[str, np.ndarray], *, fit: dict | None = None) -> Path:
    """Writes the named arrays ``values`` (and ``fit``'s state) to ``path`` atomically."""
    path = Path(path)
    arrays = {f"var/{name}": np.asarray(value) for name, value in values.items()}
    meta = {"format": FORMAT,
            "variables": {name: [list(a.shape), a.dtype.str]
                          for name, a in zip(values, arrays.values())},
            "fit": fit}
    arrays["meta"] = np.array(json.dumps(meta))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def read(path, forms: Mapping[str, tuple], where: str = "the model") -> tuple[dict, dict | None]:
    """The arrays of ``path``, checked against ``forms`` (name -> (shape, NumPy dtype)), and fit's state.

    Raises:
      HostavgError: when the file is not a hostavg checkpoint, or was written
        by a different model (arrays missing, unexpected, or of another
        shape or dtype than ``forms`` say).
    """
    _refuse_saver_checkpoint(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"][()]))
            stored = {name: z[f"var/{name}"] for name in meta["variables"]}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise HostavgError(f"{path} is not a readable hostavg checkpoint ({e})") from None
    missing = [n for n in forms if n not in stored]
    extra = [n for n in stored if n not in forms]
    wrong = [f"{n!r}: {stored[n].shape} {stored[n].dtype} in the checkpoint, {tuple(shape)} "
             f"{np.dtype(dtype).name} in {where}"
             for n, (shape, dtype) in forms.items()
             if n in stored and (stored[n].shape != tuple(shape) or stored[n].dtype != dtype)]
    if missing or extra or wrong:
        raise HostavgError(
            f"checkpoint {path} was written by a different model: missing {_few(list(map(repr, missing)))}, "
            f"unexpected {_few(list(map(repr, extra)))}, mismatched {_few(wrong)}; restore it into the model "
            f"that wrote it, or use another checkpoint directory")
    return stored, meta["fit"]


def save(graph, sess, path, *, fit: dict | None = None) -> Path:
    """Writes every global variable of ``graph`` (and ``fit``'s state) to ``path`` atomically."""
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return write(path, dict(zip([v.op.name for v in variables], sess.run(variables))), fit=fit)


def restore(graph, sess, path) -> dict | None:
    """Loads ``path`` into the variables of ``graph``; returns fit's state, or None.

    Raises:
      HostavgError: see :func:`read`; no variable is changed then.
    """
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    stored, fit = read(path, {v.op.name: (v.shape.as_list(), v.dtype.base_dtype.as_numpy_dtype)
                              for v in variables}, "the graph")
    load_variables(sess, variables, [stored[v.op.name] for v in variables])
    return fit


def _refuse_saver_checkpoint(path) -> None:
    """Raises HostavgError when ``path`` is a ``tf.train.Saver`` checkpoint (a prefix, its files, its folder)."""
    path = Path(path)
    prefix = re.sub(r"\.(index|meta|data-\d+-of-\d+)$", "", str(path))
    if Path(prefix + ".index").exists() or (path.is_dir() and (path / "checkpoint").exists()):
        shown = prefix if not path.is_dir() else v1.train.latest_checkpoint(str(path)) or path
        raise HostavgError(
            f"{path} is a tf.train.Saver checkpoint, not one of hostavg's: restore it with "
            f"saver.restore(sess, {str(shown)!r}); trainer.restore reads the .npz files that "
            f"trainer.save and fit(checkpoint_dir=...) write")


class CheckpointDir:
    """A folder of checkpoints ``ckpt-<global step>.npz``, keeping the newest ``keep``.

    Attributes:
      path: the folder.
      keep: how many checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, path, keep: int = 3):
        self.keep = positive_int("keep", keep)
        self.path = Path(path)

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints, oldest first."""
        if not self.path.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, write: Callable[[Path], object]) -> Path:
        """Has ``write(path)`` write the checkpoint of global step ``step``, then deletes the oldest beyond ``keep``."""
        path = self.path / f"ckpt-{step:010d}.npz"
        write(path)
        for old in self.checkpoints()[:-self.keep]:
            old.unlink(missing_ok=True)
        return path


def _few(items: list, shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return "[" + ", ".join(items[:shown]) + "]" + more


def _fsync_dir(path: Path) -> None:
    """Makes a rename in ``path`` durable (where the platform allows opening folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
