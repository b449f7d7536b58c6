"""Shared preparation for the entry points: feature maps, masks and states.

Inputs are cast to the work dtype *before* the feature map (a 16-bit ``exp`` overflows early),
masks are applied to the mapped keys (a masked key then adds nothing to S or z), and states are
checked against the mapped feature size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import array_api_compat

from ._namespace import Checked, namespace_of
from .feature_maps import elu_plus_one

__all__ = ["apply_feature_map", "check_mask", "check_state", "finish", "to_work_dtype"]


def to_work_dtype(c: Checked, x: Any) -> Any:
    """Cast ``x`` to the accumulation dtype (a no-op for float32 and float64)."""
    return x if x.dtype == c.work_dtype else c.xp.astype(x, c.work_dtype)


def apply_feature_map(
    c: Checked, feature_map: Callable[[Any], Any] | None, q: Any, k: Any
) -> tuple[Any, Any]:
    """Return ``phi(q), phi(k)`` in the work dtype, checking what the feature map returned."""
    if feature_map is None:
        feature_map = elu_plus_one
    elif not callable(feature_map):
        raise TypeError(
            f"feature_map must be a callable from array to array, got {type(feature_map).__name__}"
        )
    # A map may treat queries differently (FAVOR+ shifts each query row by its max, which
    # cancels between numerator and normalizer; a per-key shift would not): see ``map_query``.
    map_query = getattr(feature_map, "map_query", feature_map)
    mapped = []
    for name, x, phi in (("q", q, map_query), ("k", k, feature_map)):
        fx = phi(to_work_dtype(c, x))
        if not array_api_compat.is_array_api_obj(fx) or tuple(fx.shape[:-1]) != tuple(
            x.shape[:-1]
        ):
            raise ValueError(
                f"feature_map must return an array of shape (..., d_phi) for {name} of shape "
                f"{tuple(x.shape)}, got {getattr(fx, 'shape', type(fx).__name__)}"
            )
        mapped.append(to_work_dtype(c, fx))
    fq, fk = mapped
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(
            f"feature_map gave {fq.shape[-1]} features for q but {fk.shape[-1]} for k"
        )
    return fq, fk


def check_mask(c: Checked, attention_mask: Any, length: int) -> Any:
    """Validate a boolean ``(..., T)`` mask and return it as ``(..., T, 1)`` in the work dtype.

    The mask must broadcast against the leading dimensions of ``q`` with the usual right-aligned
    rules, so a ``(batch, T)`` mask for ``(batch, heads, T, d)`` inputs is ``mask[:, None, :]``.
    """
    xp = c.xp
    if namespace_of(attention_mask=attention_mask) is not xp:
        raise TypeError("attention_mask must be an array of the same library as q")
    if array_api_compat.device(attention_mask) != c.device:
        raise ValueError(
            f"attention_mask is on device {array_api_compat.device(attention_mask)} "
            f"but q is on device {c.device}"
        )
    if not xp.isdtype(attention_mask.dtype, "bool"):
        raise TypeError(
            f"attention_mask must be boolean (True for real tokens), got {attention_mask.dtype}"
        )
    full = (*c.batch_shape, length)
    shape = tuple(attention_mask.shape)
    ok = 1 <= len(shape) <= len(full) and all(
        m in (1, f) for m, f in zip(reversed(shape), reversed(full))
    )
    if not ok or shape[-1] != length:
        raise ValueError(
            f"attention_mask must have shape (..., T) broadcastable to {full}, got {shape}"
        )
    return xp.astype(attention_mask, c.work_dtype)[..., None]


def check_state(
    c: Checked, state: Any, batch_shape: tuple, d_phi: int, d_v: int, *, name: str
) -> tuple[Any, Any]:
    """Return ``(S, z)`` in the work dtype: zeros for ``None``, else the checked state."""
    xp = c.xp
    if state is None:
        S = xp.zeros((*batch_shape, d_phi, d_v), dtype=c.work_dtype, device=c.device)
        z = xp.zeros((*batch_shape, d_phi), dtype=c.work_dtype, device=c.device)
        return S, z
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{name} must be a LinearAttentionState (S, z), got {type(state).__name__}")
    S, z = state
    if namespace_of(**{f"{name}.S": S, f"{name}.z": z}) is not xp:
        raise TypeError(f"{name} must hold arrays of the same library as q")
    for part, x, want in (
        ("S", S, (*batch_shape, d_phi, d_v)),
        ("z", z, (*batch_shape, d_phi)),
    ):
        if array_api_compat.device(x) != c.device:
            raise ValueError(
                f"{name}.{part} is on device {array_api_compat.device(x)} "
                f"but q is on device {c.device}"
            )
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{name}.{part} must have a real floating dtype, got {x.dtype}")
        if tuple(x.shape) != want:
            raise ValueError(f"{name}.{part} must have shape {want}, got {tuple(x.shape)}")
    return to_work_dtype(c, S), to_work_dtype(c, z)


def finish(c: Checked, out: Any, query_mask: Any | None) -> Any:
    """Zero the masked query rows and cast back to the input dtype."""
    if query_mask is not None:
        out = out * query_mask
    return out if out.dtype == c.dtype else c.xp.astype(out, c.dtype)

