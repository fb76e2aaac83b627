"""hostavg.plot: several runs as {label: source}, one labelled line and colour per run drawn from
each run's own numbers; the loss against samples seen; readable figures (a tight layout, whole
step ticks, labels and titles, a cosine heatmap with values on one fixed scale)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from models import recorded_step, tf1  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models  # noqa: E402
from hostavg.hooks import Record, SkipNonFinite  # noqa: E402

v1 = tf.compat.v1
PLOTS = (hostavg.plot.micro_norms, hostavg.plot.noise_scale, hostavg.plot.variable_norms,
         hostavg.plot.loss)


def run(lr, tmp_path=None, accumulate="stack", hooks=()):
    """A small MLP fitted 2 epochs of 3 steps with validation: (trainer, sess, history, feeds)."""
    model = models.mlp(6, [8], 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(lr), accumulate=accumulate,
                                  update_ratios_every=1, hooks=list(hooks) + (
                                      [Record(tmp_path / f"rec{lr}")] if tmp_path else []))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(120, 6)).astype(np.float32)
    data = {model.x: x[:96], model.y: (x[:96, 0] > 0).astype(np.int32)}
    history = trainer.fit(sess, data, batch_size=32, micro_batch_size=8, epochs=2, seed=0,
                          validation_data={model.x: x[96:], model.y: (x[96:, 0] > 0).astype(np.int32)},
                          progress=False)
    return trainer, sess, history, hostavg.split(data, 8)


@pytest.fixture(scope="module")
def runs():
    return {"fast": run(0.05)[2], "slow": run(0.001)[2]}


@pytest.fixture(autouse=True)
def closed():
    yield
    plt.close("all")


def test_several_runs_draw_one_labelled_line_per_run_from_each_runs_numbers(runs):
    for plot in PLOTS:
        ax = plot(runs)
        labels = ax.get_legend_handles_labels()[1]
        for label in runs:
            assert any(t.startswith(f"{label}: ") for t in labels), (plot.__name__, labels)
    ax = hostavg.plot.micro_norms(runs)
    means = [line for line in ax.lines if line.get_label().endswith("norm of the mean")]
    assert [line.get_label() for line in means] == ["fast: norm of the mean", "slow: norm of the mean"]
    for line, history in zip(means, runs.values()):
        np.testing.assert_array_equal(line.get_ydata(), [s.grad_norm for s in history.steps])
        np.testing.assert_array_equal(line.get_xdata(), [s.step for s in history.steps])
    assert means[0].get_color() != means[1].get_color()
    dots = ax.collections
    assert [len(d.get_offsets()) for d in dots] == [6 * 4, 6 * 4]
    assert not np.array_equal(dots[0].get_facecolor(), dots[1].get_facecolor())
    ax = hostavg.plot.variable_norms(runs)
    fast = [line for line in ax.lines if line.get_label().startswith("fast: ")]
    slow = [line for line in ax.lines if line.get_label().startswith("slow: ")]
    assert len(fast) == len(slow) == len(runs["fast"].variables)
    assert {line.get_linestyle() for line in fast} != {line.get_linestyle() for line in slow}
    assert [line.get_color() for line in fast] == [line.get_color() for line in slow]


def test_the_loss_is_drawn_against_samples_seen_with_validation_at_each_epochs_end(runs, tmp_path):
    ax = hostavg.plot.loss(runs)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("samples seen", "loss")
    for label, history in runs.items():
        (train,) = [line for line in ax.lines if line.get_label() == f"{label}: training loss (each step)"]
        (val,) = [line for line in ax.lines if line.get_label() == f"{label}: validation loss (each epoch)"]
        np.testing.assert_array_equal(train.get_xdata(), [32, 64, 96, 128, 160, 192])
        np.testing.assert_array_equal(train.get_ydata(), [s.loss for s in history.steps])
        np.testing.assert_array_equal(val.get_xdata(), [96, 192])
        np.testing.assert_array_equal(val.get_ydata(), [e["val_loss"] for e in history.epochs])
        assert train.get_color() == val.get_color()
    # A record and a list of StepResults: the samples of the steps given; no validation.
    trainer, sess, history, feeds = run(0.01, tmp_path)
    results = [trainer.step(sess, feeds[:4]) for _ in range(3)]
    ax = hostavg.plot.loss({"record": Record(tmp_path / "rec0.01"), "steps": results})
    xs = {line.get_label(): list(line.get_xdata()) for line in ax.lines}
    assert xs == {"record: training loss (each step)": [32 * i for i in range(1, 10)],
                  "steps: training loss (each step)": [32, 64, 96]}


def test_every_plot_names_the_run_it_refuses_and_draws_nothing(runs):
    for plot in PLOTS + (hostavg.plot.cosine_heatmap,):
        good = {} if plot is hostavg.plot.cosine_heatmap else {"fast": runs["fast"]}
        for wrong in ({**good, "bad": [1.0]}, {}):
            with pytest.raises(hostavg.HostavgError, match=rf"hostavg\.plot\.{plot.__name__} takes"):
                plot(wrong)
        assert plt.get_fignums() == [], plot.__name__
    with pytest.raises(hostavg.HostavgError, match=r"got a list of 1 \(float\) for run 'bad'"):
        hostavg.plot.loss({"fast": runs["fast"], "bad": [1.0]})


def test_figures_are_tight_with_whole_step_ticks_labels_and_titles(runs):
    for plot in PLOTS:
        ax = plot(runs["fast"])
        ax.figure.canvas.draw()
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), plot.__name__
        assert all(t == int(t) for t in ax.get_xticks()), (plot.__name__, ax.get_xticks())
        assert type(ax.figure.get_layout_engine()).__name__ == "TightLayoutEngine"
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
    hostavg.plot.micro_norms(runs["fast"], ax=left)
    hostavg.plot.variable_norms(runs["fast"], ax=right)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert left.get_tightbbox(renderer).x1 <= right.get_tightbbox(renderer).x0  # no overlap


def test_the_cosine_heatmap_shows_each_value_on_one_fixed_diverging_scale(tmp_path):
    trainer, sess, _, feeds = run(0.01, hooks=[SkipNonFinite()])
    bad = [dict(f) for f in feeds[:5]]
    x = next(k for k in bad[2] if k.name == "x:0")
    bad[2][x] = np.full_like(bad[2][x], np.nan)
    res = trainer.step(sess, bad)
    assert res.dropped == (2,)
    want = res.stats.pairwise_cosines
    assert want.shape == (4, 4)
    ax = hostavg.plot.cosine_heatmap(res)
    image = ax.images[0]
    off = ~np.eye(4, dtype=bool)
    assert (image.norm.vmin, image.norm.vmax, image.cmap.name) == (-1.0, 1.0, "RdBu_r")
    assert np.ma.getmaskarray(image.get_array()).diagonal().all()  # the diagonal: off the scale
    np.testing.assert_array_equal(image.get_array()[off], want[off])
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    assert texts == {(i, j): "1" if i == j else f"{want[i, j]:.2f}" for i in range(4) for j in range(4)}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "3", "4"]  # 2 was dropped
    assert ax.get_title() == f"Cosine between micro-batch gradients, step {res.step}"
    other = trainer.step(sess, feeds[:3])
    axes = hostavg.plot.cosine_heatmap({"five": res, "three": other})
    assert [a.get_title() for a in axes] == [f"five, step {res.step}", f"three, step {other.step}"]
    assert axes[1].images[0].get_array().shape == (3, 3)
    assert all((a.images[0].norm.vmin, a.images[0].norm.vmax) == (-1, 1) for a in axes)
    both = np.concatenate([want[off], other.stats.pairwise_cosines[~np.eye(3, dtype=bool)]])
    axes = hostavg.plot.cosine_heatmap({"five": res, "three": other}, vmin=None, vmax=None,
                                       cmap="PuOr")
    for a in axes:  # the panels' own range, one scale for both
        assert a.images[0].norm.vmin == pytest.approx(both.min())
        assert a.images[0].norm.vmax == pytest.approx(both.max())
        assert a.images[0].cmap.name.startswith("PuOr")
    ax = hostavg.plot.cosine_heatmap(res, vmin=-0.5, vmax=0.5)
    assert (ax.images[0].norm.vmin, ax.images[0].norm.vmax) == (-0.5, 0.5)
    with pytest.raises(hostavg.HostavgError, match="vmin must be below vmax, got 1 and 0"):
        hostavg.plot.cosine_heatmap(res, vmin=1, vmax=0)
    with pytest.raises(hostavg.HostavgError, match="cmap must be a matplotlib colormap's name, "
                                                   "got 'nope'"):
        hostavg.plot.cosine_heatmap(res, cmap="nope")
    with pytest.raises(hostavg.HostavgError, match="ax must be 2 axes, got 1"):
        hostavg.plot.cosine_heatmap({"five": res, "three": other}, ax=plt.gca())


def distributed(tmp_path, lr=0.05):
    """A small MLP fitted 3 epochs of 4 steps keeping distributions every 2nd step, with a
    Record: (trainer, history, record)."""
    model = models.mlp(6, [8], 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(lr), distributions_every=2,
                                  update_ratios_every=1, hooks=[Record(tmp_path / f"d{lr}")])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(128, 6)).astype(np.float32)
    history = trainer.fit(sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)},
                          batch_size=32, micro_batch_size=8, epochs=3, seed=0, progress=False)
    return trainer, history, hostavg.load_record(tmp_path / f"d{lr}")


def test_distributions_are_drawn_as_bands_around_the_median_at_the_steps_that_kept_them(
        tmp_path):
    trainer, history, record = distributed(tmp_path)
    name = "hidden0/kernel"
    table = history.distributions(name, "update")
    assert list(table.index) == list(range(2, 13, 2))
    assert list(table.columns) == [0, 6.68, 15.87, 30.85, 50, 69.15, 84.13, 93.32, 100]
    assert (np.diff(table.to_numpy(), axis=1) >= 0).all()  # percentiles in order
    assert record.distributions(name, "update").equals(table)
    for source in (history, record, {"a": history, "b": record}):
        ax = hostavg.plot.distributions(source, name, "weight")
        median = ax.lines[0]
        np.testing.assert_array_equal(median.get_xdata(), table.index)
        np.testing.assert_allclose(median.get_ydata(), history.distributions(name, "weight")[50])
        assert len(ax.collections) >= 4  # the bands
    assert ax.get_title().startswith(f"Distribution of the weight of {name}\n(bands: min-max")
    with pytest.raises(hostavg.HostavgError, match=r"quantity must be one of \('gradient', "
                                                   r"'weight', 'update'\), got 'norm'"):
        history.distributions(name, "norm")
    with pytest.raises(hostavg.HostavgError, match="no variable 'nope'; the trained variables"):
        hostavg.plot.distributions(history, "nope")
    plain = run(0.05)[2]
    with pytest.raises(hostavg.HostavgError, match=r"run 'plain'.*distributions_every=N"):
        hostavg.plot.distributions({"kept": history, "plain": plain}, name)
    with pytest.raises(hostavg.HostavgError, match=r"distributions_every=N"):
        plain.distributions(name)
    assert hostavg.History.from_json(history.to_json()).distributions(name).equals(
        history.distributions(name))


def test_micro_batch_losses_are_kept_and_drawn_with_the_steps_loss(runs):
    history = runs["fast"]
    assert all(len(s.micro_losses) == 4 for s in history.steps)
    for s in history.steps:  # the step's loss: the sample-weighted mean of equal micro-batches
        assert s.loss == pytest.approx(np.mean(s.micro_losses), rel=1e-6)
    ax = hostavg.plot.micro_losses(history)
    np.testing.assert_allclose(ax.collections[0].get_offsets()[:, 1],
                               [v for s in history.steps for v in s.micro_losses])
    assert list(ax.lines[0].get_ydata()) == [s.loss for s in history.steps]
    axes = hostavg.plot.micro_losses(runs)
    assert [t.get_text() for t in axes.get_legend().get_texts()][:2] == [
        "fast: micro-batch loss", "fast: the step's loss"]


def test_noise_scale_draws_the_batch_size_and_marks_what_a_log_scale_cannot_show(runs):
    ax = hostavg.plot.noise_scale(runs["fast"])
    (batch,) = [line for line in ax.lines if line.get_label() == "batch size (32)"]
    assert list(batch.get_ydata()) == [32, 32]
    history = runs["fast"]
    broken = hostavg.History.from_json(history.to_json())
    broken.steps[0] = broken.steps[0]._replace(update_ratios=(np.inf,) * len(history.variables))
    ax = hostavg.plot.variable_norms(broken, quantity="update_ratio")
    (marks,) = [c for c in ax.collections if c.get_label().startswith("infinite or NaN")]
    assert len(ax.collections) == len(history.variables)  # one mark per variable at step 1
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [*history.variables, "infinite or NaN (at the top edge)"]


def test_runs_by_variables_keep_one_key_per_variable_and_per_run_outside_the_data(runs):
    ax = hostavg.plot.variable_norms(runs)
    names = list(runs["fast"].variables)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == names + ["run fast", "run slow"]
    styles = {line.get_label(): line.get_linestyle() for line in ax.lines}
    assert styles[f"fast: {names[0]}"] == "-" and styles[f"slow: {names[0]}"] == "--"
    ax.figure.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # beside the axes, not over the lines


# --- What a plot refuses ----------------------------------------------------------------------


def test_plots_refuse_an_ax_that_is_no_axes(tf1):
    # plot.micro_norms(results, ax="ax") raised AttributeError: 'str' object has no attribute ...
    model, trainer, sess, feed = tf1
    pytest.importorskip("matplotlib")
    results = [trainer.step(sess, hostavg.split(feed, 10))]
    with pytest.raises(hostavg.HostavgError, match=r"^hostavg.plot.micro_norms: ax must be "
                                                   r"matplotlib Axes \(or None for a new figure\), "
                                                   r"got 'ax'$"):
        hostavg.plot.micro_norms(results, ax="ax")


def test_variable_norms_of_update_ratios_never_measured_says_how_to_measure_them(tf1, tmp_path):
    model, _, _, feed = tf1
    recorded_step(model, feed, tmp_path / "rec")
    pytest.importorskip("matplotlib")
    with pytest.raises(hostavg.HostavgError, match=r"^hostavg.plot.variable_norms: no step holds "
                                                   r"update_ratio values: update ratios are "
                                                   r"measured only when the trainer is made with "
                                                   r"update_ratios_every=N"):
        hostavg.plot.variable_norms(hostavg.load_record(tmp_path / "rec"), quantity="update_ratio")
