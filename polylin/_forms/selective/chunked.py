"""The chunked form of the selective scan: a scan in two levels, O(T D N) work.

The decay of Mamba-1 varies along the channel ``d`` *and* the state index ``n``, and each
channel carries one value: read as linear attention, every channel is a head with key size N
and value size 1. A chunked attention form would build C x C decayed scores per channel,
``D C^2 N`` products per chunk against the scan's ``D C N``, and its matrix products have one
column. So this form stays a scan (``docs/selective_scan.md``) and only removes the per-token
Python steps:

1. Per chunk of L tokens, in closed form (no loop): the state a chunk adds from zero,
   ``E[d, n] = sum_l exp(A[d, n] a_l[d]) dt_l[d] x_l[d] B_l[n]`` (``a_l`` the sum of ``dt``
   after l in the chunk), and its decay ``exp(A[d, n] sum_l dt_l[d])``. Both exponents are
   sums of terms of one sign times ``A <= 0``: every factor is in ``[0, 1]``, none is the
   exponential of a difference.
2. The states at the chunk starts: ``H_{c+1} = decay_c H_c + E_c``, one step per chunk.
3. Every chunk's L tokens from its start state, all chunks at once: one step per position
   in the chunk, each an update of ``(..., chunks, D, N)``, the output read in the step.

So T tokens cost about ``L + T / L`` steps over arrays of ``T / L`` tokens instead of T steps
over one; autograd sees the same few operations.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import matmul, pad_rows, unstack
from ..common.scan import chunk_starts, sum_after

__all__ = ["selective_chunked"]


def selective_chunked(
    xp: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, h: Any, *, chunk_size: int
) -> tuple[Any, Any]:
    """The selective scan in chunks of ``chunk_size`` tokens from the state ``h``: ``x``,
    ``dt`` ``(..., T, D)`` (``dt >= 0``), ``A`` ``(..., D, N)`` (``<= 0``), ``B``, ``C``
    ``(..., T, N)``, ``h`` ``(..., D, N)``; returns ``(y, h)``, ``y`` ``(..., T, D)``.

    A last partial chunk is padded with ``dt = 0`` tokens (decay 1, nothing added) whose
    outputs are dropped.
    """
    T, channels = x.shape[-2], x.shape[-1]
    if T == 0:
        return xp.zeros((*h.shape[:-2], 0, channels), dtype=h.dtype, device=device(h)), h
    length = min(chunk_size, T)
    n_chunks = -(-T // length)
    padded = n_chunks * length
    if padded != T:
        x, dt, B, C = (pad_rows(xp, a, padded - T) for a in (x, dt, B, C))
    X, DT, Bc, Cc = (
        xp.reshape(a, (*a.shape[:-2], n_chunks, length, a.shape[-1])) for a in (x, dt, B, C)
    )
    U = DT * X  # (..., n, L, D): what each token writes, before B
    per_chunk = A[..., None, :, :]  # (..., 1, D, N) against (..., n, D, N)
    # 1. What each chunk adds from zero, and its decay.
    after = sum_after(xp, DT)  # (..., n, L, D)
    weights = xp.exp(after[..., None] * A[..., None, None, :, :]) * U[..., None]
    added = xp.sum(weights * Bc[..., :, None, :], axis=-3)  # (..., n, D, N)
    chunk_decay = xp.exp(xp.sum(DT, axis=-2)[..., None] * per_chunk)
    # 2. The state at the start of every chunk.
    state, final = chunk_starts(xp, chunk_decay, added, h, axis=-3)  # (..., n, D, N)
    # 3. Every chunk from its start state, one position at a time.
    outputs = []
    for dt_l, u_l, B_l, C_l in zip(*(unstack(xp, a, axis=-2) for a in (DT, U, Bc, Cc))):
        state = xp.exp(dt_l[..., None] * per_chunk) * state + u_l[..., None] * B_l[..., None, :]
        outputs.append(matmul(xp, state, C_l[..., :, None])[..., 0])
    y = xp.stack(outputs, axis=-2)  # (..., n, L, D)
    y = xp.reshape(y, (*y.shape[:-3], padded, channels))
    return (y if padded == T else y[..., :T, :]), final
