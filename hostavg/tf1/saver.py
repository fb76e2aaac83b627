"""Checkpoints that a ``tf.train.Saver`` wrote, which ``trainer.restore`` refuses by name.

hostavg's checkpoints are ``.npz`` files (:mod:`hostavg.train.checkpoint`); a TF1
program often keeps a Saver beside the Trainer, and its prefix, files or folder
given to ``trainer.restore`` get the Saver's own call to make instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hostavg.core.errors import ArgumentError

__all__ = ["refuse_saver_checkpoint"]


def refuse_saver_checkpoint(path) -> None:
    """Raises HostavgError when ``path`` is a ``tf.train.Saver`` checkpoint (a prefix, its
    files, its folder), naming the prefix to restore with the Saver; nothing else where it is
    not a path (the checkpoint reader names the argument)."""
    if not isinstance(path, (str, os.PathLike)):
        return
    path = Path(path)
    prefix = re.sub(r"\.(index|meta|data-\d+-of-\d+)$", "", str(path))
    if Path(prefix + ".index").exists() or (path.is_dir() and (path / "checkpoint").exists()):
        shown = prefix if not path.is_dir() else _saver_latest(path) or path
        raise ArgumentError(
            f"{path} is a tf.train.Saver checkpoint, not one of hostavg's: restore it with "
            f"saver.restore(sess, {str(shown)!r}); trainer.restore reads the .npz files that "
            f"trainer.save and fit(checkpoint_dir=...) write")


def _saver_latest(folder: Path) -> str | None:
    """The newest checkpoint a ``tf.train.Saver`` folder's ``checkpoint`` file names, or None."""
    try:
        text = (folder / "checkpoint").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', text, re.M)
    if found is None:
        return None
    name = found.group(1)
    return name if os.path.isabs(name) else str(folder / name)
