"""The delta rule and the gated delta rule against an independent float64 per-token recurrence.

Every backend x method x (with and without decay) x (scalar and per-token beta); split and
resume across methods; ``delta_rule_step`` after a chunked prefill; padding (NaN at masked
positions); packed sequences; ``jax.jit``; gradients (PyTorch and JAX, chunked vs recurrent in
float64); float32 at T = 4096; half precision; bad input. JAX calls run under ``jax.jit``.
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

from .conftest import BACKENDS

LEAD, T, D_K, D_V, CHUNK = (2, 3), 13, 6, 5, 4  # T not a multiple of the chunk size
ATOL64 = 1e-10


def reference(q, k, v, beta, log_decay=None, state=None, mask=None):
    """The recurrence written plainly in float64: ``(outputs, final state)``.

    ``beta``, ``log_decay`` broadcast to ``(..., T, 1)``; ``mask`` to ``(..., T)`` (masked
    tokens leave the state alone and output 0).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    *lead, length, d_k = k.shape
    beta = np.broadcast_to(np.asarray(beta, np.float64), (*lead, length, 1))
    g = np.zeros((*lead, length, 1)) if log_decay is None else log_decay
    g = np.broadcast_to(np.asarray(g, np.float64), (*lead, length, 1))
    keep = (
        np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    )
    S = np.zeros((*lead, d_k, v.shape[-1])) if state is None else np.array(state, np.float64)
    outputs = np.zeros((*lead, length, v.shape[-1]))
    for index in np.ndindex(*lead):
        s = S[index]
        for t in range(length):
            if not keep[index][t]:
                continue
            kt, vt = k[index][t], v[index][t]
            decayed = math.exp(g[index][t, 0]) * s
            s = decayed + beta[index][t, 0] * np.outer(kt, vt - decayed.T @ kt)
            outputs[index][t] = s.T @ q[index][t]
        S[index] = s
    return outputs, S


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(rng, lead=LEAD, length=T, d_k=D_K, d_v=D_V):
    q = rng.standard_normal((*lead, length, d_k))
    k = unit(rng.standard_normal((*lead, length, d_k)))
    v = rng.standard_normal((*lead, length, d_v))
    beta = rng.uniform(0.1, 1.0, (*lead, length, 1))
    log_decay = -rng.uniform(0.0, 0.7, (*lead, length, 1))
    return q, k, v, beta, log_decay


def needs(backend):
    """The library module of ``backend``; skip unless it is selected and usable here."""
    if backend not in BACKENDS:
        pytest.skip(f"[{backend}] not selected in POLYLIN_BACKENDS")
    reason = backend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[{backend}] {reason}")
    return backend.module()


def is_jax(backend):
    return backend in (Backend.JAX, Backend.JAX_CUDA)


def run(backend, fn, *arrays, **options):
    """``fn(*arrays, **options)`` on ``backend`` from NumPy inputs.

    NumPy arrays (positional or options) become arrays of the backend; anything else (floats,
    method, chunk_size, ...) is static. On JAX the call runs under ``jax.jit`` with the arrays
    traced. Returns the backend's result(s).
    """
    arrays = [backend.from_numpy(x) for x in arrays]
    traced = {n: backend.from_numpy(x) for n, x in options.items() if isinstance(x, np.ndarray)}
    static = {n: x for n, x in options.items() if n not in traced}
    target = functools.partial(fn, **static)
    # The recurrent form is a Python loop over T: jit would unroll it into a program the size
    # of the sequence, and compiling that costs more than running it op by op.
    if is_jax(backend) and static.get("method") != "recurrent":
        import jax

        target = jax.jit(target)
    return target(*arrays, **traced)


def delta(q, k, v, beta=None, **options):
    """``delta_rule_attention`` with ``beta`` as a keyword (so that it can be traced)."""
    return delta_rule_attention(q, k, v, beta, **options)


def run_delta(backend, inputs, **options):
    """:func:`delta` on ``backend`` from the NumPy ``(q, k, v, beta, log_decay)`` of
    ``make_inputs``."""
    q, k, v, beta, log_decay = inputs
    return run(backend, delta, q, k, v, beta=beta, log_decay=log_decay, **options)


def close(backend, got, want, atol=ATOL64):
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=atol, rtol=0)


@pytest.mark.slow_grid(cover=("method", "decay"))
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
@pytest.mark.parametrize("decay", ["none", "float", "per_token"])
@pytest.mark.parametrize("beta_kind", ["float", "per_token"])
def test_matches_reference(backend, rng, method, decay, beta_kind):
    q, k, v, beta, log_decay = make_inputs(rng)
    beta = 0.6 if beta_kind == "float" else beta
    log_decay = {"none": None, "float": -0.2, "per_token": log_decay}[decay]
    want, want_state = reference(q, k, v, beta, log_decay)
    out, state = run(
        backend,
        delta,
        q,
        k,
        v,
        beta=beta,
        log_decay=log_decay,
        method=method,
        chunk_size=CHUNK,
        return_state=True,
    )
    like = backend.from_numpy(q)
    assert type(out) is type(like) and out.dtype == like.dtype and state.dtype == like.dtype
    assert tuple(out.shape) == want.shape and tuple(state.shape) == want_state.shape
    close(backend, out, want)
    close(backend, state, want_state)


@pytest.mark.parametrize("block_rows", [8, 4096])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 16, 64])
def test_any_chunk_size(rng, monkeypatch, chunk_size, block_rows):
    """Chunks of any length, powers of two or not, shorter or longer than the sequence; in one
    block or in several (eager CPU backends process blocks of chunks). NumPy runs on one
    thread, whose chunks are capped (``ONE_THREAD_CHUNK``): lifted here, so that 64 is longer
    than the sequence."""
    monkeypatch.setattr(polylin._forms.delta.chunked, "BLOCK_ROWS", block_rows)
    monkeypatch.setattr(polylin._forms.delta.chunked, "ONE_THREAD_CHUNK", 1024)
    q, k, v, beta, log_decay = make_inputs(rng, lead=(2,), length=37)
    want, want_state = reference(q, k, v, beta, log_decay)
    out, state = delta_rule_attention(
        q, k, v, beta, log_decay=log_decay, chunk_size=chunk_size, return_state=True
    )
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


@pytest.mark.parametrize(
    "asked, T, d_k, where, want",
    [
        (64, 4096, 64, "one CPU thread, a gradient", 32),  # capped: ONE_THREAD_CHUNK
        (64, 4096, 128, "one CPU thread, a gradient", 32),
        (64, 4096, 256, "one CPU thread, a gradient", 64),  # wider keys: as asked
        (16, 4096, 64, "one CPU thread, a gradient", 16),  # shorter than the cap: as asked
        (64, 20, 64, "one CPU thread, a gradient", 32),  # no longer than T, a power of two
        (64, 4096, 64, "one CPU thread, no gradient", 16),  # capped: FORWARD_CHUNK
        (64, 4096, 128, "one CPU thread, no gradient", 32),  # wider keys: ONE_THREAD_CHUNK
        (8, 4096, 64, "one CPU thread, no gradient", 8),  # shorter than the cap: as asked
        (64, 4096, 64, "two CPU threads, a gradient", 64),  # the read-out after the loop
        (48, 4096, 64, "two CPU threads, a gradient", 64),  # rounded up to a power of two
        (64, 4096, 64, "two CPU threads, no gradient", 16),  # the read-out in the loop
        (64, 4096, 128, "two CPU threads, no gradient", 32),
        (64, 4096, 64, "lazy", 64),  # Dask, torch.compile, JAX traced for an accelerator
        (64, 4096, 64, "scanned", 32),  # JAX traced for the CPU: one scan over the chunks
        (64, 4096, 256, "scanned", 64),
        (16, 4096, 64, "accelerator", 256),  # at least ACCELERATOR_CHUNK
        (512, 4096, 64, "accelerator", 512),
    ],
)
def test_chunk_length_follows_the_execution(asked, T, d_k, where, want):
    """The delta rules' chunk length: shorter where an eager CPU loop reads the outputs inside it
    (one thread, or more without a gradient) and in a scan over the chunks (their sequential
    steps cost less than the products they save), shorter still for narrow keys without a
    gradient, longer on eager accelerators, else as asked."""
    forward = {"accelerator": False, "in_loop": True, "forward_only": True}
    execution = {
        "one CPU thread, a gradient": {"accelerator": False, "in_loop": True},
        "one CPU thread, no gradient": forward,
        "two CPU threads, a gradient": {"accelerator": False, "in_loop": False},
        "two CPU threads, no gradient": forward,
        "lazy": {"accelerator": False, "in_loop": False},
        "scanned": {"accelerator": False, "in_loop": False, "scanned": True},
        "accelerator": {"accelerator": True, "in_loop": False},
    }[where]
    assert polylin._forms.delta.chunked.chunk_length(asked, T, d_k, **execution) == want


@pytest.mark.parametrize(
    "threads, grad, want", [(1, False, 16), (1, True, 32), (2, False, 16), (2, True, 64)]
)
def test_the_chunk_follows_the_threads(rng, monkeypatch, threads, grad, want):
    """An eager CPU call asks its threads (``cpu_threads``) and whether a gradient is recorded,
    and runs the chunk :func:`chunk_length` gives for them, with the reference's results either
    way."""
    torch = needs(Backend.TORCH)
    chunked = polylin._forms.delta.chunked
    monkeypatch.setattr(chunked, "cpu_threads", lambda xp: threads)
    sizes = []
    causal_mask = chunked.causal_mask
    monkeypatch.setattr(
        chunked, "causal_mask", lambda xp, r, c, dev: sizes.append(r) or causal_mask(xp, r, c, dev)
    )
    q, k, v, beta, log_decay = make_inputs(rng, lead=(2,), length=100)
    want_out, want_state = reference(q, k, v, beta, log_decay)
    query = torch.tensor(q, requires_grad=grad)
    out, state = delta_rule_attention(
        query, *(torch.tensor(x) for x in (k, v, beta)), log_decay=torch.tensor(log_decay),
        chunk_size=64, return_state=True,
    )  # fmt: skip
    assert sizes == [want]
    np.testing.assert_allclose(out.detach(), want_out, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state.detach(), want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("first, second", [("chunked", "recurrent"), ("recurrent", "chunked")])
def test_split_and_resume(backend, rng, monkeypatch, first, second):
    """A state from either method continues in the other; with an initial state from the start.

    Eager backends process the chunks in blocks of one chunk here (``BLOCK_ROWS`` small)."""
    monkeypatch.setattr(polylin._forms.delta.chunked, "BLOCK_ROWS", 8)
    q, k, v, beta, log_decay = make_inputs(rng)
    S0 = rng.standard_normal((*LEAD, D_K, D_V))
    want, want_state = reference(q, k, v, beta, log_decay, state=S0)
    cut = 6
    head = [x[..., :cut, :] for x in (q, k, v, beta, log_decay)]
    tail = [x[..., cut:, :] for x in (q, k, v, beta, log_decay)]
    options = {"chunk_size": CHUNK, "return_state": True}
    out1, S1 = run_delta(backend, head, initial_state=S0, method=first, **options)
    out2, S2 = run_delta(
        backend, tail, initial_state=backend.to_numpy(S1), method=second, **options
    )
    close(backend, out1, want[..., :cut, :])
    close(backend, out2, want[..., cut:, :])
    close(backend, S2, want_state)


#: Initial states shared by the batch, by the heads, by both (no leading axes at all).
SHARED_STATES = [(1, 3), (2, 1), ()]


@pytest.mark.slow_grid
@pytest.mark.parametrize("lead", SHARED_STATES)
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_a_shared_initial_state_broadcasts(backend, rng, method, lead):
    """An initial state whose leading dimensions broadcast to the batch's serves every member,
    in the whole call and in a step: as the explicitly repeated state does."""
    inputs = make_inputs(rng)
    S0 = rng.standard_normal((*lead, D_K, D_V))
    full = np.broadcast_to(S0, (*LEAD, D_K, D_V))
    want, want_state = reference(*inputs, state=full)
    out, S = run_delta(
        backend, inputs, initial_state=S0, method=method, chunk_size=CHUNK, return_state=True
    )
    close(backend, out, want)
    close(backend, S, want_state)
    x = [backend.from_numpy(a[..., 0, :]) for a in inputs]
    o_t, S_t = delta_rule_step(*x[:4], backend.from_numpy(S0), log_decay=x[4])
    close(backend, o_t, want[..., 0, :])
    close(backend, S_t, reference(*(a[..., :1, :] for a in inputs), state=full)[1])


def test_a_shared_initial_state_gets_the_summed_gradient(rng):
    """The gradient of a state shared by the batch is the sum of the repeated state's."""
    torch = needs(Backend.TORCH)
    q, k, v, beta, log_decay = (torch.from_numpy(a) for a in make_inputs(rng))
    shared = torch.from_numpy(rng.standard_normal((1, 3, D_K, D_V))).requires_grad_(True)
    repeated = shared.detach().repeat(2, 1, 1, 1).requires_grad_(True)
    for S0 in (shared, repeated):
        out = delta_rule_attention(q, k, v, beta, log_decay=log_decay, initial_state=S0)
        (out * torch.cos(out)).sum().backward()
    torch.testing.assert_close(shared.grad, repeated.grad.sum(0, keepdim=True))


def test_step_continues_a_chunked_prefill(backend, rng):
    q, k, v, beta, log_decay = make_inputs(rng)
    want, want_state = reference(q, k, v, beta, log_decay)
    prefill = T - 3
    head = [x[..., :prefill, :] for x in (q, k, v, beta, log_decay)]
    out, S = run_delta(backend, head, chunk_size=CHUNK, return_state=True)
    close(backend, out, want[..., :prefill, :])
    step = delta_rule_step
    if is_jax(backend):
        import jax

        step = jax.jit(delta_rule_step)
    for t in range(prefill, T):
        x = [backend.from_numpy(a[..., t, :]) for a in (q, k, v, beta, log_decay)]
        o_t, S = step(*x[:4], S, log_decay=x[4])
        close(backend, o_t, want[..., t, :])
    close(backend, S, want_state)


def test_step_with_float_options_and_from_zero(rng):
    q, k, v, _, _ = make_inputs(rng, lead=(2,), length=4)
    want, want_state = reference(q, k, v, 0.7, -0.3)
    S = None
    for t in range(4):
        o_t, S = delta_rule_step(q[:, t], k[:, t], v[:, t], 0.7, S, log_decay=-0.3)
        np.testing.assert_allclose(o_t, want[:, t], atol=ATOL64, rtol=0)
    np.testing.assert_allclose(S, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_padding(backend, rng, method):
    """Left and right padding with NaN inputs there: masked tokens neither write nor decay."""
    q, k, v, beta, log_decay = make_inputs(rng, lead=(3,), length=T)
    mask = np.ones((3, T), bool)
    mask[0, :5] = False  # left padding
    mask[1, 9:] = False  # right padding
    mask[2, 6:8] = False  # a hole in the middle
    want, want_state = reference(q, k, v, beta, log_decay, mask=mask)
    padded = [np.where(mask[..., None], x, np.nan) for x in (q, k, v, beta, log_decay)]
    inputs = [x.copy() for x in padded]
    out, state = run_delta(
        backend,
        padded,
        attention_mask=mask,
        method=method,
        chunk_size=CHUNK,
        return_state=True,
    )
    got = backend.to_numpy(out)
    assert np.all(got[~mask] == 0)
    np.testing.assert_allclose(got, want, atol=ATOL64, rtol=0)
    close(backend, state, want_state)
    for before, after in zip(inputs, padded):  # inputs are not modified
        np.testing.assert_array_equal(before, after)


def test_padding_with_broadcast_mask_and_float_options(rng):
    """A (batch, 1, T) mask for (batch, heads, T, d) inputs, with float beta and decay."""
    q, k, v, _, _ = make_inputs(rng, lead=(2, 2), length=9)
    mask = np.ones((2, 1, 9), bool)
    mask[1, 0, :4] = False
    want, want_state = reference(q, k, v, 0.5, -0.1, mask=mask)
    out, state = delta_rule_attention(
        q, k, v, 0.5, log_decay=-0.1, attention_mask=mask, chunk_size=4, return_state=True
    )
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_cu_seqlens(backend, rng, method):
    """Packed sequences: each from its own initial state, each with its own final state."""
    offsets = [0, 5, 5, 11, T]  # an empty sequence included
    q, k, v, beta, log_decay = make_inputs(rng, lead=(2,), length=T)
    n = len(offsets) - 1
    S0 = rng.standard_normal((2, n, D_K, D_V))
    out, state = run_delta(
        backend,
        (q, k, v, beta, log_decay),
        initial_state=S0,
        cu_seqlens=offsets,
        method=method,
        chunk_size=4,
        return_state=True,
    )
    got, got_state = backend.to_numpy(out), backend.to_numpy(state)
    assert got.shape == (2, T, D_V) and got_state.shape == (2, n, D_K, D_V)
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        piece = [x[:, a:b] for x in (q, k, v, beta, log_decay)]
        want, want_state = reference(*piece, state=S0[:, i])
        np.testing.assert_allclose(got[:, a:b], want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(got_state[:, i], want_state, atol=ATOL64, rtol=0)


def test_empty_sequence_returns_a_copy_of_the_state(rng):
    q, k, v, beta, _ = make_inputs(rng, lead=(2,), length=0)
    S0 = rng.standard_normal((2, D_K, D_V))
    for method in polylin.DELTA_METHODS:
        out, state = delta_rule_attention(
            q, k, v, beta, initial_state=S0, method=method, return_state=True
        )
        assert out.shape == (2, 0, D_V) and state is not S0
        np.testing.assert_array_equal(state, S0)


def _loss_inputs(rng, length=11):
    q, k, v, beta, log_decay = make_inputs(rng, lead=(2,), length=length, d_k=4, d_v=3)
    S0 = rng.standard_normal((2, 4, 3))
    out_weight = rng.standard_normal((2, length, 3))
    state_weight = rng.standard_normal((2, 4, 3))
    return [q, k, v, beta, log_decay, S0], out_weight, state_weight


@pytest.mark.parametrize("block_rows", [8, 4096])
def test_gradients_torch(rng, monkeypatch, block_rows):
    """Gradients wrt q, k, v, beta, log_decay and the initial state: chunked == recurrent
    (with the chunks in one block, and in blocks of one chunk)."""
    torch = needs(Backend.TORCH)
    monkeypatch.setattr(polylin._forms.delta.chunked, "BLOCK_ROWS", block_rows)
    arrays, out_weight, state_weight = _loss_inputs(rng)
    grads = {}
    for method in polylin.DELTA_METHODS:
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        out, state = delta_rule_attention(
            *xs[:4],
            log_decay=xs[4],
            initial_state=xs[5],
            method=method,
            chunk_size=4,
            return_state=True,
        )
        loss = (out * torch.tensor(out_weight)).sum() + (state * torch.tensor(state_weight)).sum()
        grads[method] = [g.numpy() for g in torch.autograd.grad(loss, xs)]
    for chunked, recurrent in zip(grads["chunked"], grads["recurrent"]):
        assert np.all(np.isfinite(chunked)) and np.abs(recurrent).max() > 0
        np.testing.assert_allclose(chunked, recurrent, atol=1e-10, rtol=0)


def test_gradients_torch_match_finite_differences(rng):
    """The recurrent gradients themselves are right (so agreeing with them means something)."""
    torch = needs(Backend.TORCH)
    arrays, out_weight, _ = _loss_inputs(rng, length=6)
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]

    def loss(q, k, v, beta, g, S0):
        out = delta_rule_attention(q, k, v, beta, log_decay=g, initial_state=S0, chunk_size=4)
        return (out * torch.tensor(out_weight)).sum()

    assert torch.autograd.gradcheck(loss, xs, eps=1e-6, atol=1e-6)


def test_gradients_jax(rng):
    """``jax.grad`` under ``jax.jit``: chunked == recurrent, wrt every input."""
    needs(Backend.JAX)
    import jax

    arrays, out_weight, state_weight = _loss_inputs(rng, length=7)
    xs = [Backend.JAX.from_numpy(a) for a in arrays]

    def loss(q, k, v, beta, g, S0, *, method):
        out, state = delta_rule_attention(
            q,
            k,
            v,
            beta,
            log_decay=g,
            initial_state=S0,
            method=method,
            chunk_size=4,
            return_state=True,
        )
        return (out * out_weight).sum() + (state * state_weight).sum()

    grads = {
        m: jax.jit(jax.grad(functools.partial(loss, method=m), argnums=tuple(range(6))))(*xs)
        for m in polylin.DELTA_METHODS
    }
    for chunked, recurrent in zip(grads["chunked"], grads["recurrent"]):
        assert np.abs(np.asarray(recurrent)).max() > 0
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(recurrent), atol=1e-10, rtol=0)


def test_gradients_are_finite_with_nan_padding(rng):
    torch = needs(Backend.TORCH)
    q, k, v, beta, log_decay = make_inputs(rng, lead=(1,), length=9)
    mask = np.arange(9) >= 3
    arrays = [np.where(mask[:, None], x[0], np.nan) for x in (q, k, v, beta, log_decay)]
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = delta_rule_attention(
        *xs[:4], log_decay=xs[4], attention_mask=torch.tensor(mask), chunk_size=4
    )
    grads = torch.autograd.grad(out.sum(), xs)
    for g in grads:
        assert torch.all(torch.isfinite(g)) and torch.all(g[:3] == 0)


@pytest.mark.parametrize("keys", ["random", "repeated"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_float32_long_sequence(rng, keys, chunk_size):
    """float32 at T = 4096 (chunks of 32 and 64, per-token beta and decay) within 1e-4 of
    float64.

    "repeated" draws every key from 8 unit vectors, the associative-recall regime where the
    chunk's triangular system is far from the identity (entries of magnitude up to 1).
    """
    length, d = 4096, 16
    q = unit(rng.standard_normal((2, length, d)))
    if keys == "random":
        k = unit(rng.standard_normal((2, length, d)))
    else:
        vocabulary = unit(rng.standard_normal((8, d)))
        k = vocabulary[rng.integers(0, 8, (2, length))]
    v = rng.standard_normal((2, length, d))
    beta = rng.uniform(0.05, 1.0, (2, length, 1))
    log_decay = np.log(rng.uniform(0.9, 1.0, (2, length, 1)))
    want, want_state = reference(q, k, v, beta, log_decay)
    args = [x.astype(np.float32) for x in (q, k, v, beta, log_decay)]
    for ungated in (False, True):
        g = None if ungated else args[4]
        if ungated:
            want, want_state = reference(*args[:4])
        out, state = delta_rule_attention(
            *args[:4], log_decay=g, chunk_size=chunk_size, return_state=True
        )
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(state, want_state, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_accumulates_in_float32(rng, dtype):
    needs(Backend.TORCH)
    from .reference import rounded

    q, k, v, beta, log_decay = make_inputs(rng, length=70)
    inputs = [rounded(x, dtype) for x in (q, k, v, beta, log_decay)]
    want, want_state = reference(*inputs[:4], inputs[4])
    xs = [Backend.TORCH.from_numpy(x, dtype) for x in inputs]
    out, state = delta_rule_attention(*xs[:4], log_decay=xs[4], return_state=True)
    assert str(out.dtype).endswith(dtype) and str(state.dtype).endswith("float32")
    atol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype]  # one rounding of outputs of size ~3
    np.testing.assert_allclose(Backend.TORCH.to_numpy(out), want, atol=atol, rtol=0)
    np.testing.assert_allclose(Backend.TORCH.to_numpy(state), want_state, atol=1e-5, rtol=0)


def _bad(rng):
    q, k, v, beta, _ = make_inputs(rng, lead=(2,), length=5)
    return q, k, v, beta


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"beta": "0.5"}, TypeError, "beta must be a float or an array"),
        ({"beta": 2.5}, ValueError, r"beta must be a finite number in \[0.0, 2.0\]"),
        ({"beta": float("nan")}, ValueError, "beta must be a finite number"),
        ({"beta": True}, TypeError, "beta must be a float or an array"),
        ({"beta": np.ones((2, 5))}, ValueError, r"beta must broadcast to \(2, 5, 1\)"),
        ({"beta": np.ones((3, 5, 1))}, ValueError, "beta must broadcast"),
        ({"beta": np.ones((2, 5, 1), np.float32)}, TypeError, "beta has dtype float32"),
        ({"log_decay": 0.1}, ValueError, "log_decay must be a finite number <= 0"),
        ({"log_decay": -math.inf}, ValueError, "log_decay must be a finite number"),
        ({"log_decay": np.zeros((2, 4, 1))}, ValueError, "log_decay must broadcast"),
        ({"log_decay": [0.0]}, TypeError, "log_decay must be None, a number <= 0 or an array"),
        ({"initial_state": np.zeros((2, 6, 6))}, ValueError, r"initial_state must have shape"),
        ({"initial_state": (np.zeros((2, 6, 5)), np.zeros((2, 6)))}, TypeError, "initial_state"),
        ({"initial_state": np.zeros((2, 6, 5), int)}, TypeError, "initial_state must have a"),
        (
            {"initial_state": np.zeros((2, 6, 5), np.float32)},
            TypeError,
            "initial_state has dtype float32 but inputs of dtype float64",
        ),
        ({"method": "parallel"}, ValueError, "method must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"attention_mask": np.ones((2, 4), bool)}, ValueError, "attention_mask"),
        ({"attention_mask": np.ones((2, 5))}, TypeError, "attention_mask must be boolean"),
        ({"cu_seqlens": [0, 6]}, ValueError, "cu_seqlens"),
        (
            {"cu_seqlens": [0, 5], "attention_mask": np.ones((2, 5), bool)},
            ValueError,
            "attention_mask or cu_seqlens",
        ),
        ({"cu_seqlens": [0, 5], "initial_state": np.zeros((2, 6, 5))}, ValueError, "initial_state"),
    ],
)
def test_bad_input_names_the_argument(rng, change, error, match):
    q, k, v, beta = _bad(rng)
    options = dict(change)
    beta = options.pop("beta", beta)
    with pytest.raises(error, match=match):
        delta_rule_attention(q, k, v, beta, **options)


def test_bad_arrays_name_the_argument(rng):
    q, k, v, beta = _bad(rng)
    with pytest.raises(ValueError, match="v has sequence length"):
        delta_rule_attention(q, k, v[:, :4], beta)
    with pytest.raises(TypeError, match="k has dtype"):
        delta_rule_attention(q, k.astype(np.float32), v, beta)
    if Backend.TORCH in BACKENDS and Backend.TORCH.available():
        torch = Backend.TORCH.module()
        with pytest.raises(TypeError, match="beta must be an array of the same library as q"):
            delta_rule_attention(q, k, v, torch.tensor(beta))


def test_bad_step_input_names_the_argument(rng):
    q, k, v, _ = _bad(rng)
    q_t, k_t, v_t = q[:, 0], k[:, 0], v[:, 0]
    with pytest.raises(ValueError, match=r"state must have shape \(2, 6, 5\)"):
        delta_rule_step(q_t, k_t, v_t, 0.5, np.zeros((2, 5, 6)))
    with pytest.raises(ValueError, match=r"beta_t must broadcast to \(2, 1\)"):
        delta_rule_step(q_t, k_t, v_t, np.ones((2, 5, 1)))
    with pytest.raises(ValueError, match="log_decay must be a finite number"):
        delta_rule_step(q_t, k_t, v_t, 0.5, log_decay=1.0)
    with pytest.raises(ValueError, match="q_t must have at least 1 dimensions"):
        delta_rule_step(np.float64(1.0) * np.ones(()), k_t, v_t, 0.5)


def test_recall_beats_linear_attention():
    """The point of the rule: a key written again recalls its last value, not a blend."""
    rng = np.random.default_rng(0)
    keys = np.linalg.qr(rng.standard_normal((16, 4)))[0].T  # 4 orthonormal keys
    writes = rng.integers(0, 4, 40)
    k, v = keys[writes], rng.standard_normal((40, 8))
    last = np.stack([v[np.flatnonzero(writes == i)[-1]] for i in range(4)])
    _, S = delta_rule_attention(k, k, v, 1.0, return_state=True)
    np.testing.assert_allclose(keys @ S, last, atol=1e-12)
    _, (S_plain, z) = polylin.causal_linear_attention(k, k, v, return_state=True)
    phi = polylin.feature_maps.elu_plus_one(keys)
    plain = phi @ S_plain / (phi @ z)[:, None]
    assert np.abs(plain - last).max() > 0.5


def test_positive_log_decay_is_taken_as_zero(rng):
    """A decay never amplifies the state: log decays above 0 act as 0 (and pass gradients
    through unchanged at 0 itself)."""
    q, k, v, beta, log_decay = make_inputs(rng, lead=(2,), length=9)
    log_decay[:, ::2] = 0.0
    positive = np.where(log_decay == 0.0, 0.7, log_decay)
    want, _ = reference(q, k, v, beta, log_decay)
    for method in polylin.DELTA_METHODS:
        got = delta_rule_attention(q, k, v, beta, log_decay=positive, method=method)
        np.testing.assert_allclose(got, want, atol=ATOL64, rtol=0)
    torch = needs(Backend.TORCH)
    g = torch.tensor(log_decay, requires_grad=True)
    arrays = [torch.tensor(x) for x in (q, k, v, beta)]
    (grad,) = torch.autograd.grad(delta_rule_attention(*arrays, log_decay=g).sum(), g)
    h = 1e-6
    for index in [(0, 4, 0), (1, 6, 0)]:  # log decays of exactly 0, after some writes
        shifted = log_decay.copy()
        shifted[index] -= h
        below = delta_rule_attention(q, k, v, beta, log_decay=shifted).sum()
        above = delta_rule_attention(q, k, v, beta, log_decay=log_decay).sum()
        np.testing.assert_allclose(grad.numpy()[index], (above - below) / h, rtol=1e-4)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
def test_seq_axis(backend, rng, method):
    """(batch, T, heads, d) inputs with seq_axis=1: beta and log decay (batch, T, heads, 1), a
    2-D (batch, T) mask (batch == heads here: the mask must follow batch), the state
    (batch, heads, d_k, d_v); the output keeps the layout."""
    B = H = 2
    q, k, v, beta, log_decay = make_inputs(rng, lead=(B, H))  # (B, H, T, d)
    mask = np.ones((B, T), bool)
    mask[1, :4] = False
    S0 = rng.standard_normal((B, H, D_K, D_V))
    want, want_state = reference(q, k, v, beta, log_decay, state=S0, mask=mask[:, None, :])
    bthd = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, beta, log_decay)]
    out, state = run_delta(
        backend, bthd, initial_state=S0,
        attention_mask=mask, seq_axis=1, method=method, chunk_size=CHUNK, return_state=True,
    )  # fmt: skip
    assert tuple(out.shape) == (B, T, H, D_V)
    close(backend, out, np.swapaxes(want, 1, 2))
    close(backend, state, want_state)


def test_seq_axis_with_cu_seqlens_and_bad_ranks(rng):
    offsets = [0, 4, T]
    q, k, v, beta, _ = make_inputs(rng, lead=(1, 2))  # (1, H, T, d)
    bthd = [np.swapaxes(x, 1, 2) for x in (q, k, v, beta)]
    out = delta_rule_attention(*bthd, cu_seqlens=offsets, seq_axis=1, chunk_size=CHUNK)
    for a, b in itertools.pairwise(offsets):
        want, _ = reference(*(x[..., a:b, :] for x in (q, k, v, beta)))
        np.testing.assert_allclose(out[:, a:b], np.swapaxes(want, 1, 2), atol=ATOL64, rtol=0)
    with pytest.raises(ValueError, match="beta has 3 dimensions but q has 4"):
        delta_rule_attention(*bthd[:3], beta[0], seq_axis=1)
    with pytest.raises(ValueError, match="seq_axis=3 is the feature axis of q"):
        delta_rule_attention(*bthd, seq_axis=3)


@pytest.mark.parametrize("form", ["delta", "dplr"])
def test_blocks_grow_with_torch_threads(form, monkeypatch):
    """On PyTorch the delta rules' blocks hold a budget per thread (``_policy.cpu_threads``):
    three threads walk the sequence in a third of the blocks of one thread, to the same
    result. The delta rule reads its outputs inside the loop over chunks on one thread, and on
    more without a gradient to record; with one, in two batched products after the loop: the
    read-outs agree."""
    torch = pytest.importorskip("torch")
    import polylin._forms.dplr.chunked

    module, name = {
        "delta": (polylin._forms.delta.chunked, "_block"),
        "dplr": (polylin._forms.dplr.chunked, "_chunks"),
    }[form]
    blocks = []
    inner = getattr(module, name)
    monkeypatch.setattr(
        module, name, lambda *a, **kw: blocks.append(kw.get("in_loop")) or inner(*a, **kw)
    )
    monkeypatch.setattr(polylin._forms.delta.chunked, "BLOCK_ROWS", 16)
    monkeypatch.setattr(polylin._forms.dplr.chunked, "BLOCK_ROWS", 16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 96, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(1, 96, 1, generator=g, dtype=torch.float64)

    def call(grad: bool) -> torch.Tensor:
        query = q.clone().requires_grad_(grad)
        if form == "delta":
            return polylin.delta_rule_attention(query, k, v, beta, chunk_size=8).detach()
        return polylin.dplr_delta_rule(query, k, v, -k * beta, k * beta, chunk_size=8).detach()

    before = torch.get_num_threads()
    results, counts, read_outs = [], [], []
    try:
        for threads, grad in ((1, False), (3, False), (3, True)):
            torch.set_num_threads(threads)
            blocks.clear()
            results.append(call(grad))
            counts.append(len(blocks))
            read_outs.append(set(blocks))
    finally:
        torch.set_num_threads(before)
    assert counts == [6, 2, 2]  # 96 tokens in blocks of 16, then of 48
    if form == "delta":  # in the loop but on more threads with a gradient to record
        assert read_outs == [{True}, {True}, {False}]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=1e-12, atol=1e-12)


def recording(fused, taken):
    """``fused`` (a ``_backend.ops`` fast path) that appends to ``taken`` whether it applied."""

    def spy(*args):
        result = fused(*args)
        taken.append(result is not None)
        return result

    return spy


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_fused_chunk_loop_matches_the_array_api_loop(rng, monkeypatch, gate):
    """On one PyTorch thread the loop over chunks with the read-out inside runs as products of
    three-dimensional views (``_backend.fused.fused_delta_chunks``): the same outputs, final
    state and gradients as the array-API loop, inside ``torch.func.grad`` too (where nothing
    is written in place); grouped heads (leading dimensions that broadcast) keep the array-API
    loop."""
    torch = needs(Backend.TORCH)
    chunked = polylin._forms.delta.chunked
    taken: list[bool] = []
    spy = recording(chunked.fused_delta_chunks, taken)

    q, k, v, beta, log_decay = make_inputs(rng, lead=(2, 3), length=40, d_k=8, d_v=6)
    if gate == "channel":
        log_decay = -rng.uniform(0.0, 0.7, k.shape)
    arrays = [q, k, v, beta] + ([] if gate is None else [log_decay])
    S0 = rng.standard_normal((2, 3, 8, 6))
    weight = torch.tensor(rng.standard_normal((2, 3, 40, 6)))

    def loss(q, *rest):
        *inputs, S = rest
        gates = {} if gate is None else {"log_decay": inputs[3]}
        out, state = delta_rule_attention(
            q, *inputs[:3], **gates, initial_state=S, chunk_size=8, return_state=True
        )
        return (out * weight).sum() + state.square().sum(), out, state

    def run_loop(use_fused: bool):
        monkeypatch.setattr(chunked, "fused_delta_chunks", spy if use_fused else lambda *a: None)
        xs = [torch.tensor(a, requires_grad=True) for a in [*arrays, S0]]
        total, out, state = loss(*xs)
        grads = torch.autograd.grad(total, xs)
        in_transform = torch.func.grad(lambda x: loss(x, *xs[1:])[0])(xs[0].detach())
        return [out.detach(), state.detach(), *grads, in_transform]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fast, loop = run_loop(True), run_loop(False)
        assert taken and all(taken)
        for a, b in zip(fast, loop):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        taken.clear()
        monkeypatch.setattr(chunked, "fused_delta_chunks", spy)
        rest = [torch.tensor(a) for a in arrays[1:4]]
        shared = torch.tensor(q[:, :1])  # one query per group of three heads
        grouped = delta_rule_attention(shared, *rest, chunk_size=8)
        assert taken and not any(taken)
        want = delta_rule_attention(shared.expand(q.shape).contiguous(), *rest, chunk_size=8)
        torch.testing.assert_close(grouped, want, rtol=1e-12, atol=1e-12)
    finally:
        torch.set_num_threads(before)
