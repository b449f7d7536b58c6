"""Gated linear attention as a Flax NNX module: :func:`polylin.blocks.gated_linear_attention`
on its parameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from .. import DEFAULT_CHUNK_SIZE
from ..blocks import (
    gated_linear_attention,
    gated_linear_attention_step,
    init_gated_linear_attention,
)
from ._block import Block

__all__ = ["GatedLinearAttention"]


class GatedLinearAttention(Block):
    """Gated linear attention (GLA) for Flax: the block of the torch module.

    A per-channel forget gate, an output gate and an RMSNorm per head
    (:func:`polylin.blocks.gated_linear_attention`). The keywords, the call, the parameter
    names are those of :class:`polylin.torch.GatedLinearAttention` (and
    ``fla.layers.GatedLinearAttention``), as for :class:`GatedDeltaNet`; the cache's recurrent
    state is a :class:`polylin.LinearAttentionState`.

    Parameters
    ----------
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    expand_k, expand_v : float
        ``key_dim = hidden_size * expand_k``, ``value_dim = hidden_size * expand_v``.
    num_heads : int
        Number of query (and output) heads.
    num_kv_heads : int, optional
        Number of key/value heads, a divisor of ``num_heads``; default ``num_heads``.
    feature_map : callable, optional
        Applied to ``q`` and ``k`` after their heads are formed; default none.
    use_short_conv : bool
        Short convolutions on ``q``, ``k`` and ``v``.
    conv_size : int
        Their width.
    conv_bias : bool
        Whether they have a bias.
    use_output_gate : bool
        Multiply the normalized output by ``gate_fn(g_proj(x))``.
    gate_fn : {"swish", "silu", "sigmoid"}
        The output gate's activation.
    elementwise_affine : bool
        Whether the output norm has a weight.
    norm_eps : float
        ``eps`` of the output norm.
    gate_logit_normalizer : float
        The forget gate's divisor.
    gate_low_rank_dim : int
        The inner size of ``gk_proj``.
    clamp_min : float, optional
        Lower bound of the forget gate (in log space).
    fuse_norm : bool
        With ``gate_fn="swish"`` and ``use_output_gate``: the gated norm is one parameter,
        ``g_norm_swish_gate.weight`` (fla's names).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the forward pass.
    chunk_size : int
        Chunk length of the chunked form.
    params : mapping, optional
        Start from these parameters (a torch state dict, NumPy or JAX arrays, by name) instead
        of drawing them; the sizes above must fit their shapes.
    dtype : optional
        The parameters' dtype (default float32 when drawn; a given ``params``' own otherwise).
    device : optional
        Where to put the parameters.
    seed : int
        Seeds the draws (:func:`polylin.blocks.init_gated_linear_attention`).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        Sizes that do not fit ``params``' shapes, or names in ``params`` that are not this
        block's.

    See Also
    --------
    polylin.blocks.gated_linear_attention : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from polylin.flax import GatedLinearAttention
    >>> layer = GatedLinearAttention(hidden_size=16, num_heads=2)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> y, cache = layer(x[:, :5], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 5], cache)
    >>> bool(jnp.allclose(y_t, layer(x)[:, 5], atol=1e-5))
    True
    """

    _block = staticmethod(gated_linear_attention)
    _block_step = staticmethod(gated_linear_attention_step)
    _init = staticmethod(init_gated_linear_attention)

    def __init__(
        self,
        *,
        hidden_size: int = 1024,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        feature_map: Callable[[Any], Any] | None = None,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_output_gate: bool = True,
        gate_fn: str = "swish",
        elementwise_affine: bool = True,
        norm_eps: float = 1e-5,
        gate_logit_normalizer: float = 16,
        gate_low_rank_dim: int = 16,
        clamp_min: float | None = None,
        fuse_norm: bool = True,
        method: str = "chunked",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        options = {
            "hidden_size": hidden_size, "expand_k": expand_k, "expand_v": expand_v,
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "feature_map": feature_map,
            "use_short_conv": use_short_conv, "conv_size": conv_size, "conv_bias": conv_bias,
            "use_output_gate": use_output_gate, "gate_fn": gate_fn,
            "elementwise_affine": elementwise_affine, "norm_eps": norm_eps,
            "gate_logit_normalizer": gate_logit_normalizer,
            "gate_low_rank_dim": gate_low_rank_dim, "clamp_min": clamp_min,
            "fuse_norm": fuse_norm, "method": method, "chunk_size": chunk_size,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)
