"""The delta rule and the gated delta rule, token by token: the recurrent form and its step.

For token t (``g_t <= 0`` the log decay, a scalar or one per key channel)::

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - (exp(g_t) S_{t-1})^T k_t)^T,   o_t = S_t^T q_t
"""

from __future__ import annotations

from typing import Any

from ..._backend.compiled import compiled_tokens
from ..._backend.fused import fused_delta_step
from ..._backend.ops import add_outer, nonpositive, unstack, vector_times_matrix

__all__ = ["delta_recurrent", "delta_step"]


def delta_step(
    xp: Any, q: Any, k: Any, v: Any, beta: Any, decay: Any | None, S: Any
) -> tuple[Any, Any]:
    """One token of the (gated) delta rule: return ``(o_t, S_t)``.

    ``q``, ``k`` are ``(..., d_k)``, ``v`` is ``(..., d_v)``, ``beta`` is ``(..., 1)``, ``decay``
    (``exp(g_t)``, not its log; ``None`` for no decay) ``(..., 1 or d_k)``, ``S`` is
    ``(..., d_k, d_v)``.
    """
    done = compiled_tokens("delta", [q, k, v, beta], decay, S, step=True)  # NumPy, torch CPU
    if done is None:
        done = fused_delta_step(q, k, v, beta, decay, S)  # PyTorch, one state per token row
    if done is not None:
        return done
    if decay is not None:
        S = S * decay[..., None]
    prediction = vector_times_matrix(xp, k, S)  # what the state recalls for k_t
    S = add_outer(xp, S, (k, beta * (v - prediction)))
    return vector_times_matrix(xp, q, S), S


def delta_recurrent(
    xp: Any, q: Any, k: Any, v: Any, beta: Any, g: Any | None, S: Any, *, scale: float = 1.0
) -> tuple[Any, Any]:
    """The delta rule by T sequential updates from the state ``S``: ``(scale * out, S_T)``.

    Values of the log decay ``g`` above 0 are taken as 0 here, where the factors are formed
    (as :func:`polylin._forms.linear.recurrent.causal_recurrent`: no operation of PyTorch's on
    the sequence before the compiled loop)."""
    T = q.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    done = compiled_tokens(
        "delta", [q, k, v, beta], g, S, step=False, log=True, scale=scale, scale_output=True
    )  # one loop
    if done is not None:
        return done
    decay = None if g is None else xp.exp(nonpositive(xp, g))
    # One unstack per input (a single op for autograd) rather than a slice per token.
    qs, ks, vs, bs = (unstack(xp, x, axis=-2) for x in (q, k, v, beta))
    decays = [None] * T if decay is None else unstack(xp, decay, axis=-2)
    outputs = []
    for t in range(T):
        o, S = delta_step(xp, qs[t], ks[t], vs[t], bs[t], decays[t], S)
        outputs.append(o)
    out = xp.stack(outputs, axis=-2)
    # o_t = S_t^T (scale q_t) = scale (S_t^T q_t); the state is unchanged
    return (out if scale == 1.0 else out * scale), S
