"""Kimi Delta Attention as a Flax NNX module: :func:`polylin.blocks.kimi_delta_attention` on
its parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from .. import DEFAULT_CHUNK_SIZE
from ..blocks import (
    init_kimi_delta_attention,
    kimi_delta_attention,
    kimi_delta_attention_step,
)
from ._block import Block

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(Block):
    """Kimi Delta Attention (Kimi Linear) for Flax: the block of the torch module.

    Gated DeltaNet's block with a gate per value head and key channel and an output norm gated
    by ``sigmoid(g_proj(x))`` (:func:`polylin.blocks.kimi_delta_attention`). The keywords, the
    call, the cache and the parameter names are those of
    :class:`polylin.torch.KimiDeltaAttention` (and ``fla.layers.KimiDeltaAttention``), as for
    :class:`GatedDeltaNet`.

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
        Draw ``A_log`` as zeros (fla's option for the bounded gate). Needs ``lower_bound``.
    lower_bound : float, optional
        Bound the log gate to ``(lower_bound, 0)``:
        ``lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))``.
    conv_size : int
        Width of the short convolutions.
    conv_bias : bool
        Whether they have a bias.
    norm_eps : float
        ``eps`` of the output RMSNorm.
    params : mapping, optional
        Start from these parameters (a torch state dict, NumPy or JAX arrays, by name) instead
        of drawing them; the sizes above must fit their shapes.
    dtype : optional
        The parameters' dtype (default float32 when drawn; a given ``params``' own otherwise).
    device : optional
        Where to put the parameters.
    seed : int
        Seeds the draws (:func:`polylin.blocks.init_kimi_delta_attention`).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        ``safe_gate`` without ``lower_bound``; sizes that do not fit ``params``' shapes, or
        names in ``params`` that are not this block's.

    See Also
    --------
    polylin.blocks.kimi_delta_attention : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from polylin.flax import KimiDeltaAttention
    >>> layer = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=4)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> y, cache = layer(x[:, :5], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 5], cache)
    >>> bool(jnp.allclose(y_t, layer(x)[:, 5], atol=1e-5))
    True
    """

    _block = staticmethod(kimi_delta_attention)
    _block_step = staticmethod(kimi_delta_attention_step)
    _init = staticmethod(init_kimi_delta_attention)

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
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate needs lower_bound")
        options = {
            "hidden_size": hidden_size, "expand_v": expand_v, "head_dim": head_dim,
            "num_heads": num_heads, "num_v_heads": num_v_heads, "method": method,
            "chunk_size": chunk_size, "use_short_conv": use_short_conv,
            "allow_neg_eigval": allow_neg_eigval, "safe_gate": safe_gate,
            "lower_bound": lower_bound, "conv_size": conv_size, "conv_bias": conv_bias,
            "norm_eps": norm_eps,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)
