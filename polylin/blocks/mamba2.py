"""The Mamba-2 block (Dao and Gu, 2024) as functions of its parameters.

``mamba2(params, x)`` computes what :class:`polylin.torch.Mamba2` computes (and
``fla.layers.Mamba2`` and transformers' ``Mamba2Mixer``: the parameter names are theirs), on
the arrays of any array-API library: the SSD scan is :func:`polylin.causal_linear_attention`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

from .._inputs.defaults import DEFAULT_CHUNK_SIZE
from ..activations import silu, softplus
from ..attention import METHODS
from ..interop import array_namespace
from ..normalization import rms_norm
from ._init import Draws
from ._linear import Plan, check_implied, convolve, run_sequence, run_token
from ._params import BlockCache, linear, param

__all__ = ["init_mamba2", "mamba2", "mamba2_step"]

BLOCK = "mamba2"
#: Initialization options: accepted, their effect is in the parameters.
_INIT_ONLY = ("A_init_range", "dt_min", "dt_max", "dt_init_floor")


class _Sizes(NamedTuple):
    plan: Plan
    intermediate_size: int
    head_dim: int
    n_groups: int
    state_size: int
    rmsnorm: bool
    norm_before_gate: bool
    norm_eps: float
    dt_limit: tuple[float, float]


def _dt_limit(dt_limit: Any) -> tuple[float, float]:
    """``dt_limit`` as ``(low, high)``: two real numbers, not NaN, ``low <= high``."""
    try:
        bounds = tuple(dt_limit)
    except TypeError:
        raise TypeError(
            f"{BLOCK}: dt_limit must be a pair (low, high), got {type(dt_limit).__name__}"
        ) from None
    real = all(isinstance(b, numbers.Real) and not isinstance(b, bool) for b in bounds)
    if len(bounds) != 2 or not real:
        raise ValueError(
            f"{BLOCK}: dt_limit must be a pair of numbers (low, high), got {dt_limit!r}"
        )
    low, high = (float(b) for b in bounds)
    if math.isnan(low) or math.isnan(high) or low > high:
        raise ValueError(
            f"{BLOCK}: dt_limit must be (low, high) with low <= high, got {dt_limit!r}"
        )
    return low, high


def _groups(options: dict[str, Any], width: int) -> tuple[int, int]:
    """``(n_groups, state_size)`` from the options, given their product ``width``."""
    n_groups, state_size = options.pop("n_groups", None), options.pop("state_size", None)
    for name, value in (("n_groups", n_groups), ("state_size", state_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{BLOCK}: {name} must be a positive int, got {value!r}")
    if n_groups is None and state_size is None:
        raise TypeError(
            f"{BLOCK}: pass n_groups (or state_size): the parameters do not say how B and C "
            "split into groups"
        )
    if n_groups is None:
        n_groups = width // state_size if width % state_size == 0 else 0
    if (
        not n_groups
        or width % n_groups
        or (state_size is not None and n_groups * state_size != width)
    ):
        raise ValueError(
            f"{BLOCK}: n_groups={n_groups} and state_size={state_size} do not fit the "
            f"parameters, whose B and C have n_groups * state_size = {width} channels"
        )
    return n_groups, width // n_groups


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> _Sizes:
    """The sizes from the parameters' shapes, and the options they do not imply."""
    method = options.pop("method", "chunked")
    if method not in METHODS:
        raise ValueError(f"{BLOCK}: method must be one of {METHODS}, got {method!r}")
    chunk_size = int(options.pop("chunk_size", DEFAULT_CHUNK_SIZE))
    dt_limit = _dt_limit(options.pop("dt_limit", (0.0, math.inf)))
    norm_before_gate = options.pop("norm_before_gate", False)
    if not isinstance(norm_before_gate, bool):
        raise TypeError(
            f"{BLOCK}: norm_before_gate must be True or False, got {norm_before_gate!r}"
        )
    norm_eps = float(options.pop("norm_eps", 1e-5))
    for name in _INIT_ONLY:
        options.pop(name, None)
    projected, hidden = param(BLOCK, params, "in_proj.weight", ndim=2).shape
    intermediate = param(BLOCK, params, "out_proj.weight", ndim=2).shape[1]
    heads = param(BLOCK, params, "dt_bias", ndim=1).shape[0]
    conv = param(BLOCK, params, "conv1d.weight", ndim=3)
    conv_dim, width = conv.shape[0], conv.shape[0] - intermediate
    d_size = param(BLOCK, params, "D", ndim=1).shape[0]
    if (
        intermediate % heads or projected != intermediate + conv_dim + heads or width < 2
        or width % 2 or d_size not in (heads, intermediate)
    ):  # fmt: skip
        raise ValueError(
            f"{BLOCK}: in_proj.weight ({projected} rows), out_proj.weight ({intermediate} "
            f"columns), conv1d.weight ({conv_dim} channels), dt_bias ({heads}) and D ({d_size}) "
            "are not one Mamba-2 block's"
        )
    n_groups, state_size = _groups(options, width // 2)
    if heads % n_groups:
        raise ValueError(f"{BLOCK}: num_heads={heads} is not a multiple of n_groups={n_groups}")
    rmsnorm = "norm.weight" in params
    implied = {
        "hidden_size": hidden, "num_heads": heads, "head_dim": intermediate // heads,
        "expand": lambda e: (e * hidden == intermediate, intermediate / hidden),
        "conv_kernel": conv.shape[-1], "use_conv_bias": "conv1d.bias" in params,
        "D_has_hdim": d_size == intermediate != heads, "rmsnorm": rmsnorm,
        "use_bias": "in_proj.bias" in params,
    }  # fmt: skip
    if options.get("num_heads") == 0:  # the torch module's "from the other sizes"
        options.pop("num_heads")
    check_implied(BLOCK, options, implied)
    plan = Plan(BLOCK, hidden, heads, n_groups, 1, method, chunk_size)
    return _Sizes(
        plan, intermediate, intermediate // heads, n_groups, state_size, rmsnorm,
        norm_before_gate, norm_eps, dt_limit,
    )  # fmt: skip


def _inputs(
    params: Mapping[str, Any],
    sizes: _Sizes,
    x: Any,
    mask: Any,
    conv_state: tuple[Any, ...] | None,
    one: bool,
) -> tuple[list[Any], Any, tuple[Any, ...]]:
    """``q = C``, ``k = B`` ``(..., n_groups, 1, state_size)``, ``v = dt x`` and the log decay
    ``dt A`` ``(..., n_groups, heads per group, d)``: head ``h`` reads group ``h // (num_heads
    // n_groups)`` by broadcasting. ``rest`` is ``(x, z)`` for the output."""
    xp = array_namespace(x)
    inner, heads = sizes.intermediate_size, sizes.plan.heads
    zxbcdt = linear(params, x, "in_proj")
    z, xBC, dt = zxbcdt[..., :inner], zxbcdt[..., inner:-heads], zxbcdt[..., -heads:]
    (xBC,), states = convolve(params, ("conv1d",), [xBC], mask, conv_state, one=one)
    lead = tuple(x.shape[:-1])
    groups, width = sizes.n_groups, sizes.n_groups * sizes.state_size
    per_group = heads // groups
    xs = xp.reshape(xBC[..., :inner], (*lead, groups, per_group, sizes.head_dim))
    B, C = (
        xp.reshape(t, (*lead, groups, 1, sizes.state_size))
        for t in (xBC[..., inner : inner + width], xBC[..., inner + width :])
    )
    dt = softplus(dt + params["dt_bias"])
    low, high = sizes.dt_limit
    if low > 0.0 or high < math.inf:
        dt = xp.clip(dt, min=low, max=high)
    log_decay = xp.astype(-xp.exp(params["A_log"]) * dt, xs.dtype, copy=False)
    log_decay, dt = (xp.reshape(t, (*lead, groups, per_group, 1)) for t in (log_decay, dt))
    v = xs * xp.astype(dt, xs.dtype, copy=False)
    return [C, B, v, log_decay], (xs, z), states


def _output(params: Mapping[str, Any], sizes: _Sizes, y: Any, rest: tuple[Any, Any]) -> Any:
    """``y + D x``, the gated norm (or ``y * silu(z)``), ``out_proj``."""
    xs, z = rest
    xp = array_namespace(z)
    heads, groups = sizes.plan.heads, sizes.n_groups
    D = params["D"]
    D = xp.reshape(D, (groups, heads // groups, D.shape[0] // heads))  # (.., 1): D per head
    y = xp.reshape(y + xs * D, z.shape)
    if not sizes.rmsnorm:
        return linear(params, y * silu(z), "out_proj")
    group_shape = (groups, sizes.intermediate_size // groups)
    lead = tuple(z.shape[:-1])
    y = rms_norm(
        xp.reshape(y, (*lead, *group_shape)), xp.reshape(params["norm.weight"], group_shape),
        gate=xp.reshape(z, (*lead, *group_shape)), eps=sizes.norm_eps, activation="silu",
        norm_before_gate=sizes.norm_before_gate,
    )  # fmt: skip
    return linear(params, xp.reshape(y, z.shape), "out_proj")


def _stages(params: Mapping[str, Any], options: dict[str, Any]) -> tuple[Plan, Any, Any]:
    sizes = _sizes(params, options)
    return sizes.plan, partial(_inputs, params, sizes), partial(_output, params, sizes)


def mamba2(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The Mamba-2 block over a whole sequence (training, prefill).

    The computation of :class:`polylin.torch.Mamba2` (its docstring lists the steps):
    ``in_proj`` into ``z``, ``xBC`` and ``dt``; the short convolution and SiLU on ``xBC``;
    ``dt = softplus(dt + dt_bias)`` (clipped to ``dt_limit``); the SSD scan
    :func:`polylin.causal_linear_attention` with ``q = C``, ``k = B``, ``v = dt x`` and
    ``log_decay = -exp(A_log) dt``; ``y + D x``; the gated RMSNorm per group; ``out_proj``.

    Parameters
    ----------
    params : mapping
        The torch module's state dict (names ``in_proj.weight``, ``A_log``, ``D``, ...), as
        arrays of one library; :func:`init_mamba2` makes one.
    x : array
        ``(batch, T, hidden_size)``, of the library of ``params``.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens (left or right padding): padded tokens
        reach no real output, no convolution state and no recurrent state; their outputs are 0.
    cache : BlockCache, optional
        The cache after earlier tokens, to continue from: the convolution's state ``(batch,
        conv_kernel - 1, conv_dim)`` and a :class:`polylin.LinearAttentionState` with ``S``
        ``(batch, num_heads, state_size, head_dim)``.
    return_cache : bool
        Also return the cache after the last token.
    **options
        The torch module's constructor keywords. ``n_groups`` (or ``state_size``) is
        required: the shapes do not say how ``B`` and ``C`` split into groups.
        ``norm_before_gate``, ``dt_limit``, ``norm_eps``, ``method`` and ``chunk_size`` as
        there. ``hidden_size``, ``num_heads``, ``head_dim``, ``expand``, ``conv_kernel``,
        ``use_conv_bias``, ``D_has_hdim``, ``rmsnorm`` and ``use_bias`` follow from the shapes
        and are checked against them; the initialization's (``A_init_range``, ``dt_min``,
        ``dt_max``, ``dt_init_floor``) are accepted and unused.

    Returns
    -------
    array or (array, BlockCache)
        ``y`` ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

    Raises
    ------
    ValueError
        An option the shapes contradict, inputs of the wrong shape, a cache of another block.
    TypeError
        A mask that is not boolean, an unknown option, no ``n_groups`` nor ``state_size``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_mamba2, mamba2, mamba2_step
    >>> params = init_mamba2(np, hidden_size=32, head_dim=16, state_size=8, n_groups=2)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> y, cache = mamba2(params, x[:, :7], n_groups=2, return_cache=True)
    >>> y_t, cache = mamba2_step(params, x[:, 7], cache, n_groups=2)
    >>> bool(np.allclose(y_t, mamba2(params, x, n_groups=2)[:, 7], atol=1e-5))
    True
    """
    plan, inputs, output = _stages(params, dict(options))
    return run_sequence(
        plan, x, inputs, output, attention_mask=attention_mask, cache=cache,
        return_cache=return_cache,
    )  # fmt: skip


def mamba2_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, BlockCache]:
    """One new token per sequence of the Mamba-2 block, from the cache before it.

    Parameters
    ----------
    params : mapping
        As for :func:`mamba2`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        From ``mamba2(..., return_cache=True)`` or an earlier step; ``None`` starts from an
        empty sequence (zero states).
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token. The others keep their cache and
        output 0, whatever ``x_t`` holds there.
    **options
        As for :func:`mamba2` (``method`` and ``chunk_size`` are not used).

    Returns
    -------
    y_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache
        The cache after this token.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_mamba2, mamba2_step
    >>> params = init_mamba2(np, hidden_size=16, head_dim=8, state_size=4)
    >>> y_t, cache = mamba2_step(params, np.ones((3, 16), np.float32), n_groups=1)
    >>> y_t.shape, cache.conv_state[0].shape, cache.recurrent_state.S.shape
    ((3, 16), (3, 3, 40), (3, 4, 4, 8))
    """
    plan, inputs, output = _stages(params, dict(options))
    return run_token(plan, x_t, inputs, output, attention_mask=attention_mask, cache=cache)


def init_mamba2(
    xp: Any,
    *,
    head_dim: int = 64,
    hidden_size: int = 2048,
    state_size: int = 128,
    expand: int = 2,
    n_groups: int = 1,
    conv_kernel: int = 4,
    use_conv_bias: bool = True,
    D_has_hdim: bool = False,
    rmsnorm: bool = True,
    use_bias: bool = False,
    A_init_range: tuple[float, float] = (1, 16),
    dt_min: float = 0.001,
    dt_max: float = 0.1,
    dt_init_floor: float = 1e-4,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of a Mamba-2 block, as the torch module draws them.

    Linear and convolution weights and biases uniform within ``1 / sqrt(fan_in)`` (PyTorch's
    defaults), ``A_log = log(U(A_init_range))``, ``dt_bias`` the inverse softplus of a
    log-uniform ``dt`` in ``[dt_min, dt_max]`` floored at ``dt_init_floor``, ``D`` and the
    norm's weight ones; the names and shapes of :class:`polylin.torch.Mamba2`'s state dict.

    Parameters
    ----------
    xp : namespace
        The array library to make them in (``numpy``, ``jax.numpy``, ``torch``, ...).
    head_dim, hidden_size, state_size, expand, n_groups, conv_kernel : int
        The torch module's sizes, with its defaults.
    use_conv_bias, D_has_hdim, rmsnorm, use_bias : bool
        The torch module's options, with its defaults.
    A_init_range, dt_min, dt_max, dt_init_floor : float
        The initialization's ranges, with the torch module's defaults.
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
    >>> from polylin.blocks import init_mamba2
    >>> params = init_mamba2(np, hidden_size=16, head_dim=8, state_size=4)
    >>> params["in_proj.weight"].shape, params["conv1d.weight"].shape, params["A_log"].shape
    ((76, 16), (40, 1, 4), (4,))
    """
    draws = Draws(xp, seed=seed, dtype=dtype, device=device)
    inner = expand * hidden_size
    heads = inner // head_dim
    conv_dim = inner + 2 * n_groups * state_size
    params = {"in_proj.weight": draws.linear(inner + conv_dim + heads, hidden_size)}
    if use_bias:
        params["in_proj.bias"] = draws.bias(inner + conv_dim + heads, hidden_size)
    params["conv1d.weight"] = draws.conv(conv_dim, conv_kernel)
    if use_conv_bias:
        params["conv1d.bias"] = draws.bias(conv_dim, conv_kernel)
    params["dt_bias"] = draws.dt_bias(heads, dt_min=dt_min, dt_max=dt_max, floor=dt_init_floor)
    params["A_log"] = draws.log_uniform(heads, *A_init_range)
    params["D"] = draws.ones(inner if D_has_hdim else heads)
    if rmsnorm:
        params["norm.weight"] = draws.ones(inner)
    params["out_proj.weight"] = draws.linear(hidden_size, inner)
    if use_bias:
        params["out_proj.bias"] = draws.bias(hidden_size, inner)
    return params
