"""The generalized delta rule's quadratic form: the whole sequence as one block.

The reference that the chunked form is tested against, O(T^2) time and memory.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import causal_mask, cumulative_sum, pad_rows
from ..common.intra_chunk import segment_sums, unit_lower_inverse

__all__ = ["dplr_quadratic"]


def _rows_down(xp: Any, M: Any) -> Any:
    """``M`` with its rows moved one down along axis -2, a zero row first."""
    zeros = xp.zeros((*M.shape[:-2], 1, M.shape[-1]), dtype=M.dtype, device=device(M))
    return xp.concat([zeros, M[..., :-1, :]], axis=-2)


def _decayed_products(xp: Any, X: Any, Y: Any, E: Any | None) -> Any:
    """``sum_c X_tc Y_sc E_tsc`` for every pair ``(t, s)``: ``(..., T, T)``.

    ``E`` is ``(..., T, T, 1 or d)`` (0 where a pair does not interact) or ``None`` (no decay).
    """
    products = xp.matmul(X, xp.matrix_transpose(Y))
    if E is None:
        return products
    if E.shape[-1] == 1:
        return products * E[..., 0]
    return xp.sum(X[..., :, None, :] * Y[..., None, :, :] * E, axis=-1)


def dplr_quadratic(
    xp: Any, q: Any, k: Any, v: Any, a: Any, b: Any, g: Any | None, S: Any
) -> tuple[Any, Any]:
    """The whole sequence as one block: ``T x T`` matrices, ``O(T^2 d)`` time and memory
    (``O(T^2 d_k)`` for a gate per channel). The reference for the chunked form."""
    T = q.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    dev = device(q)
    causal = causal_mask(xp, T, T, dev)  # s <= t: the outputs' pairs
    strict = causal_mask(xp, T, T, dev, strict=True)  # s < t: the reads' pairs
    if g is None:
        E = F = None
        queries, reads, keys, values, total = q, a, k, b, None
    else:
        # Each exponent is a segment sum of its own terms: <= 0, and exact at strong gates.
        seg = segment_sums(xp, g, axis=-2)  # (..., T, T, w): sum_{s<r<=t} g_r
        seg_read = _rows_down(xp, xp.reshape(seg, (*seg.shape[:-2], -1)))  # sum_{s<r<t} g_r
        seg_read = xp.reshape(seg_read, seg.shape)
        E = xp.where(causal[:, :, None], xp.exp(seg), 0.0)
        F = xp.where(strict[:, :, None], xp.exp(seg_read), 0.0)
        before = cumulative_sum(xp, g, axis=-2, include_initial=True)  # sum_{r<=t}, from 0
        queries = q * xp.exp(before[..., 1:, :])
        reads = a * xp.exp(before[..., :-1, :])
        after = xp.exp(seg[..., -1, :, :])  # the decay from s (exclusive) to the end
        keys, values = k * after, b * after
        total = xp.matrix_transpose(xp.exp(before[..., -1:, :]))  # (..., w, 1)
    A_qk = xp.where(causal, _decayed_products(xp, q, k, E), 0.0)
    A_qb = xp.where(causal, _decayed_products(xp, q, b, E), 0.0)
    A_ak = xp.where(strict, _decayed_products(xp, a, k, F), 0.0)
    L = xp.where(strict, _decayed_products(xp, a, b, F), 0.0)
    size = 1 << (T - 1).bit_length()  # the inversion merges blocks of powers of two
    if size != T:  # zero rows and columns: identity rows, the leading T x T block unchanged
        L = xp.matrix_transpose(
            pad_rows(xp, xp.matrix_transpose(pad_rows(xp, L, size - T)), size - T)
        )
    inverse = unit_lower_inverse(xp, L)[..., :T, :T] if size != T else unit_lower_inverse(xp, L)
    R = xp.matmul(inverse, xp.matmul(reads, S) + xp.matmul(A_ak, v))  # the reads r_t
    out = xp.matmul(queries, S) + xp.matmul(A_qk, v) + xp.matmul(A_qb, R)
    kept = S if total is None else total * S
    S = kept + xp.matmul(xp.matrix_transpose(keys), v) + xp.matmul(xp.matrix_transpose(values), R)
    return out, S
