"""The two-level scan of a diagonal recurrence ``h_t = decay_t * h_{t-1} + added_t``.

Shared by the selective scan (a state per channel and state index) and the elementwise linear
recurrence (a state per channel): both cut T tokens into chunks, compute in closed form what
each chunk adds from zero and by how much it decays, run one step per chunk for the chunk
starts (:func:`chunk_starts`), then every chunk from its start at once. The closed forms weigh
each token by ``exp`` of the sum of the log decays *after* it in its chunk (:func:`sum_after`):
sums of terms of one sign, never differences of cumulative sums, so every factor is in
``[0, 1]`` and a ``-inf`` log decay is an exact reset.
"""

from __future__ import annotations

import math
from typing import Any

from ..._backend.ops import cumulative_sum, unstack

__all__ = ["chunk_starts", "default_scan_chunk", "sum_after"]


def default_scan_chunk(length: int) -> int:
    """The default chunk of a two-level scan of ``length`` tokens: about ``sqrt(T)`` (a power
    of two in [16, 256]), so that the scan takes about ``2 sqrt(T)`` steps."""
    return min(256, max(16, 1 << round(math.log2(max(length, 1)) / 2)))


def sum_after(xp: Any, x: Any, *, axis: int = -2) -> Any:
    """``sum_{r > l} x_r`` along ``axis`` (negative; the positions within a chunk): a reversed
    exclusive cumulative sum (of terms of one sign: no cancellation, ``-inf`` stays ``-inf``
    for the positions before it and never meets ``+inf``)."""
    flipped = cumulative_sum(xp, xp.flip(x, axis=axis), axis=axis, include_initial=True)
    index = (Ellipsis, slice(None, -1)) + (slice(None),) * (-axis - 1)
    return xp.flip(flipped[index], axis=axis)


def chunk_starts(xp: Any, decay: Any, added: Any, h: Any, *, axis: int) -> tuple[Any, Any]:
    """The state at the start of every chunk and after the last one.

    ``decay`` and ``added`` have the chunk axis at ``axis`` (negative), the state's axes after
    it; ``h`` is the state before the first chunk. Returns ``(starts, final)``: ``starts``
    stacked at ``axis`` (the state before each chunk), ``final`` the state after the last.
    One step per chunk: ``H_{c+1} = decay_c * H_c + added_c``.
    """
    starts = [h]
    for factor, increment in zip(unstack(xp, decay, axis=axis), unstack(xp, added, axis=axis)):
        starts.append(factor * starts[-1] + increment)
    final = starts.pop()
    return xp.stack(starts, axis=axis), final
