"""Packed variable-length sequences (``cu_seqlens``) as a padded, masked batch.

The sequences are cut out of the packed sequence axis with Python-int slices, zero-padded to the
longest one, stacked on a new batch axis and run with a right-padding mask: masked keys add
nothing to a state, so each padded row computes exactly its own sequence, and its final state is
the state after its last real token. The outputs are cut back out and concatenated. Every shape
is known from the offsets alone, so lazy backends (Dask, JAX under jit) build the graph without
looking at data; the cost is that of a batch of ``N`` sequences of the longest length.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from .._backend.ops import pad_rows

__all__ = ["length_mask", "pack", "unpack"]


def _spans(offsets: list[int]) -> list[tuple[int, int]]:
    return list(pairwise(offsets))


def pack(xp: Any, x: Any, offsets: list[int], max_len: int) -> Any:
    """``(..., T, d)`` packed -> ``(..., N, max_len, d)`` zero-padded."""
    pieces = [pad_rows(xp, x[..., a:b, :], max_len - (b - a)) for a, b in _spans(offsets)]
    return xp.stack(pieces, axis=-3)


def unpack(xp: Any, y: Any, offsets: list[int]) -> Any:
    """``(..., N, max_len, d)`` padded -> ``(..., T, d)`` packed."""
    pieces = [y[..., i, : b - a, :] for i, (a, b) in enumerate(_spans(offsets))]
    return xp.concat(pieces, axis=-2)


def length_mask(xp: Any, offsets: list[int], max_len: int, dev: Any) -> Any:
    """Boolean ``(N, max_len)``: True where a padded row holds a real token."""
    # Compared with Python ints rather than an array of lengths: building that array would be a
    # blocking host-to-device copy on a GPU (flagged by tests/test_gpu_device.py).
    positions = xp.arange(max_len, device=dev)
    return xp.stack([positions < (b - a) for a, b in _spans(offsets)], axis=0)
