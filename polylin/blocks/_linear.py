"""What the GLA and Mamba-2 blocks share, in the array API: gated linear attention over grouped
heads, its short convolutions and its cache.

Both run :func:`polylin.causal_linear_attention` (and :func:`polylin.step` for one token) with
the identity feature map, ``normalize=False`` and a log decay, on heads laid out ``(...,
shared, per_group, d)``: ``shared`` key heads (GLA's ``num_kv_heads``, Mamba-2's ``n_groups``),
each serving ``per_group`` consecutive heads by broadcasting a size-1 axis (nothing is copied
per head). A block module supplies its inputs and its output (:class:`Stage`); this one checks
the input, the mask and the cache, selects the padding away, runs the recurrence and returns the
cache, whose recurrent state is a :class:`polylin.LinearAttentionState` over ``(batch, heads,
...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .._inputs.state import LinearAttentionState
from ..attention import causal_linear_attention
from ..convolution import causal_conv1d, causal_conv1d_step
from ..decoding import step as attention_step
from ..feature_maps import identity
from ..interop import array_namespace, is_array
from ._params import BlockCache, padding_mask

__all__ = ["Plan", "check_implied", "convolve", "run_sequence", "run_token"]

#: ``inputs(x, mask, conv_state, one) -> ([q, k, v, log_decay], rest, new conv_state)``:
#: the recurrence's inputs for ``x`` (``one``: a single token per row), and what the output
#: needs besides ``o`` (``rest``).
Inputs = Callable[[Any, Any, Any, bool], tuple[list[Any], Any, tuple[Any, ...]]]
#: ``output(o, rest) -> y``.
Output = Callable[[Any, Any], Any]


class Plan(NamedTuple):
    """What the shared steps need to know of a block."""

    block: str
    hidden_size: int
    #: Heads of the state (the cache's ``(batch, heads, ...)``).
    heads: int
    #: Key heads (``heads // shared`` heads each).
    shared: int
    num_convs: int
    method: str
    chunk_size: int
    #: Multiplies the queries (:func:`polylin.causal_linear_attention`'s ``scale``).
    scale: float = 1.0


def check_implied(block: str, given: Mapping[str, Any], implied: Mapping[str, Any]) -> None:
    """Each option in ``given`` is one the block knows (a name of ``implied``) and agrees with
    what the parameters imply (``None`` there: they do not say; a callable: a test of the
    given value)."""
    for name, value in given.items():
        if name not in implied:
            raise TypeError(f"{block} got an unexpected keyword argument {name!r}")
        want = implied[name]
        if want is None or value is None:
            continue
        if callable(want) and not isinstance(want, bool):
            agrees, shown = want(value)
        else:
            agrees, shown = value == want, want
        if not agrees:
            raise ValueError(
                f"{block}: {name}={value!r} does not match the parameters, which imply "
                f"{name}={shown!r}"
            )


def convolve(
    params: Mapping[str, Any],
    names: tuple[str, ...],
    inputs: list[Any],
    mask: Any,
    states: tuple[Any, ...] | None,
    *,
    one: bool,
) -> tuple[list[Any], tuple[Any, ...]]:
    """Each input through its short causal convolution ``names[i]`` (``torch.nn.Conv1d``
    weight ``(channels, 1, width)``, optional bias) and SiLU, from its state (``one``: a single
    token); the outputs and the new states."""
    outputs, new_states = [], []
    for i, (name, x) in enumerate(zip(names, inputs)):
        xp = array_namespace(x)
        w = params[f"{name}.weight"]
        weight = xp.reshape(w, (w.shape[0], w.shape[-1]))
        bias = params.get(f"{name}.bias")
        state = None if states is None else states[i]
        if one:
            y, state = causal_conv1d_step(
                x, weight, bias, state=state, activation="silu", attention_mask=mask
            )
        else:
            y, state = causal_conv1d(
                x, weight, bias, activation="silu", state=state, return_state=True,
                attention_mask=mask,
            )  # fmt: skip
        outputs.append(y)
        new_states.append(state)
    return outputs, tuple(new_states)


def _check_cache(plan: Plan, cache: Any, x: Any) -> None:
    """``cache`` is ``None`` or a :class:`BlockCache` of this block's kind and batch."""
    if cache is None:
        return
    block = plan.block
    if not isinstance(cache, tuple) or len(cache) != 2:
        raise TypeError(
            f"{block}: cache must be a BlockCache (conv_state, recurrent_state) from this "
            f"block, got {type(cache).__name__}"
        )
    conv_state, state = cache
    if not isinstance(conv_state, tuple) or len(conv_state) != plan.num_convs:
        count = len(conv_state) if isinstance(conv_state, tuple) else type(conv_state).__name__
        raise ValueError(
            f"{block}: the cache holds {count} convolution states, this block has "
            f"{plan.num_convs}: it was made by another block"
        )
    S = state[0] if isinstance(state, tuple) and len(state) == 2 else None
    if S is None or not is_array(S) or S.ndim != 4 or S.shape[1] != plan.heads:
        raise ValueError(
            f"{block}: the cache's recurrent state must be a LinearAttentionState (S, z) with S "
            f"of shape (batch, {plan.heads}, d_k, d_v): it was made by another block"
        )
    if S.shape[0] != x.shape[0]:
        raise ValueError(
            f"{block}: the cache's recurrent state is for a batch of {S.shape[0]}, the "
            f"input's is {x.shape[0]}"
        )


def _grouped_state(xp: Any, cache: BlockCache | None, shared: int) -> LinearAttentionState | None:
    """The cache's state over ``(batch, heads, ...)`` as ``(batch, shared, heads // shared,
    ...)`` (head ``h`` in group ``h // (heads // shared)``)."""
    if cache is None:
        return None
    S, z = cache.recurrent_state
    per_group = S.shape[1] // shared
    return LinearAttentionState(
        xp.reshape(S, (S.shape[0], shared, per_group, *S.shape[2:])),
        xp.reshape(z, (z.shape[0], shared, per_group, *z.shape[2:])),
    )


def _heads_state(xp: Any, state: Any) -> Any:
    """The inverse of :func:`_grouped_state` (``z`` without a normalizer may keep a size-1
    group axis: broadcast first)."""
    S, z = state
    heads = S.shape[1] * S.shape[2]
    z = xp.broadcast_to(z, S.shape[:-1])
    return LinearAttentionState(
        xp.reshape(S, (S.shape[0], heads, *S.shape[3:])),
        xp.reshape(z, (z.shape[0], heads, *z.shape[3:])),
    )


def run_sequence(
    plan: Plan,
    x: Any,
    inputs: Inputs,
    output: Output,
    *,
    attention_mask: Any,
    cache: BlockCache | None,
    return_cache: bool,
) -> Any:
    """The block over ``x`` ``(batch, T, hidden_size)``: ``y`` or ``(y, cache)``."""
    xp = array_namespace(x)
    _check_cache(plan, cache, x)
    mask = padding_mask(plan.block, xp, attention_mask, x, "x", plan.hidden_size, rank=3)
    if mask is not None:
        x = xp.where(mask[..., None], x, 0.0)
    (q, k, v, g), rest, conv_state = inputs(
        x, mask, None if cache is None else cache.conv_state, False
    )
    o, state = causal_linear_attention(
        q, k, v, identity, method=plan.method, chunk_size=plan.chunk_size,
        initial_state=_grouped_state(xp, cache, plan.shared), return_state=True,
        attention_mask=mask, seq_axis=1, log_decay=g, normalize=False, scale=plan.scale,
    )  # fmt: skip
    y = output(o, rest)
    if mask is not None:
        y = xp.where(mask[..., None], y, 0.0)
    if not return_cache:
        return y
    return y, BlockCache(conv_state, _heads_state(xp, state))


def run_token(
    plan: Plan,
    x_t: Any,
    inputs: Inputs,
    output: Output,
    *,
    attention_mask: Any,
    cache: BlockCache | None,
) -> tuple[Any, BlockCache]:
    """One token ``x_t`` ``(batch, hidden_size)`` per sequence: ``(y_t, cache)``; the rows
    that the mask leaves out keep their cache and output 0."""
    xp = array_namespace(x_t)
    _check_cache(plan, cache, x_t)
    mask = padding_mask(plan.block, xp, attention_mask, x_t, "x_t", plan.hidden_size, rank=2)
    if mask is not None:
        x_t = xp.where(mask[:, None], x_t, 0.0)
    (q, k, v, g), rest, conv_state = inputs(
        x_t, mask, None if cache is None else cache.conv_state, True
    )
    o, state = attention_step(
        q, k, v, _grouped_state(xp, cache, plan.shared), identity, attention_mask=mask,
        log_decay=g, normalize=False, scale=plan.scale,
    )  # fmt: skip
    y = output(o, rest)
    if mask is not None:
        y = xp.where(mask[:, None], y, 0.0)
    return y, BlockCache(conv_state, _heads_state(xp, state))
