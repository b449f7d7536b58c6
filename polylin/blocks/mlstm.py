"""The mLSTM layer of xLSTM (Beck et al., 2024; xLSTM 7B) as functions of its parameters.

``mlstm(params, x)`` computes what transformers' ``xLSTMLayer`` computes (the parameter names
are its state dict's, ``weight_mode`` ``"single"`` or ``"fused"``): the projections to the
queries, keys, values and the output gate, the soft-capped input and forget gates, the
recurrence :func:`polylin.mlstm`, the per-head layer norm, ``sigmoid(o) *`` and ``out_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..activations import sigmoid
from ..interop import array_namespace, is_array
from ..mlstm import MLSTM_EPS, MLSTM_METHODS, MLSTMState
from ..mlstm import mlstm as mlstm_recurrence
from ..mlstm import mlstm_step as mlstm_recurrence_step
from ..normalization import group_norm
from ._init import Draws
from ._linear import check_implied
from ._params import BlockCache, linear, padding_mask, param

__all__ = ["init_mlstm", "mlstm", "mlstm_step"]

BLOCK = "mlstm"
#: The config's kernel choices and the initialization's depth: accepted, they do not change
#: the function.
_KERNEL_ONLY = (
    "norm_reduction_force_float32", "mode", "return_last_states", "autocast_kernel_dtype",
    "inference_state_dtype", "chunkwise_kernel", "sequence_kernel", "step_kernel",
    "num_hidden_layers",
)  # fmt: skip


class _Sizes(NamedTuple):
    hidden_size: int
    num_heads: int
    qk_dim: int
    v_dim: int
    fused: bool
    method: str
    chunk_size: int
    eps: float
    norm_eps: float
    gate_soft_cap: float | None


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, float | int) or not 0 < value < math.inf:
        raise ValueError(f"{BLOCK}: {name} must be a number > 0, got {value!r}")
    return float(value)


def _factor(dim: int, hidden: int) -> Any:
    """``int(hidden * factor) == dim`` (the layer's rounding)."""
    return lambda given: (int(hidden * given) == dim, dim / hidden)


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> _Sizes:
    """The sizes from the parameters' shapes, and the options they do not imply."""
    method = options.pop("method", "chunked")
    if method not in MLSTM_METHODS:
        raise ValueError(f"{BLOCK}: method must be one of {MLSTM_METHODS}, got {method!r}")
    chunk_size = options.pop("chunk_size", 64)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{BLOCK}: chunk_size must be an int >= 1, got {chunk_size!r}")
    eps = _positive("eps", options.pop("eps", MLSTM_EPS))
    norm_eps = _positive("norm_eps", options.pop("norm_eps", 1e-6))
    cap = options.pop("gate_soft_cap", 15.0)
    cap = None if cap is None else _positive("gate_soft_cap", cap)
    for name in _KERNEL_ONLY:
        options.pop(name, None)
    fused = "qkv_opreact.weight" in params
    if fused:
        projected, hidden = param(BLOCK, params, "qkv_opreact.weight", ndim=2).shape
        heads = param(BLOCK, params, "ifgate_preact.weight", ndim=2).shape[0] // 2
    else:
        qk_dim, hidden = param(BLOCK, params, "q.weight", ndim=2).shape
        v_dim = param(BLOCK, params, "v.weight", ndim=2).shape[0]
        heads = param(BLOCK, params, "igate_preact.weight", ndim=2).shape[0]
        for name in ("k.weight", "ogate_preact.weight", "fgate_preact.weight"):
            param(BLOCK, params, name, ndim=2)
        projected = 2 * qk_dim + 2 * v_dim
    v_dim = param(BLOCK, params, "out_proj.weight", ndim=2).shape[1]
    qk_dim = (projected - 2 * v_dim) // 2
    norm = param(BLOCK, params, "multihead_norm.weight", ndim=1).shape[0]
    if heads < 1 or qk_dim < heads or qk_dim % heads or v_dim % heads or norm != v_dim or (
        projected != 2 * qk_dim + 2 * v_dim
    ):  # fmt: skip
        raise ValueError(
            f"{BLOCK}: the projections ({projected} outputs for q, k, v and o), the gates "
            f"({heads} heads), multihead_norm.weight ({norm}) and out_proj.weight ({v_dim} "
            "columns) are not one mLSTM layer's"
        )
    implied = {
        "hidden_size": hidden, "num_heads": heads, "qk_dim_factor": _factor(qk_dim, hidden),
        "v_dim_factor": _factor(v_dim, hidden), "weight_mode": "fused" if fused else "single",
        "use_bias": "out_proj.bias" in params,
    }  # fmt: skip
    check_implied(BLOCK, options, implied)
    return _Sizes(hidden, heads, qk_dim, v_dim, fused, method, chunk_size, eps, norm_eps, cap)


def _check_cache(sizes: _Sizes, cache: Any, x: Any) -> None:
    """``cache`` is ``None`` or a :class:`BlockCache` of an mLSTM layer of this batch."""
    if cache is None:
        return
    if not isinstance(cache, tuple) or len(cache) != 2:
        raise TypeError(
            f"{BLOCK}: cache must be a BlockCache (conv_state, recurrent_state) from this "
            f"block, got {type(cache).__name__}"
        )
    conv_state, state = cache
    heads = sizes.num_heads
    d_k, d_v = sizes.qk_dim // heads, sizes.v_dim // heads
    C: Any = state[0] if isinstance(state, tuple) and len(state) == 3 else None
    if conv_state != () or not is_array(C) or C.ndim != 4 or tuple(C.shape[1:]) != (
        heads, d_k, d_v
    ):  # fmt: skip
        raise ValueError(
            f"{BLOCK}: the cache must hold no convolution state and an MLSTMState (C, n, m) "
            f"with C of shape (batch, {heads}, {d_k}, {d_v}): it was made by another block"
        )
    if C.shape[0] != x.shape[0]:
        raise ValueError(
            f"{BLOCK}: the cache's recurrent state is for a batch of {C.shape[0]}, the "
            f"input's is {x.shape[0]}"
        )


def _soft_cap(xp: Any, x: Any, cap: float | None) -> Any:
    return x if cap is None else cap * xp.tanh(x / cap)


def _inputs(params: Mapping[str, Any], sizes: _Sizes, x: Any) -> tuple[list[Any], Any]:
    """``[q, k, v, i, f]`` over ``(..., heads, d)`` (gates ``(..., heads, 1)``), and the output
    gate's pre-activation ``o`` ``(..., v_dim)``."""
    xp = array_namespace(x)
    qk, vd, heads = sizes.qk_dim, sizes.v_dim, sizes.num_heads
    if sizes.fused:
        qkvo = linear(params, x, "qkv_opreact")
        q, k = qkvo[..., :qk], qkvo[..., qk : 2 * qk]
        v, o = qkvo[..., 2 * qk : 2 * qk + vd], qkvo[..., 2 * qk + vd :]
        gates = _soft_cap(xp, linear(params, x, "ifgate_preact"), sizes.gate_soft_cap)
        i, f = gates[..., :heads], gates[..., heads:]
    else:
        q, k, v, o = (linear(params, x, name) for name in ("q", "k", "v", "ogate_preact"))
        i, f = (
            _soft_cap(xp, linear(params, x, name), sizes.gate_soft_cap)
            for name in ("igate_preact", "fgate_preact")
        )
    lead = tuple(x.shape[:-1])
    q, k, v = (xp.reshape(t, (*lead, heads, t.shape[-1] // heads)) for t in (q, k, v))
    return [q, k, v, i[..., None], f[..., None]], o


def _output(params: Mapping[str, Any], sizes: _Sizes, h: Any, o: Any) -> Any:
    """The per-head layer norm, ``sigmoid(o) *`` and ``out_proj``."""
    xp = array_namespace(h)
    h = xp.reshape(h, o.shape)
    h = group_norm(
        h, params["multihead_norm.weight"], params.get("multihead_norm.bias"),
        num_groups=sizes.num_heads, eps=sizes.norm_eps,
    )  # fmt: skip
    return linear(params, sigmoid(o) * h, "out_proj")


def mlstm(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The mLSTM layer of xLSTM over a whole sequence (training, prefill).

    transformers' ``xLSTMLayer``: the queries, keys, values (``num_heads`` heads) and the
    output gate's pre-activation ``o`` by linear maps of ``x``; the input and forget gates'
    pre-activations (one per head) soft-capped, ``cap * tanh(g / cap)``; the recurrence
    :func:`polylin.mlstm` (query scale ``d_qk ** -0.5``); a layer norm per head with the
    weight (and bias) of ``multihead_norm``; ``sigmoid(o) *``; ``out_proj``. (The residual
    block around it, ``xLSTMBlock``, adds an RMSNorm before and the feed-forward after.)

    Parameters
    ----------
    params : mapping
        ``xLSTMLayer``'s state dict, as arrays of one library: ``q.weight``, ``k.weight``,
        ``v.weight``, ``ogate_preact.weight``, ``igate_preact.weight`` and ``.bias``,
        ``fgate_preact.weight`` and ``.bias`` (``weight_mode="single"``) or
        ``qkv_opreact.weight``, ``ifgate_preact.weight`` and ``.bias`` (``"fused"``);
        ``multihead_norm.weight``, ``out_proj.weight``; the biases of ``use_bias=True``.
        :func:`init_mlstm` makes one.
    x : array
        ``(batch, T, hidden_size)``, of the library of ``params``.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens (left or right padding): a padded token
        neither forgets nor writes, its inputs are never read and its output is 0.
    cache : BlockCache, optional
        The cache after earlier tokens, to continue from: no convolution state and a
        :class:`polylin.MLSTMState` ``(C, n, m)`` with ``C`` ``(batch, num_heads, d_qk,
        d_v)``.
    return_cache : bool
        Also return the cache after the last token.
    **options
        The config's ``gate_soft_cap`` (15.0; ``None``: none), ``eps`` (1e-6, the
        recurrence's), ``norm_eps`` (1e-6), ``chunk_size`` (64) and ``method`` of
        :func:`polylin.mlstm`. ``hidden_size``, ``num_heads``, ``qk_dim_factor``,
        ``v_dim_factor``, ``weight_mode`` and ``use_bias`` follow from the shapes and are
        checked against them; the kernel choices (``mode``, ``autocast_kernel_dtype``,
        ``inference_state_dtype``, ``norm_reduction_force_float32``, ``return_last_states``,
        ``chunkwise_kernel``, ``sequence_kernel``, ``step_kernel``) and the initialization's
        ``num_hidden_layers`` are accepted and unused.

    Returns
    -------
    array or (array, BlockCache)
        ``y`` ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

    Raises
    ------
    ValueError
        An option the shapes contradict, parameters of no mLSTM layer, inputs of the wrong
        shape, a cache of another block.
    TypeError
        A mask that is not boolean, an unknown option.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_mlstm, mlstm, mlstm_step
    >>> params = init_mlstm(np, hidden_size=32, num_heads=2)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> y, cache = mlstm(params, x[:, :7], chunk_size=4, return_cache=True)
    >>> y_t, cache = mlstm_step(params, x[:, 7], cache)
    >>> bool(np.allclose(y_t, mlstm(params, x, chunk_size=4)[:, 7], atol=1e-5))
    True
    """
    sizes = _sizes(params, dict(options))
    xp = array_namespace(x)
    _check_cache(sizes, cache, x)
    mask = padding_mask(BLOCK, xp, attention_mask, x, "x", sizes.hidden_size, rank=3)
    if mask is not None:
        x = xp.where(mask[..., None], x, 0.0)
    (q, k, v, i, f), o = _inputs(params, sizes, x)
    h, state = mlstm_recurrence(
        q, k, v, i, f, eps=sizes.eps, method=sizes.method, chunk_size=sizes.chunk_size,
        initial_state=None if cache is None else cache.recurrent_state, return_state=True,
        attention_mask=mask, seq_axis=1,
    )  # fmt: skip
    y = _output(params, sizes, h, o)
    if mask is not None:
        y = xp.where(mask[..., None], y, 0.0)
    return (y, BlockCache((), state)) if return_cache else y


def mlstm_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, BlockCache]:
    """One new token per sequence of the mLSTM layer of xLSTM, from the cache before it.

    Parameters
    ----------
    params : mapping
        As for :func:`mlstm`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        From ``mlstm(..., return_cache=True)`` or an earlier step; ``None`` starts from the
        zero state.
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token. The others keep their cache and
        output 0, whatever ``x_t`` holds there.
    **options
        As for :func:`mlstm` (``method`` and ``chunk_size`` are not used).

    Returns
    -------
    y_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache
        The cache after this token.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_mlstm, mlstm_step
    >>> params = init_mlstm(np, hidden_size=32, num_heads=2)
    >>> y_t, cache = mlstm_step(params, np.ones((3, 32), np.float32))
    >>> y_t.shape, cache.recurrent_state.C.shape, cache.recurrent_state.m.shape
    ((3, 32), (3, 2, 8, 16), (3, 2, 1))
    """
    sizes = _sizes(params, dict(options))
    xp = array_namespace(x_t)
    _check_cache(sizes, cache, x_t)
    mask = padding_mask(BLOCK, xp, attention_mask, x_t, "x_t", sizes.hidden_size, rank=2)
    if mask is not None:
        x_t = xp.where(mask[:, None], x_t, 0.0)
    (q, k, v, i, f), o = _inputs(params, sizes, x_t)
    before = None if cache is None else cache.recurrent_state
    h, state = mlstm_recurrence_step(q, k, v, i, f, before, eps=sizes.eps)
    y = _output(params, sizes, h, o)
    if mask is not None:  # a row left out keeps its state
        old = MLSTMState(*(xp.zeros_like(s) for s in state)) if before is None else before
        state = MLSTMState(*(
            xp.where(xp.reshape(mask, (-1,) + (1,) * (new.ndim - 1)), new, kept)
            for new, kept in zip(state, old)
        ))  # fmt: skip
        y = xp.where(mask[:, None], y, 0.0)
    return y, BlockCache((), state)


def init_mlstm(
    xp: Any,
    *,
    hidden_size: int = 4096,
    num_heads: int = 8,
    qk_dim_factor: float = 0.5,
    v_dim_factor: float = 1.0,
    weight_mode: str = "single",
    use_bias: bool = False,
    num_hidden_layers: int = 32,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of an mLSTM layer, as transformers' xLSTM models draw them.

    The queries, keys and values normal with standard deviation ``sqrt(2 / (5 hidden_size))``
    (small init), ``out_proj`` normal with ``2 / num_hidden_layers / sqrt(hidden_size)`` (Wang
    init), the gates' weights zero, the input gates' bias -10, the forget gates' biases
    ``linspace(3, 6, num_heads)``, the other biases zero and the norm's weight one; the names
    and shapes of ``xLSTMLayer``'s state dict, with ``xLSTMConfig``'s defaults.

    Parameters
    ----------
    xp : namespace
        The array library to make them in (``numpy``, ``jax.numpy``, ``torch``, ...).
    hidden_size, num_heads : int
        The config's sizes.
    qk_dim_factor, v_dim_factor : float
        ``qk_dim = int(hidden_size * qk_dim_factor)``, ``v_dim`` alike.
    weight_mode : {"single", "fused"}
        Separate projections, or one for ``q, k, v, o`` and one for both gates.
    use_bias : bool
        Biases on the projections and the norm.
    num_hidden_layers : int
        The depth, for ``out_proj``'s scale.
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
    >>> from polylin.blocks import init_mlstm
    >>> params = init_mlstm(np, hidden_size=32, num_heads=2)
    >>> params["q.weight"].shape, params["v.weight"].shape, params["fgate_preact.bias"]
    ((16, 32), (32, 32), array([3., 6.], dtype=float32))
    """
    if weight_mode not in ("single", "fused"):
        raise ValueError(
            f"init_mlstm: weight_mode must be 'single' or 'fused', got {weight_mode!r}"
        )
    draws = Draws(xp, seed=seed, dtype=dtype, device=device)
    qk, vd, heads = int(hidden_size * qk_dim_factor), int(hidden_size * v_dim_factor), num_heads
    small = math.sqrt(2 / (5 * hidden_size))
    zeros = draws.xp.zeros
    params: dict[str, Any] = {}

    def add(name: str, rows: int, weight: Any) -> None:
        params[f"{name}.weight"] = weight
        if use_bias:
            params[f"{name}.bias"] = draws.zeros(rows)

    xp = draws.xp
    forget = xp.linspace(3.0, 6.0, heads, dtype=draws.dtype, device=device)
    minus_ten = xp.full((heads,), -10.0, dtype=draws.dtype, device=device)
    if weight_mode == "single":
        for name, rows in (("q", qk), ("k", qk), ("v", vd)):
            add(name, rows, draws.normal_bulk((rows, hidden_size)) * small)
        add("ogate_preact", vd, zeros((vd, hidden_size), dtype=draws.dtype, device=device))
        for name, bias in (("igate_preact", minus_ten), ("fgate_preact", forget)):
            params[f"{name}.weight"] = zeros((heads, hidden_size), dtype=draws.dtype,
                                             device=device)  # fmt: skip
            params[f"{name}.bias"] = bias
    else:
        rows = 2 * qk + 2 * vd
        weight = draws.xp.concat(
            [draws.normal_bulk((2 * qk + vd, hidden_size)) * small,
             zeros((vd, hidden_size), dtype=draws.dtype, device=device)]
        )  # fmt: skip
        add("qkv_opreact", rows, weight)
        params["ifgate_preact.weight"] = zeros((2 * heads, hidden_size), dtype=draws.dtype,
                                               device=device)  # fmt: skip
        params["ifgate_preact.bias"] = xp.concat([minus_ten, forget])
    params["multihead_norm.weight"] = draws.ones(vd)
    if use_bias:
        params["multihead_norm.bias"] = draws.zeros(vd)
    wang = 2 / num_hidden_layers / math.sqrt(hidden_size)
    add("out_proj", hidden_size, draws.normal_bulk((hidden_size, vd)) * wang)
    return params
