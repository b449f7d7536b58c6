"""fla's ``ops.generalized_delta_rule``: the diagonal-plus-low-rank (DPLR) delta rule."""

from __future__ import annotations

from typing import Any

from ...interop import Array
from ._args import (
    check_inputs,
    reject,
)
from ._docs import fla_doc
from ._families import (
    Result,
    dplr_chunk_options,
    dplr_family,
)

__all__ = ["chunk_dplr_delta_rule", "fused_recurrent_dplr_delta_rule"]


@fla_doc
def chunk_dplr_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    a: Array,
    b: Array,
    gk: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context: Any | None = None,
    lower_bound: float | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_dplr_delta_rule``: the generalized delta rule (DPLR transitions).

    ``S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T``,
    ``o_t = scale S_t^T q_t``: the low-rank term reads the state before the token's decay.

    Parameters
    ----------
    <q_k>
    v : array
        Values, ``(B, T, H, V)`` (or ``HV`` heads, a multiple of ``H``: each key head's ``a``,
        ``b``, ``gk`` then serve its ``HV // H`` consecutive value heads).
    a, b : array
        The low-rank term ``b_t a_t^T`` of each token, ``(B, T, H, K)`` (RWKV-7: ``a = -kk``,
        ``b = kk * a_lr``). Keep the transition's eigenvalues at most 1 in magnitude.
    gk : array
        Log decay per token, head and key channel, ``(B, T, H, K)`` (``<= 0``).
    <scale>
    <initial_state_h>
    <output_final_state>
    <cu_seqlens>
    <cu_seqlens_cpu>
    <safe_gate>
    chunk_size : int, optional
        The chunk length, a power of 2 (default :data:`polylin.DEFAULT_DPLR_CHUNK_SIZE`, 32;
        fla's default is 16: the same function).
    <disable_recompute>
    <cp_context>
    lower_bound : float, optional
        The caller's promise ``lower_bound <= gk < 0`` (a speed hint of fla): must be
        negative, else ignored.
    **kwargs
        ``head_first`` raises fla's ``DeprecationWarning``; any other option raises
        ``NotImplementedError`` naming it.

    Returns
    -------
    <o_h>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    ValueError
        fla's rules: ``B != 1`` or a state count that is not the number of sequences with
        ``cu_seqlens``, ``lower_bound >= 0``; ``a``, ``b`` or ``gk`` not of shape
        ``(B, T, H, K)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> a, b = -kk, kk * rng.uniform(0, 1, (1, 8, 2, 4))
    >>> gk = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> o, S = chunk_dplr_delta_rule(q, k, v, a, b, gk, output_final_state=True)
    >>> o_r, S_r = fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, output_final_state=True)
    >>> bool(np.allclose(o, o_r)), S.shape
    (True, (1, 2, 4, 4))
    """
    check_inputs(
        "chunk_dplr_delta_rule", q=q, k=k, v=v, a=a, b=b, gk=gk, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    chunk_size = dplr_chunk_options(
        "chunk_dplr_delta_rule", kwargs, chunk_size=chunk_size, lower_bound=lower_bound,
        cp_context=cp_context,
    )  # fmt: skip
    return dplr_family(
        q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_dplr_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    a: Array,
    b: Array,
    gk: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_dplr_delta_rule``: the generalized rule, token by token.

    :func:`chunk_dplr_delta_rule` computes the same function in chunks. fla's kernel is
    forward-only; this one is differentiable on PyTorch and JAX.

    Parameters
    ----------
    <q_k>
    <v_h>
    a, b : array
        The low-rank term ``b_t a_t^T`` of each token, ``(B, T, H, K)``.
    gk : array
        Log decay per token, head and key channel, ``(B, T, H, K)`` (``<= 0``).
    <scale>
    <initial_state_h>
    <output_final_state>
    <reverse>
    <cu_seqlens>

    Returns
    -------
    <o_h>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    ValueError
        fla's rules: ``B != 1`` or a state count that is not the number of sequences with
        ``cu_seqlens``; ``a``, ``b`` or ``gk`` not of shape ``(B, T, H, K)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_dplr_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> zero = np.zeros_like(k)      # a = b = 0, gk = 0: unnormalized linear attention
    >>> o, _ = fused_recurrent_dplr_delta_rule(q, k, v, zero, zero, zero, scale=1.0)
    >>> scores = np.tril(np.einsum("bthd,bshd->bhts", q, k))
    >>> bool(np.allclose(o, np.einsum("bhts,bshd->bthd", scores, v)))
    True
    """
    check_inputs(
        "fused_recurrent_dplr_delta_rule", q=q, k=k, v=v, a=a, b=b, gk=gk, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    reject("fused_recurrent_dplr_delta_rule", reverse=(reverse, False))
    return dplr_family(
        q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, method="recurrent",
    )  # fmt: skip
