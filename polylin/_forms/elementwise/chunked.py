"""The chunked form of the elementwise linear recurrence: a scan in two levels, O(T D) work.

``h_t = exp(g_t) * h_{t-1} + x_t`` has a state of one number per channel, so there is no matrix
product to gain from a chunked attention form: its C x C decayed scores per channel cost
``C`` times the scan's work. This form is the selective scan's two-level scan
(``_forms.common.scan``) with a state axis of size 1:

1. Per chunk of L tokens, in closed form: the state it adds from zero,
   ``E = sum_l exp(sum_{r > l} g_r) x_l``, and its decay ``exp(sum_l g_l)``; exponents are sums
   of terms ``<= 0`` (every factor in ``[0, 1]``; ``-inf`` stays an exact reset).
2. The states at the chunk starts: one step per chunk (:func:`~..common.scan.chunk_starts`).
3. Every chunk from its start, all chunks at once: one step per position in the chunk over
   arrays of ``(..., T / L, D)``.

About ``L + T / L`` steps (``2 sqrt(T)`` at the default L) instead of T.
"""

from __future__ import annotations

from typing import Any

from ..._backend.namespace import device
from ..._backend.ops import pad_rows, unstack
from ..common.scan import chunk_starts, sum_after
from .recurrent import scan_step

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
    X, G = (xp.reshape(a, (*a.shape[:-2], n_chunks, length, channels)) for a in (x, g))
    # 1. What each chunk adds from zero, and its decay.
    added = xp.sum(xp.exp(sum_after(xp, G, axis=-2)) * X, axis=-2)  # (..., n, D)
    chunk_decay = xp.exp(xp.sum(G, axis=-2))
    # 2. The state at the start of every chunk.
    state, final = chunk_starts(xp, chunk_decay, added, h, axis=-2)  # (..., n, D)
    # 3. Every chunk from its start state, one position at a time.
    outputs = []
    for x_l, g_l in zip(unstack(xp, X, axis=-2), unstack(xp, G, axis=-2)):
        state = scan_step(xp, x_l, g_l, state)
        outputs.append(state)
    y = xp.reshape(xp.stack(outputs, axis=-2), (*X.shape[:-3], padded, channels))
    return (y if padded == T else y[..., :T, :]), final
