"""Checkpoints: every variable of the model, plus fit's position, in one atomic file.

Format: one NumPy ``.npz`` file (loads with ``allow_pickle=False``): each
variable as the array ``var/<name>``, by the name its backend gives it, and
``meta``, a JSON string with the format version, each variable's shape and
dtype and, when fit wrote it, fit's state (position, ``batch_size``,
``seed``, History).

Atomic: written under a temporary name, flushed, then renamed into place; a
Ctrl-C or SIGTERM meanwhile acts once that is done.
Restoring reads and checks everything first and changes nothing unless all
of it is sound; a damaged file raises HostavgError naming it.

See docs/guides/training.md for the format and the checks in detail.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from hostavg.core.dtypes import EXTENDED, decode, encode, name_of
from hostavg.core.errors import ArgumentError, HostavgError, StepError, positive_int
from hostavg.core.files import folder, fsync_dir, read_array, remove_stale, temporary
from hostavg.engine.signals import held
from hostavg.train.history import History

__all__ = ["CheckpointDir", "read", "restore", "save", "write"]

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")
#: fit's state: key -> the least value it may hold ("batch_size" None too: the data gave its
#: own batches). "pass", the passes over the data begun, is absent from 0.1.0's checkpoints,
#: whose fit made one pass per epoch.
_FIT = {"epoch": 0, "batch": 0, "samples": 0, "batch_size": 1, "seed": 0}
_FIT_OPTIONAL = {"pass": 0}


def write(path, values: Mapping[str, np.ndarray], *, fit: dict | None = None) -> Path:
    """Writes the named arrays ``values`` (and ``fit``'s state) to ``path`` atomically.

    Raises:
      HostavgError: naming ``path`` when it is not a path, or cannot be written
        (nothing is left behind then).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"a checkpoint's path must be a file name (str or os.PathLike), got "
                            f"{path!r}")
    path = Path(path)
    arrays, forms = {}, {}
    for name, value in values.items():
        array = np.asarray(value)
        arrays[f"var/{name}"] = encode(array)[0]
        forms[name] = [list(array.shape), name_of(array.dtype)]
    arrays["meta"] = np.array(json.dumps({"format": FORMAT, "variables": forms, "fit": fit}))
    above = next(p for p in path.parents if p.exists())
    if not above.is_dir():
        raise ArgumentError(f"cannot write the checkpoint {str(path)!r}: {str(above)!r} is a file, "
                            f"not a folder")
    with held():  # a Ctrl-C or SIGTERM acts once the file is whole
        _write(path, arrays)
    return path


def _write(path: Path, arrays: dict) -> None:
    """np.savez of ``arrays`` to a temporary file renamed to ``path``, and fsync'd."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary(path)
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise StepError(f"cannot write the checkpoint {str(path)!r} "
                        f"({e.strerror or type(e).__name__}); name a file in a folder that can "
                        f"be written") from None
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def read(path, forms: Mapping[str, tuple], where: str = "the model") -> tuple[dict, dict | None]:
    """The arrays of ``path``, checked against ``forms`` (name -> (shape, NumPy dtype)), and fit's state.

    Raises:
      HostavgError: when the file is not a sound hostavg checkpoint
        (unreadable, damaged metadata, arrays that
        disagree with it, a malformed fit state), or was written by a
        different model (arrays missing, unexpected, or of another shape or
        dtype than ``forms`` say).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"a checkpoint's path must be a file name (str or os.PathLike), got "
                            f"{path!r}")
    try:
        with zipfile.ZipFile(path) as z:
            meta = json.loads(str(read_array(z, "meta")[()]))
            written, fit = _check_meta(meta)
            stored = {name: read_array(z, f"var/{name}") for name in written}
    except _Damaged as e:
        raise ArgumentError(f"checkpoint {path} is damaged: {e}; use another checkpoint") from None
    except Exception as e:  # noqa: BLE001 - a damaged zip or .npy header raises a dozen types
        raise ArgumentError(f"{path} is not a readable hostavg checkpoint "
                            f"({type(e).__name__}: {e})") from None
    damaged = []
    for name, array in stored.items():
        shape, dtype = tuple(written[name][0]), written[name][1]
        if dtype in EXTENDED:
            try:
                array = stored[name] = decode(array, dtype)
            except ValueError as e:
                damaged.append(f"{name!r}: {e}")
                continue
        if (array.shape, name_of(array.dtype)) != (shape, dtype):
            damaged.append(f"{name!r} is {array.shape} {name_of(array.dtype)}, its metadata says "
                           f"{shape} {dtype}")
    if damaged:
        raise ArgumentError(f"checkpoint {path} is damaged: {_few(damaged)}; use another checkpoint")
    missing = [n for n in forms if n not in stored]
    extra = [n for n in stored if n not in forms]
    wrong = [f"{n!r}: {stored[n].shape} {stored[n].dtype} in the checkpoint, {tuple(shape)} "
             f"{np.dtype(dtype).name} in {where}"
             for n, (shape, dtype) in forms.items()
             if n in stored and (stored[n].shape != tuple(shape) or stored[n].dtype != dtype)]
    if missing or extra or wrong:
        raise ArgumentError(
            f"checkpoint {path} was written by a different model: missing {_few(list(map(repr, missing)))}, "
            f"unexpected {_few(list(map(repr, extra)))}, mismatched {_few(wrong)}; restore it into the model "
            f"that wrote it, or use another checkpoint directory")
    return stored, fit


def save(backend, path, *, fit: dict | None = None) -> Path:
    """Writes every variable of ``backend`` (:meth:`~hostavg.engine.protocols.Backend.variables`:
    model, optimizer state, global step), and ``fit``'s state, to ``path`` atomically."""
    return write(path, backend.variables(), fit=fit)


def restore(backend, path) -> dict | None:
    """Loads ``path`` into the variables of ``backend``; returns fit's state, or None.

    Raises:
      HostavgError: see :func:`read`; no variable is changed then.
    """
    now = backend.variables()
    stored, fit = read(path, {name: (np.shape(value), np.asarray(value).dtype)
                              for name, value in now.items()})
    backend.assign(stored)
    return fit


class _Damaged(Exception):
    """What is wrong with a checkpoint's metadata."""


def _check_meta(meta) -> tuple[dict, dict | None]:
    """(name -> (shape, dtype str), fit's state or None) of a checkpoint's metadata; raises _Damaged."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _Damaged(f"its metadata is not hostavg's format {FORMAT}: {str(meta)[:80]!r}")
    forms, fit = meta.get("variables"), meta.get("fit")
    if not isinstance(forms, dict) or not all(
            isinstance(f, list) and len(f) == 2 and isinstance(f[0], list)
            and all(isinstance(d, int) and d >= 0 for d in f[0]) and isinstance(f[1], str)
            for f in forms.values()):
        raise _Damaged(f"its metadata's variables are not name -> [shape, dtype]: "
                       f"{str(forms)[:80]!r}")
    if fit is None:
        return forms, None
    if not isinstance(fit, dict) or not {*_FIT, "history"} <= set(fit) <= {*_FIT, *_FIT_OPTIONAL,
                                                                            "history"}:
        raise _Damaged(f"fit's state must hold exactly {sorted({*_FIT, 'history'})} (and "
                       f"{sorted(_FIT_OPTIONAL)}), got "
                       f"{sorted(fit) if isinstance(fit, dict) else fit!r}")
    bad = [f"{k} {fit[k]!r}" for k, least in {**_FIT, **_FIT_OPTIONAL}.items()
           if k in fit and not (k == "batch_size" and fit[k] is None)
           and (isinstance(fit[k], bool) or not isinstance(fit[k], numbers.Integral)
                or fit[k] < least)]
    if bad:
        raise _Damaged(f"fit's state has {', '.join(bad)}")
    try:
        History.from_json(fit["history"])
    except HostavgError as e:
        raise _Damaged(f"fit's history: {e}") from None
    return forms, fit


class CheckpointDir:
    """A folder of checkpoints ``ckpt-<global step>.npz``, keeping the newest ``keep``.

    Made (with its parents) if missing; a path that is a file, or a folder
    that cannot be made or written, is refused at once, before any training.

    Attributes:
      path: the folder.
      keep: how many checkpoints to keep (older ones are deleted after a save).
    """

    def __init__(self, path, keep: int = 3):
        self.keep = positive_int("keep", keep)
        self.path = folder(path, "checkpoint_dir", "the checkpoints")

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
        """Has ``write(path)`` write checkpoint ``step``; deletes all but the newest ``keep`` and stale temporaries."""
        path = self.path / f"ckpt-{step:010d}.npz"
        write(path)
        for old in self.checkpoints()[:-self.keep]:
            old.unlink(missing_ok=True)
        remove_stale(self.path, _NAME)
        return path


def _few(items: list, shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return "[" + ", ".join(items[:shown]) + "]" + more
