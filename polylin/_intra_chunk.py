"""Decayed inner products within a chunk: the building block shared by the chunked forms.

For rows ``r_t`` (queries, or keys scaled by a learning rate), keys ``k_s`` and a log decay
``g`` (one per token or one per channel), the intra-chunk matrix of a decayed recurrence is::

    M_ts = sum_c r_tc k_sc exp(sum_{s<r'<=t} g_r'c)        for s <= t (0 above the diagonal)

and the factors that carry a state across the chunk are the rows decayed from the chunk start,
``r_t exp(b_t)``, the keys decayed to the chunk end, ``k_s exp(B - b_s)``, and ``exp(B)`` (``b``
the in-chunk cumulative log decay, ``B`` its last value).

A per-channel decay cannot be factored over a whole chunk (``exp(-b_s)`` alone can overflow), so
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

A scalar gate factors its scores over the chunk: ``(R K^T) * exp(segment sums)``
(:func:`scalar_gate_scores`), one full matmul and no levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ._ops import causal_mask, pad_rows
from ._policy import cumulative_sum, device, unstack

__all__ = [
    "IntraChunk",
    "intra_chunk",
    "merge_inverse",
    "scalar_gate_scores",
    "segment_sums",
    "unit_lower_inverse",
]

#: The kinds of matrix :func:`intra_chunk` builds from a set of rows; the ``READ_`` kinds' rows
#: read before their own token's decay (module docstring).
SCORES, SOLVE = "scores", "solve"
READ_SCORES, READ_SOLVE = "read scores", "read solve"
_SOLVES = (SOLVE, READ_SOLVE)


class IntraChunk(NamedTuple):
    """What :func:`intra_chunk` returns; every array has the chunk axes last."""

    matrices: list[Any]  # per row set, (..., C, C): M with its diagonal, or (I - strict M)^-1
    rows: list[Any]  # per row set, (..., C, d): r_t exp(b_t) (READ_: exp(b_t - g_t), from the
    # chunk start to t exclusive)
    keys: Any  # (..., C, d): k_s exp(B - b_s), decayed to the chunk end
    whole: Any | None  # (..., 1, w): exp(B), the decay of the whole chunk (None: no gate)


def _shape(*arrays: Any) -> tuple[int, ...]:
    """The broadcast shape of the arrays' dimensions before their last (feature) axis."""
    shapes = [tuple(x.shape[:-1]) for x in arrays]
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + s for s in shapes]
    return tuple(max(sizes) for sizes in zip(*padded))


def _halves(xp: Any, x: Any, pairs: int) -> Any:
    """``(..., C, w)`` as ``(..., pairs, 2, C / (2 pairs), w)``: the two halves of each block."""
    *lead, length, width = x.shape
    return xp.reshape(x, (*lead, pairs, 2, length // (2 * pairs), width))


def _join(xp: Any, x: Any) -> Any:
    """The inverse of :func:`_halves`."""
    *lead, pairs, _, half, width = x.shape
    return xp.reshape(x, (*lead, 2 * pairs * half, width))


def _joined(xp: Any, upper: Any, lower: Any) -> Any:
    """The two halves ``(..., pairs, h, w)`` back as ``(..., C, w)``, their leading dimensions
    broadcast (one half may have been decayed by a gate with more of them)."""
    shape = (*_shape(upper, lower), upper.shape[-1])
    if tuple(upper.shape) != shape or tuple(lower.shape) != shape:
        upper, lower = xp.broadcast_to(upper, shape), xp.broadcast_to(lower, shape)
    return _join(xp, xp.stack([upper, lower], axis=-3))


def _merge(xp: Any, upper: Any, corner: Any, lower: Any, zeros: Any) -> Any:
    """``[[upper, 0], [corner, lower]]`` for blocks ``(..., h, h)``.

    The blocks' leading dimensions broadcast: a gate with more leading dimensions than the rows
    and keys (a decay per value head against shared keys) reaches the corners before the
    diagonal blocks.
    """
    blocks = (upper, corner, lower, zeros)
    shape = (*_shape(*blocks), upper.shape[-1])
    if any(tuple(x.shape) != shape for x in blocks):
        upper, corner, lower, zeros = (xp.broadcast_to(x, shape) for x in blocks)
    return xp.concat(
        [xp.concat([upper, zeros], axis=-1), xp.concat([corner, lower], axis=-1)], axis=-2
    )


def merge_inverse(xp: Any, inverse: Any, corner: Any, pairs: int) -> Any:
    """Merge pairs of unit lower-triangular inverses: ``(I - L)^{-1}`` on blocks twice the size.

    ``inverse`` is ``(..., 2 pairs, h, h)``: the inverses ``T11, T22`` of the diagonal blocks,
    in pairs; ``corner`` ``(..., pairs, h, h)`` is the lower-left block ``L21`` of each pair's
    ``L``. Returns ``(..., pairs, 2h, 2h)``: ``[[T11, 0], [T22 L21 T11, T22]]``.
    """
    h = inverse.shape[-1]
    T11, T22 = unstack(xp, xp.reshape(inverse, (*inverse.shape[:-3], pairs, 2, h, h)), axis=-3)
    # 1 x 1 blocks are ones: T21 is the corner itself.
    T21 = corner if h == 1 else xp.matmul(T22, xp.matmul(corner, T11))
    # Fresh zeros: ``zeros_like`` of a strided view copies its strides and slows the concat.
    zeros = xp.zeros(T11.shape, dtype=T11.dtype, device=device(T11))
    return _merge(xp, T11, T21, T22, zeros)


def unit_lower_inverse(xp: Any, L: Any) -> Any:
    """``(I - L)^{-1}`` for a strictly lower-triangular ``L`` given as a matrix ``(..., C, C)``.

    The same log-depth merges as :func:`intra_chunk`'s ``"solve"`` kinds, with the corners
    ``L21`` of each level cut out of ``L`` (a selection of the diagonal blocks, no gather): for a
    matrix that is not built from rows and keys, such as one computed whole from segment sums.
    A ``C`` that is not a power of two is padded with zeros (identity rows) and cut back.
    """
    *lead, C, _ = L.shape
    size = 1 << (C - 1).bit_length()
    if size != C:
        L = pad_rows(xp, L, size - C)
        L = xp.matrix_transpose(pad_rows(xp, xp.matrix_transpose(L), size - C))
    inverse = xp.ones((*lead, size, 1, 1), dtype=L.dtype, device=device(L))
    h = 1
    while h < size:
        pairs = size // (2 * h)
        blocks = xp.reshape(L, (*lead, pairs, 2, h, pairs, 2, h))
        lower_rows = unstack(xp, blocks, axis=-5)[1]  # (..., pairs, h, pairs, 2, h)
        corners = unstack(xp, lower_rows, axis=-2)[0]  # (..., pairs, h, pairs, h)
        index = xp.arange(pairs, device=device(L))
        same = (index[:, None] == index[None, :])[:, None, :, None]  # a block with itself
        corner = xp.sum(xp.where(same, corners, 0.0), axis=-2)  # (..., pairs, h, h)
        inverse = merge_inverse(xp, inverse, corner, pairs)
        h *= 2
    inverse = xp.reshape(inverse, (*lead, size, size))
    return inverse if size == C else inverse[..., :C, :C]


def intra_chunk(
    xp: Any, K: Any, G: Any | None, rows: Sequence[tuple[Any, str]]
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

    Each level costs ``O(d)`` products per token per row set and one batched matmul per row
    set; the 1 x 1 corners of the first level are row sums (a tiny batched matmul's backward
    costs several times as much).
    """
    chunk = K.shape[-2]
    kinds = [kind for _, kind in rows]
    decayed = [R for R, _ in rows]  # r_t decayed from the start of its stretch to t
    keys = K  # k_s decayed from s (exclusive) to the end of its stretch
    whole = None if G is None else xp.exp(G)  # (..., C / h, w): the decay of each stretch
    if whole is not None:  # rows that read before their token's decay start undecayed
        decayed = [R if kind in (READ_SCORES, READ_SOLVE) else R * whole for R, kind in rows]
    matrices = []
    for R, kind in rows:
        if kind == SCORES:  # s = t: undecayed
            matrices.append(xp.sum(R * K, axis=-1)[..., None, None])
        elif kind == READ_SCORES:  # strictly lower: a token does not read its own write
            shape = (*_shape(R, K), 1, 1)
            matrices.append(xp.zeros(shape, dtype=K.dtype, device=device(K)))
        else:  # 1 x 1 inverses
            shape = (*_shape(R, K), 1, 1)
            matrices.append(xp.ones(shape, dtype=K.dtype, device=device(K)))
    h = 1
    while h < chunk:
        pairs = chunk // (2 * h)  # blocks of 2h tokens: two stretches of h
        upper_k, lower_k = unstack(xp, _halves(xp, keys, pairs), axis=-3)
        halves = [unstack(xp, _halves(xp, R, pairs), axis=-3) for R in decayed]
        for i, (kind, (_, lower_r)) in enumerate(zip(kinds, halves)):
            if h == 1:
                corner = xp.sum(lower_r * upper_k, axis=-1)[..., None]
            else:
                corner = xp.matmul(lower_r, xp.matrix_transpose(upper_k))  # t lower, s upper
            if kind not in _SOLVES:
                M = matrices[i]
                upper, lower = unstack(
                    xp, xp.reshape(M, (*M.shape[:-3], pairs, 2, h, h)), axis=-3
                )
                matrices[i] = _merge(xp, upper, corner, lower, xp.zeros_like(upper))
            else:
                matrices[i] = merge_inverse(xp, matrices[i], corner, pairs)
        if whole is None:
            keys = _join(xp, xp.stack([upper_k, lower_k], axis=-3))
        else:
            # Stretches of 2h: a row in the second half also crosses the whole first half, a
            # key in the first half the whole second half; the other halves are unchanged (not
            # multiplied by ones: autograd keeps only the halves it multiplies).
            *g_lead, _, width = whole.shape
            first, second = unstack(xp, xp.reshape(whole, (*g_lead, pairs, 2, 1, width)), axis=-3)
            decayed = [_joined(xp, up, low * first) for up, low in halves]
            keys = _joined(xp, upper_k * second, lower_k)
            whole = first[..., 0, :] * second[..., 0, :]
        h *= 2
    matrices = [xp.reshape(M, (*M.shape[:-3], chunk, chunk)) for M in matrices]
    return IntraChunk(matrices, decayed, keys, whole)


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
    else:  # axis == -1: (..., C) -> (..., C(r), C(s))
        repeated = G[..., :, None]
    terms = xp.where(later, repeated, 0.0)
    return cumulative_sum(xp, terms, axis=axis - 1)


def scalar_gate_scores(xp: Any, R: Any, K: Any, G: Any, mask: Any) -> Any:
    """``where(mask, (r_t . k_s) exp(sum_{s<r<=t} g_r), 0)`` for a scalar gate per token.

    ``G`` is ``(..., C, 1)``; ``mask`` the boolean ``(C, C)`` pattern kept (``s <= t``, or
    ``s < t`` for a strictly lower matrix).
    """
    decay = xp.exp(segment_sums(xp, G[..., 0], axis=-1))  # (..., C, C), in [0, 1]
    return xp.where(mask, xp.matmul(R, xp.matrix_transpose(K)) * decay, 0.0)
