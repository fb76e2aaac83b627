"""Pictures of training and of micro-batch gradients, with matplotlib (``pip install matplotlib``).

Each function takes what training produced, any of: a record
(:func:`hostavg.load_record`, or the :class:`~hostavg.hooks.Record` hook that
wrote it), a list of ``StepResult`` (say, ``results.append(trainer.step(...))``),
or the :class:`~hostavg.History` that ``fit`` returns; or several runs to
compare, as a mapping ``{label: one of them}``, drawn one labelled line (and
colour) per run. It checks everything it was given before drawing anything,
draws on ``ax`` (a new figure's axes by default) and returns the axes.
Skipped steps are left out.

Every figure is laid out tightly (matplotlib's "tight" layout engine, unless
the figure has a layout engine of its own), so panels side by side keep their
labels apart; steps and micro-batches are ticked at whole numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from hostavg.core import schema
from hostavg.core.errors import ArgumentError
from hostavg.core.results import StepResult
from hostavg.core.schema import Kind
from hostavg.core import distributions as _distributions
from hostavg.core.distributions import PERCENTILES
from hostavg.core.stats import (NOISE_SCALE_BETA, NoiseScale, NoiseScaleEstimate, flatten,
                                pairwise_cosines)
from hostavg.inspect.record import Record, RecordedStep, RecordReader, check_quantity
from hostavg.train.history import History

__all__ = ["cosine_heatmap", "distributions", "loss", "micro_losses", "micro_norms", "noise_scale",
           "statistic", "variable_norms"]

#: What every plot takes.
SOURCES = ("a record (hostavg.load_record(path), or the Record hook), a list of StepResults, or "
           "the History that fit returns, or several runs as a mapping {label: one of them}")
#: A micro-batch cosine matrix larger than this is drawn without its values in the cells.
ANNOTATED = 16
#: Line styles that tell runs apart where colours tell variables apart.
STYLES = ("-", "--", ":", "-.")
#: A legend with more entries than this is drawn beside the axes, outside the data.
INSIDE = 4
#: The cosine heatmap's default scale: every cosine there is, diverging around 0.
COSINE_SCALE = (-1.0, 1.0, "RdBu_r")
#: TensorBoard's bands: pairs of percentiles (indices into PERCENTILES), outermost first.
BANDS = ((0, 8), (1, 7), (2, 6), (3, 5))


class _Step:
    """One step, whatever it came from: the samples seen so far (this step's included) and every
    quantity and user statistic by name (:data:`hostavg.core.schema.QUANTITIES`; per-variable
    ones as dicts), read as attributes: ``s.loss``, ``s.micro_norms``."""

    __slots__ = ("samples", "values")

    def __init__(self, samples: int, values: dict):
        self.samples, self.values = samples, values

    def __getattr__(self, name: str):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


class _Run(NamedTuple):
    """One run to draw: its label (None for a lone source), its applied steps, the kind of each
    quantity and statistic they hold, and its validation results as (samples seen, val_loss) at
    each epoch's end (a History's only)."""

    label: str | None
    steps: list
    kinds: dict
    validation: list


def _runs(source, plot: str) -> list[_Run]:
    """``source`` (one run, or a mapping of labelled runs) as runs, or HostavgError before
    anything is drawn."""
    if isinstance(source, Mapping) and not isinstance(source, History):
        if not source:
            raise ArgumentError(f"hostavg.plot.{plot} takes {SOURCES}; got an empty mapping")
        return [_run(value, plot, str(label)) for label, value in source.items()]
    return [_run(source, plot, None)]


#: The kind of every built-in quantity, by name.
_KINDS = {q.name: q.kind for q in schema.QUANTITIES}


def _run(source, plot: str, label: str | None) -> _Run:
    said = "" if label is None else f" for run {label!r}"
    if isinstance(source, Record):
        source = RecordReader(source.path)
    validation, kinds = [], dict(_KINDS)
    if isinstance(source, History):
        kinds.update(source.statistics)
        out = [_of_log(s, source) for s in source.steps]
        last = {s.epoch: s.samples for s in source.steps}
        validation = [(last[e["epoch"]], e["val_loss"]) for e in source.epochs
                      if "val_loss" in e and e.get("epoch") in last]
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


def _of_log(log, history: History) -> _Step:
    """A History's StepLog as a step to draw: per-variable tuples as dicts."""
    kinds = {**_KINDS, **history.statistics}
    values = {**{k: v for k, v in log._asdict().items() if k in _KINDS}, **log.statistics}
    for name, value in values.items():
        if kinds[name] is Kind.VARIABLE:
            values[name] = dict(zip(history.variables, value))
    return _Step(log.samples, values)


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


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ArgumentError("hostavg.plot needs matplotlib: pip install matplotlib") from None
    return plt


def _finish(ax, title: str, xlabel: str, ylabel: str, legend: bool = True,
            integer_x: bool = True):
    """Labels, whole-number ticks along x, a legend, and a tight layout for ``ax``'s figure."""
    from matplotlib.ticker import MaxNLocator
    ax.set_title(title, fontsize="medium")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if legend:
        _legend(ax)
    _tight(ax.figure)
    return ax


def _legend(ax, handles=None, labels=None) -> None:
    """A legend of ``ax`` (its own entries by default): beside the axes, outside the data,
    once it has more than :data:`INSIDE` entries."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if len(handles) > INSIDE:
        ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1),
                  borderaxespad=0)
    else:
        ax.legend(handles, labels, fontsize="small")


def _edge(ax, x, y, colour, marked: list, missing: bool = True) -> None:
    """Marks along the top edge, in ``colour``, the points of ``y`` a plot cannot place: infinite
    ones and (with ``missing``) NaN ones; the first marks of a figure get a legend entry
    (``marked``, a list shared by one plot, remembers it)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    bad = np.isinf(y) | (np.isnan(y) if missing else np.zeros(y.shape, bool))
    if not bad.any():
        return
    ax.scatter(x[bad], np.ones(int(bad.sum())), transform=ax.get_xaxis_transform(), marker="^",
               s=30, color=colour, clip_on=False, zorder=3,
               label=None if marked else "infinite or NaN (at the top edge)")
    ax.dataLim.update_from_data_x(x[bad], ignore=False)  # the x axis reaches them
    ax.autoscale_view()
    marked.append(True)


def _tight(figure) -> None:
    if figure.get_layout_engine() is None:
        figure.set_layout_engine("tight")


def _colour(runs: list, i: int, alone: str) -> str:
    """Run ``i``'s colour: ``alone`` for a lone run, else matplotlib's i-th."""
    return alone if len(runs) == 1 else f"C{i % 10}"


def _named(run: _Run, what: str) -> str:
    return what if run.label is None else f"{run.label}: {what}"


def micro_norms(steps, ax=None):
    """Each micro-batch's gradient norm (dots) and the mean's norm (line) over global steps.

    With :class:`~hostavg.hooks.ClipMicroBatchNorm`, the norms before clipping
    are drawn too (hollow), beside the clipped ones that were accumulated.
    Several runs: one colour per run, its mean a line and its micro-batches dots.
    """
    runs = _runs(steps, "micro_norms")
    ax = _axes(ax, "micro_norms")
    marked = []
    for i, run in enumerate(runs):
        rows = run.steps
        clipped = any(s.micro_norms_before_clip is not None for s in rows)
        xs = [s.step for s in rows for _ in s.micro_norms]
        ys = [n for s in rows for n in s.micro_norms]
        ax.scatter(xs, ys, s=8, alpha=0.5, color=_colour(runs, i, "C0"),
                   label=_named(run, "micro-batch gradient norm" + (", clipped" if clipped else "")))
        _edge(ax, xs, ys, _colour(runs, i, "C0"), marked)
        if clipped:
            before = [(s.step, n) for s in rows for n in (s.micro_norms_before_clip or ())]
            ax.scatter(*zip(*before), s=14, facecolors="none", alpha=0.6,
                       edgecolors=_colour(runs, i, "tab:red"),
                       label=_named(run, "micro-batch gradient norm before clipping"))
        ax.plot([s.step for s in rows], [s.grad_norm for s in rows],
                color=_colour(runs, i, "black"), label=_named(run, "norm of the mean"))
    ax.set_yscale("log")
    return _finish(ax, "Gradient norms: micro-batches, mean", "global step",
                   "L2 norm (log scale)")


def noise_scale(steps, ax=None, beta: float = NOISE_SCALE_BETA):
    """The simple noise scale B_simple over global steps: each step's estimate and a running one.

    The running estimate is :class:`hostavg.NoiseScale` with ``beta`` (the
    same default as the class and the TensorBoard hook); steps whose single
    estimate is negative (g2 < 0, which happens) are left out but still feed
    the running estimate; an infinite one is marked at the top edge. A dotted
    line is the batch size the steps used (their most common one): a batch
    well below B_simple can grow with little loss of sample efficiency.
    Several runs: one colour per run.
    """
    runs = _runs(steps, "noise_scale")
    drawn = [(run, [s for s in run.steps if s.trace_sigma is not None]) for run in runs]
    empty = [run.label for run, rows in drawn if not rows]
    if empty:
        which = "" if runs[0].label is None else f" (runs {empty})"
        raise ArgumentError(f"no step has a noise-scale estimate{which}: they need 2 or more "
                            f"micro-batches")
    ax = _axes(ax, "noise_scale")
    marked = []
    for i, (run, rows) in enumerate(drawn):
        tracker = NoiseScale(beta)
        running = [tracker.update(NoiseScaleEstimate(s.g2, s.trace_sigma, s.b_simple), s.step)
                   for s in rows]
        single = [b if b is not None and b > 0 else np.nan for b in (s.b_simple for s in rows)]
        steps_x = [s.step for s in rows]
        ax.scatter(steps_x, single, s=8, alpha=0.4, color=_colour(runs, i, "C0"),
                   label=_named(run, "one step's estimate"))
        ax.plot(steps_x, running, color=_colour(runs, i, "black"),
                label=_named(run, f"running estimate (beta={beta})"))
        _edge(ax, steps_x + steps_x, single + running, _colour(runs, i, "C0"), marked, False)
        sizes, counts = np.unique([s.size for s in rows], return_counts=True)
        batch = int(sizes[np.argmax(counts)])
        ax.axhline(batch, color=_colour(runs, i, "tab:green"), linestyle=":", linewidth=1.5,
                   label=_named(run, f"batch size ({batch})"))
    ax.set_yscale("log")
    return _finish(ax, "Gradient noise scale", "global step", "B_simple (samples, log scale)")


def variable_norms(steps, ax=None, quantity: str = "grad_norm"):
    """One line per trained variable over global steps: its gradient norm, or its update ratio.

    Where the micro-batch norms and the noise scale look flat, this is where
    a layer that stopped learning shows: dead ReLUs give a gradient of
    exactly 0, drawn as triangles on the bottom edge (a log scale has no 0).
    Several runs: a colour per variable and a line style per run.

    Args:
      quantity: ``"grad_norm"`` (the applied mean gradient's norm, per
        variable) or ``"update_ratio"`` (|update| / |weights| of each apply;
        about 1e-3 is usual).
    """
    check_quantity(quantity)
    runs = _runs(steps, "variable_norms")
    field = "variable_norms" if quantity == "grad_norm" else "update_ratios"
    if not any(getattr(s, field) for run in runs for s in run.steps):
        why = ("update ratios are measured only when the trainer is made with "
               "update_ratios_every=N (then every N-th step has them)"
               if quantity == "update_ratio" else "the steps hold no variables")
        raise ArgumentError(f"hostavg.plot.variable_norms: no step holds {quantity} values: {why}")
    what = "gradient norm of the mean" if quantity == "grad_norm" else "|update| / |weights|"
    return _per_variable(runs, ax, field, f"Per variable: {what}",
                         "gradient norm" if quantity == "grad_norm" else "update ratio", log=True)


def _per_variable(runs: list, ax, field: str, title: str, ylabel: str, log: bool):
    """A line per variable of the per-variable quantity ``field`` over global steps (a colour
    per variable, a line style per run); on a log scale, exact zeros as triangles at the
    bottom edge."""
    names = list(dict.fromkeys(n for run in runs for s in run.steps for n in getattr(s, field)))
    ax = _axes(ax, "variable_norms")
    table = [(run, np.array([s.step for s in run.steps]),
              np.array([[getattr(s, field).get(n, np.nan) for n in names] for s in run.steps],
                       float)) for run in runs]
    positive = np.concatenate([v[np.isfinite(v) & (v > 0)] for _, _, v in table])
    floor = positive.min() / 3 if positive.size else 1e-12
    zeros, marked = False, []  # the first marks drawn are labelled for the legend
    for r, (run, x, values) in enumerate(table):
        for j, name in enumerate(names):
            y = values[:, j]
            # NaN: not measured that step (update_ratios_every); a log scale has no 0
            shown = np.isfinite(y) & ((y > 0) if log else True)
            ax.plot(x[shown], y[shown], label=_named(run, name), linewidth=1,
                    color=f"C{j % 10}", linestyle=STYLES[r % len(STYLES)])
            _edge(ax, x, y, f"C{j % 10}", marked, missing=False)
            zero = y == 0
            if log and zero.any():  # each variable a little lower than the last: none hides another
                ax.scatter(x[zero], np.full(zero.sum(), floor * 0.8 ** (j % 8)), marker="v",
                           s=14, color=f"C{j % 10}",
                           label=None if zeros else "exactly 0 (at the bottom)")
                zeros = True
    if log:
        ax.set_yscale("log")
    _finish(ax, title, "global step", ylabel + (" (log scale)" if log else ""), legend=False)
    _legend(ax, *_keys(ax, names, runs))
    return ax


def _keys(ax, names: list, runs: list) -> tuple[list, list]:
    """A legend's entries for runs x variables: a colour per variable, a line style per run
    (for several), then the marks ``ax`` holds."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=f"C{j % 10}") for j in range(len(names))]
    labels = list(names)
    if len(runs) > 1:
        handles += [Line2D([], [], color="0.3", linestyle=STYLES[r % len(STYLES)])
                    for r in range(len(runs))]
        labels += [f"run {run.label}" for run in runs]
    marks = [(h, said) for h, said in zip(*ax.get_legend_handles_labels())
             if not isinstance(h, Line2D)]  # the lines are in the keys above
    return handles + [h for h, _ in marks], labels + [said for _, said in marks]


def statistic(steps, name: str, ax=None):
    """One quantity or user statistic (``Trainer(statistics={name: fn})``) over global steps,
    drawn by its kind.

    Per step: a line (with dots for a short run). Per micro-batch: a dot per
    micro-batch at its step. Per variable: a line per variable (a colour per
    variable, a line style per run). Values a plot cannot place (Inf, NaN) are
    marked at the top edge. Several runs: one colour per run.

    Example::

        trainer = hostavg.Trainer(loss, opt, statistics={"largest": lambda r: max(r.stats.micro_norms)})
        hostavg.plot.statistic(trainer.fit(sess, data, batch_size=256), "largest")
    """
    runs = _runs(steps, "statistic")
    kinds = {run.kinds[name] for run in runs if name in run.kinds}
    if not kinds:
        raise ArgumentError(f"hostavg.plot.statistic: no quantity or statistic {name!r}; the "
                            f"runs hold {sorted(set().union(*(run.kinds for run in runs)))}")
    kind = kinds.pop()
    if kind not in (Kind.STEP, Kind.MICRO, Kind.VARIABLE) or kinds:
        raise ArgumentError(f"hostavg.plot.statistic draws a per-step, per-micro-batch or "
                            f"per-variable value; {name!r} is {kind.said}")
    if kind is Kind.VARIABLE:
        return _per_variable(runs, ax, name, name, name, log=False)
    ax = _axes(ax, "statistic")
    marked = []
    for i, run in enumerate(runs):
        colour = _colour(runs, i, "C0")
        rows = [s for s in run.steps if s.values.get(name) is not None]
        if kind is Kind.STEP:
            xs, ys = [s.step for s in rows], [s.values[name] for s in rows]
            ax.plot(xs, ys, color=colour, linewidth=1, marker="o" if len(xs) < 30 else None,
                    markersize=3, label=_named(run, name))
        else:
            xs = [s.step for s in rows for _ in s.values[name]]
            ys = [v for s in rows for v in s.values[name]]
            ax.scatter(xs, ys, s=8, alpha=0.6, color=colour, label=_named(run, f"{name} (each "
                                                                              f"micro-batch)"))
        _edge(ax, xs, ys, colour, marked)
    return _finish(ax, name, "global step", name)


def distributions(steps, variable: str, quantity: str = "gradient", ax=None):
    """One variable's distribution over global steps, as TensorBoard's Distributions view.

    Bands between TensorBoard's percentiles (:data:`~hostavg.core.distributions.PERCENTILES`:
    min-max, then the spans of 1.5, 1 and 0.5 standard deviations of a normal
    distribution, darker inwards) and the median as a line, at the steps that
    kept distributions (a trainer made with ``distributions_every=N``).
    Several runs: one colour per run.

    Args:
      variable: a trained variable's name.
      quantity: ``"gradient"`` (the applied mean gradient), ``"weight"`` (the
        weights after the step) or ``"update"`` (weights after minus before).

    Example::

        hostavg.plot.distributions(history, "dense/kernel", "update")
    """
    runs = _runs(steps, "distributions")
    where = "hostavg.plot.distributions"
    tables = [_distributions.table([(s.step, s.distributions) for s in run.steps], variable,
                                   quantity, where if run.label is None
                                   else f"{where}, run {run.label!r}") for run in runs]
    ax = _axes(ax, "distributions")
    marked = []
    for i, (run, table) in enumerate(zip(runs, tables)):
        colour = _colour(runs, i, "C0")
        x, values = table.index.to_numpy(), table.to_numpy()
        for depth, (low, high) in enumerate(BANDS):
            ax.fill_between(x, values[:, low], values[:, high], color=colour, linewidth=0,
                            alpha=0.15 + 0.12 * depth)
        ax.plot(x, values[:, 4], color=colour, linewidth=1.2, marker="o" if len(x) < 8 else None,
                markersize=3, label=_named(run, "median"))
        _edge(ax, np.repeat(x, len(PERCENTILES)), values.ravel(), colour, marked, False)
    return _finish(ax, f"Distribution of the {quantity} of {variable}\n(bands: min-max, then "
                       f"a normal's +-1.5, +-1, +-0.5 sd)", "global step", quantity)


def micro_losses(steps, ax=None):
    """Each micro-batch's loss (dots) and the step's mean loss (line) over global steps.

    A micro-batch whose loss stands apart from its step's others holds
    unusual samples (``micro_table`` names its rows); dropped micro-batches
    are drawn too, a non-finite loss marked at the top edge. Several runs:
    one colour per run.
    """
    runs = _runs(steps, "micro_losses")
    ax = _axes(ax, "micro_losses")
    marked = []
    for i, run in enumerate(runs):
        xs = [s.step for s in run.steps for _ in s.micro_losses]
        ys = [math.nan if v is None else v for s in run.steps for v in s.micro_losses]
        colour = _colour(runs, i, "C0")
        ax.scatter(xs, ys, s=8, alpha=0.5, color=colour, label=_named(run, "micro-batch loss"))
        ax.plot([s.step for s in run.steps], [s.loss for s in run.steps],
                color=_colour(runs, i, "black"), linewidth=1, label=_named(run, "the step's loss"))
        _edge(ax, xs, ys, colour, marked)
    return _finish(ax, "Loss: micro-batches, step", "global step", "loss")


def loss(steps, ax=None):
    """The training loss of every step against the samples seen, and the validation loss.

    x: samples seen by ``fit`` (a History's own count), or for a record or a
    list of StepResults the samples of the steps given, summed (a record of
    every N-th step counts only those). The validation loss (a History's
    epochs with ``val_loss``) is drawn at each epoch's end, as dots on a
    dashed line in the run's colour. Several runs: one colour per run.

    Example::

        hostavg.plot.loss({"micro 32": history_32, "micro 8": history_8})
    """
    runs = _runs(steps, "loss")
    ax = _axes(ax, "loss")
    marked = []
    for i, run in enumerate(runs):
        colour = _colour(runs, i, "C0")
        shown = [s for s in run.steps if math.isfinite(s.loss)]
        ax.plot([s.samples for s in shown], [s.loss for s in shown], color=colour, linewidth=1,
                label=_named(run, "training loss (each step)"))
        _edge(ax, [s.samples for s in run.steps], [s.loss for s in run.steps], colour, marked)
        if run.validation:
            ax.plot(*zip(*run.validation), "o--", color=colour if len(runs) > 1 else "C1",
                    label=_named(run, "validation loss (each epoch)"))
    return _finish(ax, "Loss", "samples seen", "loss")


def cosine_heatmap(step, ax=None, vmin: float | None = COSINE_SCALE[0],
                   vmax: float | None = COSINE_SCALE[1], cmap: str = COSINE_SCALE[2]):
    """The cosine between every two accumulated micro-batches' gradients in one step.

    ``step`` is a ``StepResult`` of ``accumulate="stack"`` (its
    ``stats.pairwise_cosines``) or a recorded step with micro-batch gradients
    (``record[step]``); a record or a list of StepResults means its last
    step. Dropped micro-batches are left out; the ticks are the micro-batches'
    indices in the step.

    The colours span every cosine there is, -1 to 1, on a diverging scale
    (red agrees, blue opposes, white is orthogonal), the same in every
    figure and panel, so that a colour always means the same cosine; the
    diagonal (1, each micro-batch with itself) is grey and off the scale.
    Each cell shows its value, up to :data:`ANNOTATED` micro-batches.

    Several runs, ``{label: step}``: one panel per run, side by side (``ax``:
    None, or that many axes), on one scale; returns the list of axes.

    Args:
      vmin: the scale's low end; None: the smallest off-diagonal cosine of
        every panel, to see small differences (diverging around 0 where the
        cosines have both signs).
      vmax: the scale's high end; None: the largest such cosine.
      cmap: a matplotlib colormap's name; diverging ones suit cosines.
    """
    if isinstance(step, Mapping) and not isinstance(step, History):
        if not step:
            raise ArgumentError(f"hostavg.plot.cosine_heatmap takes one step (a StepResult or "
                                f"record[step]) or {SOURCES}; got an empty mapping")
        found = [(str(label), *_cosines(value, f" for run {label!r}"))
                 for label, value in step.items()]
        if ax is None:
            axes = _pyplot().subplots(1, len(found), figsize=(5.5 * len(found), 4.5),
                                      squeeze=False)[1][0]
        else:
            axes = list(np.ravel(ax)) if isinstance(ax, (list, tuple, np.ndarray)) else [ax]
            if len(axes) != len(found):
                raise ArgumentError(f"cosine_heatmap draws one panel per run: ax must be "
                                    f"{len(found)} axes, got {len(axes)}")
        scale = _scale([m for _, m, _, _ in found], vmin, vmax, cmap)
        for a, (label, matrix, index, number) in zip(axes, found):
            _heatmap(a, matrix, index, f"{label}, step {number}", *scale)
        axes[0].figure.suptitle("Cosine between micro-batch gradients")
        return list(axes)
    matrix, index, number = _cosines(step, "")
    return _heatmap(_axes(ax, "cosine_heatmap", (6, 5)), matrix, index,
                    f"Cosine between micro-batch gradients, step {number}",
                    *_scale([matrix], vmin, vmax, cmap))


def _scale(matrices: list, vmin, vmax, cmap: str) -> tuple:
    """(norm, colormap) of the heatmaps of ``matrices``: from ``vmin`` to ``vmax``, an end
    left None being their off-diagonal cosines' own, diverging around 0 where it lies between."""
    from matplotlib import colors
    found = np.concatenate([m[~np.eye(len(m), dtype=bool) & np.isfinite(m)] for m in matrices])
    low = (float(found.min()) if found.size else -1.0) if vmin is None else float(vmin)
    high = (float(found.max()) if found.size else 1.0) if vmax is None else float(vmax)
    if not low < high:
        if vmin is not None and vmax is not None:
            raise ArgumentError(f"cosine_heatmap: vmin must be below vmax, got {vmin} and {vmax}")
        low, high = low - 5e-4, high + 5e-4  # all alike: a little room, so colours mean something
    norm = colors.TwoSlopeNorm(0.0, low, high) if low < 0 < high else colors.Normalize(low, high)
    try:
        return norm, _colormap(cmap)
    except (KeyError, ValueError):
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
    ticks = range(0, k, math.ceil(k / ANNOTATED))
    ax.set_xticks(list(ticks), [str(index[t]) for t in ticks])
    ax.set_yticks(list(ticks), [str(index[t]) for t in ticks])
    _finish(ax, title, "micro-batch", "micro-batch", legend=False, integer_x=False)
    return ax


def _colormap(name: str):
    """matplotlib's colormap ``name``, masked cells (the diagonal) light grey."""
    import matplotlib
    return matplotlib.colormaps[name].with_extremes(bad="0.85")
