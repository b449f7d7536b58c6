"""The gated short convolutions of LFM2 and its kin, by kernel rebinding.

transformers computes these layers' depthwise causal convolution with two module-level
functions, ``causal_conv1d_fn`` (a whole sequence) and ``causal_conv1d_update`` (decoding:
the new inputs against the cached last ``width`` inputs, updated in place). Their twins here
compute on :func:`polylin.causal_conv1d` and :func:`polylin.causal_conv1d_step` in
transformers' layout (channels first, ``(batch, channels, T)``) and keep the cache's own
tensor: ``(batch, channels, width)``, written in place as transformers writes it. The Gated
DeltaNet and KDA layers (``_delta.py``) call the same two functions and rebind them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import causal_conv1d, causal_conv1d_step
from ...interop import array_namespace, work_dtype_for
from ._rebind import by_rebinding
from ._registry import Conversion


def _to(x: Any, dtype: Any) -> Any:
    return x if x.dtype == dtype else array_namespace(x).astype(x, dtype)


def polylin_causal_conv1d_fn(
    hidden_states: Any,
    weight: Any,
    bias: Any = None,
    activation: str | None = None,
    **kwargs: Any,
) -> Any:
    """transformers' ``causal_conv1d_fn`` on :func:`polylin.causal_conv1d`.

    ``hidden_states`` ``(batch, channels, T)``, ``weight`` ``(channels, width)``; computed in
    the weight's dtype and returned in the input's, as transformers does. Other keywords
    (``seq_idx``) are ignored, as transformers' own function ignores them.
    """
    xp = array_namespace(hidden_states)
    # polylin's layout (batch, T, channels) is a view: the model made these from (batch, T, ...)
    x = xp.matrix_transpose(_to(hidden_states, weight.dtype))
    out = causal_conv1d(x, weight, bias, activation=activation)
    return _to(xp.matrix_transpose(out), hidden_states.dtype)


def polylin_causal_conv1d_update(
    hidden_states: Any,
    conv_state: Any,
    weight: Any,
    bias: Any = None,
    activation: str | None = None,
) -> Any:
    """transformers' ``causal_conv1d_update`` on :func:`polylin.causal_conv1d_step`.

    ``hidden_states`` ``(batch, channels, T)`` continue the cached ``conv_state`` ``(batch,
    channels, width)`` (transformers' cache tensor: its last ``width - 1`` columns are polylin's
    state), which is updated in place to the last ``width`` inputs.
    """
    xp = array_namespace(hidden_states)
    x = xp.matrix_transpose(_to(hidden_states, weight.dtype))  # (batch, T, channels)
    width, T = weight.shape[-1], x.shape[-2]
    work = work_dtype_for(xp, x.dtype)
    state = xp.matrix_transpose(conv_state[..., conv_state.shape[-1] - (width - 1) :])
    state = _to(state, work)
    if T == 1:
        out, _ = causal_conv1d_step(x[..., 0, :], weight, bias, state=state, activation=activation)
        out = out[..., None, :]
    else:
        out = causal_conv1d(x, weight, bias, activation=activation, state=state)
    out = xp.matrix_transpose(out)
    joined = xp.concat([conv_state, _to(hidden_states, conv_state.dtype)], axis=-1)
    conv_state.copy_(joined[..., joined.shape[-1] - conv_state.shape[-1] :])
    return _to(out, hidden_states.dtype)


#: transformers' short-convolution kernel names and polylin's functions for them.
CONV_KERNELS: dict[str, Callable[..., Any]] = {
    "causal_conv1d_fn": polylin_causal_conv1d_fn,
    "causal_conv1d_update": polylin_causal_conv1d_update,
}


CONVERSIONS: dict[str, Conversion] = {
    "Lfm2ShortConv": by_rebinding("short convolution", ("lfm2", "lfm2_vl"), CONV_KERNELS),
    "Lfm2MoeShortConv": by_rebinding("short convolution", ("lfm2_moe",), CONV_KERNELS),
    "Lfm3ShortConv": by_rebinding("short convolution", ("lfm3", "lfm3_vl"), CONV_KERNELS),
    "InklingShortConvolution": by_rebinding("short convolution", ("inkling",), CONV_KERNELS),
    "Inkling2ShortConvolution": by_rebinding("short convolution", ("inkling2",), CONV_KERNELS),
}
