"""fla's ``ops.gdn2``: Gated DeltaNet 2, channel-wise erase and write gates.

``S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T``,
``o_t = scale S_t^T q_t``, with ``b`` an erase gate per key channel and ``w`` a write gate per
value channel (``b = w = beta`` is KDA). Expanded, the transition is
``Diag(exp(g_t)) - k_t (b_t * k_t * exp(g_t))^T``: a diagonal plus a rank-one term that reads
the state before the decay, one :func:`polylin.dplr_delta_rule` call with
``a = -(b * k * exp(g))``, ``b = k`` and the values ``w * v``.
"""

from __future__ import annotations

from typing import Any

from ...interop import Array, array_namespace
from ._args import check_inputs, pop_chunk_size, reject, reject_head_first, state_v_first_alias
from ._docs import fla_doc
from ._families import Result, dplr_family, static_flags

__all__ = ["chunk_gdn2", "fused_recurrent_gdn2"]

#: fla's ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x ** 2) + 1e-6)``.
L2NORM_EPS = 1e-6


def _gdn2(
    op: str,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    b: Any,
    w: Any,
    *,
    scale: float | None,
    initial_state: Any,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any,
    method: str,
    chunk_size: int = 64,
) -> Result:
    static_flags(
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
    )
    xp = array_namespace(q)
    for name, x, like in (("g", g, k), ("b", b, k), ("w", w, v)):
        if tuple(x.shape) != tuple(like.shape):
            raise ValueError(
                f"{op}: `{name}` must have shape {tuple(like.shape)} (that of "
                f"`{'k' if like is k else 'v'}`), got {tuple(x.shape)}"
            )
    if use_qk_l2norm_in_kernel:
        q, k = (x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS) for x in (q, k))
    a = -(b * k * xp.exp(g))
    return dplr_family(
        q, k, w * v, a, k, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, method=method, chunk_size=chunk_size, gate_name="g",
    )  # fmt: skip


@fla_doc
def chunk_gdn2(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    b: Array,
    w: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cp_context: Any | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_gdn2`` (Gated DeltaNet 2).

    ``S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T``,
    ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_h>
    g : array
        Log decay per token, head and key channel, ``(B, T, H, K)``.
    b : array
        Erase gate per key channel, ``(B, T, H, K)``.
    w : array
        Write gate per value channel, ``(B, T, H, V)``.
    <scale>
    <initial_state_h>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        The in-kernel gate activation of fla: not supported (``NotImplementedError``;
        compute ``g`` first).
    <cu_seqlens>
    <cu_seqlens_cpu>
    <safe_gate>
    lower_bound : float, optional
        A speed hint of fla's kernels (the gate's bound): accepted, ignored.
    <disable_recompute>
    return_intermediate_states : bool
        Not supported (``NotImplementedError`` when True).
    state_v_first : bool
        The ``(V, K)`` state layout: not supported (``NotImplementedError`` when True).
    <cp_context>
    **kwargs
        ``chunk_size`` (64, as fla requires); ``transpose_state_layout`` is the deprecated
        ``state_v_first``; ``head_first`` raises fla's ``DeprecationWarning``; any other
        keyword (``A_log``, ``dt_bias``) raises ``NotImplementedError``.

    Returns
    -------
    <o_h>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_gdn2, fused_recurrent_gdn2
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> b, w = rng.uniform(0, 1, (2, 1, 8, 2, 4))
    >>> o, S = chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, output_final_state=True)
    >>> o_r, _ = fused_recurrent_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True)
    >>> bool(np.allclose(o, o_r)), S.shape
    (True, (1, 2, 4, 4))
    """
    op = "chunk_gdn2"
    check_inputs(
        op, q=q, k=k, v=v, g=g, b=b, w=w, scale=scale, initial_state=initial_state
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size(op, kwargs, (64,))
    reject(
        op, kwargs, use_gate_in_kernel=(use_gate_in_kernel, False),
        return_intermediate_states=(return_intermediate_states, False),
        state_v_first=(state_v_first, False), cp_context=(cp_context, None),
    )  # fmt: skip
    return _gdn2(
        op, q, k, v, g, b, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, method="chunked",
        chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_gdn2(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    b: Array,
    w: Array,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_gdn2``: :func:`chunk_gdn2`, token by token.

    Parameters
    ----------
    <q_k>
    <v_h>
    g : array
        Log decay per token, head and key channel, ``(B, T, H, K)``.
    b : array
        Erase gate per key channel, ``(B, T, H, K)``.
    w : array
        Write gate per value channel, ``(B, T, H, V)``.
    A_log, dt_bias : array, optional
        The in-kernel gate's parameters: not supported (``NotImplementedError``).
    <scale>
    <initial_state_h>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported (``NotImplementedError`` when True).
    lower_bound : float, optional
        Accepted, ignored (it only bounds the in-kernel gate).
    state_v_first : bool
        Not supported (``NotImplementedError`` when True).
    <cu_seqlens>
    **kwargs
        ``transpose_state_layout`` is the deprecated ``state_v_first``; any other keyword
        raises ``NotImplementedError``.

    Returns
    -------
    <o_h>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_gdn2
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> b, w = rng.uniform(0, 1, (2, 1, 8, 2, 4))
    >>> fused_recurrent_gdn2(q, k, v, g, b, w)[0].shape
    (1, 8, 2, 4)
    """
    op = "fused_recurrent_gdn2"
    check_inputs(
        op, q=q, k=k, v=v, g=g, b=b, w=w, scale=scale, initial_state=initial_state
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject(
        op, kwargs, A_log=(A_log, None), dt_bias=(dt_bias, None),
        use_gate_in_kernel=(use_gate_in_kernel, False), state_v_first=(state_v_first, False),
    )  # fmt: skip
    return _gdn2(
        op, q, k, v, g, b, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=None, method="recurrent",
    )  # fmt: skip
