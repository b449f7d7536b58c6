"""fla's ``ops.delta_rule``: the delta rule (DeltaNet)."""

from __future__ import annotations

from typing import Any

from ...interop import Array
from ._args import (
    check_inputs,
    pop_chunk_size,
    reject,
    reject_head_first,
)
from ._docs import fla_doc
from ._families import (
    Result,
    delta_family,
)

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule"]


@fla_doc
def chunk_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_delta_rule`` (DeltaNet).

    ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    q, k : array
        Queries and keys, ``(B, T, H, K)``; unit keys (or ``use_qk_l2norm_in_kernel``) keep the
        recurrence stable.
    <v_hv>
    <beta>
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <cu_seqlens>
    <cu_seqlens_cpu>
    **kwargs
        ``chunk_size`` (16, 32 or 64); ``head_first`` raises fla's ``DeprecationWarning``; any other
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
    >>> from polylin.compat.fla import chunk_delta_rule, fused_recurrent_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> o, _ = chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    >>> o_r, _ = fused_recurrent_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    >>> bool(np.allclose(o, o_r))
    True
    """
    check_inputs(
        "chunk_delta_rule", q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state
    )
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_delta_rule", kwargs, (16, 32, 64))
    reject("chunk_delta_rule", kwargs)
    return delta_family(
        "chunk_delta_rule", q, k, v, beta, None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, method="chunked",
        chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    beta: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_delta_rule``: :func:`chunk_delta_rule`, token by token.

    Parameters
    ----------
    <q_k>
    <v_hv>
    beta : array, optional
        The learning rate per token, ``(B, T, HV)``; ``None`` means 1, as in fla.
    scale : float, optional
        Multiplies the queries, positive; default ``K ** -0.5``.
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <cu_seqlens>

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
    >>> from polylin.compat.fla import fused_recurrent_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> o, S = fused_recurrent_delta_rule(
    ...     q, k, v, use_qk_l2norm_in_kernel=True, output_final_state=True
    ... )
    >>> o.shape, S.shape
    ((1, 8, 2, 4), (1, 2, 4, 4))
    """
    check_inputs(
        "fused_recurrent_delta_rule", q=q, k=k, v=v, beta=beta, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    if scale is not None and not scale > 0:
        raise ValueError("scale must be positive")
    return delta_family(
        "fused_recurrent_delta_rule", q, k, v, beta, None, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        method="recurrent",
    )  # fmt: skip
