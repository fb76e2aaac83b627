"""Pictures of micro-batch gradients, with matplotlib (``pip install matplotlib``).

Each function takes what training produced, a list of ``StepResult`` (say,
``results.append(trainer.step(...))``) or a record from
:func:`hostavg.load_record`, draws on ``ax`` (a new figure's axes by default)
and returns the axes.
"""

from __future__ import annotations

import math

import numpy as np

from hostavg.errors import HostavgError
from hostavg.stats import NoiseScale, NoiseScaleEstimate, flatten, pairwise_cosines

__all__ = ["cosine_heatmap", "micro_norms", "noise_scale"]


def _axes(ax):
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise HostavgError("hostavg.plot needs matplotlib: pip install matplotlib") from None
    return plt.subplots(figsize=(7, 4))[1]


def _stat(stats, name):
    return stats.get(name) if isinstance(stats, dict) else getattr(stats, name)


def _steps(steps):
    out = [(s.step, s.stats) for s in steps if s.stats is not None]
    if not out:
        raise HostavgError("nothing to plot: no step with statistics was given")
    return out


def micro_norms(steps, ax=None):
    """Each micro-batch's gradient norm (dots) and the mean's norm (line) over steps."""
    ax = _axes(ax)
    rows = _steps(steps)
    xs = [step for step, st in rows for _ in _stat(st, "micro_norms")]
    ys = [n for _, st in rows for n in _stat(st, "micro_norms")]
    ax.scatter(xs, ys, s=8, alpha=0.5, label="micro-batch gradient norm")
    ax.plot([s for s, _ in rows], [_stat(st, "grad_norm") for _, st in rows], color="black",
            label="norm of the mean")
    ax.set(xlabel="global step", ylabel="L2 norm", yscale="log",
           title="Gradient norms: micro-batches vs their mean")
    ax.legend()
    return ax


def noise_scale(steps, ax=None, beta: float = 0.9):
    """The simple noise scale B_simple over steps: each step's estimate and a running one.

    The running estimate is :class:`hostavg.NoiseScale` with ``beta``; steps
    whose single estimate is negative (g2 < 0, which happens) are drawn as
    missing points but still feed the running estimate.
    """
    ax = _axes(ax)
    rows = [(s, st) for s, st in _steps(steps) if _stat(st, "trace_sigma") is not None]
    if not rows:
        raise HostavgError("no step has a noise-scale estimate: they need 2 or more micro-batches")
    tracker = NoiseScale(beta)
    running = [tracker.update(NoiseScaleEstimate(_stat(st, "g2"), _stat(st, "trace_sigma"),
                                                 _stat(st, "b_simple")), s) for s, st in rows]
    single = [b if b is not None and b > 0 and math.isfinite(b) else np.nan
              for b in (_stat(st, "b_simple") for _, st in rows)]
    steps_x = [s for s, _ in rows]
    ax.scatter(steps_x, single, s=8, alpha=0.4, label="one step's estimate")
    ax.plot(steps_x, running, color="black", label=f"running estimate (beta={beta})")
    ax.set(xlabel="global step", ylabel="B_simple (samples)", yscale="log",
           title="Gradient noise scale")
    ax.legend()
    return ax


def cosine_heatmap(step, ax=None):
    """The cosine between every two micro-batches' gradients in one step.

    ``step`` is a ``StepResult`` of ``accumulate="stack"`` or a recorded step
    with micro-batch gradients; dropped micro-batches are left out.
    """
    if hasattr(step, "micro_grads"):
        grads = [step.micro_grads(m["index"]) for m in step.micro if m["recorded"]]
    else:
        grads = [m.grads for m in step.micro if m.grads is not None and m.dropped is None]
    if len(grads) < 2:
        raise HostavgError("cosine_heatmap needs the gradients of 2 or more micro-batches: "
                           "train with accumulate='stack', or record with Record(..., micro=True)")
    ax = _axes(ax)
    image = ax.imshow(pairwise_cosines(flatten(grads)[0]), vmin=-1, vmax=1, cmap="RdBu_r")
    ax.figure.colorbar(image, ax=ax, label="cosine")
    ax.set(xlabel="micro-batch", ylabel="micro-batch",
           title=f"Agreement of micro-batch gradients, step {step.step}")
    return ax
