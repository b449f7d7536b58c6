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
