"""The Mamba-2 (SSD) mixers: Mamba2, Bamba, GraniteMoeHybrid, FalconH1, NemotronH, Zamba2.

transformers 5.23 gives the six families one mixer ``forward`` (copied per model) that calls
module-level kernels: mamba_ssm's and causal-conv1d's when they import, and otherwise
pure-PyTorch ones (``causal_conv1d_fn``, ``causal_conv1d_update``, ``mamba2_chunk_scan``,
``mamba2_selective_state_update``). A converted mixer gets :func:`_ssd_forward` instead, which
computes the same layer on polylin's functions:

- the short convolution with :func:`polylin.causal_conv1d` (prefill, training) and
  :func:`polylin.causal_conv1d_step` (one token);
- the SSD scan ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t`` with
  :func:`polylin.causal_linear_attention` (``q = C``, ``k = B``, ``v = dt x``, ``log_decay =
  dt A``, ``normalize=False``; the heads of a group broadcast against its ``B`` and ``C``) and,
  per token, a prepared :func:`polylin.step`;
- the gated RMSNorm with :func:`polylin.rms_norm`.

The cache is transformers' own: the convolution state ``(batch, conv_dim, conv_kernel)`` and
the SSM state ``(batch, num_heads, head_dim, state_size)``, read and written where transformers
does (``get_conv_state`` / ``update_conv_state``, ``get_recurrent_state`` /
``update_recurrent_state``; a decoded token updates both in place).

The families differ in attribute values, read from the layer (norm groups, eps, the gate's
order, ``time_step_limit``), and in one step: FalconH1 scales the input by
``ssm_in_multiplier`` and the projection by ``mup_vector`` (:class:`SSDVariant`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from ... import (
    LinearAttentionState,
    causal_conv1d,
    causal_conv1d_step,
    causal_linear_attention,
    prepare_step,
    rms_norm,
)
from ...feature_maps import identity
from ._rebind import rebind
from ._registry import Conversion

#: The module-level kernels a mixer's forward calls (transformers' pure-PyTorch fallbacks
#: behind its ``use_kernel_func_from_hub_with_fallback`` decorator).
KERNELS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba2_split_conv1d_scan_combined",
    "mamba2_selective_state_update",
    "mamba2_chunk_scan",
)


@dataclass(frozen=True)
class SSDVariant:
    """What one family's mixer does that the others do not.

    Parameters
    ----------
    multipliers : bool
        FalconH1's muP scaling: the input times ``ssm_in_multiplier`` before ``in_proj``, the
        projection times ``mup_vector`` after it.
    """

    multipliers: bool = False


def _torch() -> Any:
    import torch

    return torch


def _refuse_packed(kwargs: dict[str, Any]) -> None:
    """transformers' fallback refuses packed sequences (``seq_idx``, ``cu_seqlens``); so do we,
    rather than let one sequence's state run into the next."""
    for name in ("seq_idx", "cu_seqlens"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name} (packed sequences) is not supported by the polylin Mamba-2 layers: "
                "pass a padded batch with an attention_mask instead"
            )


def _fire_conv_hook(layer: Any) -> Any:
    """accelerate's offloading hook of ``conv1d``, whose weights are read directly (the class's
    ``force_accelerate_hooks("conv1d")``)."""
    hook = getattr(layer.conv1d, "_hf_hook", None)
    if hook is not None:
        hook.pre_forward(layer.conv1d)
    return hook


def _work_dtype(torch: Any, dtype: Any) -> Any:
    """float32 for 16-bit models (transformers' scan runs in float32), else the model's."""
    return torch.promote_types(dtype, torch.float32)


def _project(layer: Any, variant: SSDVariant, hidden: Any, keep: Any) -> tuple[Any, Any, Any]:
    """``gate``, ``xBC`` and ``dt`` from the in-projection; padded tokens are zeros first
    (transformers' ``apply_mask_to_padding_states``, by selection)."""
    torch = _torch()
    if keep is not None:
        hidden = torch.where(keep[..., None], hidden, 0.0).to(hidden.dtype)
    if variant.multipliers:
        hidden = hidden * layer.ssm_in_multiplier
    projected = layer.in_proj(hidden)
    if variant.multipliers:
        projected = projected * layer.mup_vector
    sizes = [layer.intermediate_size, layer.conv_dim, layer.num_heads]
    gate, xBC, dt = projected.split(sizes, dim=-1)
    return gate, xBC, dt


def _ssm_inputs(layer: Any, xBC: Any, dt: Any, *, clamp: bool) -> tuple[Any, ...]:
    """``q = C``, ``k = B``, ``v = dt x``, the log decay ``dt A`` and ``x``, grouped.

    ``xBC`` is ``(*lead, conv_dim)``, ``dt`` ``(*lead, num_heads)``. ``x``, ``v`` and the decay
    are ``(*lead, n_groups, heads per group, d)``, ``B`` and ``C`` ``(*lead, n_groups, 1,
    state_size)``: head ``h`` reads group ``h // (num_heads // n_groups)``, by broadcasting.
    transformers clamps ``dt`` to ``time_step_limit`` in its chunked scan only (``clamp``), not
    in its one-token update (neither does mamba_ssm's).
    """
    torch = _torch()
    lead = xBC.shape[:-1]
    groups, per_group = layer.n_groups, layer.num_heads // layer.n_groups
    width = layer.n_groups * layer.ssm_state_size
    x, B, C = xBC.split([layer.intermediate_size, width, width], dim=-1)
    x = x.reshape(*lead, groups, per_group, layer.head_dim)
    B, C = (t.reshape(*lead, groups, 1, layer.ssm_state_size) for t in (B, C))
    dt = torch.nn.functional.softplus(dt + layer.dt_bias.to(dt.dtype))
    low, high = layer.time_step_limit
    if clamp and (low > 0.0 or high < math.inf):
        dt = torch.clamp(dt, min=low, max=high)
    dt = dt.reshape(*lead, groups, per_group, 1)
    log_decay = dt * -torch.exp(layer.A_log.to(dt.dtype)).reshape(groups, per_group, 1)
    return C, B, x * dt, log_decay, x


def _output(layer: Any, y: Any, x: Any, gate: Any, dtype: Any) -> Any:
    """``y + D x``, the gated RMSNorm (or FalconH1's ``silu`` gate without it), ``out_proj``.

    ``y`` and ``x`` are ``(*lead, n_groups, heads per group, head_dim)`` in the work dtype.
    """
    torch = _torch()
    D = layer.D.reshape(layer.n_groups, -1, 1).to(y.dtype)
    y = (y + x * D).reshape(*gate.shape)
    gate = gate.to(y.dtype)
    norm = layer.norm
    if isinstance(norm, torch.nn.Identity):  # FalconH1 with mamba_rms_norm=False
        y = y * torch.nn.functional.silu(gate)
    else:
        groups = getattr(norm, "n_groups", None) or layer.intermediate_size // norm.group_size
        split = (*gate.shape[:-1], groups, -1)
        y = rms_norm(
            y.reshape(split), norm.weight.reshape(groups, -1).to(y.dtype), gate=gate.reshape(split),
            eps=norm.variance_epsilon, norm_before_gate=getattr(norm, "norm_before_gate", False),
        ).reshape(*gate.shape)  # fmt: skip
    return layer.out_proj(y.to(dtype))


def _grouped(layer: Any, state: Any, dtype: Any) -> LinearAttentionState:
    """transformers' SSM state ``(batch, heads, head_dim, state_size)`` as polylin's grouped
    ``S`` of ``(batch, n_groups, heads per group, state_size, head_dim)`` (a view) and a zero
    ``z`` (unused without normalization)."""
    torch = _torch()
    batch, groups = state.shape[0], layer.n_groups
    S = state.reshape(batch, groups, -1, *state.shape[2:]).transpose(-1, -2).to(dtype)
    z = torch.zeros((batch, groups, 1, S.shape[-2]), dtype=dtype, device=S.device)
    return LinearAttentionState(S, z)


def _ungrouped(S: Any) -> Any:
    """polylin's grouped ``S`` back in transformers' layout."""
    return S.transpose(-1, -2).reshape(S.shape[0], -1, S.shape[-1], S.shape[-2])


def _sequence(
    layer: Any, variant: SSDVariant, hidden: Any, cache: Any, keep: Any, state: Any
) -> Any:
    """Prefill and training: the whole sequence at once (continuing the cache if it has a
    state)."""
    torch = _torch()
    batch, length = hidden.shape[:2]
    dtype, work = hidden.dtype, _work_dtype(torch, hidden.dtype)
    gate, xBC, dt = _project(layer, variant, hidden, keep)
    weight, bias = layer.conv1d.weight[:, 0], layer.conv1d.bias
    conv_keep = keep
    if cache is not None:
        # transformers' update: the new inputs (zeros where padded) after the cached ones; the
        # cache keeps the last conv_kernel of them, and the convolution sees them all.
        new = xBC if keep is None else torch.where(keep[..., None], xBC, 0.0)
        xBC = cache.update_conv_state(
            new.transpose(1, 2), layer.layer_idx, conv_kernel_size=layer.conv_kernel_size
        ).transpose(1, 2)
        if keep is not None:
            before = torch.ones(
                (batch, xBC.shape[1] - length), dtype=torch.bool, device=keep.device
            )
            conv_keep = torch.cat([before, keep], dim=1)
    conv: Any = causal_conv1d(
        xBC, weight, bias, activation=layer.activation, attention_mask=conv_keep
    )
    xBC = conv[:, -length:]
    q, k, v, log_decay, x = (t.to(work) for t in _ssm_inputs(layer, xBC, dt.to(work), clamp=True))
    y, final = causal_linear_attention(
        q, k, v, identity, initial_state=None if state is None else _grouped(layer, state, work),
        return_state=True, attention_mask=keep, seq_axis=1, log_decay=log_decay,
        normalize=False,
    )  # fmt: skip
    if cache is not None:
        cache.update_recurrent_state(_ungrouped(final.S), layer.layer_idx)
    return _output(layer, y, x, gate, dtype)


def _token(
    layer: Any, variant: SSDVariant, step: Any, hidden: Any, conv_state: Any, state: Any
) -> Any:
    """One decoded token: both cached states are updated in place, as transformers does."""
    torch = _torch()
    dtype, work = hidden.dtype, _work_dtype(torch, hidden.dtype)
    gate, xBC, dt = (t[:, 0] for t in _project(layer, variant, hidden, None))
    weight, bias = layer.conv1d.weight[:, 0], layer.conv1d.bias
    # The cache keeps conv_kernel inputs; the convolution needs the last conv_kernel - 1.
    previous = conv_state[:, :, 1:].transpose(1, 2).to(_work_dtype(torch, xBC.dtype))
    out, _ = causal_conv1d_step(xBC, weight, bias, state=previous, activation=layer.activation)
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], xBC[:, :, None].to(conv_state.dtype)], -1))
    q, k, v, log_decay, x = (t.to(work) for t in _ssm_inputs(layer, out, dt.to(work), clamp=False))
    y, new = step(q, k, v, _grouped(layer, state, work), log_decay=log_decay)
    state.copy_(_ungrouped(new.S).to(state.dtype))
    return _output(layer, y, x, gate, dtype)[:, None]


def _ssd_forward(
    layer: Any,
    variant: SSDVariant,
    step: Any,
    hidden_states: Any,
    cache_params: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> Any:
    """The mixer's forward on polylin (the signature of transformers' mixers)."""
    _refuse_packed(kwargs)
    length = hidden_states.shape[1]
    conv_state = state = None
    if cache_params is not None:
        conv_state = cache_params.get_conv_state(layer.layer_idx, state_idx=0)
        state = cache_params.get_recurrent_state(layer.layer_idx, state_idx=0)
    keep = None if attention_mask is None else attention_mask.to(hidden_states.device) != 0
    hook = _fire_conv_hook(layer)
    decoding = (
        length == 1 and conv_state is not None and state is not None
        and not cache_params.is_recording_past(layer.layer_idx)
    )  # fmt: skip
    if decoding:  # a token is never padding (transformers passes no mask for one token)
        out = _token(layer, variant, step, hidden_states, conv_state, state)
    else:
        out = _sequence(layer, variant, hidden_states, cache_params, keep, state)
    if hook is not None:
        hook.post_forward(layer.conv1d, ())
    return out


def _conversion(model: str, variant: SSDVariant = SSDVariant()) -> Conversion:
    """The :class:`Conversion` of one family's mixer class."""

    @functools.cache
    def polylin(cls: Any) -> Any:
        # One prepared step per class: its checks run again only when the shapes change.
        decode = prepare_step(identity, normalize=False)

        def forward(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            return _ssd_forward(self, variant, decode, hidden_states, *args, **kwargs)

        forward.__qualname__ = f"polylin_{cls.__name__}.forward"
        return forward

    @functools.cache
    def fallback(cls: Any) -> Any:
        module = __import__(cls.__module__, fromlist=["_"])
        # transformers' pure-PyTorch functions, under whatever its decorators resolved.
        return rebind(cls.forward, {name: getattr(module, name).__wrapped__ for name in KERNELS})

    return Conversion("Mamba-2", (model,), polylin, fallback)


CONVERSIONS: dict[str, Conversion] = {
    "Mamba2Mixer": _conversion("mamba2"),
    "BambaMixer": _conversion("bamba"),
    "GraniteMoeHybridMambaLayer": _conversion("granitemoehybrid"),
    "FalconH1Mixer": _conversion("falcon_h1", SSDVariant(multipliers=True)),
    "NemotronHMamba2Mixer": _conversion("nemotron_h"),
    "Zamba2MambaMixer": _conversion("zamba2"),
}
