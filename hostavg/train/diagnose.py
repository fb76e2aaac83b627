"""Verdicts on a run from what its steps measured: a learning rate too high, dead variables,
vanishing and exploding gradients (:class:`Diagnose`, in every trainer's hooks by default).

Each threshold below was chosen from measured runs, said beside it. A verdict is reached
once per kind and variable (``"exploding"`` once per run), warned as a
:class:`DiagnosisWarning` and kept in ``StepResult.info["diagnoses"]``, which History keeps
(``History.diagnoses()``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from types import MappingProxyType

from hostavg.core.errors import short, warn
from hostavg.core.gradients import SparseGradient

__all__ = ["DEAD_STEPS", "DIAGNOSES", "Diagnose", "DiagnosisWarning", "EXPLODING",
           "EXPLODING_STEPS", "MEASURED_FIRST", "MEASURE_EVERY", "UPDATE_STEPS",
           "UPDATE_TOO_LARGE", "VANISHING", "VANISHING_STEPS"]

#: The kinds of verdict, in the order they are looked for.
DIAGNOSES = ("update_too_large", "dead", "vanishing", "exploding")

#: |update| / |weights| above which an update is too large. Measured on digits (a ReLU MLP
#: 64-64-10, Adam, micro-batches of 16): at lr 1e-2 and 1e-3 no kernel exceeded 0.065; at lr
#: 1.0 every kernel made 5.6-6.5 at step 1 and stayed over 0.2 for 5 steps (over 0.1 for
#: 7-9), until its units died. Not 0.1: the docs' linear regressions under plain SGD, which
#: converge, move by 0.10-0.13 of themselves in their first steps. A variable that starts at
#: 0 (a bias: its first ratio is inf) moves by 0.15-0.9 of itself in its first ten steps at
#: every learning rate and is not judged; and the verdict needs the variables over it to hold
#: most of the model's parameters.
UPDATE_TOO_LARGE = 0.2
#: Of how many of a variable's last measured ratios most (over half, and 3 at least) must be
#: too large.
UPDATE_STEPS = 5
#: The applies that measure update ratios for Diagnose: the first ``MEASURED_FIRST``, where a
#: learning rate too high shows (its units die within ten steps), then one in
#: ``MEASURE_EVERY`` (a measured apply reads every weight once more).
MEASURED_FIRST, MEASURE_EVERY = 20, 10
#: Steps in a row of a gradient exactly 0 in every micro-batch that make a variable dead: a
#: healthy variable's gradient is never exactly 0 (a float sum of many terms).
DEAD_STEPS = 20
#: How many times below the largest variable's |gradient| / |weights| a vanishing variable's
#: sits, and for how many steps in a row. Measured on digits: an 8-layer sigmoid MLP's first
#: kernels sit 3e4-5e4 below the output's; healthy MLPs' variables stay within 1e3.
VANISHING, VANISHING_STEPS = 1e4, 20
#: How many times its running median (the last 20 steps) the mean gradient's norm must be, in
#: how many steps in a row, to be exploding.
EXPLODING, EXPLODING_STEPS = 100.0, 3

_ADVICE = {
    "update_too_large": "lower the learning rate (by 10x to start), or warm it up",
    "dead": "dead units (ReLUs pushed below 0 for good, by a learning rate too high or a bias "
            "started too low) or a variable the loss does not reach: look at its layer's "
            "activations; a lower learning rate, another initialisation or a leaky activation",
    "vanishing": "saturating activations or too deep a stack: ReLU-like activations, "
                 "normalisation layers, residual connections or another initialisation",
    "exploding": "clip the mean gradient (hostavg.hooks.ClipGlobalNorm), lower the learning "
                 "rate, or look at those steps' data (History.micro_table())",
}


class DiagnosisWarning(UserWarning):
    """A verdict of :class:`Diagnose`: its kind, the variables, the evidence and advice."""


class Diagnose:
    """Judges each applied step's measurements, and warns once per verdict and variable.

    Verdicts (thresholds: this module's constants, each said why):

    - ``"update_too_large"``: the variables whose |update| / |weights| is over
      :data:`UPDATE_TOO_LARGE` in most of their last :data:`UPDATE_STEPS` measured applies
      (3 at least), where they hold most of the model's parameters; not a variable that
      started at 0 (its first measured ratio inf). Diagnose asks for the update ratios it needs
      (``wants_update_ratios``: the first :data:`MEASURED_FIRST` applies, then one in
      :data:`MEASURE_EVERY`).
    - ``"dead"``: a gradient exactly 0 in every micro-batch of :data:`DEAD_STEPS` steps.
    - ``"vanishing"``: |gradient| / |weights| :data:`VANISHING` times below the largest
      variable's for :data:`VANISHING_STEPS` steps, the variables named in the model's
      order (from the input side; not an embedding's sparse gradient, a few of its rows, nor
      weights that started at 0); judged on gradients, which Adam's normalised updates hide.
      The weights' norms are the last measured.
    - ``"exploding"``: the mean gradient's norm over :data:`EXPLODING` times its median over
      the last 20 steps, :data:`EXPLODING_STEPS` steps in a row.

    Each verdict reached is a record (``step``, ``kind``, ``variables``, ``evidence``,
    ``advice``) in ``result.info["diagnoses"]`` and a :class:`DiagnosisWarning`.
    """

    #: Its own arithmetic calls NumPy's BLAS only through hostavg's, which holds it at one
    #: thread (:mod:`hostavg.core.blas`): calling it takes no hold of its own.
    _hostavg_no_blas = True

    def __init__(self):
        self._ratios = {}        # variable -> its last measured ratios
        self._norms = {}         # variable -> its weights' last measured norm
        self._started_zero = set()  # variables whose first measured ratio was inf
        self._zero = {}          # variable -> steps in a row its gradient was exactly 0
        self._below = {}         # variable -> steps in a row it sat VANISHING below the largest
        self._grad_norms = deque(maxlen=20)
        self._high = 0           # steps in a row the mean's norm was EXPLODING times the median
        self._measured = 0
        self._said = set()       # (kind, variable) reached

    def wants_update_ratios(self, step: int) -> bool:
        return self._measured < MEASURED_FIRST or step % MEASURE_EVERY == 0

    def on_applied(self, result) -> None:
        found = [*self._update_too_large(result), *self._dead(result),
                 *self._vanishing(result), *self._exploding(result)]
        records = []
        for kind, names, evidence in found:
            self._said.update((kind, n) for n in names or (None,))
            records.append(MappingProxyType({"kind": kind, "variables": tuple(names),
                                             "evidence": evidence, "advice": _ADVICE[kind]}))
            said = f" ({', '.join(names)})" if names else ""
            warn(DiagnosisWarning(f"step {result.step}: {kind}{said}: {evidence}. "
                                  f"Advice: {_ADVICE[kind]}."))
        if records:
            result.info["diagnoses"] = tuple(records)

    def _new(self, kind: str, names) -> list:
        """Those of ``names`` not yet in a verdict of ``kind``."""
        return [n for n in names if (kind, n) not in self._said]

    def _update_too_large(self, result) -> list:
        if result.update_ratios is None:
            return []
        self._measured += 1
        over = []
        for name, ratio in result.update_ratios.items():
            if name not in self._ratios and math.isinf(ratio):
                self._started_zero.add(name)  # weights of norm 0 that moved
            last = self._ratios.setdefault(name, deque(maxlen=UPDATE_STEPS))
            last.append(ratio)
            over_it = sum(r > UPDATE_TOO_LARGE for r in last)
            if over_it >= 3 and 2 * over_it > len(last) and name not in self._started_zero:
                over.append(name)
        self._norms.update(result.weight_norms or {})
        sizes = {n: math.prod(g.shape) for n, g in result.grads.items()}
        if 2 * sum(sizes[n] for n in over) <= sum(sizes.values()):
            return []  # biases started at 0, say: not the model's updates
        over = self._new("update_too_large", over)
        if not over:
            return []
        worst = max(over, key=lambda n: max(self._ratios[n]))
        return [("update_too_large", over,
                 f"|update| / |weights| over {UPDATE_TOO_LARGE:g} in most of the last measured "
                 f"applies ({worst}: {', '.join(short(r) for r in self._ratios[worst])})")]

    def _dead(self, result) -> list:
        per_micro = result.stats.micro_variable_norms or (result.stats.variable_norms,)
        dead = []
        for name in result.stats.variable_norms:
            zero = all(m.get(name, 0.0) == 0 for m in per_micro if m is not None)
            if _streak(self._zero, name, zero) >= DEAD_STEPS:
                dead.append(name)
        dead = self._new("dead", dead)
        if not dead:
            return []
        return [("dead", dead, f"a gradient exactly 0 in every micro-batch of the last "
                               f"{DEAD_STEPS} steps")]

    def _vanishing(self, result) -> list:
        grads = result.stats.variable_norms
        # 0 is dead's, not this; a sparse gradient touches a few rows of a table it is judged
        # against whole: an embedding of 50,000 rows sat 1e4 below its model's output bias;
        # weights that started at 0 (a bias) are small by their start, not by their gradient:
        # a transformer's attention output bias stood 1e4 above its query kernel at step 20
        relative = {n: g / self._norms[n] for n, g in grads.items()
                    if self._norms.get(n, 0) > 0 and math.isfinite(g) and g > 0
                    and n not in self._started_zero
                    and not isinstance(result.grads.get(n), SparseGradient)}
        if len(relative) < 2:
            return []
        top = max(relative, key=relative.get)
        low = []
        for name, value in relative.items():
            if _streak(self._below, name, value * VANISHING < relative[top]) >= VANISHING_STEPS:
                low.append(name)
        low = self._new("vanishing", low)
        if not low:
            return []
        return [("vanishing", low,
                 f"|gradient| / |weights| {short(relative[low[0]])} ({low[0]}), over "
                 f"{short(VANISHING)}x below {top}'s {short(relative[top])}, for "
                 f"{VANISHING_STEPS} steps")]

    def _exploding(self, result) -> list:
        norm = result.stats.grad_norm
        median = statistics.median(self._grad_norms) if len(self._grad_norms) >= 3 else None
        high = median is not None and median > 0 and norm > EXPLODING * median
        self._high = self._high + 1 if high else 0
        if not high:  # a step that explodes does not move the median it is judged against
            self._grad_norms.append(norm)
        if self._high < EXPLODING_STEPS or ("exploding", None) in self._said:
            return []
        return [("exploding", (),
                 f"the mean gradient's norm {short(norm)}, {short(norm / median)}x its median "
                 f"{short(median)} over the last steps, for {EXPLODING_STEPS} steps in a row")]


def _streak(counts: dict, name: str, hit: bool) -> int:
    """``counts[name]``, the steps in a row that were a ``hit``, with this step's ``hit``."""
    counts[name] = counts.get(name, 0) + 1 if hit else 0
    return counts[name]
