"""fla's ``ops.retention``: RetNet's fixed per-head decays."""

from __future__ import annotations

import math
from typing import Any

from ...interop import Array, device
from ._args import (
    FlaHeads,
    check_inputs,
    pop_chunk_size,
    reject,
    reject_head_first,
)
from ._docs import fla_doc
from ._families import (
    Result,
    linear_family,
    simple_gate,
)

__all__ = ["chunk_retention"]


@fla_doc
def chunk_retention(
    q: Array,
    k: Array,
    v: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_retention`` (RetNet): :func:`chunk_simple_gla` with fixed decays.

    Head ``h`` decays by ``1 - 2 ** (-5 - h)`` per token, as fla defines it.

    Parameters
    ----------
    <q_k>
    <v_h>
    <scale>
    initial_state : array, optional
        ``(N, H, K, V)``.
    <output_final_state>
    <cu_seqlens>
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
    >>> from polylin.compat.fla import chunk_retention
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 1, 8, 2, 4))
    >>> chunk_retention(q, k, v)[0].shape
    (1, 8, 2, 4)
    """
    check_inputs("chunk_retention", q=q, k=k, v=v, scale=scale, initial_state=initial_state)
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_retention", kwargs, None)
    reject("chunk_retention", kwargs)
    heads = FlaHeads.of(q, k, v, None, None)
    # RetNet's per-head decays, as fla's chunk_retention defines them (in float32).
    gammas = [math.log(1.0 - 2.0 ** (-5.0 - h)) for h in range(heads.heads)]
    g_gamma = heads.xp.asarray(gammas, dtype=heads.xp.float32, device=device(q))
    return linear_family(
        q, k, v, log_decay=simple_gate("chunk_retention", None, g_gamma, q), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, normalize=False,
        cu_seqlens=cu_seqlens, method="chunked", chunk_size=chunk_size,
    )  # fmt: skip
