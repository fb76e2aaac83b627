"""A sample's squared gradient norm at its ``Dense`` layers without forming the gradient.

A ``Dense`` layer computes z = a W + b from a sample's input vector a (1 x in), so the
gradient of the sample's loss with respect to W is the outer product a^T delta, where
delta = dL/dz (1 x out), and

    |dL/dW|^2 = |a|^2 |delta|^2,    |dL/db|^2 = |delta|^2,    sum_i dL_i/dW = A^T Delta

(Goodfellow, "Efficient per-example gradient computations", 2015). ``per_sample``'s
vectorized first pass (:class:`~hostavg.engine.protocols.Vectorized`) would otherwise form
each sample's in x out gradient only to sum its squares: on a 784-64-10 MLP that was about
six times the whole batch's compute. Here each such layer's output gets a zero "tap" t
(z + t), the gradient with respect to t is delta, and a is what the layer was called on.

Which layers (:class:`DenseTaps`): exactly ``keras.layers.Dense``, trained weights held by no
other layer, no regularizer, LoRA or quantization, its dtype the compute dtype. Whether the
loss reads them elsewhere (a tied weight; a layer called twice or on more than one row runs
its own ``call``) a backend checks once per signature on the traced function; such a layer's
gradient is formed as before, and every layer's where a tapped function fails to trace (a
Dense in a loop's body, whose input would escape it).
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

import keras
from keras import ops

__all__ = ["DenseTaps"]

#: Held while a thread's taps are installed (:meth:`DenseTaps.tapped`).
_TAPPING = threading.RLock()


class DenseTaps:
    """The ``Dense`` layers of ``model`` whose trained kernel (and bias) a sample's squared
    gradient norm can take from |a|^2 |delta|^2 (see the module docstring).

    Args:
      model: a built Keras model.
      trained: the trained variables, in the order their gradients come.

    Attributes:
      layers: the eligible layers.
      kernels: per layer, the kernel's index in ``trained``.
      biases: per layer, the bias's index in ``trained``, or None (no bias).
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

    def __len__(self) -> int:
        return len(self.layers)

    def indices(self) -> set:
        """The indices in ``trained`` of every eligible layer's kernel and bias."""
        return set(self.kernels) | {b for b in self.biases if b is not None}

    def untapped(self, k: int) -> list:
        """The indices, among ``k`` trained variables, of those no layer here holds."""
        places = self.indices()
        return [p for p in range(k) if p not in places]

    def totals(self, others: list, inputs: list, deltas: list) -> list:
        """Each trained variable's gradient summed over a chunk's samples, in order: ``others``
        for :meth:`untapped`'s (summed already), A^T Delta for a layer's kernel and the sum of
        Delta for its bias, from ``inputs`` (n, in) and ``deltas`` (n, out) per layer."""
        total = [None] * (len(others) + len(self.indices()))
        for p, summed in zip(self.untapped(len(total)), others):
            total[p] = summed
        for a, d, kernel, bias in zip(inputs, deltas, self.kernels, self.biases):
            total[kernel] = ops.matmul(ops.transpose(a), d)
            if bias is not None:
                total[bias] = ops.sum(d, axis=0)
        return total

    def without(self, layers) -> DenseTaps:
        """These taps less ``layers`` (by identity)."""
        drop = {id(layer) for layer in layers}
        taps = DenseTaps.__new__(DenseTaps)
        kept = [j for j, layer in enumerate(self.layers) if id(layer) not in drop]
        taps.layers = [self.layers[j] for j in kept]
        taps.kernels = [self.kernels[j] for j in kept]
        taps.biases = [self.biases[j] for j in kept]
        return taps

    @contextmanager
    def tapped(self, read, tap, inputs: list):
        """While active, in this thread, each layer's call computes its output z = a W + b
        as ``tap(j, z)`` (j: the layer's place in :attr:`layers`), W and b given by
        ``read(variable)`` rather than read through the variable, and keeps a in
        ``inputs[j]`` (a list of one None per layer). A second call of a layer, or one on
        anything but one row (1 x in: a sample computed alone, its batch of one; not a
        sequence, nor rows a layer such as ``TimeDistributed`` folds into the batch), runs
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
        original = layer.call

        def call(x, training=None):
            if threading.get_ident() != owner or inputs[j] is not None or \
                    tuple(x.shape)[:1] != (1,) or len(x.shape) != 2:  # not one 1 x in row
                return original(x, training=training)
            z = ops.matmul(x, read(layer.kernel))
            if layer.bias is not None:
                z = ops.add(z, read(layer.bias))
            z = tap(j, z)
            inputs[j] = x
            return z if layer.activation is None else layer.activation(z)
        object.__setattr__(layer, "call", call)
        return call


def _weights(layer) -> list:
    """``layer``'s kernel and bias (where it has one)."""
    return [layer.kernel] + ([] if layer.bias is None else [layer.bias])


def _eligible(layer) -> bool:
    """Whether ``layer`` computes a^T delta for its kernel's gradient and nothing else reads its
    weights by its construction (see the module docstring)."""
    return (type(layer) is keras.layers.Dense and layer.built and "call" not in vars(layer)
            and not layer.lora_enabled and layer.quantization_mode is None
            and layer.kernel_regularizer is None and layer.bias_regularizer is None
            and layer.compute_dtype == layer.variable_dtype)
