"""The quadratic masked-kernel form: the exact reference, O(T^2) time and memory."""

from __future__ import annotations

from typing import Any

from array_api_compat import device

from ._ops import causal_mask

__all__ = ["quadratic"]


def quadratic(
    xp: Any, fq: Any, fk: Any, v: Any, S: Any, z: Any, *, causal: bool, eps: float
) -> tuple[Any, Any, Any]:
    """``O = (A V + phi(Q) S0) / (A 1 + phi(Q) z0 + eps)`` with ``A = [tril](phi(Q) phi(K)^T)``.

    ``S``, ``z`` is the state before the first token (zeros for a fresh sequence). Returns the
    output and the state after the last key.
    """
    scores = xp.matmul(fq, xp.matrix_transpose(fk))
    if causal:
        # Selected, not multiplied: a masked score may be inf or NaN (0 * inf is NaN).
        causal_rows = causal_mask(xp, fq.shape[-2], fk.shape[-2], None, device(fq))
        scores = xp.where(causal_rows, scores, 0.0)
    numerator = xp.matmul(scores, v) + xp.matmul(fq, S)
    normalizer = xp.sum(scores, axis=-1, keepdims=True) + xp.matmul(fq, z[..., None])
    out = numerator / (normalizer + eps)
    S = S + xp.matmul(xp.matrix_transpose(fk), v)
    z = z + xp.sum(fk, axis=-2)
    return out, S, z
