"""The chunked form of the elementwise linear recurrence: a scan in two levels, O(T D) work.

``h_t = exp(g_t) * h_{t-1} + x_t`` has a state of one number per channel, so there is no matrix
product to gain from a chunked attention form: its C x C decayed weights per channel cost
``C`` times the scan's work. This form is the two-level scan that the selective scan uses
(``_forms.common.scan``), with a state as large as one token's input:

1. Every chunk of L tokens from a zero state, all chunks at once: one step per position in the
   chunk over arrays of ``(..., T / L, D)``, keeping the local states ``y0_l`` and the running
   products of the decay factors ``P_l = a_l ... a_1`` (``a = exp(g)`` in ``[0, 1]``). The last
   position gives what each chunk adds from zero and its decay. (The selective scan computes
   these two in closed form instead, contracting its state axis on the way; here there is no
   axis to contract and the local scan costs less than a closed form.)
2. The states at the chunk starts ``H_c``: one step per chunk
   (:func:`~polylin._forms.common.scan.chunk_starts`).
3. ``y = y0 + P * H_c``, one broadcast over every token.

About ``L + T / L`` steps (``2 sqrt(T)`` at the default L) instead of T. Every factor is a
product of per-token factors in ``[0, 1]`` (never the exponential of a difference), and
``g = -inf`` makes ``a = 0``: an exact reset.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import pad_rows, unstack
from ..common.scan import chunk_starts

__all__ = ["scan_chunked"]


def scan_chunked(xp: Any, x: Any, g: Any, h: Any, *, chunk_size: int) -> tuple[Any, Any]:
    """The recurrence in chunks of ``chunk_size`` tokens from ``h``: ``x``, ``g`` ``(..., T, D)``
    (``g <= 0``), ``h`` ``(..., D)``; returns ``(y, h)`` as
    :func:`~polylin._forms.elementwise.recurrent.scan_recurrent`.

    A last partial chunk is padded with ``x = 0, g = 0`` tokens (nothing added, no decay)
    whose outputs are dropped.
    """
    T, channels = x.shape[-2], x.shape[-1]
    if T == 0:
        return xp.zeros((*h.shape[:-1], 0, channels), dtype=h.dtype, device=device(h)), h
    length = min(chunk_size, T)
    n_chunks = -(-T // length)
    padded = n_chunks * length
    if padded != T:
        x, g = pad_rows(xp, x, padded - T), pad_rows(xp, g, padded - T)
    X, A = (xp.reshape(a, (*a.shape[:-2], n_chunks, length, channels)) for a in (x, xp.exp(g)))
    # 1. Every chunk from zero: the local states and the running decay products.
    local: list[Any] = []
    decay: list[Any] = []
    for x_l, a_l in zip(unstack(xp, X, axis=-2), unstack(xp, A, axis=-2)):
        local.append(x_l if not local else a_l * local[-1] + x_l)
        decay.append(a_l if not decay else a_l * decay[-1])
    # 2. The state at the start of every chunk.
    starts, final = chunk_starts(xp, decay[-1], local[-1], h, axis=-2)  # (..., n, D)
    # 3. Each token's state: its local state and its chunk's start, decayed.
    y = xp.stack(local, axis=-2) + xp.stack(decay, axis=-2) * starts[..., None, :]
    y = xp.reshape(y, (*X.shape[:-3], padded, channels))
    return (y if padded == T else y[..., :T, :]), final
