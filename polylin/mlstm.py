"""The mLSTM (xLSTM's matrix memory): entry points.

A linear attention with a scalar forget gate per token (a log sigmoid), an exponential input
gate on the keys, a normalizer state ``n`` and a max-stabilizer ``m`` that keeps every
exponential of the input gate <= 1. See ``docs/mlstm.md`` for the math and the chunked form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

from ._backend.namespace import is_array
from ._forms.mlstm.chunked import mlstm_chunked
from ._forms.mlstm.quadratic import mlstm_quadratic
from ._forms.mlstm.recurrent import mlstm_recurrent, mlstm_step_form
from ._inputs.arrays import broadcasts_to, check_beside, check_floating, check_known_shape
from ._inputs.defaults import DEFAULT_CHUNK_SIZE
from ._inputs.layout import DEFAULT_SEQ_AXIS, standard_layout
from ._inputs.prepare import finish
from ._inputs.sequences import check_scale, run_sequences
from ._inputs.steps import PlanCache, PreparedStep
from ._inputs.validation import (
    AttentionInputs,
    check_coefficient,
    check_flag,
    check_method,
    check_options,
    check_qkv,
    coefficient_values,
)
from ._typing import Array
from .activations import softplus

__all__ = [
    "MLSTM_EPS", "MLSTM_METHODS", "MLSTMState", "mlstm", "mlstm_step", "prepare_mlstm_step"
]  # fmt: skip

#: The algorithms of :func:`mlstm`; they compute the same function.
MLSTM_METHODS = ("chunked", "recurrent", "quadratic")

#: The default ``eps`` of :func:`mlstm`, xLSTM's: added to the stabilized normalizer.
MLSTM_EPS = 1e-6

#: Gate pre-activations given as numbers may be any finite real.
_ANY_REAL = (-math.inf, math.inf)


class MLSTMState(NamedTuple):
    """The state of an mLSTM after some prefix of a sequence, stored relative to ``m``.

    With the unstabilized memory ``C_true = sum_s exp(i_s + sum_{s<r<=t} log f_r) k_s v_s^T``
    (the initial state's contribution decayed alike) and ``n_true`` the same sum of the keys,
    the state holds ``C = exp(-m) C_true`` and ``n = exp(-m) n_true``, with ``m`` the running
    maximum that keeps every stored weight <= 1. The layout is xLSTM's (transformers'
    ``(c, n, m)`` triple); for 16-bit inputs the three are kept in float32. The zero state is
    ``C = 0, n = 0, m = 0``.

    Parameters
    ----------
    C : array
        The matrix memory, shape ``(..., d_k, d_v)``.
    n : array
        The normalizer, shape ``(..., d_k)``.
    m : array
        The stabilizer, shape ``(..., 1)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import MLSTMState, mlstm
    >>> q = k = np.zeros((2, 5, 3)); v = np.ones((2, 5, 4)); gate = np.zeros((2, 5, 1))
    >>> out, state = mlstm(q, k, v, gate, gate, return_state=True)
    >>> state.C.shape, state.n.shape, state.m.shape
    ((2, 3, 4), (2, 3), (2, 1))
    >>> isinstance(state, MLSTMState)
    True
    """

    C: Array
    n: Array
    m: Array


def _check_part(inputs: AttentionInputs, name: str, x: Any, shape: tuple, core: int) -> Any:
    """One part of a state: an array of the inputs' library and device in the work dtype whose
    leading dimensions broadcast to ``shape``'s (its last ``core`` axes equal): broadcast."""
    xp = inputs.xp
    check_beside(xp, inputs.device, name, x)
    check_floating(xp, name, x)
    if x.dtype != inputs.work_dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but inputs of dtype {inputs.dtype} are computed in "
            f"{inputs.work_dtype}; pass a state of that dtype (the one polylin returns)"
        )
    check_known_shape(name, x)
    got = tuple(x.shape)
    if got == shape:
        return x
    if not broadcasts_to(got, shape, core):
        raise ValueError(
            f"{name} must have shape {shape} (leading axes of size 1 broadcast), got {got}"
        )
    return xp.broadcast_to(x, shape)


def _check_state(
    inputs: AttentionInputs, state: Any, lead: tuple, d_k: int, d_v: int, name: str
) -> MLSTMState:
    """An :class:`MLSTMState` (or any ``(C, n, m)`` triple) checked and broadcast to ``lead``;
    zeros for ``None``."""
    xp = inputs.xp
    shapes = ((*lead, d_k, d_v), (*lead, d_k), (*lead, 1))
    if state is None:
        return MLSTMState(*(
            xp.zeros(s, dtype=inputs.work_dtype, device=inputs.device) for s in shapes
        ))  # fmt: skip
    if not isinstance(state, tuple) or len(state) != 3:
        raise TypeError(
            f"{name} must be an MLSTMState or a (C, n, m) triple of arrays of shapes {shapes}, "
            f"got {type(state).__name__}"
        )
    return MLSTMState(*(
        _check_part(inputs, f"{name}.{part}", x, shape, core)
        for part, x, shape, core in zip("Cnm", state, shapes, (2, 1, 1))
    ))  # fmt: skip


def _scale(scale: Any, d_k: int) -> float:
    return d_k**-0.5 if scale is None else check_scale(scale)


def _log_forget(f: Any) -> Any:
    """``log sigmoid(f) = -softplus(-f)``, <= 0, accurate at both ends."""
    return -softplus(-f)


def _algorithm(xp: Any, *, method: str, chunk_size: int, scale: float, eps: float) -> Any:
    """The form that ``method`` names, on the arrays ``[q, k, v, i_gate, f_gate]``."""

    def algorithm(arrays: list[Any], state: MLSTMState, keep: Any) -> tuple[Any, MLSTMState]:
        q, k, v, i, f = arrays
        g = _log_forget(f)
        if keep is not None:  # a masked token neither forgets (g = 0) nor writes (i = -inf)
            g = xp.where(keep, g, 0.0)
            i = xp.where(keep, i, -math.inf)
        if scale != 1.0:
            q = q * scale
        parts = tuple(state)
        if method == "chunked":
            out, parts = mlstm_chunked(xp, q, k, v, g, i, parts, chunk_size=chunk_size, eps=eps)
        elif method == "recurrent":
            out, parts = mlstm_recurrent(xp, q, k, v, g, i, parts, eps=eps)
        else:
            out, parts = mlstm_quadratic(xp, q, k, v, g, i, parts, eps=eps)
        return out, MLSTMState(*parts)

    return algorithm


def mlstm(
    q: Array,
    k: Array,
    v: Array,
    i_gate: Array,
    f_gate: Array,
    /,
    *,
    scale: float | None = None,
    eps: float = MLSTM_EPS,
    method: str = "chunked",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: MLSTMState | tuple[Array, Array, Array] | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
) -> Any:
    r"""The mLSTM of xLSTM: gated linear attention with an exponential input gate, stabilized.

    With the log forget gate ``g_t = log sigmoid(f_t)``, the log input gate ``i_t`` and the
    stabilizer ``m_t = max(g_t + m_{t-1}, i_t)``::

        C_t = exp(g_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T     (n_t alike, k_t)
        h_t = C_t^T q'_t / (max(|n_t . q'_t|, exp(-m_t)) + eps),   q'_t = scale * q_t

    exactly as transformers' ``xLSTMForCausalLM`` computes it (the zero state has ``m = 0``).
    Every exponential is of a number <= 0, whatever the input gates (see the docs page "The
    mLSTM"). Every method computes the same function (to round-off).

    Parameters
    ----------
    q, k : array
        Queries and keys, shape ``(..., T, d_k)``, any number of leading batch/head dimensions.
    v : array
        Values, shape ``(..., T, d_v)``, the same dtype; the leading dimensions broadcast.
    i_gate : float or array
        The input gate's pre-activation (its log: the gate is ``exp(i_gate)``), any real: an
        array of the dtype of ``q`` broadcastable to ``(..., T, 1)`` (xLSTM's ``(B, H, T)``
        gates are ``i_gate[..., None]``), or a number.
    f_gate : float or array
        The forget gate's pre-activation (the gate is ``sigmoid(f_gate)``), the same shapes.
    scale : float, optional
        Multiplies the queries; ``None`` is ``d_k ** -0.5`` (xLSTM's).
    eps : float
        Added to the stabilized normalizer ``max(|n_t . q'_t|, exp(-m_t))``; xLSTM's ``1e-6``.
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: batched matmuls within chunks and a stabilized prefix of states across
        them, O(T C d + T d_k d_v). ``"recurrent"``: one state update per token.
        ``"quadratic"``: the parallel form over the whole sequence, O(T^2) time and memory.
    chunk_size : int
        Chunk length C of the chunked form (T need not be a multiple of it).
    initial_state : MLSTMState or (C, n, m), optional
        The state to continue from (see :class:`MLSTMState`); its leading dimensions may
        broadcast. With ``cu_seqlens`` one per sequence: leading ``(..., N)``.
    return_state : bool
        Also return the :class:`MLSTMState` after the last token.
    attention_mask : array of bool, optional
        True for real tokens: ``(batch, T)`` or the shape of ``q`` without its feature axis. A
        masked token neither forgets nor writes (the state, ``m`` included, is left exactly as
        it was), its output is 0 and its inputs are never read (they may be NaN).
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis;
        each starts from its own state.
    seq_axis : int
        The axis of T in ``q``, ``k`` and ``v`` (default -2); gate arrays then have the rank
        of ``q`` with T on the same axis.

    Returns
    -------
    array or (array, MLSTMState)
        The output ``h``, shape ``(..., T, d_v)``, same library, device and dtype as ``q``;
        with ``return_state`` also the final state (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a gate array of another dtype
        than ``q``, a state that is not a ``(C, n, m)`` triple in the work dtype.
    ValueError
        Mismatched shapes or devices, an unknown method, ``chunk_size < 1``, ``eps <= 0``, a
        non-finite number for a gate or ``scale``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import mlstm
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 40, 8))
    >>> i_gate = 10.0 * rng.standard_normal((2, 40, 1))  # strong input gates: exp(30) and more
    >>> f_gate = rng.standard_normal((2, 40, 1)) + 3.0
    >>> out, state = mlstm(q, k, v, i_gate, f_gate, chunk_size=16, return_state=True)
    >>> ref = mlstm(q, k, v, i_gate, f_gate, method="recurrent")
    >>> bool(np.allclose(out, ref)), state.C.shape, state.m.shape
    (True, (2, 8, 8), (2, 1))
    """
    layout, q, k, v = standard_layout(seq_axis, q=q, k=k, v=v)
    inputs = check_qkv(q, k, v, causal=True)
    options = check_options(eps=eps, chunk_size=chunk_size, inputs=inputs)
    eps, chunk_size = options.eps, int(chunk_size)
    check_method(method, MLSTM_METHODS)
    check_flag("return_state", return_state)
    batch, T, d_k, d_v = inputs.batch_shape, q.shape[-2], k.shape[-1], v.shape[-1]
    scale = _scale(scale, d_k)
    per_token = (*batch, T, 1)
    arrays = [inputs.to_work_dtype(x) for x in (q, k, v)]
    for name, gate in (("i_gate", i_gate), ("f_gate", f_gate)):
        gate = layout.per_token_to_standard(name, gate)
        arrays.append(
            check_coefficient(inputs, gate, per_token, name=name, bounds=_ANY_REAL, layout=layout)
        )

    def check_state(initial_state: Any, lead: tuple) -> MLSTMState:
        return _check_state(inputs, initial_state, lead, d_k, d_v, "initial_state")

    algorithm = _algorithm(inputs.xp, method=method, chunk_size=chunk_size, scale=scale, eps=eps)
    return run_sequences(
        inputs,
        layout,
        arrays,
        algorithm,
        length=T,
        check_state=check_state,
        initial_state=initial_state,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
    )


def mlstm_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    i_t: Array,
    f_t: Array,
    state: MLSTMState | tuple[Array, Array, Array] | None = None,
    /,
    *,
    scale: float | None = None,
    eps: float = MLSTM_EPS,
) -> tuple[Array, MLSTMState]:
    """One token of the mLSTM: update the state with ``(k_t, v_t)`` and read it with ``q_t``.

    Cost and memory are O(d_k d_v) whatever the position. A state returned by :func:`mlstm`
    (e.g. after a chunked prefill) continues here exactly, and the other way round.

    Parameters
    ----------
    q_t, k_t : array
        Query and key of the new token, shape ``(..., d_k)``.
    v_t : array
        Value of the new token, shape ``(..., d_v)``.
    i_t, f_t : float or array
        The input and forget gates' pre-activations: arrays of the dtype of ``q_t``
        broadcastable to ``(..., 1)`` (xLSTM's step layout), or numbers.
    state : MLSTMState or (C, n, m), optional
        The state before this token; ``None`` starts from the zero state.
    scale : float, optional
        Multiplies the query; ``None`` is ``d_k ** -0.5``.
    eps : float
        Added to the stabilized normalizer, as in :func:`mlstm`.

    Returns
    -------
    h_t : array
        Shape ``(..., d_v)``, same library, device and dtype as ``q_t``.
    state : MLSTMState
        The state after this token (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a state that is not a
        ``(C, n, m)`` triple in the work dtype.
    ValueError
        Mismatched shapes or devices, ``eps <= 0``, a non-finite number.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import mlstm, mlstm_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> i_gate, f_gate = rng.standard_normal((2, 10, 1))
    >>> prompt, state = mlstm(q[:6], k[:6], v[:6], i_gate[:6], f_gate[:6], return_state=True)
    >>> outputs = []
    >>> for t in range(6, 10):
    ...     h_t, state = mlstm_step(q[t], k[t], v[t], i_gate[t], f_gate[t], state)
    ...     outputs.append(h_t)
    >>> whole = mlstm(q, k, v, i_gate, f_gate)
    >>> bool(np.allclose(np.stack(outputs), whole[6:]))
    True
    """
    args = (q_t, k_t, v_t, i_t, f_t, state)
    plan, _ = _PLANS.plan(partial(_plan_step, scale=scale, eps=eps), args, (scale, eps))
    return _run_step(plan, *args)


#: :func:`mlstm_step`'s checks run once per signature of its arguments and options.
_PLANS = PlanCache()


class _StepPlan(NamedTuple):
    """What :func:`mlstm_step`'s checks found, for one signature of its arguments."""

    inputs: AttentionInputs
    scale: float
    eps: float
    gates: tuple  # (i, log sigmoid(f)) of numbers (converted once); None for an array
    state_shapes: tuple  # the shapes of (C, n, m), broadcast to the batch


def _plan_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    i_t: Any,
    f_t: Any,
    state: Any,
    *,
    scale: Any,
    eps: Any,
) -> tuple[_StepPlan, None]:
    """Check every argument of :func:`mlstm_step` (the ``plan`` of its
    :class:`~polylin.PreparedStep`)."""
    inputs = check_qkv(q_t, k_t, v_t, causal=True, single_token=True)
    eps, _ = check_options(eps=eps, inputs=inputs)
    batch, d_k, d_v = inputs.batch_shape, k_t.shape[-1], v_t.shape[-1]
    scale = _scale(scale, d_k)
    i, f = (
        check_coefficient(inputs, x, (*batch, 1), name=name, bounds=_ANY_REAL)
        for name, x in (("i_t", i_t), ("f_t", f_t))
    )
    checked = _check_state(inputs, state, batch, d_k, d_v, "state")
    gates = (None if is_array(i_t) else i, None if is_array(f_t) else _log_forget(f))
    shapes = tuple(tuple(part.shape) for part in checked)
    return _StepPlan(inputs, scale, eps, gates, shapes), None


def _run_step(
    plan: _StepPlan,
    q_t: Array,
    k_t: Array,
    v_t: Array,
    i_t: Any,
    f_t: Any,
    state: Any,
    *,
    checked: None = None,
) -> tuple[Array, MLSTMState]:
    """:func:`mlstm_step`'s arithmetic on arguments of the plan's signature."""
    inputs = plan.inputs
    xp = inputs.xp
    gate_shape = plan.state_shapes[2]
    i, g = plan.gates
    if i is None:
        i = coefficient_values(inputs, i_t, gate_shape)
    if g is None:
        g = _log_forget(coefficient_values(inputs, f_t, gate_shape))
    if state is None:
        parts = tuple(
            xp.zeros(shape, dtype=inputs.work_dtype, device=inputs.device)
            for shape in plan.state_shapes
        )
    else:
        parts = tuple(
            x if tuple(x.shape) == shape else xp.broadcast_to(x, shape)
            for x, shape in zip(state, plan.state_shapes)
        )
    q, k, v = (inputs.to_work_dtype(x) for x in (q_t, k_t, v_t))
    if plan.scale != 1.0:
        q = q * plan.scale
    h, new = mlstm_step_form(xp, q, k, v, g, i, parts, eps=plan.eps)
    return finish(inputs, h, None), MLSTMState(*new)


def prepare_mlstm_step(*, scale: float | None = None, eps: float = MLSTM_EPS) -> PreparedStep:
    """:func:`mlstm_step` for a decoding loop: arguments checked once, then arithmetic only.

    The returned function is called like :func:`mlstm_step` without its options,
    ``prepared(q_t, k_t, v_t, i_t, f_t, state=None)``, and returns the same ``(h_t, state)``,
    equal to the last bit. Its first call checks everything :func:`mlstm_step` checks; later
    calls whose arrays have the same library, shape, dtype and device as the call before (and
    numbers of the same values) skip the checks, and gates given as numbers are converted
    once. Any other call is checked again: errors are :func:`mlstm_step`'s.

    Parameters
    ----------
    scale : float, optional
        As in :func:`mlstm_step`; checked at the first call.
    eps : float
        As in :func:`mlstm_step`; checked at the first call.

    Returns
    -------
    PreparedStep
        A callable ``(q_t, k_t, v_t, i_t, f_t, state=None, /)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import mlstm, prepare_mlstm_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 10, 4))
    >>> i_gate, f_gate = rng.standard_normal((2, 10, 1))
    >>> prompt, state = mlstm(q[:6], k[:6], v[:6], i_gate[:6], f_gate[:6], return_state=True)
    >>> decode, outputs = prepare_mlstm_step(), []
    >>> for t in range(6, 10):
    ...     h_t, state = decode(q[t], k[t], v[t], i_gate[t], f_gate[t], state)
    ...     outputs.append(h_t)
    >>> bool(np.allclose(np.stack(outputs), mlstm(q, k, v, i_gate, f_gate)[6:]))
    True
    """
    names = ("q_t", "k_t", "v_t", "i_t", "f_t", "state")
    return PreparedStep(
        partial(_plan_step, scale=scale, eps=eps), _run_step, name="mlstm_step", names=names,
        required=5, positional_only=6, positional=6,
    )  # fmt: skip
