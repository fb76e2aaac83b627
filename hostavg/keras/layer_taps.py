"""A sample's gradient at its ``Dense`` and convolution layers from the layer's input and the
loss's gradient at its output, without differentiating the layer's weights sample by sample.

A ``Dense`` layer computes z = a W + b from a sample's input row a (1 x in), so with delta =
dL/dz (1 x out): dL/dW = a^T delta, |dL/dW|^2 = |a|^2 |delta|^2, |dL/db|^2 = |delta|^2, and
a chunk's sum is A^T Delta (Goodfellow, "Efficient per-example gradient computations", 2015).
A convolution's kernel gradient is the sum over output positions p of patch_p^T delta_p:
formed for each sample by one batched product per kernel offset, where
``tf.vectorized_map`` loops over the samples' filter gradients. Each such layer's output
gets a zero "tap" t (z + t), the gradient with respect to t is delta, and a is what the
layer was called on; ``per_sample``'s vectorized first pass
(:class:`~hostavg.engine.protocols.Vectorized`) takes those layers' norms and sums from them.

Which layers (:class:`LayerTaps`): exactly ``keras.layers.Dense``, ``Conv1D`` or ``Conv2D``
(channels last, one group), trained weights held by no other layer, no regularizer, LoRA or
quantization, its dtype the compute dtype. Whether the loss reads them elsewhere (a tied
weight; a layer called twice, or on more than one sample's worth, runs its own ``call``) a
backend checks once per signature on the traced function; such a layer's gradient is formed
as before, and every layer's where a tapped function fails to trace (a loop's body).
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

import keras
import ml_dtypes
from keras import ops

from hostavg.core.convolution import kernel_gradients, same_padding

__all__ = ["LayerTaps", "per_sample_dots"]

#: Held while a thread's taps are installed (:meth:`LayerTaps.tapped`).
_TAPPING = threading.RLock()

#: The convolutions whose kernel gradient :func:`_conv_grads` forms.
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D)


class LayerTaps:
    """The ``Dense`` and convolution layers of ``model`` whose trained kernel (and bias) a
    sample's gradient can come from a and delta (see the module docstring).

    Args:
      model: a built Keras model.
      trained: the trained variables, in the order their gradients come.

    Attributes:
      layers: the eligible layers.
      kernels: per layer, the kernel's index in ``trained``.
      biases: per layer, the bias's index in ``trained``, or None (no bias).
      outputs: per layer (by ``id``), the (shape, dtype) of its output for one sample, where
        a backend recorded them (JAX's zero taps are arguments, made before the call).
    """

    def __init__(self, model, trained: list):
        at = {id(v): i for i, v in enumerate(trained)}
        found = [layer for layer in model._flatten_layers() if _eligible(layer) and id(layer.kernel) in at
                 and (layer.bias is None or id(layer.bias) in at)]
        # a variable held by two layers gets both their gradients: formed, not tapped
        held = Counter(id(v) for layer in found for v in _weights(layer))
        found = [layer for layer in found if all(held[id(v)] == 1 for v in _weights(layer))]
        self.layers = found
        self.kernels = [at[id(layer.kernel)] for layer in found]
        self.biases = [None if layer.bias is None else at[id(layer.bias)] for layer in found]
        self.outputs = {}

    def __len__(self) -> int:
        return len(self.layers)

    def indices(self) -> set:
        """The indices in ``trained`` of every eligible layer's kernel and bias."""
        return set(self.kernels) | {b for b in self.biases if b is not None}

    def untapped(self, k: int) -> list:
        """The indices, among ``k`` trained variables, of those no layer here holds."""
        places = self.indices()
        return [p for p in range(k) if p not in places]

    def holding(self, places) -> list:
        """The layers whose kernel or bias is at one of ``places`` (indices in ``trained``)."""
        return [layer for layer, k, b in zip(self.layers, self.kernels, self.biases)
                if k in places or b in places]

    def sums(self, others: list, inputs: list, deltas: list, wide, dotted: bool = False
             ) -> tuple:
        """(each sample's squared gradient norm at these layers' kernels and biases, (n,) in
        ``wide``; each trained variable's gradient summed over the chunk, in order; with
        ``dotted``, each sample's gradient at these layers dotted with those sums, (n,) in
        ``wide`` (:func:`per_sample_dots`), else None): ``others`` for :meth:`untapped`'s
        (summed already), these layers' from ``inputs`` and ``deltas`` per layer, each of n
        samples (a sample's a and delta, stacked)."""
        squares, dots = [], []
        total = [None] * (len(others) + len(self.indices()))
        for p, summed in zip(self.untapped(len(total)), others):
            total[p] = summed
        for layer, a, d, kernel, bias in zip(self.layers, inputs, deltas, self.kernels,
                                             self.biases):
            if isinstance(layer, keras.layers.Dense):  # the bias's gradient: delta itself
                biased, biased_sq = d, _squares(d, wide)
                squares.append(_outer_squares(a, d, biased_sq, wide))
                total[kernel] = ops.matmul(ops.transpose(a), d)
                if dotted:  # a^T delta . S = (a S) . delta, S divided by its largest entry
                    top = _largest(total[kernel])
                    dots.append(ops.cast(ops.sum(ops.matmul(a, total[kernel] / top) * d, axis=1),
                                         wide) * ops.cast(top, wide))
            else:  # the bias's gradient: delta summed over the output positions
                biased, biased_sq = ops.sum(d, axis=tuple(range(1, len(d.shape) - 1))), None
                grads = _conv_grads(layer, a, d)
                squares.append(_squares(grads, wide))
                total[kernel] = ops.sum(grads, axis=0)
                if dotted:
                    dots.append(per_sample_dots(grads, total[kernel], wide))
            if bias is not None:
                squares.append(_squares(biased, wide) if biased_sq is None else biased_sq)
                total[bias] = ops.sum(biased, axis=0)
                if dotted:
                    dots.append(per_sample_dots(biased, total[bias], wide))
        square = ops.sum(ops.stack(squares), axis=0) if squares else None
        return square, total, ops.sum(ops.stack(dots), axis=0) if dots else None

    def without(self, layers) -> LayerTaps:
        """These taps less ``layers`` (by identity)."""
        drop = {id(layer) for layer in layers}
        taps = LayerTaps.__new__(LayerTaps)
        kept = [j for j, layer in enumerate(self.layers) if id(layer) not in drop]
        taps.layers = [self.layers[j] for j in kept]
        taps.kernels = [self.kernels[j] for j in kept]
        taps.biases = [self.biases[j] for j in kept]
        taps.outputs = dict(self.outputs)
        return taps

    @contextmanager
    def tapped(self, read, tap, inputs: list):
        """While active, in this thread, each layer's call computes its output z (before its
        activation) as ``tap(j, z)`` (j: the layer's place in :attr:`layers`), its weights
        given by ``read(variable)`` rather than read through the variable, and keeps its
        input in ``inputs[j]`` (a list of one None per layer). A second call of a layer, or
        one on anything but one sample (a batch of one: one 1 x in row for a ``Dense``, not a
        sequence; not rows a layer such as ``TimeDistributed`` folds into the batch), runs
        the layer's own ``call``, which reads the variable: the backend's check then finds
        the layer's weight read elsewhere."""
        with _TAPPING:  # one thread's taps at a time: each restores what it replaced
            owner, installed = threading.get_ident(), []
            try:
                for j, layer in enumerate(self.layers):
                    installed.append(self._install(j, layer, owner, read, tap, inputs))
                yield
            finally:
                for layer, call in zip(self.layers, installed):
                    if vars(layer).get("call") is call:
                        object.__delattr__(layer, "call")

    @staticmethod
    def _install(j: int, layer, owner: int, read, tap, inputs: list):
        """Replaces ``layer``'s call as :meth:`tapped` says; returns the replacement."""
        original, rank = layer.call, len(layer.kernel.shape)  # Dense 2, a convolution's + 1

        def call(x, *args, **kwargs):
            if threading.get_ident() != owner or inputs[j] is not None or \
                    tuple(x.shape)[:1] != (1,) or len(x.shape) != rank:  # not one sample
                return original(x, *args, **kwargs)
            if isinstance(layer, keras.layers.Dense):
                z = ops.matmul(x, read(layer.kernel))
            else:
                if layer.padding == "causal":  # as Conv1D's call: padded, then "valid"
                    x = ops.pad(x, layer._compute_causal_padding())
                z = ops.conv(x, read(layer.kernel), strides=list(layer.strides),
                             padding="valid" if layer.padding == "causal" else layer.padding,
                             dilation_rate=layer.dilation_rate, data_format=layer.data_format)
            if layer.bias is not None:
                z = ops.add(z, read(layer.bias))  # channels last: the bias broadcasts
            z = tap(j, z)
            inputs[j] = x
            return z if layer.activation is None else layer.activation(z)
        object.__setattr__(layer, "call", call)
        return call


def _conv_grads(layer, a, d):
    """Each sample's gradient of a convolution's kernel, (n, *kernel_size, in, out): from its
    inputs ``a`` (n, *spatial, in; "causal" padding applied) and ``deltas`` (n, *outputs,
    out) (:func:`hostavg.core.convolution.kernel_gradients`)."""
    strides, dilations = layer.strides, layer.dilation_rate
    padding = same_padding(tuple(a.shape[1:-1]), tuple(d.shape[1:-1]), layer.kernel_size,
                           strides, dilations) if layer.padding == "same" else None
    return kernel_gradients(a, d, tuple(layer.kernel.shape), strides, dilations, padding, ops)


def _outer_squares(a, d, d_sq, wide):
    """Each sample's |a|^2 |delta|^2 (``d_sq``: |delta|^2), the squared norm of its gradient
    a^T delta, in ``wide``; Inf where an entry a_j delta_k overflows the layer's dtype, as the
    gradient formed alone would."""
    big = float(ml_dtypes.finfo(keras.backend.standardize_dtype(a.dtype)).max)
    peak = ops.max(ops.abs(ops.cast(a, wide)), axis=1) * ops.max(ops.abs(ops.cast(d, wide)),
                                                                 axis=1)
    return ops.where(peak > big, ops.cast(float("inf"), wide), _squares(a, wide) * d_sq)


def _squares(x, wide):
    """Each sample's sum of squares of ``x`` (n, ...), in ``wide``."""
    x = ops.cast(x, wide)
    return ops.sum(ops.square(x), axis=tuple(range(1, len(x.shape))))


def per_sample_dots(grads, total, wide):
    """Each sample's gradient in ``grads`` (n, *shape) dotted with ``total`` (of that shape),
    (n,) in ``wide``: with ``total`` divided by its largest magnitude a in the gradients'
    dtype, then times a in ``wide``, so that no product falls below the dtype's normals for
    want of the total's scale (an Inf or NaN total gives NaN dots)."""
    top = _largest(total)
    dots = ops.sum(grads * (total / top)[None], axis=tuple(range(1, len(grads.shape))))
    return ops.cast(dots, wide) * ops.cast(top, wide)


def _largest(x):
    """The largest magnitude of ``x``, or 1 where that is 0."""
    top = ops.max(ops.abs(x))
    return ops.where(top > 0, top, ops.ones_like(top))


def _weights(layer) -> list:
    """``layer``'s kernel and bias (where it has one)."""
    return [layer.kernel] + ([] if layer.bias is None else [layer.bias])


def _eligible(layer) -> bool:
    """Whether ``layer``'s kernel gradient comes from a and delta as the module says and
    nothing else reads its weights by its construction."""
    if type(layer) is keras.layers.Dense:
        plain = layer.quantization_mode is None
    elif type(layer) in _CONVOLUTIONS:
        plain = layer.groups == 1 and layer.data_format == "channels_last"
    else:
        return False
    return (plain and layer.built and "call" not in vars(layer) and not layer.lora_enabled
            and layer.kernel_regularizer is None and layer.bias_regularizer is None
            and layer.compute_dtype == layer.variable_dtype)
