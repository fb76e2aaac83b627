"""Frozen variables: what the ``frozen`` hooks name at a step is held around its apply and put back.

At a step where a hook's ``frozen(step, names)`` names trained variables, their values and
those of their optimizer slots (:meth:`~hostavg.engine.protocols.Backend.state_of`) are read
before the apply and assigned back after it, and the apply's report is made to say so: their
update ratios 0, their weights after the apply those before, their updates 0. The optimizer's
counters are not held: they advance. A step where no hook names any reads nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hostavg.core.errors import ArgumentError
from hostavg.engine.hooks import call, name_of
from hostavg.engine.protocols import Applied, Backend

__all__ = ["Held", "held", "named"]


def named(hooks: Sequence, step: int, spec: Mapping) -> tuple[str, ...]:
    """The trained variables the ``frozen`` methods of ``hooks`` ((hook, method) pairs) name at
    ``step`` (the global step after the apply), each once, in ``spec``'s order; ArgumentError
    naming a hook's name that is no trained variable."""
    names, chosen = tuple(spec), set()
    for hook, method in hooks:
        got = call(hook, method, (step, names), f"frozen of step {step}")
        unknown = [n for n in got if n not in spec]
        if unknown:
            raise ArgumentError(
                f"hook {name_of(hook)}'s frozen({step}) named {unknown!r}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not trained; nothing was applied. The "
                f"trained variables: {list(names)}")
        chosen.update(got)
    return tuple(n for n in names if n in chosen)


class Held(NamedTuple):
    """What a step holds of its frozen variables while it applies.

    Attributes:
      state: name -> the names (in :meth:`Backend.variables`) of each frozen trained
        variable, then of its slots.
      values: name (in :meth:`Backend.variables`) -> its value before the apply.
    """

    state: dict
    values: dict

    def put_back(self, backend: Backend, applied: Applied) -> Applied:
        """Assigns the held values back after an apply that went through; ``applied`` as it
        would be had the frozen variables not moved."""
        backend.assign(self.values)
        before = {name: self.values[keys[0]] for name, keys in self.state.items()}
        return applied._replace(
            update_ratios=None if applied.update_ratios is None
            else {**applied.update_ratios, **dict.fromkeys(before, 0.0)},
            weights=None if applied.weights is None else {**applied.weights, **before},
            updates=None if applied.updates is None
            else {**applied.updates, **{n: np.zeros_like(w) for n, w in before.items()}})


def held(backend: Backend, names: Sequence[str]) -> Held | None:
    """The values of the trained variables ``names`` and of their slots, before an apply; None
    (nothing read) for no names."""
    if not names:
        return None
    state = backend.state_of(names)
    return Held(state, backend.variables([k for keys in state.values() for k in keys]))
