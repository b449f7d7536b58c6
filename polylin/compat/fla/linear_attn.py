"""fla's ``ops.linear_attn``: normalized linear attention."""

from __future__ import annotations

from ...interop import Array
from ._args import (
    check_inputs,
    reject,
)
from ._docs import fla_doc
from ._families import (
    Result,
    linear_family,
)

__all__ = ["chunk_linear_attn", "fused_recurrent_linear_attn"]


@fla_doc
def chunk_linear_attn(
    q: Array,
    k: Array,
    v: Array,
    scale: float | None = None,
    initial_state: Array | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``chunk_linear_attn``: ``o_t = scale q_t S_t``, normalized by default.

    ``S_t = sum_{s<=t} k_s v_s^T`` and, with ``normalize``, ``o_t`` is divided by
    ``scale q_t . z_t + 1e-10`` with ``z_t = sum_{s<=t} k_s``. fla applies no feature map.

    Parameters
    ----------
    <q_k>
    <v_h>
    <scale>
    initial_state : array or (array, array), optional
        ``(N, H, K, V)``; with ``normalize`` a tuple ``(kv_state, z_state)``, ``z_state`` of shape
        ``(N, 1, H, K)``.
    <output_final_state>
    normalize : bool
        Divide by ``scale q_t . z_t + 1e-10``.
    <cu_seqlens>

    Returns
    -------
    <o_h>
    final_state : array or (array, array) or None
        ``(N, H, K, V)`` if ``output_final_state``; with ``normalize`` the tuple
        ``(kv_state or None, z_state)``, as fla returns it.

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_linear_attn
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 6, 2, 4))
    >>> o, (S, z) = chunk_linear_attn(q, k, v, output_final_state=True)
    >>> o.shape, S.shape, z.shape
    ((1, 6, 2, 4), (1, 2, 4, 4), (1, 1, 2, 4))
    """
    check_inputs("chunk_linear_attn", q=q, k=k, v=v, scale=scale, initial_state=initial_state)
    return linear_family(
        q, k, v, log_decay=None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, normalize=normalize, cu_seqlens=cu_seqlens,
        method="chunked",
    )  # fmt: skip


@fla_doc
def fused_recurrent_linear_attn(
    q: Array,
    k: Array,
    v: Array,
    scale: float | None = None,
    initial_state: Array | tuple | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    normalize: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_linear_attn``: :func:`chunk_linear_attn`, token by token.

    ``normalize`` defaults to False here, as in fla.

    Parameters
    ----------
    <q_k>
    <v_h>
    <scale>
    initial_state : array or (array, array), optional
        ``(N, H, K, V)``; with ``normalize`` a tuple ``(kv_state, z_state)``.
    <output_final_state>
    <reverse>
    normalize : bool
        Divide by ``scale q_t . z_t + 1e-10``.
    <cu_seqlens>

    Returns
    -------
    <o_h>
    final_state : array or (array, array) or None
        As for :func:`chunk_linear_attn`.

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_linear_attn, fused_recurrent_linear_attn
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 6, 2, 4))
    >>> o, _ = fused_recurrent_linear_attn(q, k, v)
    >>> bool(np.allclose(o, chunk_linear_attn(q, k, v, normalize=False)[0]))
    True
    """
    check_inputs(
        "fused_recurrent_linear_attn", q=q, k=k, v=v, scale=scale, initial_state=initial_state
    )
    reject("fused_recurrent_linear_attn", reverse=(reverse, False))
    return linear_family(
        q, k, v, log_decay=None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, normalize=normalize, cu_seqlens=cu_seqlens,
        method="recurrent",
    )  # fmt: skip
