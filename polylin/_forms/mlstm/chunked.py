"""The mLSTM in chunks: batched matmuls within chunks, a stabilized prefix of states across them.

For chunk j of C tokens (``docs/mlstm.md``), ``g`` the log forget gates, ``i`` the log input
gates, ``b_t`` the sum of ``g`` from the chunk start to t (inclusive), ``B`` its last value, and
the state ``(C_j, n_j, m_j)`` entering the chunk (stored relative to its stabilizer ``m_j``)::

    L_ts  = sum_{s<r<=t} g_r + i_s          for s <= t (-inf above the diagonal)
    m_t   = max(b_t + m_j, max_s L_ts)      the recurrent form's stabilizer, exactly
    D_ts  = exp(L_ts - m_t)                 <= 1
    h_t   = (w_t q_t C_j + sum_s D_ts (q_t . k_s) v_s) / (max(|w_t q_t n_j + sum_s D_ts q_t . k_s|,
            exp(-m_t)) + eps),               w_t = exp(b_t + m_j - m_t) <= 1

and across chunks, with ``a_j = max_s L_Cs`` (the last row's maximum)::

    m_{j+1} = max(B + m_j, a_j)                                  a max-plus scan over the chunks
    C_{j+1} = exp(B + m_j - m_{j+1}) C_j + sum_s exp(L_Cs - m_{j+1}) k_s v_s^T    (n alike)

Every exponent is <= 0: each is a log weight minus a maximum over a set that contains it. The
in-chunk sums are segment sums of the gate itself
(:func:`polylin._forms.common.intra_chunk.segment_sums`), never differences of long cumulative
sums; the stabilizers of the chunk boundaries come from a log-depth scan over the chunk axis
(``max`` for addition, ``+`` for multiplication), the states from the decayed prefix that plain
linear attention uses (:func:`polylin._forms.common.prefix.chunk_prefix`). Padded tokens (a last
partial chunk) have ``g = 0`` and ``i = -inf``: they write nothing and keep ``m``.
"""

from __future__ import annotations

from typing import Any

from ..._backend.execution import eager_cpu
from ..._backend.namespace import device
from ..._backend.ops import causal_mask, cumulative_sum, matmul, pad_rows
from ..common.intra_chunk import segment_sums
from ..common.prefix import chunk_prefix

__all__ = ["LogScores", "log_scores", "mlstm_chunked", "read_out"]

_NEG_INF = float("-inf")

#: ``(b, L, row_max)``: the in-chunk cumulative log forget gates ``(..., n, C, 1)``, the
#: log weights ``L`` ``(..., n, C, C)`` (-inf above the diagonal), their row maxima
#: ``(..., n, C, 1)``.
LogScores = tuple[Any, Any, Any]


def log_scores(xp: Any, G: Any, I: Any) -> LogScores:  # noqa: E741
    """The log weights of a chunk's scores from its log gates ``G``, ``I`` ``(..., n, C, 1)``."""
    size = G.shape[-2]
    b = cumulative_sum(xp, G, axis=-2)  # from the chunk start to t: at most C terms
    seg = segment_sums(xp, G[..., 0], axis=-1)  # (..., n, C(t), C(s)): sum_{s<r<=t} g_r
    causal = causal_mask(xp, size, size, device(G))
    L = xp.where(causal, seg + xp.matrix_transpose(I), _NEG_INF)
    return b, L, xp.max(L, axis=-1, keepdims=True)


def read_out(
    xp: Any,
    Q: Any,
    K: Any,
    V: Any,
    scores: LogScores,
    m_enter: Any,
    C: Any,
    n: Any,
    *,
    eps: float,
) -> Any:
    """The outputs ``(..., n, C, d_v)`` of chunks of ``Q``, ``K``, ``V`` entering with the
    states ``C`` ``(..., n, d_k, d_v)``, ``n`` ``(..., n, d_k, 1)`` and the stabilizers
    ``m_enter`` ``(..., n, 1, 1)``."""
    b, L, row_max = scores
    inter = b + m_enter
    m = xp.maximum(inter, row_max)  # (..., n, C, 1): the stabilizer of every token
    weights = xp.exp(inter - m)  # the entering state's weight, <= 1
    A = matmul(xp, Q, xp.matrix_transpose(K)) * xp.exp(L - m)  # 0 above the diagonal
    numerator = weights * matmul(xp, Q, C) + matmul(xp, A, V)
    normalizer = weights * matmul(xp, Q, n) + xp.sum(A, axis=-1, keepdims=True)
    return numerator / (xp.maximum(xp.abs(normalizer), xp.exp(-m)) + eps)


def _max_plus_scan(xp: Any, m0: Any, totals: Any, maxima: Any) -> Any:
    """``m_{j+1} = max(totals_j + m_j, maxima_j)`` from ``m0`` ``(..., 1)`` over the chunk
    axis (-3): ``(..., n + 1, 1, 1)``, ``m0`` first. Hillis-Steele on the pairs ``(totals,
    maxima)`` (the composition of ``x -> max(F + x, A)`` maps), log depth, whole arrays only."""
    first = xp.broadcast_to(m0[..., None, :, None], (*maxima.shape[:-3], 1, 1, 1))
    values = xp.concat([first, maxima], axis=-3)
    factors = xp.concat([xp.zeros_like(totals[..., :1, :, :]), totals], axis=-3)
    factors = xp.broadcast_to(factors, values.shape)
    count, shift = values.shape[-3], 1
    while shift < count:
        values = xp.maximum(values, factors + _shifted(xp, values, shift, _NEG_INF))
        if 2 * shift < count:
            factors = factors + _shifted(xp, factors, shift, 0.0)
        shift *= 2
    return values


def _shifted(xp: Any, x: Any, shift: int, fill: float) -> Any:
    """``x`` moved ``shift`` places along the chunk axis (-3), the first places ``fill``."""
    head = xp.full((*x.shape[:-3], shift, *x.shape[-2:]), fill, dtype=x.dtype, device=device(x))
    return xp.concat([head, x[..., :-shift, :, :]], axis=-3)


def mlstm_chunked(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    i: Any,
    state: tuple[Any, Any, Any],
    *,
    chunk_size: int,
    eps: float,
) -> tuple[Any, tuple[Any, Any, Any]]:
    """The mLSTM over ``(..., T, d)`` inputs (``q`` already scaled) and ``(..., T, 1)`` log
    gates, from ``(C, n (..., d_k), m (..., 1))``, in chunks of ``chunk_size`` tokens:
    ``(out, (C, n, m))``."""
    C0, n0, m0 = state
    T = q.shape[-2]
    if T == 0:
        return v[..., :0, :], state
    chunk = min(chunk_size, T)
    count = -(-T // chunk)
    pad = count * chunk - T
    if pad:  # padded tokens: g = 0 (no forgetting), i = -inf (no write), outputs dropped
        q, k, v, g = (pad_rows(xp, x, pad) for x in (q, k, v, g))
        fill = xp.full((*i.shape[:-2], pad, 1), _NEG_INF, dtype=i.dtype, device=device(i))
        i = xp.concat([i, fill], axis=-2)
    Q, K, V, G, I = (  # noqa: E741
        xp.reshape(x, (*x.shape[:-2], count, chunk, x.shape[-1])) for x in (q, k, v, g, i)
    )
    scores = log_scores(xp, G, I)
    b, L, row_max = scores
    totals = b[..., -1:, :]  # (..., n, 1, 1): the log forget gate of the whole chunk
    m = _max_plus_scan(xp, m0, totals, row_max[..., -1:, :])
    m_enter, m_exit = m[..., :-1, :, :], m[..., 1:, :, :]
    keys = K * xp.matrix_transpose(xp.exp(L[..., -1:, :] - m_exit))  # k_s exp(L_Cs - m_{j+1})
    increments = matmul(xp, xp.matrix_transpose(keys), V)
    n_increments = xp.sum(keys, axis=-2)[..., None]
    decay = xp.exp(totals + m_enter - m_exit)  # <= 1
    chained = eager_cpu(xp, device(q))
    C_states, C_last = chunk_prefix(xp, increments, decay, C0, chained=chained)
    n_states, n_last = chunk_prefix(xp, n_increments, decay, n0[..., None], chained=chained)
    out = read_out(xp, Q, K, V, scores, m_enter, C_states, n_states, eps=eps)
    out = xp.reshape(out, (*out.shape[:-3], count * chunk, out.shape[-1]))
    if pad:
        out = out[..., :T, :]
    return out, (C_last, n_last[..., 0], m[..., -1, :, 0])
