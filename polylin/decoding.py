"""Token-by-token decoding with a fixed-size state."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from ._backend.compiled_step import CompiledStep, compiled_step
from ._backend.fused import StepRows, fused_step_rows
from ._backend.namespace import is_array
from ._forms.linear.recurrent import recurrent_step
from ._inputs.defaults import DEFAULT_EPS
from ._inputs.gates import check_log_decay, check_normalize, log_decay_values
from ._inputs.prepare import apply_feature_map, finish, map_features, select
from ._inputs.sequences import check_scale
from ._inputs.state import LinearAttentionState
from ._inputs.steps import PER_CALL, PlanCache, PreparedStep
from ._inputs.validation import (
    AttentionInputs,
    check_options,
    check_qkv,
    check_state,
    check_token_mask,
)
from ._typing import Array
from .attention import FeatureMap
from .feature_maps import resolve_feature_map

__all__ = ["prepare_step", "step"]


def step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    /,
    state: LinearAttentionState | None = None,
    feature_map: FeatureMap | None = None,
    *,
    eps: float = DEFAULT_EPS,
    attention_mask: Array | None = None,
    log_decay: Array | float | None = None,
    normalize: bool = True,
    scale: float = 1.0,
) -> tuple[Array, LinearAttentionState]:
    """Attend one new token: update the state with ``(k_t, v_t)`` and read it with ``q_t``.

    Cost and memory are O(d_phi d_v) whatever the position: the state replaces a KV cache.
    Running ``step`` over a sequence gives the same outputs as
    :func:`~polylin.causal_linear_attention`, and a state returned by that function (e.g. after
    a chunked prefill) continues here.

    Parameters
    ----------
    q_t, k_t : array
        Query and key of the new token, shape ``(..., d_k)``.
    v_t : array
        Value of the new token, shape ``(..., d_v)``. The leading dimensions of ``q_t``,
        ``k_t`` and ``v_t`` broadcast (grouped heads), and the state's broadcast to them.
    state : LinearAttentionState, optional
        The state before this token; ``None`` starts from zeros.
    feature_map : callable, optional
        Positive feature map; default :func:`polylin.feature_maps.elu_plus_one`. Pass the one
        the state was built with: a map of another feature size is an error naming the sizes,
        but a different map of the *same* size cannot be detected and silently gives wrong
        outputs.
    eps : float
        Added to the normalizer; positive and finite in the work dtype.
    attention_mask : array of bool, optional
        Which rows take this token, shape ``q_t.shape[:-1]`` (size-1 axes broadcast) or 1-D
        ``(batch,)`` for the first leading axis. Rows where it is False keep their state
        exactly (the same values, new arrays) and output exactly 0, whatever ``q_t``, ``k_t``,
        ``v_t`` hold there: finished sequences in a batch, continuous batching.
    log_decay : float or array, optional
        Log decay ``g_t <= 0`` of this token: the state decays by ``exp(g_t)`` before the
        token is added. A number or an array broadcasting against ``(..., d_phi)`` (trailing 1:
        a scalar gate, ``d_phi``: per channel); a number above 0 is an error, array values
        above 0 are taken as 0, as in :func:`~polylin.causal_linear_attention`; see
        :doc:`/decay`.
    normalize : bool
        Divide by ``phi(q_t) . z_t + eps``; ``False`` returns ``phi(q_t) S_t``.
    scale : float
        Multiplies the mapped query, as in :func:`~polylin.causal_linear_attention`.

    Returns
    -------
    o_t : array
        Shape ``(..., d_v)``, same library, device and dtype as ``q_t``.
    state : LinearAttentionState
        The state after this token, in the work dtype: float32 for 16-bit inputs, else the
        inputs' dtype. A given ``state`` must already be in that dtype.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a malformed state or one of
        another dtype than the work dtype.
    ValueError
        Mismatched shapes or devices (a token that still has its length-1 T axis; a state
        built with a feature map of another size), ``eps`` not positive and finite in the work
        dtype, a ``scale`` that is not finite.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_linear_attention, step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> prompt, state = causal_linear_attention(q[:6], k[:6], v[:6], return_state=True)
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     o_t, state = step(q[t], k[t], v[t], state)
    ...     outputs.append(o_t)
    >>> whole = causal_linear_attention(q, k, v)
    >>> bool(np.allclose(np.stack(outputs), whole[6:]))
    True
    """
    args = (q_t, k_t, v_t, state, attention_mask, log_decay)
    plan, mapped = _PLANS.plan(
        partial(_plan_step, feature_map=feature_map, eps=eps, normalize=normalize, scale=scale),
        args,
        (feature_map, eps, normalize, scale),
    )
    return _run_step(plan, *args, checked=mapped)


#: :func:`step`'s checks run once per signature of its arguments and options (``_inputs.steps``).
_PLANS = PlanCache()


class _StepPlan(NamedTuple):
    """What :func:`step`'s checks found, for one signature of its arguments."""

    inputs: AttentionInputs
    map_query: Callable[[Any], Any]
    map_key: Callable[[Any], Any]
    eps: float
    normalize: bool
    scale: float  # multiplies the mapped query
    mask_shape: tuple | None  # the token mask as (..., 1)
    state_shapes: tuple[tuple, tuple]  # (S, z) broadcast to the batch
    broadcast_state: bool  # a given state has fewer leading dimensions than the batch
    fixed_decay: Any  # the log decay of a number or None (the same at every call), or PER_CALL
    fused_rows: StepRows | None  # PyTorch, a state per token row: ``fused_step_rows`` found once
    compiled: CompiledStep | None  # NumPy, PyTorch CPU: the kernel for this signature


def _plan_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    state: LinearAttentionState | None,
    attention_mask: Array | None,
    log_decay: Any,
    *,
    feature_map: FeatureMap | None,
    eps: float,
    normalize: bool,
    scale: float,
) -> tuple[_StepPlan, tuple[Array, Array]]:
    """Check every argument of :func:`step`; return the plan and the mapped ``(fq, fk)``."""
    inputs = check_qkv(q_t, k_t, v_t, causal=True, single_token=True)
    eps, _ = check_options(eps=eps, inputs=inputs)
    check_normalize(normalize)
    scale = check_scale(scale)
    xp = inputs.xp
    mask = None if attention_mask is None else check_token_mask(inputs, attention_mask)
    q_t, k_t = (select(xp, mask, x) for x in (q_t, k_t))
    fq, fk = apply_feature_map(inputs, feature_map, q_t, k_t, names=("q_t", "k_t"))
    S, z = check_state(
        inputs,
        state,
        inputs.batch_shape,
        fq.shape[-1],
        v_t.shape[-1],
        name="state",
        token_shape=tuple(q_t.shape),
    )
    decay = check_log_decay(inputs, log_decay, length=None, d_phi=fq.shape[-1])
    map_query, map_key = resolve_feature_map(feature_map)
    shapes = [tuple(x.shape) for x in (fq, fk, v_t)]
    gate = log_decay if is_array(log_decay) else decay
    if gate is not None:
        shapes.append(tuple(gate.shape))
    fused = fused_step_rows(q_t, inputs.batch_shape, *shapes)
    shared = state is not None and (tuple(state[0].shape), tuple(state[1].shape)) != (
        tuple(S.shape), tuple(z.shape))  # fmt: skip
    compiled = None
    if mask is None and state is not None and not shared:  # the state as given
        compiled = compiled_step(
            "linear", [fq, fk, v_t], log_decay if is_array(log_decay) else decay, S, z,
            log=True, scale=scale, eps=eps if normalize else None,
        )  # fmt: skip
    plan = _StepPlan(
        inputs,
        map_query,
        map_key,
        eps,
        normalize,
        scale,
        None if mask is None else tuple(mask.shape),
        (tuple(S.shape), tuple(z.shape)),
        shared,
        PER_CALL if is_array(log_decay) else decay,
        fused,
        compiled,
    )
    return plan, (fq, fk)


def _run_step(
    plan: _StepPlan,
    q_t: Array,
    k_t: Array,
    v_t: Array,
    state: LinearAttentionState | None,
    attention_mask: Array | None,
    log_decay: Any,
    *,
    checked: tuple[Array, Array] | None = None,
) -> tuple[Array, LinearAttentionState]:
    """:func:`step`'s arithmetic on arguments of the plan's signature (``checked``: the mapped
    features the checks computed)."""
    inputs = plan.inputs
    xp = inputs.xp
    if plan.compiled is not None:  # no mask, the state as given
        fq, fk = checked or map_features(inputs, plan.map_query, plan.map_key, q_t, k_t)
        decay = log_decay if plan.fixed_decay is PER_CALL else plan.fixed_decay
        done = plan.compiled([fq, fk, v_t], decay, *state)  # type: ignore[misc]
        if done is not None:
            return done[0], LinearAttentionState(*done[1:])
    mask = None
    if attention_mask is not None:  # masked rows take zeros, before and after the map
        mask = xp.reshape(attention_mask, plan.mask_shape)
        v_t = select(xp, mask, v_t)
        if checked is None:
            q_t, k_t = select(xp, mask, q_t), select(xp, mask, k_t)
    fq, fk = checked or map_features(inputs, plan.map_query, plan.map_key, q_t, k_t)
    if plan.scale != 1.0:
        fq = fq * plan.scale
    if mask is not None:
        fk = select(xp, mask, fk)
    v_t = inputs.to_work_dtype(v_t)
    if state is None:
        S0, z0 = (xp.zeros(shape, dtype=inputs.work_dtype, device=inputs.device)
                  for shape in plan.state_shapes)
    elif plan.broadcast_state:  # a state shared by a batch or by grouped heads
        S0, z0 = (xp.broadcast_to(x, shape) for x, shape in zip(state, plan.state_shapes))
    else:
        S0, z0 = state
    decay = plan.fixed_decay
    if decay is PER_CALL:
        decay = log_decay_values(inputs, log_decay, explicit=1)
    o_t, S, z = recurrent_step(
        xp, fq, fk, v_t, S0, z0, plan.eps, log_decay=decay, normalize=plan.normalize,
        rows=plan.fused_rows,
    )  # fmt: skip
    if mask is not None:  # rows that do not take the token keep their state exactly
        S, z = xp.where(mask[..., None], S, S0), xp.where(mask, z, z0)
    return finish(inputs, o_t, mask), LinearAttentionState(S, z)


def prepare_step(
    feature_map: FeatureMap | None = None,
    *,
    eps: float = DEFAULT_EPS,
    normalize: bool = True,
    scale: float = 1.0,
) -> PreparedStep:
    """:func:`step` for a decoding loop: arguments checked once, then arithmetic only.

    The returned function is called like :func:`step` without its options,
    ``prepared(q_t, k_t, v_t, state, attention_mask=None, log_decay=None)``, and returns the
    same ``(o_t, state)``, equal to the last bit. Its first call checks everything
    :func:`step` checks; later calls whose arrays have the same library, shape, dtype and
    device as the call before (and numbers of the same values) skip the checks, which cost a
    decoding step of a small model more than its arithmetic (``docs/performance.md``,
    "Decoding"). Any other call is checked again: errors are :func:`step`'s.

    Parameters
    ----------
    feature_map : callable, optional
        As in :func:`step`. It is called on every token; a map whose output shape could
        change for inputs of the same shape is not supported.
    eps : float
        As in :func:`step`; checked at the first call.
    normalize : bool
        As in :func:`step`; checked at the first call.
    scale : float
        As in :func:`step`; checked at the first call.

    Returns
    -------
    PreparedStep
        A callable ``(q_t, k_t, v_t, /, state=None, *, attention_mask=None, log_decay=None)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_linear_attention, prepare_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> prompt, state = causal_linear_attention(q[:6], k[:6], v[:6], return_state=True)
    >>> decode = prepare_step()
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     o_t, state = decode(q[t], k[t], v[t], state)
    ...     outputs.append(o_t)
    >>> bool(np.allclose(np.stack(outputs), causal_linear_attention(q, k, v)[6:]))
    True
    """

    plan = partial(_plan_step, feature_map=feature_map, eps=eps, normalize=normalize, scale=scale)
    names = ("q_t", "k_t", "v_t", "state", "attention_mask", "log_decay")
    return PreparedStep(
        plan, _run_step, name="step", names=names, required=3, positional_only=3, positional=4
    )
