"""The chunked parallel form: batched matmuls within chunks, a prefix of states across them.

For chunk n (rows of phi(Q), phi(K), V) without decay, with M the lower-triangular ones::

    U_n = K_n^T V_n                     per-chunk state increment
    S_n = S_0 + sum_{m<n} U_m           exclusive prefix over the chunk axis
    O_n = Q_n S_n + where(M, Q_n K_n^T, 0) V_n

With a log decay ``g`` (``docs/decay.md``), ``b_t`` is the cumulative log decay from the start
of the chunk to token t (inclusive) and ``B_n`` its value at the chunk's end::

    U_n = (K_n * exp(B_n - b))^T V_n                      every exponent <= 0
    S_{n+1} = exp(B_n) S_n + U_n                          (diag(exp(B_n)) per channel)
    O_n = (Q_n * exp(b)) S_n + A_n V_n,   A_ts = sum_c q_tc k_sc exp(b_tc - b_sc)  (s <= t)

Every decay factor is the decay over a stretch of the chunk, computed from that stretch's own
log decays (never from a difference of two large cumulative sums, which loses float32
precision), so each factor is in (0, 1] whatever the decay strength. A scalar gate per token
factors the scores as ``(Q K^T) * exp(segment sums)``. A per-channel gate cannot be factored
over a whole chunk (``exp(-b_s)`` alone can overflow), so its scores are built level by level
over blocks of 2, 4, ..., C tokens (C rounded up to a power of two): in every block the queries
of the lower half meet the keys of the upper half through the block's middle, both factors
<= 1, one batched matmul per level (:func:`_channel_gate`). Its factors are products of the
per-token ``exp(g_t)``; after the last level they are the ``exp(b)``, ``exp(B - b)`` and
``exp(B)`` of the formulas above; on eager CPU backends such chunks are at most
:func:`channel_chunk` tokens long (fewer levels where the state, not the levels, dominates).
Both constructions live in :mod:`polylin._forms.common.intra_chunk`, shared with the delta
rule's chunked form. A scalar gate per head on queries and keys shared by the heads (Mamba-2's
scan) runs with the heads as columns where its bound holds
(:mod:`polylin._forms.linear.grouped`).

The normalizer's running sum ``z`` is carried like one more column of ``S`` (as if V had a
column of ones: the increments get the column sums of K, the intra-chunk normalizers the row
sums of the scores), decayed exactly like the numerator's columns, but kept as its own array:
the ones column is never built (autograd would keep it, an array the size of V), and joining
numerator and normalizer along the last axis measured slower than the separate products (a
concatenation with rows of d_v + 1, and matmuls of d_v + 1 columns). Without ``normalize`` the
normalizer of the outputs is not computed at all. No T x T matrix is formed.

Autograd sees only whole-array operations: the sequence is cut into blocks and the chunk
increments into states by one reshape and one ``unstack`` each (never a slice per block or per
chunk, whose backward would allocate and zero a gradient of the whole input per slice), and the
results are joined by ``stack``/``concat``. The backward is therefore linear in T on every
autograd backend, with no custom gradient code.

On eager CPU backends (NumPy, PyTorch CPU, array-api-strict) the sequence is processed in
blocks of about :data:`BLOCK_BYTES` of features and values: the feature map, the per-chunk
states and the scores of one block stay in cache, and the state is carried from
block to block by a short chain of additions. Lazy and accelerator backends (Dask, JAX, CuPy,
PyTorch CUDA) get one block, a ``cumulative_sum`` over the chunk axis without decay and a
logarithmic-depth scan with decay: they prefer few large operations. ``torch.compile`` and
``jax.jit`` for the CPU get one block too, its decayed states chained (under ``jit`` by one
``lax.scan``: :func:`~polylin._forms.common.prefix.chunk_prefix`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..._backend.execution import eager_accelerator, eager_cpu, rows_in_whole_chunks
from ..._backend.namespace import device
from ..._backend.ops import (
    add_matmul,
    causal_mask,
    cumulative_sum,
    dense,
    keep_lower,
    matmul,
    pad_rows,
    split_rows,
    widens,
)
from ..common.intra_chunk import SCORES, intra_chunk, scalar_gate_scores
from ..common.prefix import chunk_prefix
from ..common.scalar_gate import sum_after
from .grouped import grouped_chunked

__all__ = ["BLOCK_BYTES", "block_tokens", "causal_chunked", "channel_chunk"]

#: Bytes per block on eager CPU backends, counted as batch x tokens x (d_phi + d_v) x itemsize;
#: chosen by measurement (``docs/performance.md``): 2 MiB is 4096 rows (batch x tokens) at
#: d = 64 and 2048 at d = 128 in float32. With the libraries' default threads it was as fast or
#: faster than 1, 4 and 8 MiB (larger blocks spill the cache, smaller ones pay more
#: per-operation overhead); on one thread 1 MiB is up to 10% faster.
BLOCK_BYTES = 2 * 2**20

#: ``features(q, k, mask)`` returns ``(phi(q), phi(k))`` of one block of tokens in the work
#: dtype, masked keys already zeroed (``mask`` is that block of the attention mask, or None).
Features = Callable[[Any, Any, Any], tuple[Any, Any]]


def channel_chunk(d_phi: int) -> int:
    """The longest chunk a per-channel gate runs on eager CPU backends: ``max(32, d_phi // 2)``
    tokens.

    Its levels cost ``O(C d log C)`` products per chunk against ``O(d^2)`` per chunk for the
    state; measured on PyTorch, one thread (``GLA`` at T = 512 and 2048, forward and backward):
    chunks of 32 took 0.91-0.97x the time of 64 at d = 64, and 1.04-1.06x at d = 128 (16: no
    faster than 32 at d = 64). Shorter chunks change no result beyond rounding.
    """
    return max(32, d_phi // 2)


def block_tokens(eager: bool, length: int, chunk: int, token_bytes: int) -> int:
    """Tokens per block: a multiple of ``chunk``, or ``length`` where blocks do not pay.

    ``token_bytes`` is ``batch x (d_phi + d_v) x itemsize``: one token's features and values
    over the whole batch.
    """
    if not eager:
        return max(length, 1)
    return chunk * max(1, BLOCK_BYTES // (chunk * max(token_bytes, 1)))


def causal_chunked(
    xp: Any,
    features: Features,
    q: Any,
    k: Any,
    v: Any,
    S: Any,
    z: Any,
    *,
    mask: Any | None = None,
    log_decay: Any | None = None,
    chunk_size: int,
    eps: float,
    normalize: bool = True,
    scale: float = 1.0,
) -> tuple[Any, Any, Any]:
    """Causal linear attention in chunks of ``chunk_size`` tokens, from the state ``(S, z)``.

    ``features`` maps one block of queries and keys; a feature map acts on each token alone (as
    :func:`polylin.step` also requires), so mapping block by block is exact. ``v`` is in the
    work dtype; ``mask`` (``(..., T, 1)``) and ``log_decay`` (``(..., T or 1, 1 or d_phi)``,
    already zero at masked tokens) broadcast against the leading dimensions, as ``q``, ``k``
    and ``v`` do against each other (grouped heads); ``S`` and ``z`` have the broadcast ones.
    Each input keeps its own leading dimensions throughout: nothing is copied per group.
    ``scale`` multiplies the mapped queries; a gate folds it into its factors (:func:`_block`).
    """
    T, d_v = v.shape[-2:]
    batch = S.shape[:-2]  # the broadcast leading dimensions of q, k and v
    if T == 0:
        return xp.broadcast_to(v, (*batch, T, d_v)), S, z
    dev = device(v)
    d_phi = S.shape[-2]
    z = z[..., None]  # (..., d_phi, 1): carried like a column of S (module docstring)
    chunk = min(chunk_size, T)
    channels = log_decay is not None and log_decay.shape[-1] != 1
    eager = eager_cpu(xp, dev)
    if channels:  # halved level by level (_channel_gate); padding changes no result
        chunk = 1 << (chunk - 1).bit_length()
        if eager:
            chunk = min(chunk, channel_chunk(d_phi))
    if log_decay is not None and log_decay.shape[-2] != T:
        log_decay = xp.broadcast_to(log_decay, (*log_decay.shape[:-2], T, log_decay.shape[-1]))
    itemsize = xp.finfo(v.dtype).bits // 8
    # Per-channel gates use the same blocks: counting their extra arrays (the gates, each
    # level's decayed queries and keys) would make blocks shorter, and that measured no faster
    # (twice the bytes per token) or 15-60% slower (four times), forward and backward.
    token_bytes = math.prod(batch) * (d_phi + d_v) * itemsize
    block = block_tokens(eager, T, chunk, token_bytes)

    def per_head() -> tuple[Any, Any, Any]:
        state, norm = S, z
        causal = causal_mask(xp, chunk, chunk, dev)
        outputs = []
        # A strided block (cut from a longer sequence, or on an accelerator fla's (B, T, H, d)
        # read as (B, H, T, d)): copied once here, not by every matmul (_backend.ops.dense).
        accelerator = eager_accelerator(xp, dev)
        strided = block < T or accelerator
        pieces = (split_rows(xp, x, block, T) for x in (q, k, v, mask, log_decay))
        for q_b, k_b, v_b, mask_b, decay_b in zip(*pieces):
            fq, fk = features(q_b, k_b, mask_b)
            if strided and channels and eager:
                # A per-channel gate's factors multiply the queries and keys first (the
                # factors' dense array first, so the product is dense too): only the values
                # are copied.
                v_b = dense(xp, v_b)
            elif strided:
                fq, fk, v_b = (dense(xp, x) for x in (fq, fk, v_b))
            if accelerator and decay_b is not None:  # the gate's sums and scalings too
                decay_b = dense(xp, decay_b)
            out, state, norm = _block(
                xp, fq, fk, v_b, decay_b, state, norm, causal, eps=eps, normalize=normalize,
                chained=eager, scale=scale,
            )  # fmt: skip
            outputs.append(out)
        out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
        return out, state, norm[..., 0]

    if log_decay is None or channels:
        return per_head()

    def scaled(q: Any, k: Any, keep: Any) -> tuple[Any, Any]:
        fq, fk = features(q, k, keep)
        return (fq if scale == 1.0 else fq * scale), fk

    # A per-head scalar gate on queries and keys shared by the heads: the heads as columns
    # where that applies (_forms/linear/grouped.py), else per head.
    return grouped_chunked(
        xp, scaled, q, k, v, S, z[..., 0], mask=mask, log_decay=log_decay, chunk=chunk,
        eps=eps, normalize=normalize, otherwise=per_head,
    )


def _block(
    xp: Any,
    fq: Any,
    fk: Any,
    v: Any,
    log_decay: Any | None,
    S: Any,
    z: Any,
    causal: Any,
    *,
    eps: float,
    normalize: bool,
    chained: bool,
    scale: float,
) -> tuple[Any, Any, Any]:
    """Outputs of one block of tokens and the state ``(S, z)`` after it (``z``: ``(..., d_phi,
    1)``, a column carried like those of ``S``).

    ``scale`` multiplies the queries: a gate folds it into the queries' decay factors (a scalar
    gate's ``(..., C, 1)``, a per-channel one's factor per chunk) and adds the scores' product
    scaled (one ``baddbmm``), so that no pass over the queries is made for it; without a gate
    the queries are scaled.

    ``fq``, ``fk``, ``v`` and ``log_decay`` keep their own leading dimensions, which broadcast.
    The normalizer column is computed only when ``normalize``; numerator and normalizer are
    never joined into one array (a concatenation along the last axis, and matmuls of
    ``d_v + 1`` columns, measured slower than the separate products).
    """
    length = v.shape[-2]
    chunk = causal.shape[-1]
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk
    if padded != length:  # zero keys add nothing and zero log decays keep the state
        fq, fk, v = (pad_rows(xp, x, padded - length) for x in (fq, fk, v))
        if log_decay is not None:
            log_decay = pad_rows(xp, log_decay, padded - length)
    fq, fk, v = (rows_in_whole_chunks(x, chunk) for x in (fq, fk, v))
    if log_decay is not None:
        log_decay = rows_in_whole_chunks(log_decay, chunk)
    Q, K, V = (xp.reshape(x, (*x.shape[:-2], n_chunks, chunk, x.shape[-1])) for x in (fq, fk, v))
    weights = None  # per-token factors of the rows of Q S (a gate of grouped heads)
    score_scale = 1.0  # the part of ``scale`` not in the scores: added with their product
    if log_decay is None:
        decay = None
        Q = Q if scale == 1.0 else Q * scale
        increments = _increments(xp, K, V)
        queries = Q
        scores = keep_lower(xp, matmul(xp, Q, xp.matrix_transpose(K)), causal, fresh=True)
    else:
        lead, width = log_decay.shape[:-2], log_decay.shape[-1]
        G = xp.reshape(log_decay, (*lead, n_chunks, chunk, width))
        if width == 1:
            before = cumulative_sum(xp, G, axis=-2)  # b_t: from the chunk start to t, inclusive
            after = sum_after(xp, G)  # B - b_s: from s (exclusive) to the chunk end
            total = xp.sum(G, axis=-2, keepdims=True)  # B: the whole chunk
            scores, score_scale = scalar_gate_scores(xp, Q, K, G, causal), scale
            # A gate of grouped heads has the groups' axis: there Q * exp(b) and K * exp(B - b)
            # would copy the queries and keys per group, so the scalar per token scales the
            # rows of Q S and of V instead (the same products; where the gate widens nothing,
            # scaling the features measured faster).
            decay = xp.matrix_transpose(xp.exp(total))  # (..., n, 1, 1)
            if widens(K, after):
                increments = _increments(xp, K, V, weights=xp.exp(after))
            else:
                increments = _increments(xp, K * xp.exp(after), V)
            factor = xp.exp(before) if scale == 1.0 else xp.exp(before) * scale
            if widens(Q, before):
                queries, weights = Q, factor
            else:
                queries = Q * factor
        else:
            scores, queries, keys, chunk_decay = _channel_gate(xp, Q, K, G, scale)
            score_scale = scale
            decay = xp.matrix_transpose(chunk_decay)  # (..., n, d_phi, 1): scales state rows
            increments = _increments(xp, keys, V)
    states, S = chunk_prefix(xp, increments[0], decay, S, chained=chained)
    z_states, z = chunk_prefix(xp, increments[1], decay, z, chained=chained)
    out = _from_states(xp, queries, states, weights)
    out = add_matmul(xp, out, scores, V, fresh=True, alpha=score_scale)
    out = _rows(xp, out, padded, length)
    if not normalize:
        return out, S, z
    row_sums = xp.sum(scores, axis=-1, keepdims=True)
    row_sums = row_sums if score_scale == 1.0 else row_sums * score_scale
    normalizer = _from_states(xp, queries, z_states, weights) + row_sums
    return out / (_rows(xp, normalizer, padded, length) + eps), S, z


def _from_states(xp: Any, queries: Any, states: Any, weights: Any | None) -> Any:
    """``queries @ states``, its rows scaled by ``weights`` where given."""
    out = matmul(xp, queries, states)
    return out if weights is None else out * weights


def _rows(xp: Any, x: Any, padded: int, length: int) -> Any:
    """``(..., n, C, w)`` chunks back to ``(..., length, w)`` rows, the padding dropped."""
    x = xp.reshape(x, (*x.shape[:-3], padded, x.shape[-1]))
    return x if padded == length else x[..., :length, :]


def _increments(xp: Any, K: Any, V: Any, *, weights: Any | None = None) -> tuple[Any, Any]:
    """``(K^T V, K^T 1)`` per chunk: the increments of ``S`` and of ``z``.

    The ones column is never built: the column sums of K are the same numbers. ``weights``
    (``(..., C, 1)``) scale the rows: ``(K^T (w V), K^T w)``.
    """
    Kt = xp.matrix_transpose(K)
    if weights is None:
        return matmul(xp, Kt, V), xp.sum(K, axis=-2)[..., None]
    return matmul(xp, Kt, V * weights), matmul(xp, Kt, weights)


def _channel_gate(
    xp: Any, Q: Any, K: Any, G: Any, scale: float = 1.0
) -> tuple[Any, Any, Any, Any]:
    """Intra-chunk scores and decayed queries and keys for a gate per channel (``G``'s width).

    Returns ``(A, scale * Q * exp(b), K * exp(B - b), exp(B))``: the (unscaled) scores
    ``A_ts = sum_c q_tc k_sc exp(sum_{s<r<=t} g_rc)`` for ``s <= t`` (0 above the diagonal),
    ``(..., n, C, C)``, and the factors that carry the state across chunks (module docstring),
    built level by level, or for a bounded gate factored through each chunk's middle token, by
    :func:`polylin._forms.common.intra_chunk.intra_chunk`. C is a power of two.
    """
    blocks = intra_chunk(xp, K, G, [(Q, SCORES)], row_scale=scale)
    return blocks.matrices[0], blocks.rows[0], blocks.keys, blocks.whole
