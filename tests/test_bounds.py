"""The bounds of hostavg.core.bounds against the optimizers' own formulas, run in the
variables' dtype by NumPy (each operation rounded as the frameworks' kernels round it): from
states and gradients of every magnitude up to the dtype's largest, an apply the proof admits
leaves every value finite and within its bound, cancellation and rounding included; and the
proof refuses what it must (epsilon 0 in float16, a rate it cannot read, gradients whose
square overflows)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hostavg.core.bounds import SGD, Adam, UpdateBound, epsilon_in
from hostavg.core.gradients import SparseGradient, VariableSpec
from hostavg.engine.proof import Proof

N = 16


def adam(s, g, lr, rule, t, dtype):
    """Keras's Adam (TF1's kernel the same), in ``dtype``: s holds w, m, v (and vhat)."""
    c = lambda x: np.asarray(x, dtype)  # noqa: E731
    w = s["weight"]
    if rule.weight_decay:
        w = w - w * c(rule.weight_decay) * c(lr)
    m = s["m"] + (g - s["m"]) * c(1 - rule.beta_1)
    v = s["v"] + (g * g - s["v"]) * c(1 - rule.beta_2)
    out = {"m": m, "v": v}
    if rule.amsgrad:
        out["vhat"] = v = np.maximum(s["vhat"], v)
    alpha = c(lr * math.sqrt(1 - rule.beta_2 ** t) / (1 - rule.beta_1 ** t))
    out["weight"] = w - alpha * m / (np.sqrt(v) + c(rule.epsilon))
    return out


def sgd(s, g, lr, rule, t, dtype):
    """Keras's SGD (``rule.keras``) or TF1's GradientDescent and Momentum, in ``dtype``."""
    c = lambda x: np.asarray(x, dtype)  # noqa: E731
    w, mu, lr = s["weight"], c(rule.momentum), c(lr)
    if rule.weight_decay:
        w = w - w * c(rule.weight_decay) * lr
    if not rule.momentum:
        return {"weight": w - g * lr}
    if rule.keras:
        m = s["momentum"] * mu - g * lr
        return {"momentum": m, "weight": w + (m * mu - g * lr if rule.nesterov else m)}
    a = s["momentum"] * mu + g
    return {"momentum": a, "weight": w - (g * lr + a * mu * lr if rule.nesterov else lr * a)}


def magnitudes(state):
    return {r: float(np.max(np.abs(x.astype(np.float64)))) for r, x in state.items()}


def proof_for(rule, dtype, lr, sparse=False):
    roles = {"x": {r: r for r in ("weight", *rule.roles)}}
    return Proof(UpdateBound(rule, roles, lambda feed: lr),
                 {"x": VariableSpec((N, 1) if sparse else (N,), dtype, sparse)})


rules = st.one_of(
    st.builds(Adam,
              st.sampled_from([0.0, 0.5, 0.9, 0.99]), st.sampled_from([0.0, 0.9, 0.999]),
              st.sampled_from([1e-3, 1e-7]), st.booleans(), st.sampled_from([0.0, 0.1])),
    st.builds(SGD, st.sampled_from([0.0, 0.9, 0.99]), st.booleans(), st.booleans(),
              st.sampled_from([0.0, 0.1])))


@settings(max_examples=300, deadline=None)
@given(rule=rules, dtype=st.sampled_from([np.float32, np.float16]),
       scales=st.lists(st.floats(-6, 40), min_size=4, max_size=4),
       lr_exp=st.floats(-6, 2), seed=st.integers(0, 2 ** 16), steps=st.integers(1, 6))
def test_an_admitted_apply_stays_finite_and_within_its_bounds(rule, dtype, scales, lr_exp, seed,
                                                              steps):
    rng, lr, top = np.random.default_rng(seed), 10.0 ** lr_exp, float(np.finfo(dtype).max)
    if isinstance(rule, Adam):
        rule = rule._replace(epsilon=epsilon_in(rule.epsilon, [dtype]))
    update = adam if isinstance(rule, Adam) else sgd

    def draw(exp, positive=False):  # entries of about 10**exp, at most a 1/8th of the dtype's top
        x = rng.normal(size=N) * min(10.0 ** exp, top / 8)
        return np.abs(x).astype(dtype) if positive else x.astype(dtype)

    state = {"weight": draw(scales[0])}
    for role in rule.roles:
        state[role] = draw(scales[1 + (role != "m")], positive=role in ("v", "vhat"))
    if "vhat" in state:
        state["vhat"] = np.maximum(state["vhat"], state["v"])
    proof = proof_for(rule, dtype, lr)
    proof.applied({r: m for r, m in magnitudes(state).items()})
    for t in range(1, steps + 1):
        g = draw(scales[3] - t)
        sq = float(np.sum(g.astype(np.float64) ** 2))
        if not proof.proves({"x": g}, {"x": sq}, {}):
            return  # the device would check this one: nothing to hold
        with np.errstate(all="ignore"):
            state = update(state, g, lr, rule, t, dtype)
        proof.applied(None)
        for role, x in state.items():
            assert np.isfinite(x).all(), (role, t)
            assert float(np.max(np.abs(x.astype(np.float64)))) <= proof.bounds[role], (role, t)


def proven_after_measure(rule, dtype, g, lr=1e-3):
    proof = proof_for(rule, dtype, lr)
    proof.applied({r: 1.0 for r in ("weight", *rule.roles)})
    sq = float(np.sum(np.asarray(g, np.float64) ** 2))
    return proof.proves({"x": g}, {"x": sq}, {})


def test_float16_adam_with_an_epsilon_it_rounds_to_0_is_never_proven():
    eps = epsilon_in(1e-8, [np.float32, np.float16])
    assert eps == 0
    assert not proven_after_measure(Adam(0.9, 0.999, eps), np.float16, np.ones(N, np.float16))
    assert proven_after_measure(Adam(0.9, 0.999, epsilon_in(1e-8, [np.float32])), np.float32,
                                np.ones(N, np.float32))


def test_a_gradient_whose_square_passes_a_quarter_of_the_range_is_not_proven():
    rule = Adam(0.9, 0.999, 1e-7)
    assert proven_after_measure(rule, np.float32, np.full(N, 1e17, np.float32) / 4)
    assert not proven_after_measure(rule, np.float32, np.full(N, 1e19, np.float32))


def test_a_rate_the_backend_cannot_read_and_unknown_bounds_are_not_proven():
    proof = Proof(UpdateBound(SGD(), {"x": {"weight": "x"}}, lambda feed: None),
                  {"x": VariableSpec((N,), np.float32, False)})
    g = np.ones(N, np.float32)
    assert not proof.proves({"x": g}, {"x": float(N)}, {})  # never measured
    proof.applied({"x": 1.0})
    assert not proof.proves({"x": g}, {"x": float(N)}, {})  # no rate
    assert proof.bounds is not None


def test_a_sparse_gradient_s_rows_may_repeat_and_sum():
    """Rows given 4 times sum to 4x their value; the norm of the values alone is only 2x: the
    bound takes sqrt(rows) times it."""
    proof = proof_for(SGD(), np.float32, 1.0, sparse=True)
    proof.applied({"weight": 0.0})
    g = SparseGradient(np.zeros(4, np.int64), np.ones((4, 1), np.float32), (N, 1))
    assert proof.proves({"x": g}, {"x": 4.0}, {})
    proof.applied(None)
    assert proof.bounds["weight"] >= 4.0  # the dense row: 4


@pytest.mark.parametrize("every", [1, 3])
def test_after_every_proven_applies_one_measures(every):
    proof = proof_for(SGD(), np.float32, 1e-3)
    proof.every = every
    proof.applied({"weight": 1.0})
    g = np.ones(N, np.float32)
    seen = []
    for _ in range(2 * (every + 1)):
        ok = proof.proves({"x": g}, {"x": float(N)}, {})
        seen.append(ok)
        proof.applied(None if ok else {"weight": 1.0})
    assert seen == ([True] * every + [False]) * 2
