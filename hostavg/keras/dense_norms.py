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

Which layers (:class:`DenseTaps`): exactly ``keras.layers.Dense``, trained kernel and bias,
no regularizer, LoRA or quantization, the variables' dtype the compute dtype. Whether the
loss reads the kernel or bias elsewhere (a tied weight; a layer called twice or on more than
one row, where it runs its own ``call``) a backend checks once per signature on the traced
function (:meth:`DenseTaps.tapped` reads the weights from where the backend says, so a read
through the variable is another use); such a layer's gradient is formed as before.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import keras
from keras import ops

__all__ = ["DenseTaps"]


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

    def __init__(self, model, trained: list, layers=None):
        at = {id(v): i for i, v in enumerate(trained)}
        self.layers, self.kernels, self.biases = [], [], []
        for layer in model._flatten_layers() if layers is None else layers:
            if not _eligible(layer) or id(layer.kernel) not in at or (
                    layer.bias is not None and id(layer.bias) not in at):
                continue
            self.layers.append(layer)
            self.kernels.append(at[id(layer.kernel)])
            self.biases.append(None if layer.bias is None else at[id(layer.bias)])

    def __len__(self) -> int:
        return len(self.layers)

    def indices(self) -> set:
        """The indices in ``trained`` of every eligible layer's kernel and bias."""
        return set(self.kernels) | {b for b in self.biases if b is not None}

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
        owner = threading.get_ident()
        for j, layer in enumerate(self.layers):
            original = layer.call

            def call(x, training=None, j=j, layer=layer, original=original):
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
        try:
            yield
        finally:
            for layer in self.layers:
                object.__delattr__(layer, "call")


def _eligible(layer) -> bool:
    """Whether ``layer`` computes a^T delta for its kernel's gradient and nothing else reads its
    weights by its construction (see the module docstring)."""
    return (type(layer) is keras.layers.Dense and layer.built and "call" not in vars(layer)
            and not layer.lora_enabled and layer.quantization_mode is None
            and layer.kernel_regularizer is None and layer.bias_regularizer is None
            and layer.compute_dtype == layer.variable_dtype)
