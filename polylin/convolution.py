"""The short causal convolution of Mamba-2, Gated DeltaNet and Kimi Delta Attention blocks.

A depthwise convolution along the time axis: each channel has its own few taps, and output t
sees inputs ``t - width + 1 .. t`` only. Its decoding state is the last ``width - 1`` inputs.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

from ._backend.compiled_conv import compiled_conv
from ._backend.depthwise import causal_taps
from ._backend.namespace import device as device_of
from ._backend.ops import cumulative_sum
from ._inputs.arrays import check_beside, namespace_of, other_device, work_dtype_for
from ._inputs.layout import DEFAULT_SEQ_AXIS, standard_layout
from ._inputs.steps import PlanCache
from ._inputs.validation import AttentionInputs, check_flag, check_mask, check_token_mask
from ._typing import Array
from .activations import silu

__all__ = ["ACTIVATIONS", "causal_conv1d", "causal_conv1d_step"]

#: The activations :func:`causal_conv1d` applies after the convolution (``"swish"`` is
#: ``"silu"``, as in flash-linear-attention).
ACTIVATIONS = (None, "silu", "swish")


def _channels_first(name: str, shape: tuple, weight_shape: tuple, *, core: int) -> str | None:
    """The hint for ``x`` of the caller's ``shape`` whose axis -2, not its last, has the
    weight's channels: it looks channels-first (``(batch, channels, T)``, as ``nn.Conv1d`` and
    the causal-conv1d package take it); ``None`` when it does not."""
    channels = weight_shape[0]
    if len(shape) < 2 or shape[-2] != channels or shape[-1] == channels:
        return None
    swap = f"{name}.mT ({name} with its last two axes swapped)"
    if core == 2:
        layout, fix = "(..., T, channels)", f"{swap} and take the output's .mT back"
    else:
        layout = "(..., channels)"
        fix = f"{name}[..., 0]" if shape[-1] == 1 else swap
    function = "causal_conv1d" if core == 2 else "causal_conv1d_step"
    return (
        f"{name} looks channels-first: it has shape {shape}, whose axis -2 (not its last "
        f"axis) has the {channels} channels of weight {weight_shape}; {function} takes the "
        f"channels on the last axis, {layout}: pass {fix} (if {name} is {layout} already, "
        f"the weight is wrong: it must have shape (channels, width) = ({shape[-1]}, width))"
    )


def _check_arrays(
    x: Any,
    weight: Any,
    bias: Any,
    activation: Any,
    *,
    name: str,
    core: int,
    caller_shape: tuple | None = None,
) -> AttentionInputs:
    """Validate ``x`` (``core`` = 2: a sequence, 1: one token), ``weight``, ``bias``;
    ``caller_shape`` is the shape of ``x`` as the caller gave it (before ``seq_axis`` moved
    its time axis), for the messages."""
    arrays = {name: x, "weight": weight}
    if bias is not None:
        arrays["bias"] = bias
    xp = namespace_of(**arrays)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    layout = "(..., T, channels)" if core == 2 else "(..., channels)"
    if x.ndim < core:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    channels = x.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        shape = tuple(x.shape) if caller_shape is None else tuple(caller_shape)
        hint = None
        if weight.ndim == 2 and weight.shape[1] >= 1:
            hint = _channels_first(name, shape, tuple(weight.shape), core=core)
        if hint is not None:
            raise ValueError(hint)
        raise ValueError(
            f"weight must have shape (channels, width) = ({channels}, width), "
            f"got {tuple(weight.shape)}"
        )
    for other, value in arrays.items():
        if other != name and value.dtype != x.dtype:
            raise TypeError(f"{other} has dtype {value.dtype} but {name} has dtype {x.dtype}")
        if other != name and other_device(device_of(x), value):  # a tracer's device is None
            raise ValueError(
                f"{other} is on device {device_of(value)} but {name} is on {device_of(x)}"
            )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(
            f"bias must have shape (channels,) = ({channels},), got {tuple(bias.shape)}"
        )
    batch = tuple(x.shape[:-core])
    return AttentionInputs(xp, device_of(x), x.dtype, work_dtype_for(xp, x.dtype), batch)


def _check_state(
    inputs: AttentionInputs, state: Any, shape: tuple, name: str, *, standard: bool = True
) -> Any:
    """``state`` of the standard-layout ``shape``, or zeros for ``None``; ``standard``: the
    caller's layout is the standard one (a channels-first state is then named as such)."""
    xp = inputs.xp
    if state is None:
        return xp.zeros(shape, dtype=inputs.work_dtype, device=inputs.device)
    check_beside(xp, inputs.device, name, state, query="x")
    if tuple(state.shape) != shape:
        swapped = (*shape[:-2], shape[-1], shape[-2])
        if standard and tuple(state.shape) == swapped:
            raise ValueError(
                f"{name} looks channels-first: it has shape {tuple(state.shape)}, and the state "
                f"is (..., width - 1, channels) = {shape} (the causal-conv1d package keeps "
                f"(batch, channels, width - 1)): pass {name}.mT"
            )
        raise ValueError(
            f"{name} must have shape (..., width - 1, channels) = {shape}, got {tuple(state.shape)}"
        )
    if state.dtype != inputs.work_dtype:
        raise TypeError(
            f"{name} has dtype {state.dtype}; it must be {inputs.work_dtype} (the work dtype of "
            f"x of dtype {inputs.dtype}: what causal_conv1d returns)"
        )
    return state


def _last_real(xp: Any, ext: Any, keep: Any, count: int) -> Any:
    """The last ``count`` rows of ``ext`` (``(..., L, C)``) where ``keep`` (``(..., L, 1)``).

    Each row's rank among the real rows comes from one cumulative sum; slot ``j`` selects the
    row of rank ``total - count + 1 + j``. Selection, not a one-hot product: another row's inf
    cannot reach a slot. ``ext`` starts with ``count`` real rows (the previous state), so every
    slot finds its row.
    """
    rank = cumulative_sum(xp, xp.astype(keep, xp.int32), axis=-2)
    total = rank[..., -1:, :]
    slots = []
    for j in range(count):
        hit = keep & (rank == total - (count - 1 - j))
        slots.append(xp.sum(xp.where(hit, ext, 0.0), axis=-2))
    return xp.stack(slots, axis=-2)


def causal_conv1d(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    /,
    *,
    activation: str | None = None,
    state: Array | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Array | tuple[Array, Array]:
    r"""Depthwise causal convolution: ``y_tc = act(b_c + sum_i w_ci x_{t - width + 1 + i, c})``.

    Each channel ``c`` has ``width`` taps; output ``t`` sees the inputs ``t - width + 1 .. t``
    (inputs before the start are the ``state``, zeros by default). This is the short
    convolution that Mamba-2, Gated DeltaNet and Kimi Delta Attention apply to their
    projections, with the weight layout of the causal-conv1d package: the last tap ``w_c,
    width-1`` multiplies the current input.

    Parameters
    ----------
    x : array
        ``(..., T, channels)``, any leading dimensions (with ``seq_axis``, T may sit on another
        axis).
    weight : array
        ``(channels, width)``, the dtype of ``x``. A PyTorch ``nn.Conv1d(groups=channels)``
        weight of shape ``(channels, 1, width)`` gives it as ``weight[:, 0]``.
    bias : array, optional
        ``(channels,)``.
    activation : {None, "silu", "swish"}
        Applied to the sum (``"swish"`` is ``"silu"``).
    state : array, optional
        The last ``width - 1`` inputs before ``x``: the shape of ``x`` with ``width - 1`` in
        place of T, in the work dtype (float32 for 16-bit inputs). One returned by an earlier
        call continues exactly. ``None``: zeros (the start of a sequence).
    return_state : bool
        Also return the state after ``x``: its last ``width - 1`` real inputs (earlier ones
        come from ``state`` when ``x`` has fewer).
    attention_mask : array of bool, optional
        True for real inputs: ``(batch, T)`` or the shape of ``x`` without its channel axis
        (size-1 axes broadcast), as for :func:`~polylin.causal_linear_attention`. Masked inputs
        are selected away before the convolution (whatever they hold, NaN included, they are
        zeros there), masked outputs are exactly 0, and the returned state holds the last real
        inputs. Left padding before a sequence started without a state is exactly an empty
        prefix; right padding never reaches a real output or the state.
    seq_axis : int
        The axis of T in ``x`` (default -2). The output and the state keep that layout.

    Returns
    -------
    array or (array, array)
        The output, the shape, library, device and dtype of ``x``; with ``return_state`` also
        the new state.

    Raises
    ------
    TypeError
        Non-arrays, arrays of several libraries, non-floating or mismatched dtypes, a state of
        another dtype than the work dtype, a ``return_state`` that is not a bool.
    ValueError
        Mismatched shapes, an unknown activation.

    Notes
    -----
    The ``width`` taps are ``width`` shifted views of one padded array, combined once: forward
    and backward are linear in T, and ``width`` (usually 4) multiply-adds per input. On
    PyTorch's CPU in float32, from 16384 outputs (65536 with a gradient to record), PyTorch's
    own depthwise convolution sums the taps in one pass over the input instead, and the
    gradient of the inputs is that convolution too: 0.19x the forward time at Mamba-2's 3328
    channels, 0.35x forward and backward (one thread). On NumPy, where Numba is installed
    (the ``compiled`` extra), one compiled pass computes each output from its inputs where
    they lie, the state's or the sequence's, with the same sums (the same bits) and without
    the masked case: 0.20x the time of the taps at 3328 channels, T = 512 (one thread; 0.13x
    on two), and a decoding token's kernel 2 us against the taps' 18 us.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_conv1d
    >>> x = np.arange(1.0, 6.0)[:, None]          # (T, channels) = (5, 1)
    >>> w = np.array([[1.0, 10.0]])               # width 2: previous input, current input
    >>> causal_conv1d(x, w)[:, 0]
    array([10., 21., 32., 43., 54.])

    A prefix's state continues exactly:

    >>> y1, state = causal_conv1d(x[:3], w, return_state=True)
    >>> y2 = causal_conv1d(x[3:], w, state=state)
    >>> np.concatenate([y1, y2])[:, 0]
    array([10., 21., 32., 43., 54.])
    """
    layout, x = standard_layout(seq_axis, x=x)
    caller_shape = layout.caller_shape(tuple(getattr(x, "shape", ())))
    inputs = _check_arrays(
        x, weight, bias, activation, name="x", core=2, caller_shape=caller_shape
    )
    check_flag("return_state", return_state)
    xp = inputs.xp
    width = weight.shape[1]
    lead = inputs.batch_shape
    T, channels = x.shape[-2], x.shape[-1]
    if not layout.is_standard and state is not None:
        (state,) = layout.to_standard(state=state)
    S = _check_state(
        inputs, state, (*lead, width - 1, channels), "state", standard=layout.is_standard
    )
    keep = None
    if attention_mask is not None:
        keep = check_mask(inputs, attention_mask, T, layout)
        if not xp.isdtype(keep.dtype, "bool"):
            keep = keep != 0
        x = xp.where(keep, x, 0.0)
    x = inputs.to_work_dtype(x)
    w = inputs.to_work_dtype(weight)
    b = None if bias is None else inputs.to_work_dtype(bias)
    compiled = None if keep is not None else compiled_conv(S, x, w, b)  # NumPy, with Numba
    if compiled is not None:  # one pass, the state's rows read where they are
        out, after = compiled
    else:
        ext = xp.concat([S, x], axis=-2) if width > 1 else x
        # width shifted views of one array, combined once (linear in T, forward and backward)
        out = causal_taps(xp, ext, w, b, T)
    if activation is not None:
        out = silu(out)
    if keep is not None:
        out = xp.where(keep, out, 0.0)
    out = out if out.dtype == inputs.dtype else xp.astype(out, inputs.dtype)
    out = layout.restore(out)
    if not return_state:
        return out
    if width == 1:
        new_state = S if T else xp.asarray(S, copy=True)
    elif compiled is not None:
        new_state = after  # the kernel's
    elif keep is None:
        new_state = ext[..., T:, :]
    else:
        ones = xp.ones((*keep.shape[:-2], width - 1, 1), dtype=xp.bool, device=inputs.device)
        ext_keep = xp.concat([ones, keep], axis=-2)
        ext_keep = xp.broadcast_to(ext_keep, (*lead, T + width - 1, 1))
        new_state = _last_real(xp, ext, ext_keep, width - 1)
    if T == 0 and state is not None:  # never hand back the caller's own array
        new_state = xp.asarray(new_state, copy=True)
    return out, layout.restore(new_state)


def causal_conv1d_step(
    x_t: Array,
    weight: Array,
    bias: Array | None = None,
    /,
    *,
    state: Array | None = None,
    activation: str | None = None,
    attention_mask: Array | None = None,
) -> tuple[Array, Array]:
    """One token of :func:`causal_conv1d`: the output for ``x_t`` and the state after it.

    Parameters
    ----------
    x_t : array
        ``(..., channels)``: the new input of each sequence.
    weight : array
        ``(channels, width)``, as for :func:`causal_conv1d`.
    bias : array, optional
        ``(channels,)``.
    state : array, optional
        ``(..., width - 1, channels)``: the last ``width - 1`` inputs before ``x_t`` (from
        :func:`causal_conv1d` with ``return_state=True`` or an earlier step); ``None``: zeros.
    activation : {None, "silu", "swish"}
        Applied to the sum.
    attention_mask : array of bool, optional
        ``x_t.shape[:-1]`` (size-1 axes broadcast) or ``(batch,)``: the rows that take this
        token. A row where it is False keeps its state and outputs exactly 0.

    Returns
    -------
    y_t : array
        ``(..., channels)``, the library, device and dtype of ``x_t``.
    state : array
        The state after this token (float32 for 16-bit inputs).

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_conv1d, causal_conv1d_step
    >>> rng = np.random.default_rng(0)
    >>> x, w = rng.standard_normal((6, 3)), rng.standard_normal((3, 4))
    >>> y, state = causal_conv1d(x[:4], w, activation="silu", return_state=True)
    >>> y4, state = causal_conv1d_step(x[4], w, state=state, activation="silu")
    >>> bool(np.allclose(y4, causal_conv1d(x, w, activation="silu")[4]))
    True
    """
    args = (x_t, weight, bias, state, attention_mask)
    plan, _ = _PLANS.plan(partial(_plan_step, activation=activation), args, (activation,))
    return _run_step(plan, *args)


#: :func:`causal_conv1d_step`'s checks run once per signature of its arguments and options
#: (``_inputs.steps``): a decoding loop pays them once, not at every token.
_PLANS = PlanCache()


class _StepPlan(NamedTuple):
    """What :func:`causal_conv1d_step`'s checks found, for one signature of its arguments."""

    inputs: AttentionInputs
    activation: str | None
    state_shape: tuple  # (..., width - 1, channels)
    mask_shape: tuple | None  # the token mask as (..., 1)


def _plan_step(
    x_t: Any, weight: Any, bias: Any, state: Any, attention_mask: Any, *, activation: Any
) -> tuple[_StepPlan, None]:
    """Every check of :func:`causal_conv1d_step` (those of :func:`causal_conv1d` on the token
    as a length-1 sequence included)."""
    inputs = _check_arrays(x_t, weight, bias, activation, name="x_t", core=1)
    keep = None
    if attention_mask is not None:
        keep = check_token_mask(inputs, attention_mask, token="x_t")  # (..., 1)
    x = x_t[..., None, :]
    lead = _check_arrays(x, weight, bias, activation, name="x", core=2).batch_shape
    shape = (*lead, weight.shape[1] - 1, x_t.shape[-1])
    _check_state(inputs, state, shape, "state")
    return _StepPlan(inputs, activation, shape, None if keep is None else tuple(keep.shape)), None


def _run_step(
    plan: _StepPlan,
    x_t: Any,
    weight: Any,
    bias: Any,
    state: Any,
    attention_mask: Any,
    *,
    checked: None = None,
) -> tuple[Any, Any]:
    """:func:`causal_conv1d_step`'s arithmetic (:func:`causal_conv1d`'s on one token) on
    arguments of the plan's signature."""
    inputs = plan.inputs
    xp = inputs.xp
    x = x_t[..., None, :]
    keep = None
    if attention_mask is not None:
        keep = xp.reshape(attention_mask, plan.mask_shape)
        x = xp.where(keep[..., None], x, 0.0)
    S = state
    if S is None:
        S = xp.zeros(plan.state_shape, dtype=inputs.work_dtype, device=inputs.device)
    x, w = inputs.to_work_dtype(x), inputs.to_work_dtype(weight)
    b = None if bias is None else inputs.to_work_dtype(bias)
    compiled = None if keep is not None else compiled_conv(S, x, w, b)  # NumPy, with Numba
    if compiled is not None:
        out, new_state = compiled
        out = out[..., 0, :]
        if plan.activation is not None:
            out = silu(out)
        return (out if out.dtype == inputs.dtype else xp.astype(out, inputs.dtype)), new_state
    width = weight.shape[1]
    ext = xp.concat([S, x], axis=-2) if width > 1 else x
    # One product with the taps as rows and one sum over them: two operations on one token,
    # where the sequence form's shifted views take two per tap.
    out = xp.sum(ext * xp.matrix_transpose(w), axis=-2)
    if b is not None:
        out = out + b
    if plan.activation is not None:
        out = silu(out)
    out = out if out.dtype == inputs.dtype else xp.astype(out, inputs.dtype)
    new_state = ext[..., 1:, :] if width > 1 else S
    if keep is not None:
        old = state
        if old is None:
            old = xp.zeros(new_state.shape, dtype=new_state.dtype, device=inputs.device)
        new_state = xp.where(keep[..., None], new_state, old)
        out = xp.where(keep, out, 0.0)
    return out, new_state
