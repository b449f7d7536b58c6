"""fla's ``ops.kda``: Kimi Delta Attention, the delta rule with a gate per key channel."""

from __future__ import annotations

from typing import Any

from ...interop import Array
from ._args import (
    check_inputs,
    pop_chunk_size,
    state_v_first_alias,
)
from ._docs import fla_doc
from ._families import (
    Result,
    delta_family,
    reject_gate_options,
)

__all__ = ["chunk_kda", "fused_recurrent_kda"]


@fla_doc
def chunk_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    cp_context: Any | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_kda`` (Kimi Delta Attention): the delta rule, a decay per key channel.

    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array
        Log decay per token, value head and key channel, ``(B, T, HV, K)``.
    <beta>
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported: compute ``g`` first.
    <beta_options>
    <safe_gate>
    lower_bound : float, optional
        The in-kernel gate's bound: not supported.
    <disable_recompute>
    return_intermediate_states : bool
        Not supported.
    <state_v_first_hv>
    <cu_seqlens>
    <cu_seqlens_cpu>
    <cp_context>
    use_graph : bool
        CUDA graph capture: not supported.
    max_num_seqs : int, optional
        Used with ``use_graph`` only: not supported.
    **kwargs
        ``chunk_size`` (32 or 64); ``head_first`` raises fla's ``DeprecationWarning``; any other
        option raises ``NotImplementedError`` naming it.

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_kda, fused_recurrent_kda
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    >>> o_r, _ = fused_recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    >>> bool(np.allclose(o, o_r))
    True
    """
    check_inputs(
        "chunk_kda", q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state
    )
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    chunk_size = pop_chunk_size("chunk_kda", kwargs, (32, 64))
    reject_gate_options(
        "chunk_kda", kwargs, use_gate_in_kernel=(use_gate_in_kernel, False),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False), lower_bound=(lower_bound, None),
        return_intermediate_states=(return_intermediate_states, False),
        cp_context=(cp_context, None), use_graph=(use_graph, False),
        max_num_seqs=(max_num_seqs, None),
    )  # fmt: skip
    return delta_family(
        "chunk_kda", q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
        method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_kda``: :func:`chunk_kda`, token by token.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array
        Log decay per token, value head and key channel, ``(B, T, HV, K)``.
    <beta>
    A_log, dt_bias : array, optional
        The in-kernel gate's parameters: not supported (compute ``g`` first).
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported.
    <beta_options>
    lower_bound : float, optional
        The in-kernel gate's bound: not supported.
    <state_v_first_hv>
    <cu_seqlens>
    <kwargs_state_layout>

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_kda
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> fused_recurrent_kda(q, k, v, g, beta)[0].shape
    (1, 8, 2, 4)
    """
    check_inputs(
        "fused_recurrent_kda", q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject_gate_options(
        "fused_recurrent_kda", kwargs, A_log=(A_log, None), dt_bias=(dt_bias, None),
        use_gate_in_kernel=(use_gate_in_kernel, False),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False), lower_bound=(lower_bound, None),
    )  # fmt: skip
    return delta_family(
        "fused_recurrent_kda", q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip
