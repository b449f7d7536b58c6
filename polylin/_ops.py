"""Small array helpers that the array API standard does not provide."""

from __future__ import annotations

from typing import Any

from ._policy import device, unstack

__all__ = ["causal_mask", "l2_normalize", "pad_rows", "split_rows"]


def causal_mask(xp: Any, rows: int, cols: int, dev: Any, *, strict: bool = False) -> Any:
    """Boolean ``(rows, cols)``, True where row i may attend to column j: ``j <= i``.

    The standard has no ``tril``; a comparison of two ``arange`` vectors builds it. With
    ``strict`` the diagonal is excluded (``j < i``). Algorithms select with it
    (``where(mask, x, 0)``), never multiply: a masked score may be infinite.
    """
    i = xp.arange(rows, device=dev)[:, None]
    j = xp.arange(cols, device=dev)[None, :]
    return j < i if strict else j <= i


def pad_rows(xp: Any, x: Any, pad: int) -> Any:
    """Zero-pad ``x`` along the sequence axis (-2) by ``pad`` rows at the end."""
    if pad == 0:
        return x
    zeros = xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype, device=device(x))
    return xp.concat([x, zeros], axis=-2)


def split_rows(xp: Any, x: Any | None, size: int, length: int) -> list[Any]:
    """Cut ``x`` along the sequence axis (-2) into pieces of ``size`` rows (the last shorter).

    One reshape and one ``unstack`` cut the whole pieces, one slice takes the remainder: autograd
    sees at most two slicing operations whatever the number of pieces (a slice per piece would
    allocate and zero a gradient of the whole input per piece, quadratic in the length). ``None``
    and arrays that broadcast along the sequence axis (size 1 there) are repeated.
    """
    count = -(-length // size) if length else 1
    if x is None or x.shape[-2] == 1 or count == 1:
        return [x] * count
    whole = length // size
    *lead, _, width = x.shape
    main = x if whole * size == length else x[..., : whole * size, :]
    pieces = list(unstack(xp, xp.reshape(main, (*lead, whole, size, width)), axis=-3))
    if whole * size != length:
        pieces.append(x[..., whole * size :, :])
    return pieces


def l2_normalize(xp: Any, x: Any, /, *, eps: float = 1e-6) -> Any:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (flash-linear-attention's ``l2norm``).

    Differentiable everywhere (``eps`` keeps a zero vector's gradient finite); a zero vector
    stays zero.
    """
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + eps)
