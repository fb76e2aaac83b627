"""Whether an apply can skip the device-side check: the host-side proof that it stays finite
(:mod:`hostavg.core.bounds`), and the bounds it carries from apply to apply.

A :class:`Proof` serves one target (a session, a model). Its bounds come from a checked
apply that measured what it wrote (``ApplyRequest.magnitudes``): the largest magnitude of
every weight and slot after it. Each apply the rule proves finite is run unchecked (nothing
kept, nothing read: ``ApplyRequest.proven``), and the bounds advance by the rule; the
others are checked on the device, and measure again. Every :data:`EVERY` proven applies one
is checked and measures, so a value written outside the trainer (an assign between steps)
is seen within that many steps; a restore from a checkpoint forgets the bounds at once
(:meth:`Engine.forget_bounds`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import ml_dtypes

from hostavg.core.bounds import UpdateBound, sparse_factor
from hostavg.core.gradients import SparseGradient, VariableSpec

__all__ = ["ALLOWANCES", "EVERY", "Proof"]

#: Proven applies between two checked ones that measure again.
EVERY = 100

#: The multiples of the last apply's gradient bound that :meth:`Proof.allowance` tries, the
#: largest first: a gradient up to 4 times the last one's norm is still applied in the
#: compute's call.
ALLOWANCES = (4.0, 1.25)

#: target -> every Proof of it (of every trainer), to tell those that share a variable.
_PROOFS = weakref.WeakKeyDictionary()


class Proof:
    """The bounds of one target's weights and slots, and whether the next apply is proven.

    One bound per role (the weights, each slot), the largest magnitude over every trained
    variable: the proof costs a few dozen float operations per apply, whatever the model.

    Args:
      bound: the backend's :class:`~hostavg.core.bounds.UpdateBound`.
      spec: the trained variables' specs; each must be in ``bound.roles``.
      every: proven applies between two that measure.
      target: what holds the variables (a session, a model), shared with other trainers'
        proofs of it.
    """

    def __init__(self, bound: UpdateBound, spec: Mapping[str, VariableSpec], every: int = EVERY,
                 target=None):
        self.bound, self.every = bound, every
        self.names = list(spec)
        self.roles = ("weight", *bound.rule.roles)
        info = [ml_dtypes.finfo(s.dtype) for s in spec.values()]
        self.eps = max(float(f.eps) for f in info)
        self.limit = min(float(f.max) for f in info) / 4
        # A gradient entry whose square is below the narrowest dtype's smallest normal may be
        # lost from its squared norm (flushed to 0 on the device, or summed in that dtype).
        self._floor = max(math.sqrt(float(f.tiny)) for f in info)
        self._sparse = [n for n, s in spec.items() if s.sparse]
        # sqrt(rows) of the sparse variable with the most: the most a gradient's rows repeat
        self._rows = max((sparse_factor(s.shape[0]) for s in spec.values() if s.sparse),
                         default=1.0)
        self.bounds: dict | None = None  # role -> bound
        self.since = 0  # proven applies since the bounds were measured
        self._pending: dict | None = None
        self._allowed: dict | None = None  # the bounds after an apply at the allowance
        self._last: float | None = None  # the last gradient bound made of a mean
        self._sharing = weakref.WeakSet()  # other proofs of the target bounding a variable of mine
        if target is not None:
            self._share(target)

    def _share(self, target) -> None:
        """Registers this proof with ``target``'s others: each apply of one forgets the bounds of
        every other that bounds one of the same variables (two trainers of one model)."""
        mine = set(self.bound.measured)
        others = _PROOFS.setdefault(target, weakref.WeakSet())
        for other in others:
            if mine.intersection(other.bound.measured):
                other._sharing.add(self)
                self._sharing.add(other)
        others.add(self)

    @property
    def measuring(self) -> bool:
        """Whether the next apply must be checked and measure: the bounds are unknown, or
        :attr:`every` applies old."""
        return self.bounds is None or self.since >= self.every

    def proves(self, mean: Mapping, sq_norms: Mapping[str, float] | None, feed: Mapping) -> bool:
        """Whether the apply of ``mean`` (name -> array or SparseGradient; ``sq_norms`` its
        squared norms), fed ``feed``, is proven to leave every weight and slot finite; where it
        is, the bounds after it wait for :meth:`applied`. The gradient's bound is the norm of
        all of it (at least any variable's), times the repeats a sparse one's rows may sum."""
        self._pending = None
        if sq_norms is None:
            return False
        try:
            g = math.sqrt(math.fsum(sq_norms.values())) + self._floor
        except OverflowError:  # (fsum of finite squares past float64's range)
            return False
        if self._sparse:
            g *= max(sparse_factor(len(mean[n].indices)) if isinstance(mean[n], SparseGradient)
                     else 1.0 for n in self._sparse)
        self._last = g
        self._pending = self._admitted(g, feed)
        return self._pending is not None

    def allowance(self, feed: Mapping) -> float | None:
        """What an apply fed ``feed`` that must be allowed before its gradient is known
        (:class:`~hostavg.engine.protocols.Fused`) is allowed: the largest L2 norm of its
        gradient (times sqrt(rows) of its sparse part with the most) under which it is proven,
        found among a few multiples of the last apply's gradient bound (:data:`ALLOWANCES`);
        None where none proves it, or the bounds are being measured. The bounds after it
        wait for :meth:`settled`."""
        self._pending = self._allowed = None
        if self._last is None:
            return None
        for factor in ALLOWANCES:
            g = self._last * factor
            self._allowed = self._admitted(g, feed)
            if self._allowed is not None:
                # (the floor that proves adds, and the rounding of the norm where it is made)
                return (g - self._floor * self._rows) * (1 - 1e-9)
        return None

    def settled(self, mean: Mapping, sq_norms: Mapping[str, float], feed: Mapping) -> None:
        """After an apply that :meth:`allowance` allowed went through: the bounds after it, for
        :meth:`applied`, from its actual gradient ``mean`` (tighter), or the allowance's where
        the host's rounding of that gradient's norm disagrees."""
        allowed = self._allowed
        if not self.proves(mean, sq_norms, feed):
            self._pending = allowed

    def _admitted(self, g: float, feed: Mapping) -> dict | None:
        """The bounds after an apply fed ``feed`` of a gradient bounded by ``g``, where the rule
        proves every one of them (and every value formed on the way) within :attr:`limit`;
        else None."""
        if self.measuring:
            return None
        lr = self.bound.learning_rate(feed)
        if lr is None or not math.isfinite(lr):
            return None
        new, formed = self.bound.rule.advance(self.bounds, g, lr, self.eps)
        limit = self.limit
        ok = g <= limit and all(x <= limit for x in new.values()) and \
            all(x <= limit for x in formed)  # (False for a NaN)
        return new if ok else None

    def applied(self, magnitudes: Mapping[str, float] | None) -> None:
        """After an apply went through: the bounds become its ``magnitudes`` (name in
        :meth:`Backend.variables` -> largest magnitude, where it measured: a checked apply, or
        a proven one that its backend checked after all), else those :meth:`proves` found
        (each no lower than before: a value put back from before the apply, as a frozen
        variable's, stays within them); an apply neither proven nor measured leaves them
        unknown."""
        if self._sharing:  # (iterating even an empty WeakSet costs a step microseconds)
            for other in self._sharing:  # their variables moved without them
                other.bounds = None
        if magnitudes is not None:
            roles = self.bound.roles
            found = {r: [float(magnitudes[roles[n][r]]) for n in self.names] for r in self.roles}
            self.bounds = {r: math.inf if any(map(math.isnan, x)) else max(x)
                           for r, x in found.items()}
            self.since = 0
        elif self._pending is not None:
            self.bounds = {r: max(self.bounds[r], self._pending[r]) for r in self.roles}
            self.since += 1
        else:
            self.bounds = None
        self._pending = None
