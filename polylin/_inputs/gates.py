"""The ``log_decay`` argument: validation, the out-of-range policy, masks and packing.

``log_decay`` is ``None`` (no decay), a real number ``<= 0`` (a Python or NumPy scalar: one
decay everywhere), or an array of the inputs' library and device that broadcasts against the
mapped keys ``(..., T, d_phi)`` (``(..., d_phi)`` for one decoding step), a 0-d array
included: a trailing axis of size 1 is one scalar gate per token, a trailing axis of ``d_phi``
one gate per feature channel. An array with fewer dimensions than the keys whose last axis
could also be read as the axis before the channel axis (``(B, H, T)`` meant as one gate per
token broadcasts as one per channel where ``T == d_phi``) is a ``ValueError``: its shape does
not say which it is. The algorithms receive ``None`` or an array in the work dtype
with the token and channel axes explicit, ``(..., T or 1, 1 or d_phi)``, already zero at masked
tokens (a masked token neither adds to the state nor decays it).

The out-of-range policy, the same for every entry point, form and layer (this module is its
one home): a decay never amplifies the state. A number above 0 (or nan, or infinite) is a
``ValueError``; array values above 0 are taken as 0, by selection (``where(g > 0, 0, g)``:
``minimum`` would halve the gradient at ``g == 0`` on PyTorch), since checking them would read
the data (lazy and traced backends cannot). An array value of ``-inf`` is an exact reset of
the state. The recurrent forms select their values above 0 themselves, where they form the
factors (``clamp=False`` here: on PyTorch the selection would be an operation on the whole
sequence just before their compiled loop, ``_backend.compiled.compiled_tokens``).
"""

from __future__ import annotations

import math
from typing import Any, SupportsFloat

from .._backend.namespace import is_array
from .._backend.ops import nonpositive
from .arrays import check_beside, check_known_shape, is_real_number
from .validation import AttentionInputs, check_flag, shown_shape

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
    clamp: bool = True,
) -> Any | None:
    """Validate ``log_decay`` and return ``None`` or ``(..., T or 1, 1 or d_phi)`` work-dtype.

    ``length`` is the sequence length (``None`` for one decoding step: then the result is
    ``(..., 1 or d_phi)``); ``d_phi`` the feature size (``None``: not known yet, not checked).
    ``mask`` (``(..., T, 1)``, nonzero or True for real tokens) selects the log decay of masked
    tokens to zero, a number's too (it then becomes an array of the mask's shape: a number is
    the same value in every token's slot). ``layout`` (a ``SequenceLayout``) is the caller's:
    shapes in messages are shown in it, and an array that :func:`standard_log_decay` left in
    it (its rank is not that of ``q``) is named here. ``channels`` names the channel axis in
    messages: ``"d_phi"`` (the mapped keys of linear attention) or ``"d_k"`` (the keys of the
    delta rules); ``None`` allows a trailing axis of 1 only (one gate per token).
    Array values above 0 are selected to 0 (the module docstring's policy); with ``clamp``
    false they are left to the form that takes them (the recurrent forms take them as 0 where
    they form the factors: on PyTorch a selection of its own here would run on the sequence
    before their compiled loop, ``_backend.compiled.compiled_tokens``).
    """
    if log_decay is None:
        return None
    xp = inputs.xp
    if is_real_number(log_decay):
        value = check_log_decay_number(log_decay)
        if value == 0:
            return None
        shape = (1, 1) if length is not None else (1,)
        decay = xp.full(shape, value, dtype=inputs.work_dtype, device=inputs.device)
    else:
        _check_log_decay_array(inputs, log_decay, length, d_phi, layout, channels)
        core = 0 if length is None else 1
        decay = log_decay_values(inputs, log_decay, explicit=core + 1, clamp=clamp)
    if mask is not None:
        keep = mask if xp.isdtype(mask.dtype, "bool") else mask != 0
        decay = xp.where(keep, decay, 0.0)
    return decay


def _check_log_decay_array(
    inputs: AttentionInputs,
    log_decay: Any,
    length: int | None,
    d_phi: int | None,
    layout: Any | None,
    channels: str | None,
) -> None:
    """The checks of an array ``log_decay`` (see :func:`check_log_decay`)."""
    xp = inputs.xp
    if isinstance(log_decay, bool) or not is_array(log_decay):
        raise TypeError(
            f"log_decay must be None, a number <= 0 or an array, got {type(log_decay).__name__}"
        )
    check_beside(xp, inputs.device, "log_decay", log_decay)
    if not xp.isdtype(log_decay.dtype, "real floating"):
        raise TypeError(f"log_decay must have a real floating dtype, got {log_decay.dtype}")
    check_known_shape("log_decay", log_decay)
    core = () if length is None else (length,)
    width = d_phi if d_phi is not None else "d_phi"
    full = (*inputs.batch_shape, *core, width if channels is not None else 1)
    shape = tuple(log_decay.shape)
    keys = "mapped keys" if channels == "d_phi" else "keys"
    if channels is None:
        what = f"one gate per token: {shown_shape(layout, full)}"
    else:
        what = (
            f"{shown_shape(layout, (*full[:-1], 1))} for one gate per token, "
            f"{shown_shape(layout, full)} for one per channel"
        )
    if layout is not None and not layout.is_standard and len(shape) not in (0, layout.ndim):
        raise ValueError(
            f"log_decay has {len(shape)} dimensions but q has {layout.ndim}; with seq_axis all "
            f"sequence arguments must have the same number of dimensions: log_decay must be "
            f"{what}, or broadcast to one of them with the same number of dimensions"
        )
    fits = _broadcasts(shape, full)
    if fits and 0 < len(shape) < len(full) and shape[-1] != 1 and _broadcasts((*shape, 1), full):
        # (B, H, T) meant as one gate per token also broadcasts as one gate per channel of
        # (H, T, d_phi) where T == d_phi (and H is 1 or T): its shape cannot say which it is.
        raise ValueError(
            f"log_decay of shape {shown_shape(layout, shape)} has fewer dimensions than the "
            f"{keys} {shown_shape(layout, full)}, and its last axis ({shape[-1]}) may be their "
            "channel axis or the one before it: it does not say whether it is one gate per "
            f"token or one per channel. Pass {what} (size 1 on the axes it is shared by)"
        )
    if not fits:
        if channels is not None:
            gates = f"a trailing 1 for one gate per token, {channels} for one per channel"
        else:
            gates = "one gate per token: a trailing 1"
        raise ValueError(
            f"log_decay must broadcast against the {keys} {shown_shape(layout, full)} ({gates}), "
            f"got shape {shown_shape(layout, shape)}"
        )


def _broadcasts(shape: tuple, full: tuple) -> bool:
    """Whether an array of ``shape`` broadcasts against ``full`` (whose last entry may be the
    name ``"d_phi"``: a feature size not known yet, which any size matches)."""
    return len(shape) <= len(full) and all(
        s == 1 or s == f or (f == "d_phi" and i == 0)
        for i, (s, f) in enumerate(zip(reversed(shape), reversed(full)))
    )


def log_decay_values(
    inputs: AttentionInputs, log_decay: Any, *, explicit: int, clamp: bool = True
) -> Any:
    """A checked ``log_decay`` array in the work dtype, with at least ``explicit`` axes (the
    token axis, if any, and the channel axis), its values above 0 selected to 0 (``clamp``)."""
    xp = inputs.xp
    decay = inputs.to_work_dtype(log_decay)
    if decay.ndim < explicit:
        decay = xp.reshape(decay, (1,) * (explicit - decay.ndim) + tuple(log_decay.shape))
    # A decay never amplifies: every exponential the algorithms form stays <= 1.
    return nonpositive(xp, decay) if clamp else decay


def pack_log_decay(xp: Any, decay: Any | None, pack: Any, rank: int) -> Any | None:
    """``decay`` for packed sequences: ``pack`` it if it varies along T, else add the new axis.

    ``pack`` maps ``(..., T, w)`` to ``(..., N, max_len, w)`` (see ``_inputs.varlen.pack``); the
    result has ``rank`` dimensions (those of the packed inputs): the packed call checks it
    again, and a gate with fewer would have to say again which axis is its channel axis,
    against sizes the caller never gave.
    """
    if decay is None:
        return None
    packed = decay[..., None, :, :] if decay.shape[-2] == 1 else pack(decay)
    if packed.ndim >= rank:
        return packed
    return xp.reshape(packed, (1,) * (rank - packed.ndim) + tuple(packed.shape))


def check_normalize(normalize: Any) -> None:
    """``normalize`` must be a bool (an array or a string would be truthy by accident)."""
    check_flag("normalize", normalize)


def standard_log_decay(layout: Any, log_decay: Any) -> Any:
    """``log_decay`` in the standard layout ``(..., T, d)`` of ``layout`` (``_layout``).

    In the default layout it is returned as given (it may have fewer dimensions and broadcast);
    with another ``seq_axis`` an array must have the full rank of ``q`` and its time axis is
    moved like the inputs'. One of another rank is returned as given, for
    :func:`check_log_decay` (which knows the shapes it could have, and is given ``layout``) to
    name. Numbers (NumPy scalars too) and 0-d arrays broadcast in any layout and are returned
    as given.
    """
    if is_array(log_decay) and log_decay.ndim not in (0, layout.ndim):
        return log_decay
    return layout.per_token_to_standard("log_decay", log_decay)
