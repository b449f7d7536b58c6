"""The Gated DeltaNet block (Qwen3-Next, Qwen3.5) as functions of its parameters.

``gated_deltanet(params, x)`` computes what :class:`polylin.torch.GatedDeltaNet` computes
(and ``fla.layers.GatedDeltaNet``: the parameter names are theirs), on the arrays of any
array-API library: the torch module's state dict as NumPy, JAX, CuPy or torch arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._inputs.defaults import DEFAULT_CHUNK_SIZE
from ..activations import softplus
from ..interop import array_namespace
from ._delta import DeltaSizes, grouped, init_inputs, run_sequence, run_token, sizes_of
from ._init import Draws
from ._params import BlockCache, linear

__all__ = ["gated_deltanet", "gated_deltanet_step", "init_gated_deltanet"]

BLOCK = "gated_deltanet"


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> DeltaSizes:
    return sizes_of(
        BLOCK, params, num_heads=options.pop("num_heads", None),
        allow_neg_eigval=options.pop("allow_neg_eigval", False),
        norm_eps=options.pop("norm_eps", 1e-5), method=options.pop("method", "chunked"),
        chunk_size=options.pop("chunk_size", DEFAULT_CHUNK_SIZE), implied=options,
        extra={"use_gate": "g_proj.weight" in params},
    )  # fmt: skip


def _log_decay(params: Mapping[str, Any], x: Any, sizes: DeltaSizes) -> Any:
    """``-exp(A_log) * softplus(a_proj(x) + dt_bias)``: ``(..., num_heads, group, 1)``."""
    xp = array_namespace(x)
    A = xp.exp(params["A_log"])
    g = -A * softplus(linear(params, x, "a_proj") + params["dt_bias"])
    return grouped(xp, g, sizes, 1)


def _gate(params: Mapping[str, Any], x: Any) -> Any:
    return linear(params, x, "g_proj") if "g_proj.weight" in params else None


def gated_deltanet(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The Gated DeltaNet block over a whole sequence (training, prefill).

    The computation of :class:`polylin.torch.GatedDeltaNet` (its docstring lists the steps):
    short convolutions and SiLU on ``q``, ``k``, ``v``; L2-normalized ``q`` and ``k``;
    ``beta = sigmoid(b_proj(x))``; the gate ``-exp(A_log) * softplus(a_proj(x) + dt_bias)``;
    :func:`polylin.delta_rule_attention`; the gated RMSNorm per value head; ``o_proj``.

    Parameters
    ----------
    params : mapping
        The torch module's state dict (names ``q_proj.weight``, ``A_log``, ...), as arrays of
        one library; :func:`init_gated_deltanet` makes one.
    x : array
        ``(batch, T, hidden_size)``, of the library of ``params``.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens (left or right padding): padded tokens
        reach no real output, no convolution state and no recurrent state; their outputs are 0.
    cache : BlockCache, optional
        The cache after earlier tokens, to continue from.
    return_cache : bool
        Also return the cache after the last token.
    **options
        The torch module's constructor keywords. ``num_heads`` (or ``head_dim``) is required:
        the shapes do not say how the key dimension splits into heads. ``allow_neg_eigval``,
        ``norm_eps``, ``method`` and ``chunk_size`` as there. The others (``hidden_size``,
        ``head_dim``, ``num_v_heads``, ``expand_v``, ``use_gate``, ``use_short_conv``,
        ``conv_size``, ``conv_bias``) follow from the shapes and are checked against them.

    Returns
    -------
    array or (array, BlockCache)
        ``y`` ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

    Raises
    ------
    ValueError
        An option the shapes contradict, inputs of the wrong shape, a cache of another block.
    TypeError
        A mask that is not boolean, an unknown option.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import gated_deltanet, gated_deltanet_step, init_gated_deltanet
    >>> params = init_gated_deltanet(np, hidden_size=32, num_heads=2, head_dim=8)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> y, cache = gated_deltanet(params, x[:, :7], num_heads=2, return_cache=True)
    >>> y_t, cache = gated_deltanet_step(params, x[:, 7], cache, num_heads=2)
    >>> bool(np.allclose(y_t, gated_deltanet(params, x, num_heads=2)[:, 7], atol=1e-5))
    True
    """
    sizes = _sizes(params, dict(options))
    return run_sequence(
        BLOCK, params, x, sizes, _log_decay, _gate, "silu", attention_mask=attention_mask,
        cache=cache, return_cache=return_cache,
    )  # fmt: skip


def gated_deltanet_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, BlockCache]:
    """One new token per sequence of the Gated DeltaNet block, from the cache before it.

    Parameters
    ----------
    params : mapping
        As for :func:`gated_deltanet`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        From ``gated_deltanet(..., return_cache=True)`` or an earlier step; ``None`` starts
        from an empty sequence (zero states).
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token. The others keep their cache and
        output 0, whatever ``x_t`` holds there.
    **options
        As for :func:`gated_deltanet` (``method`` and ``chunk_size`` are not used).

    Returns
    -------
    y_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache
        The cache after this token.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import gated_deltanet_step, init_gated_deltanet
    >>> params = init_gated_deltanet(np, hidden_size=16, num_heads=2, head_dim=4)
    >>> y_t, cache = gated_deltanet_step(params, np.ones((3, 16), np.float32), num_heads=2)
    >>> y_t.shape, cache.recurrent_state.shape
    ((3, 16), (3, 2, 4, 8))
    """
    sizes = _sizes(params, dict(options))
    return run_token(
        BLOCK, params, x_t, sizes, _log_decay, _gate, "silu", attention_mask=attention_mask,
        cache=cache,
    )  # fmt: skip


def init_gated_deltanet(
    xp: Any,
    *,
    hidden_size: int = 2048,
    expand_v: float = 2,
    head_dim: int = 256,
    num_heads: int = 6,
    num_v_heads: int | None = None,
    use_gate: bool = True,
    use_short_conv: bool = True,
    conv_size: int = 4,
    conv_bias: bool = False,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of a Gated DeltaNet block, as the torch module draws them.

    Linear and convolution weights uniform within ``1 / sqrt(fan_in)`` (PyTorch's defaults),
    ``A_log = log(U(0, 16))``, ``dt_bias`` the inverse softplus of a log-uniform ``dt`` in
    ``[0.001, 0.1]``, ``o_norm.weight`` ones; the names and shapes of
    :class:`polylin.torch.GatedDeltaNet`'s state dict.

    Parameters
    ----------
    xp : namespace
        The array library to make them in (``numpy``, ``jax.numpy``, ``torch``, ...).
    hidden_size, expand_v, head_dim, num_heads, num_v_heads : int or float
        The torch module's sizes, with its defaults.
    use_gate, use_short_conv, conv_size, conv_bias : bool or int
        The torch module's options, with its defaults.
    seed : int
        Seeds the draws (Python's ``random``): the same seed gives the same parameters on
        every library.
    dtype : dtype, optional
        Default ``xp.float32``.
    device : optional
        Where to make them.

    Returns
    -------
    dict
        Name to array.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_gated_deltanet
    >>> params = init_gated_deltanet(np, hidden_size=16, num_heads=2, head_dim=4)
    >>> params["q_proj.weight"].shape, params["o_norm.weight"].shape
    ((8, 16), (8,))
    """
    draws = Draws(xp, seed=seed, dtype=dtype, device=device)
    v_heads = num_heads if num_v_heads is None else num_v_heads
    head_v_dim = round(head_dim * expand_v)
    key_dim, value_dim = num_heads * head_dim, v_heads * head_v_dim
    params = init_inputs(
        draws, hidden_size=hidden_size, key_dim=key_dim, value_dim=value_dim,
        num_v_heads=v_heads, use_short_conv=use_short_conv, conv_size=conv_size,
        conv_bias=conv_bias,
    )  # fmt: skip
    params["a_proj.weight"] = draws.linear(v_heads, hidden_size)
    params["A_log"] = draws.log_uniform(v_heads, 0.0, 16.0)
    params["dt_bias"] = draws.dt_bias(v_heads)
    if use_gate:
        params["g_proj.weight"] = draws.linear(value_dim, hidden_size)
    params["o_norm.weight"] = draws.ones(head_v_dim)
    params["o_proj.weight"] = draws.linear(hidden_size, value_dim)
    return params
