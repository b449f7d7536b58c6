"""fla's ``ops.comba``: Comba, a gated delta rule that reads the state with its own key ``p``.

``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T``, ``o_t = scale S_t^T q_t``: the
correction reads the state before the decay (fla's kernels, ``chunk_comba`` and
``fused_recurrent_comba``, and its ``naive_chunk_comba``; its ``naive_recurrent_comba`` reads
the decayed state, a different recurrence). That is the diagonal-plus-low-rank transition
``exp(g_t) I - beta_t k_t p_t^T`` with the write ``beta_t k_t v_t^T``: one
:func:`polylin.dplr_delta_rule` call with ``a = -p``, ``b = beta k`` and the key ``beta k``.
"""

from __future__ import annotations

from typing import Any

from ...interop import Array, array_namespace
from ._args import check_inputs
from ._docs import fla_doc
from ._families import Result, dplr_family, static_flags

__all__ = ["chunk_comba", "fused_recurrent_comba"]

#: fla's ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x ** 2) + 1e-6)``.
L2NORM_EPS = 1e-6


def _l2norm(xp: Any, x: Any) -> Any:
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _comba(
    op: str,
    q: Any,
    k: Any,
    v: Any,
    p: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None,
    initial_state: Any,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any,
    method: str,
) -> Result:
    check_inputs(
        op, q=q, k=k, v=v, p=p, g=g, beta=beta, scale=scale, initial_state=initial_state
    )  # fmt: skip
    static_flags(
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
    )
    xp = array_namespace(q)
    p = k if p is None else p
    if q.shape[2] != k.shape[2] or q.shape[2] != p.shape[2]:
        raise ValueError(
            f"{op}: q, k and p must have the same number of heads, got q.shape[2]={q.shape[2]}, "
            f"k.shape[2]={k.shape[2]} and p.shape[2]={p.shape[2]}"
        )
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"{op}: the value heads HV={HV} must be a multiple of the heads H={H}")
    if use_qk_l2norm_in_kernel:
        q, k, p = (_l2norm(xp, x) for x in (q, k, p))
    G = HV // H
    if G > 1:  # each query/key head serves G consecutive value heads: one copy per value head
        q, k, p = (
            xp.reshape(xp.broadcast_to(xp.expand_dims(x, axis=3), (B, T, H, G, K)), (B, T, HV, K))
            for x in (q, k, p)
        )
    b = k if beta is None else k * xp.expand_dims(beta, axis=-1)
    gk = xp.broadcast_to(xp.expand_dims(g, axis=-1), (B, T, HV, K))
    scale = K**-0.5 if scale is None else scale
    return dplr_family(
        q, b, v, -p, b, gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, method=method, gate_name="g",
    )  # fmt: skip


@fla_doc
def chunk_comba(
    q: Array,
    k: Array,
    v: Array,
    p: Array | None,
    g: Array,
    beta: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
) -> Result:
    """Compute fla's ``chunk_comba`` (Comba).

    ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T``, ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_hv>
    p : array or None
        The keys that read the state for the correction, ``(B, T, H, K)`` (``None``: ``k``).
    g : array
        Log decay per token and value head, ``(B, T, HV)``.
    beta : array, optional
        Learning rates, ``(B, T, HV)`` (``None``: 1).
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <cu_seqlens>
    <cu_seqlens_cpu>

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_comba, fused_recurrent_comba
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)
    >>> p = 0.5 * k
    >>> g = -rng.uniform(0, 1, (1, 8, 2))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> o, S = chunk_comba(q, k, v, p, g, beta, output_final_state=True)
    >>> o_r, _ = fused_recurrent_comba(q, k, p, v, g, beta)   # fla's order: p before v
    >>> bool(np.allclose(o, o_r)), S.shape
    (True, (1, 2, 4, 4))
    """
    return _comba(
        "chunk_comba", q, k, v, p, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, method="chunked",
    )  # fmt: skip


@fla_doc
def fused_recurrent_comba(
    q: Array,
    k: Array,
    p: Array | None,
    v: Array,
    g: Array,
    beta: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_comba``: :func:`chunk_comba`, token by token.

    fla's order of arguments differs from ``chunk_comba``'s: ``p`` comes before ``v``.

    Parameters
    ----------
    <q_k>
    p : array or None
        The keys that read the state for the correction, ``(B, T, H, K)`` (``None``: ``k``).
    <v_hv>
    g : array
        Log decay per token and value head, ``(B, T, HV)``.
    beta : array, optional
        Learning rates, ``(B, T, HV)`` (``None``: 1).
    <scale>
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
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_comba
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2))
    >>> fused_recurrent_comba(q, k, None, v, g, use_qk_l2norm_in_kernel=True)[0].shape
    (1, 8, 2, 4)
    """
    return _comba(
        "fused_recurrent_comba", q, k, v, p, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=None, method="recurrent",
    )  # fmt: skip
