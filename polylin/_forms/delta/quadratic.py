"""The delta rule's quadratic form: the whole sequence as one block, O(T^2) time and memory.

With ``b_t`` the cumulative log decay from the start of the sequence (per channel), ``S_0`` the
initial state and the written corrections ``w_t = beta_t (v_t - S'_t^T k_t)`` as the rows of
``W`` (``docs/delta_rule.md``)::

    (I + A) W = diag(beta) V - diag(beta) (K * exp(b)) S_0
    A_ts = beta_t sum_c k_tc k_sc exp(sum_{s<r<=t} g_rc)     for s < t, else 0
    O    = (Q * exp(b)) S_0 + P W,   P_ts = sum_c q_tc k_sc exp(sum_{s<r<=t} g_rc)   for s <= t
    S_T  = diag(exp(b_T)) S_0 + (K * exp(b_T - b))^T W

The masked matrices come from the segment sums of the gate (as the masked kernel reference of linear
attention builds its scores, :func:`polylin._forms.common.intra_chunk.segment_sums`), so a ``-inf``
gate is an exact reset; the unit lower-triangular system is solved exactly by the log-depth
inversion of :func:`polylin._forms.common.intra_chunk.unit_lower_inverse` (the sequence zero-padded
to a power of two). Nothing here is chunked: it is the family's independent parallel reference.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import causal_mask, cumulative_sum, matmul, pad_rows
from ..common.intra_chunk import scalar_gate_scores, segment_sums, unit_lower_inverse

__all__ = ["delta_quadratic"]


def delta_quadratic(
    xp: Any, q: Any, k: Any, v: Any, beta: Any, g: Any | None, S: Any
) -> tuple[Any, Any]:
    """The delta rule over ``(..., T, d)`` inputs from the state ``S``: ``(out, S_T)``."""
    T = k.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    size = 1 << (T - 1).bit_length()
    if size != T:  # zero beta: no write; zero g: no decay; padded outputs are dropped
        q, k, v, beta = (pad_rows(xp, x, size - T) for x in (q, k, v, beta))
        g = None if g is None else pad_rows(xp, g, size - T)
    rows = k * beta
    mask = causal_mask(xp, size, size, device(k))
    strict = causal_mask(xp, size, size, device(k), strict=True)
    if g is None:
        P = xp.where(mask, matmul(xp, q, xp.matrix_transpose(k)), 0.0)
        A = xp.where(strict, matmul(xp, rows, xp.matrix_transpose(k)), 0.0)
        queries, keys_rhs, keys_out, factor = q, rows, k, None
    else:
        if g.shape[-1] == 1:
            P = scalar_gate_scores(xp, q, k, g, mask)
            A = scalar_gate_scores(xp, rows, k, g, strict, strict=True)
        else:  # (..., T(t), T(s), d_k): one decay per channel, summed directly
            decayed = xp.exp(segment_sums(xp, g, axis=-2)) * k[..., None, :, :]
            P = xp.where(mask, xp.sum(q[..., :, None, :] * decayed, axis=-1), 0.0)
            A = xp.where(strict, xp.sum(rows[..., :, None, :] * decayed, axis=-1), 0.0)
        before = xp.exp(cumulative_sum(xp, g, axis=-2))  # from the start to t, inclusive
        flipped = cumulative_sum(xp, xp.flip(g, axis=-2), axis=-2, include_initial=True)
        after = xp.exp(xp.flip(flipped[..., :-1, :], axis=-2))  # from t (exclusive) to the end
        queries, keys_rhs, keys_out = q * before, rows * before, k * after
        factor = xp.exp(xp.sum(g, axis=-2))  # (..., 1 or d_k): the whole sequence
    inverse = unit_lower_inverse(xp, -A)  # (I + A)^{-1}
    W = matmul(xp, inverse, v * beta - matmul(xp, keys_rhs, S))
    out = matmul(xp, queries, S) + matmul(xp, P, W)
    if factor is not None:
        S = factor[..., :, None] * S
    S = S + matmul(xp, xp.matrix_transpose(keys_out), W)
    return (out if size == T else out[..., :T, :]), S
