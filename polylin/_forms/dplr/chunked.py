"""The generalized delta rule (diagonal plus low rank): recurrent, quadratic and chunked forms.

For token t, with ``g_t`` a log decay per key channel (or one per token, or none)::

    S_t = diag(exp(g_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T        S: (d_k, d_v)
    o_t = S_t^T q_t

(the caller scales ``q``). The low-rank term reads the state *before* token t's decay. Writing
``r_t = S_{t-1}^T a_t`` (the read, a ``d_v`` vector), every form solves the same equations
(derived in ``docs/dplr.md``): from a state ``S`` at the start of a stretch of tokens, with
``E_ts = exp(sum_{s<r<=t} g_r)`` (the decay from s, exclusive, to t, inclusive) and
``F_ts = exp(sum_{s<r<t} g_r)`` (to t, exclusive)::

    r_t = (a_t * F_t0) . S + sum_{s<t} (a_t . k_s)_F v_s + sum_{s<t} (a_t . b_s)_F r_s
    o_t = (q_t * E_t0) . S + sum_{s<=t} (q_t . k_s)_E v_s + sum_{s<=t} (q_t . b_s)_E r_s

where ``(x . y)_E = sum_c x_c y_c E_tsc``: four matrices of decayed inner products and a unit
lower-triangular system ``(I - L) R = ...`` with ``L_ts = (a_t . b_s)_F``. The quadratic form builds
them over the whole sequence from segment sums; the chunked form within each chunk with the shared
"decayed inner products within a chunk" block (:mod:`polylin._forms.common.intra_chunk`, whose
``"read"`` kinds give the ``F`` matrices and the inverse of ``I - L`` level by level), then carries
the state from chunk to chunk. No exponent is ever positive.

Every function takes ``xp`` and arrays already validated, masked (masked tokens have zero
``q, k, v, a, b`` and ``g = 0``) and in the work dtype: ``q, k, a, b`` are ``(..., T, d_k)``,
``v`` ``(..., T, d_v)``, ``g`` ``(..., T, 1 or d_k)`` or ``None``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from ..._backend.execution import cpu_threads, eager_cpu, records_gradient, scan, scans_chunks
from ..._backend.fused import fused_dplr_chunks
from ..._backend.namespace import device
from ..._backend.ops import add_matmul, add_scaled, pad_rows, split_rows, unit_lower_solver
from ..common.intra_chunk import READ_SCORES, READ_SOLVE, SCORES, intra_chunk
from ..common.prefix import chunk_loop

__all__ = ["BLOCK_ROWS", "SCANNED_CHANNEL_CHUNK", "channel_chunk", "dplr_chunked"]


#: Rows (batch x tokens) per block of chunks and per thread (``_backend.execution.cpu_threads``) on
#: eager CPU backends: the chunks' C x C intermediates of one block (the four matrices, the
#: inverse, each level's blocks) stay in cache instead of being allocated at the size of the whole
#: sequence (as the delta rule's chunked form does; ``docs/performance.md``, "Blocks and threads").
BLOCK_ROWS = 4096


#: The longest chunk a per-channel gate runs where the loop over chunks is a scan (``jax.jit``
#: for the CPU: ``_backend.execution.scans_chunks``). RWKV-7's shapes, one thread, one process,
#: alternating, median of 9: chunks of 32 took 0.69-0.70x the forward time of 64 and
#: 0.74-0.95x the gradient's (32 heads x 64 and 16 x 128, T = 512), chunks of 16 0.80-0.81x
#: and 0.96-1.11x: shorter chunks pass the factoring's bound more often
#: (:data:`~polylin._forms.common.intra_chunk.FACTORED_SPAN`) and build fewer levels. The
#: default chunk (:data:`polylin.DEFAULT_DPLR_CHUNK_SIZE`) is 32: a longer one given is capped.
SCANNED_CHANNEL_CHUNK = 32


def channel_chunk(d_k: int) -> int:
    """The longest chunk a per-channel gate runs on eager CPU backends: ``max(16, d_k // 4)``
    tokens (its four matrices and the inverse cost more levels than linear attention's one).

    Measured on PyTorch, one thread, RWKV-7's shapes (``RWKV_WKV7``, in one process,
    alternating): chunks of 16 took 0.91x the time of 32 forward and 0.97x forward and
    backward at d = 64 (32 heads, T = 512; 8 heads, T = 2048), 1.23x at d = 128; NumPy 0.98x
    at d = 64. Shorter chunks change no result beyond rounding.
    """
    return max(16, d_k // 4)


def dplr_chunked(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    a: Any,
    b: Any,
    g: Any | None,
    S: Any,
    *,
    chunk_size: int,
    scale: float = 1.0,
) -> tuple[Any, Any]:
    """Chunks of ``chunk_size`` tokens (rounded up to a power of two; for a per-channel gate at
    most :func:`channel_chunk` tokens on eager CPU backends and :data:`SCANNED_CHANNEL_CHUNK`
    where the chunks are scanned) from the state ``S``.

    Within every chunk (all chunks of a block at once, batched): the four matrices of decayed
    inner products and the inverse of ``I - L``; then ``R = U + W S`` and the state update per
    chunk, two small matmuls each in the sequential loop over chunks. On eager CPU backends the
    chunks are processed in blocks of about :data:`BLOCK_ROWS` rows per thread, cut by one
    reshape and one ``unstack`` per input (:func:`polylin._backend.ops.split_rows`); where the
    loop over chunks is a scan (``_backend.execution.scans_chunks``) one scan runs over equal
    blocks of :data:`BLOCK_ROWS` rows (the last one padded); other lazy and accelerator backends
    get one block. ``scale`` multiplies each block's queries (one pass
    over a block in cache, not a scaled copy of the whole sequence).
    """
    T = k.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    chunk = 1 << (min(chunk_size, T) - 1).bit_length()
    eager = eager_cpu(xp, device(k))
    scanned = scans_chunks(xp, k)
    if g is not None and g.shape[-1] != 1:
        if eager:
            chunk = min(chunk, channel_chunk(k.shape[-1]))
        elif scanned:
            chunk = min(chunk, SCANNED_CHANNEL_CHUNK)
    padded = -(-T // chunk) * chunk
    arrays = [q, k, v, a, b] + ([] if g is None else [g])
    if padded != T:  # zero k, v, a, b write nothing, zero g keeps the state; outputs dropped
        arrays = [pad_rows(xp, x, padded - T) for x in arrays]
    block = padded
    if eager or scanned:
        rows = math.prod(S.shape[:-2])
        per_block = BLOCK_ROWS * (cpu_threads(xp) if eager else 1)
        block = min(padded, chunk * max(1, per_block // (chunk * max(1, rows))))
    if scanned and block < padded:  # one scan over equal blocks (the last one padded)
        n_blocks = -(-padded // block)
        arrays = [pad_rows(xp, x, n_blocks * block - padded) for x in arrays]
        blocks = tuple(
            xp.moveaxis(xp.reshape(x, (*x.shape[:-2], n_blocks, block, x.shape[-1])), -3, 0)
            for x in arrays
        )

        def one(S: Any, pieces: tuple[Any, ...]) -> tuple[Any, Any]:
            q_b, *rest = pieces
            out, S = _chunks(xp, q_b if scale == 1.0 else q_b * scale, *rest, S=S, chunk=chunk)
            return S, out

        S, out = scan(one, S, blocks)
        out = xp.moveaxis(out, 0, -3)
        out = xp.reshape(out, (*out.shape[:-3], n_blocks * block, out.shape[-1]))
        return out[..., :T, :], S
    outputs = []
    # Without a gradient to record, each chunk's outputs are read inside the loop (PyTorch: the
    # forward at RWKV-7's 32 x 64, T = 512 in 0.90x / 0.85x the time of the batched read-out on
    # one / two threads; with a gradient 1.02x / 1.07x, so there the read-out stays batched).
    in_loop = eager and not records_gradient(*arrays, S)
    for q_b, *pieces in zip(*(split_rows(xp, x, block, padded) for x in arrays)):
        q_b = q_b if scale == 1.0 else q_b * scale
        out, S = _chunks(xp, q_b, *pieces, S=S, chunk=chunk, in_loop=in_loop)
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
    return (out if padded == T else out[..., :T, :]), S


def _chunks(
    xp: Any, q: Any, k: Any, v: Any, a: Any, b: Any, *gate: Any, S: Any, chunk: int,
    in_loop: bool = False,
) -> tuple[Any, Any]:
    """Outputs of consecutive chunks (their length a multiple of ``chunk``) from the state ``S``,
    and the state after them; ``in_loop``: each chunk's outputs read inside the loop over chunks
    where PyTorch can (:func:`~polylin._backend.fused.fused_dplr_chunks`), else after it."""
    length, d_v = k.shape[-2], v.shape[-1]
    n_chunks = length // chunk
    Q, K, V, A, B, *rest = (
        xp.reshape(x, (*x.shape[:-2], n_chunks, chunk, x.shape[-1])) for x in (q, k, v, a, b, *gate)
    )
    G = rest[0] if rest else None
    # Two sets of keys, k and b; the queries meet both (outputs), the a rows read before their
    # own token's decay (reads: strictly lower, the system's matrix for b). Each row set is
    # decayed once for both key sets, level by level.
    # Where the library solves triangular systems (PyTorch; XLA under jit), the levels build
    # the system's matrix and one batched solve inverts it (forward 0.93x the levels'
    # inversion, the backward unchanged); elsewhere the levels invert it as they go.
    solve = unit_lower_solver(xp, K)
    kind = READ_SOLVE if solve is None else READ_SCORES
    both = intra_chunk(xp, [K, B], G, [(Q, (SCORES, SCORES)), (A, (READ_SCORES, kind))])
    (A_qk, A_qb), (A_ak, inverse) = both.matrices
    if solve is not None:
        inverse = solve(-inverse)
    queries, reads = both.rows
    keys, values = both.keys
    whole = both.whole
    U = xp.matmul(inverse, xp.matmul(A_ak, V))  # R_n = U_n + W_n S_n
    W = xp.matmul(inverse, reads)
    increments = xp.matmul(xp.matrix_transpose(keys), V)  # (..., n, d_k, d_v)
    decay = None if whole is None else xp.matrix_transpose(whole)  # (..., n, w, 1)
    B_t = xp.matrix_transpose(values)
    fused = None
    if in_loop:  # each chunk's read-out inside the loop (_backend.fused.fused_dplr_chunks)
        fused = fused_dplr_chunks(S, U, W, B_t, increments, decay, queries, A_qk, V, A_qb)
    if fused is not None:
        out, S = fused
    else:  # (..., n, d_k, d_v) the state before each chunk, (..., n, C, d_v) the reads R
        operands = [U, W, B_t, increments, decay]
        (starts, R), S = chunk_loop(xp, partial(_chunk_step, xp), S, operands)
        out = add_matmul(xp, xp.matmul(queries, starts), A_qk, V, fresh=True)
        out = add_matmul(xp, out, A_qb, R, fresh=True)
    return xp.reshape(out, (*out.shape[:-3], length, d_v)), S


def _chunk_step(
    xp: Any, S: Any, U: Any, W: Any, B: Any, K: Any, decay: Any | None
) -> tuple[Any, tuple[Any, Any]]:
    """One chunk of the sequential loop: the reads ``R = U + W S`` and the state after the
    chunk, ``diag(exp(B)) S + K^T V + B^T R`` (``B`` the decayed ``b`` keys transposed, ``K``
    the increment ``K^T V``, ``decay`` ``(..., w, 1)`` or None). Returns ``(S', (S, R))``."""
    R = add_matmul(xp, U, W, S)  # PyTorch: one baddbmm, no temporary product
    kept = S + K if decay is None else add_scaled(xp, K, decay, S)  # PyTorch: one addcmul
    return add_matmul(xp, kept, B, R, fresh=True), (S, R)
