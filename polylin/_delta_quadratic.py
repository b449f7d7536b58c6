"""The delta rule's quadratic form: the whole sequence as one block, O(T^2) time and memory.

With ``b_t`` the cumulative log decay from the start of the sequence (per channel), ``S_0`` the
initial state and the written corrections ``w_t = beta_t (v_t - S'_t^T k_t)`` as the rows of
``W`` (``docs/delta_rule.md``)::

    (I + A) W = diag(beta) V - diag(beta) (K * exp(b)) S_0
    A_ts = beta_t sum_c k_tc k_sc exp(sum_{s<r<=t} g_rc)     for s < t, else 0
    O    = (Q * exp(b)) S_0 + P W,   P_ts = sum_c q_tc k_sc exp(sum_{s<r<=t} g_rc)   for s <= t
    S_T  = diag(exp(b_T)) S_0 + (K * exp(b_T - b))^T W

The masked matrices come from the segment sums of the gate (as the masked kernel reference of
linear attention builds its scores, :func:`polylin._quadratic.decayed_scores`), so a ``-inf``
gate is an exact reset; the unit lower-triangular system is solved exactly by the log-depth
inversion of :func:`polylin._intra_chunk.unit_lower_inverse` (the sequence zero-padded to a
power of two). Nothing here is chunked: it is the family's independent parallel reference.
"""

from __future__ import annotations

from typing import Any

from ._intra_chunk import unit_lower_inverse
from ._ops import causal_mask, pad_rows
from ._policy import device
from ._quadratic import decayed_scores

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
    (P, A), (queries, keys_rhs), keys_out, factor = decayed_scores(xp, [q, rows], k, g)
    strict = causal_mask(xp, size, size, device(k), strict=True)
    inverse = unit_lower_inverse(xp, xp.where(strict, -A, 0.0))  # (I + A)^{-1}
    W = xp.matmul(inverse, v * beta - xp.matmul(keys_rhs, S))
    out = xp.matmul(queries, S) + xp.matmul(P, W)
    if factor is not None:
        S = factor[..., :, None] * S
    S = S + xp.matmul(xp.matrix_transpose(keys_out), W)
    return (out if size == T else out[..., :T, :]), S
