"""The Mamba-1 mixer (Gu and Dao, 2023) as functions of its parameters.

``mamba(params, x)`` computes what transformers' ``MambaMixer`` computes (its slow path; the
parameter names are its state dict's, which are also mamba_ssm's ``Mamba``): ``in_proj`` into
``x`` and the gate ``z``, the short convolution and SiLU on ``x``, ``x_proj`` into the rank-r
time step, ``B`` and ``C``, ``dt_proj``, and the selective scan :func:`polylin.selective_scan`
with the skip ``D`` and the gate ``silu(z)``, then ``out_proj``. With ``bcdt_rms_eps`` it is
FalconMamba's mixer (weightless RMSNorms on the time step, ``B`` and ``C``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..interop import array_namespace, is_array
from ..normalization import rms_norm
from ..selective_scan import SELECTIVE_METHODS, selective_scan, selective_scan_step
from ._init import Draws
from ._linear import check_implied, convolve
from ._params import BlockCache, linear, padding_mask, param

__all__ = ["init_mamba", "mamba", "mamba_step"]

BLOCK = "mamba"
#: Initialization options: accepted, their effect is in the parameters.
_INIT_ONLY = (
    "time_step_scale", "time_step_min", "time_step_max", "time_step_floor",
    "time_step_init_scheme",
)  # fmt: skip


class _Sizes(NamedTuple):
    hidden_size: int
    intermediate_size: int
    time_step_rank: int
    state_size: int
    method: str
    chunk_size: int | None
    bcdt_rms_eps: float | None


def _rank(hidden: int, rank: int) -> Any:
    """``time_step_rank`` given as an int or ``"auto"`` (``ceil(hidden_size / 16)``)."""
    return lambda given: ((math.ceil(hidden / 16) if given == "auto" else given) == rank, rank)


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> _Sizes:
    """The sizes from the parameters' shapes, and the options they do not imply."""
    method = options.pop("method", "chunked")
    if method not in SELECTIVE_METHODS:
        raise ValueError(f"{BLOCK}: method must be one of {SELECTIVE_METHODS}, got {method!r}")
    chunk_size = options.pop("chunk_size", None)
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{BLOCK}: chunk_size must be an int >= 1, got {chunk_size!r}")
    act = options.pop("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{BLOCK}: hidden_act must be 'silu' (Mamba's), got {act!r}")
    eps = options.pop("bcdt_rms_eps", None)
    if eps is not None and (
        isinstance(eps, bool) or not isinstance(eps, float | int) or not 0 < eps < math.inf
    ):
        raise ValueError(f"{BLOCK}: bcdt_rms_eps must be None or a number > 0, got {eps!r}")
    for name in _INIT_ONLY:
        options.pop(name, None)
    projected, hidden = param(BLOCK, params, "in_proj.weight", ndim=2).shape
    inner = param(BLOCK, params, "out_proj.weight", ndim=2).shape[1]
    rank = param(BLOCK, params, "dt_proj.weight", ndim=2).shape[1]
    width, x_inner = param(BLOCK, params, "x_proj.weight", ndim=2).shape
    A_log = param(BLOCK, params, "A_log", ndim=2)
    conv = param(BLOCK, params, "conv1d.weight", ndim=3)
    state_size = A_log.shape[1]
    d_size = param(BLOCK, params, "D", ndim=1).shape[0]
    if (
        projected != 2 * inner or x_inner != inner or width != rank + 2 * state_size
        or A_log.shape[0] != inner or conv.shape[0] != inner or d_size != inner
        or params["dt_proj.weight"].shape[0] != inner
    ):  # fmt: skip
        raise ValueError(
            f"{BLOCK}: in_proj.weight {tuple(params['in_proj.weight'].shape)}, x_proj.weight "
            f"{(width, x_inner)}, dt_proj.weight {tuple(params['dt_proj.weight'].shape)}, "
            f"A_log {tuple(A_log.shape)}, conv1d.weight {tuple(conv.shape)}, D ({d_size},) and "
            f"out_proj.weight ({inner} columns) are not one Mamba mixer's"
        )
    implied = {
        "hidden_size": hidden, "intermediate_size": inner, "state_size": state_size,
        "expand": lambda e: (int(e * hidden) == inner, inner / hidden),
        "time_step_rank": _rank(hidden, rank), "conv_kernel": conv.shape[-1],
        "use_conv_bias": "conv1d.bias" in params, "use_bias": "in_proj.bias" in params,
    }  # fmt: skip
    check_implied(BLOCK, options, implied)
    rms_eps = None if eps is None else float(eps)
    return _Sizes(hidden, inner, rank, state_size, method, chunk_size, rms_eps)


def _check_cache(sizes: _Sizes, cache: Any, x: Any) -> None:
    """``cache`` is ``None`` or a :class:`BlockCache` of a Mamba mixer of this batch."""
    if cache is None:
        return
    if not isinstance(cache, tuple) or len(cache) != 2:
        raise TypeError(
            f"{BLOCK}: cache must be a BlockCache (conv_state, recurrent_state) from this "
            f"block, got {type(cache).__name__}"
        )
    conv_state, h = cache
    want = (sizes.intermediate_size, sizes.state_size)
    if (
        not isinstance(conv_state, tuple) or len(conv_state) != 1 or not is_array(h)
        or h.ndim != 3 or tuple(h.shape[1:]) != want
    ):  # fmt: skip
        raise ValueError(
            f"{BLOCK}: the cache must hold one convolution state and a state (batch, "
            f"{want[0]}, {want[1]}): it was made by another block"
        )
    if h.shape[0] != x.shape[0]:
        raise ValueError(
            f"{BLOCK}: the cache's recurrent state is for a batch of {h.shape[0]}, the "
            f"input's is {x.shape[0]}"
        )


def _scan_inputs(
    params: Mapping[str, Any],
    sizes: _Sizes,
    x: Any,
    mask: Any,
    conv_state: tuple[Any, ...] | None,
    one: bool,
) -> tuple[list[Any], tuple[Any, ...]]:
    """``[xs, dt, B, C, z]`` for the scan (``dt`` before ``dt_proj.bias``), and the new
    convolution state."""
    inner, rank, n = sizes.intermediate_size, sizes.time_step_rank, sizes.state_size
    projected = linear(params, x, "in_proj")
    xs, z = projected[..., :inner], projected[..., inner:]
    (xs,), states = convolve(params, ("conv1d",), [xs], mask, conv_state, one=one)
    ts_B_C = linear(params, xs, "x_proj")
    ts, B, C = ts_B_C[..., :rank], ts_B_C[..., rank : rank + n], ts_B_C[..., rank + n :]
    if sizes.bcdt_rms_eps is not None:
        ts, B, C = (rms_norm(t, eps=sizes.bcdt_rms_eps) for t in (ts, B, C))
    xp = array_namespace(x)
    dt = ts @ xp.matrix_transpose(params["dt_proj.weight"])
    return [xs, dt, B, C, z], states


def mamba(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The Mamba-1 mixer over a whole sequence (training, prefill).

    transformers' ``MambaMixer``: ``in_proj`` into ``x`` and ``z``; the depthwise causal
    convolution and SiLU on ``x``; ``x_proj`` into the time step (rank ``time_step_rank``),
    ``B`` and ``C``; ``dt = dt_proj(time step)``; the selective scan
    :func:`polylin.selective_scan` with ``A = -exp(A_log)``, ``softplus(dt)``, the skip ``D``
    and the gate ``silu(z)``; ``out_proj``.

    Parameters
    ----------
    params : mapping
        The state dict of transformers' ``MambaMixer`` (``in_proj.weight``, ``conv1d.weight``,
        ``x_proj.weight``, ``dt_proj.weight``, ``dt_proj.bias``, ``A_log``, ``D``,
        ``out_proj.weight``; ``conv1d.bias``, ``in_proj.bias`` and ``out_proj.bias`` where the
        model has them), as arrays of one library; :func:`init_mamba` makes one.
    x : array
        ``(batch, T, hidden_size)``, of the library of ``params``.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens (left or right padding): padded tokens
        reach no real output, no convolution state and no recurrent state (their inputs are
        never read); their outputs are 0.
    cache : BlockCache, optional
        The cache after earlier tokens, to continue from: the convolution's state ``(batch,
        conv_kernel - 1, intermediate_size)`` and the scan's state ``(batch,
        intermediate_size, state_size)``.
    return_cache : bool
        Also return the cache after the last token.
    **options
        ``method`` (``"chunked"``, ``"recurrent"``, ``"quadratic"``) and ``chunk_size`` of the
        scan; ``bcdt_rms_eps``: ``None`` for Mamba, FalconMamba's ``mixer_rms_eps`` for its
        weightless RMSNorms on the time step, ``B`` and ``C``; ``hidden_act`` (``"silu"``).
        The config's ``hidden_size``, ``intermediate_size``, ``expand``, ``state_size``,
        ``time_step_rank`` (an int or ``"auto"``), ``conv_kernel``, ``use_conv_bias`` and
        ``use_bias`` follow from the shapes and are checked against them; the
        initialization's (``time_step_scale``, ``time_step_min``, ``time_step_max``,
        ``time_step_floor``, ``time_step_init_scheme``) are accepted and unused.

    Returns
    -------
    array or (array, BlockCache)
        ``y`` ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

    Raises
    ------
    ValueError
        An option the shapes contradict, parameters of no Mamba mixer, inputs of the wrong
        shape, a cache of another block.
    TypeError
        A mask that is not boolean, an unknown option.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_mamba, mamba, mamba_step
    >>> params = init_mamba(np, hidden_size=16, state_size=4)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 16)).astype(np.float32)
    >>> y, cache = mamba(params, x[:, :7], return_cache=True)
    >>> y_t, cache = mamba_step(params, x[:, 7], cache)
    >>> bool(np.allclose(y_t, mamba(params, x)[:, 7], atol=1e-5))
    True
    """
    sizes = _sizes(params, dict(options))
    xp = array_namespace(x)
    _check_cache(sizes, cache, x)
    mask = padding_mask(BLOCK, xp, attention_mask, x, "x", sizes.hidden_size, rank=3)
    if mask is not None:
        x = xp.where(mask[..., None], x, 0.0)
    (xs, dt, B, C, z), conv_state = _scan_inputs(
        params, sizes, x, mask, None if cache is None else cache.conv_state, False
    )
    y, h = selective_scan(
        xs, dt, -xp.exp(params["A_log"]), B, C, D=params["D"], z=z,
        dt_bias=params.get("dt_proj.bias"), dt_softplus=True, method=sizes.method,
        chunk_size=sizes.chunk_size, initial_state=None if cache is None else cache.recurrent_state,
        return_state=True, attention_mask=mask,
    )  # fmt: skip
    y = linear(params, y, "out_proj")
    if mask is not None:
        y = xp.where(mask[..., None], y, 0.0)
    return (y, BlockCache(conv_state, h)) if return_cache else y


def mamba_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, BlockCache]:
    """One new token per sequence of the Mamba-1 mixer, from the cache before it.

    Parameters
    ----------
    params : mapping
        As for :func:`mamba`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        From ``mamba(..., return_cache=True)`` or an earlier step; ``None`` starts from an
        empty sequence (zero states).
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token. The others keep their cache and
        output 0, whatever ``x_t`` holds there.
    **options
        As for :func:`mamba` (``method`` and ``chunk_size`` are not used).

    Returns
    -------
    y_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache
        The cache after this token.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_mamba, mamba_step
    >>> params = init_mamba(np, hidden_size=16, state_size=4)
    >>> y_t, cache = mamba_step(params, np.ones((3, 16), np.float32))
    >>> y_t.shape, cache.conv_state[0].shape, cache.recurrent_state.shape
    ((3, 16), (3, 3, 32), (3, 32, 4))
    """
    sizes = _sizes(params, dict(options))
    xp = array_namespace(x_t)
    _check_cache(sizes, cache, x_t)
    mask = padding_mask(BLOCK, xp, attention_mask, x_t, "x_t", sizes.hidden_size, rank=2)
    if mask is not None:
        x_t = xp.where(mask[:, None], x_t, 0.0)
    (xs, dt, B, C, z), conv_state = _scan_inputs(
        params, sizes, x_t, mask, None if cache is None else cache.conv_state, True
    )
    before = None if cache is None else cache.recurrent_state
    y, h = selective_scan_step(
        xs, dt, -xp.exp(params["A_log"]), B, C, before, D=params["D"], z=z,
        dt_bias=params.get("dt_proj.bias"), dt_softplus=True,
    )  # fmt: skip
    y = linear(params, y, "out_proj")
    if mask is not None:  # a row left out keeps its state: its dt is not 0
        h = xp.where(mask[:, None, None], h, 0.0 if before is None else before)
        y = xp.where(mask[:, None], y, 0.0)
    return y, BlockCache(conv_state, h)


def init_mamba(
    xp: Any,
    *,
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
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of a Mamba-1 mixer, as transformers' ``MambaMixer`` draws them.

    ``A_log = log(1..state_size)`` per channel (S4D real), ``D`` ones, ``dt_proj.weight``
    uniform within (or, with ``time_step_init_scheme="constant"``, equal to)
    ``time_step_scale / sqrt(time_step_rank)``, ``dt_proj.bias`` the inverse softplus of a
    log-uniform ``dt`` in ``[time_step_min, time_step_max]`` floored at ``time_step_floor``;
    the other weights and biases uniform within ``1 / sqrt(fan_in)`` (PyTorch's defaults). The
    names and shapes of ``MambaMixer``'s state dict, with ``MambaConfig``'s defaults.

    Parameters
    ----------
    xp : namespace
        The array library to make them in (``numpy``, ``jax.numpy``, ``torch``, ...).
    hidden_size, state_size, expand, conv_kernel : int
        The config's sizes (``intermediate_size = expand * hidden_size``).
    time_step_rank : int or "auto"
        ``"auto"``: ``ceil(hidden_size / 16)``.
    use_conv_bias, use_bias : bool
        The config's options.
    time_step_scale, time_step_min, time_step_max, time_step_floor : float
        The initialization's ranges.
    time_step_init_scheme : {"random", "constant"}
        How ``dt_proj.weight`` is drawn.
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
    >>> from polylin.blocks import init_mamba
    >>> params = init_mamba(np, hidden_size=16, state_size=4)
    >>> params["in_proj.weight"].shape, params["x_proj.weight"].shape, params["A_log"].shape
    ((64, 16), (9, 32), (32, 4))
    """
    if time_step_init_scheme not in ("random", "constant"):
        raise ValueError(
            f"init_mamba: time_step_init_scheme must be 'random' or 'constant', got "
            f"{time_step_init_scheme!r}"
        )
    draws = Draws(xp, seed=seed, dtype=dtype, device=device)
    inner = int(expand * hidden_size)
    rank = math.ceil(hidden_size / 16) if time_step_rank == "auto" else int(time_step_rank)
    params = {"in_proj.weight": draws.linear(2 * inner, hidden_size)}
    if use_bias:
        params["in_proj.bias"] = draws.bias(2 * inner, hidden_size)
    params["conv1d.weight"] = draws.conv(inner, conv_kernel)
    if use_conv_bias:
        params["conv1d.bias"] = draws.bias(inner, conv_kernel)
    params["x_proj.weight"] = draws.linear(rank + 2 * state_size, inner)
    std = time_step_scale / math.sqrt(rank)
    if time_step_init_scheme == "constant":
        params["dt_proj.weight"] = draws.uniform((inner, rank), std, std)
    else:
        params["dt_proj.weight"] = draws.uniform((inner, rank), -std, std)
    params["dt_proj.bias"] = draws.dt_bias(
        inner, dt_min=time_step_min, dt_max=time_step_max, floor=time_step_floor
    )
    xp = draws.xp
    n = xp.arange(1, state_size + 1, dtype=draws.dtype, device=device)
    params["A_log"] = xp.ones((inner, 1), dtype=draws.dtype, device=device) * xp.log(n)
    params["D"] = draws.ones(inner)
    params["out_proj.weight"] = draws.linear(hidden_size, inner)
    if use_bias:
        params["out_proj.bias"] = draws.bias(hidden_size, inner)
    return params
