"""What the Gated DeltaNet and Kimi Delta Attention blocks share, in the array API.

Both project ``x`` to ``q``, ``k``, ``v`` (each through its short causal convolution and SiLU),
``beta = sigmoid(b_proj(x))`` and a log decay, run the delta rule with L2-normalized ``q`` and
``k`` over grouped value heads, and normalize, gate and project the output. A block module
supplies its log decay and its output gate; this one does the rest, for a whole sequence
(:func:`run_sequence`) and for one token (:func:`run_token`), with the cache
(:class:`BlockCache`).

Heads are laid out ``(..., num_heads, group, d)`` with ``group = num_v_heads // num_heads``:
query/key head ``h`` serves value heads ``h * group .. h * group + group - 1`` by broadcasting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..activations import sigmoid, silu
from ..convolution import causal_conv1d, causal_conv1d_step
from ..delta_rule import DELTA_METHODS, delta_rule_attention, delta_rule_step
from ..interop import array_namespace
from ..normalization import rms_norm
from ._init import Draws
from ._params import BlockCache, check_cache, linear, padding_mask, param

__all__ = ["DeltaSizes", "grouped", "init_inputs", "run_sequence", "run_token", "sizes_of"]

#: ``gate(params, x, sizes) -> log decay (..., num_heads, group, 1 or head_dim)``.
LogDecay = Callable[[Mapping[str, Any], Any, "DeltaSizes"], Any]


class DeltaSizes(NamedTuple):
    """The sizes and options of a delta-rule block, as its parameters and options give them."""

    hidden_size: int
    num_heads: int
    num_v_heads: int
    head_dim: int
    head_v_dim: int
    use_short_conv: bool
    conv_size: int
    allow_neg_eigval: bool
    norm_eps: float
    method: str
    chunk_size: int

    @property
    def group(self) -> int:
        """Value heads per query/key head."""
        return self.num_v_heads // self.num_heads

    @property
    def value_dim(self) -> int:
        """``num_v_heads * head_v_dim``."""
        return self.num_v_heads * self.head_v_dim


def _check_option(block: str, name: str, given: Any, implied: Any) -> None:
    if given is not None and given != implied:
        raise ValueError(
            f"{block}: {name}={given!r} does not match the parameters, which imply "
            f"{name}={implied!r}"
        )


def sizes_of(
    block: str,
    params: Mapping[str, Any],
    *,
    num_heads: int | None,
    allow_neg_eigval: bool,
    norm_eps: float,
    method: str,
    chunk_size: int,
    implied: Mapping[str, Any],
    extra: Mapping[str, Any],
) -> DeltaSizes:
    """The block's sizes from its parameters' shapes and the options they do not imply.

    ``implied`` holds the options a caller may pass although the shapes give them (the torch
    module's constructor keywords); each is checked against the shapes, and against ``extra``
    (the block's own implied options, such as ``use_gate``).
    """
    if method not in DELTA_METHODS:
        raise ValueError(f"{block}: method must be one of {DELTA_METHODS}, got {method!r}")
    key_dim, hidden_size = param(block, params, "q_proj.weight", ndim=2).shape
    if num_heads is None:
        head_dim = implied.get("head_dim")
        if head_dim is None:
            raise TypeError(f"{block}: pass num_heads (or head_dim): the parameters do not say")
        num_heads = key_dim // head_dim if head_dim > 0 and key_dim % head_dim == 0 else 0
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{block}: num_heads must be a positive int, got {num_heads!r}")
    value_dim = param(block, params, "v_proj.weight", ndim=2).shape[0]
    num_v_heads = param(block, params, "b_proj.weight", ndim=2).shape[0]
    head_v_dim = param(block, params, "o_norm.weight", ndim=1).shape[0]
    if key_dim % num_heads:
        raise ValueError(
            f"{block}: q_proj.weight has {key_dim} rows, not a multiple of num_heads={num_heads}"
        )
    if num_v_heads % num_heads or num_v_heads * head_v_dim != value_dim:
        raise ValueError(
            f"{block}: b_proj.weight ({num_v_heads} value heads), o_norm.weight (head_v_dim "
            f"{head_v_dim}) and v_proj.weight ({value_dim} rows) do not fit num_heads={num_heads}"
        )
    use_short_conv = "q_conv1d.weight" in params
    conv_size = param(block, params, "q_conv1d.weight", ndim=3).shape[-1] if use_short_conv else 4
    head_dim = key_dim // num_heads
    shapes = {
        "hidden_size": hidden_size, "head_dim": head_dim, "num_v_heads": num_v_heads,
        "expand_v": head_v_dim / head_dim, "use_short_conv": use_short_conv,
        "conv_size": conv_size if use_short_conv else None,
        "conv_bias": "q_conv1d.bias" in params if use_short_conv else None,
        **extra,
    }  # fmt: skip
    for name, given in implied.items():
        if name not in shapes:
            raise TypeError(f"{block} got an unexpected keyword argument {name!r}")
        if shapes[name] is not None and not (
            name == "expand_v" and given is not None and math.isclose(given, shapes[name])
        ):
            _check_option(block, name, given, shapes[name])
    return DeltaSizes(
        hidden_size, num_heads, num_v_heads, head_dim, head_v_dim, use_short_conv, conv_size,
        bool(allow_neg_eigval), float(norm_eps), method, int(chunk_size),
    )  # fmt: skip


def _qkv(
    params: Mapping[str, Any],
    x: Any,
    sizes: DeltaSizes,
    mask: Any,
    conv_state: tuple[Any, ...] | None,
    *,
    one: bool,
) -> tuple[list[Any], tuple[Any, ...]]:
    """``q, k`` ``(..., num_heads, 1, head_dim)`` and ``v`` ``(..., num_heads, group,
    head_v_dim)`` after their convolutions, and the convolutions' new states."""
    xp = array_namespace(x)
    projected = [linear(params, x, f"{n}_proj") for n in "qkv"]
    states: tuple[Any, ...] = ()
    if sizes.use_short_conv:
        outputs, new_states = [], []
        for i, (n, p) in enumerate(zip("qkv", projected)):
            w = params[f"{n}_conv1d.weight"]
            weight = xp.reshape(w, (w.shape[0], w.shape[-1]))
            bias = params.get(f"{n}_conv1d.bias")
            state = None if conv_state is None else conv_state[i]
            if one:
                y, state = causal_conv1d_step(
                    p, weight, bias, state=state, activation="silu", attention_mask=mask
                )
            else:
                y, state = causal_conv1d(
                    p, weight, bias, activation="silu", state=state, return_state=True,
                    attention_mask=mask,
                )  # fmt: skip
            outputs.append(y)
            new_states.append(state)
        projected, states = outputs, tuple(new_states)
    else:
        projected = [silu(p) for p in projected]
    lead = tuple(x.shape[:-1])
    q, k = (xp.reshape(p, (*lead, sizes.num_heads, 1, sizes.head_dim)) for p in projected[:2])
    v = grouped(xp, projected[2], sizes, sizes.head_v_dim)
    return [q, k, v], states


def grouped(xp: Any, t: Any, sizes: DeltaSizes, size: int) -> Any:
    """``(..., num_v_heads * size)`` as ``(..., num_heads, group, size)``."""
    return xp.reshape(t, (*t.shape[:-1], sizes.num_heads, sizes.group, size))


def _beta(params: Mapping[str, Any], x: Any, sizes: DeltaSizes) -> Any:
    beta = sigmoid(linear(params, x, "b_proj"))
    if sizes.allow_neg_eigval:
        beta = 2.0 * beta
    return grouped(array_namespace(x), beta, sizes, 1)


def _output(
    params: Mapping[str, Any], o: Any, x: Any, sizes: DeltaSizes, gate: Any, activation: str
) -> Any:
    """The output norm per value head, gated by ``gate``, and ``o_proj``."""
    xp = array_namespace(x)
    lead = tuple(x.shape[:-1])
    o = xp.reshape(o, (*lead, sizes.num_v_heads, sizes.head_v_dim))
    if gate is not None:
        gate = xp.reshape(gate, (*lead, sizes.num_v_heads, sizes.head_v_dim))
    o = rms_norm(
        o, params["o_norm.weight"], gate=gate, eps=sizes.norm_eps, activation=activation
    )
    return linear(params, xp.reshape(o, (*lead, sizes.value_dim)), "o_proj")


def _state_in(xp: Any, cache: BlockCache | None, sizes: DeltaSizes) -> Any:
    if cache is None:
        return None
    S = cache.recurrent_state
    return xp.reshape(S, (S.shape[0], sizes.num_heads, sizes.group, *S.shape[2:]))


def _state_out(xp: Any, S: Any, sizes: DeltaSizes) -> Any:
    return xp.reshape(S, (S.shape[0], sizes.num_v_heads, *S.shape[3:]))


def run_sequence(
    block: str,
    params: Mapping[str, Any],
    x: Any,
    sizes: DeltaSizes,
    log_decay: LogDecay,
    gate: Callable[[Mapping[str, Any], Any], Any],
    activation: str,
    *,
    attention_mask: Any,
    cache: BlockCache | None,
    return_cache: bool,
) -> Any:
    """The block over ``x`` ``(batch, T, hidden_size)``: ``y`` or ``(y, cache)``."""
    xp = array_namespace(x)
    check_cache(block, cache, x, sizes.use_short_conv)
    mask = padding_mask(block, xp, attention_mask, x, "x", sizes.hidden_size, rank=3)
    if mask is not None:
        x = xp.where(mask[..., None], x, 0.0)
    (q, k, v), conv_state = _qkv(
        params, x, sizes, mask, None if cache is None else cache.conv_state, one=False
    )
    o, S = delta_rule_attention(
        q, k, v, _beta(params, x, sizes), log_decay=log_decay(params, x, sizes),
        scale=sizes.head_dim**-0.5, qk_l2norm=True, method=sizes.method,
        chunk_size=sizes.chunk_size, initial_state=_state_in(xp, cache, sizes),
        return_state=True, attention_mask=mask, seq_axis=1,
    )  # fmt: skip
    y = _output(params, o, x, sizes, gate(params, x), activation)
    if mask is not None:
        y = xp.where(mask[..., None], y, 0.0)
    if not return_cache:
        return y
    return y, BlockCache(conv_state, _state_out(xp, S, sizes))


def run_token(
    block: str,
    params: Mapping[str, Any],
    x_t: Any,
    sizes: DeltaSizes,
    log_decay: LogDecay,
    gate: Callable[[Mapping[str, Any], Any], Any],
    activation: str,
    *,
    attention_mask: Any,
    cache: BlockCache | None,
) -> tuple[Any, BlockCache]:
    """One token ``x_t`` ``(batch, hidden_size)`` per sequence: ``(y_t, cache)``."""
    xp = array_namespace(x_t)
    check_cache(block, cache, x_t, sizes.use_short_conv)
    mask = padding_mask(block, xp, attention_mask, x_t, "x_t", sizes.hidden_size, rank=2)
    if mask is not None:
        x_t = xp.where(mask[:, None], x_t, 0.0)
    (q, k, v), conv_state = _qkv(
        params, x_t, sizes, mask, None if cache is None else cache.conv_state, one=True
    )
    S0 = _state_in(xp, cache, sizes)
    o, S = delta_rule_step(
        q, k, v, _beta(params, x_t, sizes), S0, log_decay=log_decay(params, x_t, sizes),
        scale=sizes.head_dim**-0.5, qk_l2norm=True,
    )  # fmt: skip
    if mask is not None:  # the rows that do not take the token keep their state
        S = xp.where(mask[:, None, None, None, None], S, 0.0 if S0 is None else S0)
    y = _output(params, o, x_t, sizes, gate(params, x_t), activation)
    if mask is not None:
        y = xp.where(mask[:, None], y, 0.0)
    return y, BlockCache(conv_state, _state_out(xp, S, sizes))


def init_inputs(
    draws: Draws,
    *,
    hidden_size: int,
    key_dim: int,
    value_dim: int,
    num_v_heads: int,
    use_short_conv: bool,
    conv_size: int,
    conv_bias: bool,
) -> dict[str, Any]:
    """The initial ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj`` and short convolutions."""
    params = {
        "q_proj.weight": draws.linear(key_dim, hidden_size),
        "k_proj.weight": draws.linear(key_dim, hidden_size),
        "v_proj.weight": draws.linear(value_dim, hidden_size),
        "b_proj.weight": draws.linear(num_v_heads, hidden_size),
    }
    if use_short_conv:
        for n, channels in (("q", key_dim), ("k", key_dim), ("v", value_dim)):
            params[f"{n}_conv1d.weight"] = draws.conv(channels, conv_size)
            if conv_bias:
                params[f"{n}_conv1d.bias"] = draws.bias(channels, conv_size)
    return params
