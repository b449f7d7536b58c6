""":class:`LinearAttention`: a multi-head attention layer with the usual projections.

Use it where a model has a softmax self-attention layer, train it with ``forward``, and decode
one token at a time with ``step`` and a fixed-size state instead of a KV cache.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import DEFAULT_CHUNK_SIZE, DEFAULT_EPS, LinearAttentionState, feature_maps
from ..attention import METHODS, causal_linear_attention, linear_attention
from ..decoding import step as _step
from ._blocks import LayerCache, padding_mask

__all__ = ["LinearAttention"]


class LinearAttention(nn.Module):
    r"""Multi-head linear attention: projections, heads, a feature map, and a decoding state.

    ``x`` of shape ``(batch, T, embed_dim)`` is projected to queries, keys and values,
    split into ``num_heads`` heads of size ``head_dim``, attended with
    :func:`polylin.causal_linear_attention` (or :func:`polylin.linear_attention` when
    ``causal=False``), merged and projected back to ``embed_dim``. The layer only arranges
    tensors: every number comes from those functions.

    Parameters
    ----------
    embed_dim : int
        Size of the model's hidden vectors, the last axis of ``x`` and of the output.
    num_heads : int
        Number of attention heads.
    head_dim : int, optional
        Size of each head's queries, keys and values; default ``embed_dim // num_heads`` (then
        ``embed_dim`` must be a multiple of ``num_heads``).
    feature_map : callable, optional
        Positive feature map applied to each head's queries and keys; default
        :func:`polylin.feature_maps.elu_plus_one`. A map with its own size, such as
        ``favor_plus(head_dim, ...)``, is built for ``head_dim``. An :class:`torch.nn.Module`
        (a learned feature map) is registered as a submodule and trained with the layer. A
        factory itself (``favor_plus`` rather than ``favor_plus(head_dim)``) is a ``TypeError``.
    causal : bool
        ``True`` (default): token t attends to tokens ``<= t`` (decoders, language models; the
        layer then has a state and ``step``). ``False``: every token attends to every token
        (encoders).
    bias : bool
        Whether the four projections have a bias.
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the causal forward pass (see :func:`polylin.causal_linear_attention`).
    chunk_size : int
        Chunk length of the chunked form.
    eps : float
        Added to the normalizer; must be > 0.
    normalize : bool
        Divide by the normalizer ``phi(q_t) . z_t + eps`` (default); ``False`` returns the
        numerator ``phi(q_t) S_t`` (RetNet, GLA: see :func:`polylin.causal_linear_attention`).
    device, dtype : optional
        Where and in which dtype to create the projection weights (as for
        :class:`torch.nn.Linear`).

    Attributes
    ----------
    q_proj, k_proj, v_proj : torch.nn.Linear
        ``embed_dim -> num_heads * head_dim``.
    out_proj : torch.nn.Linear
        ``num_heads * head_dim -> embed_dim``.

    See Also
    --------
    polylin.causal_linear_attention : The function every causal forward pass calls.
    polylin.step : The function every decoding step calls.

    Notes
    -----
    The state after a prefix is a :class:`polylin.LinearAttentionState` with ``S`` of shape
    ``(batch, num_heads, d_phi, head_dim)`` and ``z`` of shape ``(batch, num_heads, d_phi)``
    (``d_phi = head_dim`` for the default feature map): its size does not grow with the
    sequence. Positions where ``attention_mask`` is False take no part in attention; their
    output is ``out_proj`` of zeros, i.e. ``out_proj.bias``.

    A decay of the state (RetNet, gated linear attention) is the job of :meth:`log_decay`,
    which returns ``None`` here: a subclass overrides it to return a fixed decay per head or a
    gate per token and head computed from ``x``.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import LinearAttention
    >>> _ = torch.manual_seed(0)
    >>> layer = LinearAttention(embed_dim=32, num_heads=4)
    >>> x = torch.randn(2, 10, 32)                    # (batch, T, embed_dim)
    >>> layer(x).shape
    torch.Size([2, 10, 32])

    Prefill a prompt, then decode token by token from the returned state: the outputs are
    those of one forward pass over the whole sequence.

    >>> prompt, state = layer(x[:, :7], return_state=True)
    >>> steps = []
    >>> for t in range(7, 10):
    ...     y_t, state = layer.step(x[:, t], state)
    ...     steps.append(y_t)
    >>> torch.allclose(torch.stack(steps, dim=1), layer(x)[:, 7:], atol=1e-5)
    True
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        feature_map: Callable[[Any], Any] | None = None,
        causal: bool = True,
        bias: bool = True,
        method: str = "chunked",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        eps: float = DEFAULT_EPS,
        normalize: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim={embed_dim} is not a multiple of num_heads={num_heads}; "
                    "pass head_dim"
                )
            head_dim = embed_dim // num_heads
        elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        feature_maps.resolve_feature_map(feature_map, dim=head_dim)  # not a factory itself
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.causal, self.method, self.chunk_size, self.eps = causal, method, chunk_size, eps
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        self.feature_map, self.normalize = feature_map, normalize
        inner = num_heads * head_dim
        kwargs = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, inner, **kwargs)
        self.k_proj = nn.Linear(embed_dim, inner, **kwargs)
        self.v_proj = nn.Linear(embed_dim, inner, **kwargs)
        self.out_proj = nn.Linear(inner, embed_dim, **kwargs)

    def extra_repr(self) -> str:
        """The options, shown by ``print(layer)``."""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, method={self.method!r}, feature_map={self.feature_map!r}, "
            f"normalize={self.normalize}"
        )

    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """Log decays of the state for the tokens of ``x``; ``None``: no decay (this layer).

        A subclass overrides it to decay the state before each token is added,
        ``S_t = exp(g_t) S_{t-1} + phi(k_t) v_t^T`` (RetNet, gated linear attention): one gate
        ``g_t <= 0`` per token and head. The layer passes it to the attention functions as
        ``log_decay`` (see the docs page "Decay and gating").

        Parameters
        ----------
        x : torch.Tensor
            The layer's input: ``(batch, T, embed_dim)`` in ``forward``, ``(batch, embed_dim)``
            in ``step``.

        Returns
        -------
        torch.Tensor or None
            ``None`` here. An override returns ``g`` of shape ``(*x.shape[:-1], num_heads)``
            or broadcastable to it: ``(num_heads,)`` for a fixed decay per head, or computed
            from ``x`` for a gate per token. As for the functions, values above 0 are taken
            as 0, and a number above 0 is a ``ValueError``.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import LinearAttention
        >>> LinearAttention(8, 2).log_decay(torch.zeros(1, 3, 8)) is None
        True
        """
        return None

    def _check_input(self, x: Any, name: str, rank: int, layout: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != rank or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{name} must have shape {layout} with embed_dim={self.embed_dim}, "
                f"got {tuple(x.shape)}"
            )
        weight = self.q_proj.weight
        if x.dtype != weight.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but the layer's weights have dtype {weight.dtype}; "
                f"convert the input ({name}.to({weight.dtype})) or the layer "
                f"(layer.to({x.dtype}))"
            )
        if x.device != weight.device:
            raise ValueError(
                f"{name} is on device {x.device} but the layer's weights are on {weight.device}; "
                f"move the input ({name}.to({str(weight.device)!r})) or the layer "
                f"(layer.to({str(x.device)!r}))"
            )

    def _check_state(self, state: Any) -> None:
        """A :class:`~polylin.torch.LayerCache` (another layer's cache) is not this layer's
        state: an error naming both layers, not a shape error deep inside."""
        if isinstance(state, LayerCache):
            made_by = state.made_by or "another polylin.torch layer"
            raise ValueError(
                f"state is another layer's cache: a polylin.torch.LayerCache made by {made_by}, "
                f"and this layer is LinearAttention(num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}), whose state is a polylin.LinearAttentionState; pass "
                "the state that this layer's forward(..., return_state=True) or step returned"
            )

    def _decay_options(self, x: torch.Tensor) -> dict[str, Any]:
        """The hook's gates laid out as the functions take them: ``(batch, heads, [T,] 1)``."""
        log_decay = self.log_decay(x)
        if log_decay is None:
            return {}
        if isinstance(log_decay, numbers.Real) and not isinstance(log_decay, bool):
            return {"log_decay": log_decay}  # checked by the functions, as a number
        gates = torch.as_tensor(log_decay, dtype=x.dtype, device=x.device)
        gates = gates.expand(*x.shape[:-1], self.num_heads)
        if x.ndim == 3:  # (batch, T, heads) -> (batch, heads, T)
            gates = gates.transpose(1, 2)
        return {"log_decay": gates[..., None]}

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``(..., embed_dim)`` to q, k, v of shape ``(..., num_heads, head_dim)``."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        return tuple(proj(x).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        state: LinearAttentionState | None = None,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
        """Attend over the whole sequence ``x`` (training, prefill).

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, T, embed_dim)``.
        attention_mask : torch.Tensor, optional
            ``(batch, T)``, True (or 1) for real tokens, False (or 0) for padding, left or
            right: the mask a tokenizer returns. Padded tokens add nothing to the state. Other
            values (an additive 0/-inf mask) are an error: pass ``mask == 0`` for those.
        state : LinearAttentionState, optional
            The state after earlier tokens, to continue from (causal layers only).
        return_state : bool
            Also return the state after the last token (causal layers only).

        Returns
        -------
        torch.Tensor or (torch.Tensor, LinearAttentionState)
            ``(batch, T, embed_dim)``, and the state when ``return_state``.

        Raises
        ------
        TypeError
            ``x`` or ``attention_mask`` not a tensor.
        ValueError
            Wrong shapes; ``state`` or ``return_state`` on a non-causal layer; a non-boolean
            ``attention_mask`` with values other than 0 and 1.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import LinearAttention
        >>> layer = LinearAttention(16, 2)
        >>> x = torch.randn(2, 5, 16)
        >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # row 0 is left-padded
        >>> layer(x, mask).shape
        torch.Size([2, 5, 16])
        """
        self._check_input(x, "x", 3, "(batch, T, embed_dim)")
        self._check_state(state)
        if not isinstance(return_state, bool):
            raise TypeError(
                f"return_state must be True or False, got {type(return_state).__name__}"
            )
        batch, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._heads(x))  # (batch, heads, T, head_dim)
        mask = padding_mask(attention_mask, (batch, T))
        if mask is not None:
            mask = mask[:, None, :]  # (batch, 1, T): the same for every head
        if self.causal:
            out, new_state = causal_linear_attention(
                q,
                k,
                v,
                self.feature_map,
                method=self.method,
                chunk_size=self.chunk_size,
                eps=self.eps,
                initial_state=state,
                return_state=True,
                attention_mask=mask,
                normalize=self.normalize,
                **self._decay_options(x),
            )
        else:
            if state is not None or return_state:
                raise ValueError("state and return_state need a causal layer (causal=True)")
            if self.log_decay(x) is not None:
                raise ValueError("log_decay needs a causal layer (causal=True): it decays a state")
            out = linear_attention(
                q, k, v, self.feature_map, eps=self.eps, attention_mask=mask,
                normalize=self.normalize,
            )  # fmt: skip
        # Sizes, not -1: a reshape cannot infer a size from 0 elements (T = 0).
        inner = self.num_heads * self.head_dim
        out = self.out_proj(out.transpose(1, 2).reshape(batch, T, inner))
        return (out, new_state) if return_state else out

    def step(
        self,
        x_t: torch.Tensor,
        state: LinearAttentionState | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LinearAttentionState]:
        """Attend one new token per sequence from the state of the tokens before it.

        Parameters
        ----------
        x_t : torch.Tensor
            ``(batch, embed_dim)``: the new token of each sequence.
        state : LinearAttentionState, optional
            The state after the earlier tokens (from ``forward(..., return_state=True)`` or an
            earlier ``step``); ``None`` starts from an empty sequence.
        attention_mask : torch.Tensor, optional
            ``(batch,)``, True (or 1) for the rows that take this token. A row where it is False
            (a finished sequence in a batch) keeps its state unchanged; its attention output is
            zero, so ``y_t`` there is ``out_proj.bias``.

        Returns
        -------
        y_t : torch.Tensor
            ``(batch, embed_dim)``.
        state : LinearAttentionState
            The state after this token.

        Raises
        ------
        TypeError
            ``x_t`` not a tensor.
        ValueError
            Wrong shape of ``x_t`` or ``state``; a non-causal layer.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import LinearAttention
        >>> layer = LinearAttention(16, 2)
        >>> y_t, state = layer.step(torch.randn(3, 16))   # the first token of 3 sequences
        >>> y_t.shape, state.S.shape
        (torch.Size([3, 16]), torch.Size([3, 2, 8, 8]))
        """
        if not self.causal:
            raise ValueError("step needs a causal layer (causal=True)")
        self._check_input(x_t, "x_t", 2, "(batch, embed_dim)")
        self._check_state(state)
        q_t, k_t, v_t = self._heads(x_t)  # (batch, heads, head_dim)
        options = self._decay_options(x_t)
        mask = padding_mask(attention_mask, (x_t.shape[0],))
        if mask is not None:
            options["attention_mask"] = mask
        o_t, state = _step(
            q_t, k_t, v_t, state, self.feature_map, eps=self.eps, normalize=self.normalize,
            **options,
        )  # fmt: skip
        inner = self.num_heads * self.head_dim
        return self.out_proj(o_t.reshape(x_t.shape[0], inner)), state
