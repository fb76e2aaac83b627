"""What ``hostavg.keras.Trainer.fit`` and ``evaluate`` take as data, as Keras's ``fit`` takes it.

Two kinds of data, each made into batches ``(x, y[, sample_weight])`` of NumPy
arrays (nothing here needs Keras's TensorFlow backend):

* Samples (arrays, lists or dicts of them, pandas, any backend's tensors):
  fit cuts them into batches of ``batch_size``, shuffled by seed and data
  pass; ``validation_split`` and ``class_weight`` as Keras does.
* Batches (a batched ``tf.data.Dataset`` or a ``keras.utils.PyDataset``):
  each element one optimizer step's batch, a dataset read through one
  iterator per pass, as Keras's fit reads it (a ``.shuffle()`` keeps its order).

See docs/guides/keras.md for each kind in detail.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping

import keras
import numpy as np

from hostavg.compat.keras import unbuilt
from hostavg.core.errors import ArgumentError, positive_int
from hostavg.core.split import feed_size, split, take
from hostavg.keras.batch import as_batch, positions
from hostavg.train.sources import ArraySource

__all__ = ["Chunks", "DatasetSource", "checked_batch_size", "is_batches", "read_as_keras",
           "samples", "source", "split_validation", "validation", "weighted"]


def is_batches(x) -> bool:
    """Whether ``x`` gives its own batches: a ``tf.data.Dataset`` or a ``keras.utils.PyDataset``."""
    return isinstance(x, keras.utils.PyDataset) or _is_dataset(x)


def _is_dataset(x) -> bool:
    tf = sys.modules.get("tensorflow")  # a tf.data.Dataset exists only where TensorFlow does
    return tf is not None and isinstance(x, tf.data.Dataset)


def samples(x, y, sample_weight, what: str = "x") -> tuple:
    """``(x, y[, sample_weight])`` as NumPy arrays (dicts of them), checked to hold one number
    of samples."""
    batch = as_batch(*(_arrays(part, name) for part, name in
                       ((x, what), (y, "y"), (sample_weight, "sample_weight"))))
    if batch[0] is None:
        raise ArgumentError(f"{what} is None; fit and evaluate need the inputs")
    feed_size(batch, what)  # one length along axis 0, and at least one array
    return batch


def _arrays(value, name: str):
    """``value`` as NumPy: a pandas DataFrame or Series by ``to_numpy()``, a tensor by
    ``np.asarray``, a dict of them entry by entry; None stays None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {k: _arrays(v, f"{name}[{k!r}]") for k, v in value.items()}
    if type(value).__module__.startswith("pandas.") and hasattr(value, "to_numpy"):
        return value.to_numpy()  # a DataFrame's columns side by side, as Keras takes it
    value = positions(value)  # [xa, xb]: the inputs (or targets) in order, as Keras takes them
    if isinstance(value, Mapping):
        return {k: _arrays(v, f"{name}[{k!r}]") for k, v in value.items()}
    return np.asarray(value)


def weighted(batch: tuple, class_weight, what: str) -> tuple:
    """``batch`` with sample weights from ``class_weight`` ({class: weight}; each sample's class
    from y: an integer label, a one-hot row's argmax, or a label in a last axis of 1), as
    Keras's fit makes them; unchanged without ``class_weight``."""
    if class_weight is None:
        return batch
    if not isinstance(class_weight, Mapping):
        raise ArgumentError(f"class_weight must be a dict {{class index: weight}}, got "
                            f"{type(class_weight).__name__}")
    if len(batch) == 3:
        raise ArgumentError(f"{what}: class_weight and sample_weight together; Keras takes one "
                            f"or the other: fold the class weights into sample_weight")
    y = batch[1]
    if y is None or isinstance(y, Mapping):
        raise ArgumentError(f"{what}: class_weight needs one array of targets y (a model with a "
                            f"single output), got {'none' if y is None else 'a dict'}")
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else labels[..., 0]
    labels = np.round(labels).astype(np.int64).reshape(len(labels), -1)[:, 0]
    table = {int(k): float(v) for k, v in class_weight.items()}
    weights = np.array([table.get(int(c), 1.0) for c in labels], keras.backend.floatx())
    return batch[0], batch[1], weights


def split_validation(batch: tuple, validation_split) -> tuple:
    """(training part, validation part) of ``batch``: its last ``validation_split`` of the
    samples (before shuffling) for validation, as Keras splits them."""
    if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float)) \
            or not 0 <= validation_split < 1:
        raise ArgumentError(f"validation_split must be a number in [0, 1), got {validation_split!r}")
    n = feed_size(batch, "x")
    cut = int(math.floor(n * (1.0 - validation_split)))
    if cut in (0, n):
        raise ArgumentError(f"validation_split={validation_split} of {n} samples leaves "
                            f"{'no training' if cut == 0 else 'no validation'} sample; give more "
                            f"data or another validation_split")
    return take(batch, slice(0, cut)), take(batch, slice(cut, n))


def validation(validation_data, what: str = "validation_data"):
    """``validation_data`` made ready: a batch ``(x, y[, sample_weight])`` of NumPy arrays, or a
    dataset's :class:`DatasetSource`; checked before any training."""
    if is_batches(validation_data):
        return DatasetSource(validation_data)
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ArgumentError(f"{what} must be (x, y), (x, y, sample_weight), a tf.data.Dataset "
                            f"or a keras.utils.PyDataset, got {type(validation_data).__name__}")
    x, y, w = (*validation_data, None)[:3]
    return samples(x, y, w, what=f"{what}'s x")


class Chunks:
    """The batches to evaluate ``data`` (a batch of samples, or a :class:`DatasetSource`) in,
    afresh at each iteration: chunks of ``size`` samples, or ``count`` chunks (as
    :func:`hostavg.split` cuts), of the samples or of each of the source's batches (kept whole
    where neither is given); only the first ``steps`` chunks (of samples) or batches (of a
    source), where given."""

    def __init__(self, data, size: int | None, count: int | None = None,
                 steps: int | None = None):
        self.data, self.size, self.count, self.steps = data, size, count, steps

    def __iter__(self):
        if not isinstance(self.data, DatasetSource):
            yield from itertools.islice(split(self.data, self.size), self.steps)
            return
        for batch, _ in itertools.islice(self.data.batches(0, 0, 0, 0), self.steps):
            yield from ([batch] if self.size is None and self.count is None
                        else split(batch, self.size, micro_batches=self.count))


class DatasetSource:
    """The batches of a ``tf.data.Dataset`` or a ``keras.utils.PyDataset``, as fit's
    :class:`~hostavg.train.sources.BatchSource`: each element one step's batch; rows unknown.

    A dataset is read through one iterator per pass (each iterator of a
    ``.shuffle()`` dataset reshuffles); :meth:`first` reads from the iterator
    the next pass then continues. Where Keras's fit on TensorFlow (and its
    evaluate) opens one more iterator at a pass's end, which only
    ``steps_per_epoch`` would continue (a dataset of known cardinality), so does
    a pass here (``reopens``), so that every pass has Keras's order; see also
    :func:`read_as_keras`. ``endless``: a dataset of infinite cardinality, or a
    PyDataset whose ``num_batches`` is None.
    """

    n = None  # the samples are the data's own: fit does not batch them
    one_shot = False  # a dataset is iterated afresh every pass

    def __init__(self, data, shuffle: bool = False, class_weight=None,
                 steps_per_epoch: int | None = None):
        self.data, self.shuffle, self.class_weight = data, shuffle, class_weight
        self.py = isinstance(data, keras.utils.PyDataset)
        self._opened = None  # (element 0, the iterator first() read it from): the next pass's
        if self.py:
            self._len = data.num_batches
            self.endless, self.reopens = self._len is None, False
        else:
            cardinality = int(data.cardinality())
            self._len = cardinality if cardinality >= 0 else None  # infinite, or unknown
            self.endless = cardinality == -1  # tf.data.INFINITE_CARDINALITY; -2 is unknown
            self.reopens = (keras.backend.backend() == "tensorflow" and steps_per_epoch is None
                            and self._len is not None)

    def num_batches(self, drop_remainder):
        return self._len

    def first(self) -> tuple:
        """The first batch of the next pass (made ready), to learn the model's variables from."""
        if self.py:
            if self._len == 0:
                raise ArgumentError("the PyDataset gives no batch (num_batches 0)")
            return self._batch(self.data[0], "batch 0 of the PyDataset")
        if self._opened is None:
            elements = iter(self.data)
            head = next(elements, None)
            if head is None:
                raise ArgumentError("the dataset gives no batch (it is empty)")
            self._opened = head, elements
        return self._batch(self._opened[0], "element 0 of the dataset")

    def open_iterator(self) -> None:
        """Opens an iterator over the dataset and leaves it unread, as Keras's fit does: a
        ``.shuffle()`` dataset draws its next order for it."""
        iter(self.data)

    def batches(self, data_pass, seed, batch, samples):
        """(batch, None) of the pass's elements from element ``batch`` on."""
        if self.py:
            yield from self._py_batches(data_pass, seed, batch)
            return
        opened, self._opened = self._opened, None
        if opened is None:
            elements = iter(self.data.skip(batch) if batch else self.data)
        else:
            elements = itertools.islice(itertools.chain([opened[0]], opened[1]), batch, None)
        for i, element in enumerate(elements, batch):
            yield self._batch(element, f"element {i} of the dataset"), None
        if self.reopens:
            self.open_iterator()

    def _py_batches(self, data_pass, seed, batch):
        self.data.on_epoch_begin()
        if self._len is None:  # infinite: in order
            order = (i for i in range(batch, sys.maxsize))
        else:
            order = np.random.default_rng([seed, data_pass]).permutation(self._len) \
                if self.shuffle else np.arange(self._len)
            order = order[batch:]
        for i in order:
            yield self._batch(self.data[int(i)], f"batch {int(i)} of the PyDataset"), None
        self.data.on_epoch_end()

    def _batch(self, element, what: str) -> tuple:
        """One element as a batch ``(x, y[, sample_weight])`` of NumPy arrays."""
        if isinstance(element, list):
            element = tuple(element)
        if not isinstance(element, tuple):
            element = (element,)
        if len(element) not in (1, 2, 3):
            raise ArgumentError(f"{what} is a tuple of {len(element)}; each element must be x, "
                                f"(x,), (x, y) or (x, y, sample_weight)")
        batch = as_batch(*(_arrays(part, name) for part, name in
                           zip(element + (None,) * (3 - len(element)),
                               ("x", "y", "sample_weight"))))
        return weighted(batch, self.class_weight, what)


def checked_batch_size(batch_size, data) -> int | None:
    """fit's ``batch_size``: None for data that gives its own batches (refused if given, as
    Keras refuses it), else an integer >= 1, by default Keras's 32."""
    if is_batches(data):
        if batch_size is not None:
            raise ArgumentError(f"batch_size={batch_size!r} with a {type(data).__name__}, whose "
                                f"elements are the batches: leave batch_size None")
        return None
    return 32 if batch_size is None else positive_int("batch_size", batch_size)


def read_as_keras(source, model):
    """``source``, after what Keras's own fit and evaluate read of it before their first step,
    so that a ``.shuffle()`` dataset gives every pass Keras's order: on Keras's JAX backend,
    for a model whose layers, compiled loss or metrics are not built, they open an iterator
    to build them on its first element (a PyDataset: none, hostavg orders its batches)."""
    if keras.backend.backend() == "jax" and not source.py and unbuilt(model):
        source.open_iterator()
    return source


def source(data, batch_size, shuffle, class_weight, steps_per_epoch):
    """fit's source of batches for ``data``: a dataset's own, or an array batch cut by fit."""
    if is_batches(data):
        return DatasetSource(data, shuffle, class_weight, steps_per_epoch)
    return ArraySource(data, batch_size, shuffle)
