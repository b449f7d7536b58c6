"""The Mamba-2 block (Dao and Gu, 2024): its SSD recurrence on causal linear attention."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import nn

from .. import DEFAULT_CHUNK_SIZE, LinearAttentionState
from ..blocks import mamba2, mamba2_step
from ._blocks import Block, RMSNorm, ShortConvolution, inverse_softplus_dt, positive_int

__all__ = ["Mamba2"]


def _check_dt_limit(dt_limit: Any) -> tuple[float, float]:
    """``dt_limit`` as ``(low, high)``: two real numbers, not nan, ``low <= high``."""
    try:
        bounds = tuple(dt_limit)
    except TypeError:
        raise TypeError(
            f"dt_limit must be a pair (low, high), got {type(dt_limit).__name__}"
        ) from None
    numbers_given = all(isinstance(b, numbers.Real) and not isinstance(b, bool) for b in bounds)
    if len(bounds) != 2 or not numbers_given:
        raise ValueError(f"dt_limit must be a pair of numbers (low, high), got {dt_limit!r}")
    low, high = (float(b) for b in bounds)
    if math.isnan(low) or math.isnan(high) or low > high:
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    return low, high


class Mamba2(Block):
    r"""Mamba-2's block: in-projection, short convolution, the SSD scan, D skip, gated RMSNorm.

    For ``x`` of shape ``(batch, T, hidden_size)``, with ``intermediate_size = expand *
    hidden_size`` split into ``num_heads`` heads of ``head_dim``:

    1. ``in_proj(x)`` gives ``z`` (``intermediate_size``), ``xBC`` (``intermediate_size + 2
       n_groups state_size``) and ``dt`` (``num_heads``).
    2. ``xBC`` goes through the short causal convolution ``conv1d`` and SiLU
       (:func:`polylin.causal_conv1d`) and splits into ``x``, ``B`` and ``C`` (``n_groups``
       groups of ``state_size``; head ``h`` reads group ``h // (num_heads // n_groups)``).
    3. ``dt = softplus(dt + dt_bias)`` (clipped to ``dt_limit``), ``A = -exp(A_log)``.
    4. The SSD scan ``S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T``, ``y_t = S_t^T C_t``:
       :func:`polylin.causal_linear_attention` with ``q = C``, ``k = B``, ``v = dt x``,
       ``log_decay = dt A``, the identity feature map and ``normalize=False``.
    5. ``y + D x``, then ``norm``: RMSNorm of ``y * silu(z)`` per group (``rmsnorm=True``;
       else ``y * silu(z)``), then ``out_proj``.

    Options and parameter names are those of ``fla.layers.Mamba2`` (and of transformers'
    ``Mamba2Mixer``); a state dict of either loads by name.

    The computation is :func:`polylin.blocks.mamba2` (and its step) on the module's
    parameters.

    Parameters
    ----------
    num_heads : int, optional
        ``intermediate_size // head_dim`` (the default; any other value is an error).
    head_dim : int
        Size of each head's ``x``.
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    state_size : int
        Size of ``B`` and ``C`` per group (the SSM state is ``state_size x head_dim`` per head).
    expand : int
        ``intermediate_size = expand * hidden_size``.
    n_groups : int
        Groups of ``B`` and ``C`` (a divisor of ``num_heads``).
    conv_kernel : int
        Width of the short convolution.
    use_conv_bias : bool
        Whether the convolution has a bias.
    A_init_range : (float, float)
        ``exp(A_log)`` is initialized uniformly in this range.
    D_has_hdim : bool
        ``D`` per channel (``intermediate_size``) instead of per head.
    rmsnorm : bool
        The gated RMSNorm before ``out_proj`` (else ``y * silu(z)``).
    norm_before_gate : bool
        ``True``: ``norm(y) * silu(z)``; ``False`` (Mamba-2's): ``norm(y * silu(z))``.
    dt_min, dt_max, dt_init_floor : float
        Initialization of ``dt_bias`` (``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]``).
    dt_limit : (float, float)
        ``dt`` is clipped to this range, ``(low, high)`` with ``low <= high`` (default: not at
        all).
    use_bias : bool
        Whether ``in_proj`` and ``out_proj`` have biases.
    norm_eps : float
        ``eps`` of the RMSNorm.
    chunk_size : int
        Chunk length of the chunked form: a speed setting, the outputs are the same to
        round-off. The default is polylin's (64); transformers' and mamba_ssm's configs say
        256, with which the layer's forward took 1.2-1.3x as long on the CPU (T = 1024 and
        4096, ``benchmarks/mamba2.py``'s sizes).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the forward pass (see :func:`polylin.causal_linear_attention`).
    device, dtype : optional
        Where and in which dtype to create the parameters.

    Attributes
    ----------
    in_proj : torch.nn.Linear
        ``hidden_size -> 2 intermediate_size + 2 n_groups state_size + num_heads``.
    conv1d : ShortConvolution
        Weight ``(conv_dim, 1, conv_kernel)``, ``conv_dim = intermediate_size + 2 n_groups
        state_size``; bias ``(conv_dim,)`` with ``use_conv_bias``.
    dt_bias, A_log : torch.nn.Parameter
        ``(num_heads,)``.
    D : torch.nn.Parameter
        ``(num_heads,)``, or ``(intermediate_size,)`` with ``D_has_hdim``.
    norm : RMSNorm
        Weight ``(intermediate_size,)`` (with ``rmsnorm``).
    out_proj : torch.nn.Linear
        ``intermediate_size -> hidden_size``.

    Notes
    -----
    Parameters: ``hidden_size * (2 intermediate_size + 2 n_groups state_size + num_heads)`` for
    ``in_proj``, ``conv_dim * conv_kernel`` (+ ``conv_dim`` biases) for ``conv1d``, ``2
    num_heads`` for ``dt_bias`` and ``A_log``, ``num_heads`` (or ``intermediate_size``) for
    ``D``, ``intermediate_size`` for ``norm``, ``intermediate_size * hidden_size`` for
    ``out_proj`` (plus biases with ``use_bias``).

    The cache is a :class:`LayerCache`: the convolution's state ``(batch, conv_kernel - 1,
    conv_dim)`` and a :class:`polylin.LinearAttentionState` whose ``S`` has shape ``(batch,
    num_heads, state_size, head_dim)``.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import Mamba2
    >>> _ = torch.manual_seed(0)
    >>> layer = Mamba2(hidden_size=32, head_dim=16, state_size=8, n_groups=2)
    >>> x = torch.randn(2, 10, 32)
    >>> y, cache = layer(x[:, :7], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 7], cache)
    >>> torch.allclose(y_t, layer(x)[:, 7], atol=1e-5)
    True
    """

    _state_kind = LinearAttentionState

    def __init__(
        self,
        num_heads: int | None = None,
        head_dim: int = 64,
        hidden_size: int = 2048,
        state_size: int = 128,
        expand: int = 2,
        n_groups: int = 1,
        conv_kernel: int = 4,
        use_conv_bias: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        use_bias: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        method: str = "chunked",
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("head_dim", head_dim), ("hidden_size", hidden_size), ("state_size", state_size),
            ("expand", expand), ("n_groups", n_groups), ("conv_kernel", conv_kernel),
            ("chunk_size", chunk_size),
        ):  # fmt: skip
            positive_int(name, value)
        intermediate = expand * hidden_size
        if intermediate % head_dim:
            raise ValueError(
                f"expand * hidden_size = {intermediate} must be a multiple of {head_dim=}"
            )
        heads = intermediate // head_dim
        if num_heads not in (None, 0, heads):
            raise ValueError(
                f"num_heads * head_dim = {num_heads} * {head_dim} must equal expand * "
                f"hidden_size = {intermediate}"
            )
        if heads % n_groups:
            raise ValueError(f"num_heads={heads} must be a multiple of {n_groups=}")
        dt_limit = _check_dt_limit(dt_limit)
        self.hidden_size, self.expand, self.intermediate_size = hidden_size, expand, intermediate
        self.head_dim, self.num_heads, self.ssm_state_size = head_dim, heads, state_size
        self.n_groups, self.conv_kernel_size, self.use_conv_bias = (
            n_groups,
            conv_kernel,
            use_conv_bias,
        )
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit, self.norm_eps, self.use_bias = dt_limit, norm_eps, use_bias
        self.chunk_size, self.method = chunk_size, method
        self.conv_dim = intermediate + 2 * n_groups * state_size
        kw = {"device": device, "dtype": dtype}
        dtype = dtype or torch.get_default_dtype()
        self.in_proj = nn.Linear(
            hidden_size, intermediate + self.conv_dim + heads, bias=use_bias, **kw
        )
        self.conv1d = ShortConvolution(self.conv_dim, conv_kernel, bias=use_conv_bias, **kw)
        self.dt_bias = nn.Parameter(
            inverse_softplus_dt(
                heads, dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor, device=device
            ).to(dtype)
        )
        A = torch.empty(heads, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype))
        if rmsnorm:
            self.norm = RMSNorm(
                intermediate, eps=norm_eps, norm_before_gate=norm_before_gate,
                group_size=intermediate // n_groups, **kw,
            )  # fmt: skip
        self.D = nn.Parameter(torch.ones(intermediate if D_has_hdim else heads, **kw))
        self.out_proj = nn.Linear(intermediate, hidden_size, bias=use_bias, **kw)

    def extra_repr(self) -> str:
        """The options, shown by ``print(layer)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, state_size={self.ssm_state_size}, "
            f"n_groups={self.n_groups}, method={self.method!r}"
        )

    def _convs(self) -> list[ShortConvolution]:
        return [self.conv1d]

    def _cache_sizes(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads, "head_dim": self.head_dim,
            "state_size": self.ssm_state_size, "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel_size,
        }  # fmt: skip

    def _options(self) -> dict[str, Any]:
        """The block function's options that the parameters' shapes do not give."""
        return {
            "n_groups": self.n_groups, "norm_before_gate": self.norm_before_gate,
            "dt_limit": self.dt_limit, "norm_eps": self.norm_eps, "method": self.method,
            "chunk_size": self.chunk_size,
        }  # fmt: skip

    def _sequence(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        return mamba2(
            self._params(), x, attention_mask=mask, cache=cache, return_cache=True,
            **self._options(),
        )  # fmt: skip

    def _token(
        self, x_t: torch.Tensor, mask: torch.Tensor | None, cache: Any
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        return mamba2_step(self._params(), x_t, cache, attention_mask=mask, **self._options())
