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
    delta_rule_attention,
    delta_rule_step,
    linear_attention,
    masked_kernel_attention,
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
    # NumPy arrays among the options (a log decay) go to the backend, traced on JAX.
    given = {n: backend.from_numpy(x) for n, x in kwargs.items() if isinstance(x, np.ndarray)}
    kwargs = {n: x for n, x in kwargs.items() if n not in given}
    if backend.library == "jax.numpy" and kwargs.get("method") != "recurrent":
        # The mask is traced, the options static: calls that differ only in values share one
        # compiled program (a clean and a poisoned run, the cases of one test).
        traced = (
            given
            if kwargs.get("attention_mask") is None
            else {**given, "attention_mask": kwargs.pop("attention_mask")}
        )
        return backend.to_numpy(_jitted(fn, tuple(sorted(kwargs.items())))(*xs, **traced))
    return backend.to_numpy(fn(*xs, **given, **kwargs))


@functools.cache
def _jitted(fn, static: tuple):
    import jax

    def call(*xs, **traced):
        return fn(*xs, **traced, **dict(static))

    return jax.jit(call)


# -- 1. masks decide by selection ------------------------------------------------------------
@pytest.mark.slow_grid
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


@pytest.mark.slow_grid
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


@pytest.mark.slow_grid
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


@pytest.mark.slow_grid
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


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_future_value_reach_is_as_documented(backend, method, rng):
    """A non-finite *value* at t (not masked): what docs/numerics.md says, exactly.

    The recurrent form keeps every output before t; the chunked form every output before the
    chunk that holds t (0 x NaN inside the intra-chunk matrix product reaches the earlier rows
    of that chunk), except where its forward is a scan over the tokens (jitted JAX on the CPU,
    as the suite runs the ``jax`` backend): there every output before t; the quadratic form
    none (one T x T product). From t on every output is NaN.
    """
    q, k, v = rng.standard_normal((3, 2, T, 3))
    t = 6
    bad = v.copy()
    bad[:, t] = np.nan
    kwargs = dict(method=method, chunk_size=CHUNK)
    clean = _run(backend, causal_linear_attention, (q, k, v), **kwargs)
    poisoned = _run(backend, causal_linear_attention, (q, k, bad), **kwargs)
    scanned = backend is Backend.JAX  # jitted by the suite, on the CPU
    kept = {"recurrent": t, "chunked": t if scanned else t - t % CHUNK, "quadratic": 0}[method]
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


@pytest.mark.slow_grid
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


@pytest.mark.slow_grid
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


@pytest.mark.slow_grid
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


def _delta_loop(q, k, v, beta, log_decay):
    """The gated delta rule token by token in float64: S = a S + beta k (v - a S^T k)^T."""
    *lead, length, d_k = q.shape
    g = np.broadcast_to(log_decay, (*lead, length, 1))
    b = np.broadcast_to(beta, (*lead, length, 1))
    out = np.zeros((*lead, length, v.shape[-1]))
    for index in np.ndindex(*lead):
        S = np.zeros((d_k, v.shape[-1]))
        for t in range(length):
            a, kt = np.exp(g[index][t, 0]), k[index][t]
            S = a * S + b[index][t, 0] * np.outer(kt, v[index][t] - a * S.T @ kt)
            out[index][t] = S.T @ q[index][t]
    return out


def _gates_with_positive_values(rng, shape):
    """Log decays in [-1, 0] with a third of them replaced by values above 0, and the same
    gates with those values taken as 0 (what every entry point computes)."""
    g = -rng.random(shape)
    g.flat[::3] = 0.0
    positive = np.where(g == 0.0, rng.uniform(0.1, 5.0, shape), g)
    return positive, g


@pytest.mark.slow_grid
@pytest.mark.parametrize("width", [1, 3], ids=["token", "channel"])
def test_positive_log_decay_array_is_taken_as_zero(backend, width, rng):
    """One policy everywhere: array values above 0 act as 0 (a decay never amplifies), in
    every method of causal_linear_attention, masked_kernel_attention and step (before: NaN,
    or a growing state)."""
    q, k, v = rng.standard_normal((3, 2, T, 3))
    positive, clamped = _gates_with_positive_values(rng, (2, T, width))
    fq, fk = elu_plus_one(q), elu_plus_one(k)
    want, _, _ = decayed_loop(fq, fk, v, clamped)
    for method in METHODS:
        got = _run(backend, causal_linear_attention, (q, k, v), method=method,
                   chunk_size=CHUNK, log_decay=positive)  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=method)
    got = _run(backend, masked_kernel_attention, (q, k, v), log_decay=positive)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    xs = [backend.from_numpy(x) for x in (q, k, v, positive)]
    state = None
    for t in range(T):
        o_t, state = step(xs[0][:, t, :], xs[1][:, t, :], xs[2][:, t, :], state,
                          log_decay=xs[3][:, t, :])  # fmt: skip
        np.testing.assert_allclose(backend.to_numpy(o_t), want[:, t], rtol=1e-10, atol=1e-12)


def test_positive_log_decay_array_in_the_delta_rule(backend, rng):
    """The delta rule follows the same policy, in both methods and in delta_rule_step."""
    q, k, v = rng.standard_normal((3, 2, T, 3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.1, 1.0, (2, T, 1))
    positive, clamped = _gates_with_positive_values(rng, (2, T, 1))
    want = _delta_loop(q, k, v, beta, clamped)
    for method in ("chunked", "recurrent"):
        got = _run(backend, delta_rule_attention, (q, k, v, beta), method=method,
                   chunk_size=CHUNK, log_decay=positive)  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=method)
    xs = [backend.from_numpy(x) for x in (q, k, v, beta, positive)]
    state = None
    for t in range(T):
        o_t, state = delta_rule_step(*(x[:, t, :] for x in xs[:4]), state,
                                     log_decay=xs[4][:, t, :])  # fmt: skip
        np.testing.assert_allclose(backend.to_numpy(o_t), want[:, t], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("value", [0.5, np.float32(0.5), np.float64(1e-9), np.inf, np.nan])
def test_log_decay_number_above_zero_is_an_error_everywhere(value, rng):
    """A number is checked where it is given: above 0 (or not finite) is a ValueError at every
    entry point and in the layer's hook."""
    q, k, v = rng.standard_normal((3, 2, 5, 3))
    message = r"^log_decay must be a finite number <= 0"
    calls = [
        lambda: causal_linear_attention(q, k, v, log_decay=value),
        lambda: masked_kernel_attention(q, k, v, log_decay=value),
        lambda: step(q[:, 0], k[:, 0], v[:, 0], log_decay=value),
        lambda: delta_rule_attention(q, k, v, 0.5, log_decay=value),
        lambda: delta_rule_step(q[:, 0], k[:, 0], v[:, 0], 0.5, log_decay=value),
    ]
    for method in METHODS:
        calls.append(lambda m=method: causal_linear_attention(q, k, v, method=m, log_decay=value))
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()


def test_layer_positive_log_decay_follows_the_policy(rng):
    """polylin.torch.LinearAttention: a hook's gate tensor above 0 acts as 0; a number above 0
    is the functions' ValueError."""
    torch = pytest.importorskip("torch")
    from polylin.torch import LinearAttention

    class Gated(LinearAttention):
        gate: object = None

        def log_decay(self, x):
            return self.gate

    torch.manual_seed(0)
    layer = Gated(8, 2).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    positive, clamped = (torch.tensor(g) for g in _gates_with_positive_values(rng, (2, 7, 2)))
    layer.gate = clamped
    want = layer(x)
    layer.gate = positive
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    state = None
    for t in range(7):
        layer.gate = positive[:, t]
        y_t, state = layer.step(x[:, t], state)
        torch.testing.assert_close(y_t, want[:, t], rtol=1e-10, atol=1e-12)
    layer.gate = 0.5
    with pytest.raises(ValueError, match=r"^log_decay must be a finite number <= 0"):
        layer(x)


def test_positive_log_decay_gradient_torch(rng):
    """The selection passes the gradient at 0 whole (``minimum`` would halve it on PyTorch)
    and gives 0 above 0."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x) for x in rng.standard_normal((3, 9, 3)))
    g = torch.tensor(-rng.random((9, 1)))
    g[4] = 0.0
    g[6] = 0.7
    g.requires_grad_(True)
    for method in METHODS:
        (grad,) = torch.autograd.grad(
            causal_linear_attention(q, k, v, method=method, log_decay=g).sum(), g
        )
        h = 1e-6
        below = g.detach().clone()
        below[4] -= h
        one_sided = (
            causal_linear_attention(q, k, v, log_decay=g.detach()).sum()
            - causal_linear_attention(q, k, v, log_decay=below).sum()
        ) / h
        torch.testing.assert_close(grad[4, 0], one_sided, rtol=1e-4, atol=1e-8)
        assert grad[6, 0] == 0.0


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", METHODS)
def test_zero_dimensional_log_decay_array(backend, method, rng):
    """A 0-d array is a gate that broadcasts everywhere (as a number does), in every layout:
    causal_linear_attention refused it ("got shape ()")."""
    q, k, v = rng.standard_normal((3, 2, T, 3))
    want = causal_linear_attention(q, k, v, method=method, log_decay=-0.5, chunk_size=CHUNK)
    g = np.asarray(-0.5)
    got = _run(backend, causal_linear_attention, (q, k, v), method=method, log_decay=g,
               chunk_size=CHUNK)  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    bthd = np.ascontiguousarray(np.swapaxes(rng.standard_normal((3, 2, 2, T, 3)), 2, 3))
    want = causal_linear_attention(*bthd, method=method, log_decay=-0.5, seq_axis=1)
    got = _run(backend, causal_linear_attention, bthd, method=method, log_decay=g, seq_axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if method != "quadratic":
        delta = "chunked" if method == "chunked" else "recurrent"
        want = delta_rule_attention(*bthd, 0.5, log_decay=-0.5, seq_axis=1, method=delta)
        got = _run(backend, delta_rule_attention, (*bthd, np.asarray(0.5)), log_decay=g,
                   seq_axis=1, method=delta)  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_numpy_scalars_with_seq_axis(rng):
    """A NumPy scalar is a number wherever T sits ("has 0 dimensions but q has 4" before)."""
    q, k, v = rng.standard_normal((3, 2, T, 2, 3))  # (batch, T, heads, d)
    for method in METHODS:
        want = causal_linear_attention(q, k, v, method=method, log_decay=-0.5, seq_axis=1)
        for g in (np.float32(-0.5), np.float64(-0.5)):
            got = causal_linear_attention(q, k, v, method=method, log_decay=g, seq_axis=1)
            np.testing.assert_array_equal(got, want)
    for method in ("chunked", "recurrent"):
        want = delta_rule_attention(q, k, v, 0.5, log_decay=-0.5, seq_axis=1, method=method)
        got = delta_rule_attention(
            q, k, v, np.float32(0.5), log_decay=np.float64(-0.5), seq_axis=1, method=method
        )
        np.testing.assert_array_equal(got, want)


@pytest.mark.only_backend(Backend.JAX)
@pytest.mark.eager
def test_jax_transforms_with_one_argument_traced(backend, rng):
    """grad, jit and vmap trace some arguments and close over others: a tracer's unknown device
    is no mismatch for any argument ("log_decay is on device None but q is on device cpu:0")."""
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in rng.standard_normal((3, 2, 6, 3)))
    g = jnp.asarray(-rng.random((2, 6, 1)))
    beta = jnp.full((2, 6, 1), 0.5)
    want = causal_linear_attention(q, k, v, log_decay=g)
    grad = jax.grad(lambda g: causal_linear_attention(q, k, v, log_decay=g).sum())(g)
    assert grad.shape == g.shape and bool(jnp.isfinite(grad).all())
    np.testing.assert_allclose(jax.jit(lambda q: causal_linear_attention(q, k, v, log_decay=g))(q),
                               want, rtol=1e-12, atol=1e-12)  # fmt: skip
    batched = jax.vmap(lambda g: causal_linear_attention(q, k, v, log_decay=g))(jnp.stack([g, g]))
    np.testing.assert_allclose(batched[1], want, rtol=1e-12, atol=1e-12)
    # a float gate passed as an argument is a 0-d tracer
    got = jax.jit(lambda g: causal_linear_attention(q, k, v, log_decay=g))(-0.5)
    np.testing.assert_allclose(got, causal_linear_attention(q, k, v, log_decay=-0.5), rtol=1e-12)
    want = delta_rule_attention(q, k, v, beta, log_decay=g)
    got = jax.jit(lambda b, g: delta_rule_attention(q, k, v, b, log_decay=g))(beta, g)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    jax.grad(lambda g: delta_rule_attention(q, k, v, beta, log_decay=g).sum())(g)
    state = (jnp.zeros((2, 3, 3)), jnp.zeros((2, 3)))
    o_t, _ = jax.jit(lambda g: step(q[:, 0], k[:, 0], v[:, 0], state, log_decay=g))(g[:, 0])
    want, _ = step(q[:, 0], k[:, 0], v[:, 0], log_decay=g[:, 0])
    np.testing.assert_allclose(o_t, want, rtol=1e-12, atol=1e-12)
    S = jnp.zeros((2, 3, 3))
    jax.jit(lambda S: delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], S,
                                      log_decay=g[:, 0]))(S)  # fmt: skip
