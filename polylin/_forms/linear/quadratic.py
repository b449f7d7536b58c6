"""The quadratic masked-kernel form: the exact reference, O(T^2) time and memory.

With a log decay the causal scores are ``A_ts = sum_c phi(q_t)_c phi(k_s)_c exp(sum_{s<r<=t}
g_rc)`` for ``s <= t``; each exponent is a sum of its own terms (never a difference of two
cumulative sums, which loses float32 precision over long sequences), so it is <= 0.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import causal_mask, cumulative_sum, matmul, widens

__all__ = ["quadratic"]


def quadratic(
    xp: Any,
    fq: Any,
    fk: Any,
    v: Any,
    S: Any,
    z: Any,
    *,
    causal: bool,
    eps: float,
    log_decay: Any | None = None,
    normalize: bool = True,
) -> tuple[Any, Any, Any]:
    """``O = (A V + phi(Q) S0) / (A 1 + phi(Q) z0 + eps)`` with ``A = [tril](phi(Q) phi(K)^T)``.

    ``S``, ``z`` is the state before the first token (zeros for a fresh sequence). Returns the
    output and the state after the last key. ``log_decay`` (causal only) is ``(..., T or 1, 1
    or d_phi)``; ``normalize=False`` returns the numerator alone. The leading dimensions of
    ``fq``, ``fk``, ``v`` and ``log_decay`` broadcast (grouped heads); a scalar gate scales the
    rows of ``phi(Q) S`` and of ``V`` rather than the features, which would copy them per group.
    """
    T = fk.shape[-2]
    if log_decay is None:
        scores = matmul(xp, fq, xp.matrix_transpose(fk))
        if causal:
            scores = xp.where(causal_mask(xp, fq.shape[-2], T, device(fq)), scores, 0.0)
        fq_state, fk_state, factor = fq, fk, None
        before = after = None
    else:
        if log_decay.shape[-2] != T:
            log_decay = xp.broadcast_to(log_decay, (*log_decay.shape[:-2], T, log_decay.shape[-1]))
        later = causal_mask(xp, T, T, device(fq), strict=True)  # r > s
        mask = causal_mask(xp, T, T, device(fq))
        if log_decay.shape[-1] == 1:  # (..., T(t), T(s)) segment sums, then the scores
            terms = xp.where(later, log_decay, 0.0)  # log_decay (..., T(r), 1) broadcast over s
            decay = xp.exp(cumulative_sum(xp, terms, axis=-2))
            scores = matmul(xp, fq, xp.matrix_transpose(fk)) * decay
        else:  # (..., T(t), T(s), d_phi): one decay per channel, summed directly
            terms = xp.where(later[:, :, None], log_decay[..., :, None, :], 0.0)
            decay = xp.exp(cumulative_sum(xp, terms, axis=-3))
            scores = xp.sum(fq[..., :, None, :] * decay * fk[..., None, :, :], axis=-1)
        scores = xp.where(mask, scores, 0.0)
        before = xp.exp(cumulative_sum(xp, log_decay, axis=-2))  # from the start to t, inclusive
        flipped = cumulative_sum(xp, xp.flip(log_decay, axis=-2), axis=-2, include_initial=True)
        after = xp.exp(xp.flip(flipped[..., :-1, :], axis=-2))  # from s (exclusive) to the end
        factor = xp.exp(xp.sum(log_decay, axis=-2))  # (..., 1 or d_phi): the whole sequence
        # A scalar gate that widens the features (grouped heads) scales rows outside the
        # products below instead: fq * before would copy the queries per group.
        scalar = log_decay.shape[-1] == 1
        fq_state, before = (fq, before) if scalar and widens(fq, before) else (fq * before, None)
        fk_state, after = (fk, after) if scalar and widens(fk, after) else (fk * after, None)

    def read(state: Any) -> Any:  # phi(Q) times the state before the first token, decayed
        out = matmul(xp, fq_state, state)
        return out if before is None else out * before

    numerator = matmul(xp, scores, v) + read(S)
    if normalize:
        normalizer = xp.sum(scores, axis=-1, keepdims=True) + read(z[..., None])
        out = numerator / (normalizer + eps)
    else:
        out = numerator
    if factor is not None:
        S = factor[..., :, None] * S
        z = factor * z
    keys = xp.matrix_transpose(fk_state)
    if after is None:
        S = S + matmul(xp, keys, v)
        z = z + xp.sum(fk_state, axis=-2)
    else:
        S = S + matmul(xp, keys, v * after)
        z = z + matmul(xp, keys, after)[..., 0]
    return out, S, z
