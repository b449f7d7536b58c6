"""fla's ``ops.gated_delta_product``: Gated DeltaProduct, several delta-rule steps per token.

Each token ``t`` decays the state by ``exp(g_t)`` once, then applies ``n = num_householder``
delta-rule steps (Householder-like transitions ``I - beta k k^T``) with its ``n`` keys, values
and learning rates, and reads the state after the last one. That is Gated DeltaNet over
``T * n`` sub-steps, the decay on each token's first sub-step and the query read at its last:
one :func:`polylin.delta_rule_attention` call over the sub-steps, every ``n``-th output kept.
"""

from __future__ import annotations

from typing import Any

from ...interop import Array, array_namespace
from ._args import check_inputs, offsets_of, reject
from ._docs import fla_doc
from ._families import Result, delta_family, static_flags

__all__ = ["chunk_gated_delta_product"]


def _check_sub_steps(q: Any, k: Any, v: Any, g: Any, beta: Any, n: Any) -> None:
    """fla's shapes: ``k, v, beta`` with ``T * num_householder`` steps, ``g`` with ``T``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`num_householder` must be a positive int, got {n!r}")
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    wanted = {"k": (k, 4), "v": (v, 4), "beta": (beta, 3)}
    for name, (x, ndim) in wanted.items():
        if x.ndim != ndim or tuple(x.shape[:2]) != (B, T * n):
            raise ValueError(
                f"chunk_gated_delta_product: `{name}` must have shape (B, T * num_householder, "
                f"...) = ({B}, {T * n}, ...) for q of shape {tuple(q.shape)} and "
                f"num_householder={n}, got {tuple(x.shape)}"
            )
    if g is not None and tuple(g.shape[:2]) != (B, T):
        raise ValueError(
            f"chunk_gated_delta_product: `g` must have shape (B, T, H) = {(B, T, H)} (one "
            f"decay per token, not per sub-step), got {tuple(g.shape)}"
        )


@fla_doc
def chunk_gated_delta_product(
    q: Array,
    k: Array,
    v: Array,
    g: Array | None,
    beta: Array,
    num_householder: int,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    cp_context: Any | None = None,
) -> Result:
    """Compute fla's ``chunk_gated_delta_product`` (Gated DeltaProduct).

    For token ``t`` with sub-steps ``j = 1..n`` (``n = num_householder``):
    ``S <- exp(g_t) S``, then ``S <- S + beta_tj k_tj (v_tj - S^T k_tj)^T`` for each ``j``,
    and ``o_t = scale S^T q_t``.

    Parameters
    ----------
    q : array
        Queries, ``(B, T, H, K)``.
    k : array
        Keys, ``(B, T * num_householder, H, K)``: the ``n`` keys of token ``t`` at
        ``t * n .. t * n + n - 1``.
    v : array
        Values, ``(B, T * num_householder, HV, V)``.
    g : array or None
        Log decay per token and value head, ``(B, T, HV)``, applied once per token (``None``:
        no decay).
    beta : array
        Learning rates, ``(B, T * num_householder, HV)``.
    num_householder : int
        Delta-rule steps per token.
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    cu_seqlens : array of int, optional
        Offsets ``[0, l1, l1+l2, ...]`` of packed sequences in tokens of ``q`` (``B == 1``);
        the sub-steps' offsets are these times ``num_householder``.
    <cu_seqlens_cpu>
    <cp_context>

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    ValueError
        ``k``, ``v`` or ``beta`` without ``T * num_householder`` steps, ``g`` without ``T``.
    <raises_not_implemented>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_gated_delta_product
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 6, 2, 4))
    >>> k, v = rng.standard_normal((2, 1, 12, 2, 4))   # 2 steps per token
    >>> k /= np.linalg.norm(k, axis=-1, keepdims=True)
    >>> g = -rng.uniform(0, 1, (1, 6, 2))
    >>> beta = rng.uniform(0, 1, (1, 12, 2))
    >>> o, S = chunk_gated_delta_product(q, k, v, g, beta, 2, output_final_state=True)
    >>> o.shape, S.shape
    ((1, 6, 2, 4), (1, 2, 4, 4))
    """
    op = "chunk_gated_delta_product"
    check_inputs(
        op, q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state
    )  # fmt: skip
    reject(op, cp_context=(cp_context, None))
    static_flags(num_householder=num_householder)
    _check_sub_steps(q, k, v, g, beta, num_householder)
    n = num_householder
    xp = array_namespace(q)
    B, T, H, K = q.shape
    # every sub-step sees its token's query; only the last sub-step's output is kept
    q_sub = xp.broadcast_to(xp.expand_dims(q, axis=2), (B, T, n, H, K))
    q_sub = xp.reshape(q_sub, (B, T * n, H, K))
    g_sub = None
    if g is not None and n > 1:
        rest = xp.zeros((B, T, n - 1, *g.shape[2:]), dtype=g.dtype, device=g.device)
        g_sub = xp.concat([xp.expand_dims(g, axis=2), rest], axis=2)
        g_sub = xp.reshape(g_sub, (B, T * n, *g.shape[2:]))
    elif g is not None:
        g_sub = g
    offsets = offsets_of(cu_seqlens, cu_seqlens_cpu)
    sub_offsets = None if offsets is None else [n * o for o in offsets]
    o, S = delta_family(
        op, q_sub, k, v, beta, g_sub, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=sub_offsets, method="chunked",
    )  # fmt: skip
    o = xp.reshape(o, (B, T, n, *o.shape[2:]))[:, :, n - 1, ...]
    return o, S
