"""The mLSTM (xLSTM's matrix memory) against an independent float64 loop and transformers.

Every backend x method against the stabilized recurrence written plainly in float64 (outputs and
the state triple); chunk sizes; split and resume across methods; ``mlstm_step`` after a chunked
prefill; shared initial states; padding masks (NaN at masked positions) and packed sequences;
transformers' ``mlstm_chunkwise_native_autograd`` and ``mlstm_recurrent_sequence_native`` on
identical inputs (outputs, states, gradients); float32 at strong input gates (pre-activations up
to 50) and long T; half precision; bad input. JAX calls run under ``jax.jit``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from polylin import MLSTMState, mlstm, mlstm_step
from polylin.mlstm import MLSTM_METHODS
from polylin.testing import Backend

LEAD, T, D_K, D_V, CHUNK = (2, 3), 13, 6, 5, 4  # T not a multiple of the chunk size
ATOL64 = 1e-10


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def reference(q, k, v, i_gate, f_gate, state=None, mask=None, scale=None, eps=1e-6):
    """The xLSTM paper's stabilized mLSTM recurrence in float64: ``(outputs, (C, n, m))``.

    Gates broadcast to ``(..., T, 1)``, ``mask`` to ``(..., T)`` (a masked token is skipped:
    the state is left alone and the output is 0); the zero state has ``m = 0``.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    *lead, length, d_k = k.shape
    d_v = v.shape[-1]
    scale = d_k**-0.5 if scale is None else scale
    i_gate, f_gate = (
        np.broadcast_to(np.asarray(x, np.float64), (*lead, length, 1)) for x in (i_gate, f_gate)
    )
    keep = (
        np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    )
    if state is None:
        C, n, m = np.zeros((*lead, d_k, d_v)), np.zeros((*lead, d_k)), np.zeros((*lead, 1))
    else:
        C, n, m = (np.array(np.broadcast_to(x, s), np.float64) for x, s in zip(
            state, ((*lead, d_k, d_v), (*lead, d_k), (*lead, 1))))  # fmt: skip
    out = np.zeros((*lead, length, d_v))
    for index in np.ndindex(*lead):
        c, nn, mm = C[index], n[index], float(m[index][0])
        for t in range(length):
            if not keep[index][t]:
                continue
            g, i = float(log_sigmoid(f_gate[index][t, 0])), float(i_gate[index][t, 0])
            m_new = max(g + mm, i)
            forget, write = math.exp(g + mm - m_new), math.exp(i - m_new)
            c = forget * c + write * np.outer(k[index][t], v[index][t])
            nn = forget * nn + write * k[index][t]
            qt = scale * q[index][t]
            out[index][t] = qt @ c / (max(abs(qt @ nn), math.exp(-m_new)) + eps)
            mm = m_new
        C[index], n[index], m[index] = c, nn, mm
    return out, (C, n, m)


def make_inputs(rng, lead=LEAD, length=T, d_k=D_K, d_v=D_V, strength=3.0):
    q, k = rng.standard_normal((2, *lead, length, d_k))
    v = rng.standard_normal((*lead, length, d_v))
    i_gate = strength * rng.standard_normal((*lead, length, 1))
    f_gate = rng.standard_normal((*lead, length, 1)) + 2.0
    return q, k, v, i_gate, f_gate


def call(backend, *arrays, state=None, **options):
    """``mlstm`` on ``backend`` from NumPy arrays; ``state`` a NumPy triple or None."""
    args = [backend.from_numpy(x) for x in arrays]
    if state is not None:
        options["initial_state"] = MLSTMState(*(backend.from_numpy(x) for x in state))
    return mlstm(*args, **options)


def close(backend, got, want, atol=ATOL64, rtol=0.0):
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=atol, rtol=rtol)


def close_state(backend, got, want, atol=ATOL64):
    assert isinstance(got, MLSTMState)
    for part, w in zip(got, want):
        assert tuple(part.shape) == w.shape
        close(backend, part, w, atol=atol)


@pytest.mark.slow_grid(cover=("strength",), prefer={"method": "chunked"})
@pytest.mark.parametrize("method", MLSTM_METHODS)
@pytest.mark.parametrize("strength", [1.0, 20.0])
def test_matches_reference(backend, rng, method, strength):
    q, k, v, i_gate, f_gate = make_inputs(rng, strength=strength)
    want, want_state = reference(q, k, v, i_gate, f_gate)
    out, state = call(
        backend, q, k, v, i_gate, f_gate, method=method, chunk_size=CHUNK, return_state=True
    )
    like = backend.from_numpy(q)
    assert type(out) is type(like) and out.dtype == like.dtype
    assert tuple(out.shape) == want.shape
    close(backend, out, want)
    close_state(backend, state, want_state)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 16, 64])
def test_any_chunk_size(rng, chunk_size):
    """Chunks of any length, shorter or longer than the sequence; gates shared by the heads."""
    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(2, 3), length=37, strength=10.0)
    i_gate, f_gate = i_gate[:, :1], f_gate[:, :1]  # (2, 1, T, 1): one gate per batch member
    want, want_state = reference(q, k, v, i_gate, f_gate)
    out, state = mlstm(q, k, v, i_gate, f_gate, chunk_size=chunk_size, return_state=True)
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    for got, w in zip(state, want_state):
        np.testing.assert_allclose(got, w, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid(prefer={"first": "quadratic"})
@pytest.mark.parametrize(
    "first, second", [("chunked", "recurrent"), ("recurrent", "chunked"), ("quadratic", "chunked")]
)
def test_split_and_resume(backend, rng, first, second):
    """A state from either method continues in the other, from a given initial state."""
    inputs = make_inputs(rng, strength=5.0)
    S0 = (
        rng.standard_normal((*LEAD, D_K, D_V)),
        rng.standard_normal((*LEAD, D_K)),
        rng.standard_normal((*LEAD, 1)),
    )
    want, want_state = reference(*inputs, state=S0)
    cut = 6
    head = [x[..., :cut, :] for x in inputs]
    tail = [x[..., cut:, :] for x in inputs]
    options = {"chunk_size": CHUNK, "return_state": True}
    out1, S1 = call(backend, *head, state=S0, method=first, **options)
    S1 = tuple(backend.to_numpy(x) for x in S1)
    out2, S2 = call(backend, *tail, state=S1, method=second, **options)
    close(backend, out1, want[..., :cut, :])
    close(backend, out2, want[..., cut:, :])
    close_state(backend, S2, want_state)


@pytest.mark.slow_grid
def test_step_after_prefill(backend, rng):
    """``mlstm_step`` continues a chunked prefill token by token, as the whole call computes;
    ``(B, H, 1)`` gates (xLSTM's step layout) and a plain ``(C, n, m)`` tuple as the state."""
    q, k, v, i_gate, f_gate = make_inputs(rng, strength=10.0)
    want, want_state = reference(q, k, v, i_gate, f_gate)
    cut = 7
    _, state = call(
        backend, *(x[..., :cut, :] for x in (q, k, v, i_gate, f_gate)), chunk_size=CHUNK,
        return_state=True,
    )  # fmt: skip
    state = tuple(state)
    for t in range(cut, T):
        token = [backend.from_numpy(x[..., t, :]) for x in (q, k, v, i_gate, f_gate)]
        h, state = mlstm_step(*token, state)
        close(backend, h, want[..., t, :])
    close_state(backend, state, want_state)


@pytest.mark.parametrize("lead", [(1, 3), (2, 1), ()])
@pytest.mark.parametrize("method", MLSTM_METHODS)
def test_a_shared_initial_state_broadcasts(rng, method, lead):
    inputs = make_inputs(rng)
    S0 = (
        rng.standard_normal((*lead, D_K, D_V)),
        rng.standard_normal((*lead, D_K)),
        rng.standard_normal((*lead, 1)),
    )
    want, want_state = reference(*inputs, state=S0)
    out, state = mlstm(
        *inputs, initial_state=S0, method=method, chunk_size=CHUNK, return_state=True
    )
    np.testing.assert_allclose(out, want, atol=ATOL64, rtol=0)
    for got, w in zip(state, want_state):
        np.testing.assert_allclose(got, w, atol=ATOL64, rtol=0)


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", MLSTM_METHODS)
def test_padding_mask(backend, rng, method):
    """Left and right padding: masked tokens (NaN inputs) change nothing, output 0, and leave
    the state (``m`` included) exactly as it was."""
    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(2, 3))
    mask = np.ones((2, T), bool)
    mask[0, :4] = False  # left padding
    mask[1, -5:] = False  # right padding
    want, want_state = reference(q, k, v, i_gate, f_gate, mask=mask[:, None, :])
    poisoned = [np.where(mask[:, None, :, None], x, np.nan) for x in (q, k, v, i_gate, f_gate)]
    out, state = call(
        backend, *poisoned, attention_mask=backend.from_numpy(mask), method=method,
        chunk_size=CHUNK, return_state=True,
    )  # fmt: skip
    close(backend, out, want)
    close_state(backend, state, want_state)


@pytest.mark.slow_grid(prefer={"method": "chunked"})
@pytest.mark.parametrize("method", MLSTM_METHODS)
def test_packed_sequences(backend, rng, method):
    """``cu_seqlens``: each sequence from its own initial state, one final state each."""
    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(3,), length=17, strength=8.0)
    offsets = [0, 5, 6, 17]
    states = (
        rng.standard_normal((3, 3, D_K, D_V)),
        rng.standard_normal((3, 3, D_K)),
        rng.standard_normal((3, 3, 1)),
    )
    out, state = call(
        backend, q, k, v, i_gate, f_gate, state=states, cu_seqlens=offsets, method=method,
        chunk_size=CHUNK, return_state=True,
    )  # fmt: skip
    got = backend.to_numpy(out)
    for index, (a, b) in enumerate(itertools.pairwise(offsets)):
        piece = [x[..., a:b, :] for x in (q, k, v, i_gate, f_gate)]
        want, want_state = reference(*piece, state=tuple(s[:, index] for s in states))
        np.testing.assert_allclose(got[..., a:b, :], want, atol=ATOL64, rtol=0)
        for part, w in zip(state, want_state):
            np.testing.assert_allclose(backend.to_numpy(part)[:, index], w, atol=ATOL64, rtol=0)


def test_seq_axis_and_empty(rng):
    """``seq_axis=1`` takes ``(batch, T, heads, d)`` inputs and gates; T = 0 returns an empty
    output and the initial state (a copy)."""
    q, k, v, i_gate, f_gate = make_inputs(rng)
    want = mlstm(q, k, v, i_gate, f_gate, chunk_size=CHUNK)
    moved = [np.swapaxes(x, 1, 2) for x in (q, k, v, i_gate, f_gate)]
    out = mlstm(*moved, seq_axis=1, chunk_size=CHUNK)
    np.testing.assert_allclose(np.swapaxes(out, 1, 2), want, atol=1e-12, rtol=0)
    S0 = MLSTMState(np.ones((*LEAD, D_K, D_V)), np.ones((*LEAD, D_K)), np.ones((*LEAD, 1)))
    empty = [x[..., :0, :] for x in (q, k, v, i_gate, f_gate)]
    for method in MLSTM_METHODS:
        out, state = mlstm(*empty, initial_state=S0, method=method, return_state=True)
        assert out.shape == (*LEAD, 0, D_V)
        assert all(s is not s0 and np.array_equal(s, s0) for s, s0 in zip(state, S0))


# ---------------------------------------------------------------- transformers' implementation


def _transformers_kernels():
    pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
    if getattr(modeling, "external_xlstm", False):
        pytest.skip("transformers uses the external xlstm package here")
    return modeling


@pytest.mark.parametrize("method", MLSTM_METHODS)
def test_matches_transformers(rng, method):
    """Outputs, the final ``(c, n, m)`` and the gradients of every input and of the initial
    state equal transformers' chunkwise fallback (and its recurrent sequence kernel) in
    float64, on the xLSTM layout ``(B, H, T, d)`` with ``(B, H, T)`` gates."""
    import torch

    X = _transformers_kernels()
    B, H, length, d_k, d_v = 2, 2, 64, 8, 4
    arrays = [
        rng.standard_normal((B, H, length, d_k)),
        rng.standard_normal((B, H, length, d_k)),
        rng.standard_normal((B, H, length, d_v)),
        5.0 * rng.standard_normal((B, H, length)),
        rng.standard_normal((B, H, length)) + 2.0,
        rng.standard_normal((B, H, d_k, d_v)),
        rng.standard_normal((B, H, d_k)),
        rng.standard_normal((B, H, 1)),
    ]
    mine = [torch.tensor(x, requires_grad=True) for x in arrays]
    theirs = [torch.tensor(x, requires_grad=True) for x in arrays]
    q, k, v, i, f, c0, n0, m0 = theirs
    h_ref, (c_ref, n_ref, m_ref) = X.mlstm_chunkwise_native_autograd(
        q, k, v, i, f, c0, n0, m0, return_last_states=True, chunk_size=32
    )
    q, k, v, i, f, c0, n0, m0 = mine
    h, state = mlstm(
        q, k, v, i[..., None], f[..., None], initial_state=(c0, n0, m0), method=method,
        chunk_size=16, return_state=True,
    )  # fmt: skip
    torch.testing.assert_close(h, h_ref, rtol=1e-9, atol=1e-10)
    for got, want in zip(state, (c_ref, n_ref, m_ref)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    weights = [torch.tensor(rng.standard_normal(x.shape)) for x in (h, *state)]
    loss = sum((w * x).sum() for w, x in zip(weights, (h, *state)))
    loss_ref = sum((w * x).sum() for w, x in zip(weights, (h_ref, c_ref, n_ref, m_ref)))
    loss.backward()
    loss_ref.backward()
    for name, a, b in zip(("q", "k", "v", "i", "f", "c0", "n0", "m0"), mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-9, msg=name)
    # The recurrent sequence kernel (transformers' inference path) agrees too.
    with torch.no_grad():
        h_seq, last = X.mlstm_recurrent_sequence_native(
            *theirs[:5], *theirs[5:], return_last_states=True, dtype_state=torch.float64
        )
    torch.testing.assert_close(h.detach(), h_seq, rtol=1e-9, atol=1e-10)
    for got, want in zip(state, last):
        torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=1e-10)


def test_step_matches_transformers(rng):
    import torch

    X = _transformers_kernels()
    B, H, d_k, d_v = 2, 3, 8, 4
    q, k = (torch.tensor(rng.standard_normal((B, H, d_k))) for _ in range(2))
    v = torch.tensor(rng.standard_normal((B, H, d_v)))
    i, f = (torch.tensor(rng.standard_normal((B, H, 1)) * 4) for _ in range(2))
    state = (
        torch.tensor(rng.standard_normal((B, H, d_k, d_v))),
        torch.tensor(rng.standard_normal((B, H, d_k))),
        torch.tensor(rng.standard_normal((B, H, 1))),
    )
    h_ref, state_ref = X.mlstm_recurrent_step_native(
        q, k, v, i, f, *state, dtype_state=torch.float64
    )
    h, new_state = mlstm_step(q, k, v, i, f, state)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(new_state, state_ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["chunked", "quadratic"])
def test_gradients_match_recurrent(rng, method):
    """PyTorch float64 gradients of the parallel forms equal the recurrent form's, with a
    padding mask (the padded inputs get zero gradients)."""
    import torch

    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(2, 2), length=21, strength=10.0)
    mask = np.ones((2, 21), bool)
    mask[0, :5] = False
    grads = {}
    for name in (method, "recurrent"):
        tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, i_gate, f_gate)]
        out, state = mlstm(
            *tensors, attention_mask=torch.tensor(mask), method=name, chunk_size=4,
            return_state=True,
        )  # fmt: skip
        (out.square().sum() + state.C.sum() + state.n.sum() + state.m.sum()).backward()
        grads[name] = [t.grad for t in tensors]
    for a, b in zip(grads[method], grads["recurrent"]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
        assert torch.all(a[0, :, :5] == 0)


@pytest.mark.only_backend(Backend.JAX, reason="jax.grad under jit")
def test_jax_gradients(backend, rng):
    """``jax.grad`` of the chunked form under ``jit`` equals the quadratic form's (whose
    gradients equal the recurrent form's: test_gradients_match_recurrent)."""
    import jax
    import jax.numpy as jnp

    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(2,), length=19, strength=10.0)

    def loss(method, *arrays):
        out, state = mlstm(*arrays, method=method, chunk_size=4, return_state=True)
        return jnp.sum(out**2) + jnp.sum(state.C) + jnp.sum(state.m)

    arrays = [jnp.asarray(x) for x in (q, k, v, i_gate, f_gate)]
    fast = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2, 3, 4)))(*arrays)
    slow = jax.jit(jax.grad(lambda *a: loss("quadratic", *a), argnums=(0, 1, 2, 3, 4)))(*arrays)
    for a, b in zip(fast, slow):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------- numerics


def test_float32_at_strong_gates_and_long_sequences(rng):
    """Input-gate pre-activations up to 50 (``exp(50)`` ~ 5e21: its square overflows float32)
    and strong forgetting over T = 2048: float32 results are finite, and as close to the
    float64 result as the recurrent form's float32 results are. The mLSTM's output is a ratio
    whose denominator ``|n . q|`` can come close to 0, where any float32 computation loses
    relative precision; the error is measured against ``|h| + 1``."""
    length = 2048
    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(2,), length=length, d_k=16, d_v=16)
    i_gate = rng.uniform(-50.0, 50.0, i_gate.shape)
    f_gate = rng.uniform(-6.0, 8.0, f_gate.shape)
    want, want_state = mlstm(q, k, v, i_gate, f_gate, return_state=True)  # float64 chunked
    head = [x[..., :100, :] for x in (q, k, v, i_gate, f_gate)]
    np.testing.assert_allclose(want[..., :100, :], reference(*head)[0], atol=1e-9, rtol=1e-9)
    single = [x.astype(np.float32) for x in (q, k, v, i_gate, f_gate)]
    errors = {}
    for method in ("chunked", "recurrent"):
        out, state = mlstm(*single, method=method, return_state=True)
        assert out.dtype == np.float32 and np.all(np.isfinite(out))
        errors[method] = np.max(np.abs(out - want) / (np.abs(want) + 1.0))
        np.testing.assert_allclose(state.m, want_state.m, rtol=1e-5, atol=1e-4)
        scale_C = np.abs(want_state.C).max()
        np.testing.assert_allclose(state.C, want_state.C, atol=1e-5 * scale_C, rtol=0)
    assert errors["chunked"] < 2e-3
    assert errors["chunked"] < 2.0 * errors["recurrent"]


def test_half_precision(rng):
    """bfloat16 inputs: computed in float32, the output cast back, the state in float32."""
    torch = pytest.importorskip("torch")
    q, k, v, i_gate, f_gate = make_inputs(rng, lead=(2,), length=40, strength=10.0)
    half = [torch.tensor(x, dtype=torch.bfloat16) for x in (q, k, v, i_gate, f_gate)]
    out, state = mlstm(*half, return_state=True)
    assert out.dtype == torch.bfloat16 and state.C.dtype == torch.float32
    want = mlstm(*(x.float() for x in half))
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    h, new_state = mlstm_step(*(x[:, 0] for x in half), state)
    assert h.dtype == torch.bfloat16 and new_state.m.dtype == torch.float32


# ---------------------------------------------------------------------------- bad input


def test_bad_input(rng):
    q, k, v, i_gate, f_gate = make_inputs(rng)
    with pytest.raises(ValueError, match="method"):
        mlstm(q, k, v, i_gate, f_gate, method="fast")
    with pytest.raises(ValueError, match="i_gate must broadcast"):
        mlstm(q, k, v, i_gate[..., :3, :], f_gate)
    with pytest.raises(TypeError, match="f_gate has dtype"):
        mlstm(q, k, v, i_gate, f_gate.astype(np.float32))
    with pytest.raises(ValueError, match="f_gate must be a finite number"):
        mlstm(q, k, v, i_gate, math.inf)
    with pytest.raises(TypeError, match="initial_state must be an MLSTMState"):
        mlstm(q, k, v, i_gate, f_gate, initial_state=np.zeros((*LEAD, D_K, D_V)))
    bad = (np.zeros((*LEAD, D_K, D_V)), np.zeros((*LEAD, D_K + 1)), np.zeros((*LEAD, 1)))
    with pytest.raises(ValueError, match=r"initial_state\.n must have shape"):
        mlstm(q, k, v, i_gate, f_gate, initial_state=bad)
    wrong = (np.zeros((*LEAD, D_K, D_V)), np.zeros((*LEAD, D_K)), np.zeros((*LEAD, 1), np.float32))
    with pytest.raises(TypeError, match=r"initial_state\.m has dtype"):
        mlstm(q, k, v, i_gate, f_gate, initial_state=wrong)
    with pytest.raises(ValueError, match="eps"):
        mlstm(q, k, v, i_gate, f_gate, eps=0.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        mlstm(q, k, v, i_gate, f_gate, scale=math.nan)
    with pytest.raises(ValueError, match="i_t must broadcast"):
        mlstm_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], i_gate, f_gate[..., 0, :])
    originals = [x.copy() for x in (q, k, v, i_gate, f_gate)]
    mlstm(q, k, v, i_gate, f_gate)
    assert all(np.array_equal(a, b) for a, b in zip(originals, (q, k, v, i_gate, f_gate)))


def test_benchmark_runs(tmp_path):
    """benchmarks/mlstm.py at tiny sizes: both implementations checked and timed, a row per
    (threads, T, pass) and the goals in the JSON report."""
    pytest.importorskip("torch")
    _transformers_kernels()
    from benchmarks import mlstm as bench

    out = tmp_path / "mlstm.json"
    report = bench.main([
        "--lengths", "32", "64", "--threads", "1", "--heads", "2", "--d-qk", "8", "--d-v", "8",
        "--chunk", "16", "--repeats", "1", "--json", str(out),
    ])  # fmt: skip
    assert out.exists() and len(report["rows"]) == 4
    assert all(r["polylin_s"] > 0 and r["transformers_s"] > 0 for r in report["rows"])
    assert {g["name"].split(",")[1].strip() for g in report["goals"]} == {
        "forward",
        "forward+backward",
    }
