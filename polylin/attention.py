"""Public entry points: validate, map features, dispatch to an algorithm."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from ._chunked import causal_chunked
from ._decay import check_log_decay, check_normalize, pack_log_decay
from ._policy import DEFAULT_CHUNK_SIZE, DEFAULT_EPS
from ._prepare import apply_feature_map, finish
from ._quadratic import quadratic
from ._recurrent import causal_recurrent
from ._state import LinearAttentionState
from ._validation import check_cu_seqlens, check_mask, check_options, check_qkv, check_state
from ._varlen import length_mask, pack, unpack

__all__ = [
    "METHODS",
    "causal_linear_attention",
    "linear_attention",
    "masked_kernel_attention",
]

#: The algorithms of :func:`causal_linear_attention`; they compute the same function.
METHODS = ("chunked", "recurrent", "quadratic")

FeatureMap = Callable[[Any], Any]


def causal_linear_attention(
    q: Any,
    k: Any,
    v: Any,
    /,
    feature_map: FeatureMap | None = None,
    *,
    method: str = "chunked",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = DEFAULT_EPS,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    attention_mask: Any | None = None,
    cu_seqlens: Sequence[int] | None = None,
    log_decay: Any | None = None,
    normalize: bool = True,
) -> Any:
    r"""Causal linear attention: ``o_t = phi(q_t) S_t / (phi(q_t) @ z_t + eps)``.

    ``S_t = sum_{s<=t} phi(k_s) v_s^T`` and ``z_t = sum_{s<=t} phi(k_s)``. The three methods
    compute the same function (to round-off) at different costs. With ``log_decay`` the state
    decays before each token is added, ``S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T`` (and
    ``z`` alike): RetNet, gated linear attention, Mamba-2 (see :doc:`/decay`).

    Parameters
    ----------
    q, k : array
        Queries and keys, shape ``(..., T, d_k)``, any number of leading batch/head dimensions.
    v : array
        Values, shape ``(..., T, d_v)``, the same leading dimensions and dtype.
    feature_map : callable, optional
        Positive feature map applied to ``q`` and ``k``; default
        :func:`polylin.feature_maps.elu_plus_one`. If it has a ``map_query`` method, that maps the
        queries (any per-query scale cancels in the normalization; see
        :func:`polylin.feature_maps.favor_plus`).
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: the parallel chunkwise form, O(T C d + T d_k d_v), never a T x T matrix.
        ``"recurrent"``: one state update per token, O(d_k d_v) memory. ``"quadratic"``: the
        masked kernel form, O(T^2).
    chunk_size : int
        Chunk length C of the chunked form (T need not be a multiple of it).
    eps : float
        Added to the normalizer ``phi(q_t) . z_t``; must be > 0.
    initial_state : LinearAttentionState, optional
        State ``(S, z)`` to continue from, shapes ``(..., d_phi, d_v)`` and ``(..., d_phi)``.
        With ``cu_seqlens`` there is one per sequence: ``(..., N, d_phi, d_v)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        ``(..., T)``, True for real tokens, broadcastable to ``q.shape[:-1]``. Masked keys add to
        neither S nor z; outputs at masked positions are exactly zero. Left or right padding.
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis.
    log_decay : float or array, optional
        Log of the decay factor ``g_t <= 0``: a float (one decay everywhere) or an array that
        broadcasts against the mapped keys ``(..., T, d_phi)``, with a trailing axis of 1 (one
        gate per token, e.g. ``(heads, 1, 1)`` for a fixed decay per head) or ``d_phi`` (one
        per feature channel). Positive values (growth) are outside the contract. Gradients
        flow to it.
    normalize : bool
        Divide by the normalizer ``phi(q_t) . z_t + eps``; ``False`` returns the numerator
        ``phi(q_t) S_t`` (RetNet, GLA and Mamba-2 do not normalize; ``eps`` is then unused).
        The state keeps ``z`` either way.

    Returns
    -------
    array or (array, LinearAttentionState)
        The output, shape ``(..., T, d_v)``, same library, device and dtype as ``q``; with
        ``return_state`` also the final state (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, a non-callable feature map.
    ValueError
        Mismatched shapes or devices, an unknown method, ``chunk_size < 1``, ``eps <= 0``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_linear_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 2, 16, 8))
    >>> v = rng.standard_normal((2, 16, 4))
    >>> out = causal_linear_attention(q, k, v)
    >>> out.shape
    (2, 16, 4)
    >>> bool(np.allclose(out[:, 0], v[:, 0]))  # position 0 attends to itself only
    True
    >>> ref = causal_linear_attention(q, k, v, method="quadratic")
    >>> bool(np.allclose(out, ref))
    True
    """
    inputs = check_qkv(q, k, v, causal=True)
    check_options(eps=eps, chunk_size=chunk_size)
    check_normalize(normalize)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass attention_mask or cu_seqlens, not both")
        offsets = check_cu_seqlens(cu_seqlens, q.shape[-2])
        max_len = max(b - a for a, b in pairwise(offsets))
        decay = check_log_decay(inputs, log_decay, length=q.shape[-2], d_phi=None)
        out, state = causal_linear_attention(
            *(pack(inputs.xp, x, offsets, max_len) for x in (q, k, v)),
            feature_map,
            method=method,
            chunk_size=chunk_size,
            eps=eps,
            initial_state=initial_state,
            return_state=True,
            attention_mask=length_mask(inputs.xp, offsets, max_len, inputs.device),
            log_decay=pack_log_decay(
                inputs.xp, decay, lambda x: pack(inputs.xp, x, offsets, max_len)
            ),
            normalize=normalize,
        )
        out = unpack(inputs.xp, out, offsets)
        return (out, state) if return_state else out

    v = inputs.to_work_dtype(v)
    mask = None
    if attention_mask is not None:
        mask = check_mask(inputs, attention_mask, q.shape[-2])

    def features(q: Any, k: Any, mask: Any | None) -> tuple[Any, Any]:
        # A feature map acts on each token alone, so the chunked form maps block by block.
        fq, fk = apply_feature_map(inputs, feature_map, q, k)
        return fq, (fk if mask is None else fk * mask)

    T = q.shape[-2]
    # The chunked form maps its own blocks: there a one-token probe gives the feature size.
    if method == "chunked":
        fq, fk = features(q[..., : min(T, 1), :], k[..., : min(T, 1), :], None)
    else:
        fq, fk = features(q, k, mask)
    S, z = check_state(
        inputs, initial_state, inputs.batch_shape, fq.shape[-1], v.shape[-1], name="initial_state"
    )
    decay = check_log_decay(inputs, log_decay, length=T, d_phi=fq.shape[-1], mask=mask)
    xp = inputs.xp
    options = {"eps": eps, "log_decay": decay, "normalize": normalize}
    if method == "chunked":
        out, S, z = causal_chunked(
            xp, features, q, k, v, S, z, mask=mask, chunk_size=chunk_size, **options
        )
    elif method == "recurrent":
        out, S, z = causal_recurrent(xp, fq, fk, v, S, z, **options)
    else:
        out, S, z = quadratic(xp, fq, fk, v, S, z, causal=True, **options)
    out = finish(inputs, out, mask)
    return (out, LinearAttentionState(S, z)) if return_state else out


def linear_attention(
    q: Any,
    k: Any,
    v: Any,
    /,
    feature_map: FeatureMap | None = None,
    *,
    eps: float = DEFAULT_EPS,
    attention_mask: Any | None = None,
    normalize: bool = True,
) -> Any:
    """Non-causal linear attention: every query attends to every key.

    ``o_i = phi(q_i) S / (phi(q_i) . z + eps)`` with ``S = phi(K)^T V`` and ``z = phi(K)^T 1``,
    computed in O(T d_k d_v); the query length may differ from the key length.

    Parameters
    ----------
    q : array
        Queries, shape ``(..., T_q, d_k)``.
    k : array
        Keys, shape ``(..., T_k, d_k)``.
    v : array
        Values, shape ``(..., T_k, d_v)``.
    feature_map : callable, optional
        Positive feature map; default :func:`polylin.feature_maps.elu_plus_one`.
    eps : float
        Added to the normalizer; must be > 0.
    attention_mask : array of bool, optional
        ``(..., T_k)``, True for real keys; masked keys add to neither S nor z. When
        ``T_q == T_k`` (self-attention) the outputs at masked positions are also zero.
    normalize : bool
        Divide by ``phi(q_i) . z + eps``; ``False`` returns ``phi(q_i) S`` (``eps`` unused).

    Returns
    -------
    array
        Shape ``(..., T_q, d_v)``, same library, device and dtype as ``q``.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes.
    ValueError
        Mismatched shapes or devices, ``eps <= 0``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import linear_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 8))   # 3 queries
    >>> k = rng.standard_normal((5, 8))   # 5 keys
    >>> v = np.ones((5, 2))
    >>> linear_attention(q, k, v).round(6)  # weights sum to one (up to eps): the mean of ones
    array([[1., 1.],
           [1., 1.],
           [1., 1.]])
    """
    inputs = check_qkv(q, k, v, causal=False)
    check_options(eps=eps)
    check_normalize(normalize)
    xp = inputs.xp
    fq, fk = apply_feature_map(inputs, feature_map, q, k)
    v = inputs.to_work_dtype(v)
    query_mask = None
    if attention_mask is not None:
        mask = check_mask(inputs, attention_mask, k.shape[-2])
        fk = fk * mask
        query_mask = mask if q.shape[-2] == k.shape[-2] else None
    S = xp.matmul(xp.matrix_transpose(fk), v)
    out = xp.matmul(fq, S)
    if normalize:
        z = xp.sum(fk, axis=-2)
        out = out / (xp.matmul(fq, z[..., None]) + eps)
    return finish(inputs, out, query_mask)


def masked_kernel_attention(
    q: Any,
    k: Any,
    v: Any,
    /,
    feature_map: FeatureMap | None = None,
    *,
    causal: bool = True,
    eps: float = DEFAULT_EPS,
    log_decay: Any | None = None,
    normalize: bool = True,
) -> Any:
    """The quadratic reference: ``A = tril(phi(Q) phi(K)^T)``, ``O = A V / (A 1 + eps)``.

    Exact and simple, O(T^2) time and memory: use it to check the linear forms and for short
    sequences. ``causal=False`` drops the mask (then ``T_q`` may differ from ``T_k``). With
    ``log_decay`` the scores are ``A_ts = sum_c phi(q_t)_c phi(k_s)_c exp(sum_{s<r<=t} g_rc)``
    for ``s <= t`` (causal only; see :doc:`/decay`).

    Parameters
    ----------
    q, k : array
        Queries and keys, shape ``(..., T, d_k)``.
    v : array
        Values, shape ``(..., T, d_v)``.
    feature_map : callable, optional
        Positive feature map; default :func:`polylin.feature_maps.elu_plus_one`.
    causal : bool
        Apply the lower-triangular mask (query t sees keys s <= t).
    eps : float
        Added to the row sums ``A 1``; must be > 0.
    log_decay : float or array, optional
        Log decay ``g_t <= 0``, as in :func:`causal_linear_attention`; needs ``causal=True``.
    normalize : bool
        Divide by ``A 1 + eps``; ``False`` returns ``A V``.

    Returns
    -------
    array
        Shape ``(..., T_q, d_v)``, same library, device and dtype as ``q``.

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes.
    ValueError
        Mismatched shapes or devices, ``eps <= 0``, ``log_decay`` with ``causal=False``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import masked_kernel_attention
    >>> q = k = np.zeros((3, 2))          # phi(0) = 1: equal weights on the visible keys
    >>> v = np.array([[3.0], [1.0], [2.0]])
    >>> masked_kernel_attention(q, k, v).round(5)  # running means 3, (3+1)/2, (3+1+2)/3
    array([[3.],
           [2.],
           [2.]])
    """
    inputs = check_qkv(q, k, v, causal=causal)
    check_options(eps=eps)
    check_normalize(normalize)
    if log_decay is not None and not causal:
        raise ValueError("log_decay needs causal=True (a decay runs forward in time)")
    fq, fk = apply_feature_map(inputs, feature_map, q, k)
    v = inputs.to_work_dtype(v)
    S, z = check_state(inputs, None, inputs.batch_shape, fq.shape[-1], v.shape[-1], name="state")
    decay = check_log_decay(inputs, log_decay, length=k.shape[-2], d_phi=fq.shape[-1])
    out, _, _ = quadratic(
        inputs.xp, fq, fk, v, S, z, causal=causal, eps=eps, log_decay=decay, normalize=normalize
    )
    return finish(inputs, out, None)
