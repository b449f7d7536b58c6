"""The Kimi Delta Attention block (Kimi Linear, 2025): the delta rule with a per-channel gate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import DEFAULT_CHUNK_SIZE
from ..blocks import kimi_delta_attention, kimi_delta_attention_step
from ._blocks import RMSNorm, inverse_softplus_dt
from ._delta_block import DeltaRuleBlock

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(DeltaRuleBlock):
    r"""Kimi Delta Attention: Gated DeltaNet's block with a gate per key channel.

    For ``x`` of shape ``(batch, T, hidden_size)``:

    1. ``q, k`` = ``q_proj(x), k_proj(x)`` (``num_heads`` heads of ``head_dim``), ``v`` =
       ``v_proj(x)`` (``num_v_heads`` heads of ``head_v_dim = head_dim * expand_v``), each
       through its short causal convolution and SiLU; q and k L2-normalized per head (inside
       :func:`polylin.delta_rule_attention`), outputs scaled by ``head_dim ** -0.5``.
    2. ``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``) per value head, and a
       gate per value head and key channel: ``g = -exp(A_log) * softplus(f_proj(x) +
       dt_bias)`` (``f_proj`` is a low-rank pair of linear maps), or, with ``lower_bound``,
       ``g = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))``.
    3. :func:`polylin.delta_rule_attention` with ``log_decay = g`` of width ``head_dim``:
       ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``.
    4. ``o_norm``: RMSNorm per value head times ``sigmoid(g_proj(x))`` (``g_proj`` low rank,
       with a bias), then ``o_proj``.

    Options and parameter names are those of ``fla.layers.KimiDeltaAttention``; a state dict
    of one loads into the other.

    The computation is :func:`polylin.blocks.kimi_delta_attention` (and its step) on the module's
    parameters.

    Parameters
    ----------
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    expand_v : float
        ``head_v_dim = head_dim * expand_v`` (must be an integer).
    head_dim : int
        Size of each query/key head, and of the gate per value head.
    num_heads : int
        Number of query/key heads.
    num_v_heads : int, optional
        Number of value heads (a multiple of ``num_heads``); default ``num_heads``.
    method : {"chunked", "recurrent"}
        Algorithm of the forward pass (see :func:`polylin.delta_rule_attention`).
    chunk_size : int
        Chunk length of the chunked form.
    use_short_conv : bool
        Short convolutions on ``q``, ``k`` and ``v``.
    allow_neg_eigval : bool
        ``beta`` in ``(0, 2)`` instead of ``(0, 1)``.
    safe_gate : bool
        Initialize ``A_log`` to zeros (fla's option for the bounded gate; its kernel speed-up
        has no counterpart here). Needs ``lower_bound``.
    lower_bound : float, optional
        Bound the log gate to ``(lower_bound, 0)`` with the sigmoid form above.
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
    q_proj, k_proj, v_proj, b_proj, q_conv1d, k_conv1d, v_conv1d, o_norm, o_proj
        As for :class:`GatedDeltaNet`.
    f_proj : torch.nn.Sequential
        ``hidden_size -> head_v_dim -> gate_dim = num_v_heads * head_dim``, no biases.
    A_log : torch.nn.Parameter
        ``(num_v_heads,)``.
    dt_bias : torch.nn.Parameter
        ``(gate_dim,)``.
    g_proj : torch.nn.Sequential
        ``hidden_size -> head_v_dim`` (no bias) ``-> value_dim`` (with bias).

    Notes
    -----
    Parameters: ``hidden_size * (2 key_dim + value_dim + num_v_heads)`` for ``q, k, v`` and
    ``b_proj``, ``head_v_dim * (2 hidden_size + gate_dim + value_dim) + value_dim`` for
    ``f_proj`` and ``g_proj``, ``num_v_heads + gate_dim`` for ``A_log`` and ``dt_bias``,
    ``(2 key_dim + value_dim) * conv_size`` for the convolutions, ``head_v_dim`` for
    ``o_norm``, ``value_dim * hidden_size`` for ``o_proj``.

    The cache is a :class:`LayerCache` as for :class:`GatedDeltaNet`.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import KimiDeltaAttention
    >>> _ = torch.manual_seed(0)
    >>> layer = KimiDeltaAttention(hidden_size=32, num_heads=2, head_dim=8)
    >>> x = torch.randn(2, 10, 32)
    >>> y, cache = layer(x[:, :7], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 7], cache)
    >>> torch.allclose(y_t, layer(x)[:, 7], atol=1e-5)
    True
    """

    _block = staticmethod(kimi_delta_attention)
    _block_step = staticmethod(kimi_delta_attention_step)

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        *,
        method: str = "chunked",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate needs lower_bound")
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"lower_bound must be < 0, got {lower_bound}")
        kw = self._init_heads(
            hidden_size=hidden_size, expand_v=expand_v, head_dim=head_dim, num_heads=num_heads,
            num_v_heads=num_v_heads, method=method, chunk_size=chunk_size,
            use_short_conv=use_short_conv, allow_neg_eigval=allow_neg_eigval,
            conv_size=conv_size, conv_bias=conv_bias, norm_eps=norm_eps, device=device,
            dtype=dtype,
        )  # fmt: skip
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        num_v_heads = self.num_v_heads
        self.gate_dim = num_v_heads * head_dim
        dtype = dtype or torch.get_default_dtype()
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False, **kw),
            nn.Linear(self.head_v_dim, self.gate_dim, bias=False, **kw),
        )
        if safe_gate:
            A_log = torch.zeros(num_v_heads, device=device)
        else:
            A_log = torch.log(torch.empty(num_v_heads, device=device).uniform_(1, 16))
        self.A_log = nn.Parameter(A_log.to(dtype))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(self.gate_dim, device=device).to(dtype))
        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False, **kw),
            nn.Linear(self.head_v_dim, self.value_dim, bias=True, **kw),
        )
        self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, activation="sigmoid", **kw)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)

    def extra_repr(self) -> str:
        """The options, shown by ``print(layer)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"num_v_heads={self.num_v_heads}, head_dim={self.head_dim}, "
            f"head_v_dim={self.head_v_dim}, lower_bound={self.lower_bound}, "
            f"method={self.method!r}"
        )

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "lower_bound": self.lower_bound}
