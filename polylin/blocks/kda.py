"""The Kimi Delta Attention block (Kimi Linear) as functions of its parameters.

``kimi_delta_attention(params, x)`` computes what :class:`polylin.torch.KimiDeltaAttention`
computes (and ``fla.layers.KimiDeltaAttention``: the parameter names are theirs), on the arrays
of any array-API library.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from .._inputs.defaults import DEFAULT_CHUNK_SIZE
from ..activations import sigmoid, softplus
from ..interop import array_namespace
from ._delta import DeltaSizes, grouped, init_inputs, run_sequence, run_token, sizes_of
from ._init import Draws
from ._params import BlockCache, linear

__all__ = ["init_kimi_delta_attention", "kimi_delta_attention", "kimi_delta_attention_step"]

BLOCK = "kimi_delta_attention"


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> tuple[DeltaSizes, Any]:
    lower_bound = options.pop("lower_bound", None)
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"{BLOCK}: lower_bound must be < 0, got {lower_bound}")
    options.pop("safe_gate", None)  # an initialization option: the parameters hold its effect
    sizes = sizes_of(
        BLOCK, params, num_heads=options.pop("num_heads", None),
        allow_neg_eigval=options.pop("allow_neg_eigval", False),
        norm_eps=options.pop("norm_eps", 1e-5), method=options.pop("method", "chunked"),
        chunk_size=options.pop("chunk_size", DEFAULT_CHUNK_SIZE), implied=options, extra={},
    )  # fmt: skip
    return sizes, lower_bound


def _log_decay(
    params: Mapping[str, Any], x: Any, sizes: DeltaSizes, *, lower_bound: float | None
) -> Any:
    """The gate per value head and key channel: ``(..., num_heads, group, head_dim)``."""
    xp = array_namespace(x)
    f = linear(params, linear(params, x, "f_proj.0"), "f_proj.1") + params["dt_bias"]
    f = grouped(xp, f, sizes, sizes.head_dim)
    A = xp.reshape(xp.exp(params["A_log"]), (sizes.num_heads, sizes.group, 1))
    if lower_bound is None:
        return -A * softplus(f)
    return lower_bound * sigmoid(A * f)


def _gate(params: Mapping[str, Any], x: Any) -> Any:
    return linear(params, linear(params, x, "g_proj.0"), "g_proj.1")


def kimi_delta_attention(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The Kimi Delta Attention block over a whole sequence (training, prefill).

    The computation of :class:`polylin.torch.KimiDeltaAttention`: Gated DeltaNet's block with
    a gate per value head and key channel, ``-exp(A_log) * softplus(f_proj(x) + dt_bias)``
    (or ``lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))``), and an output norm
    gated by ``sigmoid(g_proj(x))``.

    Parameters
    ----------
    params : mapping
        The torch module's state dict (``f_proj.0.weight``, ``g_proj.1.bias``, ...), as arrays
        of one library; :func:`init_kimi_delta_attention` makes one.
    x : array
        ``(batch, T, hidden_size)``.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens.
    cache : BlockCache, optional
        The cache after earlier tokens.
    return_cache : bool
        Also return the cache after the last token.
    **options
        The torch module's constructor keywords: ``num_heads`` (or ``head_dim``) is required;
        ``lower_bound``, ``allow_neg_eigval``, ``norm_eps``, ``method``, ``chunk_size`` as
        there (``safe_gate`` is accepted: it only changes the initialization); the others
        follow from the shapes and are checked against them.

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
    >>> from polylin.blocks import init_kimi_delta_attention, kimi_delta_attention
    >>> params = init_kimi_delta_attention(np, hidden_size=32, num_heads=2, head_dim=8)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> kimi_delta_attention(params, x, num_heads=2).shape
    (2, 10, 32)
    """
    sizes, lower_bound = _sizes(params, dict(options))
    return run_sequence(
        BLOCK, params, x, sizes, partial(_log_decay, lower_bound=lower_bound), _gate,
        "sigmoid", attention_mask=attention_mask, cache=cache, return_cache=return_cache,
    )  # fmt: skip


def kimi_delta_attention_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, BlockCache]:
    """One new token per sequence of the Kimi Delta Attention block.

    Parameters
    ----------
    params : mapping
        As for :func:`kimi_delta_attention`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        The cache before this token; ``None`` starts from an empty sequence.
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token.
    **options
        As for :func:`kimi_delta_attention`.

    Returns
    -------
    y_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache
        The cache after this token.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import (
    ...     init_kimi_delta_attention, kimi_delta_attention, kimi_delta_attention_step
    ... )
    >>> params = init_kimi_delta_attention(np, hidden_size=32, num_heads=2, head_dim=8)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> y, cache = kimi_delta_attention(params, x[:, :7], num_heads=2, return_cache=True)
    >>> y_t, cache = kimi_delta_attention_step(params, x[:, 7], cache, num_heads=2)
    >>> bool(np.allclose(y_t, kimi_delta_attention(params, x, num_heads=2)[:, 7], atol=1e-5))
    True
    """
    sizes, lower_bound = _sizes(params, dict(options))
    return run_token(
        BLOCK, params, x_t, sizes, partial(_log_decay, lower_bound=lower_bound), _gate,
        "sigmoid", attention_mask=attention_mask, cache=cache,
    )  # fmt: skip


def init_kimi_delta_attention(
    xp: Any,
    *,
    hidden_size: int = 2048,
    expand_v: float = 1,
    head_dim: int = 128,
    num_heads: int = 16,
    num_v_heads: int | None = None,
    use_short_conv: bool = True,
    safe_gate: bool = False,
    conv_size: int = 4,
    conv_bias: bool = False,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of a Kimi Delta Attention block, as the torch module draws them.

    Linear and convolution weights uniform within ``1 / sqrt(fan_in)`` (``g_proj.1``'s bias
    too), ``A_log = log(U(1, 16))`` (zeros with ``safe_gate``), ``dt_bias`` the inverse
    softplus of a log-uniform ``dt`` in ``[0.001, 0.1]`` per value head and key channel,
    ``o_norm.weight`` ones.

    Parameters
    ----------
    xp : namespace
        The array library to make them in.
    hidden_size, expand_v, head_dim, num_heads, num_v_heads : int or float
        The torch module's sizes, with its defaults.
    use_short_conv, safe_gate, conv_size, conv_bias : bool or int
        The torch module's options, with its defaults.
    seed : int
        Seeds the draws: the same seed gives the same parameters on every library.
    dtype : dtype, optional
        Default ``xp.float32``.
    device : optional
        Where to make them.

    Returns
    -------
    dict
        Name to array, the names and shapes of the torch module's state dict.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_kimi_delta_attention
    >>> params = init_kimi_delta_attention(np, hidden_size=16, num_heads=2, head_dim=4)
    >>> params["f_proj.1.weight"].shape, params["dt_bias"].shape
    ((8, 4), (8,))
    """
    draws = Draws(xp, seed=seed, dtype=dtype, device=device)
    v_heads = num_heads if num_v_heads is None else num_v_heads
    head_v_dim = round(head_dim * expand_v)
    key_dim, value_dim, gate_dim = num_heads * head_dim, v_heads * head_v_dim, v_heads * head_dim
    params = init_inputs(
        draws, hidden_size=hidden_size, key_dim=key_dim, value_dim=value_dim,
        num_v_heads=v_heads, use_short_conv=use_short_conv, conv_size=conv_size,
        conv_bias=conv_bias,
    )  # fmt: skip
    params |= {
        "f_proj.0.weight": draws.linear(head_v_dim, hidden_size),
        "f_proj.1.weight": draws.linear(gate_dim, head_v_dim),
        "A_log": (
            draws.zeros(v_heads) if safe_gate
            else draws.log_uniform(v_heads, 1.0, 16.0)
        ),
        "dt_bias": draws.dt_bias(gate_dim),
        "g_proj.0.weight": draws.linear(head_v_dim, hidden_size),
        "g_proj.1.weight": draws.linear(value_dim, head_v_dim),
        "g_proj.1.bias": draws.bias(value_dim, head_v_dim),
        "o_norm.weight": draws.ones(head_v_dim),
        "o_proj.weight": draws.linear(hidden_size, value_dim),
    }  # fmt: skip
    return params
