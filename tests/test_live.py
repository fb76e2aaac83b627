"""LivePlot: one figure of the run so far, redrawn every N steps and at fit's end, from the steps
as fit's History keeps them; a PNG outside a notebook, one display updated in place in one;
nothing drawn between redraws; honest errors."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
import nbformat  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models  # noqa: E402
from hostavg.hooks import LivePlot  # noqa: E402

v1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit(live, steps=5, **trainer_kw):
    """A TF1 MLP fit for ``steps`` steps of 2 micro-batches of 8, ``live`` its hook."""
    model = models.mlp(6, [8], 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), hooks=[live],
                                  **trainer_kw)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(16 * steps, 6)).astype(np.float32)
    return trainer.fit(sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)},
                       batch_size=16, micro_batch_size=8, seed=0, progress=False)


def test_outside_a_notebook_it_writes_the_png_every_n_steps_and_at_the_end(tmp_path):
    path = tmp_path / "live.png"
    live = LivePlot(every=2, path=path)
    seen = []
    live.redraw = lambda real=live.redraw: (seen.append(len(live.history.steps)), real())
    history = fit(live)
    assert seen == [2, 4, 5] and live.redraws == 3 and live.display is None
    assert [s.loss for s in live.history.steps] == [s.loss for s in history.steps]
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 600 and image.std() > 0
    assert [p.name for p in tmp_path.iterdir()] == ["live.png"]  # no partial file left


def test_each_panel_is_the_plot_of_the_steps_so_far_or_says_why_it_cannot_be(tmp_path):
    live = LivePlot(every=100, path=tmp_path / "live.png")
    history = fit(live, steps=3, diagnose=False)  # Diagnose would measure update ratios
    assert live.redraws == 1  # fit's end
    loss, norms, noise, ratios = live.figure().axes[:4]
    np.testing.assert_array_equal(loss.lines[0].get_ydata(), [s.loss for s in history.steps])
    np.testing.assert_array_equal(norms.lines[0].get_ydata(), [s.grad_norm for s in history.steps])
    assert noise.get_title() == "Gradient noise scale"
    assert not ratios.axison and "update_ratios_every=N" in ratios.texts[0].get_text()
    live = LivePlot(every=100, panels=["update_ratios"], path=tmp_path / "live.png", x="samples")
    history = fit(live, steps=3, update_ratios_every=1)
    (ratios,) = [a for a in live.figure().axes if a.lines]
    np.testing.assert_array_equal(ratios.lines[0].get_xdata(), [16, 32, 48])
    assert len(ratios.lines) == len(history.variables)


def test_between_redraws_an_applied_step_is_only_kept(tmp_path, monkeypatch):
    live = LivePlot(every=3, path=tmp_path / "live.png")
    monkeypatch.setattr(LivePlot, "figure", lambda self: pytest.fail("drew between redraws"))
    model = models.mlp(6, [8], 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), hooks=[live])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.zeros((16, 6), np.float32)
    for _ in range(2):  # a hand-written loop: on_applied alone
        trainer.step(sess, hostavg.split({model.x: x, model.y: np.zeros(16, np.int32)}, 8))
    assert len(live.history.steps) == 2 and live.redraws == 0
    assert not (tmp_path / "live.png").exists()


@pytest.mark.parametrize("kw,match", [
    (dict(every=0), r"^LivePlot: every must be an integer >= 1, got 0$"),
    (dict(panels=("loss", "weights")), r"^LivePlot: panels must be names of \['loss', "
                                       r"'micro_losses', 'micro_norms', 'noise_scale', "
                                       r"'update_ratios', 'variable_norms'\]; got \['weights'\]$"),
    (dict(panels=()), r"^LivePlot: panels must be names of .*; got \[\]$"),
    (dict(x="time"), r"^LivePlot: x must be one of 'step', 'samples', 'epoch'; "
                     r"got 'time'$"),
    (dict(), r"^LivePlot: outside a notebook it writes a PNG: give path='live.png' \(where the "
             r"figure goes\)$"),
])
def test_liveplot_refuses_what_it_cannot_draw(kw, match):
    with pytest.raises(hostavg.HostavgError, match=match):
        LivePlot(**({"path": "live.png"} | kw) if kw else kw)


class Counting(NotebookClient):
    """Executes a notebook, keeping every display message's (type, display id)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.displays = []

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] in ("display_data", "update_display_data"):
            said = msg["content"].get("transient", {}).get("display_id")
            self.displays.append((msg["msg_type"], said, "image/png" in msg["content"]["data"]))
        return super().process_message(msg, cell, cell_index)


@pytest.mark.slow
def test_in_a_notebook_it_updates_one_display_in_place(tmp_path):
    code = """
import numpy as np, tensorflow as tf
import hostavg
from hostavg.cli import models
from hostavg.hooks import LivePlot
v1 = tf.compat.v1
model = models.mlp(6, [8], 3, seed=0)
live = LivePlot(every=2)
with model.graph.as_default():
    trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), hooks=[live])
    init = v1.global_variables_initializer()
sess = v1.Session(graph=model.graph)
sess.run(init)
x = np.random.default_rng(0).normal(size=(96, 6)).astype(np.float32)
history = trainer.fit(sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)},
                      batch_size=16, micro_batch_size=8, seed=0, progress=False)
print(live.redraws, live.display.display_id)
"""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    client = Counting(nb, timeout=120, kernel_name="python3",
                      resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=dict(os.environ, PYTHONPATH=ROOT))
    redraws, shown_id = nb.cells[0].outputs[-1]["text"].split()
    assert redraws == "3"  # steps 2, 4, 6; the end drew nothing new
    kinds = [kind for kind, _, _ in client.displays]
    assert kinds == ["display_data", "update_display_data", "update_display_data"]
    assert {said for _, said, _ in client.displays} == {shown_id}  # one display id
    assert all(png for _, _, png in client.displays)
    images = [out for out in nb.cells[0].outputs if "image/png" in out.get("data", {})]
    assert len(images) == 1  # the saved notebook keeps one figure, the last
