"""The quadratic masked-kernel form: the exact reference, O(T^2) time and memory.

With a log decay the causal scores are ``A_ts = sum_c phi(q_t)_c phi(k_s)_c exp(sum_{s<r<=t}
g_rc)`` for ``s <= t``; each exponent is a sum of its own terms (never a difference of two
cumulative sums, which loses float32 precision over long sequences), so it is <= 0.
"""

from __future__ import annotations

from typing import Any

from ._ops import causal_mask
from ._policy import cumulative_sum, device

__all__ = ["decayed_scores", "quadratic"]


def decayed_scores(
    xp: Any, rows: list[Any], keys: Any, log_decay: Any | None, *, causal: bool = True
) -> tuple[list[Any], list[Any], Any, Any | None]:
    """The masked scores of each row set against ``keys`` and the factors of the state.

    For rows ``R`` and keys ``K`` (``(..., T_q, d)``, ``(..., T, d)``, leading dimensions
    broadcasting) returns ``([A...], [R * exp(b)...], K * exp(B - b), exp(B))``, ``A_ts =
    sum_c r_tc k_sc exp(sum_{s<r<=t} g_rc)`` where ``s <= t`` (all of ``R K^T`` when not
    ``causal``, without decay), ``b`` the cumulative log decay from the start to t inclusive,
    ``B`` its total (``(..., 1 or d)``); without decay the rows, keys and ``None``.
    """
    T = keys.shape[-2]
    if log_decay is None:
        scores = [xp.matmul(R, xp.matrix_transpose(keys)) for R in rows]
        if causal:
            mask = causal_mask(xp, rows[0].shape[-2], T, device(keys))
            scores = [xp.where(mask, A, 0.0) for A in scores]
        return scores, list(rows), keys, None
    if log_decay.shape[-2] != T:
        log_decay = xp.broadcast_to(log_decay, (*log_decay.shape[:-2], T, log_decay.shape[-1]))
    later = causal_mask(xp, T, T, device(keys), strict=True)  # r > s
    mask = causal_mask(xp, T, T, device(keys))
    if log_decay.shape[-1] == 1:  # (..., T(t), T(s)) segment sums, then the scores
        terms = xp.where(later, log_decay, 0.0)  # log_decay (..., T(r), 1) broadcast over s
        decay = xp.exp(cumulative_sum(xp, terms, axis=-2))
        scores = [xp.matmul(R, xp.matrix_transpose(keys)) * decay for R in rows]
    else:  # (..., T(t), T(s), d): one decay per channel, summed directly
        terms = xp.where(later[:, :, None], log_decay[..., :, None, :], 0.0)
        decay = xp.exp(cumulative_sum(xp, terms, axis=-3)) * keys[..., None, :, :]
        scores = [xp.sum(R[..., :, None, :] * decay, axis=-1) for R in rows]
    scores = [xp.where(mask, A, 0.0) for A in scores]
    before = cumulative_sum(xp, log_decay, axis=-2)  # from the start to t, inclusive
    flipped = cumulative_sum(xp, xp.flip(log_decay, axis=-2), axis=-2, include_initial=True)
    after = xp.flip(flipped[..., :-1, :], axis=-2)  # from s (exclusive) to the end
    factor = xp.exp(xp.sum(log_decay, axis=-2))  # (..., 1 or d): the whole sequence
    return scores, [R * xp.exp(before) for R in rows], keys * xp.exp(after), factor


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
    or d_phi)``; ``normalize=False`` returns the numerator alone.
    """
    (scores,), (fq_state,), fk_state, factor = decayed_scores(
        xp, [fq], fk, log_decay, causal=causal
    )
    numerator = xp.matmul(scores, v) + xp.matmul(fq_state, S)
    if normalize:
        normalizer = xp.sum(scores, axis=-1, keepdims=True) + xp.matmul(fq_state, z[..., None])
        out = numerator / (normalizer + eps)
    else:
        out = numerator
    if factor is not None:
        S = factor[..., :, None] * S
        z = factor * z
    S = S + xp.matmul(xp.matrix_transpose(fk_state), v)
    z = z + xp.sum(fk_state, axis=-2)
    return out, S, z
