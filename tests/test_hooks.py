"""Step statistics, non-finite localisation, and the built-in hooks."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models import ENV, batches, build, cuts, v1

import hostavg
from hostavg import stats
from hostavg.hooks import ClipGlobalNorm, ClipMicroBatchNorm, Record, SkipNonFinite, TensorBoard

SIZES = (5, 12, 3, 20)


class Setup:
    def __init__(self, hooks=(), accumulate="sum", sparse=False):
        self.model = build(sparse=sparse)
        with self.model.graph.as_default():
            self.trainer = hostavg.Trainer(self.model.loss, v1.train.AdamOptimizer(0.01),
                                           accumulate=accumulate, hooks=hooks)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=self.model.graph)
        self.sess.run(init)
        data = batches(5, 1, sum(SIZES), sparse=sparse)[0]
        self.feeds = [self.model.feed({k: v[s] for k, v in data.items()}) for s in cuts(40, SIZES)]

    def poison(self, index):
        x = self.model.inputs["x"]
        feeds = [dict(f) for f in self.feeds]
        feeds[index][x] = feeds[index][x].copy()
        feeds[index][x][0, 0] = np.nan
        return feeds

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
    assert summed.stats.cosines is None and summed.stats.gsnr is None
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


def test_tensorboard_writes_scalars_and_histograms_that_read_back(tmp_path):
    import tensorflow as tf
    board = TensorBoard(tmp_path / "tb", histograms_every=2)
    s = Setup(hooks=[board])
    for _ in range(3):
        s.trainer.step(s.sess, s.feeds)
    board.flush()
    seen = {}
    for path in (tmp_path / "tb").iterdir():
        for event in v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append((event.step, tf.make_ndarray(value.tensor)))
    assert [step for step, _ in seen["hostavg/loss"]] == [1, 2, 3]
    assert {"hostavg/grad_norm", "hostavg/b_simple", "hostavg/norm_test"} <= set(seen)
    assert "hostavg/gsnr" not in seen  # "sum" mode has no GSNR
    assert [step for step, _ in seen["gradients/hidden/kernel"]] == [2]
    histogram = seen["gradients/hidden/kernel"][0][1]
    assert histogram.shape[1] == 3 and histogram[:, 2].sum() == 48  # counts of 6 x 8 values


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
    np.testing.assert_allclose(np.diag(ax.images[0].get_array()), 1, rtol=1e-6)
    summed = Setup()
    with pytest.raises(hostavg.HostavgError, match="accumulate='stack'"):
        hostavg.plot.cosine_heatmap(summed.trainer.step(summed.sess, summed.feeds))
