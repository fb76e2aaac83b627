"""A step's micro-batches less the samples a hook left out (``skip_samples``,
:class:`~hostavg.hooks.SkipBadSamples`). Pure NumPy.

Where a step fails on samples it can name (the culprits of a micro-batch whose own
loss or gradients are non-finite, that the framework refuses, or that ``prepare``
refuses: :mod:`~hostavg.engine.culprits`), the engine asks its ``skip_samples``
hooks which of them to leave out, cuts those out of their micro-batch
(:class:`Skipping`) and computes the step again from its start. Each try leaves out
at least one more sample, so a step ends after at most as many tries as it has
samples; one with no bad sample runs once, as without the hook.
"""

from __future__ import annotations

import numpy as np

from hostavg.core.errors import HostavgError
from hostavg.core.gradients import freeze
from hostavg.core.results import Culprit
from hostavg.core.split import feed_size, take
from hostavg.engine import culprits

__all__ = ["Skipping"]


class Skipping:
    """The micro-batches of one step as given, and the samples left out of each so far.

    ``feeds``, ``sizes``, ``rows``: as the step was given them. :attr:`feeds`,
    :attr:`sizes` and :attr:`rows` are what remains, :attr:`emptied` the
    micro-batches nothing remains of, :attr:`skipped` the samples left out of each
    micro-batch (:class:`~hostavg.core.results.Culprit` s at their position among
    the step's samples as given).
    """

    def __init__(self, feeds, sizes, rows):
        self._given, self._sizes, self._rows = list(feeds), sizes, rows
        self.feeds, self.sizes, self.rows = self._given, sizes, rows
        self._kept: dict[int, np.ndarray] = {}  # micro-batch -> its samples that remain
        self.skipped = [()] * len(self._given)
        self.emptied = frozenset()

    def leave_out(self, error: HostavgError, chosen) -> bool:
        """Leaves out the samples ``chosen`` (a subset of ``error.culprits``) of the micro-batch
        ``error`` names (``.micro_batch``, ``.start``); False where there are none to leave out."""
        i, start = getattr(error, "micro_batch", None), getattr(error, "start", None)
        if i is None or start is None or not chosen:
            return False
        n = self._size(i)
        kept = self._kept.get(i, np.arange(n))
        local = {c.sample - start for c in chosen}
        if not local or not all(0 <= j < len(kept) for j in local):
            return False
        first = sum(self._size(m) for m in range(i))  # the micro-batch's start as given
        self.skipped[i] = tuple(sorted(self.skipped[i] + tuple(
            Culprit(first + int(kept[c.sample - start]), c.row, c.reason) for c in chosen),
            key=lambda c: c.sample))
        self._kept[i] = np.array([j for k, j in enumerate(kept) if k not in local], np.int64)
        self._cut()
        return True

    def _size(self, i: int) -> int:
        """Micro-batch ``i``'s number of samples as given."""
        if self._sizes is not None:
            return int(self._sizes[i])
        return feed_size(self._given[i], f"micro-batch {i}")

    def _cut(self) -> None:
        """:attr:`feeds`, :attr:`sizes`, :attr:`rows` and :attr:`emptied` from what remains."""
        feeds, sizes, rows = list(self._given), None if self._sizes is None else list(self._sizes), \
            None if self._rows is None else list(self._rows)
        for i, kept in self._kept.items():
            n = self._size(i)
            blocks = culprits.block_counts(culprits.sample_arrays(self._given[i], n))
            feeds[i] = take(self._given[i], kept, n, blocks)
            if sizes is not None:
                sizes[i] = len(kept)
            if rows is not None:
                rows[i] = freeze(np.asarray(self._rows[i])[kept])
        self.feeds, self.sizes, self.rows = feeds, sizes, rows
        self.emptied = frozenset(i for i, kept in self._kept.items() if not len(kept))
