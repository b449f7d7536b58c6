"""Feature maps on every backend: values against NumPy formulas, shapes, positivity, kernels."""

from __future__ import annotations

import math
import random
import re

import array_api_compat
import numpy as np
import pytest

import polylin
from polylin import (
    causal_linear_attention,
    feature_maps,
    linear_attention,
    masked_kernel_attention,
    step,
)
from polylin.feature_maps import (
    FAVOR_MAX_KEY_EXPONENT,
    FAVOR_MAX_QUERY_EXPONENT,
    RELU_EPS,
    dpfp,
    elu_plus_one,
    favor_plus,
    identity,
    relu,
    taylor_exp,
)
from polylin.testing import Backend

from .reference import elu_plus_one as ref_elu_plus_one

# ---------------------------------------------------------------- independent NumPy formulas


def ref_taylor(x):
    outer = x[..., :, None] * x[..., None, :]
    outer = outer.reshape(*x.shape[:-1], -1)
    return np.concatenate([np.ones((*x.shape[:-1], 1)), x, outer / np.sqrt(2.0)], axis=-1)


def ref_dpfp(x, nu):
    """Schlag et al.'s reference code, transcribed: products of r with its rolls."""
    r = np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], axis=-1)
    rolled = np.concatenate([np.roll(r, j, axis=-1) for j in range(1, nu + 1)], axis=-1)
    return np.concatenate([r] * nu, axis=-1) * rolled


def favor_matrix(phi):
    """The (dim, m) projection as float64 NumPy."""
    return np.asarray(phi.projection(np.zeros((1, phi.dim))))


def ref_favor_exponent(phi, x):
    xs = np.asarray(x, np.float64) * phi.dim**-0.25
    return xs @ favor_matrix(phi) - 0.5 * (xs * xs).sum(-1, keepdims=True)


def ref_favor_key(phi, x):
    return np.exp(ref_favor_exponent(phi, x) - phi.key_offset) / np.sqrt(phi.num_features)


def ref_favor_query(phi, x):
    e = ref_favor_exponent(phi, x)
    e = e - e.max(-1, keepdims=True) + phi.key_offset
    return np.exp(e) / np.sqrt(phi.num_features)


def softmax_attention(q, k, v, *, causal):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def map_kernel_reference(fq, fk, v, *, causal=True, eps=1e-6):
    """Masked kernel attention from already mapped float64 features."""
    scores = fq @ np.swapaxes(fk, -1, -2)
    if causal:
        scores = np.tril(scores)
    return (scores @ v) / (scores.sum(-1, keepdims=True) + eps)


# (name, factory, numpy reference of the key map, numpy reference of the query map, size(d))
D = 6
MAPS = {
    "elu_plus_one": (lambda: elu_plus_one, ref_elu_plus_one, None, lambda d: d),
    "relu": (lambda: relu, lambda x: np.maximum(x, 0) + RELU_EPS, None, lambda d: d),
    "identity": (lambda: identity, lambda x: x, None, lambda d: d),
    "taylor_exp": (lambda: taylor_exp, ref_taylor, None, lambda d: 1 + d + d * d),
    "dpfp1": (lambda: dpfp(), lambda x: ref_dpfp(x, 1), None, lambda d: 2 * d),
    "dpfp3": (lambda: dpfp(nu=3), lambda x: ref_dpfp(x, 3), None, lambda d: 6 * d),
    "favor_plus": (
        lambda: favor_plus(D, 20, seed=3),
        lambda x: ref_favor_key(favor_plus(D, 20, seed=3), x),
        lambda x: ref_favor_query(favor_plus(D, 20, seed=3), x),
        lambda d: 20,
    ),
    "favor_plus_iid": (
        lambda: favor_plus(D, 9, seed=1, orthogonal=False),
        lambda x: ref_favor_key(favor_plus(D, 9, seed=1, orthogonal=False), x),
        lambda x: ref_favor_query(favor_plus(D, 9, seed=1, orthogonal=False), x),
        lambda d: 9,
    ),
}
NEW_MAPS = ["identity", "taylor_exp", "dpfp1", "dpfp3", "favor_plus", "favor_plus_iid"]


@pytest.mark.slow_grid(cover=("name",))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(MAPS))
def test_map_values_shape_dtype(backend, name, dtype, rng):
    make, ref_key, ref_query, size = MAPS[name]
    phi = make()
    x = rng.standard_normal((2, 5, D)).astype(dtype)
    xb = backend.from_numpy(x)
    tol = {"float64": 1e-12, "float32": 2e-6}[dtype]
    calls = [(phi, ref_key)]
    if ref_query is not None:
        calls.append((phi.map_query, ref_query))
    for fn, ref in calls:
        out = fn(xb)
        assert array_api_compat.array_namespace(out) is array_api_compat.array_namespace(xb)
        assert array_api_compat.device(out) == array_api_compat.device(xb)
        assert out.dtype == xb.dtype
        assert tuple(out.shape) == (2, 5, size(D))
        expected = ref(x.astype(np.float64))
        np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=tol, atol=tol)


@pytest.mark.slow_grid
@pytest.mark.parametrize("name", ["elu_plus_one", "relu", "dpfp1", "dpfp3", "favor_plus"])
def test_features_non_negative(backend, name, rng):
    make, *_ = MAPS[name]
    phi = make()
    x = backend.from_numpy(rng.standard_normal((50, D)) * 3.0)
    for fn in (phi, getattr(phi, "map_query", phi)):
        out = backend.to_numpy(fn(x))
        if name.startswith("dpfp"):
            assert np.all(out >= 0)
            assert np.any(out > 0, axis=-1).all()  # generic inputs: never an all-zero row
        else:
            assert np.all(out > 0)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_numpy_maps_return_fresh_writable_arrays(dtype, rng):
    """The zero the maps compare with is made once per dtype on NumPy: no output shares it,
    and writing into an output changes no later result."""
    x = rng.standard_normal((2, 5)).astype(dtype)
    for phi in (elu_plus_one, relu, dpfp(1)):
        first, want = phi(x), phi(x).copy()
        assert first.dtype == dtype and first.flags.writeable
        first[...] = 7.0
        np.testing.assert_array_equal(phi(x), want)


def test_identity_returns_its_input():
    x = np.arange(3.0)
    assert identity(x) is x


def test_taylor_exp_kernel_identity(backend, rng):
    """phi(x) . phi(y) = 1 + x.y + (x.y)^2 / 2 exactly, hence >= 1/2 for every pair."""
    x = rng.standard_normal((7, 5)) * 2
    y = rng.standard_normal((9, 5)) * 2
    fx, fy = (backend.to_numpy(taylor_exp(backend.from_numpy(a))) for a in (x, y))
    t = x @ y.T
    kernel = fx @ fy.T
    np.testing.assert_allclose(kernel, 1 + t + t * t / 2, rtol=1e-12, atol=1e-12)
    assert kernel.min() >= 0.5 - 1e-12
    # the minimum 1/2 is reached at x.y = -1
    a = np.array([[1.0, 0.0]])
    b = np.array([[-1.0, 0.0]])
    assert np.isclose((taylor_exp(a) @ taylor_exp(b).T)[0, 0], 0.5)


def test_dpfp_sizes_and_example():
    x = np.array([1.0, -2.0, 0.5])
    assert dpfp(2)(x).shape == (12,)
    assert dpfp(nu=2).num_features(3) == 12
    np.testing.assert_array_equal(dpfp()(x), ref_dpfp(x, 1))


# ---------------------------------------------------------------- favor_plus specifics


def test_favor_plus_attributes_and_repr():
    phi = favor_plus(8, 40, seed=5, orthogonal=False)
    assert (phi.dim, phi.num_features, phi.seed, phi.orthogonal) == (8, 40, 5, False)
    assert repr(phi) == "favor_plus(dim=8, num_features=40, seed=5, orthogonal=False)"
    assert repr(favor_plus(4)) == "favor_plus(dim=4, num_features=256, seed=0, orthogonal=True)"


def test_favor_plus_same_seed_same_result_on_every_backend(backend, rng):
    """The projection comes from the seed alone: every backend reproduces NumPy's features."""
    x = rng.standard_normal((3, 11, 16))
    expected_key = favor_plus(16, 64, seed=7)(x)
    expected_query = favor_plus(16, 64, seed=7).map_query(x)
    phi = favor_plus(16, 64, seed=7)  # a fresh object: nothing shared but the seed
    xb = backend.from_numpy(x)
    np.testing.assert_allclose(backend.to_numpy(phi(xb)), expected_key, rtol=1e-12, atol=0)
    np.testing.assert_allclose(
        backend.to_numpy(phi.map_query(xb)), expected_query, rtol=1e-12, atol=0
    )
    other = backend.to_numpy(favor_plus(16, 64, seed=8)(xb))
    assert not np.allclose(other, expected_key)


def ref_favor_projection(dim, m, seed, orthogonal):
    """The documented recipe, transcribed to float64 NumPy: from ``random.Random(seed)`` the
    ``m`` chi norms, then Box-Muller uniforms (radii, then angles); the Gaussian blocks
    orthonormalized by a QR with ``diag(R) > 0`` (or i.i.d. columns normalized)."""
    rng = random.Random(seed)
    norms = np.sqrt([2.0 * rng.gammavariate(dim / 2.0, 1.0) for _ in range(m)])
    blocks, width = (-(-m // dim), dim) if orthogonal else (1, m)
    count = blocks * dim * width
    pairs = (count + 1) // 2
    radius = np.sqrt(-2.0 * np.log([1.0 - rng.random() for _ in range(pairs)]))
    angle = 2.0 * np.pi * np.array([rng.random() for _ in range(pairs)])
    gaussian = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
    gaussian = gaussian.reshape(blocks, dim, width)
    if orthogonal:
        q, r = np.linalg.qr(gaussian)
        q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
        directions = np.concatenate(list(q), axis=1)[:, :m]
    else:
        directions = gaussian[0] / np.linalg.norm(gaussian[0], axis=0)
    return directions * norms


@pytest.mark.parametrize("orthogonal", [True, False])
@pytest.mark.parametrize("dim, m, seed", [(4, 4, 0), (6, 20, 3), (1, 5, 7), (16, 40, -2)])
def test_favor_plus_projection_follows_the_documented_recipe(dim, m, seed, orthogonal):
    """The seed fixes the map: the projection is the documented stream, drawn the documented way."""
    phi = favor_plus(dim, m, seed=seed, orthogonal=orthogonal)
    matrix = favor_matrix(phi)
    assert matrix.shape == (dim, m) and matrix.dtype == np.float64
    expected = ref_favor_projection(dim, m, seed, orthogonal)
    np.testing.assert_allclose(matrix, expected, rtol=0, atol=1e-12)


def _widest_float(backend):
    """float64 where the backend has it (not JAX without x64), else float32."""
    probe = backend.from_numpy(np.zeros(1))
    return np.float64 if backend.to_numpy(probe).dtype == np.float64 else np.float32


@pytest.mark.slow_grid
@pytest.mark.parametrize("orthogonal", [True, False])
def test_favor_plus_same_rows_on_every_backend(backend, orthogonal):
    """Built with the input's own library (its QR or the fallback), the rows match NumPy's."""
    dim, m = 16, 72  # 4 full orthogonal blocks and a partial one
    dtype = _widest_float(backend)
    x = backend.from_numpy(np.zeros((1, dim), dtype))
    matrix = favor_plus(dim, m, seed=21, orthogonal=orthogonal).projection(x)
    assert array_api_compat.array_namespace(matrix) is array_api_compat.array_namespace(x)
    assert array_api_compat.device(matrix) == array_api_compat.device(x)
    assert matrix.dtype == x.dtype
    expected = ref_favor_projection(dim, m, 21, orthogonal)
    tol = {np.float64: 1e-12, np.float32: 2e-5}[dtype]  # float32: built in float32 (JAX, no x64)
    np.testing.assert_allclose(backend.to_numpy(matrix), expected, rtol=0, atol=tol)


def test_favor_plus_projection_without_the_linalg_extension():
    """linalg is optional in the standard: without it, Gram-Schmidt gives the same rows."""
    if Backend.ARRAY_API_STRICT.unavailable_reason() is not None:
        pytest.skip(Backend.ARRAY_API_STRICT.unavailable_reason())
    strict = Backend.ARRAY_API_STRICT.module()
    x = strict.zeros((1, 12), dtype=strict.float64)
    with strict.ArrayAPIStrictFlags(enabled_extensions=()):
        assert not hasattr(strict, "linalg")
        matrix = favor_plus(12, 30, seed=1234).projection(x)
    expected = ref_favor_projection(12, 30, 1234, True)
    np.testing.assert_allclose(np.asarray(matrix), expected, rtol=0, atol=1e-12)


def test_favor_plus_projection_is_shared_and_the_cache_is_bounded(monkeypatch):
    """One array per (parameters, library, device, dtype), shared by every map with those
    parameters (no copy per map); the cache keeps at most its byte budget, dropping the least
    recently used; a projection larger than the budget is built but not kept."""
    x32, x64 = np.zeros((1, 5), np.float32), np.zeros((1, 5))
    a, b = favor_plus(5, 12, seed=2), favor_plus(5, 12, seed=2)
    assert a.projection(x64) is b.projection(x64)
    assert a.projection(x32).dtype == np.float32
    assert a.projection(x32) is not a.projection(x64)
    np.testing.assert_array_equal(a.projection(x32), a.projection(x64).astype(np.float32))

    entry = 5 * 100 * 8  # one (5, 100) float64 projection
    monkeypatch.setattr(feature_maps, "_PROJECTION_CACHE_BYTES", 2 * entry)
    first, second, third = (favor_plus(5, 100, seed=s) for s in (1001, 1002, 1003))
    kept_first, kept_second = first.projection(x64), second.projection(x64)
    assert first.projection(x64) is kept_first  # first is now the most recently used
    kept_third = third.projection(x64)  # over budget: drops second, the least recently used
    assert first.projection(x64) is kept_first
    assert third.projection(x64) is kept_third
    assert second.projection(x64) is not kept_second  # rebuilt (equal, not the same object)
    np.testing.assert_array_equal(second.projection(x64), kept_second)
    assert sum(size for _, size in feature_maps._projection_cache.values()) <= 2 * entry
    big = favor_plus(5, 300, seed=1004)  # 12000 bytes > budget: returned, never kept
    assert big.projection(x64).shape == (5, 300)
    assert big.projection(x64) is not big.projection(x64)


@pytest.mark.parametrize("dim, m", [(4, 4), (8, 20), (3, 7)])
def test_favor_plus_orthogonal_blocks_with_chi_norms(dim, m):
    w = favor_matrix(favor_plus(dim, m, seed=11)).T  # (m, dim)
    norms = np.linalg.norm(w, axis=-1)
    directions = w / norms[:, None]
    for start in range(0, m, dim):
        block = directions[start : start + dim]
        np.testing.assert_allclose(block @ block.T, np.eye(len(block)), atol=1e-12)
    # norms are not all equal (chi-distributed, not normalized rows) and not the block's
    # Gram-Schmidt norms (which would be exactly 1)
    assert norms.std() > 0.05
    w_iid = favor_matrix(favor_plus(dim, m, seed=11, orthogonal=False)).T
    d_iid = w_iid / np.linalg.norm(w_iid, axis=-1, keepdims=True)
    gram = d_iid[:dim] @ d_iid[:dim].T
    assert np.abs(gram - np.eye(dim)).max() > 0.05


def test_favor_plus_chi_norms_statistics():
    """Row norms follow chi(dim), as those of i.i.d. Gaussian rows would."""
    dim = 16
    norms = np.linalg.norm(favor_matrix(favor_plus(dim, 4096, seed=0)), axis=0)
    mean = math.sqrt(2) * math.exp(math.lgamma((dim + 1) / 2) - math.lgamma(dim / 2))
    std = math.sqrt(dim - mean**2)
    # 4096 samples: standard errors about 0.011 (mean) and 0.008 (std)
    assert abs(norms.mean() - mean) < 0.04
    assert abs(norms.std() - std) < 0.03


def test_favor_plus_estimates_the_softmax_kernel():
    """Averaged over seeds, phi(q) . phi(k) estimates exp(q . k / sqrt(d)) (key map on both)."""
    rng = np.random.default_rng(5)
    dim = 8
    q, k = rng.standard_normal((2, dim)) * 0.6
    maps = [favor_plus(dim, 256, seed=s) for s in range(400)]
    estimates = np.array([phi(q) @ phi(k) for phi in maps])
    exact = np.exp(q @ k / np.sqrt(dim))
    # 400 seeds: the standard error of the mean is about 0.5 % of exact, so a bias of 2 % is
    # four standard errors away (40 seeds, as before, only gave 1.4)
    assert estimates.std() / np.sqrt(len(maps)) < 0.006 * exact
    assert abs(estimates.mean() - exact) < 0.02 * exact


@pytest.mark.slow_grid
@pytest.mark.parametrize("causal", [True, False])
def test_favor_plus_approximation_improves_with_features(backend, causal):
    """Fixed seed: 1024 features approximate softmax attention much better than 16."""
    rng = np.random.default_rng(3)
    dim, T = 16, 48
    q, k = rng.standard_normal((2, 2, T, dim)) * 0.5
    v = rng.standard_normal((2, T, 4))
    expected = softmax_attention(q, k, v, causal=causal)
    errors = {}
    for m in (16, 1024):
        phi = favor_plus(dim, m, seed=0)
        xs = [backend.from_numpy(a) for a in (q, k, v)]
        if causal:
            out = causal_linear_attention(*xs, phi, chunk_size=16)
        else:
            out = linear_attention(*xs, phi)
        err = backend.to_numpy(out) - expected
        errors[m] = np.linalg.norm(err) / np.linalg.norm(expected)
    assert errors[1024] < 0.3 * errors[16]
    assert errors[1024] < 0.1


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_favor_plus_linear_forms_equal_masked_kernel(backend, method, rng):
    """Exact for any fixed map: every method equals the quadratic form with the same map."""
    phi = favor_plus(D, 32, seed=4)
    q, k, v = rng.standard_normal((3, 2, 21, D))
    xs = [backend.from_numpy(a) for a in (q, k, v)]
    out = backend.to_numpy(causal_linear_attention(*xs, phi, method=method, chunk_size=8))
    expected = map_kernel_reference(ref_favor_query(phi, q), ref_favor_key(phi, k), v)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-10)
    np.testing.assert_allclose(
        backend.to_numpy(masked_kernel_attention(*xs, phi)), expected, rtol=0, atol=1e-10
    )
    cross = backend.to_numpy(linear_attention(*xs, phi))
    np.testing.assert_allclose(
        cross,
        map_kernel_reference(ref_favor_query(phi, q), ref_favor_key(phi, k), v, causal=False),
        rtol=0,
        atol=1e-10,
    )


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_favor_plus_state_passing_and_step(backend, method, rng):
    phi = favor_plus(D, 24, seed=9)
    q, k, v = (backend.from_numpy(a) for a in rng.standard_normal((3, 2, 17, D)))
    whole = backend.to_numpy(causal_linear_attention(q, k, v, phi, method=method, chunk_size=4))
    head, state = causal_linear_attention(
        q[..., :10, :], k[..., :10, :], v[..., :10, :], phi,
        method=method, chunk_size=4, return_state=True,
    )  # fmt: skip
    tail = causal_linear_attention(
        q[..., 10:, :], k[..., 10:, :], v[..., 10:, :], phi,
        method=method, chunk_size=4, initial_state=state,
    )  # fmt: skip
    np.testing.assert_allclose(backend.to_numpy(head), whole[..., :10, :], atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(tail), whole[..., 10:, :], atol=1e-12)
    o_t, state = step(q[..., 10, :], k[..., 10, :], v[..., 10, :], state, phi)
    np.testing.assert_allclose(backend.to_numpy(o_t), whole[..., 10, :], atol=1e-12)


def test_favor_plus_key_offset_bounds_keys_and_leaves_weights_unchanged():
    """Large dim: the worst-case key exponent passes float32's exp limit; the offset keeps
    every key finite, and adding it back to the queries leaves phi(q) . phi(k) unchanged."""
    dim, m = 192, 64
    phi = favor_plus(dim, m, seed=0)
    w = favor_matrix(phi).T
    bound = (w * w).sum(-1).max() / 2
    assert math.log(np.finfo(np.float32).max) < bound < 144  # overflows without the offset
    assert phi.key_offset == pytest.approx(bound - FAVOR_MAX_KEY_EXPONENT)
    # the key maximizing the exponent of the largest row: x' = w_i, i.e. x = w_i * dim**0.25
    worst = (w[np.argmax((w * w).sum(-1))] * dim**0.25).astype(np.float32)
    features = phi(worst)
    assert np.all(np.isfinite(features))
    assert features.max() == pytest.approx(np.exp(FAVOR_MAX_KEY_EXPONENT) / np.sqrt(m), rel=1e-4)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 5, dim)) * 0.3
    e_q, e_k = ref_favor_exponent(phi, q), ref_favor_exponent(phi, k)
    e_q = e_q - e_q.max(-1, keepdims=True)
    weights_without_offset = np.exp(e_q) @ np.exp(e_k).T / m
    np.testing.assert_allclose(phi.map_query(q) @ phi(k).T, weights_without_offset, rtol=1e-10)
    # query features stay below exp(key_offset) / sqrt(m)
    assert phi.map_query(q).max() == pytest.approx(np.exp(phi.key_offset) / np.sqrt(m))


def test_favor_plus_key_offset_is_capped_for_very_large_dim():
    dim = 256
    phi = favor_plus(dim, 64, seed=0)
    assert phi.key_offset == FAVOR_MAX_QUERY_EXPONENT
    w = favor_matrix(phi).T
    worst = (w[np.argmax((w * w).sum(-1))] * dim**0.25).astype(np.float32)
    assert np.all(np.isfinite(phi(worst)))  # exponent bound - 80 < 88.7 here
    assert np.all(np.isfinite(phi.map_query(worst)))


def test_favor_plus_small_dim_has_no_offset():
    assert favor_plus(64, 256, seed=0).key_offset == 0.0


def test_favor_plus_rejects_wrong_input_size():
    phi = favor_plus(4, 8)
    with pytest.raises(ValueError, match=r"favor_plus\(dim=4.*\(\.\.\., 4\).*\(2, 5\)"):
        phi(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="dim=4"):
        causal_linear_attention(*np.zeros((3, 2, 3)), phi)
    with pytest.raises(TypeError, match=r"real floating inputs, got x of dtype int64"):
        phi(np.zeros((2, 4), dtype=np.int64))


def test_favor_plus_of_another_size_names_the_callers_input():
    """A map built for d_k=3 on keys of d_k=4: the error names q and its shape as passed (not
    the chunked form's one-token probe, nor the standard layout) and the map's size."""
    phi = favor_plus(3, 8)
    q, v = np.zeros((2, 8, 4)), np.zeros((2, 8, 3))
    want = r"^q has shape \(2, 8, 4\), d_k=4, but feature_map=favor_plus\(dim=3, .*maps d_k=3"
    for method in polylin.METHODS:
        with pytest.raises(ValueError, match=want):
            causal_linear_attention(q, q, v, phi, method=method, chunk_size=4)
    for fn in (linear_attention, masked_kernel_attention):
        with pytest.raises(ValueError, match=want):
            fn(q, q, v, phi)
    with pytest.raises(ValueError, match=r"^q has shape \(8, 2, 4\), d_k=4"):
        causal_linear_attention(*(x.transpose(1, 0, 2) for x in (q, q, v)), phi, seq_axis=0)
    with pytest.raises(ValueError, match=r"^q_t has shape \(2, 4\), d_k=4, .*maps d_k=3"):
        step(q[:, 0], q[:, 0], v[:, 0], None, phi)


@pytest.mark.parametrize(("factory", "call"), [(favor_plus, "favor_plus(4)"), (dpfp, "dpfp()")])
def test_a_factory_itself_is_not_a_feature_map(factory, call):
    q = np.zeros((2, 8, 4))
    with pytest.raises(TypeError, match=rf"^feature_map={factory.__name__} is the factory .* "
                       rf"call it, e\.g\. feature_map={re.escape(call)}$"):  # fmt: skip
        causal_linear_attention(q, q, q, factory)


def test_favor_plus_under_jax_jit_does_not_cache_tracers():
    if Backend.JAX.unavailable_reason() is not None:
        pytest.skip(Backend.JAX.unavailable_reason())
    jax = pytest.importorskip("jax")
    phi = favor_plus(4, 8, seed=0)
    x = Backend.JAX.from_numpy(np.linspace(-1, 1, 12).reshape(3, 4))
    jitted = jax.jit(lambda a: phi(a))
    # traced first: the projection is built eagerly, once, as a constant of the compiled
    # function (no QR in its program), and kept for later calls
    assert "qr" not in str(jax.make_jaxpr(lambda a: favor_plus(4, 8, seed=4321)(a))(x))
    first = jitted(x)
    second = phi(x)  # outside the trace: must not find a leaked tracer in the cache
    np.testing.assert_allclose(np.asarray(first), np.asarray(second), rtol=1e-12)
    grad = jax.grad(lambda a: phi.map_query(a).sum())(x)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_favor_plus_inference_mode_then_training():
    """A projection made under torch.inference_mode is not cached into a later backward."""
    torch = pytest.importorskip("torch")
    phi = favor_plus(4, 8, seed=0)
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    with torch.inference_mode():
        evaluated = phi(x)
        assert not phi.projection(x).is_inference()  # built outside inference mode: reusable
    x = x.clone().requires_grad_(True)
    trained = phi(x)
    trained.sum().backward()
    torch.testing.assert_close(trained.detach(), evaluated, rtol=1e-12, atol=0)
    assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------- inside attention, every map


@pytest.mark.slow_grid
@pytest.mark.parametrize("name", NEW_MAPS)
def test_new_maps_inside_causal_attention(backend, name, rng):
    make, ref_key, ref_query, _ = MAPS[name]
    q, k, v = rng.standard_normal((3, 2, 13, D))
    if name == "identity":  # the caller keeps identity features positive
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    xs = [backend.from_numpy(a) for a in (q, k, v)]
    out = backend.to_numpy(causal_linear_attention(*xs, make(), chunk_size=5))
    fq = (ref_query or ref_key)(q)
    expected = map_kernel_reference(fq, ref_key(k), v)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: favor_plus(0), ValueError, "dim must be >= 1, got 0"),
        (lambda: favor_plus(-3), ValueError, "dim must be >= 1"),
        (lambda: favor_plus(4.0), TypeError, "dim must be an int, got float"),
        (lambda: favor_plus(True), TypeError, "dim must be an int, got bool"),
        (lambda: favor_plus(4, 0), ValueError, "num_features must be >= 1, got 0"),
        (lambda: favor_plus(4, 2.5), TypeError, "num_features must be an int"),
        (lambda: favor_plus(4, seed="a"), TypeError, "seed must be an int, got str"),
        (lambda: favor_plus(4, orthogonal=1), TypeError, "orthogonal must be a bool"),
        (lambda: dpfp(0), ValueError, "nu must be >= 1, got 0"),
        (lambda: dpfp(nu=-1), ValueError, "nu must be >= 1"),
        (lambda: dpfp(1.5), TypeError, "nu must be an int, got float"),
    ],
)
def test_bad_arguments_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_keyword_only_options():
    with pytest.raises(TypeError):
        favor_plus(4, 8, 0)  # seed is keyword-only


def test_exports():
    import polylin.feature_maps as fm

    for name in ("identity", "favor_plus", "taylor_exp", "dpfp", "elu_plus_one", "relu"):
        assert name in fm.__all__
        assert callable(getattr(polylin.feature_maps, name))
