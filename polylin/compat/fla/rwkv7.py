"""fla's ``ops.rwkv7``: RWKV-7's time mixing, the DPLR rule in RWKV-7's terms."""

from __future__ import annotations

from typing import Any

from ...interop import Array
from ._args import (
    FlaHeads,
    check_inputs,
    in_common_dtype,
    reject,
    work_dtype,
)
from ._docs import fla_doc
from ._families import (
    Result,
    dplr_chunk_options,
    dplr_family,
)

__all__ = ["chunk_rwkv7", "fused_mul_recurrent_rwkv7", "fused_recurrent_rwkv7"]


@fla_doc
def chunk_rwkv7(
    r: Array,
    w: Array,
    k: Array,
    v: Array,
    a: Array,
    b: Array,
    scale: float = 1.0,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context: Any | None = None,
    lower_bound: float | None = None,
) -> Result:
    """Compute fla's ``chunk_rwkv7`` (RWKV-7's time mixing) as the generalized delta rule.

    :func:`chunk_dplr_delta_rule` with ``q = r`` and ``gk = w``, ``scale`` 1 by default:
    ``S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T``,
    ``o_t = scale S_t^T r_t``. ``w`` is the log decay itself (RWKV-7's layer passes
    ``w = -exp(omega)``, in fla ``-0.6065 * sigmoid(.)``), ``a = -kk``, ``b = kk * a_lr``.

    Parameters
    ----------
    <r>
    <w>
    <k>
    <v_h>
    a, b : array
        The low-rank term ``b_t a_t^T``, ``(B, T, H, K)``.
    scale : float
        Multiplies the receptances; default 1 (as in fla).
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
        The caller's promise ``lower_bound <= w < 0`` (a speed hint of fla): must be
        negative, else ignored.

    Returns
    -------
    <o_rwkv>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    ValueError
        fla's rules: ``B != 1`` or a state count that is not the number of sequences with
        ``cu_seqlens``, ``lower_bound >= 0``; ``w``, ``a`` or ``b`` not of shape
        ``(B, T, H, K)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_rwkv7, fused_mul_recurrent_rwkv7
    >>> rng = np.random.default_rng(0)
    >>> r, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> a_lr = rng.uniform(0, 1, (1, 8, 2, 4))                 # in-context learning rate
    >>> w = -np.exp(rng.uniform(-2, 0.5, (1, 8, 2, 4)))        # log decay
    >>> o, S = chunk_rwkv7(r, w, k, v, -kk, kk * a_lr, output_final_state=True)
    >>> o_r, _ = fused_mul_recurrent_rwkv7(r, w, k, v, kk, a_lr)
    >>> bool(np.allclose(o, o_r)), S.shape
    (True, (1, 2, 4, 4))
    """
    check_inputs(
        "chunk_rwkv7", r=r, w=w, k=k, v=v, a=a, b=b, scale=scale, initial_state=initial_state
    )
    chunk_size = dplr_chunk_options(
        "chunk_rwkv7", {}, chunk_size=chunk_size, lower_bound=lower_bound,
        cp_context=cp_context,
    )  # fmt: skip
    return dplr_family(
        r, k, v, a, b, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, method="chunked", chunk_size=chunk_size, gate_name="w",
    )  # fmt: skip


@fla_doc
def fused_recurrent_rwkv7(
    r: Array,
    w: Array,
    k: Array,
    v: Array,
    a: Array,
    b: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = True,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_rwkv7``: :func:`chunk_rwkv7`, token by token.

    fla's defaults differ from :func:`chunk_rwkv7`'s and are kept: ``scale=None`` means
    ``K ** -0.5`` here, and the final state is returned by default.

    Parameters
    ----------
    <r>
    <w>
    <k>
    <v_h>
    a, b : array
        The low-rank term ``b_t a_t^T``, ``(B, T, H, K)``.
    scale : float, optional
        Multiplies the receptances; default ``K ** -0.5`` (as in fla; RWKV-7 uses 1).
    <initial_state_h>
    output_final_state : bool
        Return the state after the last token (else ``None``); default True.
    <cu_seqlens>

    Returns
    -------
    <o_rwkv>
    <final_state_h>

    Raises
    ------
    ValueError
        fla's rules: ``B != 1`` or a state count that is not the number of sequences with
        ``cu_seqlens``; ``w``, ``a`` or ``b`` not of shape ``(B, T, H, K)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_rwkv7
    >>> rng = np.random.default_rng(0)
    >>> r, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> w = np.full((1, 8, 2, 4), -0.5)
    >>> o, S = fused_recurrent_rwkv7(r, w, k, v, -kk, 0.5 * kk, scale=1.0)
    >>> o.shape, S.shape
    ((1, 8, 2, 4), (1, 2, 4, 4))
    """
    check_inputs(
        "fused_recurrent_rwkv7", r=r, w=w, k=k, v=v, a=a, b=b, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    return dplr_family(
        r, k, v, a, b, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, method="recurrent",
        gate_name="w",
    )  # fmt: skip


@fla_doc
def fused_mul_recurrent_rwkv7(
    r: Array,
    w: Array,
    k: Array,
    v: Array,
    kk: Array,
    a: Array,
    scale: float = 1.0,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_mul_recurrent_rwkv7``: RWKV-7 from ``kk`` and ``a``, token by token.

    ``kk`` is the normalized key and ``a`` the in-context learning rate:
    :func:`fused_recurrent_rwkv7` with its ``a = -kk`` and ``b = kk * a`` (formed in the work
    dtype, as fla's kernel forms them in float32), ``scale`` 1 by default.

    Parameters
    ----------
    <r>
    <w>
    <k>
    <v_h>
    kk : array
        The normalized keys that the transition erases along, ``(B, T, H, K)``.
    a : array
        The in-context learning rate per channel, ``(B, T, H, K)``, in ``(0, 1)``.
    scale : float
        Multiplies the receptances; default 1 (as in fla).
    <initial_state_h>
    <output_final_state>
    <reverse>
    <cu_seqlens>

    Returns
    -------
    <o_rwkv>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    ValueError
        fla's rules: ``B != 1`` or a state count that is not the number of sequences with
        ``cu_seqlens``; ``w``, ``kk`` or ``a`` not of shape ``(B, T, H, K)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_mul_recurrent_rwkv7
    >>> rng = np.random.default_rng(0)
    >>> r, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> w, a = np.full((1, 8, 2, 4), -0.5), np.full((1, 8, 2, 4), 0.5)
    >>> fused_mul_recurrent_rwkv7(r, w, k, v, kk, a)[0].shape
    (1, 8, 2, 4)
    """
    check_inputs(
        "fused_mul_recurrent_rwkv7", r=r, w=w, k=k, v=v, kk=kk, a=a, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    reject("fused_mul_recurrent_rwkv7", reverse=(reverse, False))
    heads = FlaHeads.of(r, k, v, None, None)
    for name, x in (("kk", kk), ("a", a)):
        heads.per_key_head(x, name)  # fla's names in the shape errors
    dtype, (kk, a) = in_common_dtype(heads.xp, kk, a)
    kk, a = (heads.xp.astype(x, work_dtype(heads.xp, dtype)) for x in (kk, a))
    return dplr_family(
        r, k, v, -kk, kk * a, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, method="recurrent",
        gate_name="w",
    )  # fmt: skip
