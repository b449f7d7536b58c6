"""The Gated DeltaNet block (Yang, Kautz and Hatamizadeh, 2024) on the gated delta rule."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .. import DEFAULT_CHUNK_SIZE
from ..blocks import gated_deltanet, gated_deltanet_step
from ._blocks import RMSNorm, inverse_softplus_dt
from ._delta_block import DeltaRuleBlock

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(DeltaRuleBlock):
    r"""Gated DeltaNet: projections, short convolutions, the gated delta rule, a gated RMSNorm.

    For ``x`` of shape ``(batch, T, hidden_size)``:

    1. ``q, k`` = ``q_proj(x), k_proj(x)`` (``num_heads`` heads of ``head_dim``), ``v`` =
       ``v_proj(x)`` (``num_v_heads`` heads of ``head_v_dim = head_dim * expand_v``); each
       through its short causal convolution and SiLU (:func:`polylin.causal_conv1d`; without
       ``use_short_conv``, SiLU alone).
    2. ``q`` and ``k`` L2-normalized per head, ``q`` scaled by ``head_dim ** -0.5``; with
       ``num_v_heads > num_heads`` each query/key head serves ``num_v_heads // num_heads``
       consecutive value heads.
    3. ``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``) and the gate
       ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)``, one per token and value head.
    4. :func:`polylin.delta_rule_attention` (``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t -
       exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``).
    5. ``o_norm``: RMSNorm per value head, times ``silu(g_proj(x))`` with ``use_gate``
       (:func:`polylin.rms_norm`); then ``o_proj``.

    The options and parameter names are those of ``fla.layers.GatedDeltaNet``; a state dict of
    one loads into the other.

    The computation is :func:`polylin.blocks.gated_deltanet` (and its step) on the module's
    parameters.

    Parameters
    ----------
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    expand_v : float
        ``head_v_dim = head_dim * expand_v`` (must be an integer).
    head_dim : int
        Size of each query/key head.
    num_heads : int
        Number of query/key heads.
    num_v_heads : int, optional
        Number of value heads (a multiple of ``num_heads``); default ``num_heads``.
    method : {"chunked", "recurrent"}
        Algorithm of the forward pass (see :func:`polylin.delta_rule_attention`).
    chunk_size : int
        Chunk length of the chunked form.
    use_gate : bool
        Gate the output norm with ``silu(g_proj(x))``.
    use_short_conv : bool
        Short convolutions on ``q``, ``k`` and ``v``.
    allow_neg_eigval : bool
        ``beta`` in ``(0, 2)`` instead of ``(0, 1)``.
    conv_size : int
        Width of the short convolutions.
    conv_bias : bool
        Whether they have a bias.
    norm_eps : float
        ``eps`` of the output RMSNorm.
    device, dtype : optional
        Where and in which dtype to create the parameters.

    Attributes
    ----------
    q_proj, k_proj : torch.nn.Linear
        ``hidden_size -> key_dim = num_heads * head_dim``, no bias.
    v_proj : torch.nn.Linear
        ``hidden_size -> value_dim = num_v_heads * head_v_dim``, no bias.
    a_proj, b_proj : torch.nn.Linear
        ``hidden_size -> num_v_heads``, no bias.
    A_log, dt_bias : torch.nn.Parameter
        ``(num_v_heads,)``.
    q_conv1d, k_conv1d, v_conv1d : ShortConvolution
        Weights ``(key_dim, 1, conv_size)``, ``(key_dim, 1, conv_size)`` and
        ``(value_dim, 1, conv_size)`` (with ``use_short_conv``).
    g_proj : torch.nn.Linear
        ``hidden_size -> value_dim``, no bias (with ``use_gate``).
    o_norm : RMSNorm
        Weight ``(head_v_dim,)``.
    o_proj : torch.nn.Linear
        ``value_dim -> hidden_size``, no bias.

    Notes
    -----
    Parameters: ``hidden_size * (2 key_dim + (2 if use_gate else 1) value_dim + 2 num_v_heads)``
    for the input projections, ``value_dim * hidden_size`` for ``o_proj``, ``2 num_v_heads``
    for ``A_log`` and ``dt_bias``, ``(2 key_dim + value_dim) * conv_size`` (plus as many biases
    with ``conv_bias``) for the convolutions, ``head_v_dim`` for ``o_norm``.

    The cache is a :class:`LayerCache`: the states of ``q_conv1d``, ``k_conv1d`` and
    ``v_conv1d`` (``(batch, conv_size - 1, key_dim)`` twice and ``(batch, conv_size - 1,
    value_dim)``) and ``S`` of shape ``(batch, num_v_heads, head_dim, head_v_dim)``.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import GatedDeltaNet
    >>> _ = torch.manual_seed(0)
    >>> layer = GatedDeltaNet(hidden_size=64, num_heads=2, head_dim=16)
    >>> x = torch.randn(2, 12, 64)
    >>> layer(x).shape
    torch.Size([2, 12, 64])

    Prefill, then decode token by token: the outputs of one pass over the whole sequence.

    >>> y, cache = layer(x[:, :8], return_cache=True)
    >>> steps = []
    >>> for t in range(8, 12):
    ...     y_t, cache = layer.step(x[:, t], cache)
    ...     steps.append(y_t)
    >>> torch.allclose(torch.stack(steps, dim=1), layer(x)[:, 8:], atol=1e-5)
    True
    """

    _block = staticmethod(gated_deltanet)
    _block_step = staticmethod(gated_deltanet_step)

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        *,
        method: str = "chunked",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        kw = self._init_heads(
            hidden_size=hidden_size, expand_v=expand_v, head_dim=head_dim, num_heads=num_heads,
            num_v_heads=num_v_heads, method=method, chunk_size=chunk_size,
            use_short_conv=use_short_conv, allow_neg_eigval=allow_neg_eigval,
            conv_size=conv_size, conv_bias=conv_bias, norm_eps=norm_eps, device=device,
            dtype=dtype,
        )  # fmt: skip
        self.use_gate = use_gate
        heads = self.num_v_heads
        self.a_proj = nn.Linear(hidden_size, heads, bias=False, **kw)
        dtype = dtype or torch.get_default_dtype()
        A = torch.empty(heads, device=device).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A).to(dtype))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(heads, device=device).to(dtype))
        if not use_short_conv:
            warnings.warn(
                "use_short_conv=False: the short convolutions matter for Gated DeltaNet's "
                "quality; turn them off only on purpose",
                stacklevel=2,
            )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **kw)
        self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, **kw)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)

    def extra_repr(self) -> str:
        """The options, shown by ``print(layer)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_v_heads={self.num_v_heads}, head_dim={self.head_dim}, "
            f"head_v_dim={self.head_v_dim}, method={self.method!r}"
        )
