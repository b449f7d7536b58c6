"""The states before each chunk: a prefix over the chunk axis, decayed or not, or a loop.

:func:`chunk_prefix` serves the chunked forms whose state update across chunks is ``S_{n+1} =
decay_n * S_n + U_n`` (linear attention with or without a gate, the mLSTM's matrix memory and
normalizer); :func:`chunk_loop` those whose update depends on the state itself (the delta
rules: ``S_n`` feeds the chunk's corrections).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..._backend.execution import chains_decay, scan, scans_chunks
from ..._backend.fused import fused_chain_reads
from ..._backend.namespace import device
from ..._backend.ops import add_scaled, concat_leading, cumulative_sum, matmul, unstack

__all__ = ["chunk_loop", "chunk_prefix", "chunk_reads"]

#: ``step(S, *operands of one chunk) -> (S after the chunk, outputs of the chunk)``.
ChunkStep = Callable[..., tuple[Any, tuple[Any, ...]]]


def chunk_loop(
    xp: Any, step: ChunkStep, state: Any, operands: Sequence[Any | None]
) -> tuple[tuple[Any, ...], Any]:
    """``step`` chunk after chunk from ``state``: ``(outputs, final state)``.

    Each operand is ``(..., n, r, c)``, the chunk axis third from last (``None``: passed as
    ``None`` to every step; at least one is an array); each output of ``step`` is
    ``(..., r', c')`` and is returned stacked, ``(..., n, r', c')``. ``state`` must have the
    leading dimensions of every state ``step`` returns (the broadcast ones). A Python loop
    (one ``unstack`` per operand, one ``stack`` per output), or one scan where
    :func:`~polylin._backend.execution.scans_chunks`.
    """
    given = [x for x in operands if x is not None]
    where = [x is not None for x in operands]

    def fill(pieces: Sequence[Any]) -> list[Any]:
        it = iter(pieces)
        return [next(it) if present else None for present in where]

    if scans_chunks(xp, state):

        def one(S: Any, pieces: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
            return step(S, *fill(pieces))

        xs = tuple(xp.moveaxis(x, -3, 0) for x in given)
        state, stacked = scan(one, state, xs)
        return tuple(xp.moveaxis(y, 0, -3) for y in stacked), state
    results: list[tuple[Any, ...]] = []
    for pieces in zip(*(unstack(xp, x, axis=-3) for x in given)):
        state, outputs = step(state, *fill(pieces))
        results.append(outputs)
    return tuple(xp.stack(list(ys), axis=-3) for ys in zip(*results)), state


def chunk_prefix(
    xp: Any, increments: Any, decay: Any | None, state: Any, *, chained: bool
) -> tuple[Any, Any]:
    """States before each chunk and after the last: ``S_{n+1} = decay_n * S_n + U_n``.

    ``increments`` is ``(..., n, d_phi, d_v + 1)``, ``decay`` ``(..., n, 1 or d_phi, 1)`` or
    None (no decay). ``chained``: a Python chain over the chunks, one ``unstack`` in and one
    ``stack`` out (a block holds few chunks; one chunk's start is a view of ``state``), each
    link one :func:`~polylin._backend.ops.add_scaled` (PyTorch: one ``addcmul``); a decay is
    also chained where :func:`~polylin._backend.execution.chains_decay` (``torch.compile`` for
    the CPU), and is one ``lax.scan`` of that link where
    :func:`~polylin._backend.execution.scans_chunks` (``jax.jit`` for the CPU: the GLA
    gradient at 32 heads x 64, T = 2048 / 8192 in 0.85x / 0.80x the time of the scan below, and
    a shorter compile). Otherwise one ``cumulative_sum`` without decay, and with decay a scan of
    logarithmic depth over the chunk axis (Hillis-Steele on the pairs ``(decay, increment)``;
    every product of decays is <= 1).
    """
    if decay is not None and not chained and scans_chunks(xp, state):

        def link(S: Any, increment: Any, factor: Any) -> tuple[Any, tuple[Any]]:
            return add_scaled(xp, increment, factor, S), (S,)

        (before,), new_state = chunk_loop(xp, link, state, [increments, decay])
        return before, new_state
    if chained or (decay is not None and chains_decay(state)):
        running = [state]
        decays = [None] * increments.shape[-3] if decay is None else unstack(xp, decay, axis=-3)
        for increment, factor in zip(unstack(xp, increments, axis=-3), decays):
            if factor is None:
                running.append(running[-1] + increment)
            else:
                running.append(add_scaled(xp, increment, factor, running[-1]))
        new_state = running.pop()
        if len(running) == 1:  # a block of one chunk: its start as a view, not a copy
            return running[0][..., None, :, :], new_state
        return xp.stack(running, axis=-3), new_state
    if decay is None:
        prefix = cumulative_sum(xp, increments, axis=-3, include_initial=True)
        return prefix[..., :-1, :, :] + state[..., None, :, :], state + prefix[..., -1, :, :]
    # Prepend (1, S_0): the inclusive scan then yields every state, the final one last. The
    # increments may have fewer leading dimensions than the state (values shared by a group of
    # query heads): the state's are the broadcast ones.
    values = concat_leading(xp, [state[..., None, :, :], increments], axis=-3)
    factors = xp.concat([xp.ones_like(decay[..., :1, :, :]), decay], axis=-3)
    count = values.shape[-3]
    shift = 1
    while shift < count:
        values = values + factors * _shift_chunks(xp, values, shift, 0.0)
        if 2 * shift < count:
            factors = factors * _shift_chunks(xp, factors, shift, 1.0)
        shift *= 2
    return values[..., :-1, :, :], values[..., -1, :, :]


def chunk_reads(
    xp: Any, queries: Any, increments: Any, decay: Any | None, state: Any, *, chained: bool
) -> tuple[Any, Any]:
    """``queries_n @ S_n`` for the states before each chunk of :func:`chunk_prefix`
    (``queries`` ``(..., n, C, d_phi)``), and the state after the last chunk. A decay chained
    on PyTorch without a gradient to record writes each product as the chain runs
    (:func:`~polylin._backend.fused.fused_chain_reads`: no stacked states)."""
    if chained and decay is not None:
        fused = fused_chain_reads(queries, increments, decay, state)
        if fused is not None:
            return fused
    states, state = chunk_prefix(xp, increments, decay, state, chained=chained)
    return matmul(xp, queries, states), state


def _shift_chunks(xp: Any, x: Any, shift: int, fill: float) -> Any:
    """``x`` moved ``shift`` places along the chunk axis (-3), the first places ``fill``."""
    head = xp.full((*x.shape[:-3], shift, *x.shape[-2:]), fill, dtype=x.dtype, device=device(x))
    return xp.concat([head, x[..., :-shift, :, :]], axis=-3)
