"""What fit iterates: a source of batches (:class:`BatchSource`) and what it validates (:class:`Validation`).

Each face builds its source from the data as its users give it (the TF1 face
in :mod:`hostavg.tf1.sources`, the Keras face in :mod:`hostavg.keras.data`),
after fit's arguments are checked, and hands it to :func:`hostavg.train.loop.fit`
with its :class:`Validation`. Two sources serve both faces: :class:`ArraySource`
(arrays fit cuts into batches) and :class:`IterableSource` (an iterable's own batches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from hostavg.core.errors import ArgumentError, flag, positive_int
from hostavg.core.split import as_arrays, feed_size, take

__all__ = ["ArraySource", "BatchSource", "IterableSource", "Validation", "refuse_endless",
           "checked_validation_freq"]


class BatchSource(Protocol):
    """Where fit takes each pass's batches from.

    A pass's order depends only on (seed, pass), so that a resumed fit
    continues at its position bit for bit.
    """

    #: The samples it holds, or None where unknown (or where it gives its own batches).
    n: int | None
    #: Whether it serves one pass only (an iterator).
    one_shot: bool
    #: Whether its passes are known never to end (a dataset's ``.repeat()``).
    endless: bool

    def num_batches(self, drop_remainder: bool) -> int | None:
        """The batches of a pass (a short last one dropped with ``drop_remainder``), or None
        where it cannot tell."""

    def batches(self, data_pass: int, seed: int, batch: int, samples: int) -> Iterator[tuple]:
        """(batch, its data rows or None where unknown) of pass ``data_pass``, from where fit
        stands in it on: ``batch`` batches and ``samples`` samples taken."""


class ArraySource:
    """A batch of arrays (a feed dict, or a tuple (x, y)) cut into batches by (shuffled) index.

    The order depends only on (seed, pass).
    """

    one_shot = endless = False

    def __init__(self, data, batch_size, shuffle, blocks=None):
        self.shuffle = flag("shuffle", shuffle)
        self.data = as_arrays(data, "data")  # lists made arrays once, not at every batch
        self.n = feed_size(self.data, "data", blocks)
        self.batch_size, self.blocks = batch_size, blocks

    def num_batches(self, drop_remainder):
        return self.n // self.batch_size if drop_remainder else -(-self.n // self.batch_size)

    def batches(self, data_pass, seed, batch, samples):
        """From sample ``samples`` of the pass's order on (``batch`` is unused)."""
        order = np.random.default_rng([seed, data_pass]).permutation(self.n) if self.shuffle \
            else np.arange(self.n)
        for start in range(samples, self.n, self.batch_size):
            rows = order[start:start + self.batch_size]
            yield take(self.data, rows if self.shuffle else slice(start, start + self.batch_size),
                       self.n, self.blocks), rows


class IterableSource:
    """The batches of an iterable (or of a callable returning one per pass), each made ready by
    ``conform(batch, what)``; its rows are the iterable's own, so fit can't tell them."""

    n = None  # how many samples its batches hold is unknown until read
    endless = False  # an iterable may never end, but nothing tells beforehand

    def __init__(self, data, conform):
        self.data, self.conform = data, conform

    @property
    def one_shot(self) -> bool:
        """Whether ``data`` is an iterator (a generator), which serves one pass only."""
        return not callable(self.data) and iter(self.data) is self.data

    def num_batches(self, drop_remainder):
        return len(self.data) if hasattr(self.data, "__len__") else None

    def batches(self, data_pass, seed, batch, samples):
        """From batch ``batch`` on: the iterable's own, so samples are not counted."""
        it = iter(self.data() if callable(self.data) else self.data)
        for i, feed in enumerate(it):
            if i >= batch:  # which rows of the user's data a batch holds, fit can't tell
                yield self.conform(feed, f"batch {i} of epoch {data_pass}"), None


def refuse_endless(source: BatchSource, steps_per_epoch) -> None:
    """Raises HostavgError for a source known never to end (a dataset's ``.repeat()``) without
    ``steps_per_epoch``: its first epoch would never end."""
    if source.endless and steps_per_epoch is None:
        raise ArgumentError(
            "the data never ends (a dataset of infinite cardinality: .repeat() without a "
            "count), so without steps_per_epoch the first epoch would never end; pass "
            "steps_per_epoch=, the number of steps (batches) per epoch")


def checked_validation_freq(freq) -> int | frozenset:
    """fit's ``validation_freq``, checked: every that many epochs (an int), or the epochs listed
    (counted from 1), as a frozenset."""
    if isinstance(freq, (list, tuple, set, frozenset)):
        return frozenset(positive_int("validation_freq's epochs", e) for e in freq)
    return positive_int("validation_freq", freq)


@dataclasses.dataclass(frozen=True)
class Validation:
    """What fit evaluates at the end of an epoch, and after which epochs.

    Attributes:
      chunks: the batches to evaluate, iterated afresh at each due epoch.
      freq: :func:`checked_validation_freq`'s: every that many epochs, or those listed (from 1).
      metrics: what the backend's evaluate takes beside the chunks (the TF1 face's
        metric tensors by name), or None.
      listeners: told of the evaluation, or None: an object whose ``validating(chunks)``
        gives the chunks and whose ``validated(logs)`` hears the results (Keras callbacks).
    """

    chunks: Iterable
    freq: int | frozenset
    metrics: Mapping | None = None
    listeners: Any = None

    def due(self, epoch: int) -> bool:
        """Whether fit validates at the end of ``epoch`` (counted from 0)."""
        return epoch + 1 in self.freq if isinstance(self.freq, frozenset) \
            else (epoch + 1) % self.freq == 0
