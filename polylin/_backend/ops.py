"""Array operations the standard lacks or a library computes faster, one name per operation.

Each function is the array-API form, with the library's own kernel where it has a faster or
leaner one (PyTorch's ``baddbmm``, ``addcmul``, ``tril``, ``solve_triangular``; XLA's
``triangular_solve`` under ``jax.jit``). The rest of the
core calls these instead of deciding by library itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from . import torch_autograd
from .execution import compiling, scans_tokens, torch_transforming
from .namespace import (
    JAX_NAMESPACES,
    device,
    is_numpy_array,
    library_name,
    torch_module,
    torch_namespace_of,
)

__all__ = [
    "add_matmul",
    "add_outer",
    "broadcast_shape",
    "causal_mask",
    "concat_leading",
    "cumulative_sum",
    "dense",
    "keep_lower",
    "l2_normalize",
    "matmul",
    "native_activation",
    "native_elu_plus_one",
    "nonpositive",
    "pad_rows",
    "reciprocal",
    "split_rows",
    "stack_leading",
    "unit_lower_solver",
    "unstack",
    "vector_times_matrix",
    "widens",
]


def cumulative_sum(xp: Any, x: Any, /, *, axis: int, include_initial: bool = False) -> Any:
    """``xp.cumulative_sum(x, axis=axis, include_initial=include_initial)``, traceable.

    For PyTorch, ``torch.cumsum`` itself: array-api-compat's wrapper resolves a namespace through
    its cached helpers, which ``torch.compile`` warns about. Call this instead of
    ``xp.cumulative_sum`` everywhere in the core.
    """
    if is_numpy_array(x) and _rows_of_numpy_sum(x, axis) >= NUMPY_SUM_ROWS:
        inclusive = _numpy_running_sum(x, axis)
    elif torch_namespace_of(x) is None:
        return xp.cumulative_sum(x, axis=axis, include_initial=include_initial)
    else:
        inclusive = torch_module().cumsum(x, dim=axis)
    if not include_initial:
        return inclusive
    shape = list(x.shape)
    shape[axis] = 1
    initial = xp.zeros(tuple(shape), dtype=inclusive.dtype, device=x.device)
    return xp.concat([initial, inclusive], axis=axis)


#: Elements per position along the axis from which NumPy sums an axis other than the last as a
#: loop of whole-slice additions (:func:`cumulative_sum`).
NUMPY_SUM_ROWS = 2048


def _rows_of_numpy_sum(x: Any, axis: int) -> int:
    """The elements per position along ``axis`` of a NumPy array (0 for the last axis, one
    position or a dtype not floating: an integer sum widens to NumPy's default integer)."""
    length = x.shape[axis]
    if axis % x.ndim == x.ndim - 1 or length < 2 or x.dtype.kind != "f":
        return 0
    return x.size // length


def _numpy_running_sum(x: Any, axis: int) -> Any:
    """NumPy's inclusive ``cumsum`` along ``axis`` as one addition of whole slices per position,
    the same additions in the same order (bit-identical). ``np.cumsum`` along an axis other than
    the last runs a short inner loop per element: on one thread, at 4096-16384 elements per
    position, 0.33-0.54x its time (16 and 64 positions); at 1024 the same, fewer slower."""
    np = sys.modules["numpy"]
    moved = np.moveaxis(x, axis, 0)
    out = np.empty(moved.shape, dtype=x.dtype)
    out[0] = moved[0]
    for i in range(1, moved.shape[0]):
        np.add(out[i - 1], moved[i], out=out[i])
    return np.moveaxis(out, 0, axis)


def unstack(xp: Any, x: Any, /, *, axis: int) -> tuple[Any, ...]:
    """``xp.unstack(x, axis=axis)``, with a contiguous gradient on PyTorch.

    array-api-compat unstacks a tensor by iterating over ``moveaxis(x, axis, 0)``: autograd
    then stacks the pieces' gradients along axis 0 and moves the axis back, a gradient in a
    permuted layout that the backward of the reshape before the unstack copies whole (one
    copy of each input per training step). ``torch.unbind`` along ``axis`` stacks them in
    place. Call this instead of ``xp.unstack`` everywhere in the core.
    """
    if torch_namespace_of(x) is None:
        return tuple(xp.unstack(x, axis=axis))
    return tuple(torch_module().unbind(x, dim=axis))


def native_activation(name: str, x: Any) -> Any | None:
    """``sigmoid``, ``silu`` or ``softplus`` of ``x`` by PyTorch's own kernels for a tensor, or
    ``None`` elsewhere (the array-API forms of :mod:`polylin.activations` run there).

    The array-API forms select with ``where`` so that no exponential overflows and every
    gradient is finite; PyTorch's CPU ``where`` is slow (8.6 ms on 1.8 M float32 values, one
    thread, against 0.4-1.9 ms for ``exp``, ``clamp`` or ``sigmoid``), and the SiLU of a
    (1, 1024, 1792) activation took 40 ms against 0.47 ms for ``F.silu``. ``torch.sigmoid`` and
    ``F.silu`` are as exact and their gradients as finite. PyTorch's ``softplus`` returns ``x``
    above a threshold (20), which is not exact in float64, so softplus is written as
    ``maximum(x, 0) + log1p(exp(-|x|))``: no selection, and on PyTorch the gradient is
    ``sigmoid(x)`` everywhere, 1/2 at 0. On PyTorch that is one ``logaddexp(x, 0)``, whose
    kernel computes the same and whose gradient is ``exp(x - softplus(x)) = sigmoid(x)``: 3x
    faster than the five operations of the formula (7 against 21 us for a decoding step's 48
    values, 0.39 against 1.29 ms for 196 thousand, one thread).
    """
    if torch_namespace_of(x) is None:
        return None
    torch = torch_module()
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "softplus":
        return torch.logaddexp(x, x.new_zeros(()))
    raise ValueError(f"no native activation {name!r}")


def native_elu_plus_one(x: Any) -> Any | None:
    """``elu(x) + 1`` by the library's own autograd registration, or ``None`` where it has none.

    PyTorch's autograd would keep the ``exp`` output of the array-API form for the backward (an
    array the size of ``x``); :mod:`polylin._backend.torch_autograd` keeps only ``x``. Only for
    a tensor, that is once torch is imported. Not while ``torch.compile`` traces: its compiler
    chooses what to keep for the backward itself (and Dynamo cannot trace a custom forward-mode
    rule).
    """
    if torch_namespace_of(x) is None or compiling(x):
        return None
    return torch_autograd.elu_plus_one(x)


def keep_lower(
    xp: Any, x: Any, mask: Any | None = None, *, strict: bool = False, fresh: bool = False
) -> Any:
    """``where(mask, x, 0)`` for the lower-triangular ``mask`` of ``causal_mask(..., strict)``:
    the entries on and below the diagonal (below it when ``strict``) of the last two axes,
    exact zeros elsewhere (whatever ``x`` holds there: ``inf``, ``nan``). PyTorch: ``tril``,
    the same selection, which measured twice as fast as a broadcast ``where`` on a chunk's
    scores. A broadcast view is made contiguous first: ``tril`` of one (a scalar gate's
    repeated log decays) measured 8x slower than the copy and ``tril`` together. ``mask``
    ``None``: built here where it is read (PyTorch never reads it), for a caller that would
    otherwise build it per call (ten small operations per block of chunks).

    ``fresh``: ``x`` is a temporary of the caller's that nothing else reads (a product whose
    backward does not keep it). PyTorch then zeroes its upper triangle in place (``tril_``),
    as it does a contiguous copy of a view, outside ``torch.func`` transforms: it writes only
    the zeros where ``tril`` writes a new array (a chunk's 64 x 64 scores of 48 heads, one
    thread: 0.25x the time)."""
    if torch_namespace_of(x) is not None:
        diagonal = -1 if strict else 0
        dense = x.contiguous()
        if (fresh or dense is not x) and not torch_transforming(dense):
            return dense.tril_(diagonal)
        return torch_module().tril(dense, diagonal=diagonal)
    if mask is None:
        mask = causal_mask(xp, x.shape[-2], x.shape[-1], device(x), strict=strict)
    return xp.where(mask, x, 0.0)


def add_outer(xp: Any, S: Any, *pairs: tuple[Any, Any]) -> Any:
    """``S + sum_i x_i y_i^T`` over the last two axes for ``pairs`` of ``x_i`` ``(..., m)`` and
    ``y_i`` ``(..., n)``: a rank-1 (or rank-2) state update. PyTorch: one ``addcmul`` per pair,
    which never writes the outer product out and measured twice as fast on a decoding step's
    state (a temporary of the state's size less). NumPy, two pairs on a state of at least
    :data:`_RANK_TWO_MATMUL` elements: one matmul of the stacked factors, one state-sized
    temporary instead of two and one addition instead of two (0.4-0.7x the time of the two
    outer products from 32768 elements on; below 16384 stacking the factors costs more than it
    saves). NumPy, one pair on states of at least :data:`_RANK_ONE_MATMUL` elements per matrix:
    the same matmul with a zero second pair, whose inner loops span whole rows where the
    broadcast product iterates over one row at a time (the 32 x 128 x 128 state of a decoding
    step: 0.87x the time of the step); the sums are the same to the bit (``x y + 0 0``). The
    matmul's new array takes the sum in place."""
    if torch_namespace_of(S) is not None:
        for x, y in pairs:
            S = torch_module().addcmul(S, x[..., :, None], y[..., None, :])
        return S
    if is_numpy_array(S) and (
        (len(pairs) == 2 and S.size >= _RANK_TWO_MATMUL)
        or (len(pairs) == 1 and S.shape[-1] * S.shape[-2] >= _RANK_ONE_MATMUL)
    ):
        (x1, y1), (x2, y2) = pairs if len(pairs) == 2 else (*pairs, (xp.zeros_like(pairs[0][0]),
                                                                     xp.zeros_like(pairs[0][1])))
        xs = xp.stack(xp.broadcast_arrays(x1, x2), axis=-1)  # (..., m, 2)
        ys = xp.stack(xp.broadcast_arrays(y1, y2), axis=-2)  # (..., 2, n)
        update = xs @ ys
        if update.shape != S.shape or update.dtype != S.dtype:
            return S + update
        update += S  # the matmul's own new array
        return update
    for x, y in pairs:
        S = S + x[..., :, None] * y[..., None, :]
    return S


#: The state size (elements) from which :func:`add_outer` adds two outer products on NumPy as
#: one matmul (measured at d = 64 for batch x heads 1 to 64: equal at 16384, faster above).
_RANK_TWO_MATMUL = 2**15

#: The size of one state matrix (elements) from which :func:`add_outer` adds one outer product
#: on NumPy as a matmul (faster at 128 x 128, the same or slower at 64 x 64).
_RANK_ONE_MATMUL = 2**14


def add_scaled(xp: Any, c: Any, a: Any, b: Any) -> Any:
    """``c + a * b`` (broadcast): PyTorch's ``addcmul``, one pass that writes the sum once
    instead of the product and then the sum (a state decayed and incremented per chunk)."""
    if torch_namespace_of(c) is not None:
        return torch_module().addcmul(c, a, b)
    return c + a * b


def reciprocal(xp: Any, x: Any) -> Any:
    """``1 / x``: PyTorch's ``reciprocal``, one pass (its ``1 / x`` is a reciprocal and then a
    multiplication by the 1)."""
    if torch_namespace_of(x) is not None:
        return x.reciprocal()
    return 1.0 / x


def add_matmul(
    xp: Any, c: Any, a: Any, b: Any, *, fresh: bool = False, alpha: float = 1.0
) -> Any:
    """``c + alpha * (a @ b)``, leading dimensions broadcast as in :func:`matmul`. PyTorch, where
    the three have the same leading dimensions (at least one): one ``baddbmm`` of the flattened
    batch, which writes the sum once instead of the product and then the sum (a block's
    read-out, ``(2, 4, 16, 64, 64)``, one thread: 0.7x the time of the matmul and the
    addition), ``alpha`` its own argument. Elsewhere ``alpha`` scales the smaller of ``a`` and
    the product.

    ``fresh``: ``c`` is a temporary of the caller's that nothing else reads (the result of an
    operation whose backward does not keep it): PyTorch then adds the product into it in place
    (``baddbmm_``), if it is contiguous and no ``torch.func`` transform is active, instead of
    first copying it into a new tensor (a decayed state per chunk: the gated delta rule's
    chunked call at 32 x 128, T = 512, 0.91-0.94x the time, one and two threads)."""
    same = len(c.shape) > 2 and tuple(c.shape[:-2]) == tuple(a.shape[:-2]) == tuple(b.shape[:-2])
    if same and torch_namespace_of(c) is not None:
        *lead, m, n = c.shape
        flat = [x.reshape(-1, *x.shape[-2:]) for x in (c, a, b)]
        # A strided temporary (a permuted product of grouped heads) is left to baddbmm: written
        # in place, its strided rows measured slower (Mamba-2's scan 1.12x on two threads).
        if fresh and c.is_contiguous() and not torch_transforming(c):
            return flat[0].baddbmm_(*flat[1:], alpha=alpha).reshape(*lead, m, n)
        total = torch_module().baddbmm(*flat, alpha=alpha)
        return total.reshape(*lead, m, n)
    if alpha == 1.0:
        return c + matmul(xp, a, b)
    if a.shape[-1] <= b.shape[-1]:  # a (m, k) is no larger than the product (m, n)
        return c + matmul(xp, a * alpha, b)
    return c + matmul(xp, a, b) * alpha


def unit_lower_solver(xp: Any, x: Any) -> Callable[[Any], Any] | None:
    """A function of ``A`` ``(..., C, C)`` that returns ``(I + strictly_lower(A))^{-1}``
    (``A``'s diagonal and upper triangle are never read) where the library of ``x`` has a
    batched triangular solve that differentiates: PyTorch's ``linalg.solve_triangular``, eager
    or compiled, and under ``jax.jit`` for the CPU (:func:`~.execution.scans_tokens`) XLA's
    ``lax.linalg.triangular_solve``. ``None`` elsewhere: the array-API levels of
    :func:`polylin._forms.common.intra_chunk.intra_chunk` invert it instead.

    Under ``jax.jit`` the gated delta rule then takes the factored scores of a scalar gate and
    one solve (``_forms.delta.chunked``) instead of the levels: 0.90-0.93x the forward time
    and 0.82-0.89x the gradient's at ggml's five shapes, one thread (``docs/performance.md``,
    "The bound checked inside a compiled JAX program"); KDA and RWKV-7 1.00x. Eager JAX and
    accelerators are unmeasured and keep the levels.
    """
    if scans_tokens(xp, x):
        lax = sys.modules["jax"].lax

        def solve_jax(A: Any) -> Any:
            eye = xp.broadcast_to(xp.eye(A.shape[-1], dtype=A.dtype), A.shape)
            return lax.linalg.triangular_solve(
                A, eye, left_side=True, lower=True, unit_diagonal=True
            )

        return solve_jax
    if torch_namespace_of(x) is None:
        return None
    torch = torch_module()

    def solve(A: Any) -> Any:
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape)
        return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)

    return solve


def vector_times_matrix(xp: Any, x: Any, S: Any) -> Any:
    """``S^T x``: the vector ``x`` ``(..., m)`` read through the state ``S`` ``(..., m, n)``.

    ``x`` may broadcast against the leading dimensions of ``S`` (grouped heads): then the
    product is a sum of ``x * S``, which keeps ``x`` itself for the backward (a broadcast
    matmul would keep a copy of ``x`` per group, :func:`matmul` a permuted copy of ``S``).
    Same leading dimensions on PyTorch: one ``bmm`` of the flattened batch, which measured
    2.3x faster than ``@`` on a decoding step's five-dimensional state (7 against 16 us).
    NumPy (no backward): a broadcast ``matmul`` always, which neither copies ``x`` per group
    nor writes the product ``x * S`` out. JAX: ``x`` broadcast to the state's leading
    dimensions (XLA keeps no copy; its transpose sums over the groups) and one ``matmul``: XLA
    compiles the sum over the state's rows into a slow reduction (Mamba-2's 48 x 128 x 64
    states with shared ``B`` and ``C``, a token scan under ``jit`` on the CPU: 35x the time of
    the matmul)."""
    if is_numpy_array(S):
        return (x[..., None, :] @ S)[..., 0, :]
    if x.shape[:-1] != S.shape[:-2]:
        if library_name(xp) not in JAX_NAMESPACES:
            return xp.sum(x[..., :, None] * S, axis=-2)
        lead = broadcast_shape(tuple(x.shape[:-1]), tuple(S.shape[:-2]))
        x = xp.broadcast_to(x, (*lead, x.shape[-1]))
    if torch_namespace_of(S) is not None:
        torch = torch_module()
        m, n = S.shape[-2:]
        product = torch.bmm(x.reshape(-1, 1, m), S.reshape(-1, m, n))
        return product.reshape(*S.shape[:-2], n)
    return (x[..., None, :] @ S)[..., 0, :]


def nonpositive(xp: Any, x: Any) -> Any:
    """``where(x > 0, 0, x)``: values above 0 taken as 0, NaN kept, the gradient 1 wherever
    ``x <= 0`` (``minimum`` would halve it at 0 on PyTorch and JAX). PyTorch: one ``clamp``,
    whose gradient is the same; NumPy (no gradients): one ``minimum``. One operation instead
    of two, in every decoding step."""
    if torch_namespace_of(x) is not None:
        return torch_module().clamp(x, max=0.0)
    if is_numpy_array(x):
        return xp.minimum(x, 0.0)
    return xp.where(x > 0.0, 0.0, x)


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


def dense(xp: Any, x: Any) -> Any:
    """``x`` with its elements in row-major order: a copy only if it is a strided view.

    A block cut from a longer sequence (one ``unstack`` along a middle axis) is such a view:
    PyTorch's batched matmul flattens the leading dimensions and would copy it at every use.
    Never pass a broadcast view (the copy would materialize the broadcast).
    """
    return xp.reshape(xp.reshape(x, (-1,)), x.shape)


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
