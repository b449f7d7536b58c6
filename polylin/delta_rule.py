"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet): entry points.

Plain linear attention only adds to its state; the delta rule first reads what the state
recalls for the new key and writes only the correction, so a key written again replaces its
old value instead of piling up. See ``docs/delta_rule.md`` for the math and the chunked form.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from ._backend.compiled import compiled_tokens
from ._backend.fused import fused_delta_step, fused_step_rows
from ._backend.namespace import is_array
from ._backend.ops import l2_normalize
from ._forms.delta.chunked import delta_chunked
from ._forms.delta.quadratic import delta_quadratic
from ._forms.delta.recurrent import delta_recurrent, delta_step
from ._inputs.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_EPS
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
    check_coefficient,
    check_flag,
    check_matrix_state,
    check_method,
    check_options,
    check_qkv,
    coefficient_values,
)
from ._typing import Array

__all__ = [
    "DELTA_METHODS",
    "delta_rule_attention",
    "delta_rule_step",
    "prepare_delta_rule_step",
]

#: The algorithms of :func:`delta_rule_attention`; they compute the same function.
DELTA_METHODS = ("chunked", "recurrent", "quadratic")

#: Python-float ``beta`` must lie here: for a unit key each step then shrinks the state
#: (eigenvalue ``1 - beta`` along the key), the condition for a stable recurrence.
_BETA_BOUNDS = (0.0, 2.0)


def _check_scale_and_norm(scale: Any, qk_l2norm: Any) -> float:
    """``scale`` must be a finite real number, ``qk_l2norm`` a bool (a traced one says how to
    keep it static); returns ``float(scale)``."""
    scale = check_scale(scale)
    check_flag("qk_l2norm", qk_l2norm)
    return scale


def _algorithm(xp: Any, *, method: str, chunk_size: int, scale: float, qk_l2norm: bool) -> Any:
    """The form that ``method`` names, on the arrays ``[q, k, v, beta(, log_decay)]``, its
    output scaled."""

    def algorithm(arrays: list[Any], S: Any, keep: Any) -> tuple[Any, Any]:
        q, k, v, beta, *rest = arrays
        g = rest[0] if rest else None
        if method == "chunked":  # normalizes and scales q block by block (delta_chunked)
            return delta_chunked(
                xp, q, k, v, beta, g, S, chunk_size=chunk_size, qk_l2norm=qk_l2norm, scale=scale
            )
        if qk_l2norm:
            q, k = l2_normalize(xp, q), l2_normalize(xp, k)
        if method == "recurrent":  # scales the output itself (on the loop's arrays)
            return delta_recurrent(xp, q, k, v, beta, g, S, scale=scale)
        out, S = delta_quadratic(xp, q, k, v, beta, g, S)
        if scale != 1.0:  # o_t = S_t^T (scale q_t) = scale (S_t^T q_t); the state is unchanged
            out = out * scale
        return out, S

    return algorithm


def delta_rule_attention(
    q: Array,
    k: Array,
    v: Array,
    beta: Array,
    /,
    *,
    log_decay: Array | None = None,
    scale: float = 1.0,
    qk_l2norm: bool = False,
    method: str = "chunked",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: Array | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Array:
    r"""The (gated) delta rule: ``S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T``.

    ``S'_t = diag(exp(log_decay_t)) S_{t-1}`` (``S_{t-1}`` without decay: DeltaNet; a gate per
    token: Gated DeltaNet; a gate per key channel: Kimi Delta Attention) and the output is
    ``o_t = scale * S_t^T q_t``. Each token reads what the state recalls for its key and writes
    only the correction, scaled by the learning rate ``beta_t``. There is no feature map and no
    normalizer: ``q`` and ``k`` are used as given, or L2-normalized with ``qk_l2norm`` (see the
    docs page "The delta rule"). Every method computes the same function (to round-off).

    Parameters
    ----------
    q, k : array
        Queries and keys, shape ``(..., T, d_k)``, any number of leading batch/head dimensions.
        Keep ``beta_t * |k_t|^2 <= 2`` (e.g. unit keys), or the recurrence itself is unstable.
    v : array
        Values, shape ``(..., T, d_v)``, the same dtype. The leading dimensions of ``q``, ``k``,
        ``v`` (and of ``beta``, ``log_decay``, the mask and the state) broadcast: grouped heads
        are ``q, k`` of ``(B, H, 1, T, d_k)`` and ``v`` of ``(B, H, G, T, d_v)``, computed
        without copying ``q`` or ``k`` per group.
    beta : float or array
        The learning rate per token: a number in ``[0, 2]`` (usually in ``(0, 1]``; Python or
        NumPy scalar) or an array of the dtype of ``q`` broadcastable to ``(..., T, 1)``, whose
        values are used as given (outside ``[0, 2]`` the recurrence itself is unstable, in
        every method alike).
    log_decay : float or array, optional
        ``log a_t <= 0``: ``None`` (no decay), a number, or a real floating array
        broadcastable to ``(..., T, 1)`` (one gate per token, e.g. ``-softplus(x)``) or to
        ``(..., T, d_k)`` (one gate per key channel). A decay never amplifies the state: a
        number must be finite and ``<= 0`` (else a ``ValueError``), array values above 0 are
        taken as 0 (the policy of every entry point; see the docs page "Numerics and
        non-finite values"); an array value of ``-inf`` resets the state.
    scale : float
        Multiplies the (normalized) queries: ``o_t = scale * S_t^T q_t`` (models use
        ``d_k ** -0.5``). A finite real number.
    qk_l2norm : bool
        Normalize ``q`` and ``k`` inside the call, ``x / sqrt(sum(x^2) + 1e-6)``
        (flash-linear-attention's ``use_qk_l2norm_in_kernel``), differentiably.
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: the parallel chunkwise (WY) form, O(T C d + T d_k d_v) in batched
        matmuls. ``"recurrent"``: one state update per token (the reference for the state).
        ``"quadratic"``: the exact masked parallel form, O(T^2 d_k) time and memory.
    chunk_size : int
        Chunk length C of the chunked form (T need not be a multiple of it); rounded up to a
        power of two. On PyTorch CUDA and CuPy at least 256 (each chunk is a sequential step of
        kernel launches there; see the page "GPU"); on one CPU thread (NumPy, PyTorch with one
        thread) and under ``jax.jit`` on the CPU at most 32 for keys of up to 128 channels
        (shorter chunks save more products than their extra steps cost there); the results
        agree to round-off whatever C.
    initial_state : array, optional
        The state ``S`` to continue from, shape ``(..., d_k, d_v)``; one returned by either
        method, or one whose leading dimensions broadcast (a state shared by a batch or by
        heads). With ``cu_seqlens`` there is one per sequence: ``(..., N, d_k, d_v)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        True for real tokens: a 2-D ``(batch, T)`` mask (the first leading axis and the time
        axis), or the shape of ``q`` without its feature axis (size-1 axes broadcast), as for
        :func:`~polylin.causal_linear_attention`. A masked token neither writes to nor decays
        the state, and its output is 0; its inputs are never read (they may be NaN).
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis;
        each starts from its own state.
    seq_axis : int
        The axis of T in ``q``, ``k`` and ``v`` (default -2: ``(..., T, d)``); ``seq_axis=1``
        takes ``(batch, T, heads, d)``, and then ``beta`` and ``log_decay`` arrays are
        ``(batch, T, heads, 1)`` (the rank of ``q``). The output keeps the input layout; the
        state's leading dimensions are the inputs' without T and the feature axis.

    Returns
    -------
    array or (array, array)
        The output, shape ``(..., T, d_v)``, same library, device and dtype as ``q``; with
        ``return_state`` also the final state ``S`` (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a ``beta`` array of another dtype
        than ``q`` (a ``log_decay`` array may have any floating dtype: it is cast), a state that
        is not one array or not in the work dtype, ``scale`` not a real number, ``qk_l2norm``
        not a bool.
    ValueError
        Mismatched shapes or devices, an unknown method, ``chunk_size < 1``, a float ``beta``
        outside ``[0, 2]`` or ``log_decay > 0``, a non-finite ``scale``.

    Examples
    --------
    A key written twice: the delta rule recalls the last value, not the sum of both.

    >>> import numpy as np
    >>> from polylin import delta_rule_attention
    >>> k = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])  # the same unit key three times
    >>> v = np.array([[5.0], [7.0], [7.0]])
    >>> q = k  # read with that key
    >>> delta_rule_attention(q, k, v, 1.0)
    array([[5.],
           [7.],
           [7.]])

    The chunked form equals the per-token recurrence, with a decay too:

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 40, 8))
    >>> k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> beta = rng.uniform(0.1, 1.0, (2, 40, 1))
    >>> out, state = delta_rule_attention(q, k, v, beta, log_decay=-0.1, return_state=True)
    >>> ref = delta_rule_attention(q, k, v, beta, log_decay=-0.1, method="recurrent")
    >>> bool(np.allclose(out, ref)), state.shape
    (True, (2, 8, 8))
    """
    layout, q, k, v = standard_layout(seq_axis, q=q, k=k, v=v)
    inputs = check_qkv(q, k, v, causal=True)
    check_options(eps=DEFAULT_EPS, chunk_size=chunk_size)  # an Integral >= 1, not a tracer
    chunk_size = int(chunk_size)
    check_method(method, DELTA_METHODS)
    scale = _check_scale_and_norm(scale, qk_l2norm)
    beta = layout.per_token_to_standard("beta", beta)
    log_decay = standard_log_decay(layout, log_decay)
    xp = inputs.xp
    batch, T, d_k, d_v = inputs.batch_shape, q.shape[-2], k.shape[-1], v.shape[-1]
    per_token = (*batch, T, 1)
    arrays = [inputs.to_work_dtype(x) for x in (q, k, v)]
    check_flag("return_state", return_state)
    arrays.append(
        check_coefficient(inputs, beta, per_token, name="beta", bounds=_BETA_BOUNDS, layout=layout)
    )
    g = shaped_log_decay(  # the recurrent form takes values above 0 as 0 itself
        inputs, log_decay, per_token, channels=d_k, layout=layout, clamp=method != "recurrent"
    )
    if g is not None:
        arrays.append(g)
    # A masked token has every input selected to 0: beta = 0 (it writes nothing) and log decay
    # 0 (it does not decay the state).
    algorithm = _algorithm(
        xp, method=method, chunk_size=chunk_size, scale=scale, qk_l2norm=qk_l2norm
    )
    return run_sequences(
        inputs,
        layout,
        arrays,
        algorithm,
        length=T,
        state_shape=(d_k, d_v),
        initial_state=initial_state,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
    )


def delta_rule_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    beta_t: Array,
    state: Array | None = None,
    /,
    *,
    log_decay: Array | None = None,
    scale: float = 1.0,
    qk_l2norm: bool = False,
) -> tuple[Array, Array]:
    """One token of the (gated) delta rule: update the state with ``(k_t, v_t)``, read with ``q_t``.

    Cost and memory are O(d_k d_v) whatever the position. A state returned by
    :func:`delta_rule_attention` (e.g. after a chunked prefill) continues here exactly.

    Parameters
    ----------
    q_t, k_t : array
        Query and key of the new token, shape ``(..., d_k)``.
    v_t : array
        Value of the new token, shape ``(..., d_v)``.
    beta_t : float or array
        Learning rate: a Python float in ``[0, 2]`` or an array of the dtype of ``q_t``
        broadcastable to ``(..., 1)``.
    state : array, optional
        The state ``S`` before this token, shape ``(..., d_k, d_v)`` (its leading dimensions
        may broadcast); ``None`` starts from zeros.
    log_decay : float or array, optional
        ``log a_t <= 0`` of this token: ``None``, a number, or an array broadcastable to
        ``(..., 1)`` (one gate) or ``(..., d_k)`` (one per key channel); a number must be
        finite and ``<= 0``, array values above 0 are taken as 0, an array value of ``-inf``
        resets the state.
    scale : float
        Multiplies the (normalized) query: ``o_t = scale * S_t^T q_t``.
    qk_l2norm : bool
        Normalize ``q_t`` and ``k_t`` as ``x / sqrt(sum(x^2) + 1e-6)`` first.

    Returns
    -------
    o_t : array
        Shape ``(..., d_v)``, same library, device and dtype as ``q_t``.
    state : array
        The state after this token (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state that is not one array,
        ``scale`` not a real number, ``qk_l2norm`` not a bool.
    ValueError
        Mismatched shapes or devices, a float ``beta_t`` outside ``[0, 2]``, ``log_decay > 0``,
        a non-finite ``scale``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import delta_rule_attention, delta_rule_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> prompt, state = delta_rule_attention(q[:6], k[:6], v[:6], 0.5, return_state=True)
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     o_t, state = delta_rule_step(q[t], k[t], v[t], 0.5, state)
    ...     outputs.append(o_t)
    >>> whole = delta_rule_attention(q, k, v, 0.5)
    >>> bool(np.allclose(np.stack(outputs), whole[6:]))
    True
    """
    args = (q_t, k_t, v_t, beta_t, state, log_decay)
    plan = _PLANS.plan(
        partial(_plan_step, scale=scale, qk_l2norm=qk_l2norm), args, (scale, qk_l2norm)
    )
    return _run_step(plan[0], *args)


#: :func:`delta_rule_step`'s checks run once per signature of its arguments and options.
_PLANS = PlanCache()


def _plan_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    beta_t: Any,
    state: Array | None,
    log_decay: Any,
    *,
    scale: Any,
    qk_l2norm: Any,
) -> tuple[StepPlan, None]:
    """Check every argument of :func:`delta_rule_step` (the ``plan`` of its
    :class:`~polylin.PreparedStep`)."""
    inputs = check_qkv(q_t, k_t, v_t, causal=True, single_token=True)
    batch, d_k, d_v = inputs.batch_shape, k_t.shape[-1], v_t.shape[-1]
    beta = check_coefficient(inputs, beta_t, (*batch, 1), name="beta_t", bounds=_BETA_BOUNDS)
    g = shaped_log_decay(inputs, log_decay, (*batch, 1), channels=d_k)
    scale = _check_scale_and_norm(scale, qk_l2norm)
    token_shape = tuple(q_t.shape)
    check_matrix_state(inputs, state, (*batch, d_k, d_v), name="state", token_shape=token_shape)
    per_token = (*batch, 1)
    as_given = used_as_given(
        inputs, (beta_t, per_token), (log_decay, log_decay_shape(log_decay, per_token))
    )
    decay = planned_decay(inputs, log_decay, g)
    fused = None
    if as_given:
        arrays = [q_t, k_t, v_t, beta_t if is_array(beta_t) else beta]
        arrays += [x for x in (log_decay if is_array(log_decay) else decay,) if x is not None]
        fused = fused_step_rows(q_t, batch, *(tuple(x.shape) for x in arrays))
    beta_given = beta_t if is_array(beta_t) else beta
    compiled = planned_compiled(
        "delta", [q_t, k_t, v_t, beta_given], log_decay, decay, state, (*batch, d_k, d_v),
        as_given=as_given, scale=scale, scale_output=True, l2norm=qk_l2norm,
    )  # fmt: skip
    plan = StepPlan(
        inputs,
        scale,
        (*batch, d_k, d_v),
        decay,
        (None if is_array(beta_t) else beta,),
        qk_l2norm,
        as_given,
        fused,
        compiled,
    )
    return plan, None


def _run_step(
    plan: StepPlan,
    q_t: Array,
    k_t: Array,
    v_t: Array,
    beta_t: Any,
    state: Array | None,
    log_decay: Any,
    *,
    checked: None = None,
) -> tuple[Array, Array]:
    """:func:`delta_rule_step`'s arithmetic on arguments of the plan's signature."""
    inputs = plan.inputs
    xp = inputs.xp
    (beta,) = plan.coefficients
    done = run_compiled(plan, [q_t, k_t, v_t, beta_t if beta is None else beta], log_decay, state)
    if done is not None:  # NumPy, PyTorch CPU: the kernel, prepared for this signature
        return done
    if plan.as_given:
        q, k, v = q_t, k_t, v_t
        if beta is None:
            beta = beta_t
    else:
        if beta is None:
            beta = coefficient_values(inputs, beta_t, (*plan.state_shape[:-2], 1))
        q, k, v = (inputs.to_work_dtype(x) for x in (q_t, k_t, v_t))
    if plan.qk_l2norm:
        q, k = l2_normalize(xp, q), l2_normalize(xp, k)
    decay, S0 = step_decay(plan, log_decay), step_state(plan, state)
    fused = compiled_tokens("delta", [q, k, v, beta], decay, S0, step=True)  # NumPy, torch CPU
    if fused is None and plan.fused_rows is not None:  # PyTorch, a state per token row
        fused = fused_delta_step(q, k, v, beta, decay, S0, rows=plan.fused_rows)
    o_t, S = delta_step(xp, q, k, v, beta, decay, S0) if fused is None else fused
    if plan.scale != 1.0:
        o_t = o_t * plan.scale
    return finish(inputs, o_t, None), S


def prepare_delta_rule_step(
    *, scale: float = 1.0, qk_l2norm: bool = False
) -> PreparedStep:
    """:func:`delta_rule_step` for a decoding loop: arguments checked once, then arithmetic only.

    The returned function is called like :func:`delta_rule_step` without its options,
    ``prepared(q_t, k_t, v_t, beta_t, state, log_decay=None)``, and returns the same
    ``(o_t, state)``, equal to the last bit. Its first call checks everything
    :func:`delta_rule_step` checks; later calls whose arrays have the same library, shape,
    dtype and device as the call before (and numbers of the same values) skip the checks
    (``docs/performance.md``, "Decoding"). Any other call is checked again: errors are
    :func:`delta_rule_step`'s.

    Parameters
    ----------
    scale : float
        As in :func:`delta_rule_step`; checked at the first call.
    qk_l2norm : bool
        As in :func:`delta_rule_step`; checked at the first call.

    Returns
    -------
    PreparedStep
        A callable ``(q_t, k_t, v_t, beta_t, state=None, /, *, log_decay=None)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import delta_rule_attention, prepare_delta_rule_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> g = -0.1
    >>> prompt, state = delta_rule_attention(
    ...     q[:6], k[:6], v[:6], 0.5, log_decay=g, return_state=True
    ... )
    >>> decode = prepare_delta_rule_step()
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     o_t, state = decode(q[t], k[t], v[t], 0.5, state, log_decay=g)
    ...     outputs.append(o_t)
    >>> whole = delta_rule_attention(q, k, v, 0.5, log_decay=g)
    >>> bool(np.allclose(np.stack(outputs), whole[6:]))
    True
    """

    plan = partial(_plan_step, scale=scale, qk_l2norm=qk_l2norm)
    names = ("q_t", "k_t", "v_t", "beta_t", "state", "log_decay")
    return PreparedStep(
        plan, _run_step, name="delta_rule_step", names=names, required=4, positional_only=5,
        positional=5,
    )  # fmt: skip
