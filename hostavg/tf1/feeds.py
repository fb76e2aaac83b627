"""Feeds of a TF1 trainer: keys resolved to the graph's tensors, values checked and converted as ``sess.run`` would."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from hostavg.core.errors import ArgumentError

__all__ = ["FeedConformer", "brief", "feed_array", "resolve_feed"]


def resolve_feed(graph, feed_dict: Mapping, what: str) -> dict:
    """The feed with every key a tensor of ``graph`` (names such as ``"x:0"`` are looked up)."""
    if not isinstance(feed_dict, Mapping):
        raise ArgumentError(f"{what}: a feed must be a dict {{placeholder: array}}, "
                            f"got {type(feed_dict).__name__}")
    out = {}
    for key, value in feed_dict.items():
        if isinstance(key, str):
            try:
                key = graph.as_graph_element(key)
            except (KeyError, ValueError, TypeError) as e:
                raise ArgumentError(
                    f"{what}: feed key {key!r} names nothing in the trainer's graph ({e})") from None
            if isinstance(key, tf.Operation):  # "x" names the op; its one output is "x:0"
                if len(key.outputs) != 1:
                    raise ArgumentError(
                        f"{what}: feed key {key.name!r} names an op with {len(key.outputs)} "
                        f"outputs; name the tensor, such as {key.name + ':0'!r}")
                key = key.outputs[0]
        if getattr(key, "graph", None) is not graph:
            raise ArgumentError(
                f"{what}: feed key {getattr(key, 'name', key)!r} is not in the trainer's graph; "
                f"feed the placeholders of the graph the loss was built in")
        out[key] = value
    return out


class FeedConformer:
    """Makes each value of a feed an array of its key's dtype, checked against its key's shape, as ``sess.run`` would.

    (The compiled session calls skip that check: an array of the wrong
    shape would broadcast silently.) Stricter than ``sess.run`` where
    NumPy's conversion would change values silently: integers out of the
    placeholder's range, non-integer floats for an integer placeholder,
    None, text or objects for a numeric one, and tensors are refused
    (see :func:`feed_array`). Each key's dtype and shape are read once and
    remembered.
    """

    def __init__(self):
        self._forms = {}  # feed key -> (NumPy dtype, shape with None where any)

    def conform(self, feed: dict, what: str) -> dict:
        """``feed`` (keyed by tensors) with every value conformed; HostavgError starting with ``what`` if one cannot be."""
        out = {}
        for key, value in feed.items():
            form = self._forms.get(key)
            if form is None:
                shape = key.shape
                form = self._forms[key] = (
                    key.dtype.base_dtype.as_numpy_dtype,
                    None if shape.rank is None else tuple(shape.as_list()))
            dtype, shape = form
            # (an array as it must be needs no message: a tensor's name costs calls into TF)
            array = value if type(value) is np.ndarray and value.dtype == dtype else \
                feed_array(value, dtype, f"{what}: feed {key.name!r}")
            if shape is not None and not _fits(array.shape, shape):
                if array.ndim and array.ndim == len(shape) and _fits(array.shape[1:], shape[1:]):
                    raise ArgumentError(
                        f"{what}: placeholder {key.name!r} fixes the batch size: its shape is "
                        f"{tuple(shape)}, batches of exactly {shape[0]} rows, and this feed "
                        f"has {len(array)}. Make its first dimension None "
                        f"(tf.compat.v1.placeholder(..., shape=[None, ...])), and use "
                        f"tf.shape(x)[0], the rows the feed has, where the graph needs batch_size")
                raise ArgumentError(
                    f"{what}: feed {key.name!r} has shape {array.shape}, but it takes shape "
                    f"{tuple(shape)} (None: any length)")
            out[key] = array
        return out


def _fits(got: tuple, want: tuple) -> bool:
    """Whether an array of shape ``got`` fits a placeholder of shape ``want`` (None: any length)."""
    return len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def feed_array(value, dtype, what: str) -> np.ndarray:
    """``value`` as an array of ``dtype``, refused (HostavgError starting with ``what``) where that would change it.

    Numbers convert within their kind and to wider kinds (bool and integers
    to float, float64 to float32); integers must fit an integer dtype, and
    floats given for one must be whole numbers. None, text, objects and
    tensors (graph or eager, as ``sess.run`` refuses them) are refused for a numeric dtype.
    """
    if isinstance(value, np.ndarray) and value.dtype == dtype:
        return value
    if isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value):
        raise ArgumentError(f"{what} is an eager tensor; feed its value, such as tensor.numpy()")
    if isinstance(value, (tf.Tensor, tf.Variable, tf.Operation)):
        raise ArgumentError(f"{what} is the graph element {value.name!r}; feed values, such as "
                            f"NumPy arrays, not tensors: compute it with sess.run first")
    want = np.dtype(dtype)
    try:
        array = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ArgumentError(f"{what} cannot be made an array ({e})") from None
    if want.kind not in "biufc" or array.dtype == want:
        return array.astype(want, copy=False)
    if array.dtype.kind not in "biuf" or (want.kind == "b" and array.dtype.kind == "f"):
        raise ArgumentError(f"{what} holds {brief(array)} of dtype {array.dtype}, but the "
                            f"placeholder takes {want.name}")
    if want.kind in "iu" and array.size:
        whole = np.isfinite(array) & (array == np.round(array)) if array.dtype.kind == "f" else True
        if not np.all(whole):
            raise ArgumentError(f"{what} holds values that are not integers (such as "
                                f"{array[~whole].flat[0].item()!r}) for a {want.name} placeholder; feed "
                                f"integers")
        info = np.iinfo(want)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise ArgumentError(f"{what} holds values outside {want.name}'s range [{info.min}, "
                                f"{info.max}] (min {low}, max {high})")
    return array.astype(want)


def brief(value: np.ndarray) -> str:
    """A value for an error message: the number itself, or the array's shape."""
    return repr(value.item()) if value.size == 1 else f"an array of shape {value.shape}"
