"""The plain steps keep their plans per signature: errors are still raised, outputs unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polylin import LinearAttentionState, delta_rule_step, prepare_delta_rule_step, step
from polylin.feature_maps import identity


def _token(seed: int = 0, d: int = 8) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 2, d))
    return q, k / np.linalg.norm(k, axis=-1, keepdims=True), v


def _delta_loop(q, k, v, beta, g):
    S = np.zeros((2, q.shape[-1], v.shape[-1]))
    for _ in range(3):
        S = np.exp(g)[:, :, None] * S
        S = S + k[:, :, None] * (beta * (v - np.einsum("hij,hi->hj", S, k)))[:, None, :]
        yield np.einsum("hij,hi->hj", S, q) * 0.5


def test_delta_rule_step_equals_the_loop_and_the_prepared_step_at_every_call():
    q, k, v = _token()
    beta, g = np.full((2, 1), 0.7), np.full((2, 1), -0.2)
    prepared, S, P = prepare_delta_rule_step(scale=0.5), None, None
    for want in _delta_loop(q, k, v, beta, g):
        o, S = delta_rule_step(q, k, v, beta, S, log_decay=g, scale=0.5)
        o_p, P = prepared(q, k, v, beta, P, log_decay=g)
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12)
        assert np.array_equal(o, o_p) and np.array_equal(S, P)


def test_delta_rule_step_checks_a_new_signature_or_option_after_a_kept_plan():
    q, k, v = _token()
    delta_rule_step(q, k, v, 0.5, scale=0.5)
    with pytest.raises(ValueError, match="beta_t"):  # a number's value is in the signature
        delta_rule_step(q, k, v, 3.0, scale=0.5)
    with pytest.raises(ValueError, match="v_t"):
        delta_rule_step(q, k, np.zeros((3, 8)), 0.5, scale=0.5)
    with pytest.raises(ValueError, match="scale"):
        delta_rule_step(q, k, v, 0.5, scale=math.inf)
    with pytest.raises(TypeError, match="qk_l2norm"):
        delta_rule_step(q, k, v, 0.5, scale=0.5, qk_l2norm=1)
    with pytest.raises(ValueError, match="log_decay"):
        delta_rule_step(q, k, v, 0.5, scale=0.5, log_decay=0.5)


def test_step_checks_a_new_signature_or_option_after_a_kept_plan():
    q, k, v = _token()
    o, state = step(q, k, v)
    o2, _ = step(q, k, v)
    assert np.array_equal(o, o2)
    with pytest.raises(ValueError, match="eps"):
        step(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match="state"):  # a state of another feature size
        step(q, k, v, LinearAttentionState(state.S[:, :4], state.z[:, :4]))
    with pytest.raises(TypeError):
        step(q, k, v.astype(np.float32))
    # polylin's own feature maps are kept by identity; the plan holds the right one
    o_id, _ = step(q, k, v, None, identity, normalize=False)
    np.testing.assert_allclose(o_id, np.einsum("hi,hi,hj->hj", q, k, v), rtol=1e-12)


def test_plan_cache_plans_once_per_signature_and_options():
    from polylin._inputs.steps import PlanCache

    planned = []

    def plan(*args):
        planned.append(args)
        return len(planned), "checked"

    cache, x = PlanCache(size=2), np.zeros((2, 3))
    assert cache.plan(plan, (x, 0.5), (None, 1.0)) == (1, "checked")
    assert cache.plan(plan, (np.ones((2, 3)), 0.5), (None, 1.0)) == (1, None)  # data: no
    assert cache.plan(plan, (x, 0.25), (None, 1.0)) == (2, "checked")  # a number's value
    assert cache.plan(plan, (x, 0.5), (None, True)) == (3, "checked")  # True is not 1.0
    assert cache.plan(plan, (x, 0.5), (None, 1.0)) == (4, "checked")  # evicted (size 2)
    assert cache.plan(plan, (x, 0.5), (identity, 1.0)) == (5, "checked")
    assert cache.plan(plan, (x, 0.5), (identity, 1.0)) == (5, None)  # polylin's map: kept
    def mine(y):
        return y
    assert cache.plan(plan, (x, 0.5), (mine, 1.0)) == (6, "checked")
    assert cache.plan(plan, (x, 0.5), (mine, 1.0)) == (7, "checked")  # the caller's: never
    assert cache.plan(plan, (x, [1]), (None, 1.0)) == (8, "checked")  # unknown argument
    assert cache.plan(plan, (x, [1]), (None, 1.0)) == (9, "checked")


def _dplr_loop(q, k, v, a, b, g):
    """float64 loop of ``S_t = diag(exp(g)) S + b (a^T S) + k v^T``, ``o_t = 0.5 S^T q``."""
    S = np.zeros((2, q.shape[-1], v.shape[-1]))
    for _ in range(3):
        read = np.einsum("hi,hij->hj", a, S)
        S = np.exp(g)[:, :, None] * S + b[:, :, None] * read[:, None, :]
        S = S + k[:, :, None] * v[:, None, :]
        yield np.einsum("hij,hi->hj", S, q) * 0.5


def test_dplr_delta_rule_step_equals_the_loop_and_the_prepared_step_at_every_call():
    from polylin import dplr_delta_rule_step, prepare_dplr_step

    q, k, v = _token(1)
    a, b, g = -k, 0.6 * k, np.linspace(-0.9, -0.05, 16).reshape(2, 8)
    prepared, S, P = prepare_dplr_step(scale=0.5), None, None
    for want in _dplr_loop(q, k, v, a, b, g):  # the second and third calls use the kept plan
        o, S = dplr_delta_rule_step(q, k, v, a, b, S, log_decay=g, scale=0.5)
        o_p, P = prepared(q, k, v, a, b, P, log_decay=g)
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12)
        assert np.array_equal(o, o_p) and np.array_equal(S, P)
    q32, k32, v32, a32, b32, g32 = (x.astype(np.float32) for x in (q, k, v, a, b, g))
    S32 = P32 = None
    prepared = prepare_dplr_step(scale=0.5)
    for want in _dplr_loop(q, k, v, a, b, g):  # a new dtype: a plan of its own
        o, S32 = dplr_delta_rule_step(q32, k32, v32, a32, b32, S32, log_decay=g32, scale=0.5)
        o_p, P32 = prepared(q32, k32, v32, a32, b32, P32, log_decay=g32)
        assert o.dtype == np.float32 and S32.dtype == np.float32
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)
        assert np.array_equal(o, o_p) and np.array_equal(S32, P32)


def test_dplr_delta_rule_step_checks_a_new_signature_or_option_after_a_kept_plan():
    from polylin import dplr_delta_rule_step

    q, k, v = _token(2)
    a, b = -k, 0.5 * k
    o, S = dplr_delta_rule_step(q, k, v, a, b, log_decay=-0.3, scale=0.5)
    o2, _ = dplr_delta_rule_step(q, k, v, a, b, log_decay=-0.3, scale=0.5)
    assert np.array_equal(o, o2)
    with pytest.raises(ValueError, match="log_decay"):  # a number's value is in the signature
        dplr_delta_rule_step(q, k, v, a, b, log_decay=0.5, scale=0.5)
    with pytest.raises(ValueError, match="v_t"):
        dplr_delta_rule_step(q, k, np.zeros((3, 8)), a, b, log_decay=-0.3, scale=0.5)
    with pytest.raises(ValueError, match="a_t"):
        dplr_delta_rule_step(q, k, v, a[:, :4], b, log_decay=-0.3, scale=0.5)
    with pytest.raises(ValueError, match="state"):
        dplr_delta_rule_step(q, k, v, a, b, S[:, :4], log_decay=-0.3, scale=0.5)
    with pytest.raises(TypeError, match="b_t"):
        dplr_delta_rule_step(q, k, v, a, b.astype(np.int64), log_decay=-0.3, scale=0.5)
    with pytest.raises(ValueError, match="scale"):
        dplr_delta_rule_step(q, k, v, a, b, log_decay=-0.3, scale=math.inf)


def test_dplr_delta_rule_step_checks_once_per_signature(monkeypatch):
    import polylin.dplr as dplr

    calls, plan = [], dplr._plan_step

    def counted(*args, **kwargs):
        calls.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(dplr, "_PLANS", type(dplr._PLANS)())
    monkeypatch.setattr(dplr, "_plan_step", counted)
    q, k, v = _token(3)
    S = None
    for _ in range(3):
        _, S = dplr.dplr_delta_rule_step(q, k, v, -k, 0.5 * k, S, log_decay=-0.3)
    assert len(calls) == 2  # a state of None, then the state's signature: kept after that
    dplr.dplr_delta_rule_step(q, k, v, -k, 0.5 * k, S, log_decay=-0.3, scale=2.0)
    assert len(calls) == 3
