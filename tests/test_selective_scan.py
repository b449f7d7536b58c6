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

from polylin import causal_linear_attention, selective_scan, selective_scan_step
from polylin.feature_maps import identity
from polylin.selective_scan import SELECTIVE_METHODS
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
    keep = (
        np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    )
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
@pytest.mark.parametrize("method", SELECTIVE_METHODS)
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


@pytest.mark.slow_grid(prefer={"first": "chunked"})
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
        token = [
            b["x"][:, t, ...],
            b["dt"][:, t, ...],
            b["A"],
            b["B"][:, t, ...],
            b["C"][:, t, ...],
        ]
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


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", SELECTIVE_METHODS)
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


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", SELECTIVE_METHODS)
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


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", SELECTIVE_METHODS)
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
    for method in SELECTIVE_METHODS:
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
    for method in SELECTIVE_METHODS:
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
    arrays, out_weight, state_weight = _loss_inputs(rng, length=5)
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]

    def loss(*xs):
        out, state = _scan(*xs, method="chunked", chunk_size=4)
        return (out * torch.tensor(out_weight)).sum() + (state * torch.tensor(state_weight)).sum()

    assert torch.autograd.gradcheck(loss, xs, eps=1e-6, atol=1e-6)


def test_gradients_jax(rng):
    """``jax.grad`` under ``jax.jit``: chunked == recurrent, wrt every input."""
    needs(Backend.JAX)
    import jax

    arrays, out_weight, state_weight = _loss_inputs(rng, length=5)
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
    keep = torch.tensor(mask)
    out = selective_scan(
        xs[0], xs[1], torch.tensor(A), xs[2], xs[3], dt_bias=bias, dt_softplus=True,
        attention_mask=keep, chunk_size=4,
    )  # fmt: skip
    grads = torch.autograd.grad(out.sum(), [*xs, bias])
    for g in grads[:4]:
        assert torch.all(torch.isfinite(g)) and torch.all(g[:3] == 0)
    assert torch.all(torch.isfinite(grads[4]))


def _transformers_inputs(torch, rng, length):
    """float32 inputs in transformers' layout (batch, D, T) and (batch, N, T)."""
    x, dt, A, B, C = make_inputs(rng, length=length)
    opts = extras(rng, length=length)
    ch_first = lambda a: torch.tensor(np.swapaxes(a, -1, -2), dtype=torch.float32)  # noqa: E731
    flat = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return {
        "x": ch_first(x), "dt": ch_first(dt), "A": flat(A), "B": ch_first(B),
        "C": ch_first(C), "D": flat(opts["D"]), "z": ch_first(opts["z"]),
        "dt_bias": flat(opts["dt_bias"]),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba", "zamba"])
def test_matches_transformers(rng, family):
    """transformers' ``mamba_selective_scan`` (its PyTorch fallback) on identical float32
    inputs: outputs, final states and gradients wrt every input."""
    torch = needs(Backend.TORCH)
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    a = _transformers_inputs(torch, rng, 40)
    results = {}
    for who in ("polylin", "transformers"):
        xs = {n: t.clone().requires_grad_(True) for n, t in a.items()}
        if who == "polylin":
            y, h = selective_scan(
                xs["x"].mT, xs["dt"].mT, xs["A"], xs["B"].mT, xs["C"].mT, D=xs["D"],
                z=xs["z"].mT, dt_bias=xs["dt_bias"], dt_softplus=True, chunk_size=8,
                return_state=True,
            )  # fmt: skip
            y = y.mT
        else:
            y, h = module.mamba_selective_scan(
                xs["x"], xs["dt"], xs["A"], xs["B"], xs["C"], D=xs["D"], z=xs["z"],
                delta_bias=xs["dt_bias"], delta_softplus=True, return_last_state=True,
            )  # fmt: skip
        grads = torch.autograd.grad((y * y).sum() + h.sum(), list(xs.values()))
        results[who] = (y, h, grads)
    ours, theirs = results["polylin"], results["transformers"]
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-4, atol=1e-5)
    for name, g, g_ref in zip(a, ours[2], theirs[2]):
        assert g_ref.abs().max() > 0, name
        torch.testing.assert_close(g, g_ref, rtol=1e-3, atol=1e-4, msg=name)


def test_step_matches_transformers_state_update(rng):
    """``mamba_selective_state_update`` after a prefill: the same output and state."""
    torch = needs(Backend.TORCH)
    from transformers.models.mamba.modeling_mamba import mamba_selective_state_update

    a = _transformers_inputs(torch, rng, 12)
    _, h = selective_scan(
        a["x"].mT[:, :11], a["dt"].mT[:, :11], a["A"], a["B"].mT[:, :11], a["C"].mT[:, :11],
        dt_bias=a["dt_bias"], dt_softplus=True, return_state=True,
    )  # fmt: skip
    theirs_state = h.clone()
    t = 11
    y_ref = mamba_selective_state_update(
        theirs_state, a["x"][..., t], a["dt"][..., t], a["A"], a["B"][..., t], a["C"][..., t],
        D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True, z=a["z"][..., t],
    )  # fmt: skip
    y, h = selective_scan_step(
        a["x"][..., t], a["dt"][..., t], a["A"], a["B"][..., t], a["C"][..., t], h, D=a["D"],
        z=a["z"][..., t], dt_bias=a["dt_bias"], dt_softplus=True,
    )  # fmt: skip
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, theirs_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gates", ["strong", "mixed"])
def test_float32_long_sequence_at_strong_gates(rng, gates):
    """float32 at T = 4096: within float32 round-off of the float64 loop, for decays down to
    exp(-hundreds) per token (strong) and for dt spanning seven orders of magnitude (mixed)."""
    length, channels, size = 4096, 4, 8
    x, _, _, B, C = make_inputs(rng, lead=(1,), length=length, channels=channels, size=size)
    A = -np.exp(rng.uniform(-1.0, 3.0, (channels, size)))  # |A| up to 20
    if gates == "strong":
        dt = rng.uniform(0.0, 10.0, (1, length, channels))
    else:
        dt = 10.0 ** rng.uniform(-4.0, 3.0, (1, length, channels))
    want, want_state = reference(x, dt, A, B, C)
    f32 = [a.astype(np.float32) for a in (x, dt, A, B, C)]
    for method in ("chunked", "recurrent"):
        out, state = selective_scan(*f32, method=method, return_state=True)
        assert out.dtype == np.float32
        scale = np.abs(want).max()
        np.testing.assert_allclose(out, want, atol=2e-5 * scale, rtol=0)
        np.testing.assert_allclose(state, want_state, atol=2e-5 * np.abs(want_state).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_accumulates_in_float32(rng, dtype):
    torch = needs(Backend.TORCH)
    from .reference import rounded

    x, dt, A, B, C = (rounded(a, dtype) for a in make_inputs(rng, length=70))
    want, want_state = reference(x, dt, A, B, C, dt_softplus=True)
    xs = [Backend.TORCH.from_numpy(a, dtype) for a in (x, dt, A, B, C)]
    out, state = selective_scan(*xs, dt_softplus=True, return_state=True)
    assert out.dtype == getattr(torch, dtype) and state.dtype == torch.float32
    atol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype] * np.abs(want).max()
    np.testing.assert_allclose(Backend.TORCH.to_numpy(out), want, atol=atol, rtol=0)
    np.testing.assert_allclose(Backend.TORCH.to_numpy(state), want_state, atol=1e-4, rtol=0)


def test_decays_never_amplify(rng):
    """dt below 0 and A above 0 are taken as 0 (a decay never amplifies the state), in every
    method alike."""
    x, dt, A, B, C = make_inputs(rng)
    A = A * np.where(rng.random(A.shape) < 0.3, -1.0, 1.0)  # some entries positive
    want, _ = reference(x, dt, A, B, C)  # dt has negative entries too
    for method in SELECTIVE_METHODS:
        out = selective_scan(x, dt, A, B, C, method=method, chunk_size=4)
        np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)


def _bad_call(rng, **change):
    x, dt, A, B, C = make_inputs(rng, length=5)
    arrays = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    arrays.update({k: v for k, v in change.items() if k in arrays})
    options = {k: v for k, v in change.items() if k not in arrays}
    return selective_scan(*arrays.values(), **options)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"dt": np.ones((2, 5, 4))}, ValueError, "dt has last axis 4; it must be 5"),
        ({"dt": np.ones((2, 6, 5))}, ValueError, "dt has sequence length 6 but x has 5"),
        ({"C": np.ones((2, 5, 4))}, ValueError, "C has last axis 4; it must be 3"),
        ({"A": np.ones((5, 4))}, ValueError, r"A must have shape \(..., D, N\)"),
        ({"A": np.ones(5)}, ValueError, "A must have at least 2 dimensions"),
        ({"D": np.ones(4)}, ValueError, "D has last axis 4"),
        ({"z": np.ones((2, 5, 4))}, ValueError, "z has last axis 4"),
        ({"dt_bias": np.ones(3)}, ValueError, "dt_bias has last axis 3"),
        ({"B": np.ones((2, 5, 3), np.float32)}, TypeError, "B has dtype float32 but x"),
        ({"x": np.ones((2, 5, 5), np.int64)}, TypeError, "x must have a real floating dtype"),
        ({"B": [[1.0]]}, TypeError, "B must be an array"),
        ({"C": np.ones((3, 5, 3))}, ValueError, "do not broadcast"),
        ({"method": "scan"}, ValueError, "method must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
        ({"dt_softplus": 1}, TypeError, "dt_softplus must be True or False"),
        ({"initial_state": np.ones((2, 5, 4))}, ValueError, "initial_state must have shape"),
        ({"initial_state": np.ones((2, 5, 3), np.float32)}, TypeError, "initial_state has"),
        ({"attention_mask": np.ones((2, 4), bool)}, ValueError, "attention_mask must have"),
    ],
)
def test_bad_input_names_the_argument(rng, change, error, match):
    with pytest.raises(error, match=match):
        _bad_call(rng, **change)


def test_bad_step_input_names_the_argument(rng):
    x, dt, A, B, C = (a[:, 0] if a.ndim == 3 else a for a in make_inputs(rng, length=1))
    with pytest.raises(ValueError, match="C_t has last axis 2"):
        selective_scan_step(x, dt, A, B, C[:, :2])
    with pytest.raises(ValueError, match="state must have shape"):
        selective_scan_step(x, dt, A, B, C, np.zeros((2, CH, N + 1)))
    with pytest.raises(TypeError, match="dt_t has dtype float32"):
        selective_scan_step(x, dt.astype(np.float32), A, B, C)


def test_inputs_are_not_modified(rng):
    x, dt, A, B, C = make_inputs(rng)
    opts = extras(rng)
    copies = [a.copy() for a in (x, dt, A, B, C, *opts.values())]
    selective_scan(x, dt, A, B, C, dt_softplus=True, return_state=True, **opts)
    for before, after in zip(copies, (x, dt, A, B, C, *opts.values())):
        np.testing.assert_array_equal(before, after)
