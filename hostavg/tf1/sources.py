"""Where a TF1 trainer's fit gets its batches: a feed dict, an iterable of feed dicts, a tf.data.Dataset."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import tensorflow as tf

from hostavg.core.errors import ArgumentError
from hostavg.tf1.feeds import resolve_feed
from hostavg.train.sources import ArraySource, IterableSource

__all__ = ["DatasetSource", "feed_source"]


def feed_source(graph, data, inputs, batch_size, shuffle, blocks=None):
    """The batches of a TF1 trainer's ``data``: a feed dict, an iterable of them, or a tf.data.Dataset."""
    if isinstance(data, tf.data.Dataset):
        if inputs is None:
            raise ArgumentError("a tf.data.Dataset needs inputs=: a mapping from each element's "
                                "keys (or positions) to placeholders")
        return DatasetSource(graph, data, inputs, batch_size, shuffle)
    if inputs is not None:
        raise ArgumentError("inputs= is only for a tf.data.Dataset")
    if isinstance(data, Mapping):
        return ArraySource(resolve_feed(graph, data, "data"), batch_size, shuffle, blocks)
    if callable(data) or isinstance(data, Iterable):
        return IterableSource(data, lambda feed, what: resolve_feed(graph, feed, what))
    raise ArgumentError(
        f"data must be a dict {{placeholder: array}}, an iterable (or a callable returning one) "
        f"of feed dicts, or a tf.data.Dataset; got {type(data).__name__}")


class DatasetSource:
    """A ``tf.data.Dataset`` of single samples, batched (and shuffled by seed and pass) by fit, as
    its :class:`~hostavg.train.sources.BatchSource`; ``inputs`` maps each element key (or
    position) to its placeholder."""

    one_shot = False

    def __init__(self, graph, dataset, inputs, batch_size, shuffle):
        self.graph, self.dataset, self.batch_size, self.shuffle = graph, dataset, batch_size, shuffle
        self.inputs = dict(inputs) if isinstance(inputs, Mapping) else dict(enumerate(inputs))
        resolve_feed(graph, {v: None for v in self.inputs.values()}, "inputs")
        try:
            n = int(dataset.cardinality())
        except TypeError:  # its ops live in a graph: it cannot be iterated from Python
            raise ArgumentError(
                "fit reads a tf.data.Dataset eagerly, but this one is in graph mode: make it, and "
                "call fit, outside `with graph.as_default():`") from None
        self.n = n if n >= 0 else None
        self.endless = n == tf.data.INFINITE_CARDINALITY  # .repeat(): fit needs steps_per_epoch

    def num_batches(self, drop_remainder):
        if self.n is None:
            return None
        return self.n // self.batch_size if drop_remainder else -(-self.n // self.batch_size)

    def batches(self, data_pass, seed, batch, samples):
        """From sample ``samples`` of the pass's (seeded) order on; the rows are the elements'
        positions in the dataset."""
        ds = self.dataset.enumerate()
        if self.shuffle:
            ds = ds.shuffle(self.n or 10_000, seed=(seed + data_pass) % 2**63,
                            reshuffle_each_iteration=False)
        for rows, element in ds.skip(samples).batch(self.batch_size).as_numpy_iterator():
            try:
                yield resolve_feed(self.graph, {ph: element[k] for k, ph in self.inputs.items()},
                                   "inputs"), rows
            except (KeyError, IndexError, TypeError):
                raise ArgumentError(
                    f"inputs= names elements {list(self.inputs)} but the dataset's elements "
                    f"are {self.dataset.element_spec}") from None
