"""What the entry points do to validated inputs before and after an algorithm runs.

Inputs are cast to the work dtype *before* the feature map (a 16-bit ``exp`` overflows early);
outputs are cast back to the inputs' dtype with masked query rows zeroed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._policy import is_array
from ._validation import AttentionInputs
from .feature_maps import elu_plus_one

__all__ = ["apply_feature_map", "finish"]


def apply_feature_map(
    inputs: AttentionInputs, feature_map: Callable[[Any], Any] | None, q: Any, k: Any
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
        fx = phi(inputs.to_work_dtype(x))
        if not is_array(fx) or tuple(fx.shape[:-1]) != tuple(x.shape[:-1]):
            raise ValueError(
                f"feature_map must return an array of shape (..., d_phi) for {name} of shape "
                f"{tuple(x.shape)}, got {getattr(fx, 'shape', type(fx).__name__)}"
            )
        mapped.append(inputs.to_work_dtype(fx))
    fq, fk = mapped
    if fq.shape[-1] != fk.shape[-1]:
        raise ValueError(f"feature_map gave {fq.shape[-1]} features for q but {fk.shape[-1]} for k")
    return fq, fk


def finish(inputs: AttentionInputs, out: Any, query_mask: Any | None) -> Any:
    """Zero the masked query rows and cast back to the input dtype."""
    if query_mask is not None:
        out = out * query_mask
    return out if out.dtype == inputs.dtype else inputs.xp.astype(out, inputs.dtype)
