"""What the Gated DeltaNet and Kimi Delta Attention modules share: the sizes, the input
projections and short convolutions as parameters, the cache; the computation is
:mod:`polylin.blocks`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..delta_rule import DELTA_METHODS
from ._blocks import Block, LayerCache, ShortConvolution, positive_int

__all__ = ["DeltaRuleBlock"]


class DeltaRuleBlock(Block):
    """The forward pass and decoding step of the delta-rule blocks.

    A subclass sets the sizes (``hidden_size``, ``num_heads``, ``num_v_heads``, ``head_k_dim``,
    ``head_v_dim``, ``key_dim``, ``value_dim``), ``use_short_conv``, ``method``,
    ``chunk_size``, the projections ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``, the
    convolutions and the rest of its parameters, and names its functions of
    :mod:`polylin.blocks` (``_block``, ``_block_step``), which compute every number from the
    parameters by their state-dict names.
    """

    hidden_size: int
    num_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    key_dim: int
    value_dim: int
    use_short_conv: bool
    allow_neg_eigval: bool
    method: str
    chunk_size: int
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    b_proj: nn.Linear
    q_conv1d: ShortConvolution
    k_conv1d: ShortConvolution
    v_conv1d: ShortConvolution

    def _init_heads(
        self,
        *,
        hidden_size: int,
        expand_v: float,
        head_dim: int,
        num_heads: int,
        num_v_heads: int | None,
        method: str,
        chunk_size: int,
        use_short_conv: bool,
        allow_neg_eigval: bool,
        conv_size: int,
        conv_bias: bool,
        norm_eps: float,
        device: Any,
        dtype: Any,
    ) -> dict[str, Any]:
        """Check the shared options, set the sizes, make ``q_proj``, ``k_proj``, ``v_proj``,
        ``b_proj`` and the convolutions; returns the factory options for the rest."""
        for name, value in (
            ("hidden_size", hidden_size), ("head_dim", head_dim), ("num_heads", num_heads),
            ("conv_size", conv_size), ("chunk_size", chunk_size),
        ):  # fmt: skip
            positive_int(name, value)
        v_heads = num_heads if num_v_heads is None else positive_int("num_v_heads", num_v_heads)
        if v_heads % num_heads:
            raise ValueError(f"num_v_heads={v_heads} must be a multiple of {num_heads=}")
        head_v_dim = head_dim * expand_v
        if not math.isclose(head_v_dim, round(head_v_dim)) or round(head_v_dim) < 1:
            raise ValueError(
                f"head_dim * expand_v = {head_dim} * {expand_v} must be a positive integer"
            )
        if method not in DELTA_METHODS:
            raise ValueError(f"method must be one of {DELTA_METHODS}, got {method!r}")
        self.hidden_size, self.expand_v, self.head_dim = hidden_size, expand_v, head_dim
        self.num_heads, self.num_v_heads = num_heads, v_heads
        self.head_k_dim, self.head_v_dim = head_dim, round(head_v_dim)
        self.key_dim, self.value_dim = num_heads * head_dim, v_heads * self.head_v_dim
        self.method, self.chunk_size = method, chunk_size
        self.use_short_conv, self.allow_neg_eigval = use_short_conv, allow_neg_eigval
        self.conv_size, self.conv_bias, self.norm_eps = conv_size, conv_bias, norm_eps
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **kw)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **kw)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **kw)
        self.b_proj = nn.Linear(hidden_size, v_heads, bias=False, **kw)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **kw)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **kw)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, **kw)
        return kw

    #: The block function of :mod:`polylin.blocks` and its step.
    _block: Any
    _block_step: Any

    def _options(self) -> dict[str, Any]:
        """The block function's options that the parameters' shapes do not give."""
        return {
            "num_heads": self.num_heads, "allow_neg_eigval": self.allow_neg_eigval,
            "norm_eps": self.norm_eps, "method": self.method, "chunk_size": self.chunk_size,
        }  # fmt: skip

    def _params(self) -> dict[str, torch.Tensor]:
        """The parameters by their state-dict names, as the block functions take them; under
        ``torch.compile`` as plain tensor views (it traces polylin's checks of a tensor, not of
        an ``nn.Parameter``; eagerly the views would cost 50 us a call)."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        if torch.compiler.is_compiling():
            return {name: p[...] for name, p in params.items()}
        return params

    def _convs(self) -> list[ShortConvolution]:
        return [self.q_conv1d, self.k_conv1d, self.v_conv1d] if self.use_short_conv else []

    def _cache_sizes(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads, "num_v_heads": self.num_v_heads,
            "head_dim": self.head_k_dim, "head_v_dim": self.head_v_dim,
            "use_short_conv": self.use_short_conv, "conv_size": self.conv_size,
        }  # fmt: skip

    def _sequence(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        return self._block(
            self._params(), x, attention_mask=mask, cache=cache, return_cache=True,
            **self._options(),
        )  # fmt: skip

    def _token(
        self, x_t: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        return self._block_step(
            self._params(), x_t, cache, attention_mask=mask, **self._options()
        )
