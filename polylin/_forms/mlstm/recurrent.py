"""The mLSTM token by token: the recurrent form and its step.

For token t, with ``g_t = log sigmoid(f_t) <= 0`` the log forget gate, ``i_t`` the log input
gate (any real number) and the state ``(C, n, m)`` stored relative to its stabilizer ``m``
(``C = exp(-m) C_true``, the same for ``n``)::

    m_t = max(g_t + m_{t-1}, i_t)
    C_t = exp(g_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t = exp(g_t + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = C_t^T q_t / (max(|n_t . q_t|, exp(-m_t)) + eps)

Both exponents are <= 0 by the choice of ``m_t``. A masked token has ``g = 0`` and
``i = -inf``: ``m``, ``C`` and ``n`` stay exactly as they were.
"""

from __future__ import annotations

from typing import Any

from ..._backend.ops import add_outer, unstack, vector_times_matrix

__all__ = ["mlstm_recurrent", "mlstm_step_form"]


def mlstm_step_form(
    xp: Any, q: Any, k: Any, v: Any, g: Any, i: Any, state: tuple[Any, Any, Any], *, eps: float
) -> tuple[Any, tuple[Any, Any, Any]]:
    """One token: ``q``, ``k`` ``(..., d_k)`` (``q`` already scaled), ``v`` ``(..., d_v)``, the
    log gates ``g``, ``i`` ``(..., 1)``, the state ``(C (..., d_k, d_v), n (..., d_k), m (...,
    1))``; returns ``(h_t, (C, n, m))``."""
    C, n, m = state
    m_new = xp.maximum(g + m, i)
    forget = xp.exp(g + m - m_new)  # (..., 1), <= 1
    write = xp.exp(i - m_new)  # (..., 1), <= 1
    C = add_outer(xp, forget[..., None] * C, (k * write, v))
    n = forget * n + write * k
    numerator = vector_times_matrix(xp, q, C)
    denominator = xp.abs(xp.sum(q * n, axis=-1, keepdims=True))
    h = numerator / (xp.maximum(denominator, xp.exp(-m_new)) + eps)
    return h, (C, n, m_new)


def mlstm_recurrent(
    xp: Any, q: Any, k: Any, v: Any, g: Any, i: Any, state: tuple[Any, Any, Any], *, eps: float
) -> tuple[Any, tuple[Any, Any, Any]]:
    """The mLSTM by T sequential steps over ``(..., T, d)`` inputs and ``(..., T, 1)`` log
    gates: ``(out, (C, n, m))``."""
    T = q.shape[-2]
    if T == 0:
        return v[..., :0, :], state
    # One unstack per input (a single op for autograd) rather than a slice per token.
    qs, ks, vs, gs, i_s = (unstack(xp, x, axis=-2) for x in (q, k, v, g, i))
    outputs = []
    for t in range(T):
        h, state = mlstm_step_form(xp, qs[t], ks[t], vs[t], gs[t], i_s[t], state, eps=eps)
        outputs.append(h)
    return xp.stack(outputs, axis=-2), state
