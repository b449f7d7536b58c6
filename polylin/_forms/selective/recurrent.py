"""The recurrent form of the selective scan: one state update per token.

For channels ``d`` and state indices ``n``, with ``A`` ``(..., D, N)``::

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] x_t[d] B_t[n]
    y_t[d]    = sum_n C_t[n] h_t[d, n]

(the skip term ``D x_t`` and the gate are the entry point's). ``dt >= 0`` and ``A <= 0`` are
the caller's: every decay factor is then in ``[0, 1]``.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import matmul, unstack

__all__ = ["selective_recurrent", "selective_step"]


def selective_step(xp: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, h: Any) -> tuple[Any, Any]:
    """One token: ``x``, ``dt`` ``(..., D)``, ``B``, ``C`` ``(..., N)``, ``A`` and the state
    ``h`` ``(..., D, N)``; returns ``(y, h)`` with ``y`` ``(..., D)``."""
    decay = xp.exp(dt[..., :, None] * A)
    h = decay * h + (dt * x)[..., :, None] * B[..., None, :]
    return matmul(xp, h, C[..., :, None])[..., 0], h


def selective_recurrent(
    xp: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, h: Any
) -> tuple[Any, Any]:
    """The selective scan by T state updates from the state ``h``: ``x``, ``dt``
    ``(..., T, D)``, ``B``, ``C`` ``(..., T, N)``; returns ``(y, h)``, ``y`` ``(..., T, D)``
    with the state's leading dimensions.

    The tokens are taken apart by one ``unstack`` per input and the outputs joined by one
    ``stack`` (a slice per token would make the backward quadratic in T).
    """
    T = x.shape[-2]
    if T == 0:
        return xp.zeros((*h.shape[:-2], 0, h.shape[-2]), dtype=h.dtype, device=device(h)), h
    outputs = []
    for x_t, dt_t, B_t, C_t in zip(*(unstack(xp, a, axis=-2) for a in (x, dt, B, C))):
        y, h = selective_step(xp, x_t, dt_t, A, B_t, C_t, h)
        outputs.append(y)
    return xp.stack(outputs, axis=-2), h
