"""The gated linear attention block (Yang et al., 2023) on causal linear attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import DEFAULT_CHUNK_SIZE, LinearAttentionState
from ..attention import METHODS
from ..blocks import gated_linear_attention, gated_linear_attention_step
from ._blocks import Block, RMSNorm, ShortConvolution, positive_int

__all__ = ["GatedLinearAttention"]

#: The output gate's activations (``"swish"`` is SiLU).
_GATE_FNS = ("swish", "silu", "sigmoid")


class GatedLinearAttention(Block):
    r"""Gated linear attention: a per-channel forget gate, an output gate, an RMSNorm.

    For ``x`` of shape ``(batch, T, hidden_size)``, with ``key_dim = hidden_size * expand_k``
    and ``value_dim = hidden_size * expand_v`` split into ``num_heads`` heads:

    1. ``q = q_proj(x)``; ``k = k_proj(x)``, ``v = v_proj(x)`` for ``num_kv_heads`` heads (each
       serves ``num_heads // num_kv_heads`` consecutive query heads); with
       ``use_short_conv`` each through a short causal convolution and SiLU.
    2. The forget gate ``g = logsigmoid(gk_proj(x)) / gate_logit_normalizer`` (clamped below
       at ``clamp_min``), one per token, key head and key channel; ``gk_proj`` is a low-rank
       pair of linear maps. ``q`` is scaled by ``head_k_dim ** -0.5`` (after ``feature_map``).
    3. :func:`polylin.causal_linear_attention` with ``log_decay = g``, the identity feature
       map and ``normalize=False``: ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``,
       ``o_t = S_t^T q_t``.
    4. RMSNorm per head times ``gate_fn(g_proj(x))`` (``use_output_gate``), then ``o_proj``.

    Options and parameter names are those of ``fla.layers.GatedLinearAttention``; a state dict
    of one loads into the other.

    The computation is :func:`polylin.blocks.gated_linear_attention` (and its step) on the
    module's parameters.

    Parameters
    ----------
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    expand_k, expand_v : float
        ``key_dim = hidden_size * expand_k``, ``value_dim = hidden_size * expand_v`` (integers,
        multiples of ``num_heads``).
    num_heads : int
        Number of query (and output) heads.
    num_kv_heads : int, optional
        Number of key/value heads, a divisor of ``num_heads``; default ``num_heads``.
    feature_map : callable, optional
        Applied to ``q`` and ``k`` after their heads are formed; default none.
    use_short_conv : bool
        Short convolutions on ``q``, ``k`` and ``v``.
    conv_size : int
        Their width.
    conv_bias : bool
        Whether they have a bias.
    use_output_gate : bool
        Multiply the normalized output by ``gate_fn(g_proj(x))``.
    gate_fn : {"swish", "silu", "sigmoid"}
        The output gate's activation.
    elementwise_affine : bool
        Whether the output norm has a weight.
    norm_eps : float
        ``eps`` of the output norm.
    gate_logit_normalizer : float
        The forget gate's divisor.
    gate_low_rank_dim : int
        The inner size of ``gk_proj``.
    clamp_min : float, optional
        Lower bound of the forget gate (in log space).
    fuse_norm : bool
        With ``gate_fn="swish"`` and ``use_output_gate``: the gated norm is one module,
        ``g_norm_swish_gate`` (as in fla; the same numbers as ``g_norm`` then the gate).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the forward pass.
    chunk_size : int
        Chunk length of the chunked form.
    device, dtype : optional
        Where and in which dtype to create the parameters.

    Attributes
    ----------
    q_proj : torch.nn.Linear
        ``hidden_size -> key_dim``.
    k_proj, v_proj : torch.nn.Linear
        ``hidden_size -> key_dim // groups`` and ``value_dim // groups``, ``groups =
        num_heads // num_kv_heads``.
    g_proj : torch.nn.Linear
        ``hidden_size -> value_dim`` (with ``use_output_gate``).
    gk_proj : torch.nn.Sequential
        ``hidden_size -> gate_low_rank_dim`` (no bias) ``-> key_dim // groups`` (with bias).
    q_conv1d, k_conv1d, v_conv1d : ShortConvolution
        With ``use_short_conv``.
    g_norm_swish_gate or g_norm : RMSNorm
        Weight ``(head_v_dim,)``.
    o_proj : torch.nn.Linear
        ``value_dim -> hidden_size``.

    Notes
    -----
    Parameters: ``hidden_size * (key_dim + (key_dim + value_dim) / groups)`` for ``q, k, v``,
    ``hidden_size * value_dim`` for ``g_proj``, ``gate_low_rank_dim * (hidden_size + key_dim
    / groups) + key_dim / groups`` for ``gk_proj``, ``value_dim * hidden_size`` for ``o_proj``,
    ``head_v_dim`` for the norm, and ``(key_dim + (key_dim + value_dim) / groups) *
    conv_size`` for the convolutions.

    The cache is a :class:`LayerCache`: the states of ``q_conv1d``, ``k_conv1d``, ``v_conv1d``
    (none without ``use_short_conv``) and a :class:`polylin.LinearAttentionState` with ``S``
    of shape ``(batch, num_heads, head_k_dim, head_v_dim)``.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import GatedLinearAttention
    >>> _ = torch.manual_seed(0)
    >>> layer = GatedLinearAttention(hidden_size=32, num_heads=2, use_short_conv=True)
    >>> x = torch.randn(2, 10, 32)
    >>> y, cache = layer(x[:, :7], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 7], cache)
    >>> torch.allclose(y_t, layer(x)[:, 7], atol=1e-5)
    True
    """

    _state_kind = LinearAttentionState

    def __init__(
        self,
        *,
        hidden_size: int = 1024,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        feature_map: Callable[[Any], Any] | None = None,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_output_gate: bool = True,
        gate_fn: str = "swish",
        elementwise_affine: bool = True,
        norm_eps: float = 1e-5,
        gate_logit_normalizer: float = 16,
        gate_low_rank_dim: int = 16,
        clamp_min: float | None = None,
        fuse_norm: bool = True,
        method: str = "chunked",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size), ("num_heads", num_heads), ("conv_size", conv_size),
            ("gate_low_rank_dim", gate_low_rank_dim), ("chunk_size", chunk_size),
        ):  # fmt: skip
            positive_int(name, value)
        kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if num_heads % kv_heads:
            raise ValueError(f"num_kv_heads={kv_heads} must divide {num_heads=}")
        key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
        for name, dim in (("key_dim", key_dim), ("value_dim", value_dim)):
            if dim < 1 or dim % num_heads:
                raise ValueError(
                    f"{name} = hidden_size * expand = {dim} must be a positive multiple of "
                    f"{num_heads=}"
                )
        if gate_fn not in _GATE_FNS:
            raise ValueError(f"gate_fn must be one of {_GATE_FNS}, got {gate_fn!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if feature_map is not None and not callable(feature_map):
            raise TypeError(f"feature_map must be a callable, got {type(feature_map).__name__}")
        self.hidden_size, self.expand_k, self.expand_v = hidden_size, expand_k, expand_v
        self.num_heads, self.num_kv_heads = num_heads, kv_heads
        self.num_kv_groups = num_heads // kv_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.key_dim_per_group = key_dim // self.num_kv_groups
        self.value_dim_per_group = value_dim // self.num_kv_groups
        self.head_k_dim, self.head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.feature_map, self.use_short_conv = feature_map, use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.use_output_gate, self.gate_fn = use_output_gate, gate_fn
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        self.norm_eps, self.fuse_norm = norm_eps, fuse_norm
        self.method, self.chunk_size = method, chunk_size
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False, **kw)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False, **kw)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False, **kw)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, value_dim, bias=False, **kw)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, **kw)
            self.k_conv1d = ShortConvolution(
                self.key_dim_per_group, conv_size, bias=conv_bias, **kw
            )
            self.v_conv1d = ShortConvolution(
                self.value_dim_per_group, conv_size, bias=conv_bias, **kw
            )
        self.gk_proj = nn.Sequential(
            nn.Linear(hidden_size, gate_low_rank_dim, bias=False, **kw),
            nn.Linear(gate_low_rank_dim, self.key_dim_per_group, bias=True, **kw),
        )
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False, **kw)
        norm = RMSNorm(self.head_v_dim, eps=norm_eps, elementwise_affine=elementwise_affine, **kw)
        self.fuse_norm_and_gate = gate_fn == "swish" and fuse_norm and use_output_gate
        if self.fuse_norm_and_gate:
            self.g_norm_swish_gate = norm
        else:
            self.g_norm = norm

    def extra_repr(self) -> str:
        """The options, shown by ``print(layer)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_k_dim={self.head_k_dim}, "
            f"head_v_dim={self.head_v_dim}, method={self.method!r}"
        )

    def _convs(self) -> list[ShortConvolution]:
        return [self.q_conv1d, self.k_conv1d, self.v_conv1d] if self.use_short_conv else []

    def _cache_sizes(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_k_dim": self.head_k_dim, "head_v_dim": self.head_v_dim,
            "use_short_conv": self.use_short_conv, "conv_size": self.conv_size,
        }  # fmt: skip

    def _options(self) -> dict[str, Any]:
        """The block function's options that the parameters' shapes do not give."""
        return {
            "num_heads": self.num_heads, "feature_map": self.feature_map,
            "gate_fn": self.gate_fn, "fuse_norm": self.fuse_norm, "norm_eps": self.norm_eps,
            "gate_logit_normalizer": self.gate_logit_normalizer, "clamp_min": self.clamp_min,
            "method": self.method, "chunk_size": self.chunk_size,
        }  # fmt: skip

    def _sequence(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        return gated_linear_attention(
            self._params(), x, attention_mask=mask, cache=cache, return_cache=True,
            **self._options(),
        )  # fmt: skip

    def _token(
        self, x_t: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        return gated_linear_attention_step(
            self._params(), x_t, cache, attention_mask=mask, **self._options()
        )
