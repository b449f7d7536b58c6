"""Packed variable-length sequences (``cu_seqlens``) as a padded, masked batch.

The sequences are cut out of the packed sequence axis with Python-int slices, zero-padded to the
longest one, stacked on a new batch axis and run with a right-padding mask: masked keys add
nothing to a state, so each padded row computes exactly its own sequence, and its final state is
the state after its last real token. The outputs are cut back out and concatenated. Every shape
is known from the offsets alone, so lazy backends (Dask, JAX under jit) build the graph without
looking at data; the cost is that of a batch of ``N`` sequences of the longest length.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from ._ops import pad_rows

__all__ = ["check_cu_seqlens", "length_mask", "pack", "unpack"]


def check_cu_seqlens(cu_seqlens: Sequence[int], total: int) -> list[int]:
    """Validate offsets ``[0, l1, l1 + l2, ..., total]`` and return them as a list of ints."""
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise TypeError(
            "cu_seqlens must be a sequence of Python ints [0, l1, l1+l2, ...], "
            f"got {type(cu_seqlens).__name__}"
        )
    offsets = list(cu_seqlens)
    if not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise TypeError("cu_seqlens must contain Python ints only")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the sequence length {total}, got {offsets}"
        )
    if any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return offsets


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
