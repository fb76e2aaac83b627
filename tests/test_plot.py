"""hostavg.plot: several runs as {label: source}, one labelled line and colour per run drawn from
each run's own numbers; pictures that cannot be misread (what an axis cannot place in a strip
beside the data, a colour per variable however many, x and yscale on every plot over time,
legends that leave no holes, tick labels that never collide, the cosine heatmap's scale as its
docs say); all read back from the drawn artists."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from models import recorded_step, tf1  # noqa: E402

import hostavg  # noqa: E402
from hostavg.cli import models  # noqa: E402
import hostavg.hooks  # noqa: E402
from hostavg.hooks import Record, SkipNonFinite  # noqa: E402
from hostavg.inspect.plot import HEATMAP_SPECIAL  # noqa: E402

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
        if plot is hostavg.plot.variable_norms:
            continue  # a panel per run: below
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
    fast, slow = hostavg.plot.variable_norms(runs)  # per variable: a panel per run
    assert [fast.get_title(), slow.get_title()] == ["fast", "slow"]
    assert fast.figure is slow.figure
    assert [line.get_label() for line in fast.lines] == [f"fast: {n}" for n in runs["fast"].variables]
    assert [line.get_label() for line in slow.lines] == [f"slow: {n}" for n in runs["slow"].variables]
    for line, name in zip(slow.lines, runs["slow"].variables):
        j = runs["slow"].variables.index(name)
        np.testing.assert_array_equal(line.get_ydata(), [s.variable_norms[j] for s in runs["slow"].steps])
    assert [line.get_color() for line in fast.lines] == [line.get_color() for line in slow.lines]
    assert not fast.get_shared_x_axes().joined(fast, slow)  # steps of different runs: their own x
    fast, slow = hostavg.plot.variable_norms(runs, x="samples")  # samples compare: one x
    assert fast.get_shared_x_axes().joined(fast, slow) and fast.get_shared_y_axes().joined(fast, slow)


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


def test_the_cosine_heatmap_shows_each_value_on_the_cosines_own_scale(tmp_path):
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
    assert (want[off] > 0).all()  # every cosine positive: a sequential map over their own range
    assert (image.norm.vmin, image.norm.vmax) == (want[off].min(), want[off].max())
    assert image.cmap.name.startswith("Reds")
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
    both = np.concatenate([want[off], other.stats.pairwise_cosines[~np.eye(3, dtype=bool)]])
    for a in axes:  # the panels' own range, one scale for both
        assert a.images[0].norm.vmin == pytest.approx(both.min())
        assert a.images[0].norm.vmax == pytest.approx(both.max())
    axes = hostavg.plot.cosine_heatmap({"five": res, "three": other}, cmap="PuOr")
    assert all(a.images[0].cmap.name.startswith("PuOr") for a in axes)
    ax = hostavg.plot.cosine_heatmap(res, vmin=-1, vmax=1)  # fixed: diverging, centred on 0
    norm = ax.images[0].norm
    assert (norm.vmin, norm.vcenter, norm.vmax) == (-1, 0, 1)
    assert ax.images[0].cmap.name.startswith("RdBu_r")
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


def test_noise_scale_draws_the_batch_size(runs):
    ax = hostavg.plot.noise_scale(runs["fast"])
    (batch,) = [line for line in ax.lines if line.get_label() == "batch size (32)"]
    assert list(batch.get_ydata()) == [32, 32]


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
    recorded_step(model, feed, tmp_path / "rec", diagnose=False)  # Diagnose would measure them
    pytest.importorskip("matplotlib")
    with pytest.raises(hostavg.HostavgError, match=r"^hostavg.plot.variable_norms: no step holds "
                                                   r"update_ratio values: update ratios are "
                                                   r"measured only when the trainer is made with "
                                                   r"update_ratios_every=N"):
        hostavg.plot.variable_norms(hostavg.load_record(tmp_path / "rec"), quantity="update_ratio")


# --- Pictures that cannot be misread ----------------------------------------------------------


def strips(ax) -> dict:
    """"below" and "above" -> the strip ``ax`` drew beside its data area, read by where it lies."""
    ax.figure.canvas.draw()
    data = ax.get_window_extent()
    out = {}
    for child in ax.child_axes:
        box = child.get_window_extent()
        assert box.y1 <= data.y0 or box.y0 >= data.y1, "a strip overlaps the data area"
        out["below" if box.y1 <= data.y0 else "above"] = child
    return out


def marks(strip) -> list:
    """(x, colour) of every mark in a strip, by x."""
    from matplotlib.colors import to_hex
    return sorted((float(x), to_hex(c.get_facecolor()[0])) for c in strip.collections
                  for x, _ in c.get_offsets())


def edited(history, **changes):
    """A copy of ``history`` whose steps (by index) have the fields ``changes`` gives:
    ``{field: {index: value}}``."""
    copy = hostavg.History.from_json(history.to_json())
    for field, by_index in changes.items():
        for i, value in by_index.items():
            copy.steps[i] = copy.steps[i]._replace(**{field: value})
    return copy


def test_zeros_and_values_a_log_axis_cannot_place_go_to_strips_outside_the_data(runs):
    history = runs["fast"]
    names, k = list(history.variables), len(history.variables)
    zero = list(history.steps[0].variable_norms)
    zero[0] = 0.0
    inf = list(history.steps[1].update_ratios)
    inf[1] = np.inf
    missing = list(history.steps[2].update_ratios)
    missing[2] = np.nan  # not measured that step: neither drawn nor marked
    broken = edited(history, variable_norms={0: tuple(zero), 3: tuple(zero)},
                    update_ratios={1: tuple(inf), 2: tuple(missing)})
    ax = hostavg.plot.variable_norms(broken)
    (first,) = [line for line in ax.lines if line.get_label() == names[0]]
    assert np.isnan(first.get_ydata()[[0, 3]]).all()  # never among the data
    assert np.isfinite(first.get_ydata()[[1, 2, 4, 5]]).all()
    found = strips(ax)
    assert set(found) == {"below"} and found["below"].get_ylabel() == "= 0"
    assert marks(found["below"]) == [(1.0, first.get_color()), (4.0, first.get_color())]
    assert found["below"].get_xlabel() == "global step" and ax.get_xlabel() == ""
    ax = hostavg.plot.variable_norms(broken, quantity="update_ratio")
    found = strips(ax)
    assert set(found) == {"above"} and found["above"].get_ylabel() == "inf"
    infinite = sorted((float(s.step), ax.lines[j].get_color()) for s in broken.steps
                      for j, r in enumerate(s.update_ratios) if np.isinf(r))
    assert (2.0, ax.lines[1].get_color()) in infinite  # besides the biases' first moves from 0
    assert marks(found["above"]) == infinite
    assert np.isnan(ax.lines[2].get_ydata()[2])
    ax = hostavg.plot.variable_norms(broken, yscale="linear")  # a linear axis places 0
    assert ax.lines[0].get_ydata()[0] == 0 and not ax.child_axes and len(ax.lines) == k

    micro = [list(s.micro_norms) for s in history.steps]
    micro[2][1] = 0.0
    losses = list(history.steps[4].micro_losses)
    losses[3] = np.nan
    broken = edited(history, micro_norms={2: tuple(micro[2])}, micro_losses={4: tuple(losses)})
    found = strips(hostavg.plot.micro_norms(broken))
    assert [x for x, _ in marks(found["below"])] == [3.0]
    found = strips(hostavg.plot.micro_losses(broken))
    assert set(found) == {"above"} and found["above"].get_ylabel() == "NaN"
    assert [x for x, _ in marks(found["above"])] == [5.0]


def test_a_negative_noise_scale_is_marked_not_drawn_and_the_running_one_is_no_number(runs):
    history = runs["fast"]
    first = history.steps[0]
    # g2 < 0 at the first step: the running estimate is negative there (-1048.5 in a real run)
    broken = edited(history, g2={0: -abs(first.trace_sigma) / 1048.5},
                    b_simple={0: -1048.5})
    ax = hostavg.plot.noise_scale(broken)
    (running,) = [line for line in ax.lines if line.get_label().startswith("running estimate")]
    assert np.isnan(running.get_ydata()[0]) and np.isfinite(running.get_ydata()[1:]).all()
    found = strips(ax)
    assert found["below"].get_ylabel() == "≤ 0"
    assert [x for x, _ in marks(found["below"])] == [1.0]  # its own estimate
    # the running one is no noise scale there (NoiseScale.b_simple NaN, with its nan_reason)
    assert found["above"].get_ylabel() == "NaN" and [x for x, _ in marks(found["above"])] == [1.0]
    ax = hostavg.plot.noise_scale(broken, yscale="symlog")  # a symlog axis places the step's own
    (running,) = [line for line in ax.lines if line.get_label().startswith("running estimate")]
    assert np.isnan(running.get_ydata()[0])


@pytest.fixture(scope="module")
def deep():
    """A History of an MLP of 8 hidden layers (18 variables), 4 steps."""
    model = models.mlp(6, [8] * 8, 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), update_ratios_every=2,
                                  diagnose=False)  # which would measure every step's
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    return trainer.fit(sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}, batch_size=16,
                       micro_batch_size=8, seed=0, progress=False)


def test_eighteen_variables_are_drawn_in_eighteen_colours(deep):
    assert len(deep.variables) == 18
    ax = hostavg.plot.variable_norms(deep)
    styles = [(line.get_color(), line.get_linestyle()) for line in ax.lines]
    assert len({c for c, _ in styles}) == 18  # no two variables share a colour
    assert all(a[1] != b[1] for a, b in zip(styles, styles[1:]))  # a kernel and its bias differ
    legend = {t.get_text(): h.get_color() for t, h in zip(ax.get_legend().get_texts(),
                                                           ax.get_legend().legend_handles)}
    assert legend == {line.get_label(): line.get_color() for line in ax.lines}
    from hostavg.inspect.layout import variable_styles
    assert variable_styles(4) == [(matplotlib.colors.to_hex(f"C{j}"), "-") for j in range(4)]


def test_the_variable_heatmap_shows_every_variable_zeros_in_their_own_colour(deep):
    names = list(deep.variables)
    norms = [list(s.variable_norms) for s in deep.steps]
    norms[1][3] = 0.0
    norms[2][5] = np.inf
    broken = edited(deep, variable_norms={i: tuple(n) for i, n in enumerate(norms)})
    ax = hostavg.plot.variable_heatmap(broken)
    values, special = ax.collections
    grid = np.array(norms).T  # variables x steps
    shown = values.get_array().reshape(grid.shape)
    placed = np.isfinite(grid) & (grid > 0)
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~placed)
    np.testing.assert_array_equal(shown[placed], grid[placed])
    assert (values.norm.vmin, values.norm.vmax) == (grid[placed].min(), grid[placed].max())
    assert type(values.norm).__name__ == "LogNorm"
    cells = special.get_array().reshape(grid.shape)
    assert cells[3, 1] == 0 and cells[5, 2] == 1 and np.ma.getmaskarray(cells).sum() == grid.size - 2
    colours = [matplotlib.colors.to_hex(special.cmap(special.norm(v))) for v in (0, 1)]
    assert colours == [matplotlib.colors.to_hex(c) for _, c in HEATMAP_SPECIAL]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == names[0] and set(labels) <= set(names)  # the model's order, top down
    assert ax.get_ylim()[0] > ax.get_ylim()[1]
    ratios = hostavg.plot.variable_heatmap(deep, "update_ratio")  # every 2nd step: the others blank
    assert np.ma.getmaskarray(ratios.collections[0].get_array().reshape(grid.shape))[:, 0].all()


PLOTTED = {  # what every plot over time draws first, as a function of a step's row
    "loss": (hostavg.plot.loss, (), lambda ax: ax.lines[0]),
    "micro_losses": (hostavg.plot.micro_losses, (), lambda ax: ax.lines[0]),
    "micro_norms": (hostavg.plot.micro_norms, (), lambda ax: ax.lines[0]),
    "noise_scale": (hostavg.plot.noise_scale, (), lambda ax: ax.lines[0]),
    "variable_norms": (hostavg.plot.variable_norms, (), lambda ax: ax.lines[0]),
    "statistic": (hostavg.plot.statistic, ("grad_norm",), lambda ax: ax.lines[0]),
    "distributions": (hostavg.plot.distributions, ("hidden0/kernel",), lambda ax: ax.lines[0]),
}


@pytest.mark.parametrize("name", PLOTTED)
@pytest.mark.parametrize("yscale", ["linear", "log", "symlog"])
def test_yscale_and_x_are_honoured_on_every_plot_over_time(name, yscale, tmp_path):
    plot, args, first = PLOTTED[name]
    _, history, record = distributed(tmp_path)  # 3 epochs of 4 steps of 32 samples
    kept = [s.step for s in history.steps if s.distributions] if name == "distributions" \
        else [s.step for s in history.steps]
    want = {"step": kept, "samples": [32 * k for k in kept], "epoch": [k / 4 for k in kept]}
    for x, label in (("step", "global step"), ("samples", "samples seen"), ("epoch", "epoch")):
        ax = plot(history, *args, x=x, yscale=yscale)
        assert ax.get_yscale() == yscale, (name, x)
        np.testing.assert_allclose(first(ax).get_xdata(), want[x], err_msg=f"{name} {x}")
        assert label in (ax.get_xlabel() or strips(ax)["below"].get_xlabel())
        plt.close("all")
    with pytest.raises(hostavg.HostavgError, match=rf"^hostavg\.plot\.{name}: x='epoch' needs "
                                                   r"the History that fit returns: a record"):
        plot(record, *args, x="epoch")
    for wrong, match in ((dict(x="time"), r"x must be one of 'step', 'samples', 'epoch'; got "
                                          r"'time'"),
                         (dict(yscale="loglog"), r"yscale must be one of 'linear', 'log', "
                                                 r"'symlog'; got 'loglog'"),
                         (dict(legend=True), r"legend must be one of 'auto', 'outside', "
                                             r"'inside', False; got True")):
        with pytest.raises(hostavg.HostavgError, match=rf"^hostavg\.plot\.{name}: {match}$"):
            plot(history, *args, **wrong)
    assert plt.get_fignums() == []


def test_samples_compare_runs_of_different_batch_sizes(tmp_path):
    small = run(0.05)[2]  # batches of 32
    big = distributed(tmp_path)[1]
    ax = hostavg.plot.loss({"32": small, "big": big}, x="samples")
    assert ax.lines[0].get_xdata()[-1] == small.samples and ax.lines[2].get_xdata()[-1] == big.samples


def no_collisions(labels) -> None:
    boxes = [t.get_window_extent() for t in labels if t.get_visible() and t.get_text()]
    for a, b in zip(boxes, boxes[1:]):
        assert not a.overlaps(b), (a, b)


def test_tick_labels_never_collide(runs):
    trainer, sess, _, feeds = run(0.01)
    one = [f for feed in feeds for f in hostavg.split(feed, 1)]  # 96 micro-batches of 1
    ax = hostavg.plot.cosine_heatmap(trainer.step(sess, one[:64]))
    ax.figure.canvas.draw()
    no_collisions(ax.get_xticklabels())
    no_collisions(ax.get_yticklabels())
    assert 4 <= len(ax.get_xticklabels()) < 64
    # The Keras notebook's case: samples in the ten thousands on a panel of a 2 x 2 grid.
    many = edited(runs["fast"], samples={i: 2500 * (i + 4) for i in range(6)})
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    hostavg.plot.loss(many, ax=axes[0, 0])
    fig.canvas.draw()
    no_collisions(axes[0, 0].get_xticklabels())
    assert "k" in axes[0, 0].get_xticklabels()[1].get_text()  # 12.5k, not 12500


def test_legends_go_where_asked_and_leave_no_holes_in_a_grid(runs, deep):
    ax = hostavg.plot.variable_norms(deep, legend="outside")
    ax.figure.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    ax = hostavg.plot.variable_norms(deep, legend="inside")
    ax.figure.canvas.draw()
    inner, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert box.x0 <= inner.x0 and inner.x1 <= box.x1
    assert hostavg.plot.variable_norms(deep, legend=False).get_legend() is None
    for source, outside in ((runs["fast"], False), (runs, True)):  # 2 entries fit inside; 4 not
        ax = hostavg.plot.micro_norms(source)
        ax.figure.canvas.draw()
        assert bool(ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1) is outside
    ax = hostavg.plot.variable_norms(deep)  # alone in its figure: beside it
    ax.figure.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    hostavg.plot.loss(runs["fast"], ax=axes[0, 0])
    hostavg.plot.micro_norms(runs["fast"], ax=axes[0, 1])
    hostavg.plot.variable_norms(deep, ax=axes[1, 0])
    hostavg.plot.variable_norms(deep, quantity="update_ratio", ax=axes[1, 1])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for left, right in axes:  # no row keeps an empty space where another row's legend went
        gap = right.get_tightbbox(renderer).x0 - left.get_tightbbox(renderer).x1
        margin = fig.bbox.x1 - right.get_tightbbox(renderer).x1
        assert gap < 0.06 * fig.bbox.width and margin < 0.06 * fig.bbox.width, (gap, margin)
    for a in axes.ravel():
        legend = a.get_legend().get_window_extent()
        assert a.get_window_extent().x0 <= legend.x0 and legend.x1 <= a.get_window_extent().x1


def test_one_axes_for_several_runs_is_drawn_as_0_1_0_drew_it_with_a_deprecation(runs):
    """0.1.0's call form ``variable_norms(runs, ax=ax)`` still draws, on that axes, a line per
    variable and run (a colour per variable, a line style per run), and warns."""
    ax = plt.subplots()[1]
    with pytest.warns(DeprecationWarning, match="one axes for 2 runs is deprecated.*pass ax=None"):
        assert hostavg.plot.variable_norms(runs, ax=ax) is ax
    lines = {line.get_label(): line for line in ax.get_lines()}
    names = list(runs["fast"].variables)
    for label, style in (("fast", "-"), ("slow", "--")):
        for i, name in enumerate(names):
            line = lines[f"{label}: {name}"]
            assert line.get_linestyle() == style
            assert line.get_color() == lines[f"fast: {name}"].get_color()
            np.testing.assert_array_equal(
                line.get_ydata(), [s.variable_norms[i] for s in runs[label].steps])
    assert len({lines[f"fast: {n}"].get_color() for n in names}) == len(names)
    with pytest.raises(hostavg.ArgumentError, match="ax must be 2 axes, got 3"):
        hostavg.plot.variable_norms(runs, ax=list(plt.subplots(1, 3)[1]))


def test_curvature_draws_each_runs_measured_steps_with_the_levels_marked(tmp_path, runs):
    measured = {lr: run(lr, tmp_path, hooks=[hostavg.hooks.Curvature(
        every=2, trace_samples=2, iterations=3)]) for lr in (0.05, 0.2)}
    histories = {f"lr {lr}": found[2] for lr, found in measured.items()}
    axes = hostavg.plot.curvature({**histories, "record": hostavg.load_record(tmp_path / "rec0.2")})
    assert [a.get_title() for a in axes] == [
        "Sharpness: top eigenvalue x lr / 2", "Hessian trace (Hutchinson)", "Step quality alpha"]
    for ax, name in zip(axes, ("sharpness", "hessian_trace", "alpha")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for label, history in histories.items():
            table = history.to_pandas().dropna(subset=[name])
            drawn = lines[f"{label}: {name}"]
            np.testing.assert_array_equal(drawn.get_xdata(), table["step"])
            np.testing.assert_allclose(drawn.get_ydata(), table[name])
        # the record holds what the History of its run holds
        np.testing.assert_allclose(lines[f"record: {name}"].get_ydata(),
                                   lines[f"lr 0.2: {name}"].get_ydata())
    assert [line.get_ydata()[0] for line in axes[0].get_lines()
            if line.get_linestyle() == ":"] == [1.0]
    with pytest.raises(hostavg.HostavgError, match=r"no step was measured; train with "
                                                   r"hooks=\[hostavg.hooks.Curvature"):
        hostavg.plot.curvature(runs["fast"])
