"""Bounds that prove an optimizer's update finite on the host, before it runs.

A checked apply (``check_applied``) must never keep a NaN or an Inf in the weights or the
optimizer's state. Checking on the device means keeping what the update writes, to undo it
with: the optimizer then copies what it would update in place (a whole embedding table and
its slots). For the optimizers whose update is known here, the host can instead prove that
an apply stays finite, from three things it has: a bound on the largest magnitude of each
weight and slot (measured once by a checked apply, then carried forward by these rules), a
bound on the mean gradient's largest entry (its L2 norm, which the step computed anyway), and
the learning rate. Where every bound after the update, and every value the update's formula
forms on the way, stays below a quarter of the dtype's largest finite value, no entry can
overflow, and with finite inputs IEEE arithmetic makes NaN only of Inf, 0/0 or the square
root of a negative number, which these formulas cannot form (Adam's denominator is at least
its epsilon, its second moment a sum of non-negative terms): nothing needs keeping.

Each rule's :meth:`advance` maps the bounds of one step (role -> the largest magnitude over
every trained variable, a float) to those after it, and the intermediates to check: exact
magnitudes (the triangle inequality), each widened by :data:`ROUNDING` epsilons of the dtype
times the sum of the magnitudes its formula adds (its operations' rounding, cancellation too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

__all__ = ["Adam", "ROUNDING", "SGD", "UpdateBound", "epsilon_in", "rounded_up", "sparse_factor"]

#: The widening of each bound per step, in units of its dtype's epsilon: the update's
#: formulas form each value in at most eight operations.
ROUNDING = 8


def _decayed(weight, lr, weight_decay: float):
    """The bound of a weight after Keras's decoupled weight decay, w - lr wd w."""
    return weight * (1.0 + lr * abs(weight_decay)) if weight_decay else weight


def _formed(w, g, weight_decay: float, clip: float) -> list:
    """What Keras forms on the way, besides the update: ``w * wd`` of its weight decay, and the
    clipping's squares and products (``g^2`` of a norm, ``g * clipnorm``), computed in the
    variable's dtype, which may overflow where the update would not."""
    formed = [w * abs(weight_decay)] if weight_decay else []
    if clip:
        formed += [g * g, g * clip]
    return formed


def _widened(exact, scale, eps):
    """``exact`` widened for rounding: plus :data:`ROUNDING` epsilons of ``scale``."""
    return exact + ROUNDING * eps * scale


class SGD(NamedTuple):
    """Gradient descent, with momentum where ``momentum`` is not 0.

    TF1's (``keras=False``): ``a = mu a + g; w -= lr a`` (Nesterov: ``w -= lr (g + mu a)``).
    Keras's (``keras=True``): ``m = mu m - lr g; w += m`` (Nesterov: ``w += mu m - lr g``),
    after its weight decay. ``clip``: Keras's clipnorm or global_clipnorm (0: none), whose
    squares are checked too. Role of the slot: ``"momentum"``.
    """

    momentum: float = 0.0
    nesterov: bool = False
    keras: bool = False
    weight_decay: float = 0.0
    clip: float = 0.0

    @property
    def roles(self) -> tuple:
        """The slot roles this rule bounds, besides ``"weight"``."""
        return ("momentum",) if self.momentum else ()

    def advance(self, s: Mapping, g, lr: float, eps) -> tuple[dict, list]:
        """(the bounds after one update, its intermediates) from ``s`` (role -> bound), ``g``
        (the gradient's), ``lr`` and ``eps`` (the widest epsilon of the variables' dtypes).
        Every term here is a magnitude that adds: each bound is its own rounding scale."""
        lr = abs(lr)
        w = _decayed(s["weight"], lr, self.weight_decay)
        mu = abs(self.momentum)
        steps = _formed(s["weight"], g, self.weight_decay, self.clip)
        if not mu:
            new = {"weight": w + lr * g}
        else:
            if self.keras:
                m = mu * s["momentum"] + lr * g
                step = mu * m + lr * g if self.nesterov else m
            else:
                m = mu * s["momentum"] + g
                step = lr * (g + mu * m) if self.nesterov else lr * m
            new = {"weight": w + step, "momentum": m}
            steps.append(step)
        return {r: _widened(x, x, eps) for r, x in new.items()}, steps


class Adam(NamedTuple):
    """Adam, TF1's and Keras's alike (AdamW: Keras's ``weight_decay``), ``amsgrad`` too.

    ``m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2); w -= alpha m / (sqrt(v) + eps)`` with
    ``alpha = lr sqrt(1 - b2^t) / (1 - b1^t)``, at most ``lr / (1 - b1)`` at any step t
    (``beta_1`` as the variables' dtypes round it, the largest: 0.995 is 0.99609 in bfloat16);
    ``m / (sqrt(v) + eps)`` is at most ``|m| / eps`` since ``sqrt(v) >= 0`` (amsgrad divides
    by the running maximum of v: the same bound). ``epsilon``: the smallest of the trained
    variables' dtypes hold (1e-8 is 0 in float16: then nothing can be proven). Roles of the
    slots: ``"m"``, ``"v"``, and ``"vhat"`` with ``amsgrad``.
    """

    beta_1: float
    beta_2: float
    epsilon: float
    amsgrad: bool = False
    weight_decay: float = 0.0
    clip: float = 0.0

    @property
    def roles(self) -> tuple:
        return ("m", "v", "vhat") if self.amsgrad else ("m", "v")

    def advance(self, s: Mapping, g, lr: float, eps) -> tuple[dict, list]:
        """As :meth:`SGD.advance`; the moments' formulas add ``m`` and ``(g - m)(1 - b1)``
        (``v`` and ``(g^2 - v)(1 - b2)``), whose magnitudes are their rounding scale."""
        lr = abs(lr)
        b1, b2, gg = self.beta_1, self.beta_2, g * g
        w = _decayed(s["weight"], lr, self.weight_decay)
        m = _widened(b1 * s["m"] + (1.0 - b1) * g, s["m"] + (1.0 - b1) * (g + s["m"]), eps)
        v = _widened(b2 * s["v"] + (1.0 - b2) * gg, s["v"] + (1.0 - b2) * (gg + s["v"]), eps)
        new = {"m": m, "v": v}
        if self.amsgrad:
            new["vhat"] = max(s["vhat"], v)
        step = lr / (1.0 - b1) * m / self.epsilon if self.epsilon > 0 else math.inf
        new["weight"] = _widened(w + step, w + step, eps)
        return new, [g + s["m"], gg + s["v"], step, lr / (1.0 - b1) * m,
                     *_formed(s["weight"], g, self.weight_decay, self.clip)]


class UpdateBound(NamedTuple):
    """What a backend tells the engine for the host-side proof
    (:meth:`~hostavg.engine.protocols.Bounded.update_bound`).

    Attributes:
      rule: the optimizer's update, an :class:`SGD` or :class:`Adam`.
      roles: trained variable name (of ``spec``) -> role (``"weight"`` and each of
        ``rule.roles``) -> the name in :meth:`Backend.variables` of the variable holding it.
      learning_rate: ``f(apply feed) -> float`` the learning rate the next apply uses, or None
        where it cannot be told before the apply (a rate computed in the graph from the
        global step): that apply is then checked on the device.
    """

    rule: SGD | Adam
    roles: Mapping[str, Mapping[str, str]]
    learning_rate: Callable[[Mapping], float | None]

    @property
    def measured(self) -> list:
        """The names (in :meth:`Backend.variables`) of every variable the bounds cover, in the
        order a measuring apply reports them: per trained variable, its weight then each slot
        role of ``rule.roles``."""
        return [held[r] for held in self.roles.values() for r in ("weight", *self.rule.roles)]


def epsilon_in(epsilon: float, dtypes) -> float:
    """``epsilon`` as the narrowest of ``dtypes`` holds it: the smallest of its values there
    (0 where one rounds it to 0)."""
    return min(float(np.asarray(epsilon, dtype)) for dtype in dtypes)


def rounded_up(value: float, dtypes) -> float:
    """``value`` as the widest rounding of ``dtypes`` holds it: the largest of its values
    there (a beta close to 1, which bfloat16 rounds up)."""
    return max(float(np.asarray(value, dtype)) for dtype in dtypes)


def sparse_factor(rows: int) -> float:
    """How much larger than the L2 norm of a sparse gradient's values an entry of the dense
    gradient it sums to can be: ``sqrt(rows)`` (a row given ``rows`` times sums them:
    |sum| <= sum |x| <= sqrt(rows) |x|, Cauchy-Schwarz)."""
    return float(np.sqrt(max(rows, 1)))
