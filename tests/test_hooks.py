"""Step statistics, non-finite localisation, and the built-in hooks."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models import ENV, batches, build, cuts, poisoned, v1

import hostavg
from hostavg import stats
from hostavg.hooks import ClipGlobalNorm, ClipMicroBatchNorm, Record, SkipNonFinite, TensorBoard

SIZES = (5, 12, 3, 20)


class Setup:
    def __init__(self, hooks=(), accumulate="sum", sparse=False):
        self.model = build(sparse=sparse)
        with self.model.graph.as_default():
            self.trainer = hostavg.Trainer(self.model.loss, v1.train.AdamOptimizer(0.01),
                                           accumulate=accumulate, hooks=hooks,
                                           update_ratios_every=1)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.model.graph)
        self.sess.run(init)
        data = batches(5, 1, sum(SIZES), sparse=sparse)[0]
        self.feeds = [self.model.feed({k: v[s] for k, v in data.items()}) for s in cuts(40, SIZES)]

    def poison(self, index):
        return poisoned(self, index)

    def computes(self, feeds):
        return [self.trainer.compute(self.sess, f) for f in feeds]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_step_stats_in_sum_and_stack_agree_with_the_stats_functions(sparse):
    s = Setup(accumulate="stack", sparse=sparse)
    t = Setup(accumulate="sum", sparse=sparse)
    stacked = s.trainer.step(s.sess, s.feeds)
    summed = t.trainer.step(t.sess, t.feeds)
    G, _ = stats.flatten([m.grads for m in stacked.micro])
    b = list(SIZES)
    want = stats.noise_scale(G, b)
    for got in (stacked.stats, summed.stats):
        assert got.g2 == pytest.approx(want.g2, rel=1e-6)
        assert got.trace_sigma == pytest.approx(want.trace_sigma, rel=1e-6)
        assert got.b_simple == pytest.approx(want.b_simple, rel=1e-6)
        assert got.norm_test == pytest.approx(stats.norm_test(G, b), rel=1e-6)
        np.testing.assert_allclose(got.micro_norms, np.linalg.norm(G, axis=1), rtol=1e-6)
        assert got.micro_losses == tuple(m.loss for m in stacked.micro)
        assert got.grad_norm == pytest.approx(np.linalg.norm(np.asarray(b) @ G / 40), rel=1e-6)
        assert got.variable_norms.keys() == stacked.grads.keys()
    st = stacked.stats
    assert st.inner_product_test == pytest.approx(stats.inner_product_test(G, b), rel=1e-6)
    assert st.orthogonality_test == pytest.approx(stats.orthogonality_test(G, b), rel=1e-6)
    np.testing.assert_allclose(st.cosines, stats.cosines(G, b), rtol=1e-6)
    np.testing.assert_allclose(st.pairwise_cosines, stats.pairwise_cosines(G), rtol=1e-5)
    assert summed.stats.cosines is None and summed.stats.gsnr is None
    assert summed.stats.pairwise_cosines is None
    if not sparse:
        assert st.gsnr == pytest.approx(stats.gsnr(G, b), rel=1e-6)
    one = t.trainer.step(t.sess, t.feeds[:1]).stats
    assert one.g2 is None and one.norm_test is None and len(one.micro_norms) == 1
    table = stacked.micro_table()
    assert list(table["size"]) == b and list(table.columns) == [
        "start", "size", "loss", "norm", "cosine", "dropped"]
    assert list(table["start"]) == [0, 5, 17, 20]


def test_nan_in_micro_batch_2_raises_by_default_naming_it_and_changes_nothing():
    s = Setup(hooks=[SkipNonFinite()])
    plain = Setup()
    before = plain.model.values(plain.sess)
    message = ("step, micro-batch 2 of 4 (samples 17:20): non-finite gradients in 'hidden/kernel' "
               "(48 of 48 entries: 48 NaN, 0 Inf), ")
    with pytest.raises(hostavg.HostavgError, match=re.escape(message) + r".* and the loss is nan\. "
                       r"Nothing was applied\..*hooks=\[hostavg\.hooks\.SkipNonFinite\(\)\]"):
        plain.trainer.step(plain.sess, plain.poison(2))
    after = plain.model.values(plain.sess)
    for name in set(before) - {"forward_passes"}:  # the forward counter is no model state
        np.testing.assert_array_equal(after[name], before[name])

    # With SkipNonFinite the other three are applied, sample-weighted.
    feeds = s.poison(2)
    acc = s.trainer.accumulator()
    for g in s.computes([feeds[i] for i in (0, 1, 3)]):
        acc.add(g)
    want = acc.mean()
    res = s.trainer.step(s.sess, feeds)
    assert res.dropped == (2,) and "non-finite gradients in 'hidden/kernel'" in res.micro[2].dropped
    assert res.size == 5 + 12 + 20 and res.step == 1
    assert np.isnan(res.stats.micro_norms[2]) and np.isnan(res.stats.micro_losses[2])
    for name in want:
        np.testing.assert_allclose(res.grads[name], want[name], rtol=1e-6)
    skipped = s.trainer.step(s.sess, [feeds[2]])
    assert skipped.skipped.startswith("all 1 micro-batches were dropped")
    assert skipped.grads is None and skipped.step == 1 == s.sess.run(s.trainer.global_step)


def test_clip_micro_batch_norm_and_clip_global_norm():
    probe = Setup()
    norms = [g.global_norm() for g in probe.computes(probe.feeds)]
    limit = float(np.median(norms))
    s = Setup(hooks=[ClipMicroBatchNorm(limit)], accumulate="stack")
    res = s.trainer.step(s.sess, s.feeds)
    np.testing.assert_allclose(res.info["micro_norms_before_clip"], norms, rtol=1e-6)
    np.testing.assert_allclose(res.stats.micro_norms, np.minimum(norms, limit), rtol=1e-5)
    for m, n in zip(res.micro, norms):
        assert m.grads.global_norm() == pytest.approx(min(n, limit), rel=1e-5)

    g = Setup(hooks=[ClipGlobalNorm(0.01)])
    res = g.trainer.step(g.sess, g.feeds)
    assert res.info["grad_norm_before_clip"] > 0.01
    assert res.stats.grad_norm == pytest.approx(0.01, rel=1e-5)
    assert res.grads.global_norm() == pytest.approx(0.01, rel=1e-5)
    with pytest.raises(hostavg.HostavgError, match="max_norm must be a finite number > 0, got 0"):
        ClipGlobalNorm(0)


def test_record_holds_what_was_applied_and_loads_lazily_without_pickle(tmp_path):
    s = Setup(hooks=[SkipNonFinite(), Record(tmp_path / "rec", every=2)])
    results = [s.trainer.step(s.sess, s.feeds if i != 3 else s.poison(1)) for i in range(4)]
    record = hostavg.load_record(tmp_path / "rec")
    assert record.steps == [2, 4] and len(record) == 2
    step4 = record[4]
    assert step4.loss == results[3].loss and step4.size == 5 + 3 + 20
    for name, value in results[3].grads.items():
        np.testing.assert_array_equal(step4.mean[name], value)
    assert [m["recorded"] for m in step4.micro] == [True, False, True, True]
    assert step4.micro[1]["dropped"].startswith("non-finite")
    micro0 = step4.micro_grads(0)
    assert micro0.size == 5 and set(micro0) == set(results[3].grads)
    with pytest.raises(hostavg.HostavgError, match="no gradients recorded for micro-batch 1"):
        step4.micro_grads(1)
    table = record.to_pandas()
    assert list(table.index) == [2, 4]
    assert table.loc[2, "b_simple"] == pytest.approx(results[1].stats.b_simple)
    assert record.micro_table().loc[(4, 1), "dropped"].startswith("non-finite")
    for path in (tmp_path / "rec").iterdir():
        with np.load(path, allow_pickle=False) as z:
            assert "meta" in z.files


@pytest.mark.slow
def test_record_survives_a_process_killed_mid_run(tmp_path):
    rec = tmp_path / "rec"
    script = Path(__file__).with_name("record_script.py")
    proc = subprocess.Popen([sys.executable, str(script), str(rec)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV)
    try:
        for line in proc.stdout:
            if int(line) >= 6:
                break
    finally:
        proc.kill()
        proc.wait(30)
    record = hostavg.load_record(rec)
    assert record.steps[:6] == [1, 2, 3, 4, 5, 6]
    assert record.steps == list(range(1, len(record) + 1))
    for step in record:
        assert len(step.micro) == 8 and step.micro_grads(7).size == 8
        assert all(np.isfinite(v).all() for v in step.mean.values())


def test_tensorboard_scalars_read_back_with_event_accumulator_after_every_step(tmp_path):
    board = TensorBoard(tmp_path / "tb", histograms_every=2)
    s = Setup(hooks=[SkipNonFinite(), board], accumulate="stack")
    results = []
    for k in range(3):
        results.append(s.trainer.step(s.sess, s.poison(1) if k == 1 else s.feeds))
        scalars = events(tmp_path / "tb")  # neither flush nor close: written after every step
        assert [(step, value) for step, value in scalars["hostavg/loss"]] == [
            (r.step, pytest.approx(r.loss, rel=1e-6)) for r in results]
    names = list(results[0].grads)
    assert set(scalars) == {f"hostavg/{k}" for k in (
        "loss", "grad_norm", "learning_rate", "dropped", "nonfinite_rows", "b_simple",
        "b_simple_one_step", "g2", "trace_sigma", "norm_test", "inner_product_test",
        "orthogonality_test", "gsnr")} | {
        f"{kind}/{n}" for kind in ("grad_norm", "update_ratio", "weight_norm") for n in names}
    for tag, want in {"hostavg/grad_norm": lambda r: r.stats.grad_norm,
                      "hostavg/gsnr": lambda r: r.stats.gsnr,
                      "hostavg/norm_test": lambda r: r.stats.norm_test,
                      "hostavg/inner_product_test": lambda r: r.stats.inner_product_test,
                      "hostavg/dropped": lambda r: len(r.dropped),
                      "hostavg/learning_rate": lambda r: r.learning_rate,
                      f"grad_norm/{names[0]}": lambda r: r.stats.variable_norms[names[0]],
                      f"update_ratio/{names[0]}": lambda r: r.update_ratios[names[0]]}.items():
        assert scalars[tag] == [(r.step, pytest.approx(want(r), rel=1e-6)) for r in results], tag
    assert [v for _, v in scalars["hostavg/dropped"]] == [0, 1, 0]
    from tensorboard.backend.event_processing import event_accumulator as ea
    reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.HISTOGRAMS: 0}).Reload()
    (histogram,) = reader.Histograms("gradients/hidden/kernel")  # every 2nd step: step 2
    mean = np.asarray(results[1].grads["hidden/kernel"], np.float64)
    assert histogram.step == 2 and histogram.histogram_value.num == 48
    assert histogram.histogram_value.min == mean.min() and histogram.histogram_value.max == mean.max()
    assert histogram.histogram_value.sum == pytest.approx(mean.sum())
    assert sum(histogram.histogram_value.bucket) == 48
    # each step's micro-batches as a histogram of their finite values (the poisoned one left out)
    assert set(reader.Tags()["histograms"]) >= {"hostavg/micro_norms", "hostavg/micro_losses",
                                                "hostavg/cosines"}
    norms = reader.Histograms("hostavg/micro_norms")
    assert [h.histogram_value.num for h in norms] == [4, 3, 4]
    assert norms[2].histogram_value.max == pytest.approx(max(results[2].stats.micro_norms))


def test_plots_draw_what_the_steps_hold():
    import matplotlib
    matplotlib.use("Agg")
    s = Setup(accumulate="stack")
    results = [s.trainer.step(s.sess, s.feeds) for _ in range(5)]
    ax = hostavg.plot.micro_norms(results)
    assert len(ax.collections[0].get_offsets()) == 5 * 4
    ax = hostavg.plot.noise_scale(results)
    assert len(ax.lines[0].get_xdata()) == 5
    ax = hostavg.plot.cosine_heatmap(results[-1])
    np.testing.assert_allclose(ax.images[0].get_array().data, results[-1].stats.pairwise_cosines)
    summed = Setup()
    with pytest.raises(hostavg.HostavgError, match="accumulate='stack'"):
        hostavg.plot.cosine_heatmap(summed.trainer.step(summed.sess, summed.feeds))


# --- Honest records: only applied steps, one run per folder ----------------------------------


class FailOnce:
    """Raises in on_step at global step ``at``, once."""

    def __init__(self, at):
        self.at = at

    def on_step(self, mean, result):
        if result.step == self.at:
            self.at = None
            raise RuntimeError("flaky hook")


def events(logdir) -> dict:
    """tag -> [(step, value)] of every scalar under ``logdir``, as TensorBoard's own
    EventAccumulator reads them (its Scalars, what the Scalars tab shows)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    reader = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0}).Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)]
            for tag in reader.Tags()["scalars"]}


def test_a_step_that_failed_after_record_and_tensorboard_saw_it_leaves_nothing(tmp_path):
    board = TensorBoard(tmp_path / "tb")
    s = Setup(hooks=[Record(tmp_path / "rec"), board, FailOnce(at=2)])
    s.trainer.step(s.sess, s.feeds)
    with pytest.raises(RuntimeError, match="flaky hook") as raised:
        s.trainer.step(s.sess, s.feeds)
    assert raised.value.__notes__ == ["hostavg: raised by hook FailOnce in on_step of step 2; "
                                      "nothing was applied"]
    assert hostavg.load_record(tmp_path / "rec").steps == [1]
    s.trainer.step(s.sess, s.feeds)  # step 2 again, this time applied
    board.close()
    assert hostavg.load_record(tmp_path / "rec").steps == [1, 2]
    assert [step for step, _ in events(tmp_path / "tb")["hostavg/loss"]] == [1, 2]
    assert not [p for p in (tmp_path / "rec").iterdir() if p.name.startswith(".")]


def test_an_on_applied_hook_that_fails_says_the_step_was_applied():
    class Late:
        def on_applied(self, result):
            raise RuntimeError("late")

    s = Setup(hooks=[Late()])
    with pytest.raises(RuntimeError, match="late") as raised:
        s.trainer.step(s.sess, s.feeds)
    assert raised.value.__notes__ == ["hostavg: raised by hook Late in on_applied of step 1; "
                                      "the step was applied"]
    assert s.sess.run(s.trainer.global_step) == 1


def test_a_record_folder_of_another_run_is_refused_unless_overwritten(tmp_path):
    rec = tmp_path / "rec"
    first = Setup(hooks=[Record(rec)])
    for _ in range(3):
        first.trainer.step(first.sess, first.feeds)
    again = Setup(hooks=[Record(rec)])  # the same cell run again: a new model from step 0
    before = again.model.values(again.sess)
    with pytest.raises(hostavg.HostavgError,
                       match=rf"Record: the folder '{re.escape(str(rec))}' already holds 3 steps at "
                             rf"or after step 1, the first this run writes \(1, 2, 3\).*"
                             rf"overwrite=True"):
        again.trainer.step(again.sess, again.feeds)
    after = again.model.values(again.sess)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    # The first run's trainer goes on with its own record.
    first.trainer.step(first.sess, first.feeds)
    assert hostavg.load_record(rec).steps == [1, 2, 3, 4]
    fresh = Setup(hooks=[Record(rec, overwrite=True)])
    res = fresh.trainer.step(fresh.sess, fresh.poison(0)[1:])
    record = hostavg.load_record(rec)
    assert record.steps == [1] and record[1].loss == res.loss and record[1].size == 35


# --- Clipping shows both norms ---------------------------------------------------------------


def test_norms_before_clipping_stay_aligned_with_micro_batches_when_one_is_dropped(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    probe = Setup()
    norms = [g.global_norm() for g in probe.computes(probe.feeds)]
    limit = float(np.median(norms))
    s = Setup(hooks=[SkipNonFinite(), ClipMicroBatchNorm(limit), Record(tmp_path / "rec")])
    res = s.trainer.step(s.sess, s.poison(1))
    before = res.info["micro_norms_before_clip"]
    assert len(before) == 4 and np.isnan(before[1])
    np.testing.assert_allclose([before[i] for i in (0, 2, 3)], [norms[i] for i in (0, 2, 3)],
                               rtol=1e-6)
    table = res.micro_table()
    assert list(table.columns[:6]) == ["start", "size", "loss", "norm_before_clip", "norm",
                                       "dropped"]  # "sum" mode: no cosines
    np.testing.assert_allclose(table["norm"][[0, 2, 3]],
                               np.minimum([norms[i] for i in (0, 2, 3)], limit), rtol=1e-5)
    recorded = hostavg.load_record(tmp_path / "rec").micro_table()
    np.testing.assert_allclose(recorded["norm_before_clip"].to_numpy(), before, rtol=1e-12)
    ax = hostavg.plot.micro_norms([res])
    # the norms (the dropped one's non-finite norm in the strip above), the norms before
    # clipping (the dropped one's NaN: not measured, so not marked)
    dots, hollow = (np.ma.filled(c.get_offsets(), np.nan)[:, 1] for c in ax.collections)
    assert np.isnan(dots[1]) and np.isfinite(dots[[0, 2, 3]]).all() and np.isnan(hollow[1])
    (above,) = ax.child_axes
    assert above.get_ylabel() in ("inf", "NaN") and len(above.collections[0].get_offsets()) == 1
    assert "before clipping" in ax.get_legend_handles_labels()[1][1]


# --- Per-variable views ----------------------------------------------------------------------


def test_per_variable_norms_and_update_ratios_in_records_tables_and_plots(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    s = Setup(hooks=[Record(tmp_path / "rec")], accumulate="stack")
    results = [s.trainer.step(s.sess, s.feeds) for _ in range(3)]
    record = hostavg.load_record(tmp_path / "rec")
    names = list(s.trainer.spec)
    norms = record.variable_norms()
    assert list(norms.index) == [1, 2, 3] and list(norms.columns) == names
    for res in results:
        for name in names:
            assert norms.loc[res.step, name] == res.stats.variable_norms[name]
            assert record.variable_norms("update_ratio").loc[res.step, name] == \
                res.update_ratios[name]
    micro = record.variable_norms(micro=True)
    assert list(micro.index[:2]) == [(1, 0), (1, 1)] and len(micro) == 3 * 4
    for i, m in enumerate(results[-1].micro):  # each micro-batch's own gradient, per variable
        for name in names:
            assert micro.loc[(3, i), name] == pytest.approx(np.linalg.norm(m.grads[name]), rel=1e-5)
    assert record.to_pandas()["learning_rate"].tolist() == pytest.approx([0.01] * 3)
    table = results[-1].variable_table()
    assert list(table.index) == names and list(table.columns) == [
        "grad_norm", "update_ratio", "micro 0", "micro 1", "micro 2", "micro 3"]
    ax = hostavg.plot.variable_norms(record)
    assert [line.get_label() for line in ax.lines] == names
    ax = hostavg.plot.variable_norms(results, quantity="update_ratio")
    np.testing.assert_allclose(ax.lines[0].get_ydata(),
                               [r.update_ratios[names[0]] for r in results])
    with pytest.raises(hostavg.HostavgError, match=r"quantity must be one of \('grad_norm', "
                                                   r"'update_ratio'\), got 'norm'"):
        hostavg.plot.variable_norms(results, quantity="norm")


def test_a_variable_whose_gradient_is_exactly_zero_shows_on_the_plot():
    import matplotlib
    matplotlib.use("Agg")

    class ZeroBias:
        def on_micro_batch(self, micro):
            return {n: np.zeros_like(v) if n == "out/bias" else v for n, v in micro.grads.items()}

    s = Setup(hooks=[ZeroBias()])
    results = [s.trainer.step(s.sess, s.feeds) for _ in range(2)]
    assert results[-1].stats.variable_norms["out/bias"] == 0
    assert results[-1].update_ratios["out/bias"] == 0  # Adam with a zero gradient: no move
    ax = hostavg.plot.variable_norms(results)
    (below,) = ax.child_axes  # a strip below the data area: a log scale has no 0
    assert below.get_ylabel() == "= 0" and len(below.collections[0].get_offsets()) == 2
    (line,) = [line for line in ax.lines if line.get_label() == "out/bias"]
    assert np.isnan(line.get_ydata()).all()  # not among the data


# --- TensorBoard -----------------------------------------------------------------------------


def test_tensorboard_without_its_package_is_refused_when_made(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(hostavg.HostavgError, match=r"pip install tensorboard"):
        TensorBoard(tmp_path / "tb")


def test_tensorboard_in_fit_logs_the_running_noise_scale_rates_and_validation_and_closes(tmp_path):
    from hostavg.cli import models
    model = models.mlp(6, [8], 3, seed=0)
    board = TensorBoard(tmp_path / "tb", beta=0.5)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.GradientDescentOptimizer(0.1),
                                  hooks=[board], update_ratios_every=1)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    data = {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}
    history = trainer.fit(sess, data, batch_size=32, micro_batch_size=8, epochs=2, seed=0,
                          validation_data=data, metrics={"accuracy": model.accuracy},
                          progress=False)
    seen = events(tmp_path / "tb")  # no flush by hand: fit closed the writer
    assert [step for step, _ in seen["hostavg/loss"]] == [1, 2, 3, 4]
    tracker = hostavg.NoiseScale(0.5)
    running = [tracker.update(hostavg.stats.NoiseScaleEstimate(s.g2, s.trace_sigma, s.b_simple))
               for s in history.steps]
    np.testing.assert_allclose([v for _, v in seen["hostavg/b_simple"]], running, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in seen["hostavg/b_simple_one_step"]],
                               [s.b_simple for s in history.steps], rtol=1e-6)
    assert [float(v) for _, v in seen["hostavg/learning_rate"]] == pytest.approx([0.1] * 4)
    for name in history.variables:
        assert len(seen[f"grad_norm/{name}"]) == len(seen[f"update_ratio/{name}"]) == 4
    assert [(step, float(v)) for step, v in seen["epoch/val_accuracy"]] == [
        (2, pytest.approx(history.epochs[0]["val_accuracy"])),
        (4, pytest.approx(history.epochs[1]["val_accuracy"]))]


# --- Plots take what training produced -------------------------------------------------------


def test_every_plot_takes_a_record_results_or_a_history_and_refuses_the_rest_before_drawing(
        tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hostavg.cli import models
    model = models.mlp(6, [8], 3, seed=0)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), accumulate="stack",
                                  hooks=[Record(tmp_path / "rec")])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    history = trainer.fit(sess, {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)},
                          batch_size=32, micro_batch_size=8, epochs=2, seed=0, progress=False)
    record = hostavg.load_record(tmp_path / "rec")
    results = [trainer.step(sess, hostavg.split({model.x: x[:32], model.y: x[:32, 0] > 0}, 8))]
    for plot in (hostavg.plot.micro_norms, hostavg.plot.noise_scale, hostavg.plot.variable_norms):
        drawn = [plot(source) for source in (record, history, results)]
        assert all(ax.has_data() for ax in drawn), plot.__name__
    np.testing.assert_allclose(hostavg.plot.micro_norms(history).lines[0].get_ydata(),
                               hostavg.plot.micro_norms(record).lines[0].get_ydata(), rtol=1e-12)
    assert hostavg.plot.cosine_heatmap(record).images and hostavg.plot.cosine_heatmap(results).images
    plt.close("all")
    for plot in (hostavg.plot.micro_norms, hostavg.plot.noise_scale, hostavg.plot.variable_norms,
                 hostavg.plot.cosine_heatmap):
        for wrong in ({"loss": [1.0]}, [1.0, 2.0], history.to_pandas()):
            with pytest.raises(hostavg.HostavgError, match=rf"hostavg\.plot\.{plot.__name__} takes"):
                plot(wrong)
        assert plt.get_fignums() == [], plot.__name__  # nothing drawn
    with pytest.raises(hostavg.HostavgError, match="History that fit returns does not keep"):
        hostavg.plot.cosine_heatmap(history)


@pytest.mark.slow
def test_tensorboard_writes_on_keras_jax_without_importing_tensorflow(tmp_path):
    script = """
import sys, numpy as np, keras, hostavg.keras
from hostavg.hooks import TensorBoard
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
trainer = hostavg.keras.Trainer(model, micro_batch_size=8, distributions_every=2,
                                hooks=[TensorBoard(sys.argv[1], 1)])
trainer.fit(x, np.arange(32) % 3, batch_size=16, epochs=1, verbose=0)
print("tensorflow" in sys.modules, float(np.asarray(model.layers[0].kernel).sum()))
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tb")], env=dict(
        ENV, KERAS_BACKEND="jax"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    imported, kernel_sum = out.stdout.split()
    assert imported == "False"
    assert [step for step, _ in events(tmp_path / "tb")["hostavg/loss"]] == [1, 2]
    from tensorboard.backend.event_processing import event_accumulator as ea
    reader = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.HISTOGRAMS: 0}).Reload()
    for kind in ("weights", "updates"):  # step 2 kept its distributions: the weights after it
        assert {t for t in reader.Tags()["histograms"] if t.startswith(kind)} == {
            f"{kind}/sequential/dense/kernel", f"{kind}/sequential/dense/bias"}
        assert [h.step for h in reader.Histograms(f"{kind}/sequential/dense/kernel")] == [2]
    (weights,) = reader.Histograms("weights/sequential/dense/kernel")
    assert weights.histogram_value.num == 12
    assert weights.histogram_value.sum == pytest.approx(float(kernel_sum), rel=1e-5)


def test_a_tensorboard_folder_of_another_run_is_refused_unless_overwritten(tmp_path):
    board = TensorBoard(tmp_path / "tb")
    s = Setup(hooks=[board])
    s.trainer.step(s.sess, s.feeds)
    board.close()
    s.trainer.step(s.sess, s.feeds)  # the same hook again: its own folder, a second file
    board.close()
    again = Setup(hooks=[TensorBoard(tmp_path / "tb")])
    with pytest.raises(hostavg.HostavgError, match=re.escape(
            f"TensorBoard: the folder {str(tmp_path / 'tb')!r} already holds 2 event files")
            + ".*another run's.*overwrite=True"):
        again.trainer.step(again.sess, again.feeds)
    assert [step for step, _ in events(tmp_path / "tb")["hostavg/loss"]] == [1, 2]
    resumed = TensorBoard(tmp_path / "tb")
    resumed.on_resume(2)  # fit resumed from a checkpoint: appends
    fresh = Setup(hooks=[resumed, TensorBoard(tmp_path / "new", overwrite=True)])
    fresh.trainer.step(fresh.sess, fresh.feeds)
    over = Setup(hooks=[TensorBoard(tmp_path / "tb", overwrite=True)])
    over.trainer.step(over.sess, over.feeds)
    assert [step for step, _ in events(tmp_path / "tb")["hostavg/loss"]] == [1]
    assert len(list((tmp_path / "tb").iterdir())) == 1


def test_event_files_of_one_second_are_read_in_the_order_written(tmp_path, monkeypatch):
    # The 10th file of a process after its 9th, in the same second: TensorBoard reads a
    # folder's files in name order, so the files' numbers must sort as numbers do.
    import itertools
    from hostavg.inspect import tensorboard
    monkeypatch.setattr(tensorboard, "_FILES", itertools.count(9))
    monkeypatch.setattr(tensorboard.time, "time", lambda: 1_800_000_000.5)
    board = TensorBoard(tmp_path / "tb")
    s = Setup(hooks=[board])
    for _ in range(2):
        s.trainer.step(s.sess, s.feeds)
        board.close()  # the next step opens the next file
    assert len(list((tmp_path / "tb").iterdir())) == 2
    assert [step for step, _ in events(tmp_path / "tb")["hostavg/loss"]] == [1, 2]


def test_one_running_noise_scale_average_everywhere(tmp_path):
    import inspect
    beta = stats.NOISE_SCALE_BETA
    assert hostavg.NoiseScale().beta == TensorBoard(tmp_path / "tb").noise_scale.beta == beta
    assert inspect.signature(hostavg.plot.noise_scale).parameters["beta"].default == beta


# --- Hooks and callbacks take NumPy's numbers ---------------------------------------------------


@pytest.mark.parametrize("hook", [ClipGlobalNorm, ClipMicroBatchNorm])
@pytest.mark.parametrize("value", [np.float32(1.0), np.int64(2), np.float16(0.5)],
                         ids=["float32", "int64", "float16"])
def test_clip_hooks_take_numpy_numbers(hook, value):
    # np.float32(1.0) and np.int64(2) were refused as "not a finite number > 0".
    assert hook(value).max_norm == float(value)


@pytest.mark.parametrize("hook", [ClipGlobalNorm, ClipMicroBatchNorm])
@pytest.mark.parametrize("value", [0, -1.0, np.nan, "1", True, 1 + 0j])
def test_clip_hooks_refuse_what_is_no_finite_positive_number(hook, value):
    with pytest.raises(hostavg.HostavgError, match=r"^max_norm must be a finite number > 0, got "):
        hook(value)


def test_early_stopping_takes_numpy_integers_and_refuses_text():
    assert hostavg.EarlyStopping(patience=np.int64(2), min_delta=np.float32(0.5)).patience == 2
    with pytest.raises(hostavg.HostavgError, match=r"^min_delta must be a finite number >= 0, got "
                                                   r"'abc'$"):
        hostavg.EarlyStopping(min_delta="abc")


# --- TensorBoard's logdir ---------------------------------------------------------------------


@pytest.mark.parametrize("logdir,match", [
    (None, r"^TensorBoard: logdir must be a folder name \(str or os.PathLike\), got None$"),
    ("FILE", r"^TensorBoard: logdir '.*/a-file' is a file, not a folder; name a folder for the "
             r"event files$"),
])
def test_tensorboard_refuses_a_logdir_that_is_no_folder_at_once(tmp_path, logdir, match):
    # TensorBoard(<a file>) was accepted until the first apply.
    pytest.importorskip("tensorboard")
    (tmp_path / "a-file").write_text("a file")
    logdir = tmp_path / "a-file" if logdir == "FILE" else logdir
    with pytest.raises(hostavg.HostavgError, match=match):
        hostavg.hooks.TensorBoard(logdir)
