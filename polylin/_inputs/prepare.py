"""What the entry points do to validated inputs before and after an algorithm runs.

Inputs are cast to the work dtype *before* the feature map (a 16-bit ``exp`` overflows early);
outputs are cast back to the inputs' dtype with masked query rows zeroed.

Masks decide by selection, never by multiplication (``0 * nan`` and ``0 * inf`` are NaN, and
padding is often uninitialized memory): :func:`select` zeroes ``q``, ``k`` and ``v`` at masked
positions *before* the feature map, the mapped keys again *after* it (``phi(0)`` is not 0), and
:func:`finish` selects 0 for masked outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._backend.namespace import array_namespace, is_array
from ..feature_maps import FavorPlusFeatureMap, resolve_feature_map
from .validation import AttentionInputs

__all__ = ["apply_feature_map", "finish", "map_features", "resolve_feature_map", "select"]


def map_features(
    inputs: AttentionInputs, map_query: Callable[[Any], Any], map_key: Callable[[Any], Any],
    q: Any, k: Any,
) -> tuple[Any, Any]:
    """``phi(q), phi(k)`` in the work dtype, unchecked (see :func:`apply_feature_map`)."""
    work = inputs.to_work_dtype
    return work(map_query(work(q))), work(map_key(work(k)))


def apply_feature_map(
    inputs: AttentionInputs,
    feature_map: Callable[[Any], Any] | None,
    q: Any,
    k: Any,
    *,
    names: tuple[str, str] = ("q", "k"),
    shapes: tuple[tuple, tuple] | None = None,
) -> tuple[Any, Any]:
    """Return ``phi(q), phi(k)`` in the work dtype, checking what the feature map returned.

    ``shapes`` are the shapes of ``q`` and ``k`` as the caller passed them, for the message of
    a map built for another size (the chunked form maps a one-token probe here; default: the
    shapes of ``q`` and ``k``).
    """
    map_query, map_key = resolve_feature_map(feature_map, dim=q.shape[-1])
    if shapes is None:
        shapes = (tuple(q.shape), tuple(k.shape))
    mapped = []
    for name, x, shape, phi in ((names[0], q, shapes[0], map_query),
                                (names[1], k, shapes[1], map_key)):  # fmt: skip
        if isinstance(feature_map, FavorPlusFeatureMap) and x.shape[-1] != feature_map.dim:
            raise ValueError(
                f"{name} has shape {shape}, d_k={x.shape[-1]}, but feature_map={feature_map!r} "
                f"maps d_k={feature_map.dim}; build it for these inputs: "
                f"favor_plus({x.shape[-1]}, ...)"
            )
        fx = phi(inputs.to_work_dtype(x))
        _check_mapped(inputs, name, x, fx)
        mapped.append(inputs.to_work_dtype(fx))
    fq, fk = mapped
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(f"feature_map gave {fq.shape[-1]} features for q but {fk.shape[-1]} for k")
    return fq, fk


def _check_mapped(inputs: AttentionInputs, name: str, x: Any, fx: Any) -> None:
    """``phi(x)`` must be a real floating ``(..., d_phi)`` array of the inputs' library."""
    if not is_array(fx):
        raise TypeError(f"feature_map must return an array for {name}, got {type(fx).__name__}")
    if array_namespace(fx) is not inputs.xp:
        raise TypeError(
            f"feature_map returned a {type(fx).__module__.split('.')[0]} array for {name}, a "
            f"{type(x).__module__.split('.')[0]} array; it must return an array of the same "
            "library as its input"
        )
    if not inputs.xp.isdtype(fx.dtype, "real floating"):
        raise TypeError(
            f"feature_map must return a real floating array for {name}, got dtype {fx.dtype} "
            "(a complex result would lose its imaginary part)"
        )
    if tuple(fx.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(
            f"feature_map must return an array of shape (..., d_phi) for {name} of shape "
            f"{tuple(x.shape)}, got {tuple(fx.shape)}"
        )


def select(xp: Any, mask: Any | None, x: Any) -> Any:
    """``x`` where the boolean ``mask`` is True, exactly 0 elsewhere (``x`` without a mask)."""
    return x if mask is None else xp.where(mask, x, 0.0)


def finish(inputs: AttentionInputs, out: Any, query_mask: Any | None) -> Any:
    """Zero the masked query rows (by selection) and cast back to the input dtype."""
    out = select(inputs.xp, query_mask, out)
    return out if out.dtype == inputs.dtype else inputs.xp.astype(out, inputs.dtype)
