"""fla's ``ops.rwkv6``: gated linear attention read before the update, plus a bonus ``u``.

RWKV-6 reads the state before the current token's update and adds the current token through
a per-channel bonus ``u``:

``o_t = scale q_t^T (S_{t-1} + diag(u) k_t v_t^T)``, ``S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T``.

polylin's gated linear attention reads the state after the update. Fed the keys, values and
decays shifted one token later (zeros at each sequence's first token), its state at token
``t`` is RWKV-6's ``S_{t-1}``: its output is RWKV-6's read of the state, the bonus is a dot
product per token, and the last token's update gives the final state.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from ...interop import Array, array_namespace
from ._args import check_inputs, offsets_of, pop_chunk_size, reject, reject_head_first
from ._docs import fla_doc
from ._families import Result, linear_family, static_flags

__all__ = ["chunk_rwkv6", "fused_recurrent_rwkv6"]


def _shift(xp: Any, x: Any, starts: list[int]) -> Any:
    """``x`` ``(B, T, H, d)`` one token later along ``T``, zero at each sequence's start."""
    zero = xp.zeros((x.shape[0], 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    shifted = xp.concat([zero, x[:, :-1, ...]], axis=1)
    if len(starts) <= 1:
        return shifted
    begins = set(starts)
    first = xp.asarray([t in begins for t in range(x.shape[1])], device=x.device)
    return xp.where(xp.reshape(first, (1, -1, 1, 1)), xp.zeros_like(shifted), shifted)


def _rwkv6(
    op: str,
    r: Any,
    k: Any,
    v: Any,
    w: Any,
    u: Any,
    *,
    scale: float | None,
    initial_state: Any,
    output_final_state: bool,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any = None,
    method: str,
    chunk_size: int = 64,
) -> Result:
    check_inputs(op, r=r, k=k, v=v, w=w, u=u, scale=scale, initial_state=initial_state)
    static_flags(output_final_state=output_final_state)
    xp = array_namespace(r)
    B, T, H, K = r.shape
    HV, V = v.shape[2], v.shape[-1]
    if tuple(u.shape) != (H, K):
        raise ValueError(f"{op}: `u` must have shape (H, K) = {(H, K)}, got {tuple(u.shape)}")
    if tuple(w.shape) != tuple(k.shape):
        raise ValueError(
            f"{op}: `w` must have the shape of `k`, {tuple(k.shape)}, got {tuple(w.shape)}"
        )
    offsets = offsets_of(cu_seqlens, cu_seqlens_cpu)
    starts = [0] if offsets is None else list(offsets[:-1])
    o, S = linear_family(
        r, _shift(xp, k, starts), _shift(xp, v, starts), log_decay=_shift(xp, w, starts),
        scale=scale, initial_state=initial_state, output_final_state=True, normalize=False,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, method=method,
        chunk_size=chunk_size,
    )  # fmt: skip
    G = HV // H
    s = float(K**-0.5 if scale is None else scale)
    bonus = xp.sum(r * xp.astype(u, r.dtype) * k, axis=-1) * s  # (B, T, H)
    bonus = xp.reshape(bonus, (B, T, H, 1, 1)) * xp.reshape(v, (B, T, H, G, V))
    o = o + xp.astype(xp.reshape(bonus, (B, T, HV, V)), o.dtype)
    if not output_final_state:
        return o, None
    if offsets is None:
        ends, lengths = [T - 1] * B, [T] * B
        pick = lambda x: x[:, -1, ...]  # noqa: E731
    else:
        ends = [max(e - 1, 0) for e in offsets[1:]]
        lengths = [e - b for b, e in pairwise(offsets)]
        index = xp.asarray(ends, device=r.device)
        pick = lambda x: xp.take(x[0, ...], index, axis=0)  # noqa: E731
    N = len(ends)
    if T == 0 or not any(lengths):
        return o, S
    dt = S.dtype
    decay = xp.exp(xp.astype(pick(w), dt))  # (N, H, K)
    k_T = xp.astype(pick(k), dt)
    v_T = xp.reshape(xp.astype(pick(v), dt), (N, H, G, 1, V))
    S5 = xp.reshape(S, (N, H, G, K, V))
    updated = xp.reshape(decay, (N, H, 1, K, 1)) * S5 + xp.reshape(k_T, (N, H, 1, K, 1)) * v_T
    real = xp.reshape(xp.asarray([n > 0 for n in lengths], device=r.device), (N, 1, 1, 1, 1))
    return o, xp.reshape(xp.where(real, updated, S5), (N, HV, K, V))


@fla_doc
def chunk_rwkv6(
    r: Array,
    k: Array,
    v: Array,
    w: Array,
    u: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_rwkv6``: RWKV-6, gated linear attention with a bonus ``u``.

    ``o_t = scale r_t^T (S_{t-1} + diag(u) k_t v_t^T)``,
    ``S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T``: the state is read before the token's update
    and the current token enters through the bonus ``u``.

    Parameters
    ----------
    <r>
    <k>
    <v_h>
    w : array
        Log decay per token, head and key channel, ``(B, T, H, K)``.
    u : array
        Bonus per head and key channel, ``(H, K)``.
    <scale>
    <initial_state_h>
    <output_final_state>
    <cu_seqlens>
    <cu_seqlens_cpu>
    **kwargs
        ``chunk_size`` (a power of 2) is accepted; any other keyword raises
        ``NotImplementedError``.

    Returns
    -------
    <o_rwkv>
    <final_state_h>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_rwkv6, fused_recurrent_rwkv6
    >>> rng = np.random.default_rng(0)
    >>> r, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> w = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> u = rng.standard_normal((2, 4))
    >>> o, S = chunk_rwkv6(r, k, v, w, u, output_final_state=True)
    >>> o_r, S_r = fused_recurrent_rwkv6(r, k, v, w, u, output_final_state=True)
    >>> bool(np.allclose(o, o_r)), S.shape
    (True, (1, 2, 4, 4))
    """
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_rwkv6", kwargs, None)
    reject("chunk_rwkv6", kwargs)
    return _rwkv6(
        "chunk_rwkv6", r, k, v, w, u, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_rwkv6(
    r: Array,
    k: Array,
    v: Array,
    w: Array,
    u: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_rwkv6``: :func:`chunk_rwkv6`, token by token.

    Parameters
    ----------
    <r>
    <k>
    <v_h>
    w : array
        Log decay per token, head and key channel, ``(B, T, H, K)``.
    u : array
        Bonus per head and key channel, ``(H, K)``.
    <scale>
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
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_rwkv6
    >>> rng = np.random.default_rng(0)
    >>> r, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> w = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> fused_recurrent_rwkv6(r, k, v, w, rng.standard_normal((2, 4)))[0].shape
    (1, 8, 2, 4)
    """
    reject("fused_recurrent_rwkv6", reverse=(reverse, False))
    return _rwkv6(
        "fused_recurrent_rwkv6", r, k, v, w, u, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, method="recurrent",
    )  # fmt: skip
