"""PyTorch's fused loops: decoding steps and chains over chunks written as a few in-place
``addcmul``, ``bmm`` and ``baddbmm`` calls on flattened ``(n, rows, cols)`` states.

Each function returns ``None`` where it does not apply (another library, a gradient recorded
where it writes in place, operands that do not share the state's leading dimensions), and its
caller then runs the array-API form, which gives the same numbers (:mod:`polylin._backend.ops`
holds the single operations).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from .execution import records_gradient, torch_transforming
from .namespace import torch_module, torch_namespace_of

__all__ = [
    "StepRows",
    "fused_chain_reads",
    "fused_delta_chunks",
    "fused_delta_step",
    "fused_dplr_chunks",
    "fused_dplr_step",
    "fused_linear_step",
    "fused_step_rows",
]


class StepRows(NamedTuple):
    """What a prepared step's plan finds once about its per-token arrays
    (:func:`fused_step_rows`): the number of states, and whether an array broadcasts against
    their leading dimensions (keys shared by grouped heads, Mamba-2's ``B`` and ``C``)."""

    states: int
    broadcast: bool


def _token_rows(S: Any, *arrays: Any | None) -> tuple[int, tuple] | None:
    """``(n, arrays)`` where the fused steps below apply: ``S`` is a PyTorch tensor and every
    given per-token array has its leading dimensions (``n`` states, their product), or
    broadcasts to them outside autograd (:func:`_expanded`). ``None`` elsewhere."""
    if torch_namespace_of(S) is None:
        return None
    lead = S.shape[:-2]
    if all(x is None or x.shape[:-1] == lead for x in arrays):
        return math.prod(lead), arrays
    if not all(x is None or (x.ndim - 1 <= len(lead) and all(
        a in (1, b) for a, b in zip(reversed(x.shape[:-1]), reversed(lead))
    )) for x in arrays):  # fmt: skip
        return None
    return _expanded(S, arrays)


def _expanded(S: Any, arrays: tuple) -> tuple[int, tuple] | None:
    """``(n, arrays)`` with the per-token arrays that broadcast against the leading dimensions
    of ``S`` expanded to them (views: one token's vectors read per state), outside autograd;
    ``None`` under it (the expanded operands would be kept per group for the backward, and the
    array-API form runs)."""
    if S.requires_grad or any(x is not None and x.requires_grad for x in arrays):
        return None
    lead = S.shape[:-2]
    expanded = tuple(
        x if x is None or x.shape[:-1] == lead else x.expand(*lead, x.shape[-1]) for x in arrays
    )
    return math.prod(lead), expanded


def _rows(rows: StepRows | None, S: Any, *arrays: Any | None) -> tuple[int, tuple] | None:
    """:func:`_token_rows`, or what a plan found (``rows``) with only the expansion left."""
    if rows is None:
        return _token_rows(S, *arrays)
    if rows.broadcast:
        return _expanded(S, arrays)
    return rows.states, arrays


def _decayed(state: Any, decay: Any | None, n: int) -> tuple[Any, bool]:
    """``(diag(decay) state, whether that is a new tensor of the caller's own)`` for a flat
    ``(n, m, c)`` state and a decay ``(..., 1 or m)`` (``None``: no decay)."""
    if decay is None:
        return state, False
    return state * decay.reshape(n, -1, 1), True


def _add_outer_owned(state: Any, own: bool, x: Any, y: Any) -> Any:
    """``state + x y^T`` for ``x`` ``(n, m, 1)`` and ``y`` ``(n, 1, c)``: in place where
    ``state`` is a new tensor of the caller's own that autograd does not record (never an
    argument of polylin's caller), one ``addcmul`` otherwise."""
    if own and not state.requires_grad:
        return state.addcmul_(x, y)
    return torch_module().addcmul(state, x, y)


def fused_step_rows(x: Any, batch: tuple, *shapes: tuple) -> StepRows | None:
    """What the fused steps need to know about the per-token arrays, found once by a prepared
    step's plan instead of at every token: their :class:`StepRows` if ``x`` is a PyTorch tensor
    and every array's ``shape`` has the leading dimensions ``batch`` or broadcasts against them
    (the states' leading dimensions); else ``None``. Checking the broadcast at every token
    took 30 us against 5 us for equal shapes (Mamba-2's step, one thread)."""
    if torch_namespace_of(x) is None:
        return None
    lead = tuple(batch)
    if all(tuple(s[:-1]) == lead for s in shapes):
        return StepRows(math.prod(lead), False)
    if all(len(s) - 1 <= len(lead) and all(
        a in (1, b) for a, b in zip(reversed(s[:-1]), reversed(lead))
    ) for s in shapes):  # fmt: skip
        return StepRows(math.prod(lead), True)
    return None


def fused_delta_step(
    q: Any, k: Any, v: Any, beta: Any, decay: Any | None, S: Any, *,
    rows: StepRows | None = None,
) -> Any:
    """One token of the (gated) delta rule in four passes over the state, on PyTorch where every
    per-token array has the state's leading dimensions (a model's decoding step): ``(o, S_t)``
    with ``o = S_t^T q`` (unscaled), or ``None`` where this does not apply (the caller's
    array-API form runs; see :func:`~polylin._forms.delta.recurrent.delta_step`).

    The decay scales the state into a new tensor, one ``baddbmm`` gives ``v - S^T k`` (no
    prediction written out and subtracted), the rank-1 update adds to that new tensor in
    place and one ``bmm`` reads the output: 4 passes over the state where the array-API form
    makes 6, and 8 tensor calls instead of 15 (the 2 MiB state of 32 heads x 128 x 128, one
    thread, same process: 0.64x the time of the array-API form). ``rows``: what the caller has
    found (:func:`fused_step_rows`): not checked again."""
    found = _rows(rows, S, q, k, v, beta, decay)
    if found is None:
        return None
    n, (q, k, v, beta, decay) = found
    torch = torch_module()
    m, c = S.shape[-2:]
    state, own = _decayed(S.reshape(n, m, c), decay, n)
    error = torch.baddbmm(v.reshape(n, 1, c), k.reshape(n, 1, m), state, alpha=-1.0)
    state = _add_outer_owned(state, own, k.reshape(n, m, 1), error * beta.reshape(n, 1, 1))
    return torch.bmm(q.reshape(n, 1, m), state).reshape(v.shape), state.reshape(S.shape)


def fused_delta_chunks(
    S: Any, T: Any, BV: Any, R: Any, K: Any, decay: Any | None, Q: Any, P: Any
) -> tuple[list[Any], Any] | None:
    """The delta rule's loop over N chunks with each chunk's read-out inside it, on PyTorch where
    every operand has the state's leading dimensions: per chunk ``W = T (BV + R S)``,
    ``O = Q S + P W`` and ``S' = decay * S + K W`` (operands ``(..., N, rows, cols)``, ``K`` the
    keys transposed, ``decay`` ``(..., N, 1 or d_k, 1)`` or None). Returns each chunk's output
    ``(..., 1, C, d_v)`` and the final state, or ``None`` where this does not apply (the
    array-API loop runs: :func:`polylin._forms.delta.chunked._block`).

    Flattened to three dimensions once, a chunk is two ``bmm`` and three ``baddbmm`` (two of
    them in place into the fresh read-out and the decayed state, outside ``torch.func``
    transforms): the array-API loop's wrappers and four-dimensional views cost as much again
    at small heads (eight chunks of 32 at 16 heads x 64, one thread: 0.71x its time; at
    32 x 128 the same time). Without a gradient to record, the state after the first chunk is
    the loop's own and every later chunk updates it in place (:func:`_owned_states`)."""
    lead = tuple(S.shape[:-2])
    given = [T, BV, R, K, Q, P] + ([] if decay is None else [decay])
    if torch_namespace_of(S) is None or any(tuple(x.shape[:-3]) != lead for x in given):
        return None
    torch = torch_module()
    n = math.prod(lead)
    chunks = [x.reshape(n, *x.shape[-3:]).unbind(1) for x in given]
    decays = chunks[6] if decay is not None else [None] * len(chunks[0])
    in_place = not torch_transforming(S)
    owned = _owned_states(in_place, S, *given)
    state = S.reshape(n, *S.shape[-2:])
    outputs = []
    for T_n, BV_n, R_n, K_n, Q_n, P_n, decay_n, own in zip(*chunks[:6], decays, owned):
        W = torch.bmm(T_n, torch.baddbmm(BV_n, R_n, state))
        read = torch.bmm(Q_n, state)
        out = read.baddbmm_(P_n, W) if in_place else torch.baddbmm(read, P_n, W)
        outputs.append(out.reshape(*lead, 1, *out.shape[-2:]))
        if own:
            (state if decay_n is None else state.mul_(decay_n)).baddbmm_(K_n, W)
        elif decay_n is None:
            state = torch.baddbmm(state, K_n, W)
        elif in_place:
            state = (state * decay_n).baddbmm_(K_n, W)
        else:
            state = torch.baddbmm(state * decay_n, K_n, W)
    return outputs, state.reshape(S.shape)


def _owned_states(in_place: bool, S: Any, *operands: Any) -> Iterator[bool]:
    """Per chunk of a fused loop over chunks, whether its state update may write into the state
    in place: from the second chunk on, where ``in_place`` (no ``torch.func`` transform) and no
    gradient is recorded. The first chunk's update makes a fresh state from the caller's
    (which is never written); each later one rewrites it: no state-sized allocation per chunk
    (2 MiB at 32 heads x 128), which glibc's allocator otherwise maps and unmaps afresh (a page
    fault per 4 KiB) when a call's temporaries outgrow its thresholds."""
    own = in_place and not records_gradient(S, *operands)
    yield False
    while True:
        yield own


def fused_chain_reads(Q: Any, U: Any, decay: Any, S: Any) -> tuple[Any, Any] | None:
    """Linear attention's chain of states with each chunk's read-out written as it runs, on
    PyTorch where no gradient is recorded and every operand has the state's leading
    dimensions: ``Q_n S_n`` for ``S_{n+1} = decay_n * S_n + U_n`` (``Q`` ``(..., N, C, r)``,
    ``U`` ``(..., N, r, c)``, ``decay`` ``(..., N, 1 or r, 1 or c)``, ``S`` ``(..., r, c)``),
    ``(..., N, C, c)``, and the state after the last chunk; ``None`` where this does not apply
    (:func:`polylin._forms.common.prefix.chunk_reads` stacks the states and multiplies once).

    Each product goes into its slot of one fresh array instead of every state being stacked
    for one batched product: Mamba-2's chain of five chunks at 48 heads x 64 as columns, state
    128, in 0.85x the time on one and two threads. (Chunk-major slots, contiguous whatever the
    leading dimensions, made the rest of a batch of two slower: 1.01-1.03x the whole call
    against 0.92-0.98x.)"""
    lead = tuple(S.shape[:-2])
    if (torch_namespace_of(S) is None or records_gradient(Q, U, decay, S)
            or torch_transforming(S) or any(tuple(x.shape[:-3]) != lead for x in (Q, U, decay))):
        return None  # fmt: skip
    torch = torch_module()
    m, (n, rows), columns = math.prod(lead), Q.shape[-3:-1], S.shape[-1]
    out = torch.empty((m, n, rows, columns), dtype=torch.result_type(Q, S), device=S.device)
    queries, increments, decays = (x.reshape(m, n, *x.shape[-2:]).unbind(1) for x in (Q, U, decay))
    state = S.reshape(m, *S.shape[-2:])
    owned = _owned_states(True, S)  # the state rewritten in place from the second chunk on
    for slot, Q_n, U_n, decay_n, own in zip(out.unbind(1), queries, increments, decays, owned):
        torch.bmm(Q_n, state, out=slot)
        state = torch.addcmul(U_n, decay_n, state, out=state if own else None)
    return out.reshape(*lead, n, rows, columns), state.reshape(S.shape)


def fused_dplr_chunks(
    S: Any, U: Any, W: Any, B: Any, K: Any, decay: Any | None, Q: Any, QK: Any, V: Any, QB: Any
) -> tuple[Any, Any] | None:
    """The generalized delta rule's loop over N chunks with each chunk's read-out inside it, on
    PyTorch where every operand has the state's leading dimensions: per chunk the reads
    ``R = U + W S``, the outputs ``O = QK V + Q S + QB R`` and ``S' = decay * S + K + B R``
    (operands ``(..., N, rows, cols)``: ``QK V`` the outputs' intra-chunk part, ``B`` the decayed
    ``b`` keys transposed, ``K`` the increment ``K^T V``; ``decay`` ``(..., N, 1 or d_k, 1)`` or
    None). Returns the outputs ``(..., N, C, d_v)`` and the final state, or ``None`` where this
    does not apply (the batched read-out runs: :func:`polylin._forms.dplr.chunked._chunks`,
    which calls this where no gradient is recorded).

    Flattened to three dimensions once, a chunk is three ``baddbmm`` (one in place into the
    read-out), one in-place ``baddbmm_`` into the ``addcmul`` of decay and increment, and no
    state is stacked: the batched read-out keeps every chunk's state and reads, ``d_k x d_v``
    and ``C x d_v`` per chunk, for its products after the loop."""
    lead = tuple(S.shape[:-2])
    given = [U, W, B, K, Q, QK, QB] + ([] if decay is None else [decay])
    if torch_namespace_of(S) is None or any(tuple(x.shape[:-3]) != lead for x in [*given, V]):
        return None
    torch = torch_module()
    given[5] = torch.matmul(QK, V)  # the intra-chunk part of the outputs, for all chunks
    n = math.prod(lead)
    chunks = [x.reshape(n, *x.shape[-3:]).unbind(1) for x in given]
    decays = chunks[7] if decay is not None else [None] * len(chunks[0])
    state = S.reshape(n, *S.shape[-2:])
    outputs = []
    owned = _owned_states(not torch_transforming(S), S, *given)
    for U_n, W_n, B_n, K_n, Q_n, QV_n, QB_n, decay_n, own in zip(*chunks[:7], decays, owned):
        R = torch.baddbmm(U_n, W_n, state)
        outputs.append(torch.baddbmm(QV_n, Q_n, state).baddbmm_(QB_n, R))
        into = state if own else None  # the state rewritten in place from the second chunk on
        if decay_n is None:
            kept = torch.add(state, K_n, out=into)
        else:
            kept = torch.addcmul(K_n, decay_n, state, out=into)
        state = kept.baddbmm_(B_n, R)
    out = torch.stack(outputs, dim=1)
    return out.reshape(*lead, *out.shape[1:]), state.reshape(S.shape)


def fused_linear_step(
    fq: Any, fk: Any, v: Any, decay: Any | None, S: Any, z: Any, *,
    rows: StepRows | None = None,
) -> Any:
    """One token of (decayed) linear attention on PyTorch where every per-token array has the
    state's leading dimensions: ``(S_t^T fq, S_t, z_t)``, or ``None`` where this does not
    apply (see :func:`~polylin._forms.linear.recurrent.recurrent_step`). The decayed state
    is a new tensor that the rank-1 update adds to in place, and ``z_t = decay z + fk`` is one
    ``addcmul``: 3 passes over the state and 6 tensor calls where the array-API form makes 4
    and 11. ``rows``: as for :func:`fused_delta_step`."""
    found = _rows(rows, S, fq, fk, v, decay)
    if found is None or z.shape != S.shape[:-1]:
        return None
    n, (fq, fk, v, decay) = found
    torch = torch_module()
    m, c = S.shape[-2:]
    state, own = _decayed(S.reshape(n, m, c), decay, n)
    state = _add_outer_owned(state, own, fk.reshape(n, m, 1), v.reshape(n, 1, c))
    z = z + fk if decay is None else torch.addcmul(fk, decay, z)
    out = torch.bmm(fq.reshape(n, 1, m), state).reshape(v.shape)
    return out, state.reshape(S.shape), z


def fused_dplr_step(
    q: Any, k: Any, v: Any, a: Any, b: Any, decay: Any | None, S: Any, *,
    rows: StepRows | None = None,
) -> Any:
    """One token of the generalized delta rule on PyTorch where every per-token array has the
    state's leading dimensions: ``(S_t^T q, S_t)``, or ``None`` where this does not apply (see
    :func:`~polylin._forms.dplr.recurrent.dplr_step`). The decayed state is a new tensor that
    both rank-1 updates add to in place. ``rows``: as for :func:`fused_delta_step`."""
    found = _rows(rows, S, q, k, v, a, b, decay)
    if found is None:
        return None
    n, (q, k, v, a, b, decay) = found
    torch = torch_module()
    m, c = S.shape[-2:]
    flat = S.reshape(n, m, c)
    read = torch.bmm(a.reshape(n, 1, m), flat)  # a^T S_{t-1}, before the decay
    state, own = _decayed(flat, decay, n)
    state = _add_outer_owned(state, own, b.reshape(n, m, 1), read)
    state = _add_outer_owned(state, True, k.reshape(n, m, 1), v.reshape(n, 1, c))
    return torch.bmm(q.reshape(n, 1, m), state).reshape(v.shape), state.reshape(S.shape)
