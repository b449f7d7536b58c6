"""Small array helpers that the array API standard does not provide."""

from __future__ import annotations

from typing import Any

from array_api_compat import device

__all__ = ["causal_mask", "pad_rows"]


def causal_mask(xp: Any, rows: int, cols: int, dtype: Any, dev: Any) -> Any:
    """``(rows, cols)`` lower-triangular ones (diagonal included), in ``dtype`` (bool for None).

    Row i may attend to columns ``j <= i``. The standard has no ``tril``; a comparison of two
    ``arange`` vectors builds it.
    """
    i = xp.arange(rows, device=dev)[:, None]
    j = xp.arange(cols, device=dev)[None, :]
    return j <= i if dtype is None else xp.astype(j <= i, dtype)


def pad_rows(xp: Any, x: Any, pad: int) -> Any:
    """Zero-pad ``x`` along the sequence axis (-2) by ``pad`` rows at the end."""
    if pad == 0:
        return x
    zeros = xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype, device=device(x))
    return xp.concat([x, zeros], axis=-2)
