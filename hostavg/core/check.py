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
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hostavg.core import display
from hostavg.core.blas import need_one_blas_thread
from hostavg.core.gradients import SparseGradient

__all__ = ["CAUSES", "RANDOM_KINDS", "CheckReport", "RandomOp", "diagnose", "fixed_batch_hint",
           "shows_fixed_batch"]

#: Relative difference under which two gradients count as equal, by dtype:
#: room for summation order (float32 sums in another order differ by about 1e-6), far below
#: any real cause.
TOLERANCE = {np.dtype("float16"): 1e-2, np.dtype("float32"): 1e-4, np.dtype("float64"): 1e-9}

#: A variable's difference is judged relative to its own gradient's norm, but never to less
#: than this fraction of the whole gradient's norm: a variable whose true gradient is zero (a
#: bias the softmax cancels, such as an attention key's) holds round-off alone, and round-off
#: relative to zero is anything. Differences below FLOOR * TOLERANCE of the whole gradient
#: (1e-7 in float32) are not seen; a sum loss or a batch-dependent op moves every variable by
#: far more.
FLOOR = 1e-3

#: The kinds of random op a backend finds (:class:`RandomOp`), each advised on by the
#: :data:`CAUSES` key of its name. "random": one that a feed turns off (dropout's keep_prob or
#: rate, a training flag). "sampled": the classes of a sampled loss (nce_loss). "draw": noise
#: drawn in the forward pass (a variational autoencoder's), which no feed turns off.
RANDOM_KINDS = ("random", "sampled", "draw")


class RandomOp(NamedTuple):
    """A random op that computing a micro-batch runs, as a backend names it for check's advice.

    Attributes:
      api: what the program called to make it, such as "tf.random.normal" or "tf.nn.dropout".
      tensor: the name of the tensor it draws.
      kind: one of :data:`RANDOM_KINDS`.
      saved: whether its random state is a variable, which checkpoints hold
        (``tf.random.Generator``'s); False where it lives in the framework's
        runtime (a TF1 session's kernels), so that a resumed run draws other
        numbers than one never stopped.
    """

    api: str
    tensor: str
    kind: str
    saved: bool = False


#: What a backend's advice (:attr:`hostavg.engine.protocols.Backend.advice`) says what to do
#: about, in the words of its framework: cause -> advice. The random kinds (above; "draw" is
#: formatted with the name of a tensor drawn, ``{tensor}``); "scale": a loss that grows with
#: the feed's size; "batch": examples of an op that computes over the batch, after "such as";
#: "fixed": examples of a size fixed in the graph, and what to use instead; "no_samples":
#: what to give check when the feed held no array of samples.
CAUSES = RANDOM_KINDS + ("scale", "batch", "fixed", "no_samples")


@dataclass(frozen=True)
class CheckReport:
    """What ``trainer.check`` found.

    Attributes:
      ok: the sample-weighted mean of the micro-batch gradients equals the
        whole feed's gradient for every variable, within :data:`TOLERANCE`.
      max_rel_diff: name -> |mean - whole| / max(|whole|, FLOOR * |W|) per
        variable (L2 norms; W: the whole gradient of every variable).
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
                    f"batch's gradient ({said})")
        return f"self-check FAILED: {self.micro_batches} micro-batches differ ({said}): {self.cause}"

    def __repr__(self) -> str:
        return display.shortened(str(self))

    def _repr_html_(self) -> str:
        verdict = "passed" if self.ok else "FAILED"
        lines = [f"whole / mean gradient norm: {display.number(self.scale)}; the whole batch run "
                 f"twice differs by {display.number(self.noise)}"]
        if self.cause is not None:
            lines.insert(0, f"cause: {self.cause}")
        rows = sorted(self.max_rel_diff.items(), key=lambda kv: -kv[1])
        return display.html(f"self-check {verdict}: {self.micro_batches} micro-batches against "
                            f"the whole batch", ["variable", "relative difference"], rows, lines)


def diagnose(whole: Mapping, again: Mapping, mean: Mapping, micro_batches: int,
             advice: Mapping[str, str], random_ops: Sequence[RandomOp] = ()) -> CheckReport:
    """Compares the micro-batch mean with the whole feed's gradient, and says why they differ.

    Each variable's difference is ``|mean - whole| / max(|whole|, FLOOR * |W|)``
    (L2 norms; W: the whole gradient over every variable), judged against
    :data:`TOLERANCE` for its dtype: see :data:`FLOOR`.

    Args:
      whole, again: the gradient of the whole feed, run twice from the same weights.
      mean: the sample-weighted mean of its micro-batches' gradients.
      micro_batches: how many there were.
      advice: what to do about each of :data:`CAUSES`, in the words of the
        backend's framework (:attr:`~hostavg.engine.protocols.Backend.advice`).
      random_ops: the random ops the backend found in what a micro-batch
        computes: named, with the advice for their kinds, when the feed's
        gradient differs between runs.
    """
    need_one_blas_thread()
    dense = {name: [_dense(g[name]) for g in (whole, again, mean)] for name in whole}
    floor = FLOOR * math.sqrt(math.fsum(float(w @ w) for w, _, _ in dense.values()))
    rel, noise, sq_whole, sq_mean, dot = {}, 0.0, 0.0, 0.0, 0.0
    ok = True
    for name, (w, a, m) in dense.items():
        tolerance = TOLERANCE.get(np.dtype(whole[name].dtype), 1e-4)
        nw = float(np.linalg.norm(w))
        scale_of = max(nw, floor)
        rel[name] = float(np.linalg.norm(m - w)) / scale_of if scale_of else float(np.linalg.norm(m))
        noise = max(noise, float(np.linalg.norm(a - w)) / scale_of if scale_of
                    else float(np.linalg.norm(a)))
        ok &= rel[name] <= tolerance
        sq_whole, sq_mean, dot = sq_whole + nw * nw, sq_mean + float(m @ m), dot + float(w @ m)
    scale = math.sqrt(sq_whole / sq_mean) if sq_mean else math.inf
    cosine = dot / math.sqrt(sq_whole * sq_mean) if sq_whole and sq_mean else 0.0
    cause = None
    if not ok:
        tolerance = max(TOLERANCE.values())
        scaled = cosine > 0.9999 and abs(scale - 1) > 0.01
        if noise > tolerance:
            cause = (f"the same batch gives another gradient each run (by {noise:.2g}): "
                     f"{_random(random_ops, advice)}")
        elif scaled and micro_batches > 1 and abs(scale / micro_batches - 1) < 0.05:
            cause = (f"the whole gradient is {scale:.3g} times the micro-batch mean, about the "
                     f"number of micro-batches: the loss grows with the number of samples (a "
                     f"sum over samples, or a division by a fixed batch size). "
                     f"{advice['scale']}, so that micro-batches average to the batch")
        elif scaled:
            cause = (f"the whole gradient is {scale:.3g} times the micro-batch mean: the loss "
                     f"is scaled by something that depends on the batch's size (a sum over "
                     f"samples, a division by a fixed batch size). {advice['scale']}")
        else:
            cause = (f"the micro-batches see something the whole batch does not: an op that "
                     f"computes over the batch (each micro-batch's own statistics instead of "
                     f"the batch's), {advice['batch']}. Where nothing makes them agree, expect "
                     f"a k-micro-batch step to differ from a full-batch step; larger "
                     f"micro-batches make it smaller")
    return CheckReport(bool(ok), rel, micro_batches, scale, noise, cause)


def _random(found: Sequence[RandomOp], advice: Mapping) -> str:
    """The random ops found (a few, named) and what to do about each kind; the usual suspects
    where none was found."""
    if not found:
        return f"random ops in training mode, such as dropout or a sampled loss. {advice['random']}"
    named = ", ".join(f"{op.api} ({op.tensor!r})" for op in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    todo = [advice[kind].format(tensor=next(op.tensor for op in found if op.kind == kind))
            for kind in RANDOM_KINDS if any(op.kind == kind for op in found)]
    return f"random ops in training mode: {named}{more}. {'. '.join(todo)}"


def _dense(value) -> np.ndarray:
    if isinstance(value, SparseGradient):
        value = value.to_dense()
    return np.ravel(np.asarray(value, np.float64))


def shows_fixed_batch(message: str, n: int, whole: int) -> bool:
    """Whether ``message`` (a framework's error on a micro-batch of ``n`` rows of a batch of
    ``whole``) holds two numbers in the ratio n : whole, as a shape built from the whole batch
    leaves them: ``[3,3] vs. [12,3]``, or ``9 values`` against ``36`` (rows of 3 numbers)."""
    if n == whole:
        return False
    numbers = {int(d) for d in re.findall(r"\d+", message)}
    return any(a % n == 0 and a // n * whole in numbers for a in numbers if a)


def fixed_batch_hint(n: int, whole: int, advice: Mapping[str, str]) -> str:
    """What to say of a micro-batch of ``n`` rows that fails where its batch of ``whole``
    would not (:func:`shows_fixed_batch`, or a loss alone not finite): a size fixed in the model."""
    return (f"the {advice['model_name']} likely fixes the batch size: it builds a shape from "
            f"the full batch ({whole} rows) where the micro-batch has {n} {advice['fixed']}.")
