"""The generalized delta rule against an independent float64 per-token recurrence.

Every backend x method x decay kind (none, a float, per token, per channel) x grouped heads;
any chunk size; split and resume across methods; ``dplr_delta_rule_step`` after a chunked
prefill; padding (NaN at masked positions); packed sequences; ``seq_axis``; gradients (PyTorch
gradcheck and chunked/quadratic == recurrent, JAX); RWKV-7's own update in its own variables;
the special cases (delta rule, gated delta rule, KDA, linear attention); flash-linear-attention's
naive dplr reference; float32 at long T; bfloat16; bad input. On JAX the entry points run under
``jax.jit`` and on Dask lazily (``tests/conftest.py``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import polylin
from polylin import (
    causal_linear_attention,
    delta_rule_attention,
    dplr_delta_rule,
    dplr_delta_rule_step,
)
from polylin.feature_maps import identity
from polylin.testing import Backend

from .test_delta_rule import needs, recording, unit

LEAD, T, D_K, D_V, CHUNK = (2, 3), 13, 6, 5, 4  # T not a multiple of the chunk size
ATOL64 = 1e-10
METHODS = polylin.DPLR_METHODS
DECAYS = ["none", "float", "per_token", "per_channel"]


def reference(q, k, v, a, b, log_decay=None, *, state=None, mask=None, scale=1.0):
    """``S_t = diag(exp(g_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T``, ``o_t = scale S_t^T
    q_t``, token by token in float64: ``(outputs, final state)``.

    Every input broadcasts to the full leading shape; ``log_decay`` to ``(..., T, 1 or d_k)``;
    ``mask`` to ``(..., T)`` (masked tokens leave the state alone and output 0).
    """
    q, k, v, a, b = (np.asarray(x, np.float64) for x in (q, k, v, a, b))
    length, d_k, d_v = k.shape[-2], k.shape[-1], v.shape[-1]
    lead = np.broadcast_shapes(*(x.shape[:-2] for x in (q, k, v, a, b)))
    q, k, a, b = (np.broadcast_to(x, (*lead, length, d_k)) for x in (q, k, a, b))
    v = np.broadcast_to(v, (*lead, length, d_v))
    g = np.zeros((length, 1)) if log_decay is None else np.asarray(log_decay, np.float64)
    g = g.reshape(1, 1) if g.ndim == 0 else g
    g = np.broadcast_to(g, (*lead, length, d_k) if g.shape[-1] == d_k else (*lead, length, 1))
    keep = (
        np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    )
    S = np.zeros((*lead, d_k, d_v)) if state is None else np.array(state, np.float64)
    S = np.broadcast_to(S, (*lead, d_k, d_v)).copy()
    outputs = np.zeros((*lead, length, d_v))
    for index in np.ndindex(*lead):
        s = S[index]
        for t in range(length):
            if not keep[index][t]:
                continue
            decay = np.exp(g[index][t])[:, None]  # (d_k or 1, 1)
            read = s.T @ a[index][t]  # before the decay
            s = decay * s + np.outer(b[index][t], read) + np.outer(k[index][t], v[index][t])
            outputs[index][t] = scale * (s.T @ q[index][t])
        S[index] = s
    return outputs, S


def make_inputs(rng, lead=LEAD, length=T, d_k=D_K, d_v=D_V, decay="per_channel"):
    """RWKV-7-like inputs: ``a = -kk``, ``b = kk * a_lr``; decays in ``(exp(-exp(0.5)), 1)``."""
    q = rng.standard_normal((*lead, length, d_k))
    k = rng.standard_normal((*lead, length, d_k))
    v = rng.standard_normal((*lead, length, d_v))
    kk = unit(rng.standard_normal((*lead, length, d_k)))
    a_lr = rng.uniform(0.0, 1.0, (*lead, length, d_k))
    width = {"per_token": 1, "per_channel": d_k}.get(decay)
    log_decay = {
        "none": None,
        "float": -0.2,
    }.get(decay, None if width is None else -np.exp(rng.uniform(-3.0, 0.5, (*lead, length, width))))
    return q, k, v, -kk, kk * a_lr, log_decay


def on(backend, *arrays):
    return [None if x is None or isinstance(x, float) else backend.from_numpy(x) for x in arrays]


def close(backend, got, want, atol=ATOL64):
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=atol, rtol=0)


@pytest.mark.slow_grid(cover=("method", "decay"))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("grouped", [False, True])
def test_matches_reference(backend, rng, method, decay, grouped):
    """Every method and decay kind; grouped: q, k, a, b of (2, 1, T, d) against v (2, 3, T, d)
    (and a per-token decay of the value heads' shape)."""
    q, k, v, a, b, log_decay = make_inputs(rng, decay=decay)
    if grouped:
        q, k, a, b = (x[:, :1] for x in (q, k, a, b))
        if isinstance(log_decay, np.ndarray) and log_decay.shape[-1] == D_K:
            log_decay = log_decay[:, :1]
    S0 = rng.standard_normal((*LEAD, D_K, D_V))
    want, want_state = reference(q, k, v, a, b, log_decay, state=S0, scale=0.5)
    xq, xk, xv, xa, xb, g, xS = on(backend, q, k, v, a, b, log_decay, S0)
    out, state = dplr_delta_rule(
        xq, xk, xv, xa, xb,
        log_decay=g if g is not None else log_decay, scale=0.5, method=method,
        chunk_size=CHUNK, initial_state=xS, return_state=True,
    )  # fmt: skip
    like = backend.from_numpy(q)
    assert type(out) is type(like) and out.dtype == like.dtype and state.dtype == like.dtype
    assert tuple(out.shape) == want.shape and tuple(state.shape) == want_state.shape
    close(backend, out, want)
    close(backend, state, want_state)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 16, 64])
def test_any_chunk_size(rng, chunk_size, decay):
    """Chunks of any length (rounded up to a power of two), shorter or longer than T."""
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(2,), length=37, decay=decay)
    want, want_state = reference(q, k, v, a, b, log_decay)
    out, state = dplr_delta_rule(
        q, k, v, a, b, log_decay=log_decay, chunk_size=chunk_size, return_state=True
    )
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("first, second", list(itertools.permutations(METHODS, 2)))
def test_split_and_resume(backend, rng, first, second):
    """A state from any method continues in any other; with an initial state from the start."""
    q, k, v, a, b, log_decay = make_inputs(rng)
    S0 = rng.standard_normal((*LEAD, D_K, D_V))
    want, want_state = reference(q, k, v, a, b, log_decay, state=S0)
    cut = 6
    head = on(backend, *(x[..., :cut, :] for x in (q, k, v, a, b, log_decay)))
    tail = on(backend, *(x[..., cut:, :] for x in (q, k, v, a, b, log_decay)))
    options = {"chunk_size": CHUNK, "return_state": True}
    out1, S1 = dplr_delta_rule(
        *head[:5], log_decay=head[5], initial_state=backend.from_numpy(S0), method=first, **options
    )
    out2, S2 = dplr_delta_rule(
        *tail[:5], log_decay=tail[5], initial_state=S1, method=second, **options
    )
    close(backend, out1, want[..., :cut, :])
    close(backend, out2, want[..., cut:, :])
    close(backend, S2, want_state)


@pytest.mark.parametrize("decay", ["per_token", "per_channel"])
def test_blocks_of_one_chunk_each_scale_their_queries(rng, monkeypatch, decay):
    """Eager backends walk the chunks in blocks (here one chunk each, ``BLOCK_ROWS`` small);
    each block scales its own queries, with a state carried across blocks."""
    import polylin._forms.dplr.chunked

    monkeypatch.setattr(polylin._forms.dplr.chunked, "BLOCK_ROWS", 1)
    q, k, v, a, b, log_decay = make_inputs(rng, decay=decay)
    S0 = rng.standard_normal((*LEAD, D_K, D_V))
    want, want_state = reference(q, k, v, a, b, log_decay, state=S0, scale=0.5)
    out, state = dplr_delta_rule(
        q, k, v, a, b, log_decay=log_decay, scale=0.5, chunk_size=CHUNK, initial_state=S0,
        return_state=True,
    )  # fmt: skip
    close(Backend.NUMPY, out, want)
    close(Backend.NUMPY, state, want_state)


@pytest.mark.slow_grid
@pytest.mark.parametrize("decay", ["per_token", "per_channel"])
def test_step_continues_a_chunked_prefill(backend, rng, decay):
    q, k, v, a, b, log_decay = make_inputs(rng, decay=decay)
    want, want_state = reference(q, k, v, a, b, log_decay, scale=0.7)
    prefill = T - 3
    head = on(backend, *(x[..., :prefill, :] for x in (q, k, v, a, b, log_decay)))
    out, S = dplr_delta_rule(
        *head[:5], log_decay=head[5], scale=0.7, chunk_size=CHUNK, return_state=True
    )
    close(backend, out, want[..., :prefill, :])
    step = dplr_delta_rule_step
    if backend in (Backend.JAX, Backend.JAX_CUDA):
        import functools

        import jax

        step = jax.jit(functools.partial(dplr_delta_rule_step, scale=0.7))
    else:
        import functools

        step = functools.partial(dplr_delta_rule_step, scale=0.7)
    for t in range(prefill, T):
        x = on(backend, *(y[..., t, :] for y in (q, k, v, a, b, log_decay)))
        o_t, S = step(*x[:5], S, log_decay=x[5])
        close(backend, o_t, want[..., t, :])
    close(backend, S, want_state)


def test_step_with_float_decay_and_from_zero(rng):
    q, k, v, a, b, _ = make_inputs(rng, lead=(2,), length=4)
    want, want_state = reference(q, k, v, a, b, -0.3)
    S = None
    for t in range(4):
        o_t, S = dplr_delta_rule_step(
            q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], S, log_decay=-0.3
        )
        np.testing.assert_allclose(o_t, want[:, t], atol=ATOL64, rtol=0)
    np.testing.assert_allclose(S, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("lead", [(1, 3), (2, 1), ()])
@pytest.mark.parametrize("method", METHODS)
def test_a_shared_initial_state_broadcasts(backend, rng, method, lead):
    """A state shared by the batch, the heads or both serves every member, in the whole call
    and in a step."""
    q, k, v, a, b, log_decay = make_inputs(rng)
    S0 = rng.standard_normal((*lead, D_K, D_V))
    want, want_state = reference(q, k, v, a, b, log_decay, state=S0)
    x = on(backend, q, k, v, a, b, log_decay, S0)
    out, S = dplr_delta_rule(
        *x[:5], log_decay=x[5], initial_state=x[6], method=method, chunk_size=CHUNK,
        return_state=True,
    )  # fmt: skip
    close(backend, out, want)
    close(backend, S, want_state)
    first = on(backend, *(y[..., 0, :] for y in (q, k, v, a, b, log_decay)))
    o_t, _ = dplr_delta_rule_step(*first[:5], x[6], log_decay=first[5])
    close(backend, o_t, want[..., 0, :])


@pytest.mark.slow_grid
@pytest.mark.parametrize("grouped", [False, True])
def test_steps_on_a_large_state(backend, rng, grouped):
    """A state of 2^16 elements, where NumPy adds the two outer products as one matmul
    (``_policy.add_outer``); grouped: q, k, a, b shared by 4 value heads."""
    lead, heads = ((8, 1), (8, 4)) if grouped else ((8, 4), (8, 4))
    q, k, a, b = (rng.standard_normal((*lead, 3, 32)) for _ in range(4))
    v = rng.standard_normal((*heads, 3, 64))
    log_decay = -rng.uniform(0.0, 1.0, (*lead, 3, 32))
    a, b = -unit(a), 0.5 * unit(b)
    want, want_state = reference(q, k, v, a, b, log_decay)
    S = None
    for t in range(3):
        x = on(backend, *(y[..., t, :] for y in (q, k, v, a, b, log_decay)))
        o_t, S = dplr_delta_rule_step(*x[:5], S, log_decay=x[5])
        close(backend, o_t, want[..., t, :])
    assert math.prod(S.shape) == 2**16
    close(backend, S, want_state)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_padding(backend, rng, method):
    """Left and right padding and a hole, NaN inputs there: masked tokens neither write nor
    decay nor apply their low-rank term, and output 0; inputs are not modified."""
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(3,))
    mask = np.ones((3, T), bool)
    mask[0, :5] = False  # left padding
    mask[1, 9:] = False  # right padding
    mask[2, 6:8] = False  # a hole in the middle
    want, want_state = reference(q, k, v, a, b, log_decay, mask=mask)
    padded = [np.where(mask[..., None], x, np.nan) for x in (q, k, v, a, b, log_decay)]
    copies = [x.copy() for x in padded]
    xs = on(backend, *padded)
    out, state = dplr_delta_rule(
        *xs[:5], log_decay=xs[5], attention_mask=backend.from_numpy(mask), method=method,
        chunk_size=CHUNK, return_state=True,
    )  # fmt: skip
    got = backend.to_numpy(out)
    assert np.all(got[~mask] == 0)
    np.testing.assert_allclose(got, want, atol=ATOL64, rtol=0)
    close(backend, state, want_state)
    for before, after in zip(copies, padded):
        np.testing.assert_array_equal(before, after)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_cu_seqlens(backend, rng, method):
    """Packed sequences: each from its own initial state, each with its own final state."""
    offsets = [0, 5, 5, 11, T]  # an empty sequence included
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(2,))
    n = len(offsets) - 1
    S0 = rng.standard_normal((2, n, D_K, D_V))
    xs = on(backend, q, k, v, a, b, log_decay, S0)
    out, state = dplr_delta_rule(
        *xs[:5], log_decay=xs[5], initial_state=xs[6], cu_seqlens=offsets, method=method,
        chunk_size=CHUNK, return_state=True,
    )  # fmt: skip
    got, got_state = backend.to_numpy(out), backend.to_numpy(state)
    assert got.shape == (2, T, D_V) and got_state.shape == (2, n, D_K, D_V)
    for i, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        piece = [x[:, lo:hi] for x in (q, k, v, a, b, log_decay)]
        want, want_state = reference(*piece, state=S0[:, i])
        np.testing.assert_allclose(got[:, lo:hi], want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(got_state[:, i], want_state, atol=ATOL64, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_seq_axis(rng, method):
    """(batch, T, heads, d) inputs with seq_axis=1 and a (batch, T) mask; the output keeps the
    layout, the state is (batch, heads, d_k, d_v)."""
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(2, 2))
    mask = np.ones((2, T), bool)
    mask[1, :4] = False
    want, want_state = reference(q, k, v, a, b, log_decay, mask=mask[:, None, :])
    bthd = [np.swapaxes(x, 1, 2) for x in (q, k, v, a, b, log_decay)]
    out, state = dplr_delta_rule(
        *bthd[:5], log_decay=bthd[5], attention_mask=mask, seq_axis=1, method=method,
        chunk_size=CHUNK, return_state=True,
    )  # fmt: skip
    assert out.shape == (2, T, 2, D_V)
    np.testing.assert_allclose(out, np.swapaxes(want, 1, 2), atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


def test_empty_sequence_returns_a_copy_of_the_state(rng):
    q, k, v, a, b, _ = make_inputs(rng, lead=(2,), length=0)
    S0 = rng.standard_normal((2, D_K, D_V))
    for method in METHODS:
        out, state = dplr_delta_rule(
            q, k, v, a, b, initial_state=S0, method=method, return_state=True
        )
        assert out.shape == (2, 0, D_V) and state is not S0
        np.testing.assert_array_equal(state, S0)


# -- RWKV-7 and the special cases ---------------------------------------------------------------
@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_rwkv7_own_update(backend, rng, method):
    """RWKV-7's update in its own variables and orientation, state (d_v, d_k):
    ``state = w * state + sa * b + v * k`` with ``sa = state @ a``, ``out = state @ r``; decays
    ``w = exp(-exp(omega))``, ``a = -kk``, ``b = kk * a_lr``."""
    batch, heads, length, d = 2, 2, 19, 8
    r, k, v = rng.standard_normal((3, batch, heads, length, d))
    omega = rng.uniform(-3.0, 0.5, (batch, heads, length, d))
    kk = unit(rng.standard_normal((batch, heads, length, d)))
    a_lr = rng.uniform(0.0, 1.0, (batch, heads, length, d))
    state = np.zeros((batch, heads, d, d))  # (d_v, d_k)
    want = np.zeros((batch, heads, length, d))
    for t in range(length):
        w_t = np.exp(-np.exp(omega[..., t, :]))
        a_t, b_t = -kk[..., t, :], kk[..., t, :] * a_lr[..., t, :]
        sa = np.einsum("bhvk,bhk->bhv", state, a_t)
        state = (
            w_t[..., None, :] * state
            + sa[..., :, None] * b_t[..., None, :]
            + v[..., t, :, None] * k[..., t, None, :]
        )
        want[..., t, :] = np.einsum("bhvk,bhk->bhv", state, r[..., t, :])
    xs = on(backend, r, k, v, -kk, kk * a_lr, -np.exp(omega))
    out, S = dplr_delta_rule(
        *xs[:5], log_decay=xs[5], method=method, chunk_size=CHUNK, return_state=True
    )
    close(backend, out, want)
    close(backend, S, np.swapaxes(state, -1, -2))


def _delta_inputs(rng, lead=(2, 2), length=T):
    q = rng.standard_normal((*lead, length, D_K))
    k = unit(rng.standard_normal((*lead, length, D_K)))
    v = rng.standard_normal((*lead, length, D_V))
    beta = rng.uniform(0.1, 1.0, (*lead, length, 1))
    log_decay = -rng.uniform(0.0, 0.7, (*lead, length, 1))
    return q, k, v, beta, log_decay


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gated", [False, True])
def test_equals_the_delta_rule(backend, rng, method, gated):
    """Keys beta k, a = k, b = -beta exp(g) k: the (gated) delta rule."""
    q, k, v, beta, log_decay = _delta_inputs(rng)
    g = log_decay if gated else None
    gate = np.exp(log_decay) if gated else 1.0
    xs = on(backend, q, k, v, beta, g)
    want = delta_rule_attention(*xs[:4], log_decay=xs[4], method="recurrent")
    ys = on(backend, q, beta * k, v, k, -beta * gate * k, g)
    got = dplr_delta_rule(*ys[:5], log_decay=ys[5], method=method, chunk_size=CHUNK)
    close(backend, got, backend.to_numpy(want))


def kda_reference(q, k, v, beta, log_decay):
    """KDA, ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``."""
    *lead, length, d_k = k.shape
    S = np.zeros((*lead, d_k, v.shape[-1]))
    out = np.zeros((*lead, length, v.shape[-1]))
    for index in np.ndindex(*lead):
        s = S[index]
        for t in range(length):
            kt, bt = k[index][t], beta[index][t, 0]
            s = np.exp(log_decay[index][t])[:, None] * s
            s = s - bt * np.outer(kt, kt @ s) + bt * np.outer(kt, v[index][t])
            out[index][t] = s.T @ q[index][t]
    return out


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_equals_kda(backend, rng, method):
    """A gate per channel: keys beta k, a = exp(g) * k, b = -beta k, against a KDA loop and
    ``delta_rule_attention`` with the same per-channel gate."""
    q, k, v, beta, _ = _delta_inputs(rng)
    log_decay = -np.exp(rng.uniform(-3.0, 0.5, k.shape))
    want = kda_reference(q, k, v, beta, log_decay)
    ys = on(backend, q, beta * k, v, np.exp(log_decay) * k, -beta * k, log_decay)
    got = dplr_delta_rule(*ys[:5], log_decay=ys[5], method=method, chunk_size=CHUNK)
    close(backend, got, want)
    xs = on(backend, q, k, v, beta, log_decay)  # the delta rule's own per-channel gate
    kda = delta_rule_attention(*xs[:4], log_decay=xs[4], method=method, chunk_size=CHUNK)
    close(backend, kda, want)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("decay", ["none", "per_token", "per_channel"])
def test_equals_linear_attention_without_low_rank(backend, rng, method, decay):
    """a = b = 0: unnormalized linear attention with the same decay."""
    q, k, v, _, _, log_decay = make_inputs(rng, decay=decay)
    zero = np.zeros_like(k)
    xs = on(backend, q, k, v, zero, log_decay)
    want = causal_linear_attention(
        *xs[:3], identity, normalize=False, log_decay=xs[4], method="recurrent"
    )
    got = dplr_delta_rule(*xs[:3], xs[3], xs[3], log_decay=xs[4], method=method, chunk_size=CHUNK)
    close(backend, got, backend.to_numpy(want))


def _fla_naive():
    """flash-linear-attention's pure-PyTorch dplr reference (``benchmarks.baselines.fla_naive``)."""
    pytest.importorskip("einops")
    from benchmarks.baselines import fla_naive

    try:
        return fla_naive("generalized_delta_rule/dplr")
    except ImportError as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("form", ["dplr_recurrence", "dplr_chunkwise"])
def test_matches_fla_naive(rng, form):
    """fla's ``dplr_recurrence`` and ``dplr_chunkwise`` equal polylin's, with an initial state.

    They scale q by ``d_k ** -0.5`` themselves and compute in float32 whatever the input dtype
    (``.float()`` inside, and float64 inputs fail on mixed dtypes), so they get float32 inputs
    and are compared at float32 accuracy; polylin runs in float64 against the reference.
    """
    torch = needs(Backend.TORCH)
    naive = _fla_naive()
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(2, 2), length=64, d_k=8, d_v=8)
    S0 = rng.standard_normal((2, 2, 8, 8))
    scale = 8**-0.5
    want, want_state = reference(q, k, v, a, b, log_decay, state=S0, scale=scale)
    arrays = (q, k, v, a, b, log_decay, S0)
    xs = [torch.tensor(x, dtype=torch.float32) for x in arrays]
    options = {"chunk_size": 16} if form == "dplr_chunkwise" else {}
    fla_out, fla_state = getattr(naive, form)(*xs[:6], initial_state=xs[6], **options)
    np.testing.assert_allclose(fla_out.double().numpy(), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(fla_state.double().numpy(), want_state, atol=1e-4, rtol=0)
    ys = [torch.tensor(x) for x in arrays]
    for method in METHODS:
        out, state = dplr_delta_rule(
            *ys[:5], log_decay=ys[5], scale=scale, initial_state=ys[6], method=method,
            return_state=True,
        )  # fmt: skip
        np.testing.assert_allclose(out.numpy(), want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(state.numpy(), want_state, atol=ATOL64, rtol=0)


# -- gradients ----------------------------------------------------------------------------------
def _loss_inputs(rng, length=11, decay="per_channel"):
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(2,), length=length, d_k=4, d_v=3, decay=decay)
    S0 = rng.standard_normal((2, 4, 3))
    out_weight = rng.standard_normal((2, length, 3))
    state_weight = rng.standard_normal((2, 4, 3))
    return [q, k, v, a, b, log_decay, S0], out_weight, state_weight


@pytest.mark.parametrize("decay", ["per_token", "per_channel"])
def test_gradients_torch(rng, decay):
    """Gradients wrt q, k, v, a, b, log_decay and the initial state: chunked and quadratic ==
    recurrent."""
    torch = needs(Backend.TORCH)
    arrays, out_weight, state_weight = _loss_inputs(rng, decay=decay)
    grads = {}
    for method in METHODS:
        xs = [torch.tensor(x, requires_grad=True) for x in arrays]
        out, state = dplr_delta_rule(
            *xs[:5], log_decay=xs[5], initial_state=xs[6], method=method, chunk_size=4,
            return_state=True,
        )  # fmt: skip
        loss = (out * torch.tensor(out_weight)).sum() + (state * torch.tensor(state_weight)).sum()
        grads[method] = [g.numpy() for g in torch.autograd.grad(loss, xs)]
    for method in ("chunked", "quadratic"):
        for got, recurrent in zip(grads[method], grads["recurrent"]):
            assert np.all(np.isfinite(got)) and np.abs(recurrent).max() > 0
            np.testing.assert_allclose(got, recurrent, atol=1e-10, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_torch_match_finite_differences(rng, method):
    """``torch.autograd.gradcheck`` in float64, every input, a per-channel decay."""
    torch = needs(Backend.TORCH)
    arrays, out_weight, state_weight = _loss_inputs(rng, length=6)
    xs = [torch.tensor(x, requires_grad=True) for x in arrays]

    def loss(q, k, v, a, b, g, S0):
        out, state = dplr_delta_rule(
            q, k, v, a, b, log_decay=g, initial_state=S0, method=method, chunk_size=4,
            return_state=True,
        )  # fmt: skip
        return (out * torch.tensor(out_weight)).sum() + (state * torch.tensor(state_weight)).sum()

    assert torch.autograd.gradcheck(loss, xs, eps=1e-6, atol=1e-6)


def test_gradients_jax(rng):
    """``jax.grad`` under ``jax.jit``: chunked and quadratic == recurrent, wrt every input."""
    needs(Backend.JAX)
    import functools

    import jax

    arrays, out_weight, state_weight = _loss_inputs(rng, length=7)
    xs = [Backend.JAX.from_numpy(x) for x in arrays]

    def loss(q, k, v, a, b, g, S0, *, method):
        out, state = dplr_delta_rule(
            q, k, v, a, b, log_decay=g, initial_state=S0, method=method, chunk_size=4,
            return_state=True,
        )  # fmt: skip
        return (out * out_weight).sum() + (state * state_weight).sum()

    grads = {
        m: jax.jit(jax.grad(functools.partial(loss, method=m), argnums=tuple(range(7))))(*xs)
        for m in METHODS
    }
    for method in ("chunked", "quadratic"):
        for got, recurrent in zip(grads[method], grads["recurrent"]):
            assert np.abs(np.asarray(recurrent)).max() > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(recurrent), atol=1e-10, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_are_finite_with_nan_padding(rng, method):
    torch = needs(Backend.TORCH)
    q, k, v, a, b, log_decay = make_inputs(rng, lead=(1,), length=9)
    mask = np.arange(9) >= 3
    arrays = [np.where(mask[:, None], x[0], np.nan) for x in (q, k, v, a, b, log_decay)]
    xs = [torch.tensor(x, requires_grad=True) for x in arrays]
    out = dplr_delta_rule(
        *xs[:5], log_decay=xs[5], attention_mask=torch.tensor(mask), method=method, chunk_size=4
    )
    for g in torch.autograd.grad(out.sum(), xs):
        assert torch.all(torch.isfinite(g)) and torch.all(g[:3] == 0)


# -- numerics -----------------------------------------------------------------------------------
#: Length of the float32 checks: long enough for hundreds of chunks, short enough for the suite
#: (the float64 reference is a Python loop over T). ``make test`` runs T = 8192 (128 chunks),
#: ``make test-slow`` T = 65536.
LONG_T = 65536


@pytest.mark.parametrize("length", [8192, pytest.param(LONG_T, marks=pytest.mark.slow)])
@pytest.mark.parametrize("decays", ["rwkv7", "strong"])
def test_float32_long_sequence(rng, decays, length):
    """float32 within 1e-5 (relative to the largest output) of the float64 recurrence at
    T = 65536 (and 8192), d = 16, chunked and recurrent: RWKV-7's ranges (decays in
    (exp(-exp(0.5)), 1), a_lr in (0, 1)), or per-channel log decays down to -30 per token.
    (Measured: 1.5e-7.)"""
    d = 16
    q, k, v = rng.standard_normal((3, 1, length, d))
    kk = unit(rng.standard_normal((1, length, d)))
    a_lr = rng.uniform(0.0, 1.0, (1, length, d))
    if decays == "rwkv7":
        log_decay = -np.exp(rng.uniform(-6.0, 0.5, (1, length, d)))
    else:
        log_decay = -30.0 * rng.uniform(0.0, 1.0, (1, length, d)) ** 4
    args = [x.astype(np.float32) for x in (q, k, v, -kk, kk * a_lr, log_decay)]
    want, want_state = reference(*args[:5], args[5])
    for method in ("chunked", "recurrent"):
        out, state = dplr_delta_rule(*args[:5], log_decay=args[5], method=method, return_state=True)
        assert out.dtype == np.float32
        assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(state - want_state).max() <= 1e-5 * np.abs(want_state).max()


def test_bfloat16_accumulates_in_float32(rng):
    torch = needs(Backend.TORCH)
    from .reference import rounded

    inputs = [rounded(x, "bfloat16") for x in make_inputs(rng, length=70)]
    want, want_state = reference(*inputs[:5], inputs[5])
    xs = [Backend.TORCH.from_numpy(x, "bfloat16") for x in inputs]
    out, state = dplr_delta_rule(*xs[:5], log_decay=xs[5], return_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    got = Backend.TORCH.to_numpy(out)
    np.testing.assert_allclose(got, want, atol=2**-7 * np.abs(want).max(), rtol=0)
    np.testing.assert_allclose(Backend.TORCH.to_numpy(state), want_state, atol=1e-5, rtol=0)


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"a": [0.0]}, TypeError, "a must be an array"),
        ({"b": 0.0}, TypeError, "b must be an array"),
        ({"a": np.ones((2, 5, 5))}, ValueError, r"a must broadcast to \(2, 5, 6\)"),
        ({"b": np.ones((2, 5, 6), np.float32)}, TypeError, "b has dtype float32"),
        ({"log_decay": 0.1}, ValueError, "log_decay must be a finite number <= 0"),
        (
            {"log_decay": np.zeros((2, 5, 3))},
            ValueError,
            r"log_decay must broadcast against the keys \(2, 5, 6\) .*d_k for one per channel",
        ),
        ({"log_decay": np.zeros((2, 4, 6))}, ValueError, "log_decay must broadcast"),
        ({"scale": "1"}, TypeError, "scale must be a real number"),
        ({"scale": math.inf}, ValueError, "scale must be finite"),
        ({"method": "parallel"}, ValueError, "method must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"initial_state": np.zeros((2, 5, 6))}, ValueError, r"initial_state must have shape"),
        ({"attention_mask": np.ones((2, 4), bool)}, ValueError, "attention_mask"),
        (
            {"cu_seqlens": [0, 5], "attention_mask": np.ones((2, 5), bool)},
            ValueError,
            "attention_mask or cu_seqlens",
        ),
    ],
)
def test_bad_input_names_the_argument(rng, change, error, match):
    q, k, v, a, b, _ = make_inputs(rng, lead=(2,), length=5)
    options = dict(change)
    a, b = options.pop("a", a), options.pop("b", b)
    with pytest.raises(error, match=match):
        dplr_delta_rule(q, k, v, a, b, **options)


def test_bad_step_input_names_the_argument(rng):
    q, k, v, a, b, _ = make_inputs(rng, lead=(2,), length=1)
    q_t, k_t, v_t, a_t, b_t = (x[:, 0] for x in (q, k, v, a, b))
    with pytest.raises(ValueError, match=r"state must have shape \(2, 6, 5\)"):
        dplr_delta_rule_step(q_t, k_t, v_t, a_t, b_t, np.zeros((2, 5, 6)))
    with pytest.raises(ValueError, match=r"a_t must broadcast to \(2, 6\)"):
        dplr_delta_rule_step(q_t, k_t, v_t, a_t[:, :3], b_t)
    with pytest.raises(ValueError, match="log_decay must be a finite number"):
        dplr_delta_rule_step(q_t, k_t, v_t, a_t, b_t, log_decay=1.0)


def test_benchmark_peer_agrees_and_inputs_are_rwkv7(rng):
    """``benchmarks/dplr.py`` times fla's chunkwise form only after checking it against
    polylin, on inputs in RWKV-7's ranges."""
    torch = needs(Backend.TORCH)
    _fla_naive()  # skips without fla-core
    from benchmarks import dplr as bench

    x = bench.rwkv7_inputs(64)
    decay = torch.exp(x["log_decay"])
    assert float(decay.min()) > math.exp(-math.exp(0.5)) and float(decay.max()) < 1.0
    assert bench.check_peer(bench.fla_dplr_chunkwise(), {}) < 1e-5


@pytest.mark.parametrize("decay", ["none", "per_token", "per_channel"])
def test_fused_read_out_matches_the_batched_one(rng, monkeypatch, decay):
    """Without a gradient to record, PyTorch reads each chunk's outputs inside the loop over
    chunks (``_backend.fused.fused_dplr_chunks``): the same outputs and final state as the
    read-out after the loop, which a call with a gradient keeps; so do grouped heads whose
    operands keep broadcasting leading dimensions."""
    torch = needs(Backend.TORCH)
    chunked = polylin._forms.dplr.chunked
    taken: list[bool] = []
    spy = recording(chunked.fused_dplr_chunks, taken)

    q, k, v, a, b, log_decay = make_inputs(rng, lead=(2, 3), length=40, decay=decay)
    arrays = [torch.tensor(x) for x in (q, k, v, a, b)]
    gate = None if log_decay is None else torch.tensor(log_decay)
    S0 = torch.tensor(rng.standard_normal((2, 3, D_K, D_V)))

    def call(*xs, use_fused=True, **options):
        monkeypatch.setattr(chunked, "fused_dplr_chunks", spy if use_fused else lambda *a: None)
        return dplr_delta_rule(*xs, log_decay=gate, initial_state=S0, chunk_size=8,
                               return_state=True, **options)  # fmt: skip

    fast, batched = call(*arrays), call(*arrays, use_fused=False)
    assert taken and all(taken)
    for got, want in zip(fast, batched):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    taken.clear()
    query = arrays[0].clone().requires_grad_(True)
    out, _ = call(query, *arrays[1:])
    assert not taken  # with a gradient to record: the batched read-out
    torch.testing.assert_close(out.detach(), fast[0], rtol=1e-12, atol=1e-12)
    shared = arrays[0][:, :1]  # one query per group of three heads
    grouped, _ = call(shared, *arrays[1:])
    if decay == "none":  # a gate per head decays the queries per head: then they have its axes
        assert taken and not any(taken)
    want, _ = call(shared.expand(arrays[0].shape).contiguous(), *arrays[1:])
    torch.testing.assert_close(grouped, want, rtol=1e-12, atol=1e-12)
