"""The gated delta rule at model parity: per-channel gates (KDA), grouped heads, ``scale``,
``qk_l2norm`` and the quadratic form, against an independent float64 recurrence written here.

The reference is the loop of the formulas (``g_t`` per channel, or one per token broadcast to
every channel)::

    S'_t = diag(exp(g_t)) S_{t-1}
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T        o_t = scale * S_t^T q_t

with ``q, k`` first normalized as ``x / sqrt(sum(x^2) + 1e-6)`` when ``qk_l2norm``, and every
leading dimension broadcast by NumPy's rules (grouped heads: ``q, k`` of ``(B, H, 1, T, d_k)``,
``v, beta, g`` of ``(B, H, G, T, ...)``).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

import polylin
import polylin._forms.delta.chunked
from polylin import delta_rule_attention, delta_rule_step
from polylin.testing import Backend

from .test_delta_rule import close, is_jax, needs, run, unit

B, H, T, D_K, D_V, CHUNK = 2, 2, 13, 6, 5, 4
ATOL64 = 1e-10
OPTIONS = [(False, 1.0), (False, 0.35), (True, 1.0), (True, 0.35)]  # (qk_l2norm, scale)


def l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def reference(
    q, k, v, beta, g=None, *, state=None, mask=None, scale=1.0, qk_l2norm=False
):  # fmt: skip
    """Outputs and final state of the recurrence, float64, by a loop over every leading index.

    ``beta`` is ``(..., T, 1)`` or a float; ``g`` ``(..., T, 1 or d_k)``, a float or None;
    ``mask`` ``(..., T)`` (a masked token changes nothing and outputs 0).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if qk_l2norm:
        q, k = l2(q), l2(k)
    length, d_k, d_v = k.shape[-2], k.shape[-1], v.shape[-1]
    beta = np.asarray(beta, np.float64).reshape(np.shape(beta) or (1, 1))
    g = np.zeros((1, 1)) if g is None else np.asarray(g, np.float64).reshape(np.shape(g) or (1, 1))
    leads = [x.shape[:-2] for x in (q, k, v, beta, g)]
    if mask is not None:
        leads.append(np.shape(mask)[:-1])
    if state is not None:
        leads.append(np.shape(state)[:-2])
    lead = np.broadcast_shapes(*leads)
    q, k = (np.broadcast_to(x, (*lead, length, d_k)) for x in (q, k))
    v = np.broadcast_to(v, (*lead, length, d_v))
    beta = np.broadcast_to(beta, (*lead, length, 1))
    g = np.broadcast_to(g, (*lead, length, g.shape[-1]))
    keep = (
        np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    )
    S = np.zeros((*lead, d_k, d_v))
    if state is not None:
        S = np.array(np.broadcast_to(state, (*lead, d_k, d_v)), np.float64)
    out = np.zeros((*lead, length, d_v))
    for index in np.ndindex(*lead):
        s = S[index]
        for t in range(length):
            if not keep[index][t]:
                continue
            kt = k[index][t]
            decayed = np.exp(g[index][t])[:, None] * s
            s = decayed + beta[index][t, 0] * np.outer(kt, v[index][t] - decayed.T @ kt)
            out[index][t] = scale * (s.T @ q[index][t])
        S[index] = s
    return out, S


def grouped_inputs(rng, groups, gate, length=T, d_k=D_K, d_v=D_V, strength=0.7):
    """``q, k`` of ``(B, H, 1, T, d_k)`` (or ``(B, H, T, d_k)`` without groups) and
    ``v, beta, g`` of ``(B, H, G, T, ...)``; ``gate``: "none", "token" or "channel"."""
    key_lead = (B, H) if groups is None else (B, H, 1)
    lead = (B, H) if groups is None else (B, H, groups)
    q = rng.standard_normal((*key_lead, length, d_k))
    k = unit(rng.standard_normal((*key_lead, length, d_k))) * rng.uniform(0.5, 1.5)
    v = rng.standard_normal((*lead, length, d_v))
    beta = rng.uniform(0.1, 1.0, (*lead, length, 1))
    width = {"none": 0, "token": 1, "channel": d_k}[gate]
    g = None if not width else -rng.uniform(0.0, strength, (*lead, length, width))
    return q, k, v, beta, g


def delta(q, k, v, beta=None, **options):
    return delta_rule_attention(q, k, v, beta, **options)


@pytest.mark.slow_grid(cover=("method", "gate"))
@pytest.mark.parametrize("qk_l2norm, scale", OPTIONS)
@pytest.mark.parametrize("groups", [None, 2, 4])
@pytest.mark.parametrize("gate", ["none", "token", "channel"])
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_matches_reference(backend, rng, method, gate, groups, qk_l2norm, scale):
    q, k, v, beta, g = grouped_inputs(rng, groups, gate)
    if not qk_l2norm:
        k = unit(k)  # unnormalized keys with beta |k|^2 > 2 make the recurrence itself unstable
    want, want_state = reference(q, k, v, beta, g, scale=scale, qk_l2norm=qk_l2norm)
    out, state = run(
        backend, delta, q, k, v, beta=beta, log_decay=g, method=method, chunk_size=CHUNK,
        scale=scale, qk_l2norm=qk_l2norm, return_state=True,
    )  # fmt: skip
    assert tuple(out.shape) == want.shape and tuple(state.shape) == want_state.shape
    close(backend, out, want)
    close(backend, state, want_state)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
@pytest.mark.parametrize("gate", ["token", "channel"])
def test_any_chunk_size_and_blocks(rng, monkeypatch, chunk_size, gate):
    """Chunk lengths that are not powers of two are rounded up; blocks of one chunk too, each
    scaling its own queries."""
    monkeypatch.setattr(polylin._forms.delta.chunked, "BLOCK_ROWS", 8)
    q, k, v, beta, g = grouped_inputs(rng, 2, gate, length=37)
    want, want_state = reference(q, k, v, beta, g, scale=0.35)
    out, state = delta_rule_attention(
        q, k, v, beta, log_decay=g, chunk_size=chunk_size, scale=0.35, return_state=True
    )
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("first, second", list(itertools.permutations(polylin.DELTA_METHODS, 2)))
def test_split_and_resume_per_channel_grouped(backend, rng, first, second):
    q, k, v, beta, g = grouped_inputs(rng, 2, "channel")
    S0 = rng.standard_normal((B, H, 2, D_K, D_V))
    want, want_state = reference(q, k, v, beta, g, state=S0, scale=0.5, qk_l2norm=True)
    cut = 6
    parts = [[x[..., a:b, :] for x in (q, k, v, beta, g)] for a, b in ((0, cut), (cut, T))]
    options = dict(chunk_size=CHUNK, return_state=True, scale=0.5, qk_l2norm=True)
    (q1, k1, v1, b1, g1), (q2, k2, v2, b2, g2) = parts
    out1, S1 = run(backend, delta, q1, k1, v1, beta=b1, log_decay=g1, initial_state=S0,
                   method=first, **options)  # fmt: skip
    out2, S2 = run(backend, delta, q2, k2, v2, beta=b2, log_decay=g2,
                   initial_state=backend.to_numpy(S1), method=second, **options)  # fmt: skip
    close(backend, out1, want[..., :cut, :])
    close(backend, out2, want[..., cut:, :])
    close(backend, S2, want_state)


@pytest.mark.slow_grid
@pytest.mark.parametrize("gate", ["token", "channel"])
def test_step_after_a_chunked_prefill(backend, rng, gate):
    q, k, v, beta, g = grouped_inputs(rng, 4, gate)
    options = dict(scale=0.5, qk_l2norm=True)
    want, want_state = reference(q, k, v, beta, g, **options)
    prefill = T - 4
    head = [x[..., :prefill, :] for x in (q, k, v, beta, g)]
    out, S = run(backend, delta, *head[:3], beta=head[3], log_decay=head[4],
                 chunk_size=CHUNK, return_state=True, **options)  # fmt: skip
    close(backend, out, want[..., :prefill, :])
    step = functools.partial(delta_rule_step, **options)
    if is_jax(backend):
        import jax

        step = jax.jit(step)
    for t in range(prefill, T):
        x = [backend.from_numpy(a[..., t, :]) for a in (q, k, v, beta, g)]
        o_t, S = step(*x[:4], S, log_decay=x[4])
        assert tuple(o_t.shape) == (B, H, 4, D_V)
        close(backend, o_t, want[..., t, :])
    close(backend, S, want_state)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_padding_left_and_right(backend, rng, method):
    """NaN at masked positions, a (B, T) mask with grouped heads and a per-channel gate."""
    q, k, v, beta, g = grouped_inputs(rng, 2, "channel")
    mask = np.ones((B, T), bool)
    mask[0, :5] = False
    mask[1, 9:] = False
    want, want_state = reference(q, k, v, beta, g, mask=mask[:, None, None, :], qk_l2norm=True)
    m5 = mask[:, None, None, :, None]
    padded = [np.where(m5, x, np.nan) for x in (q, k, v, beta, g)]
    out, state = run(backend, delta, *padded[:3], beta=padded[3], log_decay=padded[4],
                     attention_mask=mask, method=method, chunk_size=CHUNK, qk_l2norm=True,
                     return_state=True)  # fmt: skip
    got = backend.to_numpy(out)
    assert np.all(got[np.broadcast_to(~mask[:, None, None, :], got.shape[:-1])] == 0)
    np.testing.assert_allclose(got, want, atol=ATOL64, rtol=0)
    close(backend, state, want_state)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_cu_seqlens_per_channel(backend, rng, method):
    offsets = [0, 5, 5, 11, T]
    q, k, v, beta, g = grouped_inputs(rng, 2, "channel")
    n = len(offsets) - 1
    S0 = rng.standard_normal((B, H, 2, n, D_K, D_V))
    out, state = run(backend, delta, q, k, v, beta=beta, log_decay=g, initial_state=S0,
                     cu_seqlens=offsets, method=method, chunk_size=CHUNK,
                     return_state=True)  # fmt: skip
    got, got_state = backend.to_numpy(out), backend.to_numpy(state)
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        piece = [x[..., a:b, :] for x in (q, k, v, beta, g)]
        want, want_state = reference(*piece, state=S0[..., i, :, :])
        np.testing.assert_allclose(got[..., a:b, :], want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(got_state[..., i, :, :], want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("gate", ["token", "channel"])
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_minus_inf_gate_resets(backend, rng, method, gate):
    """A log decay of -inf (every channel) erases the state: rows before it are those of the
    unreset sequence, rows from it on those of a sequence starting there from zero."""
    q, k, v, beta, g = grouped_inputs(rng, 2, gate, length=16)
    reset = 6  # inside the second chunk of 4
    g_reset = g.copy()
    g_reset[..., reset, :] = -np.inf
    S0 = rng.standard_normal((B, H, 2, D_K, D_V))
    options = dict(method=method, chunk_size=CHUNK, return_state=True)
    out, state = run(backend, delta, q, k, v, beta=beta, log_decay=g_reset,
                     initial_state=S0, **options)  # fmt: skip
    got = backend.to_numpy(out)
    assert np.isfinite(got).all()
    unreset, _ = reference(q, k, v, beta, g, state=S0)
    fresh, fresh_state = reference(*(x[..., reset:, :] for x in (q, k, v, beta, g)))
    np.testing.assert_allclose(got[..., :reset, :], unreset[..., :reset, :], atol=ATOL64, rtol=0)
    np.testing.assert_allclose(got[..., reset:, :], fresh, atol=ATOL64, rtol=0)
    close(backend, state, fresh_state)


def test_minus_inf_in_some_channels(rng):
    """Per channel, -inf erases those rows of the state only (the reference's exp(-inf) = 0)."""
    q, k, v, beta, g = grouped_inputs(rng, 2, "channel", length=16)
    g[..., 5, :3] = -np.inf
    g[..., 11, 4] = -np.inf
    want, want_state = reference(q, k, v, beta, g)
    for method in polylin.DELTA_METHODS:
        out, state = delta_rule_attention(
            q, k, v, beta, log_decay=g, method=method, chunk_size=CHUNK, return_state=True
        )
        np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0, err_msg=method)
        np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0, err_msg=method)


def _strong_gates(rng, length, d, gate):
    """Log decays from 0 down to -30 per token (and channel), some stretches of -30, one -1e4."""
    width = d if gate == "channel" else 1
    g = -30.0 * rng.uniform(0, 1, (1, length, width)) ** 6
    g[:, length // 3 : length // 3 + 40] = 0.0
    g[:, 100:104] = -30.0
    g[:, 200] = -1e4
    return g


def _float32_case(rng, length, gate, d=16, chunk_size=64, library="numpy"):
    q = rng.standard_normal((1, length, d))
    k = unit(rng.standard_normal((1, length, d)))
    v = rng.standard_normal((1, length, d))
    beta = rng.uniform(0.05, 1.0, (1, length, 1))
    g = _strong_gates(rng, length, d, gate)
    args = [x.astype(np.float32).astype(np.float64) for x in (q, k, v, beta, g)]
    want, want_state = reference(*args)
    inputs = [x.astype(np.float32) for x in args]
    if library == "torch":  # its own path: A factored and one triangular solve (scalar gate)
        torch = pytest.importorskip("torch")
        inputs = [torch.from_numpy(x) for x in inputs]
    out, state = delta_rule_attention(
        *inputs[:4], log_decay=inputs[4], chunk_size=chunk_size, return_state=True
    )
    out, state = np.asarray(out), np.asarray(state)
    assert out.dtype == np.float32
    error = np.abs(out - want).max() / np.abs(want).max()
    state_error = np.abs(state - want_state).max() / np.abs(want_state).max()
    return error, state_error


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("gate", ["token", "channel"])
def test_float32_strong_gates(rng, gate, library):
    """float32 within 1e-5 relative of float64 at T = 8192 with gates down to -30 per token and
    channel (and one of -1e4, where every factor underflows)."""
    error, state_error = _float32_case(rng, 8192, gate, library=library)
    assert error < 1e-5 and state_error < 1e-5, (error, state_error)


@pytest.mark.slow
@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("gate", ["token", "channel"])
def test_float32_strong_gates_65536(rng, gate, library):
    error, state_error = _float32_case(rng, 65536, gate, library=library)
    assert error < 1e-5 and state_error < 1e-5, (error, state_error)


def test_issue_reproducer_gate_minus_1e4_per_token():
    """Every 64th token a gate of -1e4, the rest -0.01: float32 within 1e-5 of float64."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 512, 16))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.full((1, 512, 1), -0.01)
    g[:, ::64] = -1e4
    want, _ = reference(q, k, v, 0.5, g)
    for method in ("chunked", "quadratic"):
        out = delta_rule_attention(
            *(x.astype("f4") for x in (q, k, v)), 0.5, log_decay=g.astype("f4"), method=method
        )
        assert np.abs(out - want).max() / np.abs(want).max() < 1e-5, method


@pytest.mark.parametrize("gate", ["token", "channel"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_accumulates_in_float32(rng, gate, dtype):
    torch = needs(Backend.TORCH)
    from .reference import rounded

    q, k, v, beta, g = grouped_inputs(rng, 2, gate, length=70)
    inputs = [rounded(x, dtype) for x in (q, unit(k), v, beta, g)]
    want, want_state = reference(*inputs, scale=0.5, qk_l2norm=True)
    xs = [Backend.TORCH.from_numpy(x, dtype) for x in inputs]
    out, state = delta_rule_attention(
        *xs[:4], log_decay=xs[4], scale=0.5, qk_l2norm=True, return_state=True
    )
    assert out.dtype == getattr(torch, dtype) and state.dtype == torch.float32
    # the output is rounded once to the half dtype; the state stays float32
    atol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]
    np.testing.assert_allclose(out.float().numpy(), want, atol=atol, rtol=0)
    np.testing.assert_allclose(state.numpy(), want_state, atol=2e-5, rtol=0)


GRAD_T = 7  # two chunks of 4, the second partial


def _grad_inputs(rng, gate):
    """Small float64 inputs (one batch, one key head, two value heads) for finite differences."""
    q = rng.standard_normal((1, 1, 1, GRAD_T, 4))
    k = unit(rng.standard_normal((1, 1, 1, GRAD_T, 4)))
    v = rng.standard_normal((1, 1, 2, GRAD_T, 3))
    beta = rng.uniform(0.1, 1.0, (1, 1, 2, GRAD_T, 1))
    width = {"none": 0, "token": 1, "channel": 4}[gate]
    g = -rng.uniform(0.0, 0.7, (1, 1, 2, GRAD_T, width)) if width else None
    S0 = rng.standard_normal((1, 1, 2, 4, 3))
    return [x for x in (q, k, v, beta, g, S0) if x is not None]


@pytest.mark.parametrize("qk_l2norm", [False, True])
@pytest.mark.parametrize("gate", ["none", "token", "channel"])
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_gradcheck_torch(rng, method, gate, qk_l2norm):
    """``torch.autograd.gradcheck`` (float64 finite differences) wrt q, k, v, beta, the gate
    and the initial state, grouped heads, scale."""
    torch = needs(Backend.TORCH)
    arrays = _grad_inputs(rng, gate)
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    weight = torch.tensor(rng.standard_normal((1, 1, 2, GRAD_T, 3)))

    def loss(*xs):
        q, k, v, beta, *rest = xs
        g, S0 = (None, rest[0]) if len(rest) == 1 else rest
        out, state = delta_rule_attention(
            q, k, v, beta, log_decay=g, initial_state=S0, method=method, chunk_size=4,
            scale=0.7, qk_l2norm=qk_l2norm, return_state=True,
        )  # fmt: skip
        return (out * weight).sum() + (state * state).sum()

    assert torch.autograd.gradcheck(loss, xs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate", ["token", "channel"])
def test_gradients_jax_against_finite_differences(rng, gate):
    """``jax.grad`` under ``jax.jit`` of every method: the directional derivative along a
    random direction equals central differences of the float64 reference loop."""
    needs(Backend.JAX)
    import jax

    arrays = _grad_inputs(rng, gate)
    weight = rng.standard_normal((1, 1, 2, GRAD_T, 3))
    direction = [rng.standard_normal(a.shape) for a in arrays]

    def ref_loss(xs):
        q, k, v, beta, g, S0 = xs
        out, state = reference(q, k, v, beta, g, state=S0, scale=0.7, qk_l2norm=True)
        return (out * weight).sum() + (state * state).sum()

    h = 1e-5
    plus = ref_loss([a + h * u for a, u in zip(arrays, direction)])
    minus = ref_loss([a - h * u for a, u in zip(arrays, direction)])
    want = (plus - minus) / (2 * h)
    xs = [Backend.JAX.from_numpy(a) for a in arrays]
    for method in polylin.DELTA_METHODS:

        def loss(q, k, v, beta, g, S0, method=method):
            out, state = delta_rule_attention(
                q, k, v, beta, log_decay=g, initial_state=S0, method=method, chunk_size=4,
                scale=0.7, qk_l2norm=True, return_state=True,
            )  # fmt: skip
            return (out * weight).sum() + (state * state).sum()

        grad = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*xs)
        got = sum(float(np.sum(np.asarray(a) * u)) for a, u in zip(grad, direction))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=method)


def test_gradients_finite_through_a_reset(rng):
    torch = needs(Backend.TORCH)
    arrays = _grad_inputs(rng, "channel")
    arrays[4][..., 4, :] = -np.inf
    for method in polylin.DELTA_METHODS:
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        out = delta_rule_attention(
            *xs[:4], log_decay=xs[4], initial_state=xs[5], method=method, chunk_size=4
        )
        grads = torch.autograd.grad(out[..., 4:, :].sum(), xs)
        assert all(torch.isfinite(gr).all() for gr in grads), method
        assert torch.all(grads[5] == 0)  # the initial state is erased at token 4


def test_grouped_call_never_copies_q_and_k(rng):
    """Grouped and repeated heads agree; the grouped call's q and k stay (B, H, 1, T, d)."""
    q, k, v, beta, g = grouped_inputs(rng, 4, "channel")
    grouped = delta_rule_attention(q, k, v, beta, log_decay=g, qk_l2norm=True)
    repeated = delta_rule_attention(
        np.repeat(q, 4, axis=2), np.repeat(k, 4, axis=2), v, beta, log_decay=g, qk_l2norm=True
    )
    np.testing.assert_allclose(grouped, repeated, atol=ATOL64, rtol=0)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"scale": "1"}, TypeError, "scale must be a real number"),
        ({"scale": True}, TypeError, "scale must be a real number"),
        ({"scale": math.inf}, ValueError, "scale must be finite"),
        ({"scale": math.nan}, ValueError, "scale must be finite"),
        ({"qk_l2norm": 1}, TypeError, "qk_l2norm must be True or False"),
        ({"qk_l2norm": "yes"}, TypeError, "qk_l2norm must be True or False"),
        ({"log_decay": np.zeros((2, 5, 3))}, ValueError, "log_decay must broadcast"),
    ],
)
def test_bad_options(rng, change, error, match):
    q, k, v, beta, _ = grouped_inputs(rng, None, "none", length=5)
    q, k, v, beta = (x[0] for x in (q, k, v, beta))
    with pytest.raises(error, match=match):
        delta_rule_attention(q, k, v, beta, **change)
    step_change = {n: x[:, 0] if isinstance(x, np.ndarray) else x for n, x in change.items()}
    with pytest.raises(error, match=match):
        delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], **step_change)


def test_groups_that_do_not_broadcast_name_the_arguments(rng):
    q, k, v, beta, _ = grouped_inputs(rng, 4, "none")
    with pytest.raises(ValueError, match="do not broadcast"):
        delta_rule_attention(np.repeat(q, 3, axis=2), k, v, beta)
