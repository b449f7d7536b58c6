"""The gated linear attention block (GLA, Yang et al., 2023) as functions of its parameters.

``gated_linear_attention(params, x)`` computes what :class:`polylin.torch.GatedLinearAttention`
computes (and ``fla.layers.GatedLinearAttention``: the parameter names are theirs), on the
arrays of any array-API library.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

from .._inputs.defaults import DEFAULT_CHUNK_SIZE
from ..activations import sigmoid, silu, softplus
from ..attention import METHODS
from ..interop import array_namespace
from ..normalization import rms_norm
from ._init import Draws
from ._linear import Plan, check_implied, convolve, run_sequence, run_token
from ._params import BlockCache, linear, param

__all__ = [
    "gated_linear_attention",
    "gated_linear_attention_step",
    "init_gated_linear_attention",
]

BLOCK = "gated_linear_attention"
GATE_FNS = {"swish": silu, "silu": silu, "sigmoid": sigmoid}
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
_NORMS = ("g_norm_swish_gate", "g_norm")


class _Sizes(NamedTuple):
    plan: Plan
    num_kv_heads: int
    groups: int
    head_k_dim: int
    head_v_dim: int
    use_short_conv: bool
    use_output_gate: bool
    #: The output norm's state-dict name, and whether the gate is applied inside it.
    norm: str
    fused: bool
    gate_fn: str
    feature_map: Callable[[Any], Any] | None
    norm_eps: float
    gate_logit_normalizer: float
    clamp_min: float | None


def _expand(dim: int, hidden: int) -> Callable[[Any], tuple[bool, Any]]:
    """``int(hidden * expand) == dim`` (the torch module's rounding)."""
    return lambda given: (int(hidden * given) == dim, dim / hidden)


def _computation_options(options: dict[str, Any]) -> dict[str, Any]:
    """Pop and check the options that the parameters do not imply."""
    feature_map = options.pop("feature_map", None)
    if feature_map is not None and not callable(feature_map):
        raise TypeError(f"{BLOCK}: feature_map must be a callable, got {type(feature_map)}")
    method = options.pop("method", "chunked")
    if method not in METHODS:
        raise ValueError(f"{BLOCK}: method must be one of {METHODS}, got {method!r}")
    gate_fn = options.pop("gate_fn", "swish")
    if gate_fn not in GATE_FNS:
        raise ValueError(f"{BLOCK}: gate_fn must be one of {tuple(GATE_FNS)}, got {gate_fn!r}")
    clamp_min = options.pop("clamp_min", None)
    normalizer = options.pop("gate_logit_normalizer", 16)
    for name, value in (("clamp_min", clamp_min), ("gate_logit_normalizer", normalizer)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{BLOCK}: {name} must be a real number, got {value!r}")
    return {
        "feature_map": feature_map, "method": method, "gate_fn": gate_fn,
        "clamp_min": None if clamp_min is None else float(clamp_min),
        "gate_logit_normalizer": float(normalizer),
        "norm_eps": float(options.pop("norm_eps", 1e-5)),
        "chunk_size": int(options.pop("chunk_size", DEFAULT_CHUNK_SIZE)),
    }  # fmt: skip


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> _Sizes:
    """The sizes from the parameters' shapes, and the options they do not imply."""
    own = _computation_options(options)
    key_dim, hidden = param(BLOCK, params, "q_proj.weight", ndim=2).shape
    kv_key_dim = param(BLOCK, params, "k_proj.weight", ndim=2).shape[0]
    value_dim = param(BLOCK, params, "o_proj.weight", ndim=2).shape[1]
    rank = param(BLOCK, params, "gk_proj.0.weight", ndim=2).shape[0]
    norm = next((n for n in _NORMS if f"{n}.weight" in params), None)
    num_heads = options.pop("num_heads", None)
    if norm is not None:
        heads_implied = value_dim // param(BLOCK, params, f"{norm}.weight", ndim=1).shape[0]
        check_implied(BLOCK, {"num_heads": num_heads}, {"num_heads": heads_implied})
        num_heads = heads_implied
    elif num_heads is None:
        raise TypeError(f"{BLOCK}: pass num_heads: the parameters (no norm weight) do not say")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{BLOCK}: num_heads must be a positive int, got {num_heads!r}")
    groups = key_dim // kv_key_dim if kv_key_dim and key_dim % kv_key_dim == 0 else 0
    if key_dim % num_heads or value_dim % num_heads or not groups or num_heads % groups:
        raise ValueError(
            f"{BLOCK}: q_proj.weight ({key_dim} rows), k_proj.weight ({kv_key_dim}) and "
            f"o_proj.weight ({value_dim} columns) do not fit num_heads={num_heads}"
        )
    use_output_gate = "g_proj.weight" in params
    swish_gate = own["gate_fn"] == "swish" and use_output_gate
    if norm == "g_norm_swish_gate" and not swish_gate:
        raise ValueError(
            f"{BLOCK}: the parameters hold g_norm_swish_gate, the norm of a swish output gate, "
            f"but gate_fn={own['gate_fn']!r}"
            + ("" if use_output_gate else " and there is no g_proj.weight")
        )
    fuse_norm = options.pop("fuse_norm", None)
    fused = swish_gate and (norm == "g_norm_swish_gate" if norm else fuse_norm is not False)
    use_short_conv = "q_conv1d.weight" in params
    implied = {
        "hidden_size": hidden, "expand_k": _expand(key_dim, hidden),
        "expand_v": _expand(value_dim, hidden), "num_kv_heads": num_heads // groups,
        "use_short_conv": use_short_conv, "use_output_gate": use_output_gate,
        "elementwise_affine": norm is not None, "gate_low_rank_dim": rank,
        "conv_size": param(BLOCK, params, "q_conv1d.weight", ndim=3).shape[-1]
        if use_short_conv else None,
        "conv_bias": "q_conv1d.bias" in params if use_short_conv else None,
        "fuse_norm": fused if norm and swish_gate else None,
    }  # fmt: skip
    check_implied(BLOCK, {**options, "fuse_norm": fuse_norm}, implied)
    plan = Plan(
        BLOCK, hidden, num_heads, num_heads // groups, 3 if use_short_conv else 0,
        own["method"], own["chunk_size"], (key_dim // num_heads) ** -0.5,
    )  # fmt: skip
    return _Sizes(
        plan, num_heads // groups, groups, key_dim // num_heads, value_dim // num_heads,
        use_short_conv, use_output_gate, norm or "g_norm", fused, own["gate_fn"],
        own["feature_map"], own["norm_eps"], own["gate_logit_normalizer"], own["clamp_min"],
    )  # fmt: skip


def _inputs(
    params: Mapping[str, Any],
    sizes: _Sizes,
    x: Any,
    mask: Any,
    conv_state: tuple[Any, ...] | None,
    one: bool,
) -> tuple[list[Any], Any, tuple[Any, ...]]:
    """``q`` ``(..., num_kv_heads, groups, head_k_dim)``, ``k``, ``v`` and the log decay
    ``(..., num_kv_heads, 1, d)``: key/value head ``h`` serves query heads ``h * groups ..
    h * groups + groups - 1`` by broadcasting."""
    xp = array_namespace(x)
    projected = [linear(params, x, f"{n}_proj") for n in "qkv"]
    states: tuple[Any, ...] = ()
    if sizes.use_short_conv:
        projected, states = convolve(params, _CONVS, projected, mask, conv_state, one=one)
    lead = tuple(x.shape[:-1])
    kv_heads, dk, dv = sizes.num_kv_heads, sizes.head_k_dim, sizes.head_v_dim
    q = xp.reshape(projected[0], (*lead, kv_heads, sizes.groups, dk))
    k = xp.reshape(projected[1], (*lead, kv_heads, 1, dk))
    v = xp.reshape(projected[2], (*lead, kv_heads, 1, dv))
    gk = linear(params, linear(params, x, "gk_proj.0"), "gk_proj.1")
    g = -softplus(-gk) / sizes.gate_logit_normalizer  # logsigmoid
    if sizes.clamp_min is not None:  # a NaN stays NaN, as with clamp
        g = xp.where(g < sizes.clamp_min, sizes.clamp_min, g)
    g = xp.reshape(g, (*lead, kv_heads, 1, dk))
    if sizes.feature_map is not None:
        q, k = sizes.feature_map(q), sizes.feature_map(k)
    return [q, k, v, xp.astype(g, q.dtype, copy=False)], x, states


def _output(params: Mapping[str, Any], sizes: _Sizes, o: Any, x: Any) -> Any:
    """The norm per head, the output gate, ``o_proj``."""
    xp = array_namespace(x)
    lead = tuple(x.shape[:-1])
    heads, dv = sizes.plan.heads, sizes.head_v_dim
    o = xp.reshape(o, (*lead, heads, dv))  # the groups back into heads
    weight = params.get(f"{sizes.norm}.weight")
    if sizes.fused:
        gate = xp.reshape(linear(params, x, "g_proj"), (*lead, heads, dv))
        o = rms_norm(o, weight, gate=gate, eps=sizes.norm_eps, activation="silu")
        o = xp.reshape(o, (*lead, heads * dv))
    else:
        o = xp.reshape(rms_norm(o, weight, eps=sizes.norm_eps), (*lead, heads * dv))
        if sizes.use_output_gate:
            o = o * GATE_FNS[sizes.gate_fn](linear(params, x, "g_proj"))
    return linear(params, o, "o_proj")


def _stages(params: Mapping[str, Any], options: dict[str, Any]) -> tuple[Plan, Any, Any]:
    sizes = _sizes(params, options)
    return sizes.plan, partial(_inputs, params, sizes), partial(_output, params, sizes)


def gated_linear_attention(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The gated linear attention block over a whole sequence (training, prefill).

    The computation of :class:`polylin.torch.GatedLinearAttention` (its docstring lists the
    steps): ``q``, ``k``, ``v`` projections (short convolutions and SiLU where the parameters
    have them), the forget gate ``logsigmoid(gk_proj(x)) / gate_logit_normalizer`` per key
    channel, :func:`polylin.causal_linear_attention` with that log decay and
    ``normalize=False``, the RMSNorm per head and output gate, ``o_proj``.

    Parameters
    ----------
    params : mapping
        The torch module's state dict (names ``q_proj.weight``, ``gk_proj.0.weight``, ...), as
        arrays of one library; :func:`init_gated_linear_attention` makes one.
    x : array
        ``(batch, T, hidden_size)``, of the library of ``params``.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens (left or right padding): padded tokens
        reach no real output, no convolution state and no recurrent state; their outputs are 0.
    cache : BlockCache, optional
        The cache after earlier tokens, to continue from. Its recurrent state is a
        :class:`polylin.LinearAttentionState` with ``S`` ``(batch, num_heads, head_k_dim,
        head_v_dim)``.
    return_cache : bool
        Also return the cache after the last token.
    **options
        The torch module's constructor keywords. ``feature_map``, ``gate_fn``, ``norm_eps``,
        ``gate_logit_normalizer``, ``clamp_min``, ``method`` and ``chunk_size`` as there;
        ``num_heads`` is needed only without a norm weight (``elementwise_affine=False``), and
        ``fuse_norm`` only there. The others (``hidden_size``, ``expand_k``, ``expand_v``,
        ``num_kv_heads``, ``use_short_conv``, ``conv_size``, ``conv_bias``,
        ``use_output_gate``, ``elementwise_affine``, ``gate_low_rank_dim``) follow from the
        shapes and are checked against them.

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
    >>> from polylin.blocks import (
    ...     gated_linear_attention, gated_linear_attention_step, init_gated_linear_attention)
    >>> params = init_gated_linear_attention(np, hidden_size=32, num_heads=2)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> y, cache = gated_linear_attention(params, x[:, :7], return_cache=True)
    >>> y_t, cache = gated_linear_attention_step(params, x[:, 7], cache)
    >>> bool(np.allclose(y_t, gated_linear_attention(params, x)[:, 7], atol=1e-5))
    True
    """
    plan, inputs, output = _stages(params, dict(options))
    return run_sequence(
        plan, x, inputs, output, attention_mask=attention_mask, cache=cache,
        return_cache=return_cache,
    )  # fmt: skip


def gated_linear_attention_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, BlockCache]:
    """One new token per sequence of the gated linear attention block, from the cache before it.

    Parameters
    ----------
    params : mapping
        As for :func:`gated_linear_attention`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        From ``gated_linear_attention(..., return_cache=True)`` or an earlier step; ``None``
        starts from an empty sequence (zero states).
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token. The others keep their cache and
        output 0, whatever ``x_t`` holds there.
    **options
        As for :func:`gated_linear_attention` (``method`` and ``chunk_size`` are not used).

    Returns
    -------
    y_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache
        The cache after this token.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import gated_linear_attention_step, init_gated_linear_attention
    >>> params = init_gated_linear_attention(np, hidden_size=16, num_heads=2)
    >>> y_t, cache = gated_linear_attention_step(params, np.ones((3, 16), np.float32))
    >>> y_t.shape, cache.recurrent_state.S.shape
    ((3, 16), (3, 2, 4, 8))
    """
    plan, inputs, output = _stages(params, dict(options))
    return run_token(plan, x_t, inputs, output, attention_mask=attention_mask, cache=cache)


def init_gated_linear_attention(
    xp: Any,
    *,
    hidden_size: int = 1024,
    expand_k: float = 0.5,
    expand_v: float = 1.0,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    use_short_conv: bool = False,
    conv_size: int = 4,
    conv_bias: bool = False,
    use_output_gate: bool = True,
    gate_fn: str = "swish",
    elementwise_affine: bool = True,
    gate_low_rank_dim: int = 16,
    fuse_norm: bool = True,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of a gated linear attention block, as the torch module draws them.

    Linear and convolution weights (and ``gk_proj``'s bias) uniform within ``1 /
    sqrt(fan_in)`` (PyTorch's defaults), the norm's weight ones; the names and shapes of
    :class:`polylin.torch.GatedLinearAttention`'s state dict.

    Parameters
    ----------
    xp : namespace
        The array library to make them in (``numpy``, ``jax.numpy``, ``torch``, ...).
    hidden_size, expand_k, expand_v, num_heads, num_kv_heads : int or float
        The torch module's sizes, with its defaults.
    use_short_conv, conv_size, conv_bias, use_output_gate, gate_fn : bool, int or str
        The torch module's options, with its defaults.
    elementwise_affine, gate_low_rank_dim, fuse_norm : bool or int
        The torch module's options, with its defaults (``fuse_norm`` names the norm
        ``g_norm_swish_gate`` with a swish output gate).
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
    >>> from polylin.blocks import init_gated_linear_attention
    >>> params = init_gated_linear_attention(np, hidden_size=16, num_heads=2)
    >>> params["q_proj.weight"].shape, params["g_norm_swish_gate.weight"].shape
    ((8, 16), (8,))
    """
    draws = Draws(xp, seed=seed, dtype=dtype, device=device)
    groups = num_heads // (num_heads if num_kv_heads is None else num_kv_heads)
    key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
    kv_key, kv_value = key_dim // groups, value_dim // groups
    params = {
        "q_proj.weight": draws.linear(key_dim, hidden_size),
        "k_proj.weight": draws.linear(kv_key, hidden_size),
        "v_proj.weight": draws.linear(kv_value, hidden_size),
    }
    if use_output_gate:
        params["g_proj.weight"] = draws.linear(value_dim, hidden_size)
    if use_short_conv:
        for n, channels in (("q", key_dim), ("k", kv_key), ("v", kv_value)):
            params[f"{n}_conv1d.weight"] = draws.conv(channels, conv_size)
            if conv_bias:
                params[f"{n}_conv1d.bias"] = draws.bias(channels, conv_size)
    params["gk_proj.0.weight"] = draws.linear(gate_low_rank_dim, hidden_size)
    params["gk_proj.1.weight"] = draws.linear(kv_key, gate_low_rank_dim)
    params["gk_proj.1.bias"] = draws.bias(kv_key, gate_low_rank_dim)
    params["o_proj.weight"] = draws.linear(hidden_size, value_dim)
    if elementwise_affine:
        fused = gate_fn == "swish" and fuse_norm and use_output_gate
        params[f"{_NORMS[0] if fused else _NORMS[1]}.weight"] = draws.ones(value_dim // num_heads)
    return params
