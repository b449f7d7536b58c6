"""RWKV-7's time mixing as a Flax NNX module: :func:`polylin.blocks.rwkv7` on its
parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import DEFAULT_DPLR_CHUNK_SIZE
from ..blocks import BlockCache, init_rwkv7, rwkv7, rwkv7_step
from ._block import Block

__all__ = ["RWKV7Attention"]


class RWKV7Attention(Block):
    """RWKV-7's time mixing for Flax: the block of the torch module.

    Token shift, LoRA gates, the generalized delta rule, a group norm
    (:func:`polylin.blocks.rwkv7`). The keywords, the call, the cache and the parameter names
    are those of :class:`polylin.torch.RWKV7Attention` (and ``fla.layers.RWKV7Attention``),
    with its value residual: the first layer (``layer_idx=0``, no ``v_lora``) returns its
    values with ``return_v_first=True``, every later layer takes them as ``v_first``.

    Parameters
    ----------
    mode : {"chunk", "fused_recurrent"}
        fla's kernel choice: accepted and checked (polylin's algorithm is ``method``).
    hidden_size : int
        Size of ``x``'s last axis, of the keys and of the output.
    head_dim : int, optional
        Size of each head; when given it decides the heads (``hidden_size // head_dim``).
    num_heads : int, optional
        Number of heads, used when ``head_dim`` is None.
    decay_low_rank_dim, gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim : int, optional
        The LoRA widths; default fla's.
    elementwise_affine : bool
        Whether ``g_norm`` has a weight and a bias.
    norm_eps : float
        ``g_norm``'s ``eps`` is ``head_dim * norm_eps``.
    layer_idx : int, optional
        The layer's depth: layer 0 has no ``v_lora`` and makes ``v_first``.
    fuse_norm : bool
        Normalize ``kk`` as fla's fused kernels do.
    value_dim : int, optional
        Default ``hidden_size``.
    num_hidden_layers : int, optional
        The model's depth (the draws only).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the forward pass (see :func:`polylin.dplr_delta_rule`).
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
        Seeds the draws (:func:`polylin.blocks.init_rwkv7`).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        Sizes that do not fit ``params``' shapes, or names in ``params`` that are not this
        block's.

    See Also
    --------
    polylin.blocks.rwkv7 : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from polylin.flax import RWKV7Attention
    >>> first = RWKV7Attention(hidden_size=16, head_dim=4, layer_idx=0)
    >>> later = RWKV7Attention(hidden_size=16, head_dim=4, layer_idx=1)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> h, v_first = first(x, return_v_first=True)
    >>> y, cache = later(x[:, :5], return_cache=True, v_first=v_first[:, :5])
    >>> y_t, cache = later.step(x[:, 5], cache, v_first=v_first[:, 5])
    >>> bool(jnp.allclose(y_t, later(x, v_first=v_first)[:, 5], atol=1e-5))
    True
    """

    _block = staticmethod(rwkv7)
    _block_step = staticmethod(rwkv7_step)
    _init = staticmethod(init_rwkv7)

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
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        options = {
            "mode": mode, "hidden_size": hidden_size, "head_dim": head_dim,
            "num_heads": num_heads, "decay_low_rank_dim": decay_low_rank_dim,
            "gate_low_rank_dim": gate_low_rank_dim, "a_low_rank_dim": a_low_rank_dim,
            "v_low_rank_dim": v_low_rank_dim, "elementwise_affine": elementwise_affine,
            "norm_eps": norm_eps, "layer_idx": layer_idx, "fuse_norm": fuse_norm,
            "value_dim": value_dim, "num_hidden_layers": num_hidden_layers, "method": method,
            "chunk_size": chunk_size,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)

    def _step_inputs(self) -> dict[str, Any]:
        """A later layer's step needs ``v_first`` ``(batch, value_dim)``."""
        if "v_lora.lora.0.weight" not in self.params or "v_proj.weight" not in self.params:
            return {}
        value_dim = self.params["v_proj.weight"][...].shape[0]
        return {"v_first": jax.ShapeDtypeStruct((1, value_dim), self.dtype)}

    def __call__(
        self,
        x: Any,
        attention_mask: Any = None,
        cache: BlockCache | None = None,
        return_cache: bool = False,
        *,
        v_first: Any = None,
        return_v_first: bool = False,
    ) -> Any:
        """The block over a whole sequence (training, prefill).

        Parameters
        ----------
        x : jax.Array
            ``(batch, T, hidden_size)``, of the parameters' dtype.
        attention_mask : jax.Array, optional
            ``(batch, T)`` booleans, True for real tokens: padded tokens reach no real output,
            no token-shift state and no recurrent state; their outputs are 0.
        cache : polylin.blocks.BlockCache, optional
            The cache after earlier tokens, to continue from.
        return_cache : bool
            Also return the cache after the last token.
        v_first : jax.Array, optional
            ``(batch, T, value_dim)``, the first layer's values: needed by every layer but
            the first (which ignores it).
        return_v_first : bool
            Also return ``v_first`` (last).

        Returns
        -------
        jax.Array or tuple
            ``(batch, T, hidden_size)``; then the cache with ``return_cache``; then
            ``v_first`` with ``return_v_first``.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from polylin.flax import RWKV7Attention
        >>> layer = RWKV7Attention(hidden_size=16, head_dim=4, layer_idx=0)
        >>> y, v_first = layer(jnp.ones((2, 6, 16), jnp.float32), return_v_first=True)
        >>> y.shape, v_first.shape
        ((2, 6, 16), (2, 6, 16))
        """
        v_first = None if v_first is None else jnp.asarray(v_first)
        return self._sequence(
            x, attention_mask, cache, return_cache, v_first=v_first, return_v_first=return_v_first
        )

    def step(
        self,
        x_t: Any,
        cache: BlockCache | None = None,
        *,
        attention_mask: Any = None,
        v_first: Any = None,
        return_v_first: bool = False,
    ) -> tuple[Any, ...]:
        """One new token per sequence, from the cache of the tokens before it.

        Parameters
        ----------
        x_t : jax.Array
            ``(batch, hidden_size)``.
        cache : polylin.blocks.BlockCache, optional
            From ``layer(..., return_cache=True)`` or an earlier ``step``; ``None`` starts
            from an empty sequence.
        attention_mask : jax.Array, optional
            ``(batch,)`` booleans: the rows that take this token.
        v_first : jax.Array, optional
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
        >>> import jax.numpy as jnp
        >>> from polylin.flax import RWKV7Attention
        >>> layer = RWKV7Attention(hidden_size=16, head_dim=4, layer_idx=0)
        >>> y_t, cache = layer.step(jnp.ones((2, 16), jnp.float32))
        >>> y_t.shape, cache.recurrent_state.shape
        ((2, 16), (2, 4, 4, 4))
        """
        v_first = None if v_first is None else jnp.asarray(v_first)
        return self._token(
            x_t, cache, attention_mask, v_first=v_first, return_v_first=return_v_first
        )
