"""A convolution's kernel gradient for each sample, from its input and the loss's gradient at its output.

For a convolution z = conv(a, kernel) (channels last, one group) the gradient of a sample's
loss with respect to the kernel at offset t is the sum over output positions p of
a[p * stride + t * dilation] (outer) delta[p], delta the loss's gradient at z. Formed as one
batched product per kernel offset (9 for a 3x3 kernel), it gives every sample's kernel gradient
at once from the inputs and deltas of a chunk, where a framework's own vectorized filter
gradient loops over the samples. Written against an array namespace ``xp`` (NumPy, or a
framework's with the same ``pad``, ``einsum``, ``stack`` and ``reshape``), so that the
faces share it and NumPy tests it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["kernel_gradients", "same_padding"]


def same_padding(inner: Sequence[int], outer: Sequence[int], sizes: Sequence[int],
                 strides: Sequence[int], dilations: Sequence[int]) -> list:
    """[(before, after)] per spatial axis of "same" padding for inputs of ``inner`` positions
    and outputs of ``outer``: the odd one after, as the frameworks pad."""
    pads = [max((o - 1) * s + (k - 1) * r + 1 - i, 0)
            for i, o, k, s, r in zip(inner, outer, sizes, strides, dilations)]
    return [(p // 2, p - p // 2) for p in pads]


def kernel_gradients(a, d, kernel_shape: Sequence[int], strides: Sequence[int],
                     dilations: Sequence[int], padding: Sequence | None = None, xp=np):
    """Each sample's kernel gradient, (n, *kernel_shape): ``a`` (n, *spatial, in) the inputs,
    ``d`` (n, *outputs, out) the loss's gradient at the outputs, ``padding`` [(before,
    after)] per spatial axis applied to ``a`` first (None: none); static shapes."""
    sizes = tuple(kernel_shape[:-2])
    outer = tuple(d.shape[1:-1])
    if padding is not None and any(p != (0, 0) for p in padding):
        a = xp.pad(a, [[0, 0]] + [list(p) for p in padding] + [[0, 0]])
    letters = "hwd"[:len(sizes)]
    spec = f"n{letters}c,n{letters}o->nco"
    grads = []
    for offset in itertools.product(*map(range, sizes)):
        window = tuple(slice(t * r, t * r + (o - 1) * s + 1, s)
                       for t, r, o, s in zip(offset, dilations, outer, strides))
        grads.append(xp.einsum(spec, a[(slice(None), *window)], d))
    return xp.reshape(xp.stack(grads, axis=1), (-1, *kernel_shape))
