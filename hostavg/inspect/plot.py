"""Pictures of training and of micro-batch gradients, with matplotlib (``pip install matplotlib``).

Each function takes what training produced, any of: a record
(:func:`hostavg.load_record`, or the :class:`~hostavg.hooks.Record` hook that
wrote it), a list of ``StepResult``, or the :class:`~hostavg.History` that
``fit`` returns; or several runs to compare, as a mapping ``{label: one of
them}``. It checks everything it was given before drawing anything, draws on
``ax`` (a new figure's axes by default) and returns the axes. Skipped steps
are left out.

Every plot over time takes ``x`` (:data:`~hostavg.inspect.layout.X_AXES`:
global step, samples seen, epoch), ``yscale`` ("linear", "log", "symlog") and
``legend`` (:data:`~hostavg.inspect.layout.LEGENDS`). What an axis cannot
place (a zero or a negative value on a log axis, an Inf, a NaN) is marked in
a labelled strip beside the data area, never among the data; every variable
has a colour of its own (:mod:`hostavg.inspect.layout`). Runs have a colour
each; per variable, where colours name the variables, a panel each.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from hostavg.core import distributions as _distributions
from hostavg.core import schema
from hostavg.core.distributions import PERCENTILES
from hostavg.core.errors import ArgumentError
from hostavg.core.results import StepResult
from hostavg.core.schema import Kind
from hostavg.core.stats import (NOISE_SCALE_BETA, NoiseScale, NoiseScaleEstimate, flatten,
                                pairwise_cosines)
from hostavg.inspect import layout
from hostavg.inspect.layout import STYLES, Strips
from hostavg.inspect.record import Record, RecordedStep, RecordReader, check_quantity
from hostavg.train.history import History

__all__ = ["cosine_heatmap", "curvature", "distributions", "loss", "micro_losses", "micro_norms", "noise_scale",
           "statistic", "variable_heatmap", "variable_norms"]

#: What every plot takes.
SOURCES = ("a record (hostavg.load_record(path), or the Record hook), a list of StepResults, or "
           "the History that fit returns, or several runs as a mapping {label: one of them}")
#: A micro-batch cosine matrix larger than this is drawn without its values in the cells.
ANNOTATED = 16
#: The cosine heatmap's colormaps by the signs its scale spans: sequential where every
#: cosine shares a sign, diverging around 0 where they have both.
COSINE_MAPS = {"positive": "Reds", "negative": "Blues_r", "both": "RdBu_r"}
#: TensorBoard's bands: pairs of percentiles (indices into PERCENTILES), outermost first.
BANDS = ((0, 8), (1, 7), (2, 6), (3, 5))
#: Each x of :data:`~hostavg.inspect.layout.X_AXES` as its axis is labelled.
X_LABELS = {"step": "global step", "samples": "samples seen", "epoch": "epoch"}
#: The heatmap of variables: its colormap (log scale), and the colours of the cells a log
#: scale cannot place, each with its legend entry. A cell never measured is left blank.
HEATMAP_MAP = "viridis"
HEATMAP_SPECIAL = (("exactly 0", "tab:red"), ("infinite", "magenta"))  # neither in viridis


class _Step:
    """One step, whatever it came from: the samples seen so far (this step's included), its
    place in epochs (a History's, else None) and every quantity and user statistic by name
    (:data:`hostavg.core.schema.QUANTITIES`; per-variable ones as dicts), read as
    attributes: ``s.loss``, ``s.micro_norms``."""

    __slots__ = ("samples", "epoch", "values")

    def __init__(self, samples: int, values: dict, epoch: float | None = None):
        self.samples, self.values, self.epoch = samples, values, epoch

    def __getattr__(self, name: str):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


class _Run(NamedTuple):
    """One run to draw: its label (None for a lone source), its applied steps, the kind of each
    quantity and statistic they hold, and its validation losses at each epoch's end (a
    History's only), as steps holding ``step``, ``samples``, ``epoch`` and ``val_loss``."""

    label: str | None
    steps: list
    kinds: dict
    validation: list


def _runs(source, plot: str, x: str = "step") -> list[_Run]:
    """``source`` (one run, or a mapping of labelled runs) as runs, or HostavgError before
    anything is drawn (``x="epoch"`` needs epochs: a History's)."""
    if isinstance(source, Mapping) and not isinstance(source, History):
        if not source:
            raise ArgumentError(f"hostavg.plot.{plot} takes {SOURCES}; got an empty mapping")
        runs = [_run(value, plot, str(label)) for label, value in source.items()]
    else:
        runs = [_run(source, plot, None)]
    lacking = [run.label for run in runs if run.steps[0].epoch is None]
    if x == "epoch" and lacking:
        which = "" if runs[0].label is None else f" (runs {lacking})"
        raise ArgumentError(f"hostavg.plot.{plot}: x='epoch' needs the History that fit returns"
                            f"{which}: a record or a list of StepResults holds no epochs; draw "
                            f"it with x='step' or x='samples'")
    return runs


#: The kind of every built-in quantity, by name.
_KINDS = {q.name: q.kind for q in schema.QUANTITIES}


def _run(source, plot: str, label: str | None) -> _Run:
    said = "" if label is None else f" for run {label!r}"
    if isinstance(source, Record):
        source = RecordReader(source.path)
    validation, kinds = [], dict(_KINDS)
    if isinstance(source, History):
        kinds.update(source.statistics)
        out = [_of_log(s, source, e) for s, e in zip(source.steps, _epochs(source.steps))]
        last = {log.epoch: s for log, s in zip(source.steps, out)}
        validation = [_Step(last[e["epoch"]].samples, {"step": last[e["epoch"]].step,
                                                       "val_loss": e["val_loss"]}, e["epoch"] + 1)
                      for e in source.epochs if "val_loss" in e and e.get("epoch") in last]
    elif isinstance(source, RecordReader) or (
            isinstance(source, (list, tuple)) and source
            and all(isinstance(s, (StepResult, RecordedStep)) for s in source)):
        out, seen = [], 0
        for s in source:
            seen += s.size
            if isinstance(s, RecordedStep):
                values = dict(s.values)
                kinds.update(s.kinds)
            else:
                values = _of_result(s)
                kinds.update({n: schema.kind_of(v) for n, v in s.statistics.items()})
            out.append(_Step(seen, values))
    else:
        raise ArgumentError(f"hostavg.plot.{plot} takes {SOURCES}; got {_described(source)}{said}")
    for step in out:  # a per-variable quantity not measured that step: no variable
        for name, kind in kinds.items():
            if kind is Kind.VARIABLE and step.values.get(name) is None:
                step.values[name] = {}
    out = [s for s in out if not math.isnan(s.grad_norm)]
    if not out:
        raise ArgumentError(f"hostavg.plot.{plot}: nothing to plot, no applied step in "
                            f"{_described(source)}{said}")
    return _Run(label, out, kinds, validation)


def _epochs(logs: list) -> list[float]:
    """Each StepLog's place in epochs: its epoch (from 0) plus the share of that epoch's
    samples seen by its end (the share of its steps, for an epoch of no samples)."""
    totals, counts = defaultdict(int), defaultdict(int)
    for s in logs:
        totals[s.epoch] += s.size
        counts[s.epoch] += 1
    seen, done, out = defaultdict(int), defaultdict(int), []
    for s in logs:
        seen[s.epoch] += s.size
        done[s.epoch] += 1
        share = seen[s.epoch] / totals[s.epoch] if totals[s.epoch] else done[s.epoch] / counts[s.epoch]
        out.append(s.epoch + share)
    return out


def _of_log(log, history: History, epoch: float) -> _Step:
    """A History's StepLog as a step to draw: per-variable tuples as dicts."""
    kinds = {**_KINDS, **history.statistics}
    values = {**{k: v for k, v in log._asdict().items() if k in _KINDS}, **log.statistics}
    for name, value in values.items():
        if kinds[name] is Kind.VARIABLE:
            values[name] = dict(zip(history.variables, value))
    return _Step(log.samples, values, epoch)


def _of_result(result: StepResult) -> dict:
    """A StepResult's quantities and statistics; a skipped step's gradient norm NaN (left out)."""
    values = {**schema.read(result), **result.statistics}
    if result.skipped:
        values["grad_norm"] = math.nan
    return values


def _described(source) -> str:
    if isinstance(source, (list, tuple)):
        kinds = sorted({type(s).__name__ for s in source})
        return f"a {type(source).__name__} of {len(source)} ({', '.join(kinds) or 'empty'})"
    return type(source).__name__


def _axes(ax, plot: str, figsize=(7, 4)):
    """``ax``, checked to be matplotlib Axes, or a new figure's axes for None."""
    if ax is not None:
        if not all(callable(getattr(ax, m, None)) for m in ("plot", "scatter", "set", "legend")):
            raise ArgumentError(f"hostavg.plot.{plot}: ax must be matplotlib Axes (or None for a "
                                f"new figure), got {ax!r}")
        return ax
    return _pyplot().subplots(figsize=figsize)[1]


def _panels(ax, plot: str, count: int, figsize: tuple, **kw) -> list:
    """One axes per run: ``ax`` (that many axes) or a new figure's row of them."""
    if ax is None:
        return list(_pyplot().subplots(1, count, figsize=(figsize[0] * count, figsize[1]),
                                       squeeze=False, **kw)[1][0])
    axes = list(np.ravel(ax)) if isinstance(ax, (list, tuple, np.ndarray)) else [ax]
    if len(axes) != count:
        raise ArgumentError(f"hostavg.plot.{plot} draws one panel per run: ax must be {count} "
                            f"axes, got {len(axes)}")
    return [_axes(a, plot) for a in axes]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ArgumentError("hostavg.plot needs matplotlib: pip install matplotlib") from None
    return plt


def _tight(figure) -> None:
    if figure.get_layout_engine() is None:
        figure.set_layout_engine("tight")


def _colour(runs: list, i: int, alone: str) -> str:
    """Run ``i``'s colour: ``alone`` for a lone run, else matplotlib's i-th."""
    return alone if len(runs) == 1 else f"C{i % 10}"


def _named(run: _Run, what: str) -> str:
    return what if run.label is None else f"{run.label}: {what}"


class _Frame:
    """One axes a plot over time draws on: where each step goes along ``x``, the y scale, and
    the :class:`~hostavg.inspect.layout.Strips` for what that scale cannot place."""

    def __init__(self, ax, x: str, yscale: str):
        self.ax, self.x, self.yscale = ax, x, yscale
        self.strips = Strips(ax, yscale == "log")
        ax.set_yscale(yscale)

    def at(self, step) -> float:
        """Where ``step`` (a :class:`_Step`) lies along x."""
        return step.step if self.x == "step" else step.samples if self.x == "samples" \
            else step.epoch

    def scatter(self, xs, ys, colour, row: int = 0, missing: bool = True, **kw):
        y = self.strips.placed(xs, [math.nan if v is None else v for v in ys], colour, row, missing)
        return self.ax.scatter(np.asarray(xs, float), y, color=colour, **kw)

    def line(self, xs, ys, colour, row: int = 0, missing: bool = True, **kw):
        y = self.strips.placed(xs, [math.nan if v is None else v for v in ys], colour, row, missing)
        return self.ax.plot(np.asarray(xs, float), y, color=colour, **kw)[0]

    def finish(self, title: str, ylabel: str, legend, handles=None, labels=None):
        """Title, axis labels, ticks, the legend (``ax``'s own entries by default), the strips
        and a tight layout; returns the axes."""
        from matplotlib.ticker import EngFormatter, MaxNLocator
        ax = self.ax
        ax.set_title(title, fontsize="medium")
        scale = "" if self.yscale == "linear" else f" ({self.yscale} scale)"
        ax.set(xlabel=X_LABELS[self.x], ylabel=ylabel + scale)
        if self.x != "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if self.x == "samples":
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 12.5k, not 12500
        if handles is None and legend is not False:
            handles, labels = ax.get_legend_handles_labels()
        layout.legend(ax, handles, labels, legend)
        self.strips.draw()
        _tight(ax.figure)
        return ax


def micro_norms(steps, ax=None, x: str = "step", yscale: str = "log", legend="auto"):
    """Each micro-batch's gradient norm (dots) and the mean's norm (line) over time.

    With :class:`~hostavg.hooks.ClipMicroBatchNorm`, the norms before clipping
    are drawn too (hollow), beside the clipped ones that were accumulated.
    Several runs: one colour per run, its mean a line and its micro-batches dots.
    """
    layout.checked("hostavg.plot.micro_norms", x, yscale, legend)
    runs = _runs(steps, "micro_norms", x)
    frame = _Frame(_axes(ax, "micro_norms"), x, yscale)
    for i, run in enumerate(runs):
        rows = run.steps
        clipped = any(s.micro_norms_before_clip is not None for s in rows)
        xs = [frame.at(s) for s in rows for _ in s.micro_norms]
        frame.scatter(xs, [n for s in rows for n in s.micro_norms], _colour(runs, i, "C0"), i,
                      s=8, alpha=0.5, label=_named(run, "micro-batch gradient norm"
                                                   + (", clipped" if clipped else "")))
        if clipped:
            before = [(frame.at(s), n) for s in rows for n in (s.micro_norms_before_clip or ())]
            frame.scatter(*zip(*before), _colour(runs, i, "tab:red"), i, missing=False, s=14,
                          alpha=0.6, facecolors="none",
                          label=_named(run, "micro-batch gradient norm before clipping"))
        frame.line([frame.at(s) for s in rows], [s.grad_norm for s in rows],
                   _colour(runs, i, "black"), i, label=_named(run, "norm of the mean"))
    return frame.finish("Gradient norms: micro-batches, mean", "L2 norm", legend)


def noise_scale(steps, ax=None, beta: float = NOISE_SCALE_BETA, x: str = "step",
                yscale: str = "log", legend="auto"):
    """The simple noise scale B_simple over time: each step's estimate and a running one.

    The running estimate is :class:`hostavg.NoiseScale` with ``beta`` (the
    same default as the class and the TensorBoard hook); every step feeds it.
    Estimates a log scale cannot place (g2 < 0 makes one negative, which
    happens, and meaningless) go to the strip below. A dotted line is the
    batch size the steps used (their most common one): a batch well below
    B_simple can grow with little loss of sample efficiency. Several runs:
    one colour per run.
    """
    layout.checked("hostavg.plot.noise_scale", x, yscale, legend)
    runs = _runs(steps, "noise_scale", x)
    drawn = [(run, [s for s in run.steps if s.trace_sigma is not None]) for run in runs]
    empty = [run.label for run, rows in drawn if not rows]
    if empty:
        which = "" if runs[0].label is None else f" (runs {empty})"
        raise ArgumentError(f"no step has a noise-scale estimate{which}: they need 2 or more "
                            f"micro-batches")
    frame = _Frame(_axes(ax, "noise_scale"), x, yscale)
    for i, (run, rows) in enumerate(drawn):
        tracker = NoiseScale(beta)
        running = [tracker.update(NoiseScaleEstimate(s.g2, s.trace_sigma, s.b_simple), s.step)
                   for s in rows]
        xs = [frame.at(s) for s in rows]
        frame.scatter(xs, [s.b_simple for s in rows], _colour(runs, i, "C0"), i, missing=False,
                      s=8, alpha=0.4, label=_named(run, "one step's estimate"))
        frame.line(xs, running, _colour(runs, i, "black"), i,
                   label=_named(run, f"running estimate (beta={beta})"))
        sizes, counts = np.unique([s.size for s in rows], return_counts=True)
        batch = int(sizes[np.argmax(counts)])
        frame.ax.axhline(batch, color=_colour(runs, i, "tab:green"), linestyle=":",
                         linewidth=1.5, label=_named(run, f"batch size ({batch})"))
    return frame.finish("Gradient noise scale", "B_simple (samples)", legend)


def variable_norms(steps, ax=None, quantity: str = "grad_norm", x: str = "step",
                   yscale: str = "log", legend="auto"):
    """One line per trained variable over time: its gradient norm, or its update ratio.

    Where the micro-batch norms and the noise scale look flat, this is where
    a layer that stopped learning shows: dead ReLUs give a gradient of
    exactly 0, marked in the strip below the data area (a log scale has no
    0). Every variable has its own colour; several runs are drawn as one
    panel each, side by side, with one legend, and the list of axes returned
    (``ax``: None or that many axes; one axes for several runs draws them
    on it with a line style per run, as 0.1.0 did, with a DeprecationWarning:
    refused from 0.3.0). Many variables read better as :func:`variable_heatmap`.

    Args:
      quantity: ``"grad_norm"`` (the applied mean gradient's norm, per
        variable) or ``"update_ratio"`` (|update| / |weights| of each apply;
        about 1e-3 is usual).
    """
    check_quantity(quantity)
    layout.checked("hostavg.plot.variable_norms", x, yscale, legend)
    runs = _runs(steps, "variable_norms", x)
    field = _variable_field(runs, quantity, "variable_norms")
    what = "gradient norm of the mean" if quantity == "grad_norm" else "|update| / |weights|"
    return _per_variable(runs, ax, field, f"Per variable: {what}",
                         "gradient norm" if quantity == "grad_norm" else "update ratio",
                         x, yscale, legend, "variable_norms")


def _variable_field(runs: list, quantity: str, plot: str) -> str:
    """The per-variable quantity of ``quantity``, or HostavgError where no step holds a
    value of it (a History keeps NaN where it was not measured)."""
    field = "variable_norms" if quantity == "grad_norm" else "update_ratios"
    if all(math.isnan(v) for run in runs for s in run.steps for v in getattr(s, field).values()):
        why = ("update ratios are measured only when the trainer is made with "
               "update_ratios_every=N (then every N-th step has them)"
               if quantity == "update_ratio" else "the steps hold no variables")
        raise ArgumentError(f"hostavg.plot.{plot}: no step holds {quantity} values: {why}")
    return field


def _per_variable(runs: list, ax, field: str, title: str, ylabel: str, x: str, yscale: str,
                  legend, plot: str):
    """A line per variable of the per-variable quantity ``field``: one axes for one run, a
    panel per run (sharing y, and x unless it is steps; one legend) for several; NaN is "not
    measured"."""
    names = list(dict.fromkeys(n for run in runs for s in run.steps for n in getattr(s, field)))
    styles = layout.variable_styles(len(names))
    several = len(runs) > 1
    if several and ax is not None and not isinstance(ax, (list, tuple, np.ndarray)):
        return _runs_on_one_axes(runs, ax, field, title, ylabel, x, yscale, legend, plot, names)
    # samples and epochs compare across runs: one x for all panels; steps of different batch
    # sizes do not, so each panel spans its own
    axes = _panels(ax, plot, len(runs), (5.5, 4), sharey=True, sharex=x != "step") if several \
        else [_axes(ax, plot)]
    from matplotlib.lines import Line2D
    keys = [Line2D([], [], color=c, linestyle=s) for c, s in styles]
    for r, (run, panel) in enumerate(zip(runs, axes)):
        frame = _Frame(panel, x, yscale)
        xs = [frame.at(s) for s in run.steps]
        for j, (name, (colour, style)) in enumerate(zip(names, styles)):
            frame.line(xs, [getattr(s, field).get(name, math.nan) for s in run.steps], colour,
                       j, missing=False, label=_named(run, name), linewidth=1, linestyle=style)
        # several panels: one legend, beside the last (a row of panels keeps no hole)
        shown = legend if r == len(runs) - 1 else False
        frame.finish(run.label if several else title, ylabel,
                     "outside" if several and shown == "auto" else shown, keys, names)
        if r:
            panel.set_ylabel("")  # the first panel's says it: y is shared
    if several:
        axes[0].figure.suptitle(title, fontsize="medium")
        return axes
    return axes[0]


#: Line styles of several runs drawn on one given axes, as 0.1.0 drew them (deprecated).
RUN_STYLES = ("-", "--", ":", "-.")


def _runs_on_one_axes(runs: list, ax, field: str, title: str, ylabel: str, x: str, yscale: str,
                      legend, plot: str, names: list):
    """Several runs' per-variable lines on the one axes ``ax`` (a colour per variable, a line
    style per run), as 0.1.0 drew them: deprecated (a panel per run since 0.2.0), warns."""
    warnings.warn(f"hostavg.plot.{plot}: one axes for {len(runs)} runs is deprecated and will be "
                  f"refused in 0.3.0: pass ax=None for a panel per run, or a list of {len(runs)} "
                  f"axes", DeprecationWarning, stacklevel=4)
    frame = _Frame(_axes(ax, plot), x, yscale)
    colours = [colour for colour, _ in layout.variable_styles(len(names))]
    for r, run in enumerate(runs):
        xs = [frame.at(s) for s in run.steps]
        for j, name in enumerate(names):
            frame.line(xs, [getattr(s, field).get(name, math.nan) for s in run.steps],
                       colours[j], j, missing=False, label=_named(run, name), linewidth=1,
                       linestyle=RUN_STYLES[r % len(RUN_STYLES)])
    return frame.finish(title, ylabel, legend)


def statistic(steps, name: str, ax=None, x: str = "step", yscale: str = "linear",
              legend="auto"):
    """One quantity or user statistic (``Trainer(statistics={name: fn})``) over time, drawn by
    its kind.

    Per step: a line (with dots for a short run). Per micro-batch: a dot per
    micro-batch at its step. Per variable: a line per variable, as
    :func:`variable_norms` draws them. Several runs: one colour per run.

    Example::

        trainer = hostavg.Trainer(loss, opt, statistics={"largest": lambda r: max(r.stats.micro_norms)})
        hostavg.plot.statistic(trainer.fit(sess, data, batch_size=256), "largest")
    """
    layout.checked("hostavg.plot.statistic", x, yscale, legend)
    runs = _runs(steps, "statistic", x)
    kinds = {run.kinds[name] for run in runs if name in run.kinds}
    if not kinds:
        raise ArgumentError(f"hostavg.plot.statistic: no quantity or statistic {name!r}; the "
                            f"runs hold {sorted(set().union(*(run.kinds for run in runs)))}")
    kind = kinds.pop()
    if kind not in (Kind.STEP, Kind.MICRO, Kind.VARIABLE) or kinds:
        raise ArgumentError(f"hostavg.plot.statistic draws a per-step, per-micro-batch or "
                            f"per-variable value; {name!r} is {kind.said}")
    if kind is Kind.VARIABLE:
        return _per_variable(runs, ax, name, name, name, x, yscale, legend, "statistic")
    frame = _Frame(_axes(ax, "statistic"), x, yscale)
    if kind is Kind.STEP:
        _step_lines(frame, runs, name)
    for i, run in enumerate(runs if kind is Kind.MICRO else ()):
        rows = [s for s in run.steps if s.values.get(name) is not None]
        frame.scatter([frame.at(s) for s in rows for _ in s.values[name]],
                      [v for s in rows for v in s.values[name]], _colour(runs, i, "C0"), i, s=8,
                      alpha=0.6, label=_named(run, f"{name} (each micro-batch)"))
    return frame.finish(name, name, legend)


def _step_lines(frame: _Frame, runs: list, name: str) -> None:
    """Each run's per-step quantity ``name`` as a line on ``frame`` (dots for a short run),
    over the steps that have it."""
    for i, run in enumerate(runs):
        rows = [s for s in run.steps if s.values.get(name) is not None]
        xs = [frame.at(s) for s in rows]
        frame.line(xs, [s.values[name] for s in rows], _colour(runs, i, "C0"), i, linewidth=1,
                   marker="o" if len(xs) < 30 else None, markersize=3, label=_named(run, name))


#: What :func:`curvature` draws, a panel each: (quantity, title, the level marked, its label).
CURVATURE_PANELS = (
    ("sharpness", "Sharpness: top eigenvalue x lr / 2", 1.0, "1: gradient descent diverges"),
    ("hessian_trace", "Hessian trace (Hutchinson)", None, None),
    ("alpha", "Step quality alpha", 0.0, "0: at the minimum along the step"),
)


def curvature(steps, ax=None, x: str = "step", legend="auto") -> list:
    """What :class:`hostavg.hooks.Curvature` measured, over time: three panels.

    Sharpness (the top Hessian eigenvalue x learning rate / 2) with the line at 1,
    above which gradient descent at that rate diverges along the top direction (the
    edge of stability); the Hessian's trace; and alpha (Cockpit's step quality, -1
    stays, 0 lands at the minimum along the step, +1 overshoots) with the line at 0.
    Several runs: one colour per run. ``ax``: three axes, or None for a new figure's row.
    Returns the three axes.
    """
    layout.checked("hostavg.plot.curvature", x, "linear", legend)
    runs = _runs(steps, "curvature", x)
    if not any(s.values.get("sharpness") is not None for run in runs for s in run.steps):
        raise ArgumentError("hostavg.plot.curvature: no step was measured; train with "
                            "hooks=[hostavg.hooks.Curvature(every=...)]")
    out = []
    for panel, (name, title, level, said) in zip(
            _panels(ax, "curvature", len(CURVATURE_PANELS), (5, 3.5)), CURVATURE_PANELS):
        frame = _Frame(panel, x, "linear")
        _step_lines(frame, runs, name)
        if level is not None:
            panel.axhline(level, color="tab:red", linestyle=":", linewidth=1.5, label=said)
        out.append(frame.finish(title, name, legend))
    return out


def distributions(steps, variable: str, quantity: str = "gradient", ax=None, x: str = "step",
                  yscale: str = "linear", legend="auto"):
    """One variable's distribution over time, as TensorBoard's Distributions view.

    Bands between TensorBoard's percentiles (:data:`~hostavg.core.distributions.PERCENTILES`:
    min-max, then the spans of 1.5, 1 and 0.5 standard deviations of a normal
    distribution, darker inwards) and the median as a line, at the steps that
    kept distributions (a trainer made with ``distributions_every=N``).
    ``yscale="symlog"`` spreads values of both signs over orders of magnitude.
    Several runs: one colour per run.

    Args:
      variable: a trained variable's name.
      quantity: ``"gradient"`` (the applied mean gradient), ``"weight"`` (the
        weights after the step) or ``"update"`` (weights after minus before).

    Example::

        hostavg.plot.distributions(history, "dense/kernel", "update", yscale="symlog")
    """
    layout.checked("hostavg.plot.distributions", x, yscale, legend)
    runs = _runs(steps, "distributions", x)
    where = "hostavg.plot.distributions"
    tables = [_distributions.table([(s.step, s.distributions) for s in run.steps], variable,
                                   quantity, where if run.label is None
                                   else f"{where}, run {run.label!r}") for run in runs]
    frame = _Frame(_axes(ax, "distributions"), x, yscale)
    for i, (run, table) in enumerate(zip(runs, tables)):
        colour = _colour(runs, i, "C0")
        at = {s.step: frame.at(s) for s in run.steps}
        xs = np.array([at[step] for step in table.index], float)
        values = np.column_stack([frame.strips.placed(xs, column, colour, i)
                                  for column in table.to_numpy().T])
        for depth, (low, high) in enumerate(BANDS):
            frame.ax.fill_between(xs, values[:, low], values[:, high], color=colour, linewidth=0,
                                  alpha=0.15 + 0.12 * depth)
        frame.ax.plot(xs, values[:, 4], color=colour, linewidth=1.2,
                      marker="o" if len(xs) < 8 else None, markersize=3,
                      label=_named(run, "median"))
    return frame.finish(f"Distribution of the {quantity} of {variable}\n(bands: min-max, then "
                        f"a normal's +-1.5, +-1, +-0.5 sd)", quantity, legend)


def micro_losses(steps, ax=None, x: str = "step", yscale: str = "linear", legend="auto"):
    """Each micro-batch's loss (dots) and the step's mean loss (line) over time.

    A micro-batch whose loss stands apart from its step's others holds
    unusual samples (``micro_table`` names its rows); dropped micro-batches
    are drawn too, a non-finite loss in the strip above. Several runs: one
    colour per run.
    """
    layout.checked("hostavg.plot.micro_losses", x, yscale, legend)
    runs = _runs(steps, "micro_losses", x)
    frame = _Frame(_axes(ax, "micro_losses"), x, yscale)
    for i, run in enumerate(runs):
        colour = _colour(runs, i, "C0")
        frame.scatter([frame.at(s) for s in run.steps for _ in s.micro_losses],
                      [v for s in run.steps for v in s.micro_losses], colour, i, s=8, alpha=0.5,
                      label=_named(run, "micro-batch loss"))
        frame.line([frame.at(s) for s in run.steps], [s.loss for s in run.steps],
                   _colour(runs, i, "black"), i, linewidth=1, label=_named(run, "the step's loss"))
    return frame.finish("Loss: micro-batches, step", "loss", legend)


def loss(steps, ax=None, x: str = "samples", yscale: str = "linear", legend="auto"):
    """The training loss of every step and the validation loss, against the samples seen.

    Samples seen: by ``fit`` (a History's own count), or for a record or a
    list of StepResults the samples of the steps given, summed (a record of
    every N-th step counts only those); ``x="step"`` or ``"epoch"`` instead.
    The validation loss (a History's epochs with ``val_loss``) is drawn at
    each epoch's end, as dots on a dashed line in the run's colour.
    ``yscale="log"`` keeps a healthy run visible beside one whose loss blew
    up. Several runs: one colour per run.

    Example::

        hostavg.plot.loss({"batch 512": history_512, "batch 64": history_64}, yscale="log")
    """
    layout.checked("hostavg.plot.loss", x, yscale, legend)
    runs = _runs(steps, "loss", x)
    frame = _Frame(_axes(ax, "loss"), x, yscale)
    for i, run in enumerate(runs):
        colour = _colour(runs, i, "C0")
        frame.line([frame.at(s) for s in run.steps], [s.loss for s in run.steps], colour, i,
                   linewidth=1, label=_named(run, "training loss (each step)"))
        if run.validation:
            frame.line([frame.at(v) for v in run.validation],
                       [v.val_loss for v in run.validation], colour if len(runs) > 1 else "C1",
                       i, marker="o", linestyle="--",
                       label=_named(run, "validation loss (each epoch)"))
    return frame.finish("Loss", "loss", legend)


def variable_heatmap(steps, quantity: str = "grad_norm", ax=None, x: str = "step"):
    """Every trained variable over time as one picture: a row per variable, a column per step.

    The compact form of :func:`variable_norms` for many variables. Colours
    are the values on a log scale (its colour bar); cells a log scale cannot
    place have colours of their own, named in the legend
    (:data:`HEATMAP_SPECIAL`: an exact 0, red; an infinite value, magenta); a
    step that did not measure the quantity (update ratios every N steps) is
    left blank. Variables run top to bottom in the model's order, their names
    thinned where they would not fit. Several runs: one panel each, stacked,
    on one colour scale; returns the list of axes.

    Args:
      quantity: ``"grad_norm"`` or ``"update_ratio"``, as :func:`variable_norms`.
    """
    check_quantity(quantity)
    layout.checked("hostavg.plot.variable_heatmap", x, "log", False)
    runs = _runs(steps, "variable_heatmap", x)
    field = _variable_field(runs, quantity, "variable_heatmap")
    names = list(dict.fromkeys(n for run in runs for s in run.steps for n in getattr(s, field)))
    tables = [np.array([[getattr(s, field).get(n, math.nan) for s in run.steps] for n in names],
                       float) for run in runs]
    several = len(runs) > 1
    height = 1.2 + 0.22 * len(names)
    axes = _panels(ax, "variable_heatmap", len(runs), (8, height), sharex=False) if several \
        else [_axes(ax, "variable_heatmap", (8, height))]
    norm = _log_norm(tables)
    what = "gradient norm of the mean" if quantity == "grad_norm" else "|update| / |weights|"
    for run, panel, table in zip(runs, axes, tables):
        frame = _Frame(panel, x, "linear")
        mesh = _cells(panel, [frame.at(s) for s in run.steps], table, norm)
        panel.figure.colorbar(mesh, ax=panel, label=f"{quantity} (log scale)")
        layout.thinned(panel, "y", list(range(len(names))), names)
        panel.set_ylim(len(names) - 0.5, -0.5)  # the model's first variable on top
        frame.finish(f"Per variable: {what}" if not several else f"{run.label}: {what}", "",
                     False)
    _special_legend(axes[-1])
    return axes if several else axes[0]


def _log_norm(tables: list):
    """A log colour scale over the positive finite values of ``tables``."""
    from matplotlib import colors
    found = np.concatenate([t[np.isfinite(t) & (t > 0)] for t in tables])
    low, high = (found.min(), found.max()) if found.size else (1e-12, 1.0)
    return colors.LogNorm(low, high if high > low else low * 10)


def _cells(ax, xs: list, table: np.ndarray, norm):
    """Draws ``table`` (variables x steps) as cells centred on ``xs``: its positive finite
    values on ``norm`` (the mesh returned), zeros and infinite values in
    :data:`HEATMAP_SPECIAL`'s colours, NaN (not measured) blank."""
    from matplotlib import colormaps, colors
    xs = np.asarray(xs, float)
    mid = (xs[1:] + xs[:-1]) / 2 if len(xs) > 1 else np.array([])
    first, last = (xs[0] - 0.5, xs[-1] + 0.5) if len(xs) == 1 else (
        xs[0] - (mid[0] - xs[0]), xs[-1] + (xs[-1] - mid[-1]))
    edges = np.concatenate([[first], mid, [last]])
    rows = np.arange(table.shape[0] + 1) - 0.5
    with np.errstate(invalid="ignore"):
        placed = np.isfinite(table) & (table > 0)
        special = np.where(table == 0, 0.0, np.where(np.isinf(table), 1.0, np.nan))
    mesh = ax.pcolormesh(edges, rows, np.ma.masked_where(~placed, table), norm=norm,
                         cmap=colormaps[HEATMAP_MAP].with_extremes(bad=(0, 0, 0, 0)))
    palette = colors.ListedColormap([c for _, c in HEATMAP_SPECIAL]).with_extremes(
        bad=(0, 0, 0, 0))
    ax.pcolormesh(edges, rows, np.ma.masked_invalid(special), cmap=palette, vmin=-0.5, vmax=1.5)
    return mesh


def _special_legend(ax) -> None:
    from matplotlib.patches import Patch
    ax.legend([Patch(color=c) for _, c in HEATMAP_SPECIAL], [said for said, _ in HEATMAP_SPECIAL],
              fontsize="small", loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2,
              frameon=False)


def cosine_heatmap(step, ax=None, vmin: float | None = None, vmax: float | None = None,
                   cmap: str | None = None):
    """The cosine between every two accumulated micro-batches' gradients in one step.

    ``step`` is a ``StepResult`` of ``accumulate="stack"`` (its
    ``stats.pairwise_cosines``) or a recorded step with micro-batch gradients
    (``record[step]``); a record or a list of StepResults means its last
    step. Dropped micro-batches are left out; the ticks are the micro-batches'
    indices in the step (thinned where they would collide).

    The colour scale spans the off-diagonal cosines themselves (their
    smallest to their largest, over every panel), so that small differences
    show; its colormap follows their signs (:data:`COSINE_MAPS`): sequential
    (reds) where every cosine is positive, diverging around 0 (blue opposes,
    white is orthogonal, red agrees) where they have both signs. The colour
    bar says the range; ``vmin=-1, vmax=1`` fixes it, the same in every figure.
    The diagonal (1, each micro-batch with itself) is grey and off the scale.
    Each cell shows its value, up to :data:`ANNOTATED` micro-batches.

    Several runs, ``{label: step}``: one panel per run, side by side (``ax``:
    None, or that many axes), on one scale; returns the list of axes.

    Args:
      vmin: the scale's low end; None: the smallest off-diagonal cosine.
      vmax: its high end; None: the largest.
      cmap: a matplotlib colormap's name; None: by the signs, as above.
    """
    if isinstance(step, Mapping) and not isinstance(step, History):
        if not step:
            raise ArgumentError(f"hostavg.plot.cosine_heatmap takes one step (a StepResult or "
                                f"record[step]) or {SOURCES}; got an empty mapping")
        found = [(str(label), *_cosines(value, f" for run {label!r}"))
                 for label, value in step.items()]
        scale = _scale([m for _, m, _, _ in found], vmin, vmax, cmap)
        axes = _panels(ax, "cosine_heatmap", len(found), (5.5, 4.5))
        for a, (label, matrix, index, number) in zip(axes, found):
            _heatmap(a, matrix, index, f"{label}, step {number}", *scale)
        axes[0].figure.suptitle("Cosine between micro-batch gradients")
        return axes
    matrix, index, number = _cosines(step, "")
    return _heatmap(_axes(ax, "cosine_heatmap", (6, 5)), matrix, index,
                    f"Cosine between micro-batch gradients, step {number}",
                    *_scale([matrix], vmin, vmax, cmap))


def _scale(matrices: list, vmin, vmax, cmap: str | None) -> tuple:
    """(norm, colormap) of the heatmaps of ``matrices``: from ``vmin`` to ``vmax``, an end
    left None being their off-diagonal cosines' own; centred on 0 where the range holds it,
    the colormap (unless given) by the range's signs (:data:`COSINE_MAPS`)."""
    from matplotlib import colors
    found = np.concatenate([m[~np.eye(len(m), dtype=bool) & np.isfinite(m)] for m in matrices])
    low = (float(found.min()) if found.size else -1.0) if vmin is None else float(vmin)
    high = (float(found.max()) if found.size else 1.0) if vmax is None else float(vmax)
    if not low < high:
        if vmin is not None and vmax is not None:
            raise ArgumentError(f"cosine_heatmap: vmin must be below vmax, got {vmin} and {vmax}")
        low, high = low - 5e-4, high + 5e-4  # all alike: a little room, so colours mean something
    both = low < 0 < high
    norm = colors.TwoSlopeNorm(0.0, low, high) if both else colors.Normalize(low, high)
    name = cmap if cmap is not None else COSINE_MAPS["both" if both else
                                                      "positive" if low >= 0 else "negative"]
    try:
        return norm, _colormap(name)
    except (KeyError, ValueError, TypeError):
        raise ArgumentError(f"cosine_heatmap: cmap must be a matplotlib colormap's name, got "
                            f"{cmap!r}") from None


def _cosines(step, said: str) -> tuple[np.ndarray, list, int]:
    """(k x k cosines, the micro-batches' indices, the global step) of one step, or HostavgError."""
    if isinstance(step, Record):
        step = RecordReader(step.path)
    if isinstance(step, RecordReader) and len(step):
        step = step[step.steps[-1]]
    elif isinstance(step, (list, tuple)) and step and isinstance(step[-1], StepResult):
        step = step[-1]
    if isinstance(step, History):
        raise ArgumentError("hostavg.plot.cosine_heatmap needs micro-batch gradients, which the "
                            "History that fit returns does not keep: pass a StepResult of "
                            "accumulate='stack', or record with hooks=[Record(path)] and pass "
                            "load_record(path)" + said)
    if isinstance(step, RecordedStep):
        index = [m["index"] for m in step.micro if m["recorded"] and m["dropped"] is None]
        matrix = pairwise_cosines(flatten([step.micro_grads(i) for i in index])[0]) \
            if len(index) > 1 else None
    elif isinstance(step, StepResult):
        index = [m.index for m in step.micro if m.dropped is None]
        matrix = step.stats.pairwise_cosines if step.stats is not None else None
    else:
        raise ArgumentError(f"hostavg.plot.cosine_heatmap takes one step (a StepResult or "
                            f"record[step]) or {SOURCES}; got {_described(step)}{said}")
    if matrix is None:
        raise ArgumentError("cosine_heatmap needs the gradients of 2 or more micro-batches: "
                            "train with accumulate='stack', or record with "
                            "Record(..., micro=True)" + said)
    return matrix, index, step.step


def _heatmap(ax, matrix: np.ndarray, index: list, title: str, norm, palette):
    k = len(matrix)
    off = ~np.eye(k, dtype=bool)
    shown = np.ma.masked_where(~off | ~np.isfinite(matrix), matrix)
    image = ax.imshow(shown, norm=norm, cmap=palette)
    ax.figure.colorbar(image, ax=ax, label="cosine (off the diagonal)")
    if k <= ANNOTATED:
        size = 9 if k <= 8 else 7
        for i in range(k):
            for j in range(k):
                value = matrix[i, j]
                if i == j or not np.isfinite(value):
                    ax.text(j, i, "1" if i == j else "nan", ha="center", va="center",
                            fontsize=size, color="0.4")
                    continue
                r, g, b, _ = palette(norm(value))
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=size,
                        color="white" if dark else "black")
    ax.set_title(title, fontsize="medium")
    ax.set(xlabel="micro-batch", ylabel="micro-batch")
    _tight(ax.figure)
    labels = [str(i) for i in index]
    layout.thinned(ax, "x", list(range(k)), labels)
    layout.thinned(ax, "y", list(range(k)), labels)
    return ax


def _colormap(name: str):
    """matplotlib's colormap ``name``, masked cells (the diagonal) light grey."""
    import matplotlib
    return matplotlib.colormaps[name].with_extremes(bad="0.85")
