"""16-bit inputs accumulate in float32 and come back in their own dtype.

The failure this prevents, at T = 32768 and d = 64 with the default ``elu + 1`` map: the
normalizer ``phi(q_t) . z_t`` grows like ``1.16**2 * d * t`` and passes float16's maximum (65504)
after a few hundred tokens, and a float16 running sum ``z_t`` stops growing at a few thousand
(adding ~1 to 8192 rounds back to 8192). polylin accumulates S, z and the chunk products in
float32, so its output stays finite and matches a float64 reference.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from polylin import causal_linear_attention
from polylin.feature_maps import favor_plus

from .reference import ATOL, elu_plus_one, rounded

T, D = 32768, 64


@cache
def long_inputs(dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One head of standard normal q, k, v of length T, rounded to ``dtype`` (as float64)."""
    rng = np.random.default_rng(32768)
    return tuple(rounded(rng.standard_normal((T, D)), dtype) for _ in range(3))


def chunkwise_reference(fq, fk, v, *, chunk=1024, eps=1e-6):
    """Causal linear attention from float64 features, chunk by chunk (never a T x T matrix)."""
    S = np.zeros((fq.shape[-1], v.shape[-1]))
    z = np.zeros(fq.shape[-1])
    out = []
    for start in range(0, len(fq), chunk):
        Q, K, V = fq[start : start + chunk], fk[start : start + chunk], v[start : start + chunk]
        A = np.tril(Q @ K.T)
        numerator = Q @ S + A @ V
        normalizer = Q @ z + A.sum(-1)
        out.append(numerator / (normalizer + eps)[:, None])
        S = S + K.T @ V
        z = z + K.sum(0)
    return np.concatenate(out)


@cache
def long_reference(dtype: str) -> np.ndarray:
    q, k, v = long_inputs(dtype)
    return chunkwise_reference(elu_plus_one(q), elu_plus_one(k), v)


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_sequence_half_precision_matches_float64(backend, dtype):
    """T = 32768, d = 64, one head, chunked: finite, input dtype, close to float64."""
    q, k, v = long_inputs(dtype)
    xs = [backend.from_numpy(a, dtype) for a in (q, k, v)]
    out, state = causal_linear_attention(*xs, return_state=True)
    assert out.dtype == xs[0].dtype
    assert tuple(out.shape) == (T, D)
    assert state.S.dtype == backend.dtype("float32")
    assert state.z.dtype == backend.dtype("float32")
    result = backend.to_numpy(out).astype(np.float64)
    assert np.all(np.isfinite(result))
    np.testing.assert_allclose(result, long_reference(dtype), rtol=0, atol=ATOL[dtype])
    # the state is the float32 sum of all keys: ~38000 per feature, beyond float16's reach
    z_exact = elu_plus_one(k).sum(0)
    np.testing.assert_allclose(backend.to_numpy(state.z), z_exact, rtol=1e-5)


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_favor_plus_half_precision(backend, dtype):
    """FAVOR+ features are computed in float32 for 16-bit inputs too."""
    rng = np.random.default_rng(16)
    q, k, v = (rounded(rng.standard_normal((2048, 16)) * s, dtype) for s in (0.5, 0.5, 1.0))
    phi = favor_plus(16, 64, seed=0)
    xs = [backend.from_numpy(a, dtype) for a in (q, k, v)]
    out = causal_linear_attention(*xs, phi)
    assert out.dtype == xs[0].dtype
    # float64 NumPy features of the same rounded inputs
    expected = chunkwise_reference(phi.map_query(q), phi(k), v)
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=ATOL[dtype])
