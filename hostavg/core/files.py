"""Files written whole or not at all, and read back whole or refused.

Written under a temporary name in the same folder, flushed, renamed. A temporary is named ``.<final name>.<pid>.<random>.tmp``, so a process killed
while writing leaves one that names its writer: :func:`remove_stale` deletes
those whose process is gone (checkpoints on every save, records when a
writer starts), and never one that a running process is still writing.

Read back (:func:`read_array`): every array of a NumPy ``.npz`` archive is read
to the end of its zip member, so that the member's CRC-32 is checked whatever
its ``.npy`` header says (``np.load`` stops after the values the header
announces: a damaged header that announces fewer would load wrong values
unchecked).
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from hostavg.core.errors import ArgumentError

__all__ = ["folder", "fsync_dir", "read_array", "remove_stale", "temporary"]

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]*\.tmp$")


def folder(path, name: str, holds: str) -> Path:
    """``path`` as a folder that exists and can be written, made with its parents if missing.

    Raises HostavgError naming the argument ``name`` (such as "checkpoint_dir")
    when ``path`` is not a path, is a file, cannot be made, or is not writable;
    ``holds`` says what the folder is for ("the checkpoints").
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"{name} must be a folder name (str or os.PathLike), got {path!r}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{name} {str(path)!r} is a file, not a folder; name a folder for "
                            f"{holds}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArgumentError(f"{name} {str(path)!r} cannot be made ({e.strerror}); name a folder "
                            f"that can") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgumentError(f"{name} {str(path)!r} is not writable; name a folder that is")
    return path


def temporary(final: Path) -> Path:
    """A new empty file beside ``final``, named for it and this process, to fill and rename onto it."""
    fd, path = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.{os.getpid()}.",
                                suffix=".tmp")
    os.close(fd)
    return Path(path)


def remove_stale(folder: Path, names: re.Pattern) -> None:
    """Deletes the temporaries in ``folder`` for final names that ``names`` matches whose writer is gone."""
    for path in folder.iterdir():
        m = _TEMPORARY.match(path.name)
        if m and names.match(m["name"]) and not _running(int(m["pid"])):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def fsync_dir(path: Path) -> None:
    """Makes a rename in ``path`` durable (where the platform allows opening folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_array(archive: zipfile.ZipFile, key: str) -> np.ndarray:
    """The array ``key`` of an open ``.npz`` archive, its whole member read so that its CRC-32 is checked.

    Raises whatever reading a damaged member raises (``zipfile.BadZipFile``
    for a CRC mismatch, ValueError for bytes its header does not describe,
    and the many types zipfile and NumPy's header parser raise); callers name
    the file.
    """
    with archive.open(key + ".npy") as member:
        array = np.lib.format.read_array(member, allow_pickle=False)
        if member.read(1):
            raise ValueError(f"{key!r} holds bytes after the array its header describes")
    return array
