"""What Gated DeltaNet and Kimi Delta Attention share: q, k, v with short convolutions, grouped
value heads, the delta rule over the whole sequence or one token, the cache."""

from __future__ import annotations

import torch
from torch import nn

from ..activations import sigmoid, silu
from ..delta_rule import delta_rule_attention, delta_rule_step
from ._blocks import (
    LayerCache,
    ShortConvolution,
    check_cache,
    check_hidden,
    convolve,
    convolve_step,
    padding_mask,
    token_mask,
)

__all__ = ["DeltaRuleBlock"]


class DeltaRuleBlock(nn.Module):
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

    def _qkv(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None, *, one: bool
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """q, k, v after their convolutions, split into heads (``one``: a single token)."""
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        states = None if cache is None else cache.conv_state
        if self.use_short_conv:
            run = convolve_step if one else convolve
            projected, conv_state = run(self._convs(), projected, mask, states)
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

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        return_cache: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LayerCache]:
        """The block over a whole sequence (training, prefill).

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, T, hidden_size)``.
        attention_mask : torch.Tensor, optional
            ``(batch, T)``, True (or 1) for real tokens: left or right padding. Padded tokens
            are selected away before the projections: they reach no real output, no
            convolution state and no recurrent state, and their outputs are 0.
        cache : LayerCache, optional
            The cache after earlier tokens, to continue from.
        return_cache : bool
            Also return the cache after the last token.

        Returns
        -------
        torch.Tensor or (torch.Tensor, LayerCache)
            ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> x = torch.randn(2, 6, 16)
        >>> mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded
        >>> y, cache = layer(x, mask, return_cache=True)
        >>> y.shape, bool((y[0, :2] == 0).all())
        (torch.Size([2, 6, 16]), True)
        """
        check_hidden(x, "x", 3, self.hidden_size)
        check_cache(cache, len(self._convs()))
        batch, T, _ = x.shape
        mask = padding_mask(attention_mask, batch, T)
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)
        (q, k, v), conv_state = self._qkv(x, mask, cache, one=False)
        beta, g = self._coefficients(x, q.dtype)
        o, S = delta_rule_attention(
            q, k, v, beta, log_decay=g, scale=self.head_k_dim**-0.5, qk_l2norm=True,
            method=self.method, chunk_size=self.chunk_size, initial_state=self._state_in(cache),
            return_state=True, attention_mask=mask, seq_axis=1,
        )  # fmt: skip
        out = self._output(o.reshape(batch, T, self.num_v_heads, self.head_v_dim), x)
        return (out, self._cache(conv_state, S)) if return_cache else out

    def step(
        self,
        x_t: torch.Tensor,
        cache: LayerCache | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LayerCache]:
        """One new token per sequence, from the cache of the tokens before it.

        Parameters
        ----------
        x_t : torch.Tensor
            ``(batch, hidden_size)``.
        cache : LayerCache, optional
            From ``forward(..., return_cache=True)`` or an earlier ``step``; ``None`` starts
            from an empty sequence.
        attention_mask : torch.Tensor, optional
            ``(batch,)``: the rows that take this token. The others (finished sequences) keep
            their cache and output 0, whatever ``x_t`` holds there.

        Returns
        -------
        y_t : torch.Tensor
            ``(batch, hidden_size)``.
        cache : LayerCache
            The cache after this token.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> y_t, cache = layer.step(torch.randn(3, 16))   # the first token of 3 sequences
        >>> y_t, cache = layer.step(torch.randn(3, 16), cache)
        >>> y_t.shape
        torch.Size([3, 16])
        """
        check_hidden(x_t, "x_t", 2, self.hidden_size)
        check_cache(cache, len(self._convs()))
        mask = token_mask(attention_mask, x_t.shape[0])
        if mask is not None:
            x_t = torch.where(mask[:, None], x_t, 0.0)
        (q, k, v), conv_state = self._qkv(x_t, mask, cache, one=True)
        beta, g = self._coefficients(x_t, q.dtype)
        S0 = self._state_in(cache)
        o, S = delta_rule_step(
            q, k, v, beta, S0, log_decay=g, scale=self.head_k_dim**-0.5, qk_l2norm=True
        )
        y = self._output(o.reshape(x_t.shape[0], self.num_v_heads, self.head_v_dim), x_t)
        if mask is not None:
            S = torch.where(mask[:, None, None, None, None], S, 0.0 if S0 is None else S0)
            y = torch.where(mask[:, None], y, 0.0)
        return y, self._cache(conv_state, S)
