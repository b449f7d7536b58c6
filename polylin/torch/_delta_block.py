"""What Gated DeltaNet and Kimi Delta Attention share: q, k, v with short convolutions, grouped
value heads, the delta rule over the whole sequence or one token, the cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..activations import sigmoid, silu
from ..delta_rule import DELTA_METHODS, delta_rule_attention, delta_rule_step
from ._blocks import Block, LayerCache, ShortConvolution, convolve, positive_int

__all__ = ["DeltaRuleBlock"]


class DeltaRuleBlock(Block):
    """The forward pass and decoding step of the delta-rule blocks.

    A subclass sets the sizes (``hidden_size``, ``num_heads``, ``num_v_heads``, ``head_k_dim``,
    ``head_v_dim``, ``key_dim``, ``value_dim``), ``use_short_conv``, ``method``,
    ``chunk_size``, the projections ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``, the
    convolutions, and defines :meth:`_log_decay` and :meth:`_output`.

    Heads are laid out ``(..., num_heads, group, d)`` with ``group = num_v_heads //
    num_heads``: query/key head ``h`` serves value heads ``h * group .. h * group + group - 1``
    by broadcasting (q and k have a size-1 group axis; nothing is copied).
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

    def _log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """The log decay per token: ``(..., num_heads, group, 1 or head_k_dim)``."""
        raise NotImplementedError

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output norm, gate and projection of ``o`` ``(..., num_v_heads, head_v_dim)``."""
        raise NotImplementedError

    @property
    def _group(self) -> int:
        return self.num_v_heads // self.num_heads

    def _grouped(self, t: torch.Tensor, size: int) -> torch.Tensor:
        """``(..., num_v_heads * size)`` as ``(..., num_heads, group, size)``."""
        return t.view(*t.shape[:-1], self.num_heads, self._group, size)

    def _convs(self) -> list[ShortConvolution]:
        return [self.q_conv1d, self.k_conv1d, self.v_conv1d] if self.use_short_conv else []

    def _cache_sizes(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads, "num_v_heads": self.num_v_heads,
            "head_dim": self.head_k_dim, "head_v_dim": self.head_v_dim,
            "use_short_conv": self.use_short_conv, "conv_size": self.conv_size,
        }  # fmt: skip

    def _qkv(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None, *, one: bool
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """q, k, v after their convolutions, split into heads (``one``: a single token)."""
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        states = None if cache is None else cache.conv_state
        if self.use_short_conv:
            projected, conv_state = convolve(self._convs(), projected, mask, states, one=one)
        else:
            projected, conv_state = [silu(p) for p in projected], ()
        lead = x.shape[:-1]
        q, k = (p.view(*lead, self.num_heads, 1, self.head_k_dim) for p in projected[:2])
        v = self._grouped(projected[2], self.head_v_dim)
        return [q, k, v], conv_state

    def _coefficients(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``beta`` ``(..., num_heads, group, 1)`` and the log decay, in ``dtype``."""
        beta = sigmoid(self.b_proj(x))
        if self.allow_neg_eigval:
            beta = 2.0 * beta
        return self._grouped(beta.to(dtype), 1), self._log_decay(x).to(dtype)

    def _state_in(self, cache: LayerCache | None) -> torch.Tensor | None:
        """The cache's ``(batch, num_v_heads, d_k, d_v)`` state as the functions take it."""
        if cache is None:
            return None
        S = cache.recurrent_state
        return S.view(S.shape[0], self.num_heads, self._group, *S.shape[2:])

    def _cache(self, conv_state: tuple[torch.Tensor, ...], S: torch.Tensor) -> LayerCache:
        return LayerCache(conv_state, S.reshape(S.shape[0], self.num_v_heads, *S.shape[3:]))

    def _sequence(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None
    ) -> tuple[torch.Tensor, LayerCache]:
        (q, k, v), conv_state = self._qkv(x, mask, cache, one=False)
        beta, g = self._coefficients(x, q.dtype)
        o, S = delta_rule_attention(
            q, k, v, beta, log_decay=g, scale=self.head_k_dim**-0.5, qk_l2norm=True,
            method=self.method, chunk_size=self.chunk_size, initial_state=self._state_in(cache),
            return_state=True, attention_mask=mask, seq_axis=1,
        )  # fmt: skip
        o = o.reshape(*x.shape[:2], self.num_v_heads, self.head_v_dim)
        return self._output(o, x), self._cache(conv_state, S)

    def _token(
        self, x_t: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None
    ) -> tuple[torch.Tensor, LayerCache]:
        (q, k, v), conv_state = self._qkv(x_t, mask, cache, one=True)
        beta, g = self._coefficients(x_t, q.dtype)
        S0 = self._state_in(cache)
        o, S = delta_rule_step(
            q, k, v, beta, S0, log_decay=g, scale=self.head_k_dim**-0.5, qk_l2norm=True
        )
        if mask is not None:  # the rows that do not take the token keep their state
            S = torch.where(mask[:, None, None, None, None], S, 0.0 if S0 is None else S0)
        o = o.reshape(x_t.shape[0], self.num_v_heads, self.head_v_dim)
        return self._output(o, x_t), self._cache(conv_state, S)
