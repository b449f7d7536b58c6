"""Inference and state: state passing, step decoding, padding masks, packed variable lengths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import polylin
from polylin import LinearAttentionState, causal_linear_attention, linear_attention, step

from .reference import masked_kernel

CHUNK = 8
T = 21  # split points below: 0, 1, inside a chunk, at a chunk boundary, T


def make(rng, lead=(2,), T=T, d_k=5, d_v=3):
    return (
        rng.standard_normal((*lead, T, d_k)),
        rng.standard_normal((*lead, T, d_k)),
        rng.standard_normal((*lead, T, d_v)),
    )


@pytest.mark.slow_grid(cover=("method",), prefer={"split": 5})
@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.parametrize("split", [0, 1, 5, CHUNK, 2 * CHUNK, T])
def test_split_with_state_equals_whole(backend, method, split, rng):
    q, k, v = (backend.from_numpy(x) for x in make(rng))
    opts = {"method": method, "chunk_size": CHUNK}
    whole, final = causal_linear_attention(q, k, v, return_state=True, **opts)
    first, state = causal_linear_attention(
        q[..., :split, :], k[..., :split, :], v[..., :split, :], return_state=True, **opts
    )
    second, state = causal_linear_attention(
        q[..., split:, :],
        k[..., split:, :],
        v[..., split:, :],
        initial_state=state,
        return_state=True,
        **opts,
    )
    joined = np.concatenate([backend.to_numpy(first), backend.to_numpy(second)], axis=-2)
    np.testing.assert_allclose(joined, backend.to_numpy(whole), rtol=0, atol=1e-12)
    for a, b in zip(state, final):
        np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), rtol=1e-12, atol=1e-12)


def test_final_state_is_the_sum(backend, rng):
    """S = sum phi(k_s) v_s^T and z = sum phi(k_s), from the same oracle feature map."""
    from .reference import elu_plus_one

    q, k, v = make(rng)
    _, state = causal_linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)), return_state=True
    )
    assert isinstance(state, LinearAttentionState)
    fk = elu_plus_one(k)
    np.testing.assert_allclose(backend.to_numpy(state.S), np.swapaxes(fk, -1, -2) @ v, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(state.z), fk.sum(-2), atol=1e-12)


def test_step_matches_whole_sequence(backend, rng):
    q, k, v = make(rng)
    expected = masked_kernel(q, k, v)
    qb, kb, vb = (backend.from_numpy(x) for x in (q, k, v))
    state = None
    for t in range(T):
        o_t, state = step(qb[..., t, :], kb[..., t, :], vb[..., t, :], state)
        np.testing.assert_allclose(backend.to_numpy(o_t), expected[..., t, :], atol=1e-12)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_prefill_then_decode(backend, method, rng):
    q, k, v = make(rng)
    qb, kb, vb = (backend.from_numpy(x) for x in (q, k, v))
    prompt = 13
    _, state = causal_linear_attention(
        qb[..., :prompt, :],
        kb[..., :prompt, :],
        vb[..., :prompt, :],
        method=method,
        chunk_size=CHUNK,
        return_state=True,
    )
    expected = masked_kernel(q, k, v)
    for t in range(prompt, T):
        o_t, state = step(qb[..., t, :], kb[..., t, :], vb[..., t, :], state)
        np.testing.assert_allclose(backend.to_numpy(o_t), expected[..., t, :], atol=1e-12)


def test_state_size_is_constant():
    """After 10,000 decoded tokens the state has exactly the shape it had after one."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 10_000, 2, 4)).astype(np.float32)
    _, state = step(q[0], k[0], v[0])
    shapes = (state.S.shape, state.z.shape)
    nbytes = state.S.nbytes + state.z.nbytes
    for t in range(1, 10_000):
        _, state = step(q[t], k[t], v[t], state)
    assert (state.S.shape, state.z.shape) == shapes == ((2, 4, 4), (2, 4))
    assert state.S.nbytes + state.z.nbytes == nbytes


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_state_is_float32(backend, dtype, rng):
    q, k, v = (backend.from_numpy(x, dtype) for x in make(rng))
    out, state = causal_linear_attention(q, k, v, return_state=True)
    assert out.dtype == q.dtype
    assert state.S.dtype == backend.dtype("float32") == state.z.dtype
    o_t, state2 = step(q[..., 0, :], k[..., 0, :], v[..., 0, :], state)
    assert o_t.dtype == q.dtype and state2.S.dtype == backend.dtype("float32")


def _padding_mask(lengths, T, left):
    pos = np.arange(T)[None, :]
    lengths = np.asarray(lengths)[:, None]
    return pos >= T - lengths if left else pos < lengths


def _masked_reference(q, k, v, mask):
    """Per row: attention over the real tokens only, zeros at the padded positions."""
    out = np.zeros(v.shape)
    for b in range(q.shape[0]):
        idx = np.flatnonzero(mask[b])
        out[b, idx] = masked_kernel(q[b, idx], k[b, idx], v[b, idx])
    return out


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
def test_attention_mask_padding(backend, method, left, rng):
    lengths = [T, 12, 1, 9]
    q, k, v = make(rng, lead=(4,))
    mask = _padding_mask(lengths, T, left)
    expected = _masked_reference(q, k, v, mask)
    out = causal_linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)),
        method=method,
        chunk_size=CHUNK,
        attention_mask=backend.from_numpy(mask),
    )
    out = backend.to_numpy(out)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    assert np.all(out[~mask] == 0.0)  # exactly zero, not just small


def test_attention_mask_state_excludes_padding(backend, rng):
    """Padded keys are in neither S nor z: the state equals the unpadded sequence's state."""
    q, k, v = make(rng, lead=(1,))
    mask = _padding_mask([15], T, left=True)
    args = [backend.from_numpy(x) for x in (q, k, v)]
    _, padded = causal_linear_attention(
        *args, attention_mask=backend.from_numpy(mask), return_state=True
    )
    _, real = causal_linear_attention(*(a[..., T - 15 :, :] for a in args), return_state=True)
    for a, b in zip(padded, real):
        np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), atol=1e-12)


def test_attention_mask_broadcast_over_heads(backend, rng):
    """A (batch, T) mask is given as mask[:, None, :] for (batch, heads, T, d) inputs."""
    q, k, v = make(rng, lead=(2, 3))
    mask = _padding_mask([T, 7], T, left=False)
    out = causal_linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)),
        attention_mask=backend.from_numpy(mask[:, None, :]),
    )
    for h in range(3):
        np.testing.assert_allclose(
            backend.to_numpy(out)[:, h],
            _masked_reference(q[:, h], k[:, h], v[:, h], mask),
            atol=1e-12,
        )


def test_linear_attention_mask(backend, rng):
    q, k, v = make(rng, lead=(3,))
    mask = _padding_mask([T, 4, 11], T, left=False)
    out = linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)), attention_mask=backend.from_numpy(mask)
    )
    expected = masked_kernel(q, k, v, causal=False, mask=mask)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=1e-12)
    # cross-attention: the mask covers the keys only
    out = linear_attention(
        *(backend.from_numpy(x) for x in (q[:, :5], k, v)), attention_mask=backend.from_numpy(mask)
    )
    expected = masked_kernel(q[:, :5], k, v, causal=False, mask=mask)
    np.testing.assert_allclose(backend.to_numpy(out), expected, atol=1e-12)


CU_SEQLENS = [0, 7, 8, 8, 30, 41]  # lengths 7, 1, 0, 22, 11


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_cu_seqlens_matches_per_sequence(backend, method, rng):
    total = CU_SEQLENS[-1]
    q, k, v = make(rng, lead=(2,), T=total)
    out, states = causal_linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)),
        method=method,
        chunk_size=CHUNK,
        cu_seqlens=CU_SEQLENS,
        return_state=True,
    )
    out = backend.to_numpy(out)
    assert out.shape == (2, total, 3)
    assert tuple(states.S.shape) == (2, 5, 5, 3) and tuple(states.z.shape) == (2, 5, 5)
    for i, (a, b) in enumerate(itertools.pairwise(CU_SEQLENS)):
        np.testing.assert_allclose(
            out[:, a:b], masked_kernel(q[:, a:b], k[:, a:b], v[:, a:b]), atol=1e-12
        )
        _, state = causal_linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], return_state=True)
        np.testing.assert_allclose(backend.to_numpy(states.S)[:, i], state.S, atol=1e-12)
        np.testing.assert_allclose(backend.to_numpy(states.z)[:, i], state.z, atol=1e-12)


def test_cu_seqlens_with_initial_state(backend, rng):
    """Each packed sequence continues from its own state: equal to running the halves."""
    lengths = [9, 4, 12]
    q, k, v = make(rng, lead=(), T=2 * sum(lengths))
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    half = sum(lengths)
    first = [backend.from_numpy(x[:half]) for x in (q, k, v)]
    second = [backend.from_numpy(x[half:]) for x in (q, k, v)]
    _, states = causal_linear_attention(*first, cu_seqlens=cu, return_state=True)
    out = backend.to_numpy(causal_linear_attention(*second, cu_seqlens=cu, initial_state=states))
    for a, b in itertools.pairwise(cu):
        seq = [np.concatenate([x[a:b], x[half + a : half + b]]) for x in (q, k, v)]
        expected = masked_kernel(*seq)[b - a :]
        np.testing.assert_allclose(out[a:b], expected, atol=1e-12)


def test_cu_seqlens_errors(rng):
    q, k, v = make(rng, T=10)
    for bad, exc, msg in [
        ([0, 4, 9], ValueError, "end at the sequence length 10"),
        ([1, 10], ValueError, "start at 0"),
        ([0, 6, 4, 10], ValueError, "non-decreasing"),
        ([0, 4.0, 10], TypeError, "integers only"),
        ([0, np.array(4), 10], TypeError, "integers only"),
        ([0, True, 10], TypeError, "integers only"),
        (np.array([0, 10]), TypeError, "sequence of ints"),
    ]:
        with pytest.raises(exc, match=msg):
            causal_linear_attention(q, k, v, cu_seqlens=bad)
    # NumPy's integers (a list made from np.cumsum) are offsets like Python's.
    numpy_ints = list(np.cumsum([0, 4, 6]))
    assert all(type(o) is np.int64 for o in numpy_ints)
    np.testing.assert_array_equal(
        causal_linear_attention(q, k, v, cu_seqlens=numpy_ints),
        causal_linear_attention(q, k, v, cu_seqlens=[0, 4, 10]),
    )
    with pytest.raises(ValueError, match="attention_mask or cu_seqlens, not both"):
        causal_linear_attention(q, k, v, cu_seqlens=[0, 10], attention_mask=np.ones((2, 10), bool))


def test_mask_errors(rng):
    q, k, v = make(rng, T=6)
    with pytest.raises(TypeError, match="attention_mask must be boolean"):
        causal_linear_attention(q, k, v, attention_mask=np.ones((2, 6)))
    expected = r"attention_mask must have shape \(batch, T\) = \(2, 6\) .*; got "
    with pytest.raises(ValueError, match=expected + r"\(2, 5\)"):
        causal_linear_attention(q, k, v, attention_mask=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match=expected + r"\(3, 6\)"):
        causal_linear_attention(q, k, v, attention_mask=np.ones((3, 6), bool))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="same library as q"):
        causal_linear_attention(q, k, v, attention_mask=torch.ones((2, 6), dtype=torch.bool))


def test_state_errors(rng):
    q, k, v = make(rng, T=6)  # d_k = 5, d_v = 3, batch 2
    S, z = np.zeros((2, 5, 3)), np.zeros((2, 5))
    with pytest.raises(TypeError, match="initial_state must be a LinearAttentionState"):
        causal_linear_attention(q, k, v, initial_state=S)
    with pytest.raises(ValueError, match=r"initial_state.S must have shape \(2, 5, 3\)"):
        causal_linear_attention(q, k, v, initial_state=(S[..., :2], z))
    with pytest.raises(ValueError, match=r"initial_state.z must have shape \(2, 5\)"):
        causal_linear_attention(q, k, v, initial_state=(S, np.zeros((3, 5))))
    with pytest.raises(TypeError, match=r"initial_state\.S must have a real floating dtype"):
        causal_linear_attention(q, k, v, initial_state=(S.astype(int), z))
    with pytest.raises(ValueError, match=r"state.S must have shape \(2, 5, 3\)"):
        step(q[:, 0], k[:, 0], v[:, 0], (np.zeros((3, 5, 3)), z))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="same library as q"):
        causal_linear_attention(q, k, v, initial_state=(torch.zeros(2, 5, 3), torch.zeros(2, 5)))
    with pytest.raises(
        TypeError, match=r"initial_state.z is a numpy array but initial_state.S is a torch"
    ):
        causal_linear_attention(q, k, v, initial_state=(torch.zeros(2, 5, 3), z))


def test_inputs_and_state_unchanged(backend, rng):
    q, k, v = make(rng)
    S0, z0 = rng.standard_normal((2, 5, 3)), rng.random((2, 5))
    args = [backend.from_numpy(x) for x in (q, k, v)]
    state = LinearAttentionState(backend.from_numpy(S0), backend.from_numpy(z0))
    mask = backend.from_numpy(np.ones((2, T), bool))
    causal_linear_attention(*args, initial_state=state, attention_mask=mask)
    step(args[0][..., 0, :], args[1][..., 0, :], args[2][..., 0, :], state)
    for a, x in zip((q, k, v, S0, z0), (*args, *state)):
        np.testing.assert_array_equal(backend.to_numpy(x), a)
