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


def decayed_loop(
    fq, fk, v, log_decay=None, *, normalize=True, eps=1e-6, mask=None, S0=None, z0=None
):
    """Causal linear attention with decay, one token at a time, in float64, written plainly.

    ``fq``, ``fk``: mapped features ``(..., T, d_phi)``; ``v``: ``(..., T, d_v)``;
    ``log_decay``: anything that broadcasts against ``(..., T, d_phi)``; ``mask``: boolean
    ``(..., T)``. For each token t: if masked, the state is unchanged and the output is 0;
    otherwise ``S = exp(g_t)[:, None] * S + k_t v_t^T``, ``z = exp(g_t) * z + k_t`` and
    ``o_t = q_t S / (q_t . z + eps)`` (or ``q_t S``). Returns ``(out, S, z)``.
    """
    fq, fk, v = (np.asarray(x, dtype=np.float64) for x in (fq, fk, v))
    lead = np.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2])
    T, d_phi, d_v = fq.shape[-2], fq.shape[-1], v.shape[-1]
    fq, fk = (np.broadcast_to(x, (*lead, T, d_phi)) for x in (fq, fk))
    v = np.broadcast_to(v, (*lead, T, d_v))
    g = np.zeros((*lead, T, d_phi))
    if log_decay is not None:
        g = np.broadcast_to(np.asarray(log_decay, dtype=np.float64), (*lead, T, d_phi))
    keep = np.ones((*lead, T), dtype=bool)
    if mask is not None:
        keep = np.broadcast_to(np.asarray(mask, dtype=bool), (*lead, T))
    S = np.zeros((*lead, d_phi, d_v)) if S0 is None else np.array(S0, dtype=np.float64)
    z = np.zeros((*lead, d_phi)) if z0 is None else np.array(z0, dtype=np.float64)
    out = np.zeros((*lead, T, d_v))
    for index in np.ndindex(*lead):
        s, n = S[index].copy(), z[index].copy()
        for t in range(T):
            if not keep[index][t]:
                continue
            factor = np.exp(g[index][t])
            s = factor[:, None] * s + np.outer(fk[index][t], v[index][t])
            n = factor * n + fk[index][t]
            numerator = fq[index][t] @ s
            out[index][t] = numerator / (fq[index][t] @ n + eps) if normalize else numerator
        S[index], z[index] = s, n
    return out, S, z
