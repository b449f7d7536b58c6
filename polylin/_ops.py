"""Small array helpers that the array API standard does not provide."""

from __future__ import annotations

import math
from typing import Any

from ._policy import add_matmul, device, unstack, vector_times_matrix

__all__ = [
    "broadcast_shape",
    "causal_mask",
    "concat_leading",
    "dense",
    "l2_normalize",
    "matmul",
    "matmul_add",
    "pad_rows",
    "read_state",
    "split_rows",
    "stack_leading",
    "widens",
]


def broadcast_shape(*shapes: tuple) -> tuple:
    """The broadcast shape of ``shapes`` (aligned from the right, a size of 1 stretches).

    A ``ValueError`` saying which axis does not broadcast otherwise. Only shapes are combined:
    grouped heads (``q, k`` of ``(B, H, 1, T, d)`` against ``v`` of ``(B, H, G, T, d)``) are
    never copied per group.
    """
    rank = max([0, *(len(s) for s in shapes)])  # no default=: torch.compile cannot trace it
    result: list[int] = []
    for axis in range(-rank, 0):
        sizes = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(sizes) > 1:
            raise ValueError(
                f"axis {axis} has sizes {sorted(sizes)}; each must equal the others or be 1"
            )
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def matmul(xp: Any, a: Any, b: Any) -> Any:
    """``xp.matmul(a, b)`` for leading dimensions that broadcast, without expanding either.

    PyTorch's ``matmul`` expands both operands to the broadcast batch and copies the one with
    size-1 axes (and keeps that copy for the backward): for a query shared by ``G`` grouped
    heads, a copy of the query per group. Here an axis along which only ``b`` varies becomes
    more columns of ``b`` and an axis along which only ``a`` varies more rows of ``a``, so one
    matmul over the shared axes computes every group from the one shared operand (its gradient
    sums over the groups inside the matrix product); the permutes copy at most the operand
    that already has those axes. Equal leading dimensions go straight to the ``@`` operator
    (the library's own matmul: array-api-compat's wrapper costs a decoding step ~7 us a call).
    """
    lead_a, lead_b = tuple(a.shape[:-2]), tuple(b.shape[:-2])
    if lead_a == lead_b:
        return a @ b  # the standard's operator: array-api-compat's xp.matmul adds a call
    rank = max(len(lead_a), len(lead_b))
    lead_a, lead_b = (1,) * (rank - len(lead_a)) + lead_a, (1,) * (rank - len(lead_b)) + lead_b
    a_only = [i for i in range(rank) if lead_a[i] != 1 and lead_b[i] == 1]
    b_only = [i for i in range(rank) if lead_b[i] != 1 and lead_a[i] == 1]
    if not a_only and not b_only:  # only missing leading axes: nothing is expanded
        return a @ b
    shared = [i for i in range(rank) if i not in a_only and i not in b_only]
    rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    sizes = [max(x, y) for x, y in zip(lead_a, lead_b)]
    common = [sizes[i] for i in shared]
    a_sizes, b_sizes = [sizes[i] for i in a_only], [sizes[i] for i in b_only]
    a = xp.reshape(a, (*lead_a, rows, inner))
    a = xp.permute_dims(a, (*shared, *b_only, *a_only, rank, rank + 1))
    a = xp.reshape(a, (*common, math.prod(a_sizes) * rows, inner))
    b = xp.reshape(b, (*lead_b, inner, cols))
    b = xp.permute_dims(b, (*shared, *a_only, rank, *b_only, rank + 1))
    b = xp.reshape(b, (*common, inner, math.prod(b_sizes) * cols))
    out = xp.reshape(a @ b, (*common, *a_sizes, rows, *b_sizes, cols))
    order: list[Any] = [*shared, *a_only, "rows", *b_only, "cols"]
    return xp.permute_dims(out, tuple(order.index(i) for i in (*range(rank), "rows", "cols")))


def read_state(xp: Any, x: Any, S: Any) -> Any:
    """``S^T x``: the vector ``x`` ``(..., m)`` read through the state ``S`` ``(..., m, n)``.

    ``x`` may broadcast against the leading dimensions of ``S`` (grouped heads): then the
    product is a sum of ``x * S``, which keeps ``x`` itself for the backward (a broadcast
    matmul would keep a copy of ``x`` per group, :func:`matmul` a permuted copy of ``S``).
    """
    if x.shape[:-1] != S.shape[:-2]:
        return xp.sum(x[..., :, None] * S, axis=-2)
    return vector_times_matrix(xp, x, S)


def dense(xp: Any, x: Any) -> Any:
    """``x`` with its elements in row-major order: a copy only if it is a strided view.

    A block cut from a longer sequence (one ``unstack`` along a middle axis) is such a view:
    PyTorch's batched matmul flattens the leading dimensions and would copy it at every use.
    Never pass a broadcast view (the copy would materialize the broadcast).
    """
    return xp.reshape(xp.reshape(x, (-1,)), x.shape)


def matmul_add(xp: Any, c: Any, a: Any, b: Any) -> Any:
    """``c + a @ b`` (leading dimensions broadcast, as in :func:`matmul`): one fused operation
    where the three have the same leading dimensions (:func:`polylin._policy.add_matmul`)."""
    if len(c.shape) > 2 and tuple(c.shape[:-2]) == tuple(a.shape[:-2]) == tuple(b.shape[:-2]):
        return add_matmul(xp, c, a, b)
    return c + matmul(xp, a, b)


def widens(x: Any, y: Any) -> bool:
    """Whether ``x * y`` would be larger than ``x`` (``y`` broadcasts ``x``'s leading axes):
    a gate of grouped heads times a query shared by the group would copy it per group."""
    return broadcast_shape(tuple(x.shape), tuple(y.shape)) != tuple(x.shape)


def concat_leading(xp: Any, arrays: list[Any], axis: int) -> Any:
    """``concat`` along ``axis`` (negative) of arrays whose other axes broadcast.

    The sum of the keys of a grouped call has the keys' leading dimensions while the state
    increments have the broadcast ones; the smaller operand is broadcast (a view) into the
    result, which ``concat`` writes anyway. Arrays of one shape but on ``axis`` go straight in.
    """
    others = [x.shape[:axis] + x.shape[axis % x.ndim + 1 :] for x in arrays]
    if all(o == others[0] for o in others):
        return xp.concat(arrays, axis=axis)
    shape = broadcast_shape(*others)
    cut = len(shape) + axis + 1  # where the concatenated axis goes back in
    return xp.concat(
        [xp.broadcast_to(x, (*shape[:cut], x.shape[axis], *shape[cut:])) for x in arrays],
        axis=axis,
    )


def stack_leading(xp: Any, arrays: list[Any], axis: int) -> Any:
    """``stack`` of arrays whose shapes broadcast (to the broadcast shape)."""
    shapes = [tuple(x.shape) for x in arrays]
    if any(s != shapes[0] for s in shapes):
        shape = broadcast_shape(*shapes)
        arrays = [xp.broadcast_to(x, shape) for x in arrays]
    return xp.stack(arrays, axis=axis)


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
