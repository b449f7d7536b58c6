"""The elementwise linear recurrence and RG-LRU against an independent float64 loop and
transformers' RecurrentGemma code.

Every backend x method: states and final states (with an initial state, ``log_a`` per token or
per channel, ``-inf`` resets, RG-LRU's gates and resets); any chunk size; split and resume;
steps after a prefill; NaN padding; packed sequences; ``seq_axis``; gradients (PyTorch and
JAX under jit, every method, and finite differences); transformers' ``_rnn_scan`` and
``RecurrentGemmaRglru`` on identical inputs (outputs, states, gradients); float32 at strong
gates and long T; half precision; bad input; inputs not modified.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from polylin import linear_scan, linear_scan_step, rg_lru, rg_lru_step
from polylin.linear_scan import LINEAR_SCAN_METHODS
from polylin.testing import Backend

from .conftest import BACKENDS

T, CH = 13, 5  # T not a multiple of the chunk sizes used
ATOL64 = 1e-10


def softplus(x):
    return np.logaddexp(0.0, x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def reference(x, log_a, *, state=None, mask=None):
    """``h_t = exp(log_a_t) h_{t-1} + x_t`` plainly in float64, token by token:
    ``(every state, last state)``. ``mask`` ``(..., T)``: a masked token leaves the state
    alone and outputs 0."""
    x, log_a = np.asarray(x, np.float64), np.minimum(np.asarray(log_a, np.float64), 0.0)
    lead = np.broadcast_shapes(x.shape[:-2], log_a.shape[:-2])
    length, channels = x.shape[-2], x.shape[-1]
    x, log_a = (np.broadcast_to(a, (*lead, length, channels)) for a in (x, log_a))
    keep = (
        np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    )
    h = np.zeros((*lead, channels)) if state is None else np.array(
        np.broadcast_to(state, (*lead, channels)), np.float64)  # fmt: skip
    y = np.zeros((*lead, length, channels))
    for index in np.ndindex(*lead):
        s = h[index]
        for t in range(length):
            if keep[index][t]:
                s = np.exp(log_a[index][t]) * s + x[index][t]
                y[index][t] = s
        h[index] = s
    return y, h


def rg_lru_reference(x, i_gate, r_gate, param, *, c=8.0, reset=None, state=None, mask=None):
    """RG-LRU as Griffin writes it, in float64: the gates, then :func:`reference`."""
    log_a = -c * softplus(param) * sigmoid(r_gate)
    b = np.sqrt(1.0 - np.exp(2.0 * log_a)) * sigmoid(i_gate) * x
    if reset is not None:
        b = np.where(reset, sigmoid(i_gate) * x, b)
        log_a = np.where(reset, -np.inf, log_a)
    return reference(b, log_a, state=state, mask=mask)


def make_inputs(rng, lead=(2,), length=T, channels=CH):
    x = rng.standard_normal((*lead, length, channels))
    log_a = -np.exp(rng.standard_normal((*lead, length, channels)))
    return x, log_a


def make_gates(rng, lead=(2,), length=T, channels=CH):
    x, i_gate, r_gate = (rng.standard_normal((*lead, length, channels)) for _ in range(3))
    return x, i_gate, r_gate, rng.standard_normal(channels)


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
@pytest.mark.parametrize("method", LINEAR_SCAN_METHODS)
@pytest.mark.parametrize("case", ["plain", "shared", "resets", "rg_lru"])
def test_matches_reference(backend, rng, method, case):
    x, log_a = make_inputs(rng)
    state0 = rng.standard_normal((2, CH))
    if case == "rg_lru":
        x, i_gate, r_gate, param = make_gates(rng)
        reset = np.zeros((2, T, 1), bool)
        reset[0, 0], reset[1, 6] = True, True
        want, want_state = rg_lru_reference(x, i_gate, r_gate, param, reset=reset, state=state0)
        out, state = run(backend, rg_lru, x, i_gate, r_gate, param, reset=reset, method=method,
                         chunk_size=4, initial_state=state0, return_state=True)  # fmt: skip
    else:
        if case == "shared":  # one decay per token, shared by the channels
            log_a = log_a[..., :1]
        elif case == "resets":  # -inf drops the state exactly
            log_a[0, 0], log_a[1, 5, 2], log_a[1, 7] = -np.inf, -np.inf, -np.inf
        want, want_state = reference(x, log_a, state=state0)
        out, state = run(backend, linear_scan, x, log_a, method=method, chunk_size=4,
                         initial_state=state0, return_state=True)  # fmt: skip
    like = backend.from_numpy(x)
    assert type(out) is type(like) and out.dtype == like.dtype and state.dtype == like.dtype
    assert tuple(out.shape) == want.shape and tuple(state.shape) == want_state.shape
    close(backend, out, want)
    close(backend, state, want_state)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16, 64, None])
def test_any_chunk_size(rng, chunk_size):
    x, log_a = make_inputs(rng, length=37)
    want, want_state = reference(x, log_a)
    out, state = linear_scan(x, log_a, chunk_size=chunk_size, return_state=True)
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


def test_heads_broadcast(rng):
    """Leading dimensions broadcast: one Lambda per head against (batch, heads, T, D)."""
    x, i_gate, r_gate, _ = make_gates(rng, lead=(2, 3))
    param = rng.standard_normal((3, CH))
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param[:, None, :])
    for method in LINEAR_SCAN_METHODS:
        out, state = rg_lru(x, i_gate, r_gate, param, method=method, chunk_size=4,
                            return_state=True)  # fmt: skip
        np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid(prefer={"first": "chunked"})
@pytest.mark.parametrize("first, second", [("chunked", "recurrent"), ("quadratic", "chunked")])
def test_split_and_resume(backend, rng, first, second):
    x, i_gate, r_gate, param = make_gates(rng)
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param)
    cut = 6
    y1, h = run(backend, rg_lru, *(a[:, :cut] for a in (x, i_gate, r_gate)), param,
                method=first, chunk_size=4, return_state=True)  # fmt: skip
    rest = [backend.from_numpy(a[:, cut:]) for a in (x, i_gate, r_gate)]
    y2, h = rg_lru(*rest, backend.from_numpy(param), method=second, chunk_size=4,
                   initial_state=h, return_state=True)  # fmt: skip
    close(backend, y1, want[:, :cut])
    close(backend, y2, want[:, cut:])
    close(backend, h, want_state)


def test_steps_continue_a_prefill(backend, rng):
    """rg_lru_step and linear_scan_step after a chunked prefill: every output and the state."""
    x, i_gate, r_gate, param = make_gates(rng)
    reset = np.zeros((2, T, 1), bool)
    reset[1, 10] = True  # a reset while decoding
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param, reset=reset)
    b = {n: backend.from_numpy(a) for n, a in
         dict(x=x, i=i_gate, r=r_gate, param=param, reset=reset).items()}  # fmt: skip
    cut = 8
    _, h = rg_lru(b["x"][:, :cut, ...], b["i"][:, :cut, ...], b["r"][:, :cut, ...], b["param"],
                  return_state=True)  # fmt: skip
    for t in range(cut, T):
        y_t, h = rg_lru_step(b["x"][:, t, ...], b["i"][:, t, ...], b["r"][:, t, ...], b["param"],
                             h, reset=b["reset"][:, t, ...])  # fmt: skip
        close(backend, y_t, want[:, t])
    close(backend, h, want_state)
    x, log_a = make_inputs(rng)
    want, want_state = reference(x, log_a)
    _, h = run(backend, linear_scan, x[:, :cut], log_a[:, :cut], return_state=True)
    for t in range(cut, T):
        y_t, h = linear_scan_step(backend.from_numpy(x[:, t]), backend.from_numpy(log_a[:, t]), h)
        close(backend, y_t, want[:, t])
    close(backend, h, want_state)


def test_step_from_zero(rng):
    x, i_gate, r_gate, param = make_gates(rng, length=1)
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param)
    y, h = rg_lru_step(x[:, 0], i_gate[:, 0], r_gate[:, 0], param)
    np.testing.assert_allclose(y, want[:, 0], atol=ATOL64, rtol=0)
    np.testing.assert_allclose(h, want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", LINEAR_SCAN_METHODS)
def test_padding(backend, rng, method):
    """Left and right padding holding NaN: the real tokens' outputs and the final state are
    those of the unpadded sequences; padded outputs are exactly 0."""
    x, i_gate, r_gate, param = make_gates(rng)
    mask = np.ones((2, T), bool)
    mask[0, :4] = False  # left padding
    mask[1, -3:] = False  # right padding
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param, mask=mask)
    nan = lambda a: np.where(mask[..., None], a, np.nan)  # noqa: E731
    out, state = run(backend, rg_lru, nan(x), nan(i_gate), nan(r_gate), param,
                     attention_mask=mask, method=method, chunk_size=4,
                     return_state=True)  # fmt: skip
    got = backend.to_numpy(out)
    assert np.all(got[~mask] == 0)
    np.testing.assert_allclose(got, want, atol=ATOL64, rtol=0)
    close(backend, state, want_state)
    x, log_a = make_inputs(rng)
    want, want_state = reference(x, log_a, mask=mask)
    out, state = run(backend, linear_scan, nan(x), nan(log_a), attention_mask=mask,
                     method=method, chunk_size=4, return_state=True)  # fmt: skip
    close(backend, out, want)
    close(backend, state, want_state)


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", LINEAR_SCAN_METHODS)
def test_cu_seqlens(backend, rng, method):
    """Packed sequences, each from its own initial state, with Lambda per head."""
    offsets = [0, 5, 5, 11, T]  # an empty sequence included
    x, i_gate, r_gate, _ = make_gates(rng, lead=(1, 2))  # (1, heads, T, d)
    param = rng.standard_normal((2, CH))
    n = len(offsets) - 1
    h0 = rng.standard_normal((1, 2, n, CH))
    out, state = run(backend, rg_lru, x, i_gate, r_gate, param, initial_state=h0,
                     cu_seqlens=offsets, method=method, chunk_size=4,
                     return_state=True)  # fmt: skip
    got, got_state = backend.to_numpy(out), backend.to_numpy(state)
    assert got.shape == (1, 2, T, CH) and got_state.shape == (1, 2, n, CH)
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        piece = [v[..., a:b, :] for v in (x, i_gate, r_gate)]
        want, want_state = rg_lru_reference(*piece, param[:, None, :], state=h0[:, :, i])
        np.testing.assert_allclose(got[..., a:b, :], want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(got_state[:, :, i], want_state, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", LINEAR_SCAN_METHODS)
def test_seq_axis(backend, rng, method):
    """(T, batch, d) inputs with seq_axis=0; the output keeps the layout."""
    x, i_gate, r_gate, param = make_gates(rng)
    reset = np.zeros((2, T, 1), bool)
    reset[:, 3] = True
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param, reset=reset)
    tbd = [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in (x, i_gate, r_gate, reset)]
    out, state = run(backend, rg_lru, *tbd[:3], param, reset=tbd[3], seq_axis=0,
                     method=method, chunk_size=4, return_state=True)  # fmt: skip
    close(backend, out, np.swapaxes(want, 0, 1))
    close(backend, state, want_state)


def test_empty_sequence_returns_a_copy_of_the_state(rng):
    x, log_a = make_inputs(rng, length=0)
    h0 = rng.standard_normal((2, CH))
    for method in LINEAR_SCAN_METHODS:
        out, h = linear_scan(x, log_a, initial_state=h0, method=method, return_state=True)
        assert out.shape == (2, 0, CH) and h is not h0
        np.testing.assert_array_equal(h, h0)


def _loss_inputs(rng, length=11):
    x, i_gate, r_gate, param = make_gates(rng, length=length)
    h0 = rng.standard_normal((2, CH))
    return [x, i_gate, r_gate, param, h0], rng.standard_normal((2, length, CH))


def _rg(x, i_gate, r_gate, param, h0, *, method, reset=None, chunk_size=4):
    return rg_lru(x, i_gate, r_gate, param, initial_state=h0, reset=reset, method=method,
                  chunk_size=chunk_size, return_state=True)  # fmt: skip


def test_gradients_torch(rng):
    """Gradients wrt every input (with resets): each method equals the recurrent one."""
    torch = needs(Backend.TORCH)
    arrays, out_weight = _loss_inputs(rng)
    reset = torch.zeros((2, 11, 1), dtype=torch.bool)
    reset[0, 4] = True
    grads = {}
    for method in LINEAR_SCAN_METHODS:
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        out, state = _rg(*xs, method=method, reset=reset)
        loss = (out * torch.tensor(out_weight)).sum() + (state * state).sum()
        grads[method] = [g.numpy() for g in torch.autograd.grad(loss, xs)]
    for method in ("chunked", "quadratic"):
        for got, recurrent in zip(grads[method], grads["recurrent"]):
            assert np.all(np.isfinite(got)) and np.abs(recurrent).max() > 0
            np.testing.assert_allclose(got, recurrent, atol=1e-10, rtol=0)


def test_gradients_torch_match_finite_differences(rng):
    torch = needs(Backend.TORCH)
    arrays, out_weight = _loss_inputs(rng, length=6)
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]

    def loss(*xs):
        out, state = _rg(*xs, method="chunked", chunk_size=4)
        return (out * torch.tensor(out_weight)).sum() + (state * state).sum()

    assert torch.autograd.gradcheck(loss, xs, eps=1e-6, atol=1e-6)


def test_gradients_jax(rng):
    """``jax.grad`` under ``jax.jit``: chunked and quadratic == recurrent, wrt every input."""
    needs(Backend.JAX)
    import jax

    arrays, out_weight = _loss_inputs(rng, length=7)
    xs = [Backend.JAX.from_numpy(a) for a in arrays]
    reset = Backend.JAX.from_numpy(np.arange(7)[None, :, None] == 3)

    def loss(*xs, method):
        out, state = _rg(*xs, method=method, reset=reset)
        return (out * out_weight).sum() + (state * state).sum()

    grads = {
        m: jax.jit(jax.grad(lambda *a, m=m: loss(*a, method=m), argnums=tuple(range(5))))(*xs)
        for m in LINEAR_SCAN_METHODS
    }
    for m in ("chunked", "quadratic"):
        for got, recurrent in zip(grads[m], grads["recurrent"]):
            assert np.all(np.isfinite(np.asarray(got))) and np.abs(np.asarray(recurrent)).max() > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(recurrent), atol=1e-10, rtol=0)


def test_gradients_are_finite_with_nan_padding(rng):
    torch = needs(Backend.TORCH)
    x, i_gate, r_gate, param = make_gates(rng, lead=(1,), length=9)
    mask = np.arange(9) >= 3
    arrays = [np.where(mask[:, None], a[0], np.nan) for a in (x, i_gate, r_gate)]
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    p = torch.tensor(param, requires_grad=True)
    out = rg_lru(*xs, p, attention_mask=torch.tensor(mask), chunk_size=4)
    grads = torch.autograd.grad(out.sum(), [*xs, p])
    for g in grads[:3]:
        assert torch.all(torch.isfinite(g)) and torch.all(g[:3] == 0)
    assert torch.all(torch.isfinite(grads[3]))


def _rglru_module(torch, rng, width=8, heads=2):
    """transformers' ``RecurrentGemmaRglru`` with random float32 parameters."""
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    config = RecurrentGemmaConfig(lru_width=width, num_attention_heads=heads, hidden_size=width)
    module = RecurrentGemmaRglru(config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.tensor(rng.standard_normal(tuple(p.shape)) * 0.5, dtype=torch.float32))
    return module


def _gates(torch, module, x):
    """The module's gate pre-activations: its block-diagonal linear maps."""
    batch, length, width = x.shape
    heads = module.num_attention_heads
    blocks = x.reshape(batch, length, heads, width // heads)
    i_gate = torch.einsum("bthi,hij->bthj", blocks, module.input_gate_weight)
    r_gate = torch.einsum("bthi,hij->bthj", blocks, module.recurrent_gate_weight)
    i_gate = (i_gate + module.input_gate_bias).reshape(batch, length, width)
    r_gate = (r_gate + module.recurrent_gate_bias).reshape(batch, length, width)
    return i_gate, r_gate


def test_matches_transformers_rglru(rng):
    """``RecurrentGemmaRglru.forward`` (its ``_rnn_scan`` loop) on identical float32 inputs,
    with a reset inside the batch (position 0 of a second document): outputs, the last state,
    gradients wrt the input and every parameter; then one decoding step on its state."""
    torch = needs(Backend.TORCH)
    module = _rglru_module(torch, rng)
    x = torch.tensor(rng.standard_normal((2, 40, 8)), dtype=torch.float32)
    position_ids = torch.arange(40)[None].repeat(2, 1)
    position_ids[1, 17:] = torch.arange(23)  # a new document at token 17
    results = {}
    for who in ("polylin", "transformers"):
        xs = x.clone().requires_grad_(True)
        module.recurrent_states = None
        if who == "polylin":
            i_gate, r_gate = _gates(torch, module, xs)
            y, h = rg_lru(xs, i_gate, r_gate, module.recurrent_param,
                          reset=(position_ids == 0)[..., None], chunk_size=8,
                          return_state=True)  # fmt: skip
        else:
            y = module(xs, position_ids)
            h = module.recurrent_states
        params = [xs, *module.parameters()]
        grads = torch.autograd.grad((y * y).sum() + h.sum(), params)
        results[who] = (y, h, grads)
    ours, theirs = results["polylin"], results["transformers"]
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    names = ["x", *(n for n, _ in module.named_parameters())]
    for name, g, g_ref in zip(names, ours[2], theirs[2]):
        assert g_ref.abs().max() > 0, name
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5, msg=name)
    # one decoding step from the state both computed
    x_t = torch.tensor(rng.standard_normal((2, 1, 8)), dtype=torch.float32)
    with torch.no_grad():
        module.recurrent_states = theirs[1].detach()
        y_ref = module(x_t, torch.full((2, 1), 40))
        i_gate, r_gate = _gates(torch, module, x_t)
        y, h = rg_lru_step(x_t[:, 0], i_gate[:, 0], r_gate[:, 0], module.recurrent_param,
                           ours[1].detach())  # fmt: skip
    torch.testing.assert_close(y, y_ref[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, module.recurrent_states, rtol=1e-5, atol=1e-6)


def test_matches_transformers_rnn_scan(rng):
    """``_rnn_scan`` itself (a given ``a`` and input, a reset, an initial state) against
    :func:`linear_scan` with ``log_a = log(a)``, ``-inf`` at the reset."""
    torch = needs(Backend.TORCH)
    module = _rglru_module(torch, rng)
    a = torch.tensor(rng.uniform(0.05, 0.999, (2, 30, 8)), dtype=torch.float32)
    b = torch.tensor(rng.standard_normal((2, 30, 8)), dtype=torch.float32)
    reset = torch.zeros((2, 30, 1), dtype=torch.bool)
    reset[0, 12] = True
    h0 = torch.tensor(rng.standard_normal((2, 8)), dtype=torch.float32)
    y_ref, h_ref = module._rnn_scan(b, a, reset, h0)
    log_a = torch.where(reset, -torch.inf, torch.log(a))
    y, h = linear_scan(b, log_a, initial_state=h0, return_state=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gates", ["strong", "near_one"])
def test_float32_long_sequence_at_strong_gates(rng, gates):
    """float32 at T = 4096 within float32 round-off of the float64 loop: decays down to
    exp(-50) per token (strong), and a up to 1 - 1e-6 (near_one: RG-LRU's long memory, where
    sqrt(1 - a^2) must not cancel)."""
    length = 4096
    x, i_gate, r_gate, _ = make_gates(rng, lead=(1,), length=length, channels=4)
    if gates == "strong":
        param = np.array([1.0, 3.0, 5.0, 6.0])  # c softplus(Lambda) up to about 48
    else:
        param = np.array([-14.0, -12.0, -9.0, -6.0])  # log a down to about -7e-6
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param)
    f32 = [a.astype(np.float32) for a in (x, i_gate, r_gate, param)]
    for method in ("chunked", "recurrent"):
        out, state = rg_lru(*f32, method=method, return_state=True)
        assert out.dtype == np.float32
        scale = np.abs(want).max()
        np.testing.assert_allclose(out, want, atol=2e-5 * scale, rtol=0)
        np.testing.assert_allclose(state, want_state, atol=2e-5 * np.abs(want_state).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_accumulates_in_float32(rng, dtype):
    torch = needs(Backend.TORCH)
    from .reference import rounded

    x, i_gate, r_gate, param = (rounded(a, dtype) for a in make_gates(rng, length=70))
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param)
    xs = [Backend.TORCH.from_numpy(a, dtype) for a in (x, i_gate, r_gate)]
    out, state = rg_lru(*xs, torch.tensor(param, dtype=torch.float32), return_state=True)
    assert out.dtype == getattr(torch, dtype) and state.dtype == torch.float32
    atol = {"float16": 4e-3, "bfloat16": 3e-2}[dtype] * np.abs(want).max()
    np.testing.assert_allclose(Backend.TORCH.to_numpy(out), want, atol=atol, rtol=0)
    np.testing.assert_allclose(Backend.TORCH.to_numpy(state), want_state, atol=1e-4, rtol=0)


def test_decays_never_amplify(rng):
    """log_a above 0 is taken as 0, in every method alike."""
    x, log_a = make_inputs(rng)
    log_a = log_a * np.where(rng.random(log_a.shape) < 0.3, -1.0, 1.0)
    want, _ = reference(x, log_a)
    for method in LINEAR_SCAN_METHODS:
        out = linear_scan(x, log_a, method=method, chunk_size=4)
        np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)


def _bad_call(rng, **change):
    x, i_gate, r_gate, param = make_gates(rng, length=5)
    arrays = {"x": x, "input_gate": i_gate, "recurrent_gate": r_gate, "recurrent_param": param}
    arrays.update({k: v for k, v in change.items() if k in arrays})
    options = {k: v for k, v in change.items() if k not in arrays}
    return rg_lru(*arrays.values(), **options)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"input_gate": np.ones((2, 5, 4))}, ValueError, "input_gate has last axis 4; it mu"),
        ({"recurrent_gate": np.ones((2, 6, 5))}, ValueError, "recurrent_gate has sequence len"),
        ({"recurrent_param": np.ones(4)}, ValueError, "recurrent_param has last axis 4"),
        ({"recurrent_param": np.ones(1)}, ValueError, "recurrent_param has last axis 1"),
        ({"input_gate": np.ones((2, 5, 5), np.float32)}, TypeError, "input_gate has dtype"),
        ({"x": np.ones((2, 5, 5), np.int64)}, TypeError, "x must have a real floating dtype"),
        ({"x": np.ones(5)}, ValueError, "x must have at least 2 dimensions"),
        ({"recurrent_gate": [[1.0]]}, TypeError, "recurrent_gate must be an array"),
        ({"input_gate": np.ones((3, 5, 5))}, ValueError, "do not broadcast"),
        ({"reset": np.ones((2, 5, 1))}, TypeError, "reset must be a boolean array"),
        ({"reset": np.ones((2, 5, 3), bool)}, ValueError, "reset must have the shape of x"),
        ({"c": 0.0}, ValueError, "c must be > 0"),
        ({"c": "8"}, TypeError, "c must be a real number"),
        ({"method": "scan"}, ValueError, "method must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
        ({"return_state": 1}, TypeError, "return_state must be True or False"),
        ({"initial_state": np.ones((2, 4))}, ValueError, "initial_state must have shape"),
        ({"initial_state": np.ones((2, 5), np.float32)}, TypeError, "initial_state has"),
        ({"attention_mask": np.ones((2, 4), bool)}, ValueError, "attention_mask must have"),
    ],
)
def test_bad_input_names_the_argument(rng, change, error, match):
    with pytest.raises(error, match=match):
        _bad_call(rng, **change)


def test_bad_linear_scan_and_step_input_names_the_argument(rng):
    x, log_a = make_inputs(rng, length=5)
    with pytest.raises(ValueError, match="log_a has last axis 3; it must be 5"):
        linear_scan(x, log_a[..., :3])
    with pytest.raises(ValueError, match="log_a has sequence length 4 but x has 5"):
        linear_scan(x, log_a[:, :4])
    with pytest.raises(ValueError, match="state must have shape"):
        linear_scan_step(x[:, 0], log_a[:, 0], np.zeros((2, CH + 1)))
    with pytest.raises(ValueError, match="log_a_t has last axis 2"):
        linear_scan_step(x[:, 0], log_a[:, 0, :2])
    x, i_gate, r_gate, param = make_gates(rng, length=1)
    with pytest.raises(TypeError, match="recurrent_gate_t has dtype float32"):
        rg_lru_step(x[:, 0], i_gate[:, 0], r_gate[:, 0].astype(np.float32), param)


def test_inputs_are_not_modified(rng):
    x, i_gate, r_gate, param = make_gates(rng)
    reset = rng.random((2, T, 1)) < 0.2
    h0 = rng.standard_normal((2, CH))
    arrays = (x, i_gate, r_gate, param, reset, h0)
    copies = [a.copy() for a in arrays]
    rg_lru(x, i_gate, r_gate, param, reset=reset, initial_state=h0, return_state=True)
    rg_lru_step(x[:, 0], i_gate[:, 0], r_gate[:, 0], param, h0, reset=reset[:, 0])
    linear_scan(x, -np.abs(i_gate), initial_state=h0, return_state=True)
    for before, after in zip(copies, arrays):
        np.testing.assert_array_equal(before, after)


def test_resets_with_padding_and_packed_sequences(rng):
    """A reset at the first real token of a left-padded row (what transformers' position ids
    give), and resets inside packed sequences: as the unpadded, unpacked reference."""
    x, i_gate, r_gate, param = make_gates(rng)
    mask = np.ones((2, T), bool)
    mask[1, :4] = False
    reset = np.zeros((2, T, 1), bool)
    reset[0, 0], reset[1, 4], reset[0, 9] = True, True, True
    want, want_state = rg_lru_reference(x, i_gate, r_gate, param, reset=reset, mask=mask)
    nan = lambda a: np.where(mask[..., None], a, np.nan)  # noqa: E731
    for method in LINEAR_SCAN_METHODS:
        out, state = rg_lru(nan(x), nan(i_gate), nan(r_gate), param, reset=reset,
                            attention_mask=mask, method=method, chunk_size=4,
                            return_state=True)  # fmt: skip
        np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(state, want_state, atol=ATOL64, rtol=0)
    offsets = [0, 6, T]
    out, state = rg_lru(x[:1], i_gate[:1], r_gate[:1], param, reset=reset[:1],
                        cu_seqlens=offsets, chunk_size=4, return_state=True)  # fmt: skip
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        piece = [v[:1, a:b] for v in (x, i_gate, r_gate)]
        want, want_state = rg_lru_reference(*piece, param, reset=reset[:1, a:b])
        np.testing.assert_allclose(out[:, a:b], want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(state[:, i], want_state, atol=ATOL64, rtol=0)


def test_a_shared_state_broadcasts(rng):
    """A state ``(D,)`` or ``(1, D)`` serves a batch (sequence and step alike)."""
    x, log_a = make_inputs(rng)
    shared = rng.standard_normal(CH)
    want, want_state = reference(x, log_a, state=shared)
    for state in (shared, shared[None]):
        out, last = linear_scan(x, log_a, initial_state=state, return_state=True)
        np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
        np.testing.assert_allclose(last, want_state, atol=ATOL64, rtol=0)
        y, h = linear_scan_step(x[:, 0], log_a[:, 0], state)
        np.testing.assert_allclose(y, want[:, 0], atol=ATOL64, rtol=0)
        assert h.shape == (2, CH)
    with pytest.raises(ValueError, match=r"state must have shape \(2, 5\)"):
        linear_scan_step(x[:, 0], log_a[:, 0], np.ones((3, CH)))
