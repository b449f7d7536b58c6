"""The delta rule and the gated delta rule: a per-token recurrence and its chunked parallel form.

For token t (``g_t <= 0`` the log decay, a scalar or one per key channel; no decay is ``g = 0``;
``-inf`` resets the state)::

    S'_t = diag(exp(g_t)) S_{t-1}                                    S: (d_k, d_v)
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T        o_t = S_t^T q_t

The chunked form (derived in ``docs/delta_rule.md``): within a chunk of C tokens from the state
``S`` at its start, with ``b_i = g_1 + ... + g_i`` (the in-chunk cumulative log decay, per
channel), ``B = b_C`` and the written corrections ``w_i = beta_i (v_i - S'_i^T k_i)`` as the
rows of ``W``::

    (I + A) W = diag(beta) V - diag(beta) (K * exp(b)) S,
    A_ij = beta_i sum_c k_ic k_jc exp(b_ic - b_jc)   for j < i, else 0   (unit lower-triangular)
    O  = (Q * exp(b)) S + P W,   P_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   for j <= i
    S' = diag(exp(B)) S + (K * exp(B - b))^T W

No exponent is formed as a difference of cumulative sums: ``P``, ``A`` and every factor are
built by :func:`polylin._forms.common.intra_chunk.intra_chunk` from products of per-token factors
``exp(g_t) <= 1`` (a scalar gate's ``P`` from segment sums of the gate), so a ``-inf`` gate is
an exact reset and float32 keeps its accuracy at strong gates. ``T = (I + A)^{-1}`` comes from
the same levels (one quadrant per level feeds the scores and the inversion), or, where the
library solves triangular systems (``_backend.ops.unit_lower_solver``) and the gate is a scalar or
absent, from one batched solve of ``A``, itself one matmul times the segment decay of the
scores (:func:`_factored`). The sequential
loop over chunks computes ``W = T (diag(beta) V - diag(beta) (K * exp(b)) S)``, ``T`` applied
once to the whole right-hand side (where ``T`` comes from a solve, as ``T diag(beta)`` applied
to ``V - (K * exp(b)) S``: a ``C x C`` matrix scaled instead of the values), and the state
update.

Every function here takes ``xp`` and arrays already validated, masked (masked tokens have
``beta = 0``, ``g = 0`` and zero ``q, k, v``) and in the work dtype; leading dimensions
broadcast (grouped heads). ``beta`` is ``(..., T, 1)`` and ``g`` ``(..., T, 1 or d_k)``, or
``None`` for the ungated rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from ..._backend.execution import (
    cpu_threads,
    eager_accelerator,
    eager_cpu,
    records_gradient,
    scan,
    scans_chunks,
)
from ..._backend.fused import fused_delta_chunks
from ..._backend.namespace import device
from ..._backend.ops import (
    add_matmul,
    causal_mask,
    cumulative_sum,
    dense,
    keep_lower,
    l2_normalize,
    matmul,
    pad_rows,
    unit_lower_solver,
    unstack,
)
from ..common.intra_chunk import (
    SCORES,
    SOLVE,
    IntraChunk,
    intra_chunk,
    scalar_gate_scores,
    segment_decay,
)
from ..common.prefix import chunk_loop

__all__ = [
    "ACCELERATOR_CHUNK",
    "BLOCK_ROWS",
    "FORWARD_CHUNK",
    "FORWARD_KEYS",
    "ONE_THREAD_CHUNK",
    "ONE_THREAD_KEYS",
    "chunk_length",
    "delta_chunked",
]


#: Rows (batch x tokens) per block of chunks and per thread (``_backend.execution.cpu_threads``) on
#: eager CPU backends: the chunks' C x C intermediates (scores, triangular inverse, decays) of one
#: block stay in cache instead of being allocated at the size of the whole sequence, and each
#: thread gets a share of every operation large enough to pay for the split. Measured on PyTorch
#: CPU by ``benchmarks/blocks.py``: see ``docs/performance.md``, "Blocks and threads".
BLOCK_ROWS = 4096

#: The shortest chunk on eager accelerators (PyTorch CUDA, CuPy), where each chunk's sequential
#: step is a few kernel launches that the host pays for: the chunked gated delta rule at
#: ``(2, 8192, 16, 64)`` on an H200 took 26 ms in chunks of 64, 18 ms in chunks of 128 and
#: 8 ms in chunks of 256 (forward + backward: 100, 55 and 32 ms), eager, with float32 errors
#: of 4e-7 against float64 at every size (``benchmarks/gpu_profile.py``, ``docs/gpu.md``).
ACCELERATOR_CHUNK = 256

#: The longest chunk where an eager CPU loop reads each chunk's outputs inside it (PyTorch with
#: one thread, or more without a gradient to record; NumPy, array-api-strict) for keys of at
#: most :data:`ONE_THREAD_KEYS` channels. Halving the chunk halves the products
#: that grow with it (``C d`` multiply-adds per token against ``d^2`` for the state's), and on
#: one thread the twice as many sequential steps cost less than that: chunks of 32 took
#: 0.79-0.90x the forward time of 64 and 0.84-0.95x forward and backward (PyTorch, one
#: thread, d = 64 and 128, T = 512-16384, the three gates), NumPy 0.79-0.94x forward
#: (``benchmarks/delta_chunks.py``). With two threads and the outputs read after the loop (a
#: gradient to record) the sequential steps gain little from the second thread (forward
#: 0.89-0.98x, forward and backward 0.95-1.14x): there the chunk stays as asked; read inside
#: the loop, chunks of 32 took 0.65-0.93x the forward time of 64 on two threads (ggml's shapes).
#: At d = 256 the chunk makes no difference on one thread (1.00-1.05x): it stays as asked.
#: Shorter chunks change no result beyond rounding.
ONE_THREAD_CHUNK = 32

#: The widest keys that :data:`ONE_THREAD_CHUNK` applies to.
ONE_THREAD_KEYS = 128

#: The longest chunk of an eager CPU call with no gradient to record (prefill, inference), for
#: keys of at most :data:`FORWARD_KEYS` channels. There the chunk's own work (the ``C x C``
#: scores, system and decays: ``C d`` products and ``C`` elementwise terms per token) weighs
#: more against the state's ``d^2``: on an AVX-512 core (AMD EPYC, Zen 5), chunks of 16 took
#: 0.84-0.87x the forward time of 32 on one PyTorch thread at d = 64 (the three gates, T =
#: 512-16384), 0.89-0.98x on two threads (1.06x at T = 16384) and 0.85-0.94x on NumPy; at
#: d = 128 0.94-0.98x on one thread, 0.99-1.06x on two, 1.01-1.04x on NumPy, so wider keys keep
#: :data:`ONE_THREAD_CHUNK`. With a gradient chunks of 16 took 1.02-1.16x the forward and
#: backward time of 32 (``benchmarks/delta_chunks.py --chunks 16 32``).
FORWARD_CHUNK = 16

#: The widest keys that :data:`FORWARD_CHUNK` applies to.
FORWARD_KEYS = 64


def chunk_length(
    chunk_size: int,
    T: int,
    d_k: int,
    *,
    accelerator: bool,
    in_loop: bool,
    scanned: bool = False,
    forward_only: bool = False,
) -> int:
    """The chunk length the delta rules run: ``chunk_size`` (at most ``T``) rounded up to a power
    of two, at least :data:`ACCELERATOR_CHUNK` on eager accelerators, at most
    :data:`FORWARD_CHUNK` for keys of up to :data:`FORWARD_KEYS` channels on an eager CPU
    backend with no gradient to record (``forward_only``), and at most
    :data:`ONE_THREAD_CHUNK` for keys of up to :data:`ONE_THREAD_KEYS` channels where an eager
    CPU loop reads each chunk's outputs inside it (``in_loop``: one thread, or more without a
    gradient to record; on two threads chunks of 32 took 0.65-0.93x the forward time of 64 at
    ggml's shapes) and where the loop over chunks is one scan (``scanned``: JAX under ``jit``
    on the CPU, whose scan runs its steps one after another: chunks of 32 took 0.79-1.00x the
    time of 64, forward, gated rule and KDA at d = 64 and 128, T = 512 and 4096, on one and
    two cores)."""
    if accelerator:  # fewer sequential steps, each a few launches (ACCELERATOR_CHUNK)
        chunk_size = max(chunk_size, ACCELERATOR_CHUNK)
    elif forward_only and d_k <= FORWARD_KEYS:
        chunk_size = min(chunk_size, FORWARD_CHUNK)
    elif (scanned or in_loop) and d_k <= ONE_THREAD_KEYS:
        chunk_size = min(chunk_size, ONE_THREAD_CHUNK)
    return 1 << (min(chunk_size, T) - 1).bit_length()


def delta_chunked(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    beta: Any,
    g: Any | None,
    S: Any,
    *,
    chunk_size: int,
    qk_l2norm: bool = False,
    scale: float = 1.0,
) -> tuple[Any, Any]:
    """The delta rule in chunks of ``chunk_size`` tokens from the state ``S``: ``(out, S_T)``.

    The chunk length is rounded up to a power of two (the levels of
    :func:`polylin._forms.common.intra_chunk.intra_chunk` halve it; :func:`chunk_length`); zero
    padding changes no result. On eager CPU backends the chunks are processed in blocks of about
    :data:`BLOCK_ROWS` rows per thread, on one thread in chunks of at most
    :data:`ONE_THREAD_CHUNK` tokens (keys of up to :data:`ONE_THREAD_KEYS` channels); where the
    loop over chunks is a scan (``_backend.execution.scans_chunks``) so is the loop over blocks
    of :data:`BLOCK_ROWS` rows (the last one padded); other lazy and accelerator backends get
    one block, and eager accelerators chunks of at least
    :data:`ACCELERATOR_CHUNK` tokens and dense inputs. Blocks come from one reshape and one
    ``unstack`` per input (autograd sees no per-block slice); each array keeps its own leading
    dimensions (grouped heads broadcast, nothing is copied per group).

    With ``qk_l2norm`` the queries and keys are L2-normalized block by block, inside
    :func:`_block`: the products keep the normalized blocks for the backward (they need them),
    and no normalized copy of the whole sequence is made besides. ``scale`` multiplies each
    block's queries (``o_t = S_t^T (scale q_t)``): a pass over one block in cache, not over the
    whole output (a fresh array of the sequence's size, page faults included).
    """
    T = k.shape[-2]
    if T == 0:
        return v[..., :0, :], S
    accelerator = eager_accelerator(xp, device(k))
    eager = eager_cpu(xp, device(k))
    threads = cpu_threads(xp) if eager else 1
    scanned = scans_chunks(xp, k)
    # The read-out inside the loop over chunks (_block) on one thread, and on more without a
    # gradient to record.
    forward_only = eager and not records_gradient(q, k, v, beta, g, S)
    in_loop = eager and (threads == 1 or forward_only)
    chunk = chunk_length(
        chunk_size, T, k.shape[-1], accelerator=accelerator, in_loop=in_loop, scanned=scanned,
        forward_only=forward_only,
    )  # fmt: skip
    n_chunks = -(-T // chunk)
    per_block = n_chunks
    if eager or scanned:
        rows = BLOCK_ROWS * threads
        per_block = max(1, rows // (chunk * max(1, math.prod(S.shape[:-2]))))
    n_blocks = -(-n_chunks // per_block)
    per_block = -(-n_chunks // n_blocks)  # as even as possible: little padding
    padded = n_blocks * per_block * chunk
    arrays = [q, k, v, beta] + ([] if g is None else [g])
    if padded != T:  # zero beta: no write; zero g: no decay; padded outputs are dropped
        arrays = [pad_rows(xp, x, padded - T) for x in arrays]
    arrays = [
        xp.reshape(x, (*x.shape[:-2], n_blocks, per_block, chunk, x.shape[-1])) for x in arrays
    ]
    causal = causal_mask(xp, chunk, chunk, device(k))

    def block_outputs(S: Any, block: Sequence[Any], in_loop: bool) -> tuple[Any, list[Any]]:
        Q, K, *rest = block
        if qk_l2norm:
            Q, K = l2_normalize(xp, Q), l2_normalize(xp, K)
        if scale != 1.0:
            Q = Q * scale
        outputs, S = _block(xp, Q, K, *rest, S=S, causal=causal, in_loop=in_loop)
        return S, outputs

    blocks: list[Sequence[Any]]
    if scanned and n_blocks > 1:  # one scan over the blocks, each its own scan over chunks

        def one(S: Any, block: tuple[Any, ...]) -> tuple[Any, Any]:
            S, (out,) = block_outputs(S, block, False)
            return S, out

        S, out = scan(one, S, tuple(xp.moveaxis(x, -4, 0) for x in arrays))
        out = xp.reshape(xp.moveaxis(out, 0, -4), (*out.shape[1:-3], padded, out.shape[-1]))
        return (out if padded == T else out[..., :T, :]), S
    if n_blocks == 1:
        blocks = [[y[..., 0, :, :, :] for y in arrays]]
    else:
        blocks = list(zip(*(unstack(xp, x, axis=-4) for x in arrays)))
    if accelerator:
        # On an accelerator a strided input (fla's (B, T, H, d) read as (B, H, T, d)) would
        # make every array derived from it strided, and each batched matmul of the chunk loop
        # would copy its operands per chunk: one copy of each input here instead.
        blocks = [[dense(xp, x) for x in block] for block in blocks]
    elif eager:
        # A flattening reshape copies a strided block of q and k once (matmul would copy them
        # at every use, and the key reshapes of the levels too; a sequence of one block as
        # well: 0.94x the forward time at ggml's shapes that are one block, the gated delta
        # rule at T = 64 and, on two threads, at 16 x 64, T = 512 and KDA), unless the block
        # loop writes them anew anyway (normalized, or the queries scaled): one pass, not two.
        rewritten = (qk_l2norm or scale != 1.0, qk_l2norm)
        blocks = [
            [x if new else dense(xp, x) for x, new in zip(block[:2], rewritten)] + list(block[2:])
            for block in blocks
        ]
    pieces: list[Any] = []  # (..., chunks, C, d_v) each: all joined by one concatenation
    for block in blocks:
        S, outputs = block_outputs(S, block, in_loop)
        pieces.extend(outputs)
    out = pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-3)
    out = xp.reshape(out, (*out.shape[:-3], padded, out.shape[-1]))
    return (out if padded == T else out[..., :T, :]), S


def _levels(
    xp: Any, Q: Any, K: Any, V: Any, B: Any, G: Any | None, causal: Any
) -> tuple[Any, Any, IntraChunk, Any]:
    """The scores, the decayed queries, the :class:`IntraChunk` and the values ``diag(beta) V``
    of :func:`_block` from the levels of :func:`intra_chunk`, in the array API alone. The rows
    ``-diag(beta) K`` enter the levels negated once: the levels then build ``(I + A)^{-1}``
    directly, and their decayed rows ``-diag(beta) K exp(b)`` enter the right-hand side of
    ``W`` without another negation."""
    rows = K * (-B)  # negating beta (..., C, 1), not the keys
    if G is None:
        scores = keep_lower(xp, matmul(xp, Q, xp.matrix_transpose(K)), causal, fresh=True)
        return scores, Q, intra_chunk(xp, K, None, [(rows, SOLVE)]), V * B
    if G.shape[-1] == 1:  # a scalar gate factors its scores: one full matmul
        scores = scalar_gate_scores(xp, Q, K, G, causal)
        queries = Q * xp.exp(cumulative_sum(xp, G, axis=-2))  # decayed from the chunk start
        return scores, queries, intra_chunk(xp, K, G, [(rows, SOLVE)]), V * B
    blocks = intra_chunk(xp, K, G, [(Q, SCORES), (rows, SOLVE)], relative=True)
    return blocks.matrices[0], blocks.rows[0], blocks, V * B


def _factored(
    xp: Any, Q: Any, K: Any, V: Any, B: Any, G: Any | None, causal: Any, solve: Any
) -> tuple[Any, Any, IntraChunk, Any]:
    """The scores, the decayed queries, the :class:`IntraChunk` and the values of
    :func:`_block` for no gate or a scalar one, where the library solves triangular systems
    (``solve``): ``A`` is one matmul times the chunk's :func:`segment_decay` (shared with the
    scores), and ``(I + A)^{-1}`` one batched triangular solve. The factors across the chunk
    come from in-chunk sums of the gate, each of its own terms: ``exp(b_t)`` from the chunk
    start (a cumulative sum) and ``exp(B - b_s)`` to its end (a reversed cumulative sum after
    ``s``). ``beta`` scales the inverse's columns, ``W = ((I + A)^{-1} diag(beta)) (V - (K
    exp(b)) S)``: a pass over a ``C x C`` matrix instead of the values and keys scaled by it
    (``C x d`` each); the values enter the loop as they are."""
    keys_t = xp.matrix_transpose(K)
    columns = xp.matrix_transpose(B)  # beta as (..., 1, C)
    if G is None:
        scores = keep_lower(xp, matmul(xp, Q, keys_t), causal, fresh=True)
        inverse = solve(matmul(xp, K * B, keys_t)) * columns
        return scores, Q, IntraChunk([inverse], [-K], K, None), V
    decay = segment_decay(xp, G)
    scores = scalar_gate_scores(xp, Q, K, G, causal, decay=decay)
    inverse = solve(matmul(xp, K * B, keys_t) * decay)  # only the strictly lower part is read
    start = xp.exp(cumulative_sum(xp, G, axis=-2))  # exp(b_t), (..., C, 1)
    after = cumulative_sum(xp, xp.flip(G, axis=-2), axis=-2, include_initial=True)
    end = xp.exp(xp.flip(after[..., :-1, :], axis=-2))  # exp(sum_{r > s} g_r)
    whole = start[..., -1:, :]  # exp(B): (..., 1, 1)
    return scores, Q * start, IntraChunk([inverse * columns], [K * (-start)], K * end, whole), V


def _block(
    xp: Any,
    Q: Any,
    K: Any,
    V: Any,
    B: Any,
    *rest: Any,
    S: Any,
    causal: Any,
    in_loop: bool,
) -> tuple[list[Any], Any]:
    """Outputs of N consecutive chunks from the state ``S``, and the state after them: the
    outputs as pieces ``(..., chunks, C, d_v)`` in order (one per chunk when ``in_loop``, else
    one of all N). ``Q, K, V, B`` (and the log decays, if any) are ``(..., N, C, d)``.

    The intra-chunk matrices come from :func:`_factored` where the library solves triangular
    systems and the gate (if any) is a scalar, else from :func:`_levels`.
    """
    G = rest[0] if rest else None
    solve = unit_lower_solver(xp, K)
    if solve is not None and (G is None or G.shape[-1] == 1):
        scores, queries, blocks, values = _factored(xp, Q, K, V, B, G, causal, solve)
    else:
        scores, queries, blocks, values = _levels(xp, Q, K, V, B, G, causal)
    inverse, keys_rhs = blocks.matrices[-1], blocks.rows[-1]
    if blocks.entry is not None:  # rows counted from the chunks' middle tokens: so is the state
        S = S * xp.matrix_transpose(blocks.entry)[..., 0, :, :]
    # The state recurrence across chunks is sequential: S_n feeds W_n. Each input is unstacked
    # once (one op for autograd); per chunk W_n = T_n (values_n + keys_rhs_n S_n) and the state
    # update remain (T applied once, to the sum, not to each term before the loop; beta either
    # in T's columns or in the values and keys: _factored, _levels).
    operands = (inverse, values, keys_rhs, xp.matrix_transpose(blocks.keys))
    decay = None if blocks.whole is None else xp.matrix_transpose(blocks.whole)  # (..., N, w, 1)
    # Read-out: on eager CPU backends, on one thread or without a gradient to record, each
    # chunk's O_n = Q_n S_n + P_n W_n in the loop, while S_n and W_n are in cache (no stacked
    # copy of the states, d_k x d_v per chunk: 16 MiB per block of eight chunks at 32 x 128;
    # forward on two threads 0.86x the time of the batched read-out at 32 x 128, T >= 512,
    # 0.95-0.97x at 16 x 64 and KDA); elsewhere two batched products after it: fewer, larger
    # operations, which more threads split better with a gradient to record (forward and
    # backward on two threads: a median of 0.92x the in-loop time over ten alternating runs,
    # 0.87-1.15x) and a graph that grows less with T.
    if not in_loop:  # (..., N, d_k, d_v) the state before each chunk, (..., N, C, d_v) W
        (starts, W), S = chunk_loop(xp, partial(_chunk_step, xp), S, [*operands, decay])
        return [add_matmul(xp, matmul(xp, queries, starts), scores, W, fresh=True)], S
    fused = fused_delta_chunks(S, *operands, decay, queries, scores)
    if fused is not None:
        return fused
    Ts, BVs, Rs, Ks = (unstack(xp, x, axis=-3) for x in operands)
    decays = [None] * len(Ts) if decay is None else unstack(xp, decay, axis=-3)
    Qs, Ps = (unstack(xp, x, axis=-3) for x in (queries, scores))
    outputs = []
    for n in range(len(Ts)):
        S_next, (_, W) = _chunk_step(xp, S, Ts[n], BVs[n], Rs[n], Ks[n], decays[n])
        outputs.append(add_matmul(xp, matmul(xp, Qs[n], S), Ps[n], W, fresh=True)[..., None, :, :])
        S = S_next
    return outputs, S


def _chunk_step(
    xp: Any, S: Any, T: Any, BV: Any, R: Any, K: Any, decay: Any | None
) -> tuple[Any, tuple[Any, Any]]:
    """One chunk of the sequential loop: ``W = T (BV + R S)`` (``T diag(beta) (V + R S)``
    with beta in ``T``'s columns) and the state after the chunk, ``diag(exp(B)) S + K^T W``
    (``K`` already transposed, ``decay`` ``(..., w, 1)`` or None). Returns ``(S', (S, W))``."""
    W = matmul(xp, T, add_matmul(xp, BV, R, S))
    if decay is None:
        return add_matmul(xp, S, K, W), (S, W)
    return add_matmul(xp, S * decay, K, W, fresh=True), (S, W)
