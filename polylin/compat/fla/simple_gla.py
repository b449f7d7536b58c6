"""fla's ``ops.simple_gla``: linear attention with a scalar decay per head and token."""

from __future__ import annotations

from typing import Any

from ...interop import Array
from ._args import (
    check_inputs,
    pop_chunk_size,
    reject,
    reject_head_first,
    state_v_first_alias,
)
from ._docs import fla_doc
from ._families import (
    Result,
    linear_family,
    simple_gate,
)

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla"]


@fla_doc
def chunk_simple_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array | None = None,
    g_gamma: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_simple_gla``: one decay per head and token.

    ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_h>
    g : array, optional
        Log decay per token and head, ``(B, T, H)``.
    g_gamma : array, optional
        Log decay per head, ``(H,)``, instead of ``g``.
    <scale>
    <initial_state_h_v_first>
    <output_final_state>
    <state_v_first>
    <cu_seqlens>
    <cu_seqlens_cpu>
    **kwargs
        ``chunk_size`` (a power of 2); ``head_first`` raises fla's ``DeprecationWarning``; any other
        option raises ``NotImplementedError`` naming it.

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
    >>> from polylin.compat.fla import chunk_simple_gla
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (2, 8, 2))
    >>> o, state = chunk_simple_gla(q, k, v, g, output_final_state=True)
    >>> o.shape, state.shape
    ((2, 8, 2, 4), (2, 2, 4, 4))
    """
    check_inputs(
        "chunk_simple_gla", q=q, k=k, v=v, g=g, g_gamma=g_gamma, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_simple_gla", kwargs, None)
    reject("chunk_simple_gla", kwargs)
    return linear_family(
        q, k, v, log_decay=simple_gate("chunk_simple_gla", g, g_gamma, q), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, normalize=False,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
        method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_simple_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array | None = None,
    g_gamma: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_simple_gla``: :func:`chunk_simple_gla`, token by token.

    Parameters
    ----------
    <q_k>
    <v_h>
    g : array, optional
        Log decay per token and head, ``(B, T, H)``.
    g_gamma : array, optional
        Log decay per head, ``(H,)``, instead of ``g``.
    <scale>
    <initial_state_h_v_first>
    <output_final_state>
    <reverse>
    <state_v_first>
    <cu_seqlens>
    <kwargs_state_layout>

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
    >>> from polylin.compat.fla import chunk_simple_gla, fused_recurrent_simple_gla
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2))
    >>> o, _ = fused_recurrent_simple_gla(q, k, v, g)
    >>> bool(np.allclose(o, chunk_simple_gla(q, k, v, g)[0]))
    True
    """
    check_inputs(
        "fused_recurrent_simple_gla", q=q, k=k, v=v, g=g, g_gamma=g_gamma, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject("fused_recurrent_simple_gla", kwargs, reverse=(reverse, False))
    return linear_family(
        q, k, v, log_decay=simple_gate("fused_recurrent_simple_gla", g, g_gamma, q),
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        normalize=False, cu_seqlens=cu_seqlens, state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip
