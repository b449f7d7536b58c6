"""Decayed inner products within a chunk: the building block shared by the chunked forms.

For rows ``r_t`` (queries, or keys scaled by a learning rate), keys ``k_s`` and a log decay
``g`` (one per token or one per channel), the intra-chunk matrix of a decayed recurrence is::

    M_ts = sum_c r_tc k_sc exp(sum_{s<r'<=t} g_r'c)        for s <= t (0 above the diagonal)

and the factors that carry a state across the chunk are the rows decayed from the chunk start,
``r_t exp(b_t)``, the keys decayed to the chunk end, ``k_s exp(B - b_s)``, and ``exp(B)`` (``b``
the in-chunk cumulative log decay, ``B`` its last value).

A per-channel decay cannot in general be factored over a chunk (``exp(-b_s)`` can overflow), so
:func:`intra_chunk` builds ``M`` level by level over blocks of 2, 4, ..., C tokens (C a power of
two): in every block the rows of its lower half meet the keys of its upper half through the
block's middle, ``exp(sum_{s<r'<=t} g)`` being ``exp(sum from the start of t's half to t)``
times ``exp(sum after s to the end of s's half)``, both <= 1. So the lower-left quadrant of every
block is one batched matmul of decayed rows and keys, and the two diagonal quadrants are the
previous level's blocks. The factors of level 2h are those of level h times one factor of a
whole half: every factor is a product of per-token factors ``exp(g_t) <= 1`` (no overflow; one
that underflows stands for a smaller true value; a ``-inf`` gate gives an exact 0), never the
exponential of a difference of long sums. After the last level the factors span the chunk.

The same levels serve the delta rule's unit lower-triangular inverse ``(I - L)^{-1}``,
``L = strictly_lower(M)``: merging two blocks of size h whose inverses are ``T11, T22`` gives
``[[T11, 0], [T22 L21 T11, T22]]`` (:func:`merge_inverse`), and ``L21`` is exactly the level's
lower-left quadrant. That is exact triangular inversion (not a truncated series), log-depth,
one batched computation per level over all blocks of all chunks, with no C x C matrix sliced.

A row set may also *read before its own token's decay* (the generalized delta rule's low-rank
read ``a_t^T S_{t-1}``): kinds ``"read scores"`` and ``"read solve"`` give the strictly lower
``N_ts = sum_c r_tc k_sc exp(sum_{s<r'<t} g_r'c)`` (``s < t``) and ``(I - N)^{-1}``. The same
levels build them: such rows are simply not decayed by their own token at the first level, so
a row's factor runs from the start of its stretch to ``t`` exclusive (still a product of
per-token factors <= 1), and after the last level it is ``r_t exp(b_t - g_t)``, the decay from
the chunk start to ``t`` exclusive.

Several key sets met by the same rows (the generalized rule's ``k`` and ``b``) share one call:
the rows are decayed once per level for all of them, each key set on its own.

A scalar gate factors its scores over the chunk: ``(R K^T) * exp(segment sums)``
(:func:`scalar_gate_scores`), one full matmul and no levels.

Where a per-channel gate decays no channel of a chunk by more than ``FACTORED_SPAN`` (16: the
usual GLA gates, every gate of RWKV-7's range at its chunks of 16), it factors too, through the
chunk's middle token ``m``: ``M = (R exp(e)) (K exp(-e))^T`` masked, with ``e_t`` the gate's
running sum from ``m`` to ``t`` (negated before ``m``), each a sum of its own terms, never a
difference of long sums; every factor is within ``exp(+-16)`` (no overflow; an entry above the
diagonal at most ``exp(16)`` times ``r . k``, never kept), and the exponents' rounding stays
on a par with the levels' products (float32 scores within 1.4-2.2e-7 of float64 sums at the
bound, the levels 0.7-1.6e-7). One matmul per row set and key set replaces the levels' three
elementwise passes per level. Eager CPU backends read the gate's values to choose
(:func:`~polylin._backend.execution.reads_values`); under ``jax.jit`` for the CPU the choice is
a ``lax.cond`` of the compiled program, which holds both constructions and runs one
(:func:`~polylin._backend.execution.branches_in_program`). A larger decay, a ``-inf`` or
``nan``, a half-precision gate, chunks of one token and every other traced or lazy call take
the levels.

The factored rows and keys are ``R exp(e)`` and ``K exp(-e)``: the rows decayed from the
chunk's start, ``r_t exp(b_t)``, are those times ``exp(b_m)``, one more pass per row set. A
caller that carries the state across chunks may instead count from the middle tokens
(``relative``): it carries ``diag(exp(b_m)) S`` into each chunk, reads it with ``R exp(e)`` as
they are, and passes it on by ``exp(B - b_m + b_m')`` to the next chunk's middle token ``m'``,
the keys decayed by the same factor (one pass, as to the chunk's end); only the first chunk's
state is scaled, once per call (the delta rule with a per-channel gate: KDA's forward 0.96-0.97x
the time, one and two threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ..._backend.execution import (
    branch,
    branches_in_program,
    reads_values,
    splits_chunks_on_concat,
)
from ..._backend.namespace import device
from ..._backend.ops import (
    broadcast_shape,
    causal_mask,
    concat_leading,
    cumulative_sum,
    keep_lower,
    matmul,
    reciprocal,
    stack_leading,
    unit_lower_solver,
    unstack,
)

__all__ = [
    "FACTORED_SPAN",
    "IntraChunk",
    "intra_chunk",
    "merge_inverse",
    "scalar_gate_scores",
    "segment_decay",
    "segment_sums",
    "unit_lower_inverse",
]

#: The kinds of matrix :func:`intra_chunk` builds from a set of rows; the ``READ_`` kinds' rows
#: read before their own token's decay (module docstring).
SCORES, SOLVE = "scores", "solve"
READ_SCORES, READ_SOLVE = "read scores", "read solve"
_READS = (READ_SCORES, READ_SOLVE)

#: The largest chunk log decay ``-B`` (per channel) whose scores :func:`intra_chunk` factors
#: through the middle of the range instead of building them level by level (module docstring).
FACTORED_SPAN = 16.0


class IntraChunk(NamedTuple):
    """What :func:`intra_chunk` returns; every array has the chunk axes last."""

    matrices: list[Any]  # per row set, (..., C, C): M with its diagonal, or (I - strict M)^-1
    rows: list[Any]  # per row set, (..., C, d): r_t exp(b_t), decayed from the chunk start
    # (the READ_ kinds: r_t exp(b_t - g_t), to t exclusive)
    keys: Any  # (..., C, d): k_s exp(B - b_s), decayed to the chunk end
    whole: Any | None  # (..., 1, w): exp(B), the decay of the whole chunk (None: no gate)
    # Counted from reference tokens (intra_chunk's relative): rows from their chunk's, keys and
    # whole to the next chunk's (the last chunk's to its end); entry (..., 1, 1, w) is the
    # decay from the first chunk's start to its reference. None: the chunks' starts.
    entry: Any | None = None


def _shape(*arrays: Any) -> tuple[int, ...]:
    """The broadcast shape of the arrays' dimensions before their last (feature) axis."""
    return broadcast_shape(*(tuple(x.shape[:-1]) for x in arrays))


def _halves(xp: Any, x: Any, pairs: int) -> Any:
    """``(..., C, w)`` as ``(..., pairs, 2, C / (2 pairs), w)``: the two halves of each block."""
    *lead, length, width = x.shape
    return xp.reshape(x, (*lead, pairs, 2, length // (2 * pairs), width))


def _join(xp: Any, x: Any) -> Any:
    """The inverse of :func:`_halves`."""
    *lead, pairs, _, half, width = x.shape
    return xp.reshape(x, (*lead, 2 * pairs * half, width))


def _joined(xp: Any, first: Any, second: Any) -> Any:
    """The halves ``(..., pairs, h, w)`` of each block joined back to ``(..., C, w)``, their
    leading dimensions broadcast (a grouped gate decays one half per group)."""
    if splits_chunks_on_concat(first):
        # Dask gives a stack one chunk per piece: after the last level, one per token. One
        # selection between broadcasts keeps each block whole.
        lower = (xp.arange(2, device=device(first)) == 1)[:, None, None]  # (half, token, w)
        return _join(xp, xp.where(lower, second[..., None, :, :], first[..., None, :, :]))
    return _join(xp, stack_leading(xp, [first, second], axis=-3))


def _merge(xp: Any, upper: Any, corner: Any, lower: Any, zeros: Any) -> Any:
    """``[[upper, 0], [corner, lower]]`` for blocks ``(..., h, h)`` (leading dimensions
    broadcast: a grouped gate makes the corners per group before the diagonal blocks are)."""
    if splits_chunks_on_concat(upper):
        # Dask gives a concatenation one chunk per piece: C^2 chunks per chunk after the last
        # level. The quadrants, (..., 2(i), h(t), 2(j), h(s)), are one selection instead.
        half = xp.arange(2, device=device(upper))
        i, j = half[:, None, None, None], half[:, None]
        upper, corner, lower = (x[..., None, :, None, :] for x in (upper, corner, lower))
        quadrants = xp.where(i == j, xp.where(i == 0, upper, lower), xp.where(i > j, corner, 0.0))
        h = quadrants.shape[-1]
        return xp.reshape(quadrants, (*quadrants.shape[:-4], 2 * h, 2 * h))
    top = concat_leading(xp, [upper, zeros], axis=-1)
    return concat_leading(xp, [top, concat_leading(xp, [corner, lower], axis=-1)], axis=-2)


def merge_inverse(xp: Any, inverse: Any, corner: Any, pairs: int) -> Any:
    """Merge pairs of unit lower-triangular inverses: ``(I - L)^{-1}`` on blocks twice the size.

    ``inverse`` is ``(..., 2 pairs, h, h)``: the inverses ``T11, T22`` of the diagonal blocks,
    in pairs; ``corner`` ``(..., pairs, h, h)`` is the lower-left block ``L21`` of each pair's
    ``L``. Returns ``(..., pairs, 2h, 2h)``: ``[[T11, 0], [T22 L21 T11, T22]]``.
    """
    h = inverse.shape[-1]
    T11, T22 = unstack(xp, xp.reshape(inverse, (*inverse.shape[:-3], pairs, 2, h, h)), axis=-3)
    # 1 x 1 blocks are ones: T21 is the corner itself.
    T21 = corner if h == 1 else matmul(xp, T22, matmul(xp, corner, T11))
    # Fresh zeros: ``zeros_like`` of a strided view copies its strides and slows the concat.
    zeros = xp.zeros(T11.shape, dtype=T11.dtype, device=device(T11))
    return _merge(xp, T11, T21, T22, zeros)


def unit_lower_inverse(xp: Any, L: Any) -> Any:
    """``(I - L)^{-1}`` for a given strictly lower-triangular ``L`` ``(..., C, C)``, C a power
    of two: the levels of :func:`merge_inverse` with each level's lower-left quadrants taken
    from ``L`` (one ``take`` of the flattened matrix per level, no slice in a loop).
    """
    size = L.shape[-1]
    lead = L.shape[:-2]
    flat = xp.reshape(L, (*lead, size * size))
    inverse = xp.ones((*lead, size, 1, 1), dtype=L.dtype, device=device(L))
    h = 1
    while h < size:
        pairs = size // (2 * h)
        block = xp.arange(pairs, device=device(L))[:, None, None] * (2 * h * size + 2 * h)
        row = xp.arange(h, device=device(L))[None, :, None] * size
        col = xp.arange(h, device=device(L))[None, None, :]
        index = xp.reshape(block + row + col + h * size, (pairs * h * h,))
        corner = xp.reshape(xp.take(flat, index, axis=-1), (*lead, pairs, h, h))
        inverse = merge_inverse(xp, inverse, corner, pairs)
        h *= 2
    return xp.reshape(inverse, (*lead, size, size))


def _merged(xp: Any, M: Any | None, kind: str, corner: Any, pairs: int) -> Any:
    """The matrices of blocks twice the size from those of the last level, ``M`` (``None``
    before the first level of an inverse), and the lower-left ``corner`` of each block."""
    h = corner.shape[-1]
    if kind in (SCORES, READ_SCORES):  # M holds the diagonal at least
        assert M is not None
        upper, lower = unstack(xp, xp.reshape(M, (*M.shape[:-3], pairs, 2, h, h)), axis=-3)
        return _merge(xp, upper, corner, lower, xp.zeros_like(upper))
    if M is None:  # the 2 x 2 inverses [[1, 0], [l, 1]]
        entry = corner[..., 0, 0]
        one, zero = xp.ones_like(entry), xp.zeros_like(entry)
        pattern = xp.stack([one, zero, entry, one], axis=-1)
        return xp.reshape(pattern, (*entry.shape, 2, 2))
    return merge_inverse(xp, M, corner, pairs)


def intra_chunk(
    xp: Any,
    K: Any,
    G: Any | None,
    rows: Sequence[tuple[Any, Any]],
    *,
    relative: bool = False,
    row_scale: float = 1.0,
) -> IntraChunk:
    """The decayed intra-chunk matrices of several row sets against the keys ``K``, and the
    factors that carry the state across the chunk (module docstring).

    ``K`` is ``(..., C, d)`` with C a power of two, ``G`` the log decay ``(..., C, w)``
    (``w`` 1 or ``d``; ``None``: no decay), each entry of ``rows`` an ``(R, kind)`` with ``R``
    ``(..., C, d)``; the leading dimensions broadcast. ``kind`` is ``"scores"`` for ``M`` with
    its diagonal (0 above it) or ``"solve"`` for the unit lower-triangular ``(I - L)^{-1}``,
    ``L`` the strictly lower part of ``M`` (pass negated rows for ``(I + L)^{-1}``);
    ``"read scores"`` and ``"read solve"`` the same for rows that read before their own token's
    decay: the strictly lower ``N`` and ``(I - N)^{-1}`` (module docstring).

    ``K`` may also be a list of key sets of one shape: then each ``kind`` is a tuple, one per
    key set (all reads or none), and the result's ``matrices[i]`` and ``keys`` are lists, one
    per key set. Every row set is decayed once for all key sets (the generalized rule's rows
    meet two).

    ``relative`` (the chunk axis is ``-3``: ``K`` ``(..., N, C, d)``): where the scores are
    factored through each chunk's middle token, the rows, keys and ``whole`` count from that
    token (its *reference*) instead of the chunk's start, and ``entry`` is the decay from the
    first chunk's start to its reference: a caller that carries ``diag(entry) S`` into the
    first chunk and ``diag(whole) S`` from chunk to chunk reads and updates the state with the
    rows and keys as given, and leaves the last chunk with ``S`` itself (module docstring).
    The levels count from the chunks' starts (``entry`` ``None``; ones where the choice is
    made inside a compiled program).

    ``row_scale`` multiplies the decayed rows (not the matrices): a query scale that the
    factored scores fold into the rows' decay from the chunk start, a small array (GLA's
    forward at ggml's shape 0.93-0.97x the time of scaling the queries first); one more pass
    over the rows otherwise.

    Each level costs one batched matmul per row set and key set and ``O(d)`` products per
    token per row set and key set for a per-channel gate (``O(h)`` per token for a scalar
    one); the 1 x 1 corners of the first level are row sums (a tiny batched matmul's backward
    costs several times as much).
    """
    several = isinstance(K, list)
    key_sets = list(K) if several else [K]
    kinds = [list(kind) if several else [kind] for _, kind in rows]  # per row set, per key set
    reads = [row_kinds[0] in _READS for row_kinds in kinds]
    parts = _factored(xp, key_sets, G, rows, kinds, reads, relative=relative, row_scale=row_scale)
    if parts is None:
        matrices, decayed, keys, whole = _levels(xp, key_sets, G, rows, kinds, reads)
        if row_scale != 1.0:
            decayed = [R * row_scale for R in decayed]
        parts = matrices, decayed, keys, whole, None
    matrices, decayed, keys, whole, entry = parts
    if several:
        return IntraChunk(matrices, decayed, keys, whole, entry)
    return IntraChunk([M for (M,) in matrices], decayed, keys[0], whole, entry)


#: What :func:`_levels` returns: the matrices (per row set, per key set), the decayed rows (per
#: row set), the decayed keys (per key set) and the whole-chunk decay; :func:`_factored` adds
#: :class:`IntraChunk`'s ``entry`` (``_Referenced``).
_Parts = tuple[list[list[Any]], list[Any], list[Any], Any]
_Referenced = tuple[list[list[Any]], list[Any], list[Any], Any, Any]


def _levels(
    xp: Any, key_sets: list[Any], G: Any | None, rows: Sequence[tuple[Any, Any]],
    kinds: list[list[str]], reads: list[bool],
) -> _Parts:
    """:func:`intra_chunk`'s matrices, rows, keys and whole-chunk decay level by level."""
    chunk = key_sets[0].shape[-2]
    decayed = [R for R, _ in rows]  # r_t decayed from the start of its stretch to t
    keys = key_sets  # k_s decayed from s (exclusive) to the end of its stretch
    whole = None if G is None else xp.exp(G)  # (..., C / h, w): the decay of each stretch
    # A scalar gate keeps its factors apart, (..., C, 1) for the rows and the keys, and scales
    # each h x h corner by their outer product: h^2 products per block instead of 2 h d.
    scalar = whole is not None and whole.shape[-1] == 1
    # Rows that read before their own token's decay start undecayed: their factor (None: ones)
    # runs from the start of their stretch to t exclusive.
    row_factor, key_factor, read_factor = whole, None, None
    reading = any(reads)
    if whole is not None and not scalar:
        decayed = [R if read else whole * R for R, read in zip(decayed, reads)]  # dense
    matrices: list[list[Any]] = [[] for _ in rows]
    for (R, _), row_kinds, row_matrices in zip(rows, kinds, matrices):
        for key, kind in zip(key_sets, row_kinds):  # s = t: undecayed (a read does not see
            if kind == SCORES:  # its own token's write)
                row_matrices.append(xp.sum(R * key, axis=-1)[..., None, None])
            elif kind == READ_SCORES:
                shape = (*_shape(R, key), 1, 1)
                row_matrices.append(xp.zeros(shape, dtype=key.dtype, device=device(key)))
            else:
                row_matrices.append(None)
    h = 1
    while h < chunk:
        pairs = chunk // (2 * h)  # blocks of 2h tokens: two stretches of h
        key_halves = [unstack(xp, _halves(xp, key, pairs), axis=-3) for key in keys]
        halves = [unstack(xp, _halves(xp, R, pairs), axis=-3) for R in decayed]
        if scalar:
            _, low_f = unstack(xp, _halves(xp, row_factor, pairs), axis=-3)
            up_kf = None
            if key_factor is None:
                outer = low_f
            else:
                up_kf, _ = unstack(xp, _halves(xp, key_factor, pairs), axis=-3)
                outer = low_f * xp.matrix_transpose(up_kf)
            outer_read = None if up_kf is None else xp.matrix_transpose(up_kf)
            if reading and read_factor is not None:
                _, low_rf = unstack(xp, _halves(xp, read_factor, pairs), axis=-3)
                outer_read = low_rf if outer_read is None else low_rf * outer_read
        for row_kinds, read, (_, lower_r), row_matrices in zip(kinds, reads, halves, matrices):
            for j, (kind, (upper_k, _)) in enumerate(zip(row_kinds, key_halves)):
                if h == 1:
                    corner = xp.sum(lower_r * upper_k, axis=-1)[..., None]
                else:
                    corner = matmul(xp, lower_r, xp.matrix_transpose(upper_k))  # t low, s up
                if scalar:
                    factor = outer_read if read else outer
                    corner = corner if factor is None else corner * factor
                row_matrices[j] = _merged(xp, row_matrices[j], kind, corner, pairs)
        if whole is not None:
            # Stretches of 2h: a row in the second half also crosses the whole first half, a
            # key in the first half the whole second half; the other halves are unchanged (not
            # multiplied by ones: autograd keeps only the halves it multiplies).
            *g_lead, _, width = whole.shape
            first, second = unstack(xp, xp.reshape(whole, (*g_lead, pairs, 2, 1, width)), axis=-3)
            if scalar:
                up_f, low_f = unstack(xp, _halves(xp, row_factor, pairs), axis=-3)
                row_factor = _joined(xp, up_f, low_f * first)
                if key_factor is None:
                    key_factor = _joined(xp, second, xp.ones_like(second))
                else:
                    up_f, low_f = unstack(xp, _halves(xp, key_factor, pairs), axis=-3)
                    key_factor = _joined(xp, up_f * second, low_f)
                if not reading:
                    pass
                elif read_factor is None:
                    read_factor = _joined(xp, xp.ones_like(first), first)
                else:
                    up_f, low_f = unstack(xp, _halves(xp, read_factor, pairs), axis=-3)
                    read_factor = _joined(xp, up_f, low_f * first)
            else:
                decayed = [_joined(xp, up, low * first) for up, low in halves]
                keys = [_joined(xp, up * second, low) for up, low in key_halves]
            whole = first[..., 0, :] * second[..., 0, :]
        h *= 2
    if scalar:
        factors = [read_factor if read else row_factor for read in reads]
        decayed = [R if f is None else R * f for R, f in zip(decayed, factors)]
        keys = [key if key_factor is None else key * key_factor for key in key_sets]
    for (R, _), row_matrices in zip(rows, matrices):
        for j, (M, key) in enumerate(zip(row_matrices, key_sets)):
            if M is None:  # C = 1
                M = xp.ones((*_shape(R, key), 1, 1), dtype=key.dtype, device=device(key))
            row_matrices[j] = xp.reshape(M, (*M.shape[:-3], chunk, chunk))
    return matrices, decayed, keys, whole


def _factored(
    xp: Any, key_sets: list[Any], G: Any | None, rows: Sequence[tuple[Any, Any]],
    kinds: list[list[str]], reads: list[bool], *, relative: bool = False, row_scale: float = 1.0,
) -> _Referenced | None:
    """:func:`intra_chunk`'s matrices, rows, keys and whole-chunk decay for a per-channel gate
    factored over the chunk through its middle token; ``None`` where that does not apply
    (module docstring): no gate or a scalar one, chunks of one token, no entries, a precision
    other than float32 and float64, a backend that neither reads values nor chooses inside its
    program, a chunk log decay beyond :data:`FACTORED_SPAN`. Where the choice is made inside
    the program (:func:`~polylin._backend.execution.branches_in_program`) both constructions
    are traced and the program runs one. The fifth value is :class:`IntraChunk`'s ``entry``.
    """
    if (G is None or G.shape[-1] == 1 or G.shape[-2] < 2 or 0 in G.shape
            or G.dtype not in (xp.float32, xp.float64)):  # fmt: skip
        return None
    in_program = branches_in_program(xp, G)
    if not (in_program or reads_values(xp, G)):
        return None
    outward = _outward_sums(xp, G)
    # The chunk's decay -B = -(b_m + (B - b_m)) = e_{-1} - e_{C-1}, per channel (nan: False)
    bounded = xp.max(outward[..., 0, :] - outward[..., -1, :]) <= FACTORED_SPAN
    if in_program:

        def levels() -> _Referenced:
            matrices, decayed, keys, whole = _levels(xp, key_sets, G, rows, kinds, reads)
            if row_scale != 1.0:
                decayed = [R * row_scale for R in decayed]
            entry = xp.ones_like(whole[..., :1, :, :]) if relative else None
            return matrices, decayed, keys, whole, entry

        return branch(
            bounded,
            lambda: _through_middle(
                xp, key_sets, outward, rows, kinds, reads, relative, row_scale),
            levels,
        )
    if not bool(bounded):
        return None
    return _through_middle(xp, key_sets, outward, rows, kinds, reads, relative, row_scale)


def _outward_sums(xp: Any, G: Any) -> Any:
    """``(..., C + 1, w)``: the gate's running sums outward from the middle token
    ``m = C / 2 - 1``, ``e_{t-1}`` for ``t = 0..C``: ``e_t = sum_{m<r<=t} g_r`` after ``m``,
    ``-sum_{t<r<=m} g_r`` before it (``e_{-1} = -b_m``, ``e_{C-1} = B - b_m``).

    One matrix product of a constant ``(C + 1, C)`` matrix of 0 and +-1 with ``G``: each row
    the sum of its own terms, as a running sum would add them, in one batched product instead
    of two running sums, two reversals, a negation and a join (the sums of a contiguous block of
    GLA's gate, ``(1, 32, 4, 32, 64)``, one thread: PyTorch 0.4-0.6x the time, NumPy 0.3x; the
    whole forward of GLA and RWKV-7 at ggml's shapes 0.93-0.97x, a strided block copied by the
    product first). The constant matrix is broadcast to ``G``'s leading dimensions, so that the
    product is batched over them and the sums come out row-major in ``G``'s own order. As one
    2-D product over all of ``G``'s columns (what :func:`~polylin._backend.ops.matmul` makes of
    a matrix times a stack) they came out token-major, a chunk's rows a whole block of heads
    apart, and so did every factor computed from them: MKL's kernels for Intel processors
    multiply such scores and transposed keys 2.4x slower than row-major ones (32 x 64 by
    64 x 32, 128 of them: GLA's, KDA's and RWKV-7's forward at ggml's shapes 0.83-0.95x the time
    with the sums row-major; 0.96-1.03x on MKL's AMD path and on NumPy, which were not slowed).
    A term that is not finite makes every sum of its channel ``nan`` (``0 * inf``): the bound
    then fails.
    """
    chunk = G.shape[-2]
    middle = chunk // 2 - 1
    dev = device(G)
    t = xp.arange(-1, chunk, device=dev)[:, None]  # e_t for t = -1..C-1
    r = xp.arange(chunk, device=dev)[None, :]
    # +1 where m < r <= t (after the middle), -1 where t < r <= m (before it), else 0
    signs = xp.astype(r <= t, G.dtype) - xp.astype(r <= middle, G.dtype)
    return xp.broadcast_to(signs, (*G.shape[:-2], *signs.shape)) @ G


def _through_middle(
    xp: Any, key_sets: list[Any], outward: Any, rows: Sequence[tuple[Any, Any]],
    kinds: list[list[str]], reads: list[bool], relative: bool, row_scale: float,
) -> _Referenced:
    """:func:`_factored`'s construction from the gate's running sums outward from the middle
    token m, ``e_{t-1}`` for ``t = 0..C`` (:func:`_outward_sums`); ``relative``: counted from
    the middle tokens; ``row_scale``: the decayed rows' scale (:func:`intra_chunk`)."""
    grows = xp.exp(outward)  # exp(e_{t-1}), t = 0..C
    inverse = reciprocal(xp, grows)  # exp(-e_{t-1}); the first row exp(b_m) (within exp(16))
    shrinks, to_start = inverse[..., 1:, :], inverse[..., :1, :]  # exp(-e), exp(b_m)
    to_end = grows[..., -1:, :]  # exp(B - b_m)
    solve = unit_lower_solver(xp, outward)  # PyTorch, XLA under jit: a batched triangular solve
    met = [shrinks * key for key in key_sets]  # k_s exp(-e_s)
    # The rows' scale joins their one factor per chunk (exp(b_m)), a small array.
    row_start = to_start if row_scale == 1.0 else to_start * row_scale
    matrices, decayed = [], []
    for (R, _), row_kinds, read in zip(rows, kinds, reads):
        meeting = (grows[..., :-1, :] if read else grows[..., 1:, :]) * R  # a read: to t excl.
        # r_t exp(b_t) (a read: exp(b_t - g_t)); relative: r_t exp(e_t), from the middle
        if relative:
            decayed.append(meeting if row_scale == 1.0 else meeting * row_scale)
        else:
            decayed.append(meeting * row_start)
        row_matrices = []
        for key, kind in zip(met, row_kinds):
            M = matmul(xp, meeting, xp.matrix_transpose(key))
            if kind == SCORES:
                row_matrices.append(keep_lower(xp, M, fresh=True))
            elif kind == READ_SCORES:
                row_matrices.append(keep_lower(xp, M, strict=True, fresh=True))
            elif solve is not None:  # reads M's strictly lower triangle only
                row_matrices.append(solve(-M))
            else:
                L = keep_lower(xp, M, strict=True, fresh=True)
                row_matrices.append(unit_lower_inverse(xp, L))
        matrices.append(row_matrices)
    if not relative:
        return matrices, decayed, [key * to_end for key in met], to_start * to_end, None
    # From each middle token to the next chunk's, exp(B - b_m + b_m'): the last chunk's to its end
    later = xp.concat([to_start[..., 1:, :, :], xp.ones_like(to_start[..., :1, :, :])], axis=-3)
    onward = to_end * later
    return matrices, decayed, [key * onward for key in met], onward, to_start[..., :1, :, :]


def segment_sums(xp: Any, G: Any, axis: int) -> Any:
    """``seg[t, s] = sum_{s < r <= t} g_r`` (0 where ``t <= s``), a new axis after ``axis``.

    ``G`` has the token axis at ``axis`` (negative); the result has two token axes there, the
    later one for s. Each entry is the sum of its own terms (Mamba-2's "segsum"), so it keeps
    float32 precision where a difference of cumulative sums would not, and a ``-inf`` term
    gives ``-inf`` (never ``-inf - -inf``).
    """
    length = G.shape[axis]
    later = causal_mask(xp, length, length, device(G), strict=True)  # r > s
    if axis == -2:  # (..., C, w) -> (..., C(r), C(s), w)
        repeated = G[..., :, None, :]
        later = later[:, :, None]
    else:  # axis == -1: (..., C) -> (..., C(r), C(s)): the strictly lower triangle
        repeated = xp.broadcast_to(G[..., :, None], (*G.shape, length))
        return cumulative_sum(xp, keep_lower(xp, repeated, later, strict=True), axis=-2)
    terms = xp.where(later, repeated, 0.0)
    return cumulative_sum(xp, terms, axis=axis - 1)


def segment_decay(xp: Any, G: Any) -> Any:
    """``exp(sum_{s<r<=t} g_r)`` ``(..., C, C)`` (1 on and above the diagonal), in ``[0, 1]``,
    for a scalar gate ``G`` ``(..., C, 1)``: the decay of a chunk's scores."""
    return xp.exp(segment_sums(xp, G[..., 0], axis=-1))


def scalar_gate_scores(
    xp: Any, R: Any, K: Any, G: Any, mask: Any, *, strict: bool = False, decay: Any = None
) -> Any:
    """``where(mask, (r_t . k_s) exp(sum_{s<r<=t} g_r), 0)`` for a scalar gate per token.

    ``G`` is ``(..., C, 1)``; ``mask`` the boolean ``(C, C)`` pattern kept (``s <= t``, or
    ``s < t`` for a strictly lower matrix: ``causal_mask(..., strict)``); ``decay`` its
    :func:`segment_decay`, if already computed.
    """
    decay = segment_decay(xp, G) if decay is None else decay
    scores = matmul(xp, R, xp.matrix_transpose(K)) * decay
    return keep_lower(xp, scores, mask, strict=strict, fresh=True)
