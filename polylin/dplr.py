"""The generalized delta rule (diagonal-plus-low-rank transitions, RWKV-7): entry points.

Every recurrence of the delta family is one state update with the transition
``diag(exp(g_t)) + b_t a_t^T``; :func:`dplr_delta_rule` computes it in general (RWKV-7 is
the model that uses it whole). See ``docs/dplr.md`` for the math, the forms and the
substitutions that give the delta rule, the gated delta rule and KDA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from ._backend.compiled import compiled_tokens
from ._backend.fused import fused_dplr_step, fused_step_rows
from ._backend.namespace import is_array
from ._forms.dplr.chunked import dplr_chunked
from ._forms.dplr.quadratic import dplr_quadratic
from ._forms.dplr.recurrent import dplr_recurrent, dplr_step
from ._inputs.defaults import DEFAULT_DPLR_CHUNK_SIZE, DEFAULT_EPS
from ._inputs.gates import standard_log_decay
from ._inputs.layout import DEFAULT_SEQ_AXIS, standard_layout
from ._inputs.prepare import finish
from ._inputs.sequences import (
    StepPlan,
    check_scale,
    log_decay_shape,
    planned_compiled,
    planned_decay,
    run_compiled,
    run_sequences,
    shaped_log_decay,
    step_decay,
    step_state,
    used_as_given,
)
from ._inputs.steps import PlanCache, PreparedStep
from ._inputs.validation import (
    AttentionInputs,
    check_coefficient,
    check_matrix_state,
    check_method,
    check_options,
    check_qkv,
)
from ._typing import Array

__all__ = [
    "DPLR_METHODS",
    "dplr_delta_rule",
    "dplr_delta_rule_step",
    "prepare_dplr_step",
]

#: The algorithms of :func:`dplr_delta_rule`; they compute the same function.
DPLR_METHODS = ("chunked", "recurrent", "quadratic")

_ANY = (-math.inf, math.inf)


def _check_vectors(inputs: AttentionInputs, x: Any, shape: tuple, name: str) -> Any:
    """``a`` or ``b``: an array of the dtype of ``q`` that broadcasts to ``shape`` (the keys'),
    in the work dtype, keeping its own leading dimensions (grouped heads are not copied)."""
    if not is_array(x):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    check_coefficient(inputs, x, shape, name=name, bounds=_ANY, per="key channel")
    return _vector_values(inputs, x, shape)


def _vector_values(inputs: AttentionInputs, x: Any, shape: tuple) -> Any:
    """A checked ``a`` or ``b`` in the work dtype, broadcast to the trailing axes of ``shape``
    only (see :func:`_check_vectors`)."""
    core = len(shape) - len(inputs.batch_shape)  # (T, d_k), or (d_k,) for one token
    lead = tuple(x.shape[:-core]) if x.ndim >= core else ()
    x, shape = inputs.to_work_dtype(x), (*lead, *shape[-core:])
    return x if tuple(x.shape) == shape else inputs.xp.broadcast_to(x, shape)


def _algorithm(xp: Any, method: str, chunk_size: int, scale: float) -> Any:
    """The form that ``method`` names, on the arrays ``[q, k, v, a, b(, log_decay)]``, its
    queries scaled (block by block in the chunked form)."""

    def algorithm(arrays: list[Any], S: Any, keep: Any) -> tuple[Any, Any]:
        q, k, v, a, b, *rest = arrays
        g = rest[0] if rest else None
        if method == "chunked":
            return dplr_chunked(xp, q, k, v, a, b, g, S, chunk_size=chunk_size, scale=scale)
        if method == "recurrent":  # scales the queries itself (on the loop's arrays)
            return dplr_recurrent(xp, q, k, v, a, b, g, S, scale=scale)
        return dplr_quadratic(xp, q if scale == 1.0 else q * scale, k, v, a, b, g, S)

    return algorithm


def dplr_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    a: Array,
    b: Array,
    /,
    *,
    log_decay: Array | None = None,
    scale: float = 1.0,
    method: str = "chunked",
    chunk_size: int = DEFAULT_DPLR_CHUNK_SIZE,
    initial_state: Array | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Array:
    r"""The generalized delta rule (RWKV-7): a decay plus a rank-one term per token.

    ``S_t = diag(exp(g_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T``, and the output is
    ``o_t = scale * S_t^T q_t``, with the state ``S`` of shape ``(d_k, d_v)``. The transition
    ``diag(exp(g_t)) + b_t a_t^T`` is a diagonal decay plus a rank-one term that reads the
    state before the decay (flash-linear-attention's ``dplr`` convention: its ``alpha`` is
    ``a``, its ``beta`` is ``b``). RWKV-7 is ``log_decay = -exp(w)``, ``a = -kk``,
    ``b = kk * a_lr`` with ``kk`` the L2-normalized key; the delta rule, the gated delta rule
    and KDA are other choices of ``a`` and ``b`` (docs page "The generalized delta rule").
    The three methods compute the same function (to round-off).

    Parameters
    ----------
    q, k : array
        Queries and keys, shape ``(..., T, d_k)``, any number of leading batch/head dimensions
        (they broadcast against each other and against ``v``).
    v : array
        Values, shape ``(..., T, d_v)``, the same dtype.
    a, b : array
        The low-rank term ``b_t a_t^T`` of each token: arrays of the dtype of ``q`` that
        broadcast to the shape of ``k``. Keep the transition's eigenvalues at most 1 in
        magnitude (RWKV-7's ``a = -kk``, ``b = kk * a_lr`` with ``a_lr`` in ``(0, 1)`` do), or
        the recurrence itself grows without bound.
    log_decay : float or array, optional
        ``g_t <= 0``: ``None`` (no decay), a Python float, or an array of the dtype of ``q``
        broadcastable to ``(..., T, 1)`` (one decay per token) or ``(..., T, d_k)`` (one per
        key channel, RWKV-7's). Values above 0 are taken as 0 (a decay never amplifies).
    scale : float
        The factor of the output (e.g. ``d_k ** -0.5``).
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: the parallel chunkwise form, ``O(T C d + T d_k d_v)`` in batched matmuls
        (the default). ``"recurrent"``: one state update per token (decoding, the reference).
        ``"quadratic"``: the whole sequence as one block, ``O(T^2 d)`` time and ``O(T^2)``
        memory (``O(T^2 d_k)`` with a gate per channel); for tests and short sequences.
    chunk_size : int
        Chunk length C of the chunked form, rounded up to a power of two (T need not be a
        multiple of it). The default, :data:`DEFAULT_DPLR_CHUNK_SIZE` (32), is half the other
        families' 64: the block within a chunk dominates this form's time, and 32 ran
        0.76-0.95x the time of 64 (NumPy and PyTorch, forward and forward+backward,
        ``docs/dplr.md``). On CPU backends a per-channel gate runs chunks of at most
        ``max(16, d_k / 4)`` tokens (eager) or 32 (under ``jax.jit``); the results agree to
        round-off whatever C.
    initial_state : array, optional
        The state ``S`` to continue from, shape ``(..., d_k, d_v)``; one returned by any
        method or by :func:`dplr_delta_rule_step`, or one whose leading dimensions broadcast
        (a state shared by a batch or by heads). With ``cu_seqlens`` there is one per
        sequence: ``(..., N, d_k, d_v)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        True for real tokens, in the shapes :func:`~polylin.delta_rule_attention` takes. A
        masked token neither writes nor decays nor applies its low-rank term, and its output is
        0; its inputs are never read (they may be NaN).
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis;
        each starts from its own state.
    seq_axis : int
        The axis of T in ``q, k, v, a, b`` (default -2); with another axis ``log_decay``
        arrays have the rank of ``q`` too. The output keeps the input layout.

    Returns
    -------
    array or (array, array)
        The output, shape ``(..., T, d_v)``, same library, device and dtype as ``q``; with
        ``return_state`` also the final state ``S`` (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, ``a`` or ``b`` of another dtype
        than ``q`` (a ``log_decay`` array may have any floating dtype: it is cast), a state
        that is not one array or not in the work dtype.
    ValueError
        Mismatched shapes or devices, an unknown method, ``chunk_size < 1``, a float
        ``log_decay > 0``, ``attention_mask`` with ``cu_seqlens``.

    Examples
    --------
    With ``a = b = 0`` nothing is erased: unnormalized linear attention.

    >>> import numpy as np
    >>> from polylin import dplr_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 40, 8))
    >>> zero = np.zeros_like(k)
    >>> out = dplr_delta_rule(q, k, v, zero, zero)
    >>> bool(np.allclose(out, np.tril(q @ np.swapaxes(k, -1, -2)) @ v))
    True

    RWKV-7's transition (a per-channel decay, a = -kk, b = kk * a_lr), chunked against the
    per-token recurrence:

    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> a_lr = rng.uniform(0.0, 1.0, k.shape)
    >>> w = -np.exp(rng.uniform(-2.0, 0.5, k.shape))  # log decays
    >>> out, S = dplr_delta_rule(q, k, v, -kk, kk * a_lr, log_decay=w, return_state=True)
    >>> ref = dplr_delta_rule(q, k, v, -kk, kk * a_lr, log_decay=w, method="recurrent")
    >>> bool(np.allclose(out, ref)), S.shape
    (True, (2, 8, 8))
    """
    layout, q, k, v, a, b = standard_layout(seq_axis, q=q, k=k, v=v, a=a, b=b)
    inputs = check_qkv(q, k, v, causal=True)
    check_options(eps=DEFAULT_EPS, chunk_size=chunk_size)  # an Integral >= 1, not a tracer
    chunk_size = int(chunk_size)
    check_method(method, DPLR_METHODS)
    scale = check_scale(scale)
    log_decay = standard_log_decay(layout, log_decay)
    xp = inputs.xp
    batch, T, d_k, d_v = inputs.batch_shape, q.shape[-2], k.shape[-1], v.shape[-1]
    keys = (*batch, T, d_k)
    arrays = [inputs.to_work_dtype(x) for x in (q, k, v)]
    arrays += [_check_vectors(inputs, x, keys, name) for name, x in (("a", a), ("b", b))]
    g = shaped_log_decay(  # the recurrent form takes values above 0 as 0 itself
        inputs, log_decay, (*batch, T, 1), channels=d_k, layout=layout,
        clamp=method != "recurrent",
    )  # fmt: skip
    if g is not None:
        arrays.append(g)

    # A masked token has every input selected to 0: it writes nothing, applies no low-rank
    # term (a = b = 0) and does not decay the state (g = 0).
    return run_sequences(
        inputs,
        layout,
        arrays,
        _algorithm(xp, method, chunk_size, scale),
        length=T,
        state_shape=(d_k, d_v),
        initial_state=initial_state,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
    )


def dplr_delta_rule_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    a_t: Array,
    b_t: Array,
    state: Array | None = None,
    /,
    *,
    log_decay: Array | None = None,
    scale: float = 1.0,
) -> tuple[Array, Array]:
    """One token of the generalized delta rule: update the state, read it with ``q_t``.

    Cost and memory are O(d_k d_v) whatever the position. A state returned by
    :func:`dplr_delta_rule` (e.g. after a chunked prefill) continues here exactly.

    Parameters
    ----------
    q_t, k_t : array
        Query and key of the new token, shape ``(..., d_k)``.
    v_t : array
        Value of the new token, shape ``(..., d_v)``.
    a_t, b_t : array
        The low-rank term ``b_t a_t^T``, arrays of the dtype of ``q_t`` broadcastable to the
        shape of ``k_t``.
    state : array, optional
        The state ``S`` before this token, shape ``(..., d_k, d_v)`` (its leading dimensions
        may broadcast); ``None`` starts from zeros.
    log_decay : float or array, optional
        ``g_t <= 0`` of this token: ``None``, a Python float, or an array broadcastable to
        ``(..., 1)`` or ``(..., d_k)``; values above 0 are taken as 0.
    scale : float
        The factor of the output.

    Returns
    -------
    o_t : array
        Shape ``(..., d_v)``, same library, device and dtype as ``q_t``.
    state : array
        The state after this token (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state that is not one array.
    ValueError
        Mismatched shapes or devices, a float ``log_decay > 0``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import dplr_delta_rule, dplr_delta_rule_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> a, b, w = -kk, 0.5 * kk, np.full((10, 4), -0.3)
    >>> prompt, state = dplr_delta_rule(
    ...     q[:6], k[:6], v[:6], a[:6], b[:6], log_decay=w[:6], return_state=True
    ... )
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     o_t, state = dplr_delta_rule_step(q[t], k[t], v[t], a[t], b[t], state, log_decay=w[t])
    ...     outputs.append(o_t)
    >>> whole = dplr_delta_rule(q, k, v, a, b, log_decay=w)
    >>> bool(np.allclose(np.stack(outputs), whole[6:]))
    True
    """
    args = (q_t, k_t, v_t, a_t, b_t, state, log_decay)
    plan = _PLANS.plan(partial(_plan_step, scale=scale), args, (scale,))
    return _run_step(plan[0], *args)


#: :func:`dplr_delta_rule_step`'s checks run once per signature of its arguments and options.
_PLANS = PlanCache()


def _plan_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    a_t: Array,
    b_t: Array,
    state: Array | None,
    log_decay: Any,
    *,
    scale: Any,
) -> tuple[StepPlan, None]:
    """Check every argument of :func:`dplr_delta_rule_step` (the ``plan`` of ``_prepared``)."""
    inputs = check_qkv(q_t, k_t, v_t, causal=True, single_token=True)
    batch, d_k, d_v = inputs.batch_shape, k_t.shape[-1], v_t.shape[-1]
    scale = check_scale(scale)
    for name, x in (("a_t", a_t), ("b_t", b_t)):
        _check_vectors(inputs, x, (*batch, d_k), name)
    g = shaped_log_decay(inputs, log_decay, (*batch, 1), channels=d_k)
    check_matrix_state(inputs, state, (*batch, d_k, d_v), name="state")
    vectors = ((x, (*x.shape[:-1], d_k) if x.ndim else None) for x in (a_t, b_t))
    log_decay_as_given = (log_decay, log_decay_shape(log_decay, (*batch, 1)))
    decay = planned_decay(inputs, log_decay, g)
    as_given = used_as_given(inputs, *vectors, log_decay_as_given)
    fused = None
    if as_given:
        arrays = [q_t, k_t, v_t, a_t, b_t]
        arrays += [x for x in (log_decay if is_array(log_decay) else decay,) if x is not None]
        fused = fused_step_rows(q_t, batch, *(tuple(x.shape) for x in arrays))
    compiled = planned_compiled(
        "dplr", [q_t, k_t, v_t, a_t, b_t], log_decay, decay, state, (*batch, d_k, d_v),
        as_given=as_given, scale=scale,
    )  # fmt: skip
    plan = StepPlan(
        inputs, scale, (*batch, d_k, d_v), decay, (), as_given=as_given, fused_rows=fused,
        compiled=compiled,
    )  # fmt: skip
    return plan, None


def _run_step(
    plan: StepPlan,
    q_t: Array,
    k_t: Array,
    v_t: Array,
    a_t: Array,
    b_t: Array,
    state: Array | None,
    log_decay: Any,
    *,
    checked: None = None,
) -> tuple[Array, Array]:
    """:func:`dplr_delta_rule_step`'s arithmetic on arguments of the plan's signature."""
    done = run_compiled(plan, [q_t, k_t, v_t, a_t, b_t], log_decay, state)
    if done is not None:  # NumPy, PyTorch CPU: the kernel, prepared for this signature
        return done
    inputs = plan.inputs
    if plan.as_given:
        q, k, v, a, b = q_t, k_t, v_t, a_t, b_t
    else:
        keys = plan.state_shape[:-1]
        a, b = (_vector_values(inputs, x, keys) for x in (a_t, b_t))
        q, k, v = (inputs.to_work_dtype(x) for x in (q_t, k_t, v_t))
    if plan.scale != 1.0:
        q = q * plan.scale
    decay, S0 = step_decay(plan, log_decay), step_state(plan, state)
    fused = compiled_tokens("dplr", [q, k, v, a, b], decay, S0, step=True)  # NumPy, torch CPU
    if fused is None and plan.fused_rows is not None:  # PyTorch, a state per token row
        fused = fused_dplr_step(q, k, v, a, b, decay, S0, rows=plan.fused_rows)
    o_t, S = dplr_step(inputs.xp, q, k, v, a, b, decay, S0) if fused is None else fused
    return finish(inputs, o_t, None), S


def prepare_dplr_step(*, scale: float = 1.0) -> PreparedStep:
    """:func:`dplr_delta_rule_step` for a decoding loop: checked once, then arithmetic only.

    The returned function is called like :func:`dplr_delta_rule_step` without its options,
    ``prepared(q_t, k_t, v_t, a_t, b_t, state, log_decay=None)``, and returns the same
    ``(o_t, state)``, equal to the last bit. Its first call checks everything the plain step
    checks; later calls whose arrays have the same library, shape, dtype and device as the
    call before (and numbers of the same values) skip the checks (``docs/performance.md``,
    "Decoding"). Any other call is checked again: errors are the plain step's.

    Parameters
    ----------
    scale : float
        As in :func:`dplr_delta_rule_step`; checked at the first call.

    Returns
    -------
    PreparedStep
        A callable ``(q_t, k_t, v_t, a_t, b_t, state=None, /, *, log_decay=None)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import dplr_delta_rule, prepare_dplr_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> a, b, w = -kk, 0.5 * kk, np.full((10, 4), -0.3)
    >>> decode, state, outputs = prepare_dplr_step(), None, []
    >>> for t in range(10):
    ...     o_t, state = decode(q[t], k[t], v[t], a[t], b[t], state, log_decay=w[t])
    ...     outputs.append(o_t)
    >>> bool(np.allclose(np.stack(outputs), dplr_delta_rule(q, k, v, a, b, log_decay=w)))
    True
    """

    names = ("q_t", "k_t", "v_t", "a_t", "b_t", "state", "log_decay")
    return PreparedStep(
        partial(_plan_step, scale=scale), _run_step, name="dplr_delta_rule_step", names=names,
        required=5, positional_only=6, positional=6,
    )  # fmt: skip
