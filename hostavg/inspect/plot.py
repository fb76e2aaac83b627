"""Pictures of micro-batch gradients, with matplotlib (``pip install matplotlib``).

Each function takes what training produced, any of: a record from
:func:`hostavg.load_record`, a list of ``StepResult`` (say,
``results.append(trainer.step(...))``), or the :class:`~hostavg.History`
that ``fit`` returns; it checks what it was given before drawing anything,
draws on ``ax`` (a new figure's axes by default) and returns the axes.
Skipped steps are left out.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hostavg.core.errors import HostavgError
from hostavg.train.history import History
from hostavg.inspect.record import RecordedStep, RecordReader, check_quantity
from hostavg.core.results import StepResult
from hostavg.core.stats import NoiseScale, NoiseScaleEstimate, flatten, pairwise_cosines

__all__ = ["cosine_heatmap", "micro_norms", "noise_scale", "variable_norms"]

#: What every plot takes.
SOURCES = ("a record (hostavg.load_record(path)), a list of StepResults, or the History that "
           "fit returns")


class _Step(NamedTuple):
    """One step, whatever it came from: what the plots draw."""

    step: int
    grad_norm: float
    g2: float | None
    trace_sigma: float | None
    b_simple: float | None
    micro_norms: tuple
    micro_norms_before_clip: tuple | None
    variable_norms: dict
    update_ratios: dict


def _steps(source, plot: str) -> list[_Step]:
    """``source`` as a list of :class:`_Step`, or HostavgError before anything is drawn."""
    if isinstance(source, History):
        names = source.variables
        out = [_Step(s.step, s.grad_norm, s.g2, s.trace_sigma, s.b_simple, s.micro_norms,
                     s.micro_norms_before_clip, dict(zip(names, s.variable_norms)),
                     dict(zip(names, s.update_ratios))) for s in source.steps]
    elif isinstance(source, RecordReader) or (
            isinstance(source, (list, tuple)) and source
            and all(isinstance(s, (StepResult, RecordedStep)) for s in source)):
        out = [_of(s) for s in source]
    else:
        raise HostavgError(f"hostavg.plot.{plot} takes {SOURCES}; got {_described(source)}")
    out = [s for s in out if not math.isnan(s.grad_norm)]
    if not out:
        raise HostavgError(f"hostavg.plot.{plot}: nothing to plot, no applied step in "
                           f"{_described(source)}")
    return out


def _of(s) -> _Step:
    if isinstance(s, RecordedStep):
        st = s.stats
        return _Step(s.step, st.get("grad_norm", math.nan), st.get("g2"), st.get("trace_sigma"),
                     st.get("b_simple"), tuple(st.get("micro_norms") or ()),
                     s.info.get("micro_norms_before_clip"), st.get("variable_norms") or {},
                     s.update_ratios or {})
    st = s.stats
    if s.skipped or st is None:
        return _Step(s.step, math.nan, None, None, None, (), None, {}, {})
    return _Step(s.step, st.grad_norm, st.g2, st.trace_sigma, st.b_simple, st.micro_norms,
                 s.info.get("micro_norms_before_clip"), st.variable_norms,
                 s.update_ratios or {})


def _described(source) -> str:
    if isinstance(source, (list, tuple)):
        kinds = sorted({type(s).__name__ for s in source})
        return f"a {type(source).__name__} of {len(source)} ({', '.join(kinds) or 'empty'})"
    return type(source).__name__


def _axes(ax, plot: str):
    """``ax``, checked to be matplotlib Axes, or a new figure's axes for None."""
    if ax is not None:
        if not all(callable(getattr(ax, m, None)) for m in ("plot", "scatter", "set", "legend")):
            raise HostavgError(f"hostavg.plot.{plot}: ax must be matplotlib Axes (or None for a new "
                               f"figure), got {ax!r}")
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise HostavgError("hostavg.plot needs matplotlib: pip install matplotlib") from None
    return plt.subplots(figsize=(7, 4))[1]


def micro_norms(steps, ax=None):
    """Each micro-batch's gradient norm (dots) and the mean's norm (line) over steps.

    With :class:`~hostavg.hooks.ClipMicroBatchNorm`, the norms before clipping
    are drawn too (hollow), beside the clipped ones that were accumulated.
    """
    rows = _steps(steps, "micro_norms")
    ax = _axes(ax, "micro_norms")
    clipped = any(s.micro_norms_before_clip is not None for s in rows)
    xs = [s.step for s in rows for _ in s.micro_norms]
    ax.scatter(xs, [n for s in rows for n in s.micro_norms], s=8, alpha=0.5,
               label="micro-batch gradient norm" + (", clipped" if clipped else ""))
    if clipped:
        before = [(s.step, n) for s in rows for n in (s.micro_norms_before_clip or ())]
        ax.scatter(*zip(*before), s=14, facecolors="none", edgecolors="tab:red", alpha=0.6,
                   label="micro-batch gradient norm before clipping")
    ax.plot([s.step for s in rows], [s.grad_norm for s in rows], color="black",
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
    rows = [s for s in _steps(steps, "noise_scale") if s.trace_sigma is not None]
    if not rows:
        raise HostavgError("no step has a noise-scale estimate: they need 2 or more micro-batches")
    ax = _axes(ax, "noise_scale")
    tracker = NoiseScale(beta)
    running = [tracker.update(NoiseScaleEstimate(s.g2, s.trace_sigma, s.b_simple), s.step)
               for s in rows]
    single = [b if b is not None and b > 0 and math.isfinite(b) else np.nan
              for b in (s.b_simple for s in rows)]
    steps_x = [s.step for s in rows]
    ax.scatter(steps_x, single, s=8, alpha=0.4, label="one step's estimate")
    ax.plot(steps_x, running, color="black", label=f"running estimate (beta={beta})")
    ax.set(xlabel="global step", ylabel="B_simple (samples)", yscale="log",
           title="Gradient noise scale")
    ax.legend()
    return ax


def variable_norms(steps, ax=None, quantity: str = "grad_norm"):
    """One line per trained variable over steps: its gradient norm, or its update-to-weight ratio.

    Where the micro-batch norms and the noise scale look flat, this is where
    a layer that stopped learning shows: dead ReLUs give a gradient of
    exactly 0, drawn as triangles on the bottom edge (a log scale has no 0).

    Args:
      quantity: ``"grad_norm"`` (the applied mean gradient's norm, per
        variable) or ``"update_ratio"`` (|update| / |weights| of each apply;
        about 1e-3 is usual).
    """
    check_quantity(quantity)
    rows = _steps(steps, "variable_norms")
    field = "variable_norms" if quantity == "grad_norm" else "update_ratios"
    names = list(dict.fromkeys(n for s in rows for n in getattr(s, field)))
    if not names:
        why = ("update ratios are measured only when the trainer is made with "
               "update_ratios_every=N (then every N-th step has them)"
               if quantity == "update_ratio" else "the steps hold no variables")
        raise HostavgError(f"hostavg.plot.variable_norms: no step holds {quantity} values: {why}")
    ax = _axes(ax, "variable_norms")
    x = np.array([s.step for s in rows])
    values = np.array([[getattr(s, field).get(n, np.nan) for n in names] for s in rows], float)
    positive = values[np.isfinite(values) & (values > 0)]
    floor = positive.min() / 3 if positive.size else 1e-12
    for j, name in enumerate(names):
        y = values[:, j]
        shown = np.isfinite(y) & (y > 0)  # NaN: not measured that step (update_ratios_every)
        line, = ax.plot(x[shown], y[shown], label=name, linewidth=1)
        zero = y == 0
        if zero.any():  # each variable a little lower than the last, so that none hides another
            ax.scatter(x[zero], np.full(zero.sum(), floor * 0.8 ** (j % 8)), marker="v", s=14,
                       color=line.get_color())
    what = "gradient norm of the mean" if quantity == "grad_norm" else "|update| / |weights|"
    ax.set(xlabel="global step", ylabel=what + ("  (triangles: exactly 0)" if (values == 0).any()
                                                else ""), yscale="log",
           title=f"Per variable: {what}")
    ax.legend(fontsize="small", ncol=max(1, len(names) // 12))
    return ax


def cosine_heatmap(step, ax=None):
    """The cosine between every two micro-batches' gradients in one step.

    ``step`` is a ``StepResult`` of ``accumulate="stack"`` or a recorded step
    with micro-batch gradients (``record[step]``); a record or a list of
    StepResults means its last step. Dropped micro-batches are left out.
    """
    if isinstance(step, RecordReader) and len(step):
        step = step[step.steps[-1]]
    elif isinstance(step, (list, tuple)) and step and isinstance(step[-1], StepResult):
        step = step[-1]
    if isinstance(step, History):
        raise HostavgError("hostavg.plot.cosine_heatmap needs micro-batch gradients, which the "
                           "History that fit returns does not keep: pass a StepResult of "
                           "accumulate='stack', or record with hooks=[Record(path)] and pass "
                           "load_record(path)")
    if isinstance(step, RecordedStep):
        grads = [step.micro_grads(m["index"]) for m in step.micro if m["recorded"]]
    elif isinstance(step, StepResult):
        grads = [m.grads for m in step.micro if m.grads is not None and m.dropped is None]
    else:
        raise HostavgError(f"hostavg.plot.cosine_heatmap takes one step (a StepResult or "
                           f"record[step]) or {SOURCES}; got {_described(step)}")
    if len(grads) < 2:
        raise HostavgError("cosine_heatmap needs the gradients of 2 or more micro-batches: "
                           "train with accumulate='stack', or record with Record(..., micro=True)")
    ax = _axes(ax, "cosine_heatmap")
    image = ax.imshow(pairwise_cosines(flatten(grads)[0]), vmin=-1, vmax=1, cmap="RdBu_r")
    ax.figure.colorbar(image, ax=ax, label="cosine")
    ax.set(xlabel="micro-batch", ylabel="micro-batch",
           title=f"Agreement of micro-batch gradients, step {step.step}")
    return ax
