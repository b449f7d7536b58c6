"""The mLSTM's quadratic (parallel) form: the whole sequence as one chunk, O(T^2) time and memory.

The xLSTM paper's parallel form with an initial state: the log weights
``L_ts = sum_{s<r<=t} g_r + i_s`` (``s <= t``), the stabilizer ``m_t = max(b_t + m_0, max_s
L_ts)`` and the outputs of :func:`polylin._forms.mlstm.chunked.read_out` over one block of T
tokens; the final state is the last row's weights ``exp(L_Ts - m_T)`` applied to the keys.
"""

from __future__ import annotations

from typing import Any

from ..._backend.ops import matmul
from .chunked import log_scores, read_out

__all__ = ["mlstm_quadratic"]


def mlstm_quadratic(
    xp: Any, q: Any, k: Any, v: Any, g: Any, i: Any, state: tuple[Any, Any, Any], *, eps: float
) -> tuple[Any, tuple[Any, Any, Any]]:
    """The mLSTM over ``(..., T, d)`` inputs (``q`` already scaled) and ``(..., T, 1)`` log
    gates from ``(C, n (..., d_k), m (..., 1))``: ``(out, (C, n, m))``."""
    C0, n0, m0 = state
    if q.shape[-2] == 0:
        return v[..., :0, :], state
    Q, K, V, G, I = (x[..., None, :, :] for x in (q, k, v, g, i))  # noqa: E741
    scores = log_scores(xp, G, I)
    b, L, row_max = scores
    m_enter = m0[..., None, :, None]  # (..., 1, 1, 1)
    C, n = C0[..., None, :, :], n0[..., None, :, None]
    out = read_out(xp, Q, K, V, scores, m_enter, C, n, eps=eps)[..., 0, :, :]
    m_last = xp.maximum(b[..., -1:, :] + m_enter, row_max[..., -1:, :])  # (..., 1, 1, 1)
    weights = xp.exp(L[..., -1:, :] - m_last)  # (..., 1, 1, T)
    decay = xp.exp(b[..., -1:, :] + m_enter - m_last)
    keys = K * xp.matrix_transpose(weights)
    C = decay * C + matmul(xp, xp.matrix_transpose(keys), V)
    n = decay[..., 0] * n[..., 0] + xp.sum(keys, axis=-2)
    return out, (C[..., 0, :, :], n[..., 0, :], m_last[..., 0, 0, :])
