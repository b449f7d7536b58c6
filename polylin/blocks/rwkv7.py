"""The RWKV-7 time-mixing block ("Goose") as functions of its parameters.

``rwkv7(params, x)`` computes what :class:`polylin.torch.RWKV7Attention` computes (and
``fla.layers.RWKV7Attention``: the parameter and option names are theirs), on the arrays of any
array-API library. Per token, with ``x'`` the previous token (the token shift):

1. ``x_c = x + (x' - x) * x_c`` for ``c`` in ``r, w, k, v, a, g`` (six learned mixes);
2. ``r = r_proj(x_r)``, ``k = k_proj(x_k)``, ``v = v_proj(x_v)``; the log decay
   ``w = -exp(-1/2) * sigmoid(w_lora(x_w))`` (a ``tanh`` LoRA), the in-context learning rate
   ``a = sigmoid(a_lora(x_a))``, the output gate ``g = g_lora(x_g)`` (a ``sigmoid`` LoRA);
3. the value residual: the first layer's ``v`` is ``v_first``; a later layer moves its ``v``
   toward it, ``v + (v_first - v) * sigmoid(v_lora(x_v))``;
4. ``kk = normalize(k * k_k)`` per head, ``k = k * (1 + (a - 1) * k_a)``;
5. the generalized delta rule :func:`polylin.dplr_delta_rule` with ``q = r``,
   ``log_decay = w``, ``a = -kk``, ``b = kk * a``, scale 1;
6. the group norm per head (``g_norm``, ``eps = head_dim * norm_eps``), the bonus
   ``sum(r * k * r_k) * v`` per head, the gate ``g`` and ``o_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .._backend.ops import cumulative_sum, l2_normalize
from .._inputs.defaults import DEFAULT_DPLR_CHUNK_SIZE
from ..activations import sigmoid
from ..dplr import DPLR_METHODS, dplr_delta_rule, dplr_delta_rule_step
from ..interop import array_namespace, device, is_array, work_dtype_for
from ..normalization import group_norm
from ._init import Draws
from ._params import BlockCache, linear, padding_mask, param

__all__ = ["init_rwkv7", "rwkv7", "rwkv7_step"]

BLOCK = "rwkv7"

#: ``exp(-1/2)``: RWKV-7's log decay is ``-exp(-1/2) * sigmoid(.)``, in ``(-0.607, 0)``.
DECAY_SCALE = 0.6065306597126334

#: fla's modes: both compute the same function (fla picks its kernel by the length).
MODES = ("chunk", "fused_recurrent")


class RWKV7Sizes(NamedTuple):
    """The sizes and options of an RWKV-7 block, as its parameters and options give them."""

    hidden_size: int
    num_heads: int
    head_dim: int
    head_v_dim: int
    first_layer: bool
    fuse_norm: bool
    norm_eps: float
    method: str
    chunk_size: int

    @property
    def value_dim(self) -> int:
        """``num_heads * head_v_dim``."""
        return self.num_heads * self.head_v_dim


def _check(name: str, given: Any, implied: Any) -> None:
    if given is not None and given != implied:
        raise ValueError(
            f"{BLOCK}: {name}={given!r} does not match the parameters, which imply "
            f"{name}={implied!r}"
        )


def _sizes(params: Mapping[str, Any], options: dict[str, Any]) -> RWKV7Sizes:
    """The sizes from the parameters' shapes; the options they imply are checked."""
    method = options.pop("method", "chunked")
    if method not in DPLR_METHODS:
        raise ValueError(f"{BLOCK}: method must be one of {DPLR_METHODS}, got {method!r}")
    mode = options.pop("mode", None)
    if mode is not None and mode not in MODES:
        raise ValueError(f"{BLOCK}: mode must be one of {MODES}, got {mode!r}")
    fuse_norm = options.pop("fuse_norm", False)
    if not isinstance(fuse_norm, bool):
        raise TypeError(f"{BLOCK}: fuse_norm must be True or False, got {fuse_norm!r}")
    norm_eps = float(options.pop("norm_eps", 1e-5))
    chunk_size = int(options.pop("chunk_size", DEFAULT_DPLR_CHUNK_SIZE))
    options.pop("num_hidden_layers", None)  # an initialization option
    key_dim, hidden_size = param(BLOCK, params, "r_proj.weight", ndim=2).shape
    num_heads, head_dim = param(BLOCK, params, "r_k", ndim=2).shape
    value_dim = param(BLOCK, params, "v_proj.weight", ndim=2).shape[0]
    if num_heads * head_dim != key_dim or value_dim % num_heads:
        raise ValueError(
            f"{BLOCK}: r_k ({num_heads} heads of {head_dim}) does not fit r_proj.weight "
            f"({key_dim} rows) and v_proj.weight ({value_dim} rows)"
        )
    first_layer = "v_lora.lora.0.weight" not in params
    lora = {
        f"{n}_low_rank_dim": param(BLOCK, params, f"{lora}.lora.0.weight", ndim=2).shape[0]
        for n, lora in (("decay", "w_lora"), ("a", "a_lora"), ("gate", "g_lora"))
    }
    lora["v_low_rank_dim"] = (
        None if first_layer else param(BLOCK, params, "v_lora.lora.0.weight", ndim=2).shape[0]
    )
    head = options.pop("head_dim", None)
    if head is not None:  # fla's rule: head_dim, when given, decides (num_heads is ignored)
        _check("head_dim", head, head_dim)
        options.pop("num_heads", None)
    shapes = {
        "hidden_size": hidden_size, "num_heads": num_heads, "value_dim": value_dim,
        "elementwise_affine": "g_norm.weight" in params, **lora,
    }  # fmt: skip
    layer_idx = options.pop("layer_idx", None)
    if layer_idx is not None and (layer_idx == 0) != first_layer:
        raise ValueError(
            f"{BLOCK}: layer_idx={layer_idx!r} does not match the parameters: the first layer "
            "(layer_idx=0) has no v_lora, every other layer has one"
        )
    for name, given in options.items():
        if name not in shapes:
            raise TypeError(f"{BLOCK} got an unexpected keyword argument {name!r}")
        _check(name, given, shapes[name])
    return RWKV7Sizes(
        hidden_size, num_heads, head_dim, value_dim // num_heads, first_layer, fuse_norm,
        norm_eps, method, chunk_size,
    )  # fmt: skip


def _check_cache(cache: Any, x: Any, sizes: RWKV7Sizes) -> None:
    """``cache`` is ``None`` or a :class:`BlockCache` of an RWKV-7 block of these sizes."""
    if cache is None:
        return
    if not isinstance(cache, tuple) or len(cache) != 2:
        raise TypeError(
            f"{BLOCK}: cache must be a BlockCache (conv_state, recurrent_state) from this "
            f"block, got {type(cache).__name__}"
        )
    shift, S = cache
    batch = x.shape[0]
    want = (batch, 1, sizes.hidden_size)
    if not isinstance(shift, tuple) or len(shift) != 1:
        got = len(shift) if isinstance(shift, tuple) else type(shift).__name__
        raise ValueError(
            f"{BLOCK}: the cache's conv_state must hold one token-shift state, got {got}: it "
            "was made by another block"
        )
    if not is_array(shift[0]) or tuple(shift[0].shape) != want:
        raise ValueError(
            f"{BLOCK}: the cache's token-shift state must have shape (batch, 1, hidden_size) "
            f"= {want}, got {getattr(shift[0], 'shape', type(shift[0]).__name__)}"
        )
    state = (batch, sizes.num_heads, sizes.head_dim, sizes.head_v_dim)
    if not is_array(S) or tuple(S.shape) != state:
        raise ValueError(
            f"{BLOCK}: the cache's recurrent state must have shape (batch, num_heads, "
            f"head_dim, head_v_dim) = {state}, got {getattr(S, 'shape', type(S).__name__)}"
        )


def _check_v_first(xp: Any, v_first: Any, x: Any, sizes: RWKV7Sizes, name: str) -> None:
    if sizes.first_layer:
        return  # the first layer makes v_first (and ignores one given, as fla's does)
    if v_first is None:
        raise TypeError(
            f"{BLOCK}: this layer has a v_lora (it is not the first layer): pass v_first, the "
            "first layer's values (its rwkv7(..., return_v_first=True))"
        )
    want = (*x.shape[:-1], sizes.value_dim)
    if not is_array(v_first) or array_namespace(v_first) is not xp:
        raise TypeError(f"{BLOCK}: v_first must be an array of the library of {name}")
    if tuple(v_first.shape) != want or v_first.dtype != x.dtype:
        raise ValueError(
            f"{BLOCK}: v_first must have shape {want} and dtype {x.dtype} ({name}'s with "
            f"value_dim), got {tuple(v_first.shape)} {v_first.dtype}"
        )


def _lora(
    params: Mapping[str, Any], x: Any, name: str, activation: Callable[[Any], Any] | None
) -> Any:
    """fla's ``LoRA``: ``lora.2(activation(lora.0(x)))``."""
    h = linear(params, x, f"{name}.lora.0")
    return linear(params, h if activation is None else activation(h), f"{name}.lora.2")


def _heads(xp: Any, t: Any, sizes: RWKV7Sizes, size: int) -> Any:
    return xp.reshape(t, (*t.shape[:-1], sizes.num_heads, size))


def _normalize(xp: Any, x: Any, fuse_norm: bool) -> Any:
    """``kk``: fla's ``l2_norm`` (``fuse_norm``) or ``F.normalize``, ``x / max(|x|, 1e-12)``
    (as ``x / sqrt(max(|x|^2, 1e-24))``, by selection: finite gradients at a zero vector)."""
    work = work_dtype_for(xp, x.dtype)  # 1e-24 is 0 in float16
    y = x if x.dtype == work else xp.astype(x, work)
    if fuse_norm:
        y = l2_normalize(xp, y)
    else:
        squares = xp.sum(y * y, axis=-1, keepdims=True)
        y = y / xp.sqrt(xp.where(squares > 1e-24, squares, 1e-24))
    return y if y.dtype == x.dtype else xp.astype(y, x.dtype)


class _Mixed(NamedTuple):
    r: Any
    w: Any
    k: Any
    v: Any
    kk: Any
    a: Any
    g: Any
    v_first: Any


def _time_mix(
    params: Mapping[str, Any], x: Any, prev: Any, sizes: RWKV7Sizes, v_first: Any, keep: Any
) -> _Mixed:
    """Steps 1-4 for ``x`` and the tokens before it ``prev`` (``(..., hidden_size)``); ``keep``
    (``x``'s shape without hidden_size, or ``None``) selects the real tokens."""
    xp = array_namespace(x)
    delta = prev - x
    mix = {n: x + delta * xp.reshape(params[f"x_{n}"], (sizes.hidden_size,)) for n in "rwkvag"}
    r = linear(params, mix["r"], "r_proj")
    w = -DECAY_SCALE * sigmoid(_lora(params, mix["w"], "w_lora", xp.tanh))
    k = linear(params, mix["k"], "k_proj")
    v = linear(params, mix["v"], "v_proj")
    if sizes.first_layer:
        v_first = v if keep is None else xp.where(keep[..., None], v, 0.0)
    else:
        if keep is not None:  # padding in v_first (NaN, say) must reach nothing, gradients too
            v_first = xp.where(keep[..., None], v_first, 0.0)
        v = v + (v_first - v) * sigmoid(_lora(params, mix["v"], "v_lora", None))
    a = sigmoid(_lora(params, mix["a"], "a_lora", None))
    g = _lora(params, mix["g"], "g_lora", sigmoid)
    kk = _normalize(xp, _heads(xp, k * params["k_k"], sizes, sizes.head_dim), sizes.fuse_norm)
    k = k + k * (a - 1.0) * params["k_a"]
    d, dv = sizes.head_dim, sizes.head_v_dim
    return _Mixed(
        _heads(xp, r, sizes, d), _heads(xp, w, sizes, d), _heads(xp, k, sizes, d),
        _heads(xp, v, sizes, dv), kk, _heads(xp, a, sizes, d), g, v_first,
    )  # fmt: skip


def _output(params: Mapping[str, Any], o: Any, m: _Mixed, sizes: RWKV7Sizes) -> Any:
    """Step 6: the group norm, the bonus term, the gate and ``o_proj``."""
    xp = array_namespace(o)
    lead = tuple(o.shape[:-2])
    o = group_norm(
        xp.reshape(o, (*lead, sizes.value_dim)), params.get("g_norm.weight"),
        params.get("g_norm.bias"), num_groups=sizes.num_heads,
        eps=sizes.head_dim * sizes.norm_eps,
    )  # fmt: skip
    bonus = xp.sum(m.r * m.k * params["r_k"], axis=-1, keepdims=True) * m.v
    o = (o + xp.reshape(bonus, (*lead, sizes.value_dim))) * m.g
    return linear(params, o, "o_proj")


def _shift(xp: Any, x: Any, keep: Any, state: Any) -> tuple[Any, Any]:
    """The previous token of each token of ``x`` ``(batch, T, hidden)`` (``state`` before the
    first) and the new state: the last real token (``state`` where there is none)."""
    ext = xp.concat([state, x], axis=1)
    T = x.shape[1]
    if keep is None:
        return ext[:, :T, :], ext[:, T:, :]
    ones = xp.ones((x.shape[0], 1), dtype=xp.bool, device=device(keep))
    ext_keep = xp.concat([ones, keep], axis=1)
    rank = cumulative_sum(xp, xp.astype(ext_keep, xp.int32), axis=1)
    last = ext_keep & (rank == rank[:, -1:])  # one True per row: its last real token
    return ext[:, :T, :], xp.sum(xp.where(last[..., None], ext, 0.0), axis=1, keepdims=True)


def _results(y: Any, cache: BlockCache | None, v_first: Any, return_v_first: bool) -> Any:
    out = (y,) if cache is None else (y, cache)
    if return_v_first:
        out = (*out, v_first)
    return out[0] if len(out) == 1 else out


def rwkv7(
    params: Mapping[str, Any],
    x: Any,
    /,
    *,
    v_first: Any = None,
    return_v_first: bool = False,
    attention_mask: Any = None,
    cache: BlockCache | None = None,
    return_cache: bool = False,
    **options: Any,
) -> Any:
    """The RWKV-7 time-mixing block over a whole sequence (training, prefill).

    The computation of :class:`polylin.torch.RWKV7Attention` and ``fla.layers.RWKV7Attention``
    (this module's docstring lists the steps): token shift, the six mixes, the LoRA paths of
    ``w``, ``a``, ``g`` and ``v``, the value residual, :func:`polylin.dplr_delta_rule`, the
    group norm, the bonus term and the gate.

    Parameters
    ----------
    params : mapping
        The torch module's state dict (``x_r``, ``r_proj.weight``, ``w_lora.lora.0.weight``,
        ``g_norm.bias``, ...), as arrays of one library; :func:`init_rwkv7` makes one. The
        first layer of a model has no ``v_lora``.
    x : array
        ``(batch, T, hidden_size)``, of the library of ``params``.
    v_first : array, optional
        ``(batch, T, value_dim)``: the first layer's values, which every later layer needs
        (fla's ``v_first``). The first layer makes it and ignores one given.
    return_v_first : bool
        Also return ``v_first`` (the first layer's own values, later layers' ``v_first`` as
        given), last, as fla's ``forward`` returns it.
    attention_mask : array, optional
        ``(batch, T)`` booleans, True for real tokens (left or right padding): padded tokens
        reach no real output, no token-shift state and no recurrent state; their outputs (and
        the first layer's ``v_first`` there) are 0. A token after padding sees a zero previous
        token, as at the start of a sequence.
    cache : BlockCache, optional
        The cache after earlier tokens, to continue from: ``conv_state`` holds the token-shift
        state ``(batch, 1, hidden_size)`` (the last real token), ``recurrent_state`` the state
        ``(batch, num_heads, head_dim, head_v_dim)``.
    return_cache : bool
        Also return the cache after the last token.
    **options
        The torch module's constructor keywords: ``norm_eps`` (1e-5), ``fuse_norm`` (False:
        ``kk = x / max(|x|, 1e-12)``; True: ``x / sqrt(|x|^2 + 1e-6)``, fla's fused kernels'),
        ``mode`` (accepted; both of fla's modes compute the same function), polylin's
        ``method`` and ``chunk_size`` (see :func:`polylin.dplr_delta_rule`). The others
        (``hidden_size``, ``head_dim``, ``num_heads``, ``value_dim``, the ``*_low_rank_dim``,
        ``elementwise_affine``, ``layer_idx``, ``num_hidden_layers``) follow from the shapes
        and are checked against them.

    Returns
    -------
    array or tuple
        ``y`` ``(batch, T, hidden_size)``; then the cache with ``return_cache``; then
        ``v_first`` with ``return_v_first``.

    Raises
    ------
    ValueError
        An option the shapes contradict, inputs of the wrong shape, a cache of another block.
    TypeError
        A mask that is not boolean, an unknown option, a later layer without ``v_first``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_rwkv7, rwkv7, rwkv7_step
    >>> first = init_rwkv7(np, hidden_size=32, head_dim=8, layer_idx=0)
    >>> second = init_rwkv7(np, hidden_size=32, head_dim=8, layer_idx=1, seed=1)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    >>> h, v_first = rwkv7(first, x, return_v_first=True)
    >>> y = rwkv7(second, x + h, v_first=v_first)
    >>> y.shape, v_first.shape
    ((2, 10, 32), (2, 10, 32))

    Prefill, then one step: the outputs of one pass.

    >>> _, cache = rwkv7(first, x[:, :9], return_cache=True)
    >>> h_9, cache = rwkv7_step(first, x[:, 9], cache)
    >>> bool(np.allclose(h_9, h[:, 9], atol=1e-5))
    True
    """
    sizes = _sizes(params, dict(options))
    xp = array_namespace(x)
    _check_cache(cache, x, sizes)
    mask = padding_mask(BLOCK, xp, attention_mask, x, "x", sizes.hidden_size, rank=3)
    _check_v_first(xp, v_first, x, sizes, "x")
    if mask is not None:
        x = xp.where(mask[..., None], x, 0.0)
    state = cache.conv_state[0] if cache is not None else None
    if state is None:
        state = xp.zeros((x.shape[0], 1, sizes.hidden_size), dtype=x.dtype, device=device(x))
    prev, shift_state = _shift(xp, x, mask, state)
    m = _time_mix(params, x, prev, sizes, v_first, mask)
    o, S = dplr_delta_rule(
        m.r, m.k, m.v, -m.kk, m.kk * m.a, log_decay=m.w, method=sizes.method,
        chunk_size=sizes.chunk_size,
        initial_state=None if cache is None else cache.recurrent_state, return_state=True,
        attention_mask=mask, seq_axis=1,
    )  # fmt: skip
    y = _output(params, o, m, sizes)
    if mask is not None:
        y = xp.where(mask[..., None], y, 0.0)
    new_cache = BlockCache((shift_state,), S) if return_cache else None
    return _results(y, new_cache, m.v_first, return_v_first)


def rwkv7_step(
    params: Mapping[str, Any],
    x_t: Any,
    cache: BlockCache | None = None,
    /,
    *,
    v_first: Any = None,
    return_v_first: bool = False,
    attention_mask: Any = None,
    **options: Any,
) -> tuple[Any, ...]:
    """One new token per sequence of the RWKV-7 block, from the cache before it.

    Parameters
    ----------
    params : mapping
        As for :func:`rwkv7`.
    x_t : array
        ``(batch, hidden_size)``.
    cache : BlockCache, optional
        From ``rwkv7(..., return_cache=True)`` or an earlier step; ``None`` starts from an
        empty sequence (a zero previous token, a zero state).
    v_first : array, optional
        ``(batch, value_dim)``: the first layer's values of this token (later layers).
    return_v_first : bool
        Also return ``v_first`` (last).
    attention_mask : array, optional
        ``(batch,)`` booleans: the rows that take this token. The others keep their cache and
        output 0, whatever ``x_t`` (and ``v_first``) hold there.
    **options
        As for :func:`rwkv7` (``method`` and ``chunk_size`` are not used).

    Returns
    -------
    tuple
        ``y_t`` ``(batch, hidden_size)``, the cache after this token, and ``v_first`` with
        ``return_v_first``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import init_rwkv7, rwkv7_step
    >>> params = init_rwkv7(np, hidden_size=16, head_dim=4, layer_idx=0, num_hidden_layers=2)
    >>> y_t, cache = rwkv7_step(params, np.ones((3, 16), np.float32))
    >>> y_t.shape, cache.conv_state[0].shape, cache.recurrent_state.shape
    ((3, 16), (3, 1, 16), (3, 4, 4, 4))
    """
    sizes = _sizes(params, dict(options))
    xp = array_namespace(x_t)
    _check_cache(cache, x_t, sizes)
    mask = padding_mask(BLOCK, xp, attention_mask, x_t, "x_t", sizes.hidden_size, rank=2)
    _check_v_first(xp, v_first, x_t, sizes, "x_t")
    if mask is not None:
        x_t = xp.where(mask[:, None], x_t, 0.0)
    if cache is None:
        prev = xp.zeros(x_t.shape, dtype=x_t.dtype, device=device(x_t))
        S0 = None
    else:
        prev, S0 = cache.conv_state[0][:, 0, :], cache.recurrent_state
    m = _time_mix(params, x_t, prev, sizes, v_first, mask)
    o, S = dplr_delta_rule_step(m.r, m.k, m.v, -m.kk, m.kk * m.a, S0, log_decay=m.w)
    shift = x_t
    if mask is not None:  # the rows that do not take the token keep their cache
        S = xp.where(mask[:, None, None, None], S, 0.0 if S0 is None else S0)
        shift = xp.where(mask[:, None], x_t, prev)
    y = _output(params, o, m, sizes)
    if mask is not None:
        y = xp.where(mask[:, None], y, 0.0)
    cache = BlockCache((xp.reshape(shift, (shift.shape[0], 1, shift.shape[1])),), S)
    out = _results(y, cache, m.v_first, return_v_first)
    return tuple(out)


class _BulkDraws(Draws):
    """:class:`Draws` whose uniform draws are made in bulk (a 1024-wide layer has millions)."""

    def uniform(self, shape: tuple[int, ...], low: float, high: float) -> Any:
        return self.uniform_bulk(shape, low, high)


def _low_rank(given: int | None, hidden_size: int, coefficient: float, factor: float) -> int:
    """fla's default LoRA width: ``coefficient * sqrt(hidden_size) * factor`` in multiples of
    32, at least 32."""
    if given is not None:
        return given
    return max(32, int(round(coefficient * hidden_size**0.5 * factor / 32) * 32))


def init_rwkv7(
    xp: Any,
    *,
    hidden_size: int = 1024,
    head_dim: int | None = 64,
    num_heads: int | None = None,
    decay_low_rank_dim: int | None = None,
    gate_low_rank_dim: int | None = None,
    a_low_rank_dim: int | None = None,
    v_low_rank_dim: int | None = None,
    elementwise_affine: bool = True,
    layer_idx: int | None = None,
    num_hidden_layers: int | None = None,
    value_dim: int | None = None,
    seed: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> dict[str, Any]:
    """Initial parameters of an RWKV-7 block, as ``fla.layers.RWKV7Attention`` draws them.

    With ``layer_idx`` and ``num_hidden_layers``, fla's RWKV-7 initialization for that depth:
    the token-shift mixes ``1 - (n / hidden_size) ** (p * (1 - layer_idx /
    num_hidden_layers))``, the decay bias ramp with its per-head zigzag, ``k_k = 0.71 - 0.1 *
    ramp``, ``k_a = 1.02``, ``r_k = -0.04``, the ``a`` and ``v`` biases, ``g_norm.weight =
    ((layer_idx + 1) / num_hidden_layers) ** 0.7``, orthogonal ``r_proj``, ``v_proj`` and
    ``k_proj`` (gain 0.1), ``o_proj`` zero. Without it, fla's plain defaults: the mixes, ``k_k``,
    ``k_a`` and ``r_k`` zero, ``torch.nn.Linear``'s uniform draws. Every LoRA starts with a
    zero first map and an orthogonal second one (gain 0.1), zero bias. The names and shapes
    are those of :class:`polylin.torch.RWKV7Attention`'s state dict.

    Parameters
    ----------
    xp : namespace
        The array library to make them in (``numpy``, ``jax.numpy``, ``torch``, ...).
    hidden_size, head_dim, num_heads : int
        The sizes, with fla's defaults (``head_dim``, when given, decides the heads).
    decay_low_rank_dim, gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim : int, optional
        The LoRA widths; default fla's, from ``hidden_size`` and ``head_dim``.
    elementwise_affine : bool
        Whether the group norm has a weight and a bias.
    layer_idx, num_hidden_layers : int, optional
        The layer's depth in the model and the model's; layer 0 has no ``v_lora``.
    value_dim : int, optional
        Default ``hidden_size``.
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
    >>> from polylin.blocks import init_rwkv7
    >>> params = init_rwkv7(np, hidden_size=64, head_dim=16, layer_idx=0, num_hidden_layers=4)
    >>> params["r_k"].shape, params["w_lora.lora.0.weight"].shape, "v_lora.lora.0.weight" in params
    ((4, 16), (32, 64), False)
    """
    if head_dim is None and num_heads is None:
        raise ValueError("init_rwkv7: pass head_dim or num_heads")
    heads = hidden_size // head_dim if head_dim is not None else num_heads
    assert heads is not None
    head_dim = hidden_size // heads if head_dim is None else head_dim
    values = hidden_size if value_dim is None else value_dim
    if heads < 1 or heads * head_dim != hidden_size or values % heads:
        raise ValueError(
            f"init_rwkv7: hidden_size={hidden_size} and value_dim={values} must split into "
            f"heads of head_dim={head_dim}"
        )
    depth = layer_idx is not None and num_hidden_layers is not None
    if depth and (
        num_hidden_layers < 2 or not 0 <= layer_idx < num_hidden_layers  # type: ignore[operator]
        or values != hidden_size
    ):  # fmt: skip
        raise ValueError(
            "init_rwkv7: fla's initialization of a layer_idx needs num_hidden_layers >= 2 "
            f"above it and value_dim == hidden_size; got {layer_idx=}, {num_hidden_layers=}, "
            f"value_dim={values}"
        )
    factor = head_dim / 64
    ranks = {
        "w": _low_rank(decay_low_rank_dim, hidden_size, 2.5, factor),
        "a": _low_rank(a_low_rank_dim, hidden_size, 2.5, factor),
        "v": _low_rank(v_low_rank_dim, hidden_size, 1.7, factor),
        "g": _low_rank(gate_low_rank_dim, hidden_size, 5, 1.0),
    }
    draws = _BulkDraws(xp, seed=seed, dtype=dtype, device=device)
    p: dict[str, Any] = {}
    for n in "rwkvag":
        p[f"x_{n}"] = draws.xp.reshape(draws.zeros(hidden_size), (1, 1, hidden_size))
    p["k_k"], p["k_a"] = draws.zeros(hidden_size), draws.zeros(hidden_size)
    p["r_k"] = draws.xp.reshape(draws.zeros(hidden_size), (heads, head_dim))
    for n, out in (("r", hidden_size), ("k", hidden_size), ("v", values)):
        p[f"{n}_proj.weight"] = draws.linear(out, hidden_size)
    p["o_proj.weight"] = draws.linear(hidden_size, values)
    loras = [("w", hidden_size), ("a", hidden_size), ("g", values)]
    if layer_idx != 0:
        loras.insert(1, ("v", values))
    for n, out in loras:
        p[f"{n}_lora.lora.0.weight"] = draws.xp.reshape(
            draws.zeros(ranks[n] * hidden_size), (ranks[n], hidden_size)
        )
        gain = math.sqrt(ranks[n] / out) if ranks[n] > out else 1.0
        p[f"{n}_lora.lora.2.weight"] = draws.orthogonal(out, ranks[n], gain=0.1 * gain)
        if n != "g":
            p[f"{n}_lora.lora.2.bias"] = draws.zeros(out)
    if elementwise_affine:
        p["g_norm.weight"], p["g_norm.bias"] = draws.ones(values), draws.zeros(values)
    if depth:
        assert layer_idx is not None and num_hidden_layers is not None
        p.update(_depth_init(draws, p, hidden_size, head_dim, layer_idx, num_hidden_layers))
    return p


def _depth_init(
    draws: Draws, p: dict[str, Any], hidden: int, head_dim: int, layer: int, layers: int
) -> dict[str, Any]:
    """fla's ``RWKV7Attention._initialize_weights`` for the layer ``layer`` of ``layers``."""
    ratio_0_to_1 = layer / (layers - 1)
    ratio_1_to_almost0 = 1.0 - layer / layers
    half = (head_dim - 1) / 2
    linear, zigzag, www, ddd = [], [], [], []
    for n in range(hidden):
        linear.append(n / (hidden - 1) - 0.5)
        z = ((n % head_dim) - half) / half if half else 0.0
        zigzag.append(z * abs(z))
        www.append(-6 + 6 * (n / (hidden - 1)) ** (1 + 1 * ratio_0_to_1**0.3))
        ddd.append(n / hidden)

    def vector(values: list[float], shape: tuple[int, ...] = (hidden,)) -> Any:
        return draws.xp.reshape(
            draws.xp.asarray(values, dtype=draws.dtype, device=draws.device), shape
        )

    out: dict[str, Any] = {}
    for c, power in zip("rwkvag", (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)):
        exponent = power * ratio_1_to_almost0
        out[f"x_{c}"] = vector([1.0 - d**exponent for d in ddd], (1, 1, hidden))
    out["k_a"] = vector([1.02] * hidden)
    out["r_k"] = vector([-0.04] * hidden, (hidden // head_dim, head_dim))
    out["k_k"] = vector([0.71 - x * 0.1 for x in linear])
    out["w_lora.lora.2.bias"] = vector([w + 0.5 + z * 2.5 for w, z in zip(www, zigzag)])
    out["a_lora.lora.2.bias"] = vector([-0.19 + z * 0.3 + x * 0.4 for z, x in zip(zigzag, linear)])
    if layer != 0:
        out["v_lora.lora.2.bias"] = vector([0.73 - x * 0.4 for x in linear])
    if "g_norm.weight" in p:
        out["g_norm.weight"] = vector([((layer + 1) / layers) ** 0.7] * hidden)
    out["r_proj.weight"] = draws.orthogonal(hidden, hidden)
    out["k_proj.weight"] = draws.orthogonal(hidden, hidden, gain=0.1)
    out["v_proj.weight"] = draws.orthogonal(hidden, hidden)
    out["o_proj.weight"] = draws.xp.reshape(draws.zeros(hidden * hidden), (hidden, hidden))
    return out
