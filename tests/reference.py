"""Independent float64 NumPy oracles: the masked kernel form and the design note's loop."""

from __future__ import annotations

import numpy as np


def elu_plus_one(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def masked_kernel(q, k, v, *, causal=True, eps=1e-6, feature_map=elu_plus_one, mask=None):
    """``A = tril(phi(Q) phi(K)^T)``, ``O = A V / (A 1 + eps)`` in float64, masked keys removed."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    fq, fk = feature_map(q), feature_map(k)
    scores = fq @ np.swapaxes(fk, -1, -2)
    if causal:
        scores = np.tril(scores)
    if mask is not None:
        scores = scores * np.asarray(mask, dtype=np.float64)[..., None, :]
    out = (scores @ v) / (scores.sum(-1, keepdims=True) + eps)
    if mask is not None and q.shape[-2] == k.shape[-2]:
        out = out * np.asarray(mask, dtype=np.float64)[..., :, None]
    return out


def seed_loop(q, k, v, eps=1e-6):
    """The design note's per-token loop, transcribed to NumPy (batch, T, d) inputs."""
    fq, fk = elu_plus_one(np.asarray(q, np.float64)), elu_plus_one(np.asarray(k, np.float64))
    v = np.asarray(v, np.float64)
    batch, T, d_k = fq.shape
    state = np.zeros((batch, d_k, v.shape[-1]))
    normalizer = np.zeros((batch, d_k))
    outs = []
    for t in range(T):
        state = state + fk[:, t, :, None] * v[:, t, None, :]
        normalizer = normalizer + fk[:, t]
        num = np.einsum("bd,bdv->bv", fq[:, t], state)
        den = np.einsum("bd,bd->b", fq[:, t], normalizer)[:, None]
        outs.append(num / (den + eps))
    return np.stack(outs, axis=1)


#: Tolerance on outputs (which are convex combinations of values of size ~1), per input dtype.
#: The reference sees the same dtype-rounded inputs, so this bounds accumulation and output
#: rounding only: float32 sums over T, 16-bit outputs are rounded once at the end.
ATOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and back to float64: what a backend in that dtype sees."""
    if dtype == "bfloat16":
        import ml_dtypes  # shipped with JAX; torch rounds identically (round to nearest even)

        return x.astype(ml_dtypes.bfloat16).astype(np.float64)
    return x.astype(dtype).astype(np.float64)
