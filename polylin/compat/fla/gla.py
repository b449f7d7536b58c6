"""fla's ``ops.gla``: gated linear attention, a decay per key channel."""

from __future__ import annotations

from typing import Any

from ...interop import Array
from ._args import (
    check_inputs,
    reject,
    state_v_first_alias,
)
from ._docs import fla_doc
from ._families import (
    Result,
    linear_family,
)

__all__ = ["chunk_gla", "fused_recurrent_gla"]


@fla_doc
def chunk_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
) -> Result:
    """Compute fla's ``chunk_gla`` (gated linear attention): one decay per key channel.

    ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_h>
    g : array
        Log decay per token, head and key channel, ``(B, T, H, K)``.
    <scale>
    <initial_state_h_v_first>
    <output_final_state>
    <state_v_first>
    <cu_seqlens>
    <cu_seqlens_cpu>

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
    >>> from polylin.compat.fla import chunk_gla, fused_recurrent_gla
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> o, _ = chunk_gla(q, k, v, g)
    >>> bool(np.allclose(o, fused_recurrent_gla(q, k, v, g)[0]))
    True
    """
    check_inputs("chunk_gla", q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state)
    return linear_family(
        q, k, v, log_decay=g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, normalize=False, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first, method="chunked",
    )  # fmt: skip


@fla_doc
def fused_recurrent_gla(
    q: Array,
    k: Array,
    v: Array,
    gk: Array | None = None,
    gv: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_gla``: :func:`chunk_gla`, token by token.

    Parameters
    ----------
    <q_k>
    <v_h>
    gk : array, optional
        Log decay per key channel, ``(B, T, H, K)``.
    gv : array, optional
        Value gates: not supported (``NotImplementedError``).
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
    >>> from polylin.compat.fla import fused_recurrent_gla
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> gk = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> fused_recurrent_gla(q, k, v, gk)[0].shape
    (1, 8, 2, 4)
    """
    check_inputs(
        "fused_recurrent_gla", q=q, k=k, v=v, gk=gk, scale=scale, initial_state=initial_state
    )
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject("fused_recurrent_gla", kwargs, gv=(gv, None), reverse=(reverse, False))
    return linear_family(
        q, k, v, log_decay=gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, normalize=False, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip
