"""Adversarial inputs: non-finite values never cross a mask, finite inputs never give NaN, options
are checked in the work dtype, and the edges give errors that name the argument.

Every case runs on every backend and every method; each compares against the same computation
without the adversarial values (bitwise where the arithmetic is identical) or against the float64
oracle.
"""

from __future__ import annotations

import functools

import array_api_compat
import numpy as np
import pytest

from polylin import (
    METHODS,
    LinearAttentionState,
    causal_linear_attention,
    linear_attention,
    masked_kernel_attention,
    delta_rule_attention,
    delta_rule_step,
    step,
)
from polylin.feature_maps import dpfp
from polylin.feature_maps import elu_plus_one as elu_plus_one_map
from polylin.testing import Backend

from .reference import decayed_loop, elu_plus_one, masked_kernel

# Non-finite inputs make NumPy warn on purpose here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:Sparse CSR tensor support is in beta state:UserWarning",
)

T, CHUNK = 13, 4  # T not a multiple of the chunk; padding shares chunks with real tokens
POISON = [np.nan, np.inf, -np.inf]


def _padded(rng):
    """(batch 2, heads 2, T, 3) inputs, the first sequence left-padded, the second right-padded."""
    q, k, v = rng.standard_normal((3, 2, 2, T, 3))
    mask = np.ones((2, T), dtype=bool)
    mask[0, :5] = False
    mask[1, -6:] = False
    return q, k, v, mask


def _fill(x, mask, value):
    """``x`` with ``value`` at the masked positions of a (batch, T) mask."""
    y = x.copy()
    y[np.broadcast_to(~mask[:, None, :], y.shape[:-1])] = value
    return y


def _run(backend, fn, arrays, **kwargs):
    """``fn(*arrays, **kwargs)`` on ``backend``, back as NumPy.

    On JAX under ``jax.jit``, except the recurrent form (its unrolled loop compiles slowly, while
    eagerly its steps reuse one compiled shape).
    """
    xs = [backend.from_numpy(x) for x in arrays]
    if backend.library == "jax.numpy" and kwargs.get("method") != "recurrent":
        # The mask is traced, the options static: calls that differ only in values share one
        # compiled program (a clean and a poisoned run, the cases of one test).
        traced = (
            {}
            if kwargs.get("attention_mask") is None
            else {"attention_mask": kwargs.pop("attention_mask")}
        )
        return backend.to_numpy(_jitted(fn, tuple(sorted(kwargs.items())))(*xs, **traced))
    return backend.to_numpy(fn(*xs, **kwargs))


@functools.cache
def _jitted(fn, static: tuple):
    import jax

    def call(*xs, **traced):
        return fn(*xs, **traced, **dict(static))

    return jax.jit(call)


# -- 1. masks decide by selection ------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("poison", POISON[:2], ids=["nan", "inf"])
def test_padding_never_reaches_real_tokens(backend, method, poison, rng):
    """Whatever the padding holds, real outputs are those of zero padding, masked ones exactly 0."""
    q, k, v, mask = _padded(rng)
    m = backend.from_numpy(mask)
    kwargs = dict(method=method, chunk_size=CHUNK, attention_mask=m)
    clean = _run(backend, causal_linear_attention, (q, k, v), **kwargs)
    poisoned = _run(
        backend, causal_linear_attention, [_fill(x, mask, poison) for x in (q, k, v)], **kwargs
    )
    np.testing.assert_array_equal(poisoned, clean)
    assert np.all(poisoned[np.broadcast_to(~mask[:, None, :], poisoned.shape[:-1])] == 0.0)
    real = np.broadcast_to(mask[:, None, :], q.shape[:-1])
    expected = np.zeros_like(clean)
    for b in range(2):
        idx = np.flatnonzero(mask[b])
        expected[b][:, idx] = masked_kernel(q[b][:, idx], k[b][:, idx], v[b][:, idx])
    np.testing.assert_allclose(poisoned[real], expected[real], rtol=0, atol=1e-10)


@pytest.mark.parametrize("poison", POISON[:1], ids=["nan"])
def test_padding_state_is_clean(backend, poison, rng):
    q, k, v, mask = _padded(rng)
    args = [backend.from_numpy(_fill(x, mask, poison)) for x in (q, k, v)]
    _, state = causal_linear_attention(
        *args, chunk_size=CHUNK, attention_mask=backend.from_numpy(mask), return_state=True
    )
    assert np.isfinite(backend.to_numpy(state.S)).all()
    assert np.isfinite(backend.to_numpy(state.z)).all()


@pytest.mark.parametrize("poison", POISON[:2], ids=["nan", "inf"])
def test_linear_attention_key_mask_by_selection(backend, poison, rng):
    q, k, v, mask = _padded(rng)
    m = backend.from_numpy(mask)
    for queries in (q, q[..., :4, :]):  # self-attention (outputs masked too) and cross-attention
        clean = _run(backend, linear_attention, (queries, k, v), attention_mask=m)
        bad_q = _fill(queries, mask, poison) if queries.shape == q.shape else queries
        poisoned = _run(
            backend,
            linear_attention,
            (bad_q, _fill(k, mask, poison), _fill(v, mask, poison)),
            attention_mask=m,
        )
        np.testing.assert_array_equal(poisoned, clean)
        np.testing.assert_allclose(
            poisoned,
            masked_kernel(queries, k, v, causal=False, mask=mask[:, None, :]),
            rtol=0,
            atol=1e-10,
        )


@pytest.mark.parametrize("method", METHODS)
def test_overflowing_masked_score_gives_the_recurrent_answer(backend, method, rng):
    """A masked (future) score overflows to inf while every input is finite: no NaN appears."""
    q = np.array([[1e20], [0.0], [0.5]])
    k = np.array([[0.0], [1e20], [0.25]])
    v = rng.standard_normal((3, 2))
    arrays = [x.astype(np.float32) for x in (q, k, v)]
    out = _run(backend, causal_linear_attention, arrays, method=method, chunk_size=4)
    reference = _run(backend, causal_linear_attention, arrays, method="recurrent")
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[0], v[0], rtol=1e-6)  # position 0 attends to itself only
    kernel = _run(backend, masked_kernel_attention, arrays)
    np.testing.assert_allclose(kernel, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("which", "poison"),
    [("q", np.nan), ("k", np.nan), ("k", np.inf)],
    ids=["q-nan", "k-nan", "k-inf"],
)
def test_future_query_or_key_does_not_leak_backwards(backend, method, which, poison, rng):
    q, k, v = rng.standard_normal((3, 2, T, 3))
    t = 6  # inside a chunk: earlier tokens of the same chunk see its scores
    bad = {"q": q.copy(), "k": k.copy()}
    bad[which][:, t] = poison
    kwargs = dict(method=method, chunk_size=CHUNK)
    clean = _run(backend, causal_linear_attention, (q, k, v), **kwargs)
    poisoned = _run(backend, causal_linear_attention, (bad["q"], bad["k"], v), **kwargs)
    np.testing.assert_array_equal(poisoned[:, :t], clean[:, :t])
    if poison != poison:
        assert np.isnan(poisoned[:, t]).all()


@pytest.mark.parametrize("method", METHODS)
def test_future_value_reach_is_as_documented(backend, method, rng):
    """A non-finite *value* at t (not masked): what docs/numerics.md says, exactly.

    The recurrent form keeps every output before t; the chunked form every output before the
    chunk that holds t (0 x NaN inside the intra-chunk matrix product reaches the earlier rows
    of that chunk); the quadratic form none (one T x T product). From t on every output is NaN.
    """
    q, k, v = rng.standard_normal((3, 2, T, 3))
    t = 6
    bad = v.copy()
    bad[:, t] = np.nan
    kwargs = dict(method=method, chunk_size=CHUNK)
    clean = _run(backend, causal_linear_attention, (q, k, v), **kwargs)
    poisoned = _run(backend, causal_linear_attention, (q, k, bad), **kwargs)
    kept = {"recurrent": t, "chunked": t - t % CHUNK, "quadratic": 0}[method]
    np.testing.assert_array_equal(poisoned[:, :kept], clean[:, :kept])
    assert np.isnan(poisoned[:, kept:]).all()


# -- 2. options in the work dtype -----------------------------------------------------------
def test_eps_must_be_positive_in_the_work_dtype(backend, rng):
    q, k, v = (backend.from_numpy(x, "float32") for x in rng.standard_normal((3, 4, 3)))
    for method in METHODS:
        with pytest.raises(ValueError, match=r"^eps must be > 0 and finite in .*float32.*1e-50"):
            causal_linear_attention(q, k, v, method=method, eps=1e-50)
        with pytest.raises(ValueError, match=r"^eps must be > 0 and finite in .*float32"):
            causal_linear_attention(q, k, v, method=method, eps=1e39)
    for fn in (linear_attention, masked_kernel_attention):
        with pytest.raises(ValueError, match=r"^eps must be > 0 and finite in .*float32"):
            fn(q, k, v, eps=1e-50)
    with pytest.raises(ValueError, match=r"^eps must be > 0 and finite in .*float32"):
        step(q[0, ...], k[0, ...], v[0, ...], eps=1e-50)
    # float64 inputs compute in float64, where 1e-50 is a normal positive number
    out = _run(backend, causal_linear_attention, rng.standard_normal((3, 4, 3)), eps=1e-50)
    assert np.isfinite(out).all()


def test_eps_for_half_inputs_is_checked_in_float32(backend, rng):
    if "float16" not in backend.float_dtypes():
        pytest.skip(f"[{backend}] has no float16")
    arrays = rng.standard_normal((3, 4, 3)).astype(np.float16)
    # 1e-30 is 0 in float16 but a normal float32 number: the normalizer is float32
    assert np.isfinite(_run(backend, causal_linear_attention, arrays, eps=1e-30)).all()
    q, k, v = (backend.from_numpy(x) for x in arrays)
    with pytest.raises(ValueError, match=r"^eps must be > 0 and finite in .*float32"):
        causal_linear_attention(q, k, v, eps=1e-40)


def _plain_relu(x):
    """max(x, 0): zero features for negative inputs (unlike polylin's lifted relu)."""
    return array_api_compat.array_namespace(x).maximum(x, 0.0)


@pytest.mark.parametrize("method", METHODS)
def test_smallest_valid_eps_never_divides_zero_by_zero(backend, method, rng):
    """Fully masked rows and rows with zero features are 0/(0 + eps) = 0, not NaN."""
    q, k, v = rng.standard_normal((3, 2, 6, 3)).astype(np.float32)
    q[1] = -np.abs(q[1])  # relu features of these queries are all zero
    mask = np.ones((2, 6), dtype=bool)
    mask[0] = False
    eps = float(np.finfo(np.float32).smallest_normal)
    out = _run(
        backend,
        causal_linear_attention,
        (q, k, v),
        feature_map=_plain_relu,
        method=method,
        eps=eps,
        attention_mask=backend.from_numpy(mask),
    )
    np.testing.assert_array_equal(out, np.zeros_like(out))


@pytest.mark.parametrize(
    "eps", [np.float32(1e-6), np.finfo(np.float32).eps, np.float64(1e-5), 1, np.int64(1)]
)
def test_eps_any_real_number(eps, rng):
    q, k, v = rng.standard_normal((3, 5, 3))
    expected = masked_kernel(q, k, v, eps=float(eps))
    for method in METHODS:
        out = causal_linear_attention(q, k, v, method=method, eps=eps)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        linear_attention(q, k, v, eps=eps), masked_kernel(q, k, v, causal=False, eps=float(eps))
    )


@pytest.mark.parametrize("chunk_size", [np.int64(2), np.int32(3), np.uint8(4)])
def test_chunk_size_any_integer(chunk_size, rng):
    q, k, v = rng.standard_normal((3, 7, 3))
    out = causal_linear_attention(q, k, v, chunk_size=chunk_size)
    np.testing.assert_allclose(out, masked_kernel(q, k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("chunk_size", "error", "message"),
    [
        (None, TypeError, r"^chunk_size must be an int, got NoneType"),
        (True, TypeError, r"^chunk_size must be an int, got bool"),
        (np.bool_(True), TypeError, r"^chunk_size must be an int, got bool"),
        (4.0, TypeError, r"^chunk_size must be an int, got float"),
        (np.int64(0), ValueError, r"^chunk_size must be >= 1, got 0"),
    ],
)
def test_chunk_size_checked_for_every_method(method, chunk_size, error, message, rng):
    q, k, v = rng.standard_normal((3, 5, 3))
    with pytest.raises(error, match=message):
        causal_linear_attention(q, k, v, method=method, chunk_size=chunk_size)


@pytest.mark.parametrize("eps", [True, "1e-6", None, np.array(1e-6), 1j])
def test_eps_not_a_real_number(eps, rng):
    q, k, v = rng.standard_normal((3, 5, 3))
    with pytest.raises(TypeError, match=r"^eps must be a positive real number"):
        causal_linear_attention(q, k, v, eps=eps)


# -- 3. clear errors at the edges -------------------------------------------------------------
def test_feature_map_of_another_library():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 5, 3))
    with pytest.raises(TypeError, match=r"^feature_map returned a torch array for q, a numpy"):
        causal_linear_attention(q, k, v, lambda x: torch.asarray(x) + 1.0)
    tq, tk, tv = (torch.asarray(x) for x in (q, k, v))
    with pytest.raises(TypeError, match=r"^feature_map returned a numpy array for q, a torch"):
        linear_attention(tq, tk, tv, lambda x: x.numpy() + 1.0)
    with pytest.raises(TypeError, match=r"^feature_map returned a numpy array for q_t, a torch"):
        step(tq[0], tk[0], tv[0], None, lambda x: x.numpy() + 1.0)


def test_feature_map_complex_or_not_an_array(backend, rng):
    q, k, v = (backend.from_numpy(x) for x in rng.standard_normal((3, 5, 3)))
    xp = backend.namespace()
    if not hasattr(xp, "complex128"):
        pytest.skip(f"[{backend}] has no complex128")

    def complex_map(x):
        return xp.astype(x, xp.complex128) * 1j + 1.0

    for fn in (causal_linear_attention, linear_attention, masked_kernel_attention):
        with pytest.raises(TypeError, match=r"^feature_map must return a real floating array"):
            fn(q, k, v, complex_map)
    with pytest.raises(TypeError, match=r"^feature_map must return an array for q, got list"):
        causal_linear_attention(q, k, v, lambda x: [1.0])


def test_numpy_ml_dtypes_refused():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones((5, 3), dtype=ml_dtypes.bfloat16)
    y = np.ones((5, 3), dtype=np.float32)
    with pytest.raises(TypeError, match=r"^q has dtype bfloat16 .*float16, float32 or float64"):
        causal_linear_attention(x, y, y)
    with pytest.raises(TypeError, match=r"^v_t has dtype bfloat16"):
        step(y[0], y[0], x[0])


def test_numpy_masked_array_refused():
    x = np.ones((5, 3))
    masked = np.ma.masked_array(x, mask=np.zeros_like(x, dtype=bool))
    with pytest.raises(TypeError, match=r"^k is a numpy.ma.MaskedArray, whose mask polylin"):
        causal_linear_attention(x, masked, x)
    with pytest.raises(TypeError, match=r"^attention_mask is a numpy.ma.MaskedArray"):
        causal_linear_attention(x, x, x, attention_mask=np.ma.masked_array(np.ones(5, bool)))


def test_torch_sparse_refused():
    torch = pytest.importorskip("torch")
    x = torch.ones(5, 3, dtype=torch.float64)
    for sparse in (x.to_sparse(), x.to_sparse_csr()):
        with pytest.raises(TypeError, match=r"^v is a sparse PyTorch tensor \(layout torch.sp"):
            causal_linear_attention(x, x, sparse)


@pytest.mark.parametrize("fn", ["causal", "step"])
def test_state_of_another_dtype_refused(backend, fn, rng):
    q, k, v = (backend.from_numpy(x, "float64") for x in rng.standard_normal((3, 2, 5, 3)))
    S = backend.from_numpy(np.zeros((2, 3, 3)), "float32")
    z = backend.from_numpy(np.zeros((2, 3)), "float32")
    match = r"state.S has dtype .*float32 but inputs of dtype .*float64 are computed in"
    with pytest.raises(TypeError, match=match):
        if fn == "causal":
            causal_linear_attention(q, k, v, initial_state=LinearAttentionState(S, z))
        else:
            step(q[:, 0, :], k[:, 0, :], v[:, 0, :], LinearAttentionState(S, z))


@pytest.mark.parametrize("method", METHODS)
def test_empty_sequence_returns_a_new_state(backend, method, rng):
    q, k, v = (backend.from_numpy(x) for x in rng.standard_normal((3, 2, 0, 3)))
    S0, z0 = rng.standard_normal((2, 3, 3)), rng.random((2, 3))
    state = LinearAttentionState(backend.from_numpy(S0), backend.from_numpy(z0))
    out, new = causal_linear_attention(
        q, k, v, method=method, initial_state=state, return_state=True
    )
    assert out.shape == (2, 0, 3)
    assert new.S is not state.S and new.z is not state.z
    np.testing.assert_array_equal(backend.to_numpy(new.S), S0)
    np.testing.assert_array_equal(backend.to_numpy(new.z), z0)
    if backend.library == "numpy":
        assert not np.shares_memory(new.S, state.S) and not np.shares_memory(new.z, state.z)
    if backend.library == "torch":
        assert new.S.data_ptr() != state.S.data_ptr() and new.z.data_ptr() != state.z.data_ptr()


# -- 4. gates, scalars, devices and layouts (issue 22) ------------------------------------------
@pytest.mark.only_backend(Backend.DASK)
@pytest.mark.eager
@pytest.mark.parametrize("t_chunk", [None, 16])
def test_dask_per_channel_gate_graph_stays_small(backend, t_chunk, rng):
    """A per-channel gate's Dask graph is within 3x the scalar gate's, at any T: its scores
    are placed by selection, never concatenated from quadrants (one Dask chunk per quadrant
    was C^2 tasks per chunk: 56,381 against 127 at T=37)."""
    import dask.array as da

    for length in (1, 5, 37, 64, 100, 333):
        x = rng.standard_normal((2, length, 4))
        chunks = (2, t_chunk or length, 4)
        q = da.from_array(x, chunks=chunks)
        gates = {w: -rng.random((2, length, w)) for w in (1, 4)}
        sizes = {}
        for width, g in gates.items():
            out = causal_linear_attention(q, q, q, log_decay=da.from_array(g, chunks=chunks))
            sizes[width] = len(out.__dask_graph__())
        assert sizes[4] <= 3 * sizes[1], (length, sizes)
    want, _, _ = decayed_loop(elu_plus_one(x), elu_plus_one(x), x, gates[4])
    np.testing.assert_allclose(out.compute(), want, rtol=0, atol=1e-12)


def test_elu_plus_one_limits_at_infinity(backend):
    """elu(x) + 1 is 0 at -inf and inf at +inf on every backend (x / 2 -+ |x| / 2 was
    inf - inf = nan there on all but PyTorch); nan stays nan; finite values are unchanged."""
    x = np.array([-np.inf, -700.0, -1.0, -0.0, 0.0, 2.0, 1e308, np.inf, np.nan])
    got = backend.to_numpy(elu_plus_one_map(backend.from_numpy(x)))
    np.testing.assert_allclose(got, elu_plus_one(x), rtol=1e-15, atol=0)
    np.testing.assert_array_equal(got[[0, 7, 8]], [0.0, np.inf, np.nan])


def test_infinite_key_adds_nothing(backend, rng):
    """A key of -inf has features 0: every other output is that of the sequence with the key
    masked (a NaN before: 0 * inf inside the map), on every backend and method."""
    q, k, v = rng.standard_normal((3, 2, 7, 3))
    k[1, 3] = -np.inf
    mask = np.ones((2, 7), dtype=bool)
    mask[1, 3] = False
    for method in METHODS:
        got = _run(backend, causal_linear_attention, (q, k, v), method=method, chunk_size=CHUNK)
        masked = causal_linear_attention(
            q, np.where(mask[..., None], k, 0.0), v, method=method, attention_mask=mask
        )
        assert np.isfinite(got).all(), method
        np.testing.assert_allclose(got[mask], masked[mask], rtol=0, atol=1e-12, err_msg=method)


def test_dpfp_product_with_a_zero_factor_is_zero(backend):
    """dpfp multiplies features: a zero factor gives 0 even when the other one is inf."""
    x = np.array([[np.inf, -2.0], [-np.inf, 1.0], [0.5, -3.0]])
    got = backend.to_numpy(dpfp(2)(backend.from_numpy(x)))
    np.testing.assert_array_equal(got[0], [np.inf, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[1], [0, 0, np.inf, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[2], dpfp(2)(x[2]))
