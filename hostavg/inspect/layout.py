"""How hostavg's plots lay out what they draw, so that a picture cannot be misread.

* Values an axis cannot place are never drawn among the data: on a log
  axis exact zeros and negative values go to a labelled strip below the data
  area, infinite and NaN values (on any axis) to one above it (:class:`Strips`);
  each strip is an axes of its own sharing x, so no mark there reads as a value.
* Every variable of a plot has its own colour, however many there are
  (:func:`variable_styles`); neighbours beyond ten also differ in line style.
* Legends beside the axes where an axes has its figure to itself, inside it
  where it shares the figure (a grid keeps no holes), or as asked (:func:`legend`).
* Tick labels are thinned so that they never collide (:func:`thinned`), and
  samples are ticked compactly (12.5k).

Only matplotlib, imported by the functions that draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hostavg.core.errors import ArgumentError

__all__ = ["INSIDE", "LEGENDS", "STYLES", "Strips", "X_AXES", "YSCALES", "checked", "legend",
           "thinned", "variable_styles"]

#: What a plot over time can take as x: the global step, the samples seen, or epochs
#: (a History's: each step at its epoch plus the share of the epoch's samples seen).
X_AXES = ("step", "samples", "epoch")
#: The y scales of a plot over time (matplotlib's names).
YSCALES = ("linear", "log", "symlog")
#: Where a legend goes: "auto" (beside the axes when the axes is alone in its figure, inside
#: it when it shares the figure, and inside for a few entries), "outside", "inside", or
#: False for none.
LEGENDS = ("auto", "outside", "inside", False)
#: A legend with more entries than this goes beside its axes ("auto", the axes alone):
#: inside, a longer one would cover data (a lone run's two, training and validation, fit).
INSIDE = 2
#: Line styles that tell runs apart, and neighbouring variables beyond ten.
STYLES = ("-", "--", ":", "-.")
#: Variables up to this many get matplotlib's ten distinct colours; more, a colormap's.
TEN = 10
#: The perceptual colormap spread over the variables beyond :data:`TEN` (its light end left out).
VARIABLES_MAP, VARIABLES_END = "viridis", 0.9


def checked(where: str, x: str, yscale: str, legend_mode) -> None:
    """Refuses an ``x``, ``yscale`` or ``legend`` that is none of the known ones, the error
    starting with ``where`` (the function's public name)."""
    for name, value, known in (("x", x, X_AXES), ("yscale", yscale, YSCALES),
                               ("legend", legend_mode, LEGENDS)):
        if not any(value is k or (isinstance(k, str) and isinstance(value, str) and value == k)
                   for k in known):
            raise ArgumentError(f"{where}: {name} must be one of "
                                f"{', '.join(map(repr, known))}; got {value!r}")


def variable_styles(n: int) -> list[tuple[str, str]]:
    """(colour, line style) of each of ``n`` variables, all colours distinct: matplotlib's
    ten for up to ten, else :data:`VARIABLES_MAP` spread over them, neighbours (a layer's
    kernel and bias) alternating solid and dashed."""
    from matplotlib import colormaps, colors
    if n <= TEN:
        return [(colors.to_hex(f"C{j}"), "-") for j in range(n)]
    spread = colormaps[VARIABLES_MAP](np.linspace(0, VARIABLES_END, n))
    return [(colors.to_hex(c), STYLES[j % 2]) for j, c in enumerate(spread)]


def legend(ax, handles: list, labels: list, mode) -> None:
    """A legend of ``ax``'s ``handles`` as ``mode`` (one of :data:`LEGENDS`) says."""
    if mode is False or not handles:
        return
    alone = sum(a.get_visible() for a in ax.figure.axes) == 1
    if mode == "auto":
        mode = "outside" if len(handles) > INSIDE and alone else "inside"
    if mode == "outside":
        ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1),
                  borderaxespad=0, ncol=1 + (len(handles) - 1) // 12)
    else:
        ax.legend(handles, labels, fontsize="small" if len(handles) <= 8 else "x-small",
                  ncol=1 + (len(handles) - 1) // 10, framealpha=0.85)


def thinned(ax, axis: str, positions: Sequence, labels: Sequence[str]) -> None:
    """Ticks ``axis`` ("x" or "y") of ``ax`` at ``positions`` labelled ``labels``, every
    k-th only, k as small as keeps the labels from touching at the axes' drawn size."""
    if not len(positions):
        return
    size = ax.get_window_extent().width if axis == "x" else ax.get_window_extent().height
    points = size * 72 / ax.figure.dpi
    font = 9.0  # both axes alike: a heatmap of micro-batches reads the same both ways
    each = font * (0.62 * max(len(s) for s in labels) + 0.8) if axis == "x" else font * 1.5
    k = max(1, math.ceil(len(positions) * each / max(points, 1.0)))
    getattr(ax, f"set_{axis}ticks")(list(positions[::k]), list(labels[::k]),
                                    fontsize=font)


class Strips:
    """What ``ax`` cannot place, drawn beside its data area.

    :meth:`placed` takes a series' points and returns its values with those
    left out (NaN: a line breaks there); it keeps them for a strip: on a log
    axis exact zeros and negative values for the one below, infinite values
    (and NaN ones, where NaN is not "not measured") for the one above.
    :meth:`draw` makes the strips that got points: thin axes sharing x, each
    labelled ("= 0", "≤ 0", "inf", "NaN"), one row per series (its ``row``)
    that has points there, so that a few marks are large enough to see.
    """

    #: A strip's height, as a share of its axes' height, per row, at least and at most.
    ROW, LOW, HIGH = 0.012, 0.08, 0.2
    #: The gap between a strip and the data area, a share of the axes' height.
    GAP = 0.02

    def __init__(self, ax, log: bool):
        self.ax, self.log = ax, log
        self.below, self.above = [], []  # (x, kind per point, colour, row)

    def placed(self, x, y, colour, row: int = 0, missing: bool = True) -> np.ndarray:
        """``y`` (a float array over ``x``) with what ``ax`` cannot place set to NaN, kept
        for the strips in ``colour`` on ``row``; ``missing``: a NaN is a value to mark,
        not one that was not measured."""
        x, y = np.asarray(x, float), np.asarray(y, float)
        with np.errstate(invalid="ignore"):
            low = (y <= 0) if self.log else np.zeros(y.shape, bool)
        high = np.isinf(y) | (np.isnan(y) if missing else np.zeros(y.shape, bool))
        if low.any():
            self.below.append((x[low], np.where(y[low] < 0, "neg", "zero"), colour, row))
        if high.any():
            self.above.append((x[high], np.where(np.isnan(y[high]), "nan", "inf"), colour, row))
        out = y.copy()
        out[low | high] = np.nan
        return out

    def draw(self) -> list:
        """Makes the strips that hold points; returns them (bottom first). The x tick labels
        and the x label move to the bottom strip."""
        made = []
        if self.below:
            strip = self._strip(-self.GAP, self.below,
                                "≤ 0" if any("neg" in k for _, k, _, _ in self.below) else "= 0", "v")
            self.ax.tick_params(labelbottom=False)
            strip.set_xlabel(self.ax.get_xlabel())
            self.ax.set_xlabel("")
            strip.tick_params(labelbottom=True)
            made.append(strip)
        if self.above:
            kinds = {k for _, ks, _, _ in self.above for k in ks}
            made.append(self._strip(1 + self.GAP, self.above,
                                    ", ".join(w for w in ("inf", "NaN") if w.lower() in kinds),
                                    "^"))
        return made

    def _strip(self, edge: float, points: list, said: str, marker: str):
        """A strip of ``points`` from ``edge`` (a share of the axes' height) outwards: up from
        above the axes (edge > 1), down from below it."""
        rows = {row: i for i, row in enumerate(sorted({p[3] for p in points}))}
        height = min(max(self.LOW, self.ROW * len(rows)), self.HIGH)
        bottom = edge if edge > 1 else edge - height
        strip = self.ax.inset_axes([0, bottom, 1, height], sharex=self.ax)
        strip.set_facecolor("0.94")
        row_points = self.ax.get_window_extent().height * height / len(rows) * 72 / self.ax.figure.dpi
        size = float(np.clip(row_points * 0.8, 2.5, 6.0)) ** 2  # markers of a row stay in it
        for x, _, colour, row in points:
            strip.scatter(x, np.full(len(x), len(rows) - rows[row] - 0.5), marker=marker,
                          s=size, color=colour, clip_on=False, zorder=3, linewidths=0)
        strip.set_ylim(0, len(rows))
        strip.set_yticks([])
        strip.set_ylabel(said, rotation=0, ha="right", va="center", fontsize="small")
        strip.tick_params(labelbottom=False, bottom=False)
        for side in ("top", "right", "left", "bottom"):
            strip.spines[side].set_color("0.7")
        return strip
