"""Gated DeltaNet as a Flax NNX module: :func:`polylin.blocks.gated_deltanet` on its
parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from .. import DEFAULT_CHUNK_SIZE
from ..blocks import gated_deltanet, gated_deltanet_step, init_gated_deltanet
from ._block import Block

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(Block):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5) for Flax: the block of the torch module.

    The keywords, the call (``layer(x, attention_mask=None, cache=None, return_cache=False)``
    and ``layer.step(x_t, cache)``) and the parameter names are those of
    :class:`polylin.torch.GatedDeltaNet` (and of ``fla.layers.GatedDeltaNet``): a torch state
    dict loads by name, and the two compute the same numbers
    (:func:`polylin.blocks.gated_deltanet`). The parameters are
    ``nnx.Param``s in ``layer.params``, an ``nnx.Dict`` keyed by the state-dict names
    (``"q_proj.weight"``, ``"A_log"``, ...); ``nnx.jit``, ``nnx.grad`` and ``nnx.split`` see
    them as any Flax parameters. The cache is a :class:`polylin.blocks.BlockCache` (a pytree).

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
    params : mapping, optional
        Start from these parameters (a torch state dict, NumPy or JAX arrays, by name) instead
        of drawing them; the sizes above must fit their shapes.
    dtype : optional
        The parameters' dtype (default float32 when drawn; a given ``params``' own otherwise).
    device : optional
        Where to put the parameters.
    seed : int
        Seeds the draws (:func:`polylin.blocks.init_gated_deltanet`: the torch module's
        distributions; the same seed gives the same parameters on every library).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        Sizes that do not fit ``params``' shapes, or names in ``params`` that are not this
        block's.

    See Also
    --------
    polylin.blocks.gated_deltanet : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from polylin.flax import GatedDeltaNet
    >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> layer(x).shape
    (2, 6, 16)

    Prefill, then decode token by token: the outputs of one pass over the whole sequence.

    >>> y, cache = layer(x[:, :5], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 5], cache)
    >>> bool(jnp.allclose(y_t, layer(x)[:, 5], atol=1e-5))
    True

    Training: ``nnx.grad`` (here compiled by ``nnx.jit``) differentiates the parameters, by
    their state-dict names.

    >>> loss = lambda layer, x: (layer(x) ** 2).mean()
    >>> grads = nnx.jit(nnx.grad(loss))(layer, x)
    >>> grads["params"]["A_log"].shape
    (2,)
    """

    _block = staticmethod(gated_deltanet)
    _block_step = staticmethod(gated_deltanet_step)
    _init = staticmethod(init_gated_deltanet)

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
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        options = {
            "hidden_size": hidden_size, "expand_v": expand_v, "head_dim": head_dim,
            "num_heads": num_heads, "num_v_heads": num_v_heads, "method": method,
            "chunk_size": chunk_size, "use_gate": use_gate, "use_short_conv": use_short_conv,
            "allow_neg_eigval": allow_neg_eigval, "conv_size": conv_size,
            "conv_bias": conv_bias, "norm_eps": norm_eps,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)
