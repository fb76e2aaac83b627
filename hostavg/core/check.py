"""Does splitting into micro-batches give the whole batch's gradient? A self-check. Pure NumPy.

hostavg's step equals the full-batch step only when the loss is the MEAN of
per-sample losses computed independently of each other. Three things break
that in real programs, and each leaves its own fingerprint when the same
feed is run whole and in micro-batches from the same weights:

* a loss that is a SUM over samples (or divided by a fixed batch-size
  constant): the micro-batch mean is the whole gradient scaled down, by the
  number of micro-batches when they are equal;
* random ops in training mode (dropout, sampled losses): the same feed run
  twice gives two gradients;
* ops that compute over the batch (batch norm in training mode): neither a
  scale nor noise, a difference that stays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hostavg.core.gradients import SparseGradient

__all__ = ["CheckReport", "diagnose"]

#: Relative difference under which two gradients count as equal, by dtype:
#: room for summation order (float32: ~1e-6 seen), far below any real cause.
TOLERANCE = {np.dtype("float16"): 1e-2, np.dtype("float32"): 1e-4, np.dtype("float64"): 1e-9}


@dataclass(frozen=True)
class CheckReport:
    """What ``trainer.check`` found.

    Attributes:
      ok: the sample-weighted mean of the micro-batch gradients equals the
        whole feed's gradient for every variable, within :data:`TOLERANCE`.
      max_rel_diff: name -> |mean - whole| / |whole| (L2 norms) per variable.
      micro_batches: how many micro-batches the feed was cut into.
      scale: |whole| / |mean| over all variables (1 when ok; the number of
        micro-batches for a loss that is a sum).
      noise: the largest relative difference between two runs of the whole
        feed (0 for a deterministic model).
      cause: None when ok; else the likely cause and what to do, in words.
    """

    ok: bool
    max_rel_diff: dict
    micro_batches: int
    scale: float
    noise: float
    cause: str | None

    def __str__(self) -> str:
        worst = max(self.max_rel_diff, key=self.max_rel_diff.get)
        said = (f"largest relative difference {self.max_rel_diff[worst]:.2g} in {worst!r}")
        if self.ok:
            return (f"self-check passed: {self.micro_batches} micro-batches give the whole "
                    f"feed's gradient ({said})")
        return f"self-check FAILED: {self.micro_batches} micro-batches differ ({said}): {self.cause}"


def diagnose(whole: Mapping, again: Mapping, mean: Mapping, micro_batches: int) -> CheckReport:
    """Compares the micro-batch mean with the whole feed's gradient, and says why they differ.

    Args:
      whole, again: the gradient of the whole feed, run twice from the same weights.
      mean: the sample-weighted mean of its micro-batches' gradients.
      micro_batches: how many there were.
    """
    rel, noise, sq_whole, sq_mean, dot = {}, 0.0, 0.0, 0.0, 0.0
    ok = True
    for name in whole:
        tolerance = TOLERANCE.get(np.dtype(whole[name].dtype), 1e-4)
        w, a, m = (_dense(g[name]) for g in (whole, again, mean))
        nw = float(np.linalg.norm(w))
        rel[name] = float(np.linalg.norm(m - w)) / nw if nw else float(np.linalg.norm(m))
        noise = max(noise, float(np.linalg.norm(a - w)) / nw if nw else float(np.linalg.norm(a)))
        ok &= rel[name] <= tolerance
        sq_whole, sq_mean, dot = sq_whole + nw * nw, sq_mean + float(m @ m), dot + float(w @ m)
    scale = math.sqrt(sq_whole / sq_mean) if sq_mean else math.inf
    cosine = dot / math.sqrt(sq_whole * sq_mean) if sq_whole and sq_mean else 0.0
    cause = None
    if not ok:
        tolerance = max(TOLERANCE.values())
        if noise > tolerance:
            cause = (f"the same feed gives another gradient each run (by {noise:.2g}): random ops "
                     f"in training mode, such as dropout or a sampled loss. Turn them off for the "
                     f"check (keep_prob 1.0, training False) and check again")
        elif cosine > 0.9999 and micro_batches > 1 and abs(scale / micro_batches - 1) < 0.05:
            cause = (f"the whole gradient is {scale:.3g} times the micro-batch mean, about the "
                     f"number of micro-batches: the loss grows with the number of samples (a "
                     f"sum over samples, or a division by a fixed batch size). Use the mean, "
                     f"tf.reduce_mean, so that micro-batches average to the batch")
        elif cosine > 0.9999:
            cause = (f"the whole gradient is {scale:.3g} times the micro-batch mean: the loss "
                     f"is scaled by something that depends on the feed's size (a sum over "
                     f"samples, a division by a fixed batch size). Use tf.reduce_mean")
        else:
            cause = ("the micro-batches see something the whole feed does not: an op that "
                     "computes over the batch, such as batch norm in training mode (statistics "
                     "of each micro-batch instead of the batch). Expect a k-micro-batch step to "
                     "differ from a full-batch step; larger micro-batches make it smaller")
    return CheckReport(bool(ok), rel, micro_batches, scale, noise, cause)


def _dense(value) -> np.ndarray:
    if isinstance(value, SparseGradient):
        value = value.to_dense()
    return np.ravel(np.asarray(value, np.float64))
