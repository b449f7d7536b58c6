"""The quadratic form of the elementwise linear recurrence: every state from every earlier
token at once.

``h_t = sum_{s <= t} exp(sum_{s < r <= t} g_r) x_s + exp(sum_{r <= t} g_r) h_0``. O(T^2 D)
time and memory: the exact parallel form, for tests and short sequences. The segment sums are
each their own sum (``_forms.common.intra_chunk.segment_sums``), never differences of
cumulative sums.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import causal_mask, cumulative_sum
from ..common.intra_chunk import segment_sums

__all__ = ["scan_quadratic"]


def scan_quadratic(xp: Any, x: Any, g: Any, h: Any) -> tuple[Any, Any]:
    """The recurrence in its quadratic form; arguments and result as
    :func:`~polylin._forms.elementwise.recurrent.scan_recurrent`."""
    T, channels = x.shape[-2], x.shape[-1]
    if T == 0:
        return xp.zeros((*h.shape[:-1], 0, channels), dtype=h.dtype, device=device(h)), h
    visible = causal_mask(xp, T, T, device(x))[:, :, None]  # (T(t), T(s), 1)
    weights = xp.where(visible, xp.exp(segment_sums(xp, g, axis=-2)), 0.0)
    y = xp.sum(weights * x[..., None, :, :], axis=-2)
    y = y + xp.exp(cumulative_sum(xp, g, axis=-2)) * h[..., None, :]
    return y, y[..., -1, :]
