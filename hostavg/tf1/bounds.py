"""The update rule of a TF1 optimizer, for the host-side proof that an apply stays finite
(:mod:`hostavg.core.bounds`): GradientDescent, Momentum (Nesterov too) and Adam, each of
exactly that class (a subclass may change the update), with hyper-parameters that are
numbers or constant tensors (read from private attributes:
:func:`~hostavg.compat.tensorflow.hyperparameters`), and a learning rate that is one or a
placeholder the apply is fed. Any other optimizer, or a learning rate computed in the graph (a decay of the global
step), has every apply checked on the device.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from hostavg.compat.tensorflow import hyperparameters
from hostavg.core.bounds import SGD, Adam, UpdateBound, epsilon_in, rounded_up
from hostavg.core.gradients import VariableSpec

__all__ = ["update_bound"]

v1 = tf.compat.v1


def update_bound(optimizer, rate, apply_inputs: Mapping, spec: Mapping[str, VariableSpec],
                 slots: Mapping[str, Mapping[str, str]], trained: list) -> UpdateBound | None:
    """The :class:`~hostavg.core.bounds.UpdateBound` of ``optimizer`` (``rate``: its
    learning-rate tensor; ``apply_inputs``: name -> the placeholders the apply is fed;
    ``slots``: trained name -> slot name -> the slot variable's name; ``trained``: the
    variables, none with a constraint, which the optimizer applies after its update), or
    None."""
    learning_rate = _rate(rate, apply_inputs)
    rule = _rule(optimizer, spec)
    if learning_rate is None or rule is None or any(
            getattr(v, "constraint", None) is not None for v in trained):
        return None
    roles = {}
    for name in spec:
        held = {"weight": name, **{role: slots[name].get(role) for role in rule.roles}}
        if None in held.values():
            return None
        roles[name] = held
    return UpdateBound(rule, roles, learning_rate)


def _rule(optimizer, spec: Mapping[str, VariableSpec]):
    """The rule of ``optimizer``'s update, or None where it is none of those known (or its
    hyper-parameters cannot be read: :func:`~hostavg.compat.tensorflow.hyperparameters`)."""
    found = hyperparameters(optimizer)
    if found is None:
        return None
    if isinstance(optimizer, v1.train.MomentumOptimizer):
        momentum = _number(found["momentum"])
        return None if momentum is None else SGD(momentum, bool(found["nesterov"]))
    if isinstance(optimizer, v1.train.AdamOptimizer):
        b1, b2, eps = (_number(found[k]) for k in ("beta1", "beta2", "epsilon"))
        dtypes = [s.dtype for s in spec.values()]
        if None in (b1, b2, eps):
            return None
        b1 = rounded_up(b1, dtypes)  # as the kernels cast it to each variable's dtype
        if not (0 <= b1 < 1 and 0 <= b2 <= 1):
            return None
        return Adam(b1, b2, epsilon_in(eps, dtypes))
    return SGD()


def _number(value) -> float | None:
    """``value`` (a number or a tensor of constant value) as a float, else None."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, tf.Tensor):
        found = tf.get_static_value(value)
        if found is not None and np.ndim(found) == 0:
            return float(found)
    return None


def _rate(rate, apply_inputs: Mapping):
    """``f(apply feed) -> float`` of the learning-rate tensor ``rate``: its constant value,
    or what the apply is fed for it; None where it is computed in the graph."""
    if rate is None:
        return None
    value = _number(rate)
    if value is not None:
        return lambda feed: value
    name = rate.name
    if name in apply_inputs:
        return lambda feed: float(feed[name]) if name in feed else None
    return None
