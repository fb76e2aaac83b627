"""The estimators against brute force and the paper's formulas. Pure NumPy."""

import math

import numpy as np
import pytest

from hostavg import HostavgError, NoiseScale
from hostavg import stats

D = 40


def draws(sizes, trials, seed=0):
    """Micro-batch gradients g_i = G + noise with covariance Sigma / b_i, known G and Sigma."""
    rng = np.random.default_rng(seed)
    G = rng.normal(0, 0.3, D)
    scales = rng.uniform(0.5, 2.0, D)  # Sigma = diag(scales^2)
    b = np.asarray(sizes, float)
    noise = rng.normal(size=(trials, len(b), D)) * scales / np.sqrt(b)[:, None]
    return G + noise, b, float(G @ G), float(np.sum(scales ** 2))


@pytest.mark.parametrize("sizes", [[16] * 4, [4, 8, 16, 40]], ids=["equal", "unequal"])
def test_g2_and_trace_sigma_are_unbiased(sizes):
    Gs, b, g2_true, tr_true = draws(sizes, 20000)
    est = [stats.noise_scale(G, b) for G in Gs]
    assert np.mean([e.g2 for e in est]) == pytest.approx(g2_true, rel=0.03)
    assert np.mean([e.trace_sigma for e in est]) == pytest.approx(tr_true, rel=0.03)


def test_equal_sizes_match_the_two_batch_size_formulas_exactly():
    Gs, b, _, _ = draws([8] * 5, 3)
    k, small = 5, 8.0
    big = k * small
    for G in Gs:
        g_small_sq = np.mean(np.sum(G ** 2, axis=1))  # |G_small|^2, averaged over the k small batches
        g_big_sq = float(np.sum(G.mean(0) ** 2))
        g2 = (big * g_big_sq - small * g_small_sq) / (big - small)
        S = (g_small_sq - g_big_sq) / (1 / small - 1 / big)
        est = stats.noise_scale(G, b)
        assert est.g2 == pytest.approx(g2, rel=1e-12)
        assert est.trace_sigma == pytest.approx(S, rel=1e-12)
        assert est.b_simple == pytest.approx(S / g2, rel=1e-12)


def test_tests_gsnr_and_cosines_on_a_hand_computed_case():
    G = np.array([[1.0, 0.0], [3.0, 2.0]])
    b = [1, 3]
    gbar = np.array([2.5, 1.5])  # (1 * [1, 0] + 3 * [3, 2]) / 4
    sq = gbar @ gbar  # 8.5
    S = (1 * np.sum((G[0] - gbar) ** 2) + 3 * np.sum((G[1] - gbar) ** 2)) / 1  # 3.25 + 1.0833 * 3
    assert stats.noise_scale(G, b).trace_sigma == pytest.approx(S)
    assert stats.norm_test(G, b) == pytest.approx(math.sqrt(S / (4 * sq)))
    v_ip = 1 * (G[0] @ gbar - sq) ** 2 + 3 * (G[1] @ gbar - sq) ** 2
    assert stats.inner_product_test(G, b) == pytest.approx(math.sqrt(v_ip / (4 * sq ** 2)))
    v_orth = sum(w * (g @ g - (g @ gbar) ** 2 / sq) for w, g in zip(b, G))
    assert stats.orthogonality_test(G, b) == pytest.approx(math.sqrt(v_orth / (4 * sq)))
    var = (1 * (G[0] - gbar) ** 2 + 3 * (G[1] - gbar) ** 2) / 1
    assert stats.gsnr(G, b) == pytest.approx(np.mean(gbar ** 2 / (var + 1e-5)))
    np.testing.assert_allclose(stats.cosines(G, b),
                               [g @ gbar / np.linalg.norm(g) / np.linalg.norm(gbar) for g in G])
    np.testing.assert_allclose(np.diag(stats.pairwise_cosines(G)), [1, 1])


def test_from_sums_equals_the_stack_estimate():
    Gs, b, _, _ = draws([3, 5, 9], 1)
    G = Gs[0]
    gbar = b @ G / b.sum()
    est = stats.from_sums(float(b @ np.sum(G ** 2, 1)), float(b.sum()), float(gbar @ gbar), 3)
    for got, want in zip(est, stats.noise_scale(G, b)):
        assert got == pytest.approx(want, rel=1e-9)


def test_flatten_keeps_only_touched_sparse_rows_and_their_dot_products():
    from hostavg import SparseGradient
    a = {"w": np.array([1.0, 2.0]), "e": SparseGradient([7, 7, 2], [[1.0], [1.0], [3.0]], (1000, 1))}
    c = {"w": np.array([0.0, 1.0]), "e": SparseGradient([2], [[4.0]], (1000, 1))}
    G, total = stats.flatten([a, c])
    assert total == 1002
    np.testing.assert_array_equal(G, [[1, 2, 3, 2], [0, 1, 4, 0]])  # rows 2 and 7, 7's summed


def test_noise_scale_tracker_bias_corrects_each_average():
    t = NoiseScale(beta=0.5)
    assert t.b_simple is None
    t.update(stats.NoiseScaleEstimate(g2=2.0, trace_sigma=10.0, b_simple=5.0))
    assert (t.g2, t.trace_sigma, t.b_simple) == (2.0, 10.0, 5.0)
    t.update(stats.NoiseScaleEstimate(g2=-1.0, trace_sigma=20.0, b_simple=-20.0))
    # Averages 0.25 * first + 0.5 * second, divided by 1 - 0.5^2; g2's comes to 0.
    assert t.trace_sigma == pytest.approx((0.25 * 10 + 0.5 * 20) / 0.75)
    assert t.g2 == pytest.approx((0.25 * 2 - 0.5 * 1) / 0.75)
    assert math.isnan(t.b_simple) and [s for s, _ in t.history] == [1, 2]
    assert t.nan_reason.startswith("the averaged |G|^2 (g2) is 0, not > 0: the micro-batches'")


def test_a_running_noise_scale_that_is_no_number_is_nan_with_its_reason_not_kept_as_one():
    """The first running estimate a researcher met was -1048.5: a g2 average below 0 makes no
    noise scale. It is NaN, with a reason, until the average is positive; then a number."""
    t = NoiseScale(beta=0.9)
    t.update(stats.NoiseScaleEstimate(g2=-0.002, trace_sigma=2.097, b_simple=-1048.5))
    assert math.isnan(t.b_simple) and math.isnan(t.history[-1][1])
    assert t.nan_reason == ("the averaged |G|^2 (g2) is -0.002, not > 0: the micro-batches' "
                            "spread still hides the mean gradient; it needs more steps, or more "
                            "samples per step")
    for _ in range(3):
        t.update(stats.NoiseScaleEstimate(g2=0.01, trace_sigma=1.0, b_simple=100.0))
    assert t.nan_reason is None and t.g2 > 0
    assert t.b_simple == pytest.approx(t.trace_sigma / t.g2) and t.history[-1][1] == t.b_simple
    t.update(stats.NoiseScaleEstimate(g2=math.inf, trace_sigma=1.0, b_simple=0.0))
    assert math.isnan(t.b_simple) and t.nan_reason.startswith("a step's estimate was not finite")


def test_estimators_refuse_one_micro_batch_and_bad_sizes():
    with pytest.raises(HostavgError, match="need at least 2 micro-batches, got 1"):
        stats.noise_scale(np.ones((1, 3)), [4])
    with pytest.raises(HostavgError, match=r"b must hold one size per row of G: shape \(2,\)"):
        stats.gsnr(np.ones((2, 3)), [4])
    with pytest.raises(HostavgError, match="b must be finite and > 0"):
        stats.cosines(np.ones((2, 3)), [4, 0])
    with pytest.raises(HostavgError, match="beta must be in"):
        NoiseScale(1.0)


def test_step_stats_pairwise_cosines_equal_brute_force_over_dense_blocks_and_sparse_rows():
    """Every pair of micro-batch gradients by explicit dot products over the dense gradients; a
    variable longer than one block, a sparse one with repeated rows, a micro-batch of norm 0."""
    from hostavg import Accumulator, SparseGradient, VariableSpec
    from hostavg.core.gradients import BLOCK
    rng = np.random.default_rng(3)
    spec = {"big": VariableSpec((BLOCK + 123,), np.dtype("float32"), False),
            "emb": VariableSpec((50, 2), np.dtype("float32"), True),
            "t": VariableSpec((), np.dtype("float32"), False)}

    def grads(zero=False):
        ids = rng.integers(0, 50, 6)
        ids[1] = ids[0]  # a row read twice
        scale = 0.0 if zero else 1.0
        return {"big": scale * rng.normal(size=BLOCK + 123).astype(np.float32),
                "emb": SparseGradient(ids, scale * rng.normal(size=(6, 2)).astype(np.float32),
                                      (50, 2)),
                "t": np.float32(scale * rng.normal())}

    stack = [grads(), grads(), grads(zero=True), grads()]
    acc = Accumulator(spec, accumulate="stack")
    for g, b in zip(stack, [3, 1, 2, 5]):
        acc.add(g, weight=b)
    st = stats.step_stats(acc.mean(), acc.weights, acc.sq_norms, [0.0] * 4, [0.0] * 4,
                          stack)
    dense = [np.concatenate([np.ravel(g["big"]), g["emb"].to_dense().ravel(), [g["t"]]])
             .astype(np.float64) for g in stack]
    want = np.full((4, 4), np.nan)
    for i in range(4):
        for j in range(4):
            if i != 2 and j != 2:
                want[i, j] = dense[i] @ dense[j] / np.linalg.norm(dense[i]) / np.linalg.norm(dense[j])
    got = st.pairwise_cosines
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.isnan(got[2]).all() and np.isnan(got[:, 2]).all()  # a gradient of norm 0
    assert not got.flags.writeable and got.dtype == np.float64
    np.testing.assert_allclose(got, stats.pairwise_cosines(stats.flatten(stack)[0]), rtol=1e-9)
    # From the mean as accumulated (float32 here): within its rounding, ~1e-7 of the sum.
    np.testing.assert_allclose(st.cosines_to_rest, rest_cosines(dense, [3, 1, 2, 5]), rtol=1e-6,
                               atol=1e-6)
    summed = Accumulator(spec)
    for g in stack[:2]:
        summed.add(g, weight=1)
    assert stats.step_stats(summed.mean(), summed.weights, summed.sq_norms, [0.0] * 2,
                            [0.0] * 2).pairwise_cosines is None  # "sum" mode keeps no stack
    one = stats.step_stats(acc.mean(), [1.0], [1.0], [0.0], [0.0], stack[:1])
    assert one.pairwise_cosines is None and one.cosines_to_rest is None


def rest_cosines(G, b) -> np.ndarray:
    """Brute force: each row against the b-weighted mean of the other rows (NaN at a norm 0)."""
    G, b = np.asarray(G, np.float64), np.asarray(b, np.float64)
    out = []
    for i in range(len(G)):
        others = [j for j in range(len(G)) if j != i]
        rest = b[others] @ G[others] / b[others].sum()
        norms = np.linalg.norm(G[i]) * np.linalg.norm(rest)
        out.append(G[i] @ rest / norms if norms else np.nan)
    return np.array(out)


def test_cosines_to_rest_equal_brute_force_and_a_dominant_row_is_not_its_own_mean():
    rng = np.random.default_rng(4)
    G, b = rng.normal(size=(6, D)), rng.uniform(1, 9, 6)
    np.testing.assert_allclose(stats.cosines_to_rest(G, b), rest_cosines(G, b), rtol=1e-10)
    # One row 1e4 times the others, against them: its cosine with the mean it makes is ~1,
    # with the others' mean -1; theirs with the rest (that row) is what each makes with it.
    G = np.vstack([-1e4 * np.ones(D), rng.normal(1, 0.1, (5, D))])
    got = stats.cosines_to_rest(G, np.ones(6))
    np.testing.assert_allclose(got, rest_cosines(G, np.ones(6)), rtol=1e-9)
    assert stats.cosines(G, np.ones(6))[0] > 0.99 and got[0] < -0.99
    assert (stats.cosines(G, np.ones(6)) >= got - 1e-12).all()  # the mean leans to each row
    # The others sum to 0: no direction to be against (and none a rounding error makes).
    assert np.isnan(stats.cosines_to_rest([[1.0, 2.0], [0.0, 0.0]], [1, 1])).all()
    got = stats.cosines_to_rest([[0.1, 0.3], [-0.2, -0.6], [3.0, 1.0]], [2, 1, 1])
    assert np.isnan(got[2]) and np.isfinite(got[:2]).all()
