"""The delta rule and the gated delta rule: a per-token recurrence and its chunked parallel form.

For token t (``g_t <= 0`` the log decay, ``a_t = exp(g_t)``; no decay is ``g_t = 0``)::

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T        S: (d_k, d_v)
    o_t = S_t^T q_t

The chunked form (derived in ``docs/delta_rule.md``): within a chunk of C tokens from the state
``S`` at its start, with ``G_i = g_1 + ... + g_i`` (cumulative log decay inside the chunk) and
the written corrections ``w_i = beta_i (v_i - a_i S_{i-1}^T k_i)`` as the rows of ``W``::

    (I + A) W = diag(beta) V - diag(beta exp(G)) K S,
    A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0          (unit lower-triangular)
    O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j) masked to j <= i) W
    S' = exp(G_C) S + (diag(exp(G_C - G)) K)^T W

``T = (I + A)^{-1}`` depends on the keys alone, so it is computed for every chunk at once by a
log-depth block recursion (:func:`_unit_lower_inverse`); then ``U = T diag(beta) V`` and
``Wk = T diag(beta exp(G)) K`` give ``W = U - Wk S``, and only two small matmuls per chunk remain
in the sequential loop over chunks. Every exponent is a difference ``G_i - G_j`` with ``j <= i``
(or ``G_i`` itself), hence ``<= 0``: no factor exceeds 1.

Every function here takes ``xp`` and arrays already validated, masked (masked tokens have
``beta = 0``, ``g = 0`` and zero ``q, k, v``) and in the work dtype. ``beta`` and ``g`` are
``(..., T, 1)``; ``g`` is ``None`` for the ungated rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._ops import pad_rows
from ._policy import cumulative_sum, device, eager_cpu, unstack

__all__ = ["BLOCK_ROWS", "delta_chunked", "delta_recurrent", "delta_step"]


def delta_step(
    xp: Any, q: Any, k: Any, v: Any, beta: Any, decay: Any | None, S: Any
) -> tuple[Any, Any]:
    """One token of the (gated) delta rule: return ``(o_t, S_t)``.

    ``q``, ``k`` are ``(..., d_k)``, ``v`` is ``(..., d_v)``, ``beta`` and ``decay`` (``a_t``, not
    its log; ``None`` for no decay) are ``(..., 1)``, ``S`` is ``(..., d_k, d_v)``.
    """
    if decay is not None:
        S = S * decay[..., None]
    prediction = xp.matmul(k[..., None, :], S)[..., 0, :]  # what the state recalls for k_t
    correction = beta * (v - prediction)
    S = S + k[..., :, None] * correction[..., None, :]
    return xp.matmul(q[..., None, :], S)[..., 0, :], S


def delta_recurrent(
    xp: Any, q: Any, k: Any, v: Any, beta: Any, g: Any | None, S: Any
) -> tuple[Any, Any]:
    """The delta rule by T sequential updates from the state ``S``: ``(out, S_T)``."""
    T = q.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    # One unstack per input (a single op for autograd) rather than a slice per token.
    qs, ks, vs, bs = (unstack(xp, x, axis=-2) for x in (q, k, v, beta))
    decays = [None] * T if g is None else unstack(xp, xp.exp(g), axis=-2)
    outputs = []
    for t in range(T):
        o, S = delta_step(xp, qs[t], ks[t], vs[t], bs[t], decays[t], S)
        outputs.append(o)
    return xp.stack(outputs, axis=-2), S


def _unit_lower_inverse(xp: Any, kb: Any, k: Any, G: Any | None) -> Any:
    """``(I + A)^{-1}`` for every chunk, ``A = strictly_lower(kb k^T * exp(G_i - G_j))``.

    ``kb = diag(beta) K`` and ``k`` are ``(..., C, d_k)``, ``G`` is ``(..., C, 1)`` or ``None``;
    the result is ``(..., C, C)``, unit lower-triangular.

    A log-depth block recursion: the inverses of the diagonal blocks of size ``s`` are merged in
    pairs by ``inv([[L11, 0], [L21, L22]]) = [[T11, 0], [-T22 L21 T11, T22]]`` (``T = L^{-1}``),
    from the ``2 x 2`` blocks (by formula) to the whole chunk, each level one batched computation
    over all pairs of all chunks. It is exact triangular inversion (not a truncated series),
    with the rounding behaviour of forward substitution. ``L21`` is built from the keys of the
    two halves, so no full ``C x C`` matrix is sliced and every decay factor is
    ``exp(G_i - G_j)`` with token ``i`` after token ``j``: an exponent ``<= 0`` without any mask.
    """
    *lead, C, d_k = k.shape
    size = 1
    while size < C:
        size *= 2
    if size != C:  # zero keys give identity rows: the leading C x C block is unchanged
        kb, k = pad_rows(xp, kb, size - C), pad_rows(xp, k, size - C)
        if G is not None:  # repeat the last cumulative log decay: exponents stay <= 0
            tail = xp.broadcast_to(G[..., -1:, :], (*lead, size - C, 1))
            G = xp.concat([G, tail], axis=-2)
    if size == 1:
        return xp.ones((*lead, 1, 1), dtype=k.dtype, device=device(k))
    # The keys of later tokens enter negated, once: then T21 = T22 (-L21) T11 needs no negation.
    kb = -kb
    # s = 1 directly: the 2 x 2 inverses are [[1, 0], [-l, 1]], l the one entry of L21.
    _, kb_low = unstack(xp, xp.reshape(kb, (*lead, size // 2, 2, d_k)), axis=-2)
    k_up, _ = unstack(xp, xp.reshape(k, (*lead, size // 2, 2, d_k)), axis=-2)
    entry = xp.sum(kb_low * k_up, axis=-1)  # -l, (..., size / 2)
    if G is not None:
        G_up, G_low = unstack(xp, xp.reshape(G, (*lead, size // 2, 2)), axis=-1)
        entry = entry * xp.exp(G_low - G_up)
    one, zero = xp.ones_like(entry), xp.zeros_like(entry)
    inverse = xp.reshape(xp.stack([one, zero, entry, one], axis=-1), (*lead, size // 2, 2, 2))
    s = 2
    while s < size:
        pairs = (*lead, size // (2 * s), 2, s)
        _, kb_low = unstack(xp, xp.reshape(kb, (*pairs, d_k)), axis=-3)
        k_up, _ = unstack(xp, xp.reshape(k, (*pairs, d_k)), axis=-3)
        L21 = xp.matmul(kb_low, xp.matrix_transpose(k_up))  # -L21
        if G is not None:
            G_up, G_low = unstack(xp, xp.reshape(G, (*pairs, 1)), axis=-3)
            L21 = L21 * xp.exp(G_low - xp.matrix_transpose(G_up))
        T11, T22 = unstack(xp, xp.reshape(inverse, (*pairs, s)), axis=-3)
        T21 = xp.matmul(T22, xp.matmul(L21, T11))
        # Fresh zeros: ``zeros_like`` of a strided view copies its strides and slows the concat.
        upper = xp.concat([T11, xp.zeros(T11.shape, dtype=T11.dtype, device=device(T11))], axis=-1)
        lower = xp.concat([T21, T22], axis=-1)
        inverse = xp.concat([upper, lower], axis=-2)  # (..., size / 2s, 2s, 2s)
        s *= 2
    inverse = xp.reshape(inverse, (*lead, size, size))
    return inverse if size == C else inverse[..., :C, :C]


#: Rows (batch x tokens) per block of chunks on eager CPU backends: the chunks' C x C
#: intermediates (scores, triangular inverse, decays) of one block stay in cache instead of
#: being allocated at the size of the whole sequence. Measured on PyTorch CPU (d = 64, C = 64,
#: float32): see ``docs/delta_rule.md``.
BLOCK_ROWS = 4096


def delta_chunked(
    xp: Any, q: Any, k: Any, v: Any, beta: Any, g: Any | None, S: Any, *, chunk_size: int
) -> tuple[Any, Any]:
    """The delta rule in chunks of ``chunk_size`` tokens from the state ``S``: ``(out, S_T)``.

    On eager CPU backends the chunks are processed in blocks of about :data:`BLOCK_ROWS` rows;
    lazy and accelerator backends get one block. Blocks come from one reshape and one
    ``unstack`` per input (autograd sees no per-block slice).
    """
    *batch, T, _ = k.shape
    d_v = v.shape[-1]
    if T == 0:
        return v[..., :0, :], S
    chunk = min(chunk_size, T)
    n_chunks = -(-T // chunk)
    per_block = n_chunks
    if eager_cpu(xp, device(k)):
        per_block = max(1, BLOCK_ROWS // (chunk * max(1, math.prod(batch))))
    n_blocks = -(-n_chunks // per_block)
    per_block = -(-n_chunks // n_blocks)  # as even as possible: little padding
    padded = n_blocks * per_block * chunk
    arrays = [q, k, v, beta] + ([] if g is None else [g])
    if padded != T:  # zero beta: no write; zero g: no decay; padded outputs are dropped
        arrays = [pad_rows(xp, x, padded - T) for x in arrays]
    shape = (*batch, n_blocks, per_block, chunk)
    arrays = [xp.reshape(x, (*shape, x.shape[-1])) for x in arrays]
    blocks: list[Sequence[Any]]
    if n_blocks == 1:
        blocks = [[x[..., 0, :, :, :] for x in arrays]]
    else:
        blocks = list(zip(*(unstack(xp, x, axis=-4) for x in arrays)))
        # A flattening reshape copies the strided block of q and k once (matmul would copy
        # them at every use, and the key reshapes of the inversion too).
        blocks = [[_dense(xp, x) for x in block[:2]] + list(block[2:]) for block in blocks]
    i = xp.arange(chunk, device=device(k))
    causal = i[None, :] <= i[:, None]
    outputs = []
    for block in blocks:
        out, S = _block(xp, *block, S=S, causal=causal)
        outputs.append(out)
    out = outputs[0] if n_blocks == 1 else xp.stack(outputs, axis=-4)
    out = xp.reshape(out, (*batch, padded, d_v))
    return (out if padded == T else out[..., :T, :]), S


def _dense(xp: Any, x: Any) -> Any:
    """``x`` with its elements in row-major order: a copy only if it is a strided view."""
    return xp.reshape(xp.reshape(x, (-1,)), x.shape)


def _block(
    xp: Any, Q: Any, K: Any, V: Any, B: Any, *rest: Any, S: Any, causal: Any
) -> tuple[Any, Any]:
    """Outputs ``(..., N, C, d_v)`` of N consecutive chunks from the state ``S``, and the state
    after them. ``Q, K, V, B`` (and the log decays, if any) are ``(..., N, C, d)``."""
    scores = xp.matmul(Q, xp.matrix_transpose(K))
    Kb = K * B
    if rest:
        G = cumulative_sum(xp, rest[0], axis=-2)  # (..., N, C, 1), non-increasing, <= 0
        G_last = G[..., -1:, :]
        # Selected, not clipped by ``minimum`` (whose gradient is halved at ties, where log
        # decays are 0): above the diagonal the exponent would be positive.
        gap = xp.where(causal, G - xp.matrix_transpose(G), 0.0)
        scores = scores * xp.exp(gap)
        inverse = _unit_lower_inverse(xp, Kb, K, G)
        decayed = xp.exp(G)  # how much of the chunk's starting state each token still sees
        keys_rhs = Kb * decayed
        Q = Q * decayed
        K_out = K * xp.exp(G_last - G)  # how much of each token's write survives the chunk
        chunk_decays = unstack(xp, xp.exp(G_last), axis=-3)  # (..., 1, 1) each
    else:
        inverse = _unit_lower_inverse(xp, Kb, K, None)
        keys_rhs = Kb
        K_out = K
        chunk_decays = None
    scores = xp.where(causal, scores, 0.0)
    U = xp.matmul(inverse, V * B)
    Wk = xp.matmul(inverse, keys_rhs)
    # The state recurrence across chunks is sequential: S_n feeds W_n. Each input is unstacked
    # once (one op for autograd); per chunk only W_n = U_n - Wk_n S_n and the state update remain.
    Us, Wks, Ks = (unstack(xp, x, axis=-3) for x in (U, Wk, xp.matrix_transpose(K_out)))
    states, corrections = [], []
    for n in range(len(Us)):
        states.append(S)
        W = Us[n] - xp.matmul(Wks[n], S)
        corrections.append(W)
        S_kept = S if chunk_decays is None else S * chunk_decays[n]
        S = S_kept + xp.matmul(Ks[n], W)
    starts = xp.stack(states, axis=-3)  # (..., N, d_k, d_v): the state before each chunk
    W = xp.stack(corrections, axis=-3)  # (..., N, C, d_v)
    return xp.matmul(Q, starts) + xp.matmul(scores, W), S
