"""The ``log_decay`` argument: validation, the out-of-range policy, masks and packing.

``log_decay`` is ``None`` (no decay), a real number ``<= 0`` (a Python or NumPy scalar: one
decay everywhere), or an array of the inputs' library and device that broadcasts against the
mapped keys ``(..., T, d_phi)`` (``(..., d_phi)`` for one decoding step), a 0-d array
included: a trailing axis of size 1 is one scalar gate per token, a trailing axis of ``d_phi``
one gate per feature channel. The algorithms receive ``None`` or an array in the work dtype
with the token and channel axes explicit, ``(..., T or 1, 1 or d_phi)``, already zero at masked
tokens (a masked token neither adds to the state nor decays it).

The out-of-range policy, the same for every entry point, form and layer (this module is its
one home): a decay never amplifies the state. A number above 0 (or nan, or infinite) is a
``ValueError``; array values above 0 are taken as 0, by selection (``where(g > 0, 0, g)``:
``minimum`` would halve the gradient at ``g == 0`` on PyTorch), since checking them would read
the data (lazy and traced backends cannot). An array value of ``-inf`` is an exact reset of
the state.
"""

from __future__ import annotations

import math
from typing import Any, SupportsFloat

from ._policy import device as device_of
from ._policy import is_array, nonpositive
from ._validation import (
    AttentionInputs,
    _check_known_shape,
    check_flag,
    is_real_number,
    namespace_of,
    other_device,
)

__all__ = [
    "check_log_decay",
    "check_log_decay_number",
    "check_normalize",
    "log_decay_values",
    "pack_log_decay",
    "standard_log_decay",
]


def check_log_decay_number(log_decay: SupportsFloat) -> float:
    """A number ``log_decay`` as a float; a ``ValueError`` unless it is finite and ``<= 0`` (a
    ``-inf`` reset belongs in an array, at the tokens it resets)."""
    value = float(log_decay)
    if value == -math.inf:
        raise ValueError(
            f"log_decay must be a finite number <= 0, got {log_decay}: a number is one decay for "
            "every token, and -inf would reset the state at each of them; to reset the state at "
            "chosen tokens pass a log_decay array with -inf there"
        )
    if not (math.isfinite(value) and value <= 0):
        raise ValueError(
            f"log_decay must be a finite number <= 0 (a decay factor exp(log_decay) in (0, 1]), "
            f"got {log_decay}; a decay never amplifies the state (array values above 0 are "
            "taken as 0)"
        )
    return value


def check_log_decay(
    inputs: AttentionInputs,
    log_decay: Any,
    *,
    length: int | None,
    d_phi: int | None,
    mask: Any | None = None,
    layout: Any | None = None,
    channels: str | None = "d_phi",
) -> Any | None:
    """Validate ``log_decay`` and return ``None`` or ``(..., T or 1, 1 or d_phi)`` work-dtype.

    ``length`` is the sequence length (``None`` for one decoding step: then the result is
    ``(..., 1 or d_phi)``); ``d_phi`` the feature size (``None``: not known yet, not checked).
    ``mask`` (``(..., T, 1)``, nonzero or True for real tokens) selects the log decay of masked
    tokens to zero. ``layout`` (a ``SequenceLayout``) is the caller's: shapes in messages are
    shown in it. ``channels`` names the channel axis in messages: ``"d_phi"`` (the mapped keys of
    linear attention) or ``"d_k"`` (the keys of the delta rules); ``None`` allows a trailing
    axis of 1 only (one gate per token).
    Array values above 0 are selected to 0 (the module docstring's policy).
    """
    if log_decay is None:
        return None
    xp = inputs.xp
    if is_real_number(log_decay):
        value = check_log_decay_number(log_decay)
        if value == 0:
            return None
        shape = (1, 1) if length is not None else (1,)
        return xp.full(shape, value, dtype=inputs.work_dtype, device=inputs.device)
    if isinstance(log_decay, bool) or not is_array(log_decay):
        raise TypeError(
            f"log_decay must be None, a number <= 0 or an array, got {type(log_decay).__name__}"
        )
    if namespace_of(log_decay=log_decay) is not xp:
        raise TypeError("log_decay must be an array of the same library as q")
    if other_device(inputs.device, log_decay):
        raise ValueError(
            f"log_decay is on device {device_of(log_decay)} but q is on device {inputs.device}"
        )
    if not xp.isdtype(log_decay.dtype, "real floating"):
        raise TypeError(f"log_decay must have a real floating dtype, got {log_decay.dtype}")
    _check_known_shape("log_decay", log_decay)
    core = () if length is None else (length,)
    width = d_phi if d_phi is not None else "d_phi"
    full = (*inputs.batch_shape, *core, width if channels is not None else 1)
    shape = tuple(log_decay.shape)
    fits = len(shape) <= len(full) and all(
        s == 1 or s == f or (f == "d_phi" and i == 0)
        for i, (s, f) in enumerate(zip(reversed(shape), reversed(full)))
    )
    if not fits:
        shown = (lambda x: x) if layout is None else layout.caller_shape
        if channels is None:
            keys, what = "keys", "one gate per token: a trailing 1"
        else:
            keys = "mapped keys" if channels == "d_phi" else "keys"
            what = f"a trailing 1 for one gate per token, {channels} for one per channel"
        raise ValueError(
            f"log_decay must broadcast against the {keys} {shown(full)} ({what}), got shape "
            f"{shown(shape)}"
        )
    decay = log_decay_values(inputs, log_decay, explicit=len(core) + 1)
    if mask is not None:
        keep = mask if xp.isdtype(mask.dtype, "bool") else mask != 0
        decay = xp.where(keep, decay, 0.0)
    return decay


def log_decay_values(inputs: AttentionInputs, log_decay: Any, *, explicit: int) -> Any:
    """A checked ``log_decay`` array in the work dtype, with at least ``explicit`` axes (the
    token axis, if any, and the channel axis), its values above 0 selected to 0."""
    xp = inputs.xp
    decay = inputs.to_work_dtype(log_decay)
    if decay.ndim < explicit:
        decay = xp.reshape(decay, (1,) * (explicit - decay.ndim) + tuple(log_decay.shape))
    # A decay never amplifies: every exponential the algorithms form stays <= 1.
    return nonpositive(xp, decay)


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
    check_flag("normalize", normalize)


def standard_log_decay(layout: Any, log_decay: Any) -> Any:
    """``log_decay`` in the standard layout ``(..., T, d)`` of ``layout`` (``_layout``).

    In the default layout it is returned as given (it may have fewer dimensions and broadcast);
    with another ``seq_axis`` an array must have the full rank of ``q`` and its time axis is
    moved like the inputs' (``to_standard`` names ``log_decay`` if the rank differs). Numbers
    (NumPy scalars too) and 0-d arrays broadcast in any layout and are returned as given.
    """
    return layout.per_token_to_standard("log_decay", log_decay)
