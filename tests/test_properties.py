"""Property-based tests: random shapes, chunk sizes and splits, every method."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import polylin
from polylin import causal_linear_attention, linear_attention

from .reference import masked_kernel

lead_dims = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


@st.composite
def problems(draw):
    lead = draw(lead_dims)
    T = draw(st.integers(0, 40))
    d_k, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    q, k = scale * rng.standard_normal((2, *lead, T, d_k))
    v = rng.standard_normal((*lead, T, d_v))
    return q, k, v


@settings(max_examples=60, deadline=None)
@given(problem=problems(), method=st.sampled_from(polylin.METHODS), chunk=st.integers(1, 50))
def test_any_shape_matches_reference(problem, method, chunk):
    q, k, v = problem
    out = causal_linear_attention(q, k, v, method=method, chunk_size=chunk)
    assert out.shape == v.shape
    np.testing.assert_allclose(out, masked_kernel(q, k, v), rtol=0, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(problem=problems(), chunk=st.integers(1, 16), data=st.data())
def test_any_split_with_state(problem, chunk, data):
    q, k, v = problem
    T = q.shape[-2]
    split = data.draw(st.integers(0, T))
    method = data.draw(st.sampled_from(polylin.METHODS))
    opts = {"method": method, "chunk_size": chunk}
    first, state = causal_linear_attention(
        q[..., :split, :], k[..., :split, :], v[..., :split, :], return_state=True, **opts
    )
    second = causal_linear_attention(
        q[..., split:, :], k[..., split:, :], v[..., split:, :], initial_state=state, **opts
    )
    whole = causal_linear_attention(q, k, v, **opts)
    np.testing.assert_allclose(np.concatenate([first, second], axis=-2), whole, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(problem=problems(), t_q=st.integers(1, 12))
def test_noncausal_any_shape(problem, t_q):
    q, k, v = problem
    q = np.resize(q, (*q.shape[:-2], t_q, q.shape[-1]))
    out = linear_attention(q, k, v)
    assert out.shape == (*v.shape[:-2], t_q, v.shape[-1])
    np.testing.assert_allclose(out, masked_kernel(q, k, v, causal=False), rtol=0, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(problem=problems())
def test_outputs_are_convex_combinations(problem):
    """Positive weights summing to (almost) one: every output lies within the values' range."""
    q, k, v = problem
    if q.shape[-2] == 0:
        return
    out = causal_linear_attention(q, k, v)
    running_max = np.maximum.accumulate(v, axis=-2)
    running_min = np.minimum.accumulate(v, axis=-2)
    slack = 1e-9 + 1e-5 * np.abs(v).max()  # eps pulls outputs slightly towards zero
    assert np.all(out <= np.maximum(running_max, 0) + slack)
    assert np.all(out >= np.minimum(running_min, 0) - slack)
