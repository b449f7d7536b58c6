"""The generalized delta rule (diagonal plus low rank), token by token.

For token t, with ``g_t`` a log decay per key channel (or one per token, or none)::

    S_t = diag(exp(g_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,   o_t = S_t^T q_t
"""

from __future__ import annotations

from typing import Any

from ..._backend.compiled import compiled_tokens
from ..._backend.fused import fused_dplr_step
from ..._backend.ops import add_outer, nonpositive, unstack, vector_times_matrix

__all__ = ["dplr_recurrent", "dplr_step"]


def dplr_step(
    xp: Any, q: Any, k: Any, v: Any, a: Any, b: Any, decay: Any | None, S: Any
) -> tuple[Any, Any]:
    """One token: ``(o_t, S_t)``. ``q, k, a, b`` are ``(..., d_k)``, ``v`` ``(..., d_v)``,
    ``decay`` (``exp(g_t)``, not its log) ``(..., 1 or d_k)`` or ``None``, ``S`` the state."""
    done = compiled_tokens("dplr", [q, k, v, a, b], decay, S, step=True)  # NumPy, torch CPU
    if done is None:
        done = fused_dplr_step(q, k, v, a, b, decay, S)  # PyTorch, one state per token row
    if done is not None:
        return done
    read = vector_times_matrix(xp, a, S)  # a_t^T S_{t-1}, before the decay
    if decay is not None:
        S = S * decay[..., :, None]
    S = add_outer(xp, S, (b, read), (k, v))
    return vector_times_matrix(xp, q, S), S


def dplr_recurrent(
    xp: Any, q: Any, k: Any, v: Any, a: Any, b: Any, g: Any | None, S: Any, *,
    scale: float = 1.0,
) -> tuple[Any, Any]:
    """T sequential updates from the state ``S``: ``(out, S_T)``, ``scale`` multiplying ``q``.

    Values of the log decay ``g`` above 0 are taken as 0 here, where the factors are formed
    (as :func:`polylin._forms.linear.recurrent.causal_recurrent`: no operation of PyTorch's on
    the sequence before the compiled loop)."""
    T = q.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    done = compiled_tokens(
        "dplr", [q, k, v, a, b], g, S, step=False, log=True, scale=scale
    )  # one loop
    if done is not None:
        return done
    if scale != 1.0:
        q = q * scale
    decay = None if g is None else xp.exp(nonpositive(xp, g))
    # One unstack per input (a single op for autograd) rather than a slice per token.
    qs, ks, vs, as_, bs = (unstack(xp, x, axis=-2) for x in (q, k, v, a, b))
    decays: list[Any] = [None] * T if decay is None else list(unstack(xp, decay, axis=-2))
    outputs = []
    for t in range(T):
        o, S = dplr_step(xp, qs[t], ks[t], vs[t], as_[t], bs[t], decays[t], S)
        outputs.append(o)
    return xp.stack(outputs, axis=-2), S
