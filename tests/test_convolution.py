"""hostavg.core.convolution: each sample's kernel gradient from its input and the loss's gradient
at the output, against the forward convolution itself (the gradient of sum(conv(a, K) * d) with
respect to K, which is linear in K, read off basis kernels), in NumPy."""

import itertools

import numpy as np
import pytest

from hostavg.core.convolution import kernel_gradients, same_padding


def conv(a, kernel, strides, dilations, padding):
    """The forward convolution of one sample ``a`` (*spatial, in) by loops: (*outputs, out)."""
    if padding is not None:
        a = np.pad(a, list(padding) + [(0, 0)])
    sizes = kernel.shape[:-2]
    outer = [(n - (k - 1) * r - 1) // s + 1
             for n, k, s, r in zip(a.shape[:-1], sizes, strides, dilations)]
    out = np.zeros((*outer, kernel.shape[-1]))
    for p in itertools.product(*map(range, outer)):
        for t in itertools.product(*map(range, sizes)):
            at = tuple(q * s + u * r for q, u, s, r in zip(p, t, strides, dilations))
            out[p] += a[at] @ kernel[t]
    return out


@pytest.mark.parametrize("spatial, kernel, strides, dilations, same", [
    ((7, 6), (3, 3), (1, 1), (1, 1), True),
    ((8, 7), (3, 2), (2, 2), (1, 1), True),   # "same" with a stride: one more after
    ((9, 9), (2, 3), (2, 1), (1, 1), False),
    ((9, 8), (3, 3), (1, 1), (2, 2), False),  # dilated
    ((10,), (4,), (3,), (1,), True),          # one spatial axis
])
def test_each_samples_kernel_gradient_is_the_forward_convolutions(spatial, kernel, strides,
                                                                  dilations, same):
    rng = np.random.default_rng(0)
    n, c_in, c_out = 3, 2, 4
    shape = (*kernel, c_in, c_out)
    a = rng.normal(size=(n, *spatial, c_in))
    outer = [-(-s // t) for s, t in zip(spatial, strides)] if same else \
        [(s - (k - 1) * r - 1) // t + 1 for s, k, t, r in zip(spatial, kernel, strides, dilations)]
    padding = same_padding(spatial, outer, kernel, strides, dilations) if same else None
    d = rng.normal(size=(n, *outer, c_out))
    got = kernel_gradients(a, d, shape, strides, dilations, padding)
    assert got.shape == (n, *shape)
    for i in range(n):
        want = np.zeros(shape)
        for j in np.ndindex(shape):
            basis = np.zeros(shape)
            basis[j] = 1.0
            want[j] = np.sum(conv(a[i], basis, strides, dilations, padding) * d[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-12, atol=1e-12)


def test_same_padding_puts_the_odd_one_after():
    # 8 positions, kernel 3, stride 2 -> 4 outputs: (4 - 1) * 2 + 3 - 8 = 1 to pad, after
    assert same_padding((8,), (4,), (3,), (2,), (1,)) == [(0, 1)]
    assert same_padding((7, 7), (7, 7), (3, 5), (1, 1), (1, 1)) == [(1, 1), (2, 2)]
