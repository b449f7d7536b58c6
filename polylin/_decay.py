"""The ``log_decay`` argument: validation, and what masks and packing do to it.

``log_decay`` is ``None`` (no decay), a Python float ``<= 0`` (one decay everywhere), or an array
of the inputs' library and device that broadcasts against the mapped keys ``(..., T, d_phi)``
(``(..., d_phi)`` for one decoding step): a trailing axis of size 1 is one scalar gate per token,
a trailing axis of ``d_phi`` one gate per feature channel. The algorithms receive ``None`` or an
array in the work dtype with the token and channel axes explicit, ``(..., T or 1, 1 or d_phi)``,
already zero at masked tokens (a masked token neither adds to the state nor decays it).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import array_api_compat

from ._validation import AttentionInputs, namespace_of

__all__ = ["check_log_decay", "check_normalize", "pack_log_decay", "standard_log_decay"]


def check_log_decay(
    inputs: AttentionInputs,
    log_decay: Any,
    *,
    length: int | None,
    d_phi: int | None,
    mask: Any | None = None,
) -> Any | None:
    """Validate ``log_decay`` and return ``None`` or ``(..., T or 1, 1 or d_phi)`` work-dtype.

    ``length`` is the sequence length (``None`` for one decoding step: then the result is
    ``(..., 1 or d_phi)``); ``d_phi`` the feature size (``None``: not known yet, not checked).
    ``mask`` (``(..., T, 1)``, nonzero or True for real tokens) selects the log decay of masked
    tokens to zero.
    """
    if log_decay is None:
        return None
    xp = inputs.xp
    if isinstance(log_decay, Real) and not isinstance(log_decay, bool):
        value = float(log_decay)
        if not (math.isfinite(value) and value <= 0):
            raise ValueError(
                f"log_decay must be <= 0 and finite (a decay factor exp(log_decay) in (0, 1]), "
                f"got {log_decay}"
            )
        if value == 0:
            return None
        shape = (1, 1) if length is not None else (1,)
        decay = xp.full(shape, value, dtype=inputs.work_dtype, device=inputs.device)
    else:
        if isinstance(log_decay, bool) or not array_api_compat.is_array_api_obj(log_decay):
            raise TypeError(
                f"log_decay must be None, a float <= 0 or an array, got {type(log_decay).__name__}"
            )
        if namespace_of(log_decay=log_decay) is not xp:
            raise TypeError("log_decay must be an array of the same library as q")
        if array_api_compat.device(log_decay) != inputs.device:
            raise ValueError(
                f"log_decay is on device {array_api_compat.device(log_decay)} "
                f"but q is on device {inputs.device}"
            )
        if not xp.isdtype(log_decay.dtype, "real floating"):
            raise TypeError(f"log_decay must have a real floating dtype, got {log_decay.dtype}")
        core = () if length is None else (length,)
        full = (*inputs.batch_shape, *core, d_phi if d_phi is not None else "d_phi")
        shape = tuple(log_decay.shape)
        fits = 1 <= len(shape) <= len(full) and all(
            s == 1 or s == f or (f == "d_phi" and i == 0)
            for i, (s, f) in enumerate(zip(reversed(shape), reversed(full)))
        )
        if not fits:
            raise ValueError(
                f"log_decay must broadcast against the mapped keys {full} (a trailing 1 for one "
                f"gate per token, d_phi for one per channel), got shape {shape}"
            )
        decay = inputs.to_work_dtype(log_decay)
        explicit = len(core) + 1  # the token (if any) and channel axes must exist
        if decay.ndim < explicit:
            decay = xp.reshape(decay, (1,) * (explicit - decay.ndim) + shape)
    if mask is not None:
        keep = mask if xp.isdtype(mask.dtype, "bool") else mask != 0
        decay = xp.where(keep, decay, 0.0)
    return decay


def pack_log_decay(xp: Any, decay: Any | None, pack: Any) -> Any | None:
    """``decay`` for packed sequences: ``pack`` it if it varies along T, else add the new axis.

    ``pack`` maps ``(..., T, w)`` to ``(..., N, max_len, w)`` (see ``_varlen.pack``).
    """
    if decay is None:
        return None
    if decay.shape[-2] == 1:
        return decay[..., None, :, :]
    return pack(decay)


def check_normalize(normalize: Any) -> None:
    """``normalize`` must be a bool (an array or a string would be truthy by accident)."""
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True or False, got {type(normalize).__name__}")


def standard_log_decay(layout: Any, log_decay: Any) -> Any:
    """``log_decay`` in the standard layout ``(..., T, d)`` of ``layout`` (``_layout``).

    In the default layout it is returned as given (it may have fewer dimensions and broadcast);
    with another ``seq_axis`` an array must have the full rank of ``q`` and its time axis is
    moved like the inputs' (``to_standard`` names ``log_decay`` if the rank differs).
    """
    if layout.is_standard or not array_api_compat.is_array_api_obj(log_decay):
        return log_decay
    (moved,) = layout.to_standard(log_decay=log_decay)
    return moved
