"""The mLSTM layer of xLSTM as a Flax NNX module: :func:`polylin.blocks.mlstm` on its
parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from ..blocks import init_mlstm, mlstm, mlstm_step
from ._block import Block

__all__ = ["MLSTM"]


class MLSTM(Block):
    """The mLSTM layer of xLSTM for Flax.

    The projections, the soft-capped gates, the mLSTM recurrence, the per-head layer norm, the
    output gate and ``out_proj`` (:func:`polylin.blocks.mlstm`). The keywords are
    ``xLSTMConfig``'s and the parameter names those of transformers' ``xLSTMLayer`` state dict
    (``from_torch_state_dict`` loads one); the call, ``step`` and the methods are
    :class:`GatedDeltaNet`'s; the cache's recurrent state is a :class:`polylin.MLSTMState`.

    Parameters
    ----------
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    num_heads : int
        Number of heads.
    qk_dim_factor, v_dim_factor : float
        The queries' and keys' size is ``int(hidden_size * qk_dim_factor)``, the values'
        alike.
    weight_mode : {"single", "fused"}
        Separate projections, or one for ``q, k, v, o`` and one for both gates.
    use_bias : bool
        Biases on the projections and the norm.
    gate_soft_cap : float, optional
        ``cap * tanh(g / cap)`` on the gates' pre-activations; ``None``: none.
    eps : float
        The recurrence's ``eps`` (:func:`polylin.mlstm`).
    norm_eps : float
        ``eps`` of the per-head layer norm.
    chunk_size : int
        Chunk length of the chunked form.
    num_hidden_layers : int
        The model's depth, for the draw of ``out_proj`` (see :func:`polylin.blocks.init_mlstm`).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the recurrence.
    params : mapping, optional
        Start from these parameters (a torch state dict, NumPy or JAX arrays, by name) instead
        of drawing them; the sizes above must fit their shapes.
    dtype : optional
        The parameters' dtype (default float32 when drawn; a given ``params``' own otherwise).
    device : optional
        Where to put the parameters.
    seed : int
        Seeds the draws (:func:`polylin.blocks.init_mlstm`).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        Sizes that do not fit ``params``' shapes, or names in ``params`` that are not this
        block's.

    See Also
    --------
    polylin.blocks.mlstm : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from polylin.flax import MLSTM
    >>> layer = MLSTM(hidden_size=16, num_heads=2, chunk_size=4)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> y, cache = layer(x[:, :5], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 5], cache)
    >>> bool(jnp.allclose(y_t, layer(x)[:, 5], atol=1e-5))
    True
    """

    _block = staticmethod(mlstm)
    _block_step = staticmethod(mlstm_step)
    _init = staticmethod(init_mlstm)

    def __init__(
        self,
        hidden_size: int = 4096,
        num_heads: int = 8,
        qk_dim_factor: float = 0.5,
        v_dim_factor: float = 1.0,
        weight_mode: str = "single",
        use_bias: bool = False,
        gate_soft_cap: float | None = 15.0,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
        num_hidden_layers: int = 32,
        *,
        method: str = "chunked",
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        options = {
            "hidden_size": hidden_size, "num_heads": num_heads, "qk_dim_factor": qk_dim_factor,
            "v_dim_factor": v_dim_factor, "weight_mode": weight_mode, "use_bias": use_bias,
            "gate_soft_cap": gate_soft_cap, "eps": eps, "norm_eps": norm_eps,
            "chunk_size": chunk_size, "num_hidden_layers": num_hidden_layers, "method": method,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)
