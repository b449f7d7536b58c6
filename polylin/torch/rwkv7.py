"""RWKV-7's time-mixing block (Peng et al., 2025) on the generalized delta rule."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import DEFAULT_DPLR_CHUNK_SIZE, DPLR_METHODS
from ..blocks import init_rwkv7, rwkv7, rwkv7_step
from ._blocks import LayerCache, check_dtype, check_hidden, padding_mask, positive_int

__all__ = ["RWKV7Attention"]

_MODES = ("chunk", "fused_recurrent")


class _LoRA(nn.Module):
    """fla's ``LoRA`` as a parameter holder: ``lora.0`` (no bias), an activation, ``lora.2``."""

    def __init__(self, input_dim: int, output_dim: int, rank: int, bias: bool, **kw: Any):
        super().__init__()
        self.lora = nn.Sequential(
            nn.Linear(input_dim, rank, bias=False, **kw),
            nn.Identity(),  # the activation: no parameters, the block applies it
            nn.Linear(rank, output_dim, bias=bias, **kw),
        )


class RWKV7Attention(nn.Module):
    r"""RWKV-7's time mixing: token shift, LoRA gates, the generalized delta rule, a group norm.

    For ``x`` of shape ``(batch, T, hidden_size)`` and the previous token ``x'`` (zeros before
    the first, the cache's token after a prefill):

    1. six mixes ``x_c = x + (x' - x) * x_c`` (``c`` in ``r, w, k, v, a, g``);
    2. ``r, k, v`` = ``r_proj, k_proj, v_proj`` of theirs; the log decay
       ``w = -exp(-1/2) sigmoid(w_lora(x_w))``, the learning rate ``a = sigmoid(a_lora(x_a))``,
       the gate ``g = g_lora(x_g)``;
    3. the value residual: layer 0 returns its ``v`` as ``v_first``, every later layer moves
       its ``v`` toward it by ``sigmoid(v_lora(x_v))``;
    4. ``kk = normalize(k * k_k)`` per head, ``k = k (1 + (a - 1) k_a)``;
    5. :func:`polylin.dplr_delta_rule` with ``q = r``, ``log_decay = w``, ``a = -kk`` and
       ``b = kk * a``: ``S_t = diag(exp(w_t)) S_{t-1} - (kk_t * a_t) (kk_t^T S_{t-1}) + k_t
       v_t^T``, ``o_t = S_t^T r_t``;
    6. ``g_norm`` (a group norm per head, ``eps = head_dim * norm_eps``), plus the bonus
       ``sum(r * k * r_k) v`` per head, times ``g``, then ``o_proj``.

    The options and parameter names are those of ``fla.layers.RWKV7Attention``: a state dict
    of one loads into the other. The computation is :func:`polylin.blocks.rwkv7` (and its
    step) on the module's parameters; the parameters are drawn by
    :func:`polylin.blocks.init_rwkv7` (fla's initialization) from torch's generator.

    Parameters
    ----------
    mode : {"chunk", "fused_recurrent"}
        fla's kernel choice: accepted and checked; both compute the same function (polylin's
        algorithm is ``method``).
    hidden_size : int
        Size of ``x``'s last axis, of the keys and of the output.
    head_dim : int, optional
        Size of each head; when given it decides the heads (``hidden_size // head_dim``).
    num_heads : int, optional
        Number of heads, used when ``head_dim`` is None.
    decay_low_rank_dim, gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim : int, optional
        The LoRA widths; default fla's (from ``hidden_size`` and ``head_dim``).
    elementwise_affine : bool
        Whether ``g_norm`` has a weight and a bias.
    norm_eps : float
        ``g_norm``'s ``eps`` is ``head_dim * norm_eps``.
    layer_idx : int, optional
        The layer's depth: layer 0 has no ``v_lora`` and makes ``v_first``; with
        ``num_hidden_layers``, fla's depth-dependent initialization.
    fuse_norm : bool
        Normalize ``kk`` as fla's fused kernels do, ``x / sqrt(|x|^2 + 1e-6)``, instead of
        ``F.normalize``'s ``x / max(|x|, 1e-12)``.
    value_dim : int, optional
        Default ``hidden_size``.
    num_hidden_layers : int, optional
        The model's depth (initialization only).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the forward pass (see :func:`polylin.dplr_delta_rule`).
    chunk_size : int
        Chunk length of the chunked form.
    device, dtype : optional
        Where and in which dtype to create the parameters.

    Attributes
    ----------
    x_r, x_w, x_k, x_v, x_a, x_g : torch.nn.Parameter
        ``(1, 1, hidden_size)``.
    k_k, k_a : torch.nn.Parameter
        ``(hidden_size,)``.
    r_k : torch.nn.Parameter
        ``(num_heads, head_dim)``.
    r_proj, k_proj : torch.nn.Linear
        ``hidden_size -> hidden_size``, no bias.
    v_proj, o_proj : torch.nn.Linear
        ``hidden_size -> value_dim`` and back, no bias.
    w_lora, a_lora, v_lora, g_lora : torch.nn.Module
        ``lora.0`` ``(rank, hidden_size)`` and ``lora.2`` ``(out, rank)`` with a bias
        (``g_lora``: none); no ``v_lora`` in layer 0.
    g_norm : torch.nn.GroupNorm
        ``num_heads`` groups of ``value_dim`` channels (a parameter holder).

    Notes
    -----
    The cache is a :class:`LayerCache`: ``conv_state`` holds the token-shift state
    ``(batch, 1, hidden_size)`` (the last real token), ``recurrent_state`` the state
    ``(batch, num_heads, head_dim, head_v_dim)``.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import RWKV7Attention
    >>> _ = torch.manual_seed(0)
    >>> first = RWKV7Attention(hidden_size=64, head_dim=16, layer_idx=0)
    >>> later = RWKV7Attention(hidden_size=64, head_dim=16, layer_idx=1)
    >>> x = torch.randn(2, 12, 64)
    >>> h, v_first = first(x, return_v_first=True)
    >>> later(x + h, v_first=v_first).shape
    torch.Size([2, 12, 64])

    Prefill, then decode token by token: the outputs of one pass over the whole sequence.

    >>> y, cache = later(x[:, :8], v_first=v_first[:, :8], return_cache=True)
    >>> steps = []
    >>> for t in range(8, 12):
    ...     y_t, cache = later.step(x[:, t], cache, v_first=v_first[:, t])
    ...     steps.append(y_t)
    >>> torch.allclose(torch.stack(steps, dim=1), later(x, v_first=v_first)[:, 8:], atol=1e-5)
    True
    """

    def __init__(
        self,
        mode: str = "chunk",
        hidden_size: int = 1024,
        head_dim: int | None = 64,
        num_heads: int | None = None,
        decay_low_rank_dim: int | None = None,
        gate_low_rank_dim: int | None = None,
        a_low_rank_dim: int | None = None,
        v_low_rank_dim: int | None = None,
        elementwise_affine: bool = True,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        fuse_norm: bool = False,
        value_dim: int | None = None,
        num_hidden_layers: int | None = None,
        *,
        method: str = "chunked",
        chunk_size: int = DEFAULT_DPLR_CHUNK_SIZE,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if method not in DPLR_METHODS:
            raise ValueError(f"method must be one of {DPLR_METHODS}, got {method!r}")
        positive_int("hidden_size", hidden_size)
        positive_int("chunk_size", chunk_size)
        self.mode, self.method, self.chunk_size = mode, method, chunk_size
        self.hidden_size, self.norm_eps, self.fuse_norm = hidden_size, norm_eps, fuse_norm
        self.layer_idx, self.num_hidden_layers = layer_idx, num_hidden_layers
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
        params = init_rwkv7(
            torch, hidden_size=hidden_size, head_dim=head_dim, num_heads=num_heads,
            decay_low_rank_dim=decay_low_rank_dim, gate_low_rank_dim=gate_low_rank_dim,
            a_low_rank_dim=a_low_rank_dim, v_low_rank_dim=v_low_rank_dim,
            elementwise_affine=elementwise_affine, layer_idx=layer_idx,
            num_hidden_layers=num_hidden_layers, value_dim=value_dim, seed=seed,
            dtype=dtype or torch.get_default_dtype(), device=device,
        )  # fmt: skip
        self.num_heads, self.head_dim = params["r_k"].shape
        self.key_dim, self.value_dim = hidden_size, params["v_proj.weight"].shape[0]
        self.head_v_dim = self.value_dim // self.num_heads
        kw = {"device": device, "dtype": dtype}
        for n in "rwkvag":
            setattr(self, f"x_{n}", nn.Parameter(params[f"x_{n}"]))
        self.k_k, self.k_a, self.r_k = (nn.Parameter(params[n]) for n in ("k_k", "k_a", "r_k"))
        self.r_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **kw)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **kw)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **kw)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)
        for n, out in (("w", self.key_dim), ("v", self.value_dim), ("a", self.key_dim),
                       ("g", self.value_dim)):  # fmt: skip
            if f"{n}_lora.lora.0.weight" in params:
                rank = params[f"{n}_lora.lora.0.weight"].shape[0]
                setattr(self, f"{n}_lora", _LoRA(hidden_size, out, rank, n != "g", **kw))
        self.g_norm = nn.GroupNorm(
            self.num_heads, self.value_dim, eps=self.head_dim * norm_eps,
            affine=elementwise_affine, **kw,
        )  # fmt: skip
        with torch.no_grad():
            self.load_state_dict(params)

    def extra_repr(self) -> str:
        """The options, shown by ``print(layer)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, "
            f"layer_idx={self.layer_idx}, method={self.method!r}"
        )

    def _options(self) -> dict[str, Any]:
        return {
            "norm_eps": self.norm_eps, "fuse_norm": self.fuse_norm, "method": self.method,
            "chunk_size": self.chunk_size,
        }  # fmt: skip

    def _params(self) -> dict[str, torch.Tensor]:
        """The parameters by their state-dict names (plain tensor views under
        ``torch.compile``, which traces polylin's checks of a tensor)."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        if torch.compiler.is_compiling():
            return {name: p[...] for name, p in params.items()}
        return params

    def _made_by(self) -> str:
        return (
            f"RWKV7Attention(hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, head_v_dim={self.head_v_dim})"
        )

    def _check_cache(self, cache: Any) -> None:
        if cache is None:
            return
        if not isinstance(cache, LayerCache):
            raise TypeError(f"cache must be a polylin.torch.LayerCache, got {type(cache).__name__}")
        if cache.made_by is not None and cache.made_by != self._made_by():
            raise ValueError(
                f"cache is another layer's cache: it was made by {cache.made_by}, and this "
                f"layer is {self._made_by()}; pass the cache that this layer's "
                "forward(..., return_cache=True) or step returned"
            )

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        return_cache: bool = False,
        *,
        v_first: torch.Tensor | None = None,
        return_v_first: bool = False,
    ) -> Any:
        """The block over a whole sequence (training, prefill).

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, T, hidden_size)``.
        attention_mask : torch.Tensor, optional
            ``(batch, T)``, True (or 1) for real tokens: left or right padding. Padded tokens
            reach no real output, no token-shift state and no recurrent state; their outputs
            are 0.
        cache : LayerCache, optional
            The cache after earlier tokens, to continue from.
        return_cache : bool
            Also return the cache after the last token.
        v_first : torch.Tensor, optional
            ``(batch, T, value_dim)``, the first layer's values: needed by every layer but
            the first (which ignores it).
        return_v_first : bool
            Also return ``v_first`` (last).

        Returns
        -------
        torch.Tensor or tuple
            ``(batch, T, hidden_size)``; then the cache with ``return_cache``; then
            ``v_first`` with ``return_v_first``.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import RWKV7Attention
        >>> layer = RWKV7Attention(hidden_size=16, head_dim=4)
        >>> x, v_first = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
        >>> mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded
        >>> y, cache = layer(x, mask, return_cache=True, v_first=v_first)
        >>> y.shape, bool((y[0, :2] == 0).all())
        (torch.Size([2, 6, 16]), True)
        """
        check_hidden(x, "x", 3, self.hidden_size)
        check_dtype(x, "x", self)
        self._check_cache(cache)
        mask = padding_mask(attention_mask, tuple(x.shape[:2]))
        block_cache: Any = cache  # a LayerCache is a BlockCache's tuple
        out = rwkv7(
            self._params(), x, v_first=v_first, return_v_first=return_v_first,
            attention_mask=mask, cache=block_cache, return_cache=return_cache,
            **self._options(),
        )  # fmt: skip
        return self._layer_cache(out, return_cache)

    def _layer_cache(self, out: Any, has_cache: bool) -> Any:
        """The block's result with its :class:`~polylin.blocks.BlockCache` as a
        :class:`LayerCache` that records this layer."""
        if not has_cache:
            return out
        cache = LayerCache(*out[1], made_by=self._made_by())
        return (out[0], cache, *out[2:])

    def step(
        self,
        x_t: torch.Tensor,
        cache: LayerCache | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        v_first: torch.Tensor | None = None,
        return_v_first: bool = False,
    ) -> tuple[Any, ...]:
        """One new token per sequence, from the cache of the tokens before it.

        Parameters
        ----------
        x_t : torch.Tensor
            ``(batch, hidden_size)``.
        cache : LayerCache, optional
            From ``forward(..., return_cache=True)`` or an earlier ``step``; ``None`` starts
            from an empty sequence.
        attention_mask : torch.Tensor, optional
            ``(batch,)``: the rows that take this token; the others keep their cache and
            output 0.
        v_first : torch.Tensor, optional
            ``(batch, value_dim)``: the first layer's values of this token (later layers).
        return_v_first : bool
            Also return ``v_first`` (last).

        Returns
        -------
        tuple
            ``y_t`` ``(batch, hidden_size)``, the cache after this token, and ``v_first``
            with ``return_v_first``.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import RWKV7Attention
        >>> layer = RWKV7Attention(hidden_size=16, head_dim=4, layer_idx=0)
        >>> y_t, cache = layer.step(torch.randn(3, 16))   # the first token of 3 sequences
        >>> y_t, cache, v_first = layer.step(torch.randn(3, 16), cache, return_v_first=True)
        >>> y_t.shape, v_first.shape
        (torch.Size([3, 16]), torch.Size([3, 16]))
        """
        check_hidden(x_t, "x_t", 2, self.hidden_size)
        check_dtype(x_t, "x_t", self)
        self._check_cache(cache)
        mask = padding_mask(attention_mask, (x_t.shape[0],))
        block_cache: Any = cache
        out = rwkv7_step(
            self._params(), x_t, block_cache, v_first=v_first, return_v_first=return_v_first,
            attention_mask=mask, **self._options(),
        )  # fmt: skip
        return tuple(self._layer_cache(out, True))
