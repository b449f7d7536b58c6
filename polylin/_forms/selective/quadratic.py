"""The quadratic form of the selective scan: every output from every earlier token at once.

``y_t[d] = sum_{s <= t} sum_n C_t[n] B_s[n] exp(A[d, n] sum_{s < r <= t} dt_r[d]) dt_s[d]
x_s[d]``, plus ``sum_n C_t[n] exp(A[d, n] sum_{r <= t} dt_r[d]) h_0[d, n]`` from the initial
state. O(T^2 D N) time and memory: the exact parallel form, for tests and short sequences.
The segment sums are each their own sum (``_forms.common.intra_chunk.segment_sums``), never
differences of cumulative sums.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import causal_mask, cumulative_sum
from ..common.intra_chunk import segment_sums

__all__ = ["selective_quadratic"]


def selective_quadratic(
    xp: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, h: Any
) -> tuple[Any, Any]:
    """The selective scan in its quadratic form (module docstring); arguments and result as
    :func:`polylin._forms.selective.recurrent.selective_recurrent`."""
    T, channels = x.shape[-2], x.shape[-1]
    if T == 0:
        return xp.zeros((*h.shape[:-2], 0, channels), dtype=h.dtype, device=device(h)), h
    U = dt * x  # (..., T, D)
    seg = segment_sums(xp, dt, axis=-2)  # (..., T(t), T(s), D)
    decay = xp.exp(seg[..., None] * A[..., None, None, :, :])  # (..., T, T, D, N)
    pairs = C[..., :, None, None, :] * B[..., None, :, None, :]  # (..., T, T, 1, N)
    scores = xp.sum(decay * pairs, axis=-1)  # (..., T, T, D)
    visible = causal_mask(xp, T, T, device(x))[:, :, None]
    scores = xp.where(visible, scores, 0.0)
    y = xp.sum(scores * U[..., None, :, :], axis=-2)
    before = cumulative_sum(xp, dt, axis=-2)  # (..., T, D): sums of terms >= 0
    from_start = xp.exp(before[..., None] * A[..., None, :, :]) * h[..., None, :, :]
    y = y + xp.sum(from_start * C[..., :, None, :], axis=-1)
    last = xp.exp(seg[..., -1, :, :][..., None] * A[..., None, :, :])  # (..., T(s), D, N)
    written = xp.sum(last * U[..., None] * B[..., :, None, :], axis=-3)
    return y, from_start[..., -1, :, :] + written
