"""Mamba-2's block as a Flax NNX module: :func:`polylin.blocks.mamba2` on its parameters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flax import nnx

from .. import DEFAULT_CHUNK_SIZE
from ..blocks import init_mamba2, mamba2, mamba2_step
from ._block import Block

__all__ = ["Mamba2"]


class Mamba2(Block):
    """Mamba-2's block (its SSD scan) for Flax: the block of the torch module.

    ``in_proj``, a short convolution, the scalar-decay scan, the gated RMSNorm and
    ``out_proj`` (:func:`polylin.blocks.mamba2`). The keywords, the call, the parameter names
    are those of :class:`polylin.torch.Mamba2` (and transformers' ``Mamba2Mixer``), as for
    :class:`GatedDeltaNet`; the cache's recurrent state is a
    :class:`polylin.LinearAttentionState`.

    Parameters
    ----------
    num_heads : int, optional
        ``expand * hidden_size // head_dim`` (the default; any other value is an error).
    head_dim : int
        Size of each head's ``x``.
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    state_size : int
        Size of ``B`` and ``C`` per group.
    expand : int
        ``intermediate_size = expand * hidden_size``.
    n_groups : int
        Groups of ``B`` and ``C`` (a divisor of ``num_heads``).
    conv_kernel : int
        Width of the short convolution.
    use_conv_bias : bool
        Whether the convolution has a bias.
    A_init_range : (float, float)
        ``exp(A_log)`` is drawn uniformly in this range.
    D_has_hdim : bool
        ``D`` per channel instead of per head.
    rmsnorm : bool
        The gated RMSNorm before ``out_proj`` (else ``y * silu(z)``).
    norm_before_gate : bool
        ``True``: ``norm(y) * silu(z)``; ``False`` (Mamba-2's): ``norm(y * silu(z))``.
    dt_min, dt_max, dt_init_floor : float
        The draw of ``dt_bias`` (``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]``).
    dt_limit : (float, float)
        ``dt`` is clipped to this range (default: not at all).
    use_bias : bool
        Whether ``in_proj`` and ``out_proj`` have biases.
    norm_eps : float
        ``eps`` of the RMSNorm.
    chunk_size : int
        Chunk length of the chunked form.
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the forward pass (see :func:`polylin.causal_linear_attention`).
    params : mapping, optional
        Start from these parameters (a torch state dict, NumPy or JAX arrays, by name) instead
        of drawing them; the sizes above must fit their shapes.
    dtype : optional
        The parameters' dtype (default float32 when drawn; a given ``params``' own otherwise).
    device : optional
        Where to put the parameters.
    seed : int
        Seeds the draws (:func:`polylin.blocks.init_mamba2`).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        Sizes that do not fit ``params``' shapes, or names in ``params`` that are not this
        block's.

    See Also
    --------
    polylin.blocks.mamba2 : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from polylin.flax import Mamba2
    >>> layer = Mamba2(hidden_size=16, head_dim=8, state_size=4, n_groups=2)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> y, cache = layer(x[:, :5], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 5], cache)
    >>> bool(jnp.allclose(y_t, layer(x)[:, 5], atol=1e-5))
    True
    """

    _block = staticmethod(mamba2)
    _block_step = staticmethod(mamba2_step)
    _init = staticmethod(init_mamba2)

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
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        options = {
            "num_heads": num_heads, "head_dim": head_dim, "hidden_size": hidden_size,
            "state_size": state_size, "expand": expand, "n_groups": n_groups,
            "conv_kernel": conv_kernel, "use_conv_bias": use_conv_bias,
            "A_init_range": tuple(A_init_range), "D_has_hdim": D_has_hdim, "rmsnorm": rmsnorm,
            "norm_before_gate": norm_before_gate, "dt_min": dt_min, "dt_max": dt_max,
            "dt_init_floor": dt_init_floor, "dt_limit": tuple(dt_limit), "use_bias": use_bias,
            "norm_eps": norm_eps, "chunk_size": chunk_size, "method": method,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)
