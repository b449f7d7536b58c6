"""The recurrent form: one rank-1 state update per token (the design note's loop)."""

from __future__ import annotations

from typing import Any

__all__ = ["causal_recurrent", "recurrent_step"]


def recurrent_step(
    xp: Any, fq: Any, fk: Any, v: Any, S: Any, z: Any, eps: float
) -> tuple[Any, Any, Any]:
    """Advance the state by one token and return ``(output, S, z)``.

    ``fq``, ``fk`` are mapped features ``(..., d_phi)``, ``v`` is ``(..., d_v)``, ``S`` and ``z``
    the state before the token. Cost and memory are independent of the position.
    """
    S = S + fk[..., :, None] * v[..., None, :]
    z = z + fk
    numerator = xp.matmul(fq[..., None, :], S)[..., 0, :]
    normalizer = xp.sum(fq * z, axis=-1, keepdims=True)
    return numerator / (normalizer + eps), S, z


def causal_recurrent(
    xp: Any, fq: Any, fk: Any, v: Any, S: Any, z: Any, *, eps: float
) -> tuple[Any, Any, Any]:
    """Causal linear attention by T sequential state updates, from the state ``(S, z)``."""
    T = fq.shape[-2]
    outputs = []
    for t in range(T):
        o, S, z = recurrent_step(xp, fq[..., t, :], fk[..., t, :], v[..., t, :], S, z, eps)
        outputs.append(o)
    if not outputs:
        return v[..., :0, :], S, z
    return xp.stack(outputs, axis=-2), S, z
