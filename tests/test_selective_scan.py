"""The selective scan (Mamba-1) against an independent float64 loop and transformers' code.

Every backend x method: outputs and final states (with the skip, the gate, the bias and
softplus, an initial state, A per head); any chunk size; split and resume; the step after a
chunked prefill; NaN padding; packed sequences; ``seq_axis``; gradients (PyTorch and JAX,
every method, and finite differences); transformers' ``mamba_selective_scan`` and
``mamba_selective_state_update`` on identical inputs (outputs, states, gradients); the
per-channel GLA form it equals; float32 at strong gates and long T; half precision; bad input.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import polylin
from polylin import causal_linear_attention, selective_scan, selective_scan_step
from polylin.feature_maps import identity
from polylin.testing import Backend

from .conftest import BACKENDS

T, CH, N = 13, 5, 3  # T not a multiple of the chunk sizes used
ATOL64 = 1e-10


def softplus(x):
    return np.logaddexp(0.0, x)


def reference(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
              state=None, mask=None):  # fmt: skip
    """The recurrence written plainly in float64, token by token: ``(y, final state)``.

    Leading dimensions of every argument broadcast; ``mask`` ``(..., T)``: a masked token
    leaves the state alone and outputs 0.
    """
    x, dt, B, C = (np.asarray(a, np.float64) for a in (x, dt, B, C))
    lead = np.broadcast_shapes(x.shape[:-2], dt.shape[:-2], B.shape[:-2], C.shape[:-2],
                               np.shape(A)[:-2])  # fmt: skip
    length, channels, size = x.shape[-2], x.shape[-1], B.shape[-1]
    x, dt = (np.broadcast_to(a, (*lead, length, channels)) for a in (x, dt))
    B, C = (np.broadcast_to(a, (*lead, length, size)) for a in (B, C))
    A = np.broadcast_to(np.minimum(A, 0.0), (*lead, channels, size))
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = softplus(dt)
    dt = np.maximum(dt, 0.0)
    keep = np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    h = np.zeros((*lead, channels, size)) if state is None else np.array(
        np.broadcast_to(state, (*lead, channels, size)), np.float64)  # fmt: skip
    y = np.zeros((*lead, length, channels))
    for index in np.ndindex(*lead):
        s = h[index]
        for t in range(length):
            if not keep[index][t]:
                continue
            d = dt[index][t]
            s = np.exp(d[:, None] * A[index]) * s + np.outer(d * x[index][t], B[index][t])
            out = s @ C[index][t]
            if D is not None:
                out = out + np.broadcast_to(D, (*lead, channels))[index] * x[index][t]
            if z is not None:
                g = np.broadcast_to(z, (*lead, length, channels))[index][t]
                out = out * g / (1.0 + np.exp(-g))
            y[index][t] = out
        h[index] = s
    return y, h


def make_inputs(rng, lead=(2,), length=T, channels=CH, size=N):
    x = rng.standard_normal((*lead, length, channels))
    dt = rng.standard_normal((*lead, length, channels)) - 0.5
    A = -np.exp(rng.standard_normal((channels, size)))
    B = rng.standard_normal((*lead, length, size))
    C = rng.standard_normal((*lead, length, size))
    return x, dt, A, B, C


def extras(rng, lead=(2,), length=T, channels=CH, size=N):
    """The optional arrays: skip, gate, bias, an initial state."""
    return {
        "D": rng.standard_normal(channels),
        "z": rng.standard_normal((*lead, length, channels)),
        "dt_bias": 0.3 * rng.standard_normal(channels),
        "initial_state": rng.standard_normal((*lead, channels, size)),
    }


def needs(backend):
    """The library module of ``backend``; skip unless it is selected and usable here."""
    if backend not in BACKENDS:
        pytest.skip(f"[{backend}] not selected in POLYLIN_BACKENDS")
    reason = backend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[{backend}] {reason}")
    return backend.module()


def run(backend, fn, *arrays, **options):
    """``fn`` on ``backend`` from NumPy inputs (NumPy options become the backend's arrays)."""
    arrays = [backend.from_numpy(a) for a in arrays]
    options = {n: backend.from_numpy(a) if isinstance(a, np.ndarray) else a
               for n, a in options.items()}  # fmt: skip
    return fn(*arrays, **options)


def close(backend, got, want, atol=ATOL64):
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=atol, rtol=0)


@pytest.mark.slow_grid(cover=("method", "case"))
@pytest.mark.parametrize("method", polylin.SELECTIVE_METHODS)
@pytest.mark.parametrize("case", ["plain", "full", "heads"])
def test_matches_reference(backend, rng, method, case):
    x, dt, A, B, C = make_inputs(rng)
    options = {}
    if case == "full":
        options = {**extras(rng), "dt_softplus": True}
    elif case == "heads":  # Zamba's heads: (batch, heads, T, D), A per head, B shared by heads
        x, dt = (rng.standard_normal((2, 3, T, CH)) for _ in range(2))
        A = -np.exp(rng.standard_normal((3, CH, N)))
        B, C = B[:, None], C[:, None]
        options = {"dt_softplus": True}
    state0 = options.pop("initial_state", None)
    want, want_state = reference(x, dt, A, B, C, state=state0, **options)
    out, state = run(backend, selective_scan, x, dt, A, B, C, method=method, chunk_size=4,
                     initial_state=state0, return_state=True, **options)  # fmt: skip
    like = backend.from_numpy(x)
    assert type(out) is type(like) and out.dtype == like.dtype and state.dtype == like.dtype
    assert tuple(out.shape) == want.shape and tuple(state.shape) == want_state.shape
    close(backend, out, want)
    close(backend, state, want_state)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16, 64, None])
def test_any_chunk_size(rng, chunk_size):
    x, dt, A, B, C = make_inputs(rng, length=37)
    want, want_state = reference(x, dt, A, B, C, dt_softplus=True)
    out, state = selective_scan(x, dt, A, B, C, dt_softplus=True, chunk_size=chunk_size,
                                return_state=True)  # fmt: skip
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


def test_equals_the_per_channel_gla_form(rng):
    """The derivation of the docs page: per channel, GLA with key B, query C, a decay per
    state index dt A, and the one-number value dt x (channels as heads)."""
    x, dt, A, B, C = make_inputs(rng)
    dt = softplus(dt)
    want = selective_scan(x, dt, A, B, C)
    heads = lambda a: np.broadcast_to(a[:, None], (2, CH, T, a.shape[-1]))  # noqa: E731
    v = np.swapaxes(dt * x, 1, 2)[..., None]  # (batch, D, T, 1)
    g = np.swapaxes(dt, 1, 2)[..., None] * A[:, None, :]  # (batch, D, T, N)
    out = causal_linear_attention(heads(C), heads(B), v, identity, log_decay=g, normalize=False)
    np.testing.assert_allclose(np.swapaxes(out[..., 0], 1, 2), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("first, second", [("chunked", "recurrent"), ("quadratic", "chunked")])
def test_split_and_resume(backend, rng, first, second):
    x, dt, A, B, C = make_inputs(rng)
    want, want_state = reference(x, dt, A, B, C, dt_softplus=True)
    cut = 6
    piece = lambda a, s: a[..., s, :]  # noqa: E731
    y1, h = run(backend, selective_scan, *(piece(a, slice(cut)) for a in (x, dt)), A,
                *(piece(a, slice(cut)) for a in (B, C)), dt_softplus=True, method=first,
                chunk_size=4, return_state=True)  # fmt: skip
    rest = [backend.from_numpy(piece(a, slice(cut, None))) for a in (x, dt, B, C)]
    y2, h = selective_scan(rest[0], rest[1], backend.from_numpy(A), rest[2], rest[3],
                           dt_softplus=True, method=second, chunk_size=4, initial_state=h,
                           return_state=True)  # fmt: skip
    close(backend, y1, want[:, :cut, ...])
    close(backend, y2, want[:, cut:])
    close(backend, h, want_state)


def test_step_continues_a_chunked_prefill(backend, rng):
    x, dt, A, B, C = make_inputs(rng)
    opts = extras(rng)
    opts.pop("initial_state")
    want, want_state = reference(x, dt, A, B, C, dt_softplus=True, **opts)
    b = {name: backend.from_numpy(a) for name, a in
         dict(x=x, dt=dt, A=A, B=B, C=C, **opts).items()}  # fmt: skip
    params = {"D": b["D"], "dt_bias": b["dt_bias"], "dt_softplus": True}
    cut = 9
    head = [b[n][:, :cut, ...] for n in ("x", "dt")] + [b["A"]] + [b[n][:, :cut, ...] for n in "BC"]
    _, h = selective_scan(*head, z=b["z"][:, :cut, ...], return_state=True, **params)
    for t in range(cut, T):
        token = [b["x"][:, t, ...], b["dt"][:, t, ...], b["A"], b["B"][:, t, ...], b["C"][:, t, ...]]
        y_t, h = selective_scan_step(*token, h, z=b["z"][:, t, ...], **params)
        close(backend, y_t, want[:, t, ...])
    close(backend, h, want_state)


def test_step_from_zero_and_shared_state(rng):
    x, dt, A, B, C = make_inputs(rng, length=1)
    want, want_state = reference(x, dt, A, B, C)
    y, h = selective_scan_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    np.testing.assert_allclose(y, want[:, 0], atol=ATOL64, rtol=0)
    np.testing.assert_allclose(h, want_state, atol=ATOL64, rtol=0)
    shared = rng.standard_normal((CH, N))  # one state for the whole batch broadcasts
    y, h = selective_scan_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], shared)
    want, want_state = reference(x, dt, A, B, C, state=shared)
    np.testing.assert_allclose(y, want[:, 0], atol=ATOL64, rtol=0)
    assert h.shape == (2, CH, N)


@pytest.mark.parametrize("method", polylin.SELECTIVE_METHODS)
def test_padding(backend, rng, method):
    """Left and right padding holding NaN: the real tokens' outputs and the final state are
    those of the unpadded sequences; padded outputs are exactly 0."""
    x, dt, A, B, C = make_inputs(rng)
    opts = extras(rng)
    opts.pop("initial_state")
    mask = np.ones((2, T), bool)
    mask[0, :4] = False  # left padding
    mask[1, -3:] = False  # right padding
    want, want_state = reference(x, dt, A, B, C, dt_softplus=True, mask=mask, **opts)
    nan = lambda a: np.where(mask[..., None], a, np.nan)  # noqa: E731
    out, state = run(backend, selective_scan, nan(x), nan(dt), A, nan(B), nan(C),
                     dt_softplus=True, attention_mask=mask, method=method, chunk_size=4,
                     return_state=True, D=opts["D"], z=nan(opts["z"]),
                     dt_bias=opts["dt_bias"])  # fmt: skip
    got = backend.to_numpy(out)
    assert np.all(got[~mask] == 0)
    np.testing.assert_allclose(got, want, atol=ATOL64, rtol=0)
    close(backend, state, want_state)


@pytest.mark.parametrize("method", polylin.SELECTIVE_METHODS)
def test_cu_seqlens(backend, rng, method):
    """Packed sequences, each from its own initial state, with A per head."""
    offsets = [0, 5, 5, 11, T]  # an empty sequence included
    x, dt, _, B, C = make_inputs(rng, lead=(1, 2))  # (1, heads, T, d)
    A = -np.exp(rng.standard_normal((2, CH, N)))
    D = rng.standard_normal((2, CH))
    n = len(offsets) - 1
    h0 = rng.standard_normal((1, 2, n, CH, N))
    out, state = run(backend, selective_scan, x, dt, A, B, C, D=D, dt_softplus=True,
                     initial_state=h0, cu_seqlens=offsets, method=method, chunk_size=4,
                     return_state=True)  # fmt: skip
    got, got_state = backend.to_numpy(out), backend.to_numpy(state)
    assert got.shape == (1, 2, T, CH) and got_state.shape == (1, 2, n, CH, N)
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        piece = [v[..., a:b, :] for v in (x, dt, B, C)]
        want, want_state = reference(piece[0], piece[1], A, piece[2], piece[3],
                                     D=D[:, None, :][:, 0], dt_softplus=True,
                                     state=h0[:, :, i])  # fmt: skip
        np.testing.assert_allclose(got[..., a:b, :], want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(got_state[:, :, i], want_state, atol=ATOL64, rtol=0)


@pytest.mark.parametrize("method", polylin.SELECTIVE_METHODS)
def test_seq_axis(backend, rng, method):
    """(T, batch, d) inputs with seq_axis=0; the output keeps the layout."""
    x, dt, A, B, C = make_inputs(rng)
    want, want_state = reference(x, dt, A, B, C, dt_softplus=True)
    tbd = [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in (x, dt, B, C)]
    out, state = run(backend, selective_scan, tbd[0], tbd[1], A, tbd[2], tbd[3],
                     dt_softplus=True, seq_axis=0, method=method, chunk_size=4,
                     return_state=True)  # fmt: skip
    close(backend, out, np.swapaxes(want, 0, 1))
    close(backend, state, want_state)


def test_empty_sequence_returns_a_copy_of_the_state(rng):
    x, dt, A, B, C = make_inputs(rng, length=0)
    h0 = rng.standard_normal((2, CH, N))
    for method in polylin.SELECTIVE_METHODS:
        out, h = selective_scan(x, dt, A, B, C, initial_state=h0, method=method,
                                return_state=True)  # fmt: skip
        assert out.shape == (2, 0, CH) and h is not h0
        np.testing.assert_array_equal(h, h0)


def _loss_inputs(rng, length=11):
    x, dt, A, B, C = make_inputs(rng, length=length)
    opts = extras(rng, length=length)
    arrays = [x, dt, A, B, C, opts["D"], opts["z"], opts["dt_bias"], opts["initial_state"]]
    return arrays, rng.standard_normal((2, length, CH)), rng.standard_normal((2, CH, N))


def _scan(x, dt, A, B, C, D, z, dt_bias, h0, *, method, chunk_size=4):
    return selective_scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                          initial_state=h0, method=method, chunk_size=chunk_size,
                          return_state=True)  # fmt: skip


def test_gradients_torch(rng):
    """Gradients wrt every input: each method equals the recurrent one (float64)."""
    torch = needs(Backend.TORCH)
    arrays, out_weight, state_weight = _loss_inputs(rng)
    grads = {}
    for method in polylin.SELECTIVE_METHODS:
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        out, state = _scan(*xs, method=method)
        loss = (out * torch.tensor(out_weight)).sum() + (state * torch.tensor(state_weight)).sum()
        grads[method] = [g.numpy() for g in torch.autograd.grad(loss, xs)]
    for method in ("chunked", "quadratic"):
        for got, recurrent in zip(grads[method], grads["recurrent"]):
            assert np.all(np.isfinite(got)) and np.abs(recurrent).max() > 0
            np.testing.assert_allclose(got, recurrent, atol=1e-10, rtol=0)


def test_gradients_torch_match_finite_differences(rng):
    torch = needs(Backend.TORCH)
    arrays, out_weight, state_weight = _loss_inputs(rng, length=6)
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]

    def loss(*xs):
        out, state = _scan(*xs, method="chunked", chunk_size=4)
        return (out * torch.tensor(out_weight)).sum() + (state * torch.tensor(state_weight)).sum()

    assert torch.autograd.gradcheck(loss, xs, eps=1e-6, atol=1e-6)


def test_gradients_jax(rng):
    """``jax.grad`` under ``jax.jit``: chunked == recurrent, wrt every input."""
    needs(Backend.JAX)
    import jax

    arrays, out_weight, state_weight = _loss_inputs(rng, length=7)
    xs = [Backend.JAX.from_numpy(a) for a in arrays]

    def loss(*xs, method):
        out, state = _scan(*xs, method=method)
        return (out * out_weight).sum() + (state * state_weight).sum()

    grads = {
        m: jax.jit(jax.grad(lambda *a, m=m: loss(*a, method=m), argnums=tuple(range(9))))(*xs)
        for m in ("chunked", "recurrent")
    }
    for chunked, recurrent in zip(grads["chunked"], grads["recurrent"]):
        assert np.abs(np.asarray(recurrent)).max() > 0
        np.testing.assert_allclose(np.asarray(chunked), np.asarray(recurrent), atol=1e-10, rtol=0)


def test_gradients_are_finite_with_nan_padding(rng):
    torch = needs(Backend.TORCH)
    x, dt, A, B, C = make_inputs(rng, lead=(1,), length=9)
    mask = np.arange(9) >= 3
    arrays = [np.where(mask[:, None], a[0], np.nan) for a in (x, dt, B, C)]
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    bias = torch.tensor(rng.standard_normal(CH), requires_grad=True)
    out = selective_scan(xs[0], xs[1], torch.tensor(A), xs[2], xs[3], dt_bias=bias,
                         dt_softplus=True, attention_mask=torch.tensor(mask), chunk_size=4)  # fmt: skip
    grads = torch.autograd.grad(out.sum(), [*xs, bias])
    for g in grads[:4]:
        assert torch.all(torch.isfinite(g)) and torch.all(g[:3] == 0)
    assert torch.all(torch.isfinite(grads[4]))
