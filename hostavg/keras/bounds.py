"""The update rule of a Keras optimizer, for the host-side proof that an apply stays finite
(:mod:`hostavg.core.bounds`): SGD (momentum, Nesterov), Adam (amsgrad) and AdamW, each of
exactly that class, with weight decay and clipping as Keras applies them (clipping shrinks a
gradient, but forms its squares in the variable's dtype, which are checked too), without an
exponential moving average of the weights, accumulation in the optimizer, a loss scale factor
or a variable's constraint (which each write or scale what the rules do not see). Any other
optimizer has every apply checked on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import keras
import numpy as np

from hostavg.core.bounds import SGD, Adam, UpdateBound, epsilon_in, rounded_up
from hostavg.core.gradients import VariableSpec

__all__ = ["update_bound"]

#: The name Keras gives each slot of a variable (``add_variable_from_reference``), by role.
_SLOTS = {"momentum": "momentum", "m": "momentum", "v": "velocity", "vhat": "velocity_hat"}


def update_bound(optimizer, trained: list, spec: Mapping[str, VariableSpec], key: Mapping,
                 learning_rate: Callable[[Mapping], float | None]) -> UpdateBound | None:
    """The :class:`~hostavg.core.bounds.UpdateBound` of ``optimizer`` over ``trained`` (the
    variables of ``spec``, in its order; ``key``: id of a variable -> its name in
    :meth:`Backend.variables`), or None."""
    rule = _rule(optimizer, spec)
    prefixes = [v.path.replace("/", "_") for v in trained]
    # A constraint (applied after each update) is no rule's; two paths one slot name could
    # name ("a/b_c", "a_b/c") would leave a slot unmeasured.
    if rule is None or any(getattr(v, "constraint", None) is not None for v in trained) \
            or len(set(prefixes)) < len(prefixes):
        return None
    slots = {v.name: v for v in optimizer.variables}
    roles = {}
    for name, v, prefix in zip(spec, trained, prefixes):
        held = {"weight": key[id(v)]}
        for role in rule.roles:
            slot = slots.get(f"{prefix}_{_SLOTS[role]}")
            if slot is None or tuple(slot.shape) != tuple(v.shape):
                return None
            held[role] = key[id(slot)]
        roles[name] = held
    return UpdateBound(rule, roles, learning_rate)


def _rule(optimizer, spec: Mapping[str, VariableSpec]):
    """The rule of ``optimizer``'s update, or None where it is none of those known."""
    if getattr(optimizer, "use_ema", False) or getattr(optimizer, "gradient_accumulation_steps",
                                                       None) \
            or getattr(optimizer, "loss_scale_factor", None) is not None:
        return None
    decay = _number(getattr(optimizer, "weight_decay", None) or 0.0)
    clips = [_number(getattr(optimizer, k, None) or 0.0) for k in ("clipnorm", "global_clipnorm")]
    if None in (decay, *clips):
        return None
    clip, kind, dtypes = max(clips), type(optimizer), [s.dtype for s in spec.values()]
    if kind is keras.optimizers.SGD:
        momentum = _number(optimizer.momentum)
        if momentum is None:
            return None
        return SGD(momentum, bool(optimizer.nesterov), keras=True, weight_decay=decay, clip=clip)
    if kind in (keras.optimizers.Adam, keras.optimizers.AdamW):
        b1, b2, eps = (_number(x) for x in (optimizer.beta_1, optimizer.beta_2,
                                            optimizer.epsilon))
        if None in (b1, b2, eps):
            return None
        b1 = rounded_up(b1, dtypes)  # as Keras casts it to each variable's dtype
        if not (0 <= b1 < 1 and 0 <= b2 <= 1):
            return None
        return Adam(b1, b2, epsilon_in(eps, dtypes), bool(optimizer.amsgrad), decay, clip)
    return None


def _number(value) -> float | None:
    """``value`` as a float where it is a number (not a callable, not a tensor), else None."""
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        return float(value)
    return None
