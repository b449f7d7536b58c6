"""Layouts, the mask rule, errors that point at the cause, and decoding with finished rows.

- ``seq_axis``: ``(batch, T, heads, d)`` inputs with ``seq_axis=1`` give exactly the transposed
  result of ``(batch, heads, T, d)`` inputs, for every entry point, with masks, states and
  ``cu_seqlens``; the output keeps the input layout.
- Masks: a 2-D ``(batch, T)`` mask always means the first leading axis and the time axis (also
  when ``batch == heads``); any other mask has the full rank of ``q`` without its feature axis.
- ``step(..., attention_mask=)``: rows where it is False keep their state and output 0.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from polylin import (
    METHODS,
    LinearAttentionState,
    causal_linear_attention,
    linear_attention,
    masked_kernel_attention,
    step,
)
from polylin.feature_maps import favor_plus

from .reference import masked_kernel

B, H, T, D, DV = 2, 3, 9, 4, 5


def _bthd(rng, t=T):
    """q, k (B, T, H, D) and v (B, T, H, DV)."""
    q, k = rng.standard_normal((2, B, t, H, D))
    return q, k, rng.standard_normal((B, t, H, DV))


def _to_bhtd(x):
    return np.swapaxes(x, 1, 2)


def _padding(lengths, t=T, left=False):
    idx = np.arange(t)[None, :]
    n = np.asarray(lengths)[:, None]
    return idx >= t - n if left else idx < n


def _jit_or_call(backend, fn, *arrays, **kwargs):
    if backend.library == "jax.numpy" and kwargs.get("method") != "recurrent":
        import jax

        return jax.jit(functools.partial(fn, **kwargs))(*arrays)
    return fn(*arrays, **kwargs)


# -- seq_axis ---------------------------------------------------------------------------------
@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_seq_axis_bthd_with_mask_and_state(backend, method, rng):
    q, k, v = _bthd(rng)
    mask = _padding([T, 6], left=True)
    S0 = rng.standard_normal((B, H, D, DV))
    z0 = rng.random((B, H, D))
    state = LinearAttentionState(backend.from_numpy(S0), backend.from_numpy(z0))
    out, new = _jit_or_call(
        backend,
        causal_linear_attention,
        *(backend.from_numpy(x) for x in (q, k, v)),
        method=method,
        chunk_size=4,
        seq_axis=1,
        attention_mask=backend.from_numpy(mask),
        initial_state=state,
        return_state=True,
    )
    assert out.shape == (B, T, H, DV)
    assert new.S.shape == (B, H, D, DV) and new.z.shape == (B, H, D)
    expected, expected_state = causal_linear_attention(
        *(_to_bhtd(x) for x in (q, k, v)),
        attention_mask=mask[:, None, :],
        initial_state=LinearAttentionState(S0, z0),
        return_state=True,
    )
    np.testing.assert_allclose(backend.to_numpy(out), _to_bhtd(expected), rtol=0, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(new.S), expected_state.S, rtol=0, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(new.z), expected_state.z, rtol=0, atol=1e-10)


def test_seq_axis_other_entry_points(backend, rng):
    q, k, v = _bthd(rng)
    xs = [backend.from_numpy(x) for x in (q, k, v)]
    mask = _padding([T, 5])
    bhtd = [_to_bhtd(x) for x in (q, k, v)]
    out = _jit_or_call(
        backend, linear_attention, *xs, seq_axis=1, attention_mask=backend.from_numpy(mask)
    )
    expected = masked_kernel(*bhtd, causal=False, mask=mask[:, None, :])
    np.testing.assert_allclose(backend.to_numpy(out), _to_bhtd(expected), rtol=0, atol=1e-10)
    cross = _jit_or_call(backend, linear_attention, xs[0][:, :4, ...], *xs[1:], seq_axis=-3)
    expected = masked_kernel(bhtd[0][:, :, :4], *bhtd[1:], causal=False)
    np.testing.assert_allclose(backend.to_numpy(cross), _to_bhtd(expected), rtol=0, atol=1e-10)
    out = _jit_or_call(backend, masked_kernel_attention, *xs, seq_axis=1)
    np.testing.assert_allclose(
        backend.to_numpy(out), _to_bhtd(masked_kernel(*bhtd)), rtol=0, atol=1e-10
    )


def test_seq_axis_first_and_cu_seqlens(backend, rng):
    """(T, batch, d) with seq_axis=0, and packed sequences along seq_axis=1 of (B, T, H, D)."""
    q, k, v = rng.standard_normal((3, T, 2, D))
    out = _jit_or_call(
        backend, causal_linear_attention, *(backend.from_numpy(x) for x in (q, k, v)), seq_axis=0
    )
    expected = masked_kernel(*(np.swapaxes(x, 0, 1) for x in (q, k, v)))
    np.testing.assert_allclose(
        backend.to_numpy(out), np.swapaxes(expected, 0, 1), rtol=0, atol=1e-10
    )
    q, k, v = _bthd(rng)
    offsets = [0, 4, 5, T]
    out, states = _jit_or_call(
        backend,
        causal_linear_attention,
        *(backend.from_numpy(x) for x in (q, k, v)),
        seq_axis=1,
        cu_seqlens=offsets,
        return_state=True,
    )
    assert out.shape == (B, T, H, DV) and states.S.shape == (B, H, 3, D, DV)
    got = backend.to_numpy(out)
    for a, b in itertools.pairwise(offsets):
        piece = masked_kernel(*(_to_bhtd(x[:, a:b]) for x in (q, k, v)))
        np.testing.assert_allclose(got[:, a:b], _to_bhtd(piece), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("seq_axis", "error", "message"),
    [
        (-1, ValueError, r"^seq_axis=-1 is the feature axis of q \(shape \(2, 9, 3, 4\)\)"),
        (3, ValueError, r"^seq_axis=3 is the feature axis"),
        (4, ValueError, r"^seq_axis=4 is out of range for q with 4 dimensions"),
        (-5, ValueError, r"^seq_axis=-5 is out of range"),
        (1.0, TypeError, r"^seq_axis must be an int, got float"),
        (True, TypeError, r"^seq_axis must be an int, got bool"),
    ],
)
def test_seq_axis_errors(seq_axis, error, message, rng):
    xs = _bthd(rng)
    for fn in (causal_linear_attention, linear_attention, masked_kernel_attention):
        with pytest.raises(error, match=message):
            fn(*xs, seq_axis=seq_axis)


def test_seq_axis_numpy_integer(rng):
    q, k, v = _bthd(rng)
    out = causal_linear_attention(q, k, v, seq_axis=np.int64(1))
    expected = masked_kernel(*(_to_bhtd(x) for x in (q, k, v)))
    np.testing.assert_allclose(out, _to_bhtd(expected), rtol=0, atol=1e-10)


# -- the mask rule ----------------------------------------------------------------------------
@pytest.mark.slow_grid
@pytest.mark.parametrize("seq_axis", [-2, 1])
def test_2d_mask_means_batch_and_time_when_batch_equals_heads(backend, seq_axis, rng):
    """B == H: a (B, T) mask is per sequence, never per head, in either layout."""
    n = 3
    q, k, v = rng.standard_normal((3, n, n, T, D))  # (B, H, T, D), B == H
    mask = _padding([T, 5, 2], left=True)
    expected = np.zeros_like(v)
    for b in range(n):
        idx = np.flatnonzero(mask[b])
        expected[b][:, idx] = masked_kernel(q[b][:, idx], k[b][:, idx], v[b][:, idx])
    if seq_axis == 1:
        q, k, v = (_to_bhtd(x) for x in (q, k, v))
    m = backend.from_numpy(mask)
    xs = [backend.from_numpy(x) for x in (q, k, v)]
    out = backend.to_numpy(
        _jit_or_call(backend, causal_linear_attention, *xs, attention_mask=m, seq_axis=seq_axis)
    )
    if seq_axis == 1:
        out = _to_bhtd(out)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-10)
    # the full-rank equivalents: (B, 1, T) and (B, H, T) for (B, H, T, D); (B, T, 1) for seq_axis=1
    full = mask[:, None, :] if seq_axis == -2 else mask[:, :, None]
    for m in (full, np.broadcast_to(full, q.shape[:-1]).copy()):
        again = _jit_or_call(
            backend,
            causal_linear_attention,
            *xs,
            attention_mask=backend.from_numpy(m),
            seq_axis=seq_axis,
        )
        got = backend.to_numpy(again)
        np.testing.assert_allclose(got if seq_axis == -2 else _to_bhtd(got), expected, atol=1e-10)


def test_per_head_mask_is_full_rank(backend, rng):
    """A mask that differs per head is written with the full rank (size-1 batch axis)."""
    q, k, v = rng.standard_normal((3, B, H, T, D))
    head_mask = _padding([T, 4, 7])  # (H, T): one row per head
    out = _jit_or_call(
        backend,
        causal_linear_attention,
        *(backend.from_numpy(x) for x in (q, k, v)),
        attention_mask=backend.from_numpy(head_mask[None]),
    )
    expected = masked_kernel(q, k, v, mask=np.broadcast_to(head_mask, (B, H, T)))
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("shape", "seq_axis", "q_shape", "message"),
    [
        # (H, T) meant per head for (B, H, T, D) with B != H: not silently broadcast
        ((H, T), -2, (B, H, T, D), r"\(batch, T\) = \(2, 9\) or .* \(2, 3, 9\) .*; got \(3, 9\)"),
        ((T,), -2, (B, H, T, D), r"got \(9,\)"),
        ((B, T, 1), -2, (B, H, T, D), r"got \(2, 9, 1\)"),
        (
            (B, 1, T),
            1,
            (B, T, H, D),
            r"\(batch, T\) = \(2, 9\) or .* \(2, 9, 3\) .*; got \(2, 1, 9\)",
        ),
        ((T, B), -2, (B, T, D), r"^attention_mask must have shape \(batch, T\) = \(2, 9\) "),
        ((1, T), -2, (T, D), r"^attention_mask must have shape \(T,\) = \(9,\); got \(1, 9\)"),
        ((B, H, T - 1), -2, (B, H, T, D), r"got \(2, 3, 8\)"),
    ],
)
def test_mask_fitting_no_rule_is_an_error(shape, seq_axis, q_shape, message):
    q = np.zeros(q_shape)
    mask = np.ones(shape, dtype=bool)
    for fn in (causal_linear_attention, linear_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, q, q, attention_mask=mask, seq_axis=seq_axis)


# -- step: errors that point at the cause, finished rows --------------------------------------
def test_step_token_with_its_time_axis(rng):
    q, k, v = rng.standard_normal((3, B, H, T, D))
    _, state = causal_linear_attention(q, k, v, return_state=True)
    token = [x[..., -1:, :] for x in (q, k, v)]  # (B, H, 1, D): the T axis kept
    with pytest.raises(
        ValueError,
        match=r"^q_t must have shape \(\.\.\., d\) for one token .*"
        r"got \(2, 3, 1, 4\) for a state with leading dimensions \(2, 3\)",
    ):
        step(*token, state)


def test_step_with_another_feature_map(rng):
    q, k, v = rng.standard_normal((3, B, T, D))
    phi = favor_plus(D, num_features=16, seed=0)
    _, state = causal_linear_attention(q, k, v, phi, return_state=True)
    with pytest.raises(
        ValueError,
        match=r"^state was built with a feature map of 16 features, "
        r"but feature_map gives 4 .* pass the same feature_map",
    ):
        step(q[:, 0], k[:, 0], v[:, 0], state)
    _, state = causal_linear_attention(q, k, v, return_state=True)
    with pytest.raises(ValueError, match=r"^initial_state was built with a feature map of 4 "):
        causal_linear_attention(q, k, v, phi, initial_state=state)
    assert step(q[:, 0], k[:, 0], v[:, 0], state)[0].shape == (B, D)  # the same map: fine


def test_step_mask_keeps_finished_rows(backend, rng):
    _, state = causal_linear_attention(*rng.standard_normal((3, B, H, T, D)), return_state=True)
    state = LinearAttentionState(*(backend.from_numpy(s) for s in state))
    token = rng.standard_normal((3, B, H, D))
    token[:, 1] = np.nan  # a finished row's inputs may be anything
    xs = [backend.from_numpy(x) for x in token]
    for mask in (np.array([True, False]), np.array([[True], [False]])):  # (B,) and (B, 1)
        o_t, new = _jit_or_call(backend, step, *xs, state, attention_mask=backend.from_numpy(mask))
        o_t = backend.to_numpy(o_t)
        assert np.all(o_t[1] == 0.0)
        for old, now in zip(state, new):
            np.testing.assert_array_equal(backend.to_numpy(now)[1], backend.to_numpy(old)[1])
        full, full_state = step(
            *(x[:1, ...] for x in xs), LinearAttentionState(*(s[:1, ...] for s in state))
        )
        np.testing.assert_allclose(o_t[:1], backend.to_numpy(full), rtol=0, atol=1e-12)
        np.testing.assert_allclose(
            backend.to_numpy(new.S)[:1], backend.to_numpy(full_state.S), rtol=0, atol=1e-12
        )


def test_step_mask_per_head_and_errors(backend, rng):
    token = [backend.from_numpy(x) for x in rng.standard_normal((3, B, H, D))]
    mask = np.array([[True, False, True], [False, False, True]])  # (B, H)
    o_t, state = step(*token, attention_mask=backend.from_numpy(mask))
    o_t, S = backend.to_numpy(o_t), backend.to_numpy(state.S)
    assert np.all(o_t[~mask] == 0.0) and np.all(S[~mask] == 0.0)
    assert np.all(o_t[mask] != 0.0)
    for bad in (np.ones(H, bool), np.ones((B, H, 1), bool), np.ones((H, B), bool)):
        with pytest.raises(
            ValueError,
            match=r"^attention_mask of a decoding step must have "
            r"the batch shape of q_t, \(2, 3\)",
        ):
            step(*token, attention_mask=backend.from_numpy(bad))


# -- traced options under jax.jit -------------------------------------------------------------
@pytest.mark.parametrize("option", ["chunk_size", "eps", "seq_axis"])
def test_traced_option_must_be_static(option):
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    q = jnp.ones((2, 8, 4))
    value = {"chunk_size": 4, "eps": 1e-6, "seq_axis": -2}[option]

    def f(q, value):
        return causal_linear_attention(q, q, q, **{option: value})

    with pytest.raises(
        TypeError,
        match=rf"^{option} must be static under jax.jit.*"
        r"static_argnames.*functools.partial",
    ):
        jax.jit(f)(q, value)
    out = jax.jit(f, static_argnames="value")(q, value)  # static: fine
    assert out.shape == (2, 8, 4)
