"""fla's ``ops.gated_delta_rule``: the gated delta rule (Gated DeltaNet, Qwen3-Next)."""

from __future__ import annotations

from typing import Any

from ...interop import Array, is_array
from ._args import (
    check_inputs,
    describe,
    pop_chunk_size,
    reject_head_first,
    state_v_first_alias,
)
from ._docs import fla_doc
from ._families import (
    Result,
    delta_family,
    reject_gate_options,
)

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


@fla_doc
def chunk_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    chunk_indices: Array | None = None,
    cp_context: Any | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_gated_delta_rule`` (Gated DeltaNet).

    ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T`` with ``a_t = exp(g_t)``,
    ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array
        Log decay per token and value head, ``(B, T, HV)`` (``<= 0``).
    <beta>
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <beta_options>
    <state_v_first_hv>
    <cu_seqlens>
    <cu_seqlens_cpu>
    chunk_indices : array, optional
        The precomputed varlen chunk table of fla, derived from ``cu_seqlens``: ignored.
    <cp_context>
    **kwargs
        ``chunk_size`` (16, 32 or 64); ``head_first`` raises fla's ``DeprecationWarning``; any
        other option raises ``NotImplementedError`` naming it (``use_gate_in_kernel``,
        ``A_log``, ``dt_bias`` among them: compute ``g`` first).

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
    >>> from polylin.compat.fla import chunk_gated_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 2, 8, 2, 4))
    >>> v = rng.standard_normal((2, 8, 4, 3))      # 4 value heads on 2 query/key heads
    >>> g = -rng.uniform(0, 1, (2, 8, 4))          # log decay
    >>> beta = rng.uniform(0, 1, (2, 8, 4))        # learning rate
    >>> o, state = chunk_gated_delta_rule(
    ...     q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True
    ... )
    >>> o.shape, state.shape
    ((2, 8, 4, 3), (2, 4, 4, 3))
    """
    check_inputs(
        "chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_gated_delta_rule", kwargs, (16, 32, 64))
    reject_gate_options(
        "chunk_gated_delta_rule", kwargs,
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False), cp_context=(cp_context, None),
    )  # fmt: skip
    return delta_family(
        "chunk_gated_delta_rule", q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
        method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


def _gated_delta_landing(op: str, **landed: Any) -> str:
    """The error of a call ``(q, k, v, g, beta, more...)`` in fla 0.6's order ``(q, k, v, g,
    gk, gv, beta, scale, ...)``: which argument landed where, and the call by keyword."""
    where = ", ".join(f"`{name}` got {describe(x)}" for name, x in landed.items() if x is not None)
    return (
        f"polylin.compat.fla.{op} takes (q, k, v, g, gk, gv, beta, scale, initial_state, ...) "
        "in this order, as fla 0.6 does: a call (q, k, v, g, beta, ...) puts beta in `gk` and "
        f"the next positional arguments in `gv`, `beta`, `scale`, ...: {where} (a (B, T, HV) "
        "array in `gk` is beta's shape, not a gate's (B, T, HV, K)). Pass beta and what follows "
        f"by keyword: {op}(q, k, v, g, beta=beta, scale=..., initial_state=...)."
    )


@fla_doc
def fused_recurrent_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array | None = None,
    gk: Array | None = None,
    gv: Array | None = None,
    beta: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_gated_delta_rule``: the gated delta rule, token by token.

    :func:`chunk_gated_delta_rule` computes the same function in chunks.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array, optional
        Log decay per token and value head, ``(B, T, HV)``.
    gk : array, optional
        Log decay per key channel, ``(B, T, HV, K)`` (the KDA transition, as
        :func:`fused_recurrent_kda`); not together with ``g``. A ``(B, T, HV)`` array here
        beside ``g`` is read as ``beta``: the call ``(q, k, v, g, beta)`` of fla's own docs for
        this op (whose fifth positional parameter is ``gk``) computes what
        ``(q, k, v, g=g, beta=beta)`` does; with ``gv`` or ``beta`` also given it raises
        ``TypeError`` saying where each argument landed.
    gv : array, optional
        Value gates: not supported.
    beta : array, optional
        The learning rate per token, ``(B, T, HV)``; ``None`` means 1.
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported: compute ``g`` first.
    A_log, dt_bias : array, optional
        The in-kernel gate's parameters: not supported.
    <beta_options>
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
    >>> from polylin.compat.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 9, 2, 4))
    >>> g, beta = -rng.uniform(0, 1, (1, 9, 2)), rng.uniform(0, 1, (1, 9, 2))
    >>> prefill, S = chunk_gated_delta_rule(
    ...     q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], output_final_state=True
    ... )
    >>> o_t, S = fused_recurrent_gated_delta_rule(
    ...     q[:, 8:], k[:, 8:], v[:, 8:], g=g[:, 8:], beta=beta[:, 8:], initial_state=S,
    ...     output_final_state=True,
    ... )
    >>> whole, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    >>> bool(np.allclose(o_t, whole[:, 8:]))
    True
    """
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    op = "fused_recurrent_gated_delta_rule"
    if g is not None and gk is not None and is_array(gk) and gk.ndim == 3:
        # The call (q, k, v, g, beta) of fla's docs: fla 0.6's fifth parameter is gk, and a
        # (B, T, HV) array there, beside g, is beta (a gate gk is (B, T, HV, K)).
        if gv is not None or beta is not None:
            raise TypeError(_gated_delta_landing(op, gk=gk, gv=gv, beta=beta, scale=scale))
        gk, beta = None, gk
    check_inputs(op, q=q, k=k, v=v, g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state)
    reject_gate_options(
        op, kwargs, gv=(gv, None), use_gate_in_kernel=(use_gate_in_kernel, False),
        A_log=(A_log, None), dt_bias=(dt_bias, None),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False),
    )  # fmt: skip
    if g is not None and gk is not None:
        raise NotImplementedError(
            f"polylin.compat.fla.{op} does not support `g` and `gk` together (pass one gate, "
            "gk=g[..., None] + gk; if the fifth positional argument was meant as beta: fla "
            "0.6's fifth parameter is gk, pass beta=... by keyword)"
        )
    return delta_family(
        op, q, k, v, beta, gk if gk is not None else g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip
