"""The Mamba-1 mixer as a Flax NNX module: :func:`polylin.blocks.mamba` on its parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from ..blocks import init_mamba, mamba, mamba_step
from ._block import Block

__all__ = ["Mamba"]


class Mamba(Block):
    """The Mamba-1 mixer for Flax (and FalconMamba's, with ``bcdt_rms_eps``).

    ``in_proj``, the short convolution, ``x_proj``, ``dt_proj``, the selective scan with the
    skip ``D`` and the gate ``silu(z)``, ``out_proj`` (:func:`polylin.blocks.mamba`). The
    keywords are ``MambaConfig``'s and the parameter names those of transformers'
    ``MambaMixer`` state dict (``from_torch_state_dict`` loads one); the call, ``step`` and
    the methods are :class:`GatedDeltaNet`'s; the cache's recurrent state is the scan's state
    ``(batch, intermediate_size, state_size)``.

    Parameters
    ----------
    hidden_size : int
        Size of ``x``'s last axis and of the output.
    state_size : int
        Size of the state per channel (``N``).
    expand : int
        ``intermediate_size = expand * hidden_size``.
    conv_kernel : int
        Width of the short convolution.
    time_step_rank : int or "auto"
        Rank of the time step's projection; ``"auto"``: ``ceil(hidden_size / 16)``.
    use_conv_bias, use_bias : bool
        Whether the convolution, and ``in_proj`` and ``out_proj``, have biases.
    time_step_scale, time_step_min, time_step_max, time_step_floor : float
        The draw of ``dt_proj`` (see :func:`polylin.blocks.init_mamba`).
    time_step_init_scheme : {"random", "constant"}
        How ``dt_proj.weight`` is drawn.
    bcdt_rms_eps : float, optional
        FalconMamba's ``mixer_rms_eps``: weightless RMSNorms on the time step, ``B`` and
        ``C``; ``None`` (Mamba): none.
    chunk_size : int, optional
        Chunk length of the scan's chunked form (default about ``sqrt(T)``).
    method : {"chunked", "recurrent", "quadratic"}
        Algorithm of the scan (see :func:`polylin.selective_scan`).
    params : mapping, optional
        Start from these parameters (a torch state dict, NumPy or JAX arrays, by name) instead
        of drawing them; the sizes above must fit their shapes.
    dtype : optional
        The parameters' dtype (default float32 when drawn; a given ``params``' own otherwise).
    device : optional
        Where to put the parameters.
    seed : int
        Seeds the draws (:func:`polylin.blocks.init_mamba`).
    rngs : flax.nnx.Rngs, optional
        Draw the seed from its ``params`` stream instead (Flax's convention).

    Raises
    ------
    ValueError
        Sizes that do not fit ``params``' shapes, or names in ``params`` that are not this
        block's.

    See Also
    --------
    polylin.blocks.mamba : The computation.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from polylin.flax import Mamba
    >>> layer = Mamba(hidden_size=16, state_size=4)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 16), jnp.float32)
    >>> y, cache = layer(x[:, :5], return_cache=True)
    >>> y_t, cache = layer.step(x[:, 5], cache)
    >>> bool(jnp.allclose(y_t, layer(x)[:, 5], atol=1e-5))
    True
    """

    _block = staticmethod(mamba)
    _block_step = staticmethod(mamba_step)
    _init = staticmethod(init_mamba)

    def __init__(
        self,
        hidden_size: int = 768,
        state_size: int = 16,
        expand: int = 2,
        conv_kernel: int = 4,
        time_step_rank: int | str = "auto",
        use_conv_bias: bool = True,
        use_bias: bool = False,
        time_step_scale: float = 1.0,
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
        time_step_init_scheme: str = "random",
        bcdt_rms_eps: float | None = None,
        chunk_size: int | None = None,
        *,
        method: str = "chunked",
        params: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        options = {
            "hidden_size": hidden_size, "state_size": state_size, "expand": expand,
            "conv_kernel": conv_kernel, "time_step_rank": time_step_rank,
            "use_conv_bias": use_conv_bias, "use_bias": use_bias,
            "time_step_scale": time_step_scale, "time_step_min": time_step_min,
            "time_step_max": time_step_max, "time_step_floor": time_step_floor,
            "time_step_init_scheme": time_step_init_scheme, "bcdt_rms_eps": bcdt_rms_eps,
            "chunk_size": chunk_size, "method": method,
        }  # fmt: skip
        super().__init__(options, params=params, dtype=dtype, device=device, seed=seed, rngs=rngs)
