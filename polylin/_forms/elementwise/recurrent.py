"""The recurrent form of the elementwise linear recurrence: one state update per token.

``h_t = exp(g_t) * h_{t-1} + x_t``, elementwise over the channels, with ``g_t <= 0`` (the
caller's): every decay factor is in ``[0, 1]`` and ``g_t = -inf`` drops the state exactly.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import unstack

__all__ = ["scan_recurrent", "scan_step"]


def scan_step(xp: Any, x: Any, g: Any, h: Any) -> Any:
    """One token: ``x``, ``g`` ``(..., D)`` against the state ``h`` ``(..., D)``; returns the new
    state, which is also the output."""
    return xp.exp(g) * h + x


def scan_recurrent(xp: Any, x: Any, g: Any, h: Any) -> tuple[Any, Any]:
    """T state updates from ``h``: ``x``, ``g`` ``(..., T, D)``; returns ``(y, h)``, ``y``
    ``(..., T, D)`` every state, ``h`` the last.

    One ``unstack`` per input and one ``stack`` of the outputs (a slice per token would make
    the backward quadratic in T).
    """
    if x.shape[-2] == 0:
        return xp.zeros((*h.shape[:-1], 0, h.shape[-1]), dtype=h.dtype, device=device(h)), h
    outputs = []
    for x_t, g_t in zip(unstack(xp, x, axis=-2), unstack(xp, g, axis=-2)):
        h = scan_step(xp, x_t, g_t, h)
        outputs.append(h)
    return xp.stack(outputs, axis=-2), h
