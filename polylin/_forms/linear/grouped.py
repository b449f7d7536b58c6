"""Gated linear attention for heads that share their queries and keys, the heads as columns.

Mamba-2's scan (``causal_linear_attention(C, B, x dt, identity, log_decay=dt A)`` with ``C``
and ``B`` shared by a group of heads) has a scalar gate per token and head but one set of
queries and keys per group. The chunked form of :mod:`polylin._forms.linear.chunked` keeps the
heads as a leading axis: every chunk builds each head's decayed scores ``(C, C)`` from segment
sums and multiplies them with that head's values, and the matrix products with the shared
queries and keys move the heads into columns and back (:func:`~polylin._backend.ops.matmul`).

Here the group's heads are columns throughout: the values are ``(T, heads x d_v)`` (the
caller's ``(T, heads, d_v)`` layout as it is), the state ``(d_phi, heads x d_v)``, and the
chunk's scores ``P = lower(Q K^T)`` one matrix for the group, the gate's decay factored out of
them through the middle of each half chunk
(:mod:`polylin._forms.common.scalar_gate`): every matrix product has every head's values as
its columns and every elementwise operation runs over contiguous rows. The formulas are those
of the chunked form, with ``b`` and ``B`` per head::

    U_n = K_n^T (V_n * exp(B_n - b))          S_{n+1} = exp(B_n) S_n + U_n
    O_n = (Q_n S_n) * exp(b) + Y_n            (Y_n: the factored intra-chunk products)

It serves eager CPU backends (the factoring reads the gate's values) where the gate varies along
a leading axis along which the queries, the keys and the mask do not, the sequence has at least
:data:`MIN_CHUNKS` chunks, and every chunk's factors are within the span
(:func:`~polylin._forms.common.scalar_gate.within_span`); elsewhere
:func:`~polylin._forms.linear.chunked.causal_chunked` runs its own form. (Under ``jax.jit``,
chosen inside the program by a ``lax.cond``, it took 0.43-1.27x the forward time of the scan
over tokens and 0.40-1.09x the gradient's time of the per-head chunks, and 3-5x the time to
compile: left out.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..._backend.execution import adds_in_place, reads_values
from ..._backend.namespace import device
from ..._backend.ops import (
    broadcast_shape,
    causal_mask,
    cumulative_sum,
    dense,
    keep_lower,
    matmul,
    pad_rows,
    split_rows,
)
from ..common.prefix import chunk_prefix, chunk_reads
from ..common.scalar_gate import (
    half_factors,
    half_products,
    half_products_into,
    sum_after,
    within_span,
)

__all__ = ["BLOCK_BYTES", "MIN_CHUNKS", "grouped_chunked"]

#: Bytes of values per block (batch x tokens x heads x d_v x itemsize): at Mamba-2's 48 heads x
#: 64, state 128, 8 MiB is 10 chunks of 64 tokens. Blocks of 128, 256, 512 and 1024 tokens took
#: 0.82 / 0.81 / 0.80 / 0.84x the time of the per-head form at T = 2048 on one thread, 0.75 /
#: 0.65 / 0.65 / 0.66x on two (one block of 64 tokens: 0.83 and 0.89x); on an AVX-512 core
#: (Zen 5) 8 MiB took 0.95x the time of 4 MiB on one and two threads there (T = 512: 0.96 /
#: 0.89x; 16 MiB 0.93-0.94x at T = 2048), 0.99-1.03x at 8 heads (T = 4096) and on NumPy:
#: fewer blocks, fewer operations.
BLOCK_BYTES = 8 * 2**20

#: The fewest chunks a sequence needs for this form: with one chunk of 64 tokens it took
#: 1.10-1.28x the time of the per-head form (8 heads x 64 and 4 x 16, forward and gradient, one
#: thread; its extra operations cost more than they save), with four 0.91-0.99x.
MIN_CHUNKS = 4


def grouped_chunked(
    xp: Any,
    features: Callable[[Any, Any, Any], tuple[Any, Any]],
    q: Any,
    k: Any,
    v: Any,
    S: Any,
    z: Any,
    *,
    mask: Any | None,
    log_decay: Any,
    chunk: int,
    eps: float,
    normalize: bool,
    otherwise: Callable[[], tuple[Any, Any, Any]],
) -> tuple[Any, Any, Any]:
    """:func:`~polylin._forms.linear.chunked.causal_chunked`'s ``(out, S, z)`` for a scalar
    gate ``log_decay`` ``(..., T or 1, 1)`` and heads that share their queries and keys, where
    this form applies (module docstring), else ``otherwise()``. ``S`` ``(..., d_phi, d_v)``
    and ``z`` ``(..., d_phi)`` have the broadcast leading dimensions. The sequence runs in
    blocks of about :data:`BLOCK_BYTES` of values.
    """
    length, d_v = v.shape[-2:]
    if log_decay.shape[-1] != 1 or length < MIN_CHUNKS * chunk or not reads_values(xp, v):
        return otherwise()
    lead = tuple(S.shape[:-2])
    rank = len(lead)

    def full(x: Any) -> Any:  # every leading axis present
        return xp.reshape(x, (*(1,) * (rank + 2 - x.ndim), *x.shape))

    q, k, v = (full(x) for x in (q, k, v))
    log_decay = xp.broadcast_to(full(log_decay), (*full(log_decay).shape[:-2], length, 1))
    mask = None if mask is None else full(mask)
    shared = broadcast_shape(*(tuple(x.shape[:-2]) for x in (q, k, mask) if x is not None))
    gated = tuple(log_decay.shape[:-2])
    heads = [i for i in range(rank) if shared[i] == 1 and gated[i] > 1]
    if not heads:
        return otherwise()
    others = [i for i in range(rank) if i not in heads]
    outer = tuple(lead[i] for i in others)
    width = math.prod(lead[i] for i in heads)

    def fold(x: Any) -> Any:  # (*lead, r, c) -> (*outer, r, width, c): the heads next to c
        x = xp.broadcast_to(x, (*lead, *x.shape[-2:]))
        x = xp.permute_dims(x, (*others, rank, *heads, rank + 1))
        return xp.reshape(x, (*outer, x.shape[rank - len(heads)], width, x.shape[-1]))

    def squeeze(x: Any) -> Any:  # the heads' axes (all 1) dropped
        return xp.reshape(x, (*(x.shape[i] for i in others), *x.shape[-2:]))

    if not within_span(xp, log_decay, chunk):
        return otherwise()
    G = fold(log_decay)[..., 0]  # (*outer, T, width)
    values = xp.reshape(fold(v), (*outer, length, width * d_v))
    state = xp.reshape(fold(S), (*outer, S.shape[-2], width * d_v))
    norm = xp.reshape(fold(z[..., None]), (*outer, z.shape[-1], width))
    rows = [squeeze(q), squeeze(k), values, None if mask is None else squeeze(mask), G]
    itemsize = xp.finfo(values.dtype).bits // 8
    block = chunk * max(1, BLOCK_BYTES // (chunk * math.prod(outer) * width * d_v * itemsize))
    causal = causal_mask(xp, chunk, chunk, device(v))
    outputs = []
    for q_b, k_b, v_b, mask_b, g_b in zip(*(split_rows(xp, x, block, length) for x in rows)):
        fq, fk = features(q_b, k_b, mask_b)
        fq, fk, v_b = (dense(xp, x) for x in (fq, fk, v_b))
        out, state, norm = _block(
            xp, fq, fk, v_b, g_b, state, norm, causal, eps=eps, normalize=normalize
        )
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)

    def unfold(x: Any) -> Any:  # (*outer, r, width * c) -> (*lead, r, c)
        rows, columns = x.shape[-2], x.shape[-1] // width
        x = xp.reshape(x, (*outer, rows, *(lead[i] for i in heads), columns))
        order = [*others, rank, *heads, rank + 1]  # the axes of x, by their place in lead
        return xp.permute_dims(x, tuple(order.index(i) for i in range(rank + 2)))

    return unfold(out), unfold(state), unfold(norm)[..., 0]


def _block(
    xp: Any, fq: Any, fk: Any, v: Any, G: Any, S: Any, z: Any, causal: Any, *,
    eps: float, normalize: bool,
) -> tuple[Any, Any, Any]:
    """One block: ``fq``, ``fk`` ``(..., L, d_phi)``, ``v`` ``(..., L, width x d_v)``, ``G``
    ``(..., L, width)``; ``S`` ``(..., d_phi, width x d_v)`` and ``z`` ``(..., d_phi, width)``
    before it. Returns the outputs (normalized where ``normalize``) and both after it."""
    length, width = G.shape[-2:]
    chunk = causal.shape[-1]
    n = -(-length // chunk)
    padded = n * chunk
    fq, fk, v, G = (pad_rows(xp, x, padded - length) for x in (fq, fk, v, G))
    Q, K = (xp.reshape(x, (*x.shape[:-2], n, chunk, x.shape[-1])) for x in (fq, fk))
    d_v = v.shape[-1] // width
    V = xp.reshape(v, (*v.shape[:-2], n, chunk, width, d_v))
    G = xp.reshape(G, (*G.shape[:-2], n, chunk, width))

    def flat(x: Any) -> Any:  # (..., r, width, c) -> (..., r, width x c)
        return xp.reshape(x, (*x.shape[:-2], x.shape[-2] * x.shape[-1]))

    into = adds_in_place(V, Q, K, G, S)  # the outputs added into Q_n S_n (half_products_into)
    before = None
    if normalize or not into:
        before = xp.exp(cumulative_sum(xp, G, axis=-2))[..., None]  # exp(b), (..., n, C, width, 1)
    after = xp.exp(sum_after(xp, G))[..., None]  # exp(B - b)
    whole = xp.exp(xp.sum(G, axis=-2, keepdims=True))[..., None]  # exp(B), (..., n, 1, width, 1)
    Kt = xp.matrix_transpose(K)
    P = keep_lower(xp, matmul(xp, Q, Kt), causal, fresh=True)
    factors = half_factors(xp, G)
    decay = flat(xp.broadcast_to(whole, (*whole.shape[:-1], d_v)))
    reads, S = chunk_reads(xp, Q, matmul(xp, Kt, flat(V * after)), decay, S, chained=True)
    reads = xp.reshape(reads, V.shape)  # Q_n S_n
    if into:
        out = half_products_into(xp, factors, P, V, reads)
    else:
        assert before is not None
        out = reads * before + half_products(xp, factors, P, V)
    out = xp.reshape(out, (*out.shape[:-4], padded, width * d_v))[..., :length, :]
    z_states, z = chunk_prefix(
        xp, matmul(xp, Kt, after[..., 0]), whole[..., 0], z, chained=True
    )
    if not normalize:
        return out, S, z
    assert before is not None
    ones = xp.ones((*V.shape[:-1], 1), dtype=V.dtype, device=device(V))
    normalizer = matmul(xp, Q, z_states) * before[..., 0]
    normalizer = normalizer + half_products(xp, factors, P, ones)[..., 0]
    normalizer = xp.reshape(normalizer, (*normalizer.shape[:-3], padded, width))[..., :length, :]
    out = xp.reshape(out, (*out.shape[:-1], width, d_v)) / (normalizer[..., None] + eps)
    return xp.reshape(out, (*out.shape[:-2], width * d_v)), S, z
