"""MiniMax's lightning attention: linear attention with a fixed per-head decay.

``MiniMaxLightningAttention`` computes its recurrence inline (a Python loop over blocks for a
prompt, one over tokens when continuing from its cache), so it gets a ``forward`` of its own:
``S_t = exp(-slope_h) S_{t-1} + k_t v_t^T``, ``o_t = q_t^T S_t`` is
:func:`polylin.causal_linear_attention` with the identity feature map, ``log_decay`` the
layer's ``-slope_rate`` and no normalization, and one token against the cache is polylin's
prepared :func:`polylin.step`. The layer's projections, activation, RMSNorm and output gate are
its own modules, called as transformers calls them; the state is the one ``MiniMaxCache``
holds (``get_linear_cache`` / ``set_linear_cache``), ``(batch, heads, head_dim, head_dim)``.
"""

from __future__ import annotations

import functools
from typing import Any

from ... import LinearAttentionState, causal_linear_attention, prepare_step
from ...feature_maps import identity
from ._registry import Conversion

#: One token against the cache (arguments checked once per signature).
_STEP = prepare_step(identity, normalize=False)


def _lightning(self: Any, q: Any, k: Any, v: Any, S: Any, keep: Any) -> tuple[Any, Any]:
    """``q, k, v`` ``(batch, T, heads, d)``, ``S`` the cached state or None, ``keep`` the real
    tokens ``(batch, T)`` or None: the output ``(batch, T, heads, d)`` and the new state."""
    import torch

    batch, T, heads, d = q.shape
    log_decay = (-self.slope_rate).to(q.dtype)  # (heads, 1, 1)
    state = None
    if S is not None:
        z = torch.zeros((batch, heads, d), dtype=S.dtype, device=S.device)  # unused: no normalizer
        state = LinearAttentionState(S, z)
    if state is not None and T == 1:
        o, new = _STEP(
            q[:, 0], k[:, 0], v[:, 0], state, log_decay=log_decay[..., 0], attention_mask=None
        )
        return o[:, None], new.S
    o, new = causal_linear_attention(
        q, k, v, identity, seq_axis=1, log_decay=log_decay.view(1, 1, heads, 1),
        normalize=False, initial_state=state, return_state=True, attention_mask=keep,
    )  # fmt: skip
    return o, new.S


def _forward(
    self: Any,
    hidden_states: Any,
    position_embeddings: Any = None,
    attention_mask: Any = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``MiniMaxLightningAttention.forward`` with the recurrence on polylin."""
    import torch

    batch, T, _ = hidden_states.shape
    heads, d = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    keep = None
    if attention_mask is not None:  # the model's 2-D padding mask (None when there is none)
        keep = attention_mask.bool()
        qkv = torch.where(keep[..., None], qkv, 0.0)  # padded tokens are zeros, as in transformers
    q, k, v = torch.split(qkv.view(batch, T, heads, 3 * d), d, dim=3)
    S = past_key_values.get_linear_cache(self.layer_idx) if past_key_values is not None else None
    output, S = _lightning(self, q, k, v, S, keep)
    output = self.norm(output.reshape(batch, T, heads * d))
    output = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * output)
    if past_key_values is not None:
        past_key_values.set_linear_cache(self.layer_idx, S)
    return output, S


@functools.cache
def _polylin(cls: Any) -> Any:
    return _forward


@functools.cache
def _fallback(cls: Any) -> Any:
    # the class's own code: its inline loops are transformers' pure-PyTorch reference
    return cls.forward


CONVERSIONS: dict[str, Conversion] = {
    "MiniMaxLightningAttention": Conversion(
        "lightning attention", ("minimax",), _polylin, _fallback
    ),
}
