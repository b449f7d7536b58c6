"""Resolve the array namespace, device and dtype policy, and validate inputs.

This is the one place that knows how arrays from different libraries are told apart. Everything
else receives ``xp`` (an array-API namespace) and arrays that are known to be consistent.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import array_api_compat

__all__ = [
    "Checked",
    "check_attention_inputs",
    "check_options",
    "compute_dtype",
    "namespace_of",
]


class Checked(NamedTuple):
    """What the entry points need to know about validated ``q, k, v``."""

    xp: Any
    device: Any
    dtype: Any  # the inputs' dtype, which the output gets back
    work_dtype: Any  # the dtype the algorithms accumulate in (float32 for half inputs)
    batch_shape: tuple  # the leading dimensions shared by q, k and v


def _library(x: Any) -> str:
    """A short library name for error messages."""
    module = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(module, module)


def namespace_of(**arrays: Any) -> Any:
    """Return the array-API namespace shared by the named arrays.

    Raises a ``TypeError`` naming the argument that is not an array, or that comes from another
    library than the first one.
    """
    xp = None
    first = None
    for name, x in arrays.items():
        if not array_api_compat.is_array_api_obj(x):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        try:
            this = array_api_compat.array_namespace(x)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        if xp is None:
            xp, first = this, name
        elif this is not xp:
            raise TypeError(
                f"{name} is a {_library(x)} array but {first} is a {_library(arrays[first])} "
                "array; pass arrays from one library"
            )
    return xp


def _check_device(xp: Any, device: Any, first: str, **arrays: Any) -> None:
    for name, x in arrays.items():
        other = array_api_compat.device(x)
        if other != device:
            raise ValueError(f"{name} is on device {other} but {first} is on device {device}")


def compute_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype to accumulate in: float32 for 16-bit floats, the dtype itself otherwise.

    Bit width is read from ``finfo`` rather than compared to ``xp.float16``: not every namespace
    has float16 or bfloat16, and NumPy's ``dtype == None`` comparisons are a trap.
    """
    return xp.float32 if xp.finfo(dtype).bits < 32 else dtype


def _check_floating(xp: Any, name: str, x: Any) -> None:
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")


def _check_known_shape(name: str, x: Any) -> None:
    # Lazy libraries may not know a size until they compute (the standard says None, Dask
    # says nan); every algorithm needs static sizes to lay out its chunks.
    if any(s is None or (isinstance(s, float) and s != s) for s in x.shape):
        raise ValueError(
            f"{name} has unknown dimensions {tuple(x.shape)}; polylin needs every size known "
            f"(for a Dask array, call {name}.compute_chunk_sizes() first)"
        )


def check_attention_inputs(
    q: Any, k: Any, v: Any, *, causal: bool, single_token: bool = False
) -> Checked:
    """Validate ``q``, ``k``, ``v`` and resolve namespace, device and dtypes.

    ``q`` and ``k`` are ``(..., T, d_k)``, ``v`` is ``(..., T, d_v)``, with identical leading
    dimensions. When ``causal`` the query length must equal the key length. With
    ``single_token`` there is no T axis (one decoding step): ``(..., d_k)`` and ``(..., d_v)``.
    """
    qn, kn, vn = names = ("q_t", "k_t", "v_t") if single_token else ("q", "k", "v")
    xp = namespace_of(**{qn: q, kn: k, vn: v})
    device = array_api_compat.device(q)
    _check_device(xp, device, qn, **{kn: k, vn: v})
    core, layout = (1, "(..., d)") if single_token else (2, "(..., T, d)")
    for name, x in zip(names, (q, k, v)):
        _check_floating(xp, name, x)
        _check_known_shape(name, x)
        if x.ndim < core:
            raise ValueError(
                f"{name} must have at least {core} dimensions {layout}, got shape {tuple(x.shape)}"
            )
    for name, x in ((kn, k), (vn, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {qn} has dtype {q.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{kn} has feature size d_k={k.shape[-1]} but {qn} has d_k={q.shape[-1]}; "
            "they must match"
        )
    if not single_token:
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"v has sequence length {v.shape[-2]} but k has {k.shape[-2]}; they must match"
            )
        if causal and q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"q has sequence length {q.shape[-2]} but k has {k.shape[-2]}; causal attention "
                "needs equal lengths (use linear_attention for cross-attention)"
            )
    batch_shape = tuple(q.shape[:-core])
    for name, x in ((kn, k), (vn, v)):
        if tuple(x.shape[:-core]) != batch_shape:
            raise ValueError(
                f"{name} has leading dimensions {tuple(x.shape[:-core])} but {qn} has "
                f"{batch_shape}; they must be identical"
            )
    return Checked(xp, device, q.dtype, compute_dtype(xp, q.dtype), batch_shape)


def check_options(*, eps: float, chunk_size: int | None = None) -> None:
    """Validate the scalar options shared by the entry points."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a positive float, got {type(eps).__name__}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
