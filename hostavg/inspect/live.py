"""The LivePlot hook: one figure of the run so far, redrawn in place while fit trains.

In Jupyter the figure is one IPython display, updated in place (a display
handle), so a saved notebook keeps one final figure; elsewhere it is a PNG
file, replaced whole at each redraw (a viewer never reads half of one). The
figure is drawn with matplotlib's object API (no pyplot), so it never opens a
window nor shows twice in a notebook.
"""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path

from hostavg.core.errors import ArgumentError, HostavgError, positive_int
from hostavg.inspect import layout, plot
from hostavg.train.history import History
from hostavg.train.progress import in_notebook

__all__ = ["PANELS", "LivePlot"]

#: Each panel LivePlot can draw, by name: the plot that draws it and its keyword arguments.
PANELS = {
    "loss": (plot.loss, {}),
    "micro_losses": (plot.micro_losses, {}),
    "micro_norms": (plot.micro_norms, {}),
    "noise_scale": (plot.noise_scale, {}),
    "variable_norms": (plot.variable_norms, {}),
    "update_ratios": (plot.variable_norms, {"quantity": "update_ratio"}),
}


class LivePlot:
    """Redraws a figure of the steps applied so far every ``every`` steps, and at the end.

    A hook (``fit(..., callbacks=[LivePlot(every=10)])`` on either face, or
    ``Trainer(hooks=[...])``). Each applied step is kept as fit's History
    keeps it (a few numbers per step, micro-batch and variable, no
    gradients); between redraws that is all an ``on_applied`` call does. A
    redraw draws each panel with :mod:`hostavg.plot`, two panels a row; a
    panel the steps cannot draw yet (``"update_ratios"`` needs the trainer's
    ``update_ratios_every``, ``"noise_scale"`` two micro-batches or more)
    says why in place of its plot.

    Args:
      every: redraw every this many applied steps (an int >= 1).
      panels: names of :data:`PANELS`, in order.
      path: where the PNG goes outside a notebook (required there); in a
        notebook, also written there when given.
      x: the x of every panel (``"step"``, ``"samples"`` or ``"epoch"``).

    Attributes:
      history: the steps drawn from (a :class:`~hostavg.History`).
      redraws: how many times the figure was drawn.
      display: the IPython display handle in a notebook (after the first redraw), else None.

    Raises:
      HostavgError: an unknown panel, ``every`` below 1, no ``path`` outside a notebook.
    """

    def __init__(self, every: int = 10, panels=("loss", "micro_norms", "noise_scale",
                                                 "update_ratios"), path=None, x: str = "step"):
        self.every = positive_int("LivePlot: every", every)
        self.panels = tuple(panels) if not isinstance(panels, str) else (panels,)
        unknown = [p for p in self.panels if p not in PANELS]
        if unknown or not self.panels:
            raise ArgumentError(f"LivePlot: panels must be names of {sorted(PANELS)}; got "
                                f"{unknown or list(self.panels)}")
        layout.checked("LivePlot", x, "linear", False)
        self.notebook = in_notebook()
        if path is None and not self.notebook:
            raise ArgumentError("LivePlot: outside a notebook it writes a PNG: give path="
                                "'live.png' (where the figure goes)")
        self.path, self.x = None if path is None else Path(path), x
        self.history, self.redraws, self.display = History(), 0, None
        self._epoch, self._drawn = 0, 0

    def on_epoch_begin(self, epoch: int) -> None:
        self._epoch = epoch

    def on_applied(self, result) -> None:
        self.history.add(self._epoch, result)
        if len(self.history.steps) % self.every == 0:
            self.redraw()

    def on_train_end(self, history) -> None:
        """fit ended: the last steps drawn too."""
        if len(self.history.steps) != self._drawn:
            self.redraw()

    def redraw(self) -> None:
        """Draws the figure of every step so far; shows it (notebook) and writes ``path``."""
        png = self._png()
        self.redraws, self._drawn = self.redraws + 1, len(self.history.steps)
        if self.notebook:
            from IPython.display import Image, display
            if self.display is None:
                self.display = display(Image(data=png), display_id=True)
            else:
                self.display.update(Image(data=png))
        if self.path is not None:
            partial = self.path.with_name(f".{self.path.name}.partial")
            partial.write_bytes(png)
            os.replace(partial, self.path)

    def _png(self) -> bytes:
        out = io.BytesIO()
        self.figure().savefig(out, format="png", dpi=80)
        return out.getvalue()

    def figure(self):
        """The matplotlib Figure of every step so far, as a redraw draws it (no pyplot)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        rows = (len(self.panels) + 1) // 2
        columns = min(2, len(self.panels))
        figure = Figure(figsize=(6.5 * columns, 3.8 * rows), layout="tight")
        FigureCanvasAgg(figure)
        axes = figure.subplots(rows, columns, squeeze=False).ravel()
        for ax, name in zip(axes, self.panels):
            draw, kw = PANELS[name]
            try:
                draw(self.history, ax=ax, x=self.x, **kw)
            except HostavgError as error:  # this panel cannot be drawn yet: say why
                ax.clear()
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{name}:\n" + textwrap.fill(str(error), 60), ha="center",
                        va="center", fontsize="small", transform=ax.transAxes)
        for ax in axes[len(self.panels):]:
            ax.set_axis_off()
        figure.suptitle(f"{len(self.history.steps)} steps, {self.history.samples} samples",
                        fontsize="medium")
        return figure
