"""Public entry points: validate, map features, dispatch to an algorithm."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._backend.execution import scans_tokens, with_derivatives_of
from ._backend.ops import matmul
from ._forms.linear.chunked import causal_chunked
from ._forms.linear.quadratic import quadratic
from ._forms.linear.recurrent import causal_recurrent
from ._inputs.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_EPS
from ._inputs.gates import check_log_decay, check_normalize, standard_log_decay
from ._inputs.layout import DEFAULT_SEQ_AXIS, standard_layout
from ._inputs.prepare import apply_feature_map, finish, select
from ._inputs.sequences import check_scale, run_sequences
from ._inputs.state import LinearAttentionState
from ._inputs.validation import (
    check_flag,
    check_mask,
    check_method,
    check_options,
    check_qkv,
    check_state,
)
from ._typing import Array

__all__ = [
    "METHODS",
    "causal_linear_attention",
    "linear_attention",
    "masked_kernel_attention",
]

#: The algorithms of :func:`causal_linear_attention`; they compute the same function.
METHODS = ("chunked", "recurrent", "quadratic")

FeatureMap = Callable[[Array], Array]


def causal_linear_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap | None = None,
    *,
    method: str = "chunked",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float = DEFAULT_EPS,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    attention_mask: Array | None = None,
    cu_seqlens: Sequence[int] | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
    log_decay: Array | float | None = None,
    normalize: bool = True,
    scale: float = 1.0,
) -> Array | tuple[Array, LinearAttentionState]:
    r"""Causal linear attention: ``o_t = phi(q_t) S_t / (phi(q_t) @ z_t + eps)``.

    ``S_t = sum_{s<=t} phi(k_s) v_s^T`` and ``z_t = sum_{s<=t} phi(k_s)``. The three methods
    compute the same function (to round-off) at different costs. With ``log_decay`` the state
    decays before each token is added, ``S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T`` (and
    ``z`` alike): RetNet, gated linear attention, Mamba-2 (see :doc:`/decay`).

    Parameters
    ----------
    q, k : array
        Queries and keys, shape ``(..., T, d_k)``, any number of leading batch/head dimensions
        (with ``seq_axis``, T may sit on another axis: ``(B, T, H, d_k)`` with ``seq_axis=1``).
    v : array
        Values, shape ``(..., T, d_v)``, the same dtype. The leading dimensions of ``q``, ``k``
        and ``v`` broadcast against each other (grouped heads: ``q, k`` of ``(B, H, 1, T, d_k)``
        against ``v`` of ``(B, H, G, T, d_v)``, never copied per group); the output and the
        state have the broadcast ones.
    feature_map : callable, optional
        Positive feature map applied to ``q`` and ``k``; default
        :func:`polylin.feature_maps.elu_plus_one`. If it has a ``map_query`` method, that maps the
        queries (any per-query scale cancels in the normalization; see
        :func:`polylin.feature_maps.favor_plus`). It must return a real floating array of the
        inputs' library, ``(..., d_phi)``, and act on each token alone.
    method : {"chunked", "recurrent", "quadratic"}
        ``"chunked"``: the parallel chunkwise form, O(T C d + T d_k d_v), never a T x T matrix.
        ``"recurrent"``: one state update per token, O(d_k d_v) memory. ``"quadratic"``: the
        masked kernel form, O(T^2).
    chunk_size : int
        Chunk length C of the chunked form (T need not be a multiple of it); any integer >= 1
        (checked for every method). On CPU backends a per-channel ``log_decay`` runs chunks of
        at most ``max(32, d_phi / 2)`` tokens; the results agree to round-off whatever C.
    eps : float
        Added to the normalizer ``phi(q_t) . z_t``; any real number that is positive and finite
        in the work dtype (at least its smallest normal number: ``1.2e-38`` for float32).
    initial_state : LinearAttentionState, optional
        State ``(S, z)`` to continue from, shapes ``(..., d_phi, d_v)`` and ``(..., d_phi)``
        (``...``: the inputs' broadcast leading dimensions without T; size-1 axes broadcast),
        in the work dtype. With
        ``cu_seqlens`` there is one per sequence: ``(..., N, d_phi, d_v)``.
    return_state : bool
        Also return the state after the last token.
    attention_mask : array of bool, optional
        True for real tokens. A 2-D ``(batch, T)`` mask (what a tokenizer returns) always means
        the first leading axis and the time axis, for any layout and number of head axes; any
        other mask has the shape of ``q`` without its feature axis (size-1 axes broadcast), in
        the inputs' layout. Masked positions are selected away, never multiplied: whatever
        ``q``, ``k``, ``v`` hold there (NaN, inf), they add to neither S nor z, real outputs
        are those without them, and masked outputs are exactly zero. Left or right padding.
    cu_seqlens : sequence of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed independent sequences along the T axis.
    seq_axis : int
        The axis of T in ``q``, ``k`` and ``v`` (default -2: ``(..., T, d)``); ``seq_axis=1``
        takes ``(batch, T, heads, d)``. The output keeps the input layout; the state's leading
        dimensions are the inputs' without T and the feature axis.
    log_decay : float or array, optional
        Log of the decay factor ``g_t <= 0``: a float (one decay everywhere) or an array that
        broadcasts against the mapped keys ``(..., T, d_phi)``, with a trailing axis of 1 (one
        gate per token, e.g. ``(heads, 1, 1)`` for a fixed decay per head) or ``d_phi`` (one
        per feature channel). An array with fewer dimensions than the mapped keys whose last
        axis may be their channel axis or the one before it (``(batch, heads, T)`` with ``T ==
        d_phi``) does not say which gate it is: a ``ValueError``. With ``seq_axis`` other than
        -2 an array has the full rank of ``q``, in the inputs' layout (a number or a 0-d array
        broadcasts in any layout). A number is the same value at every token: masked tokens
        take 0 (``attention_mask``) whatever ``log_decay`` is. A decay
        never amplifies the state: a number must be finite and ``<= 0`` (else a
        ``ValueError``), array values above 0 are taken as 0 (their gradient is 0), and an
        array value of ``-inf`` is an exact reset. Gradients flow to it.
    normalize : bool
        Divide by the normalizer ``phi(q_t) . z_t + eps``; ``False`` returns the numerator
        ``phi(q_t) S_t`` (RetNet, GLA and Mamba-2 do not normalize; ``eps`` is then unused).
        The state keeps ``z`` either way.
    scale : float
        Multiplies the mapped queries: ``o_t = S_t^T (scale phi(q_t))`` (GLA, RetNet and fla's
        ops scale by ``d_k ** -0.5``); normalized, numerator and normalizer alike, so that only
        ``eps`` weighs differently. The state does not depend on it. Given here rather than
        applied to ``q`` first, it costs no pass over the queries where a gate's factors
        carry it (the chunked form with a ``log_decay`` array).

    Returns
    -------
    array or (array, LinearAttentionState)
        The output, the shape of ``q`` with ``d_v`` features, same library, device and dtype as
        ``q``; with ``return_state`` also the final state (float32 for 16-bit inputs).

    Raises
    ------
    TypeError
        Arrays from different libraries, non-floating dtypes, unsupported arrays (NumPy masked
        arrays, ml_dtypes dtypes, sparse tensors), a non-callable feature map or one returning
        another library or a complex array, a state of another dtype, options of the wrong type
        or traced under ``jax.jit`` (they must be static).
    ValueError
        Mismatched shapes or devices, a mask that fits neither mask rule, an unknown method,
        ``chunk_size < 1``, ``eps`` not positive and finite in the work dtype, a number
        ``log_decay`` above 0, a ``scale`` that is not finite.

    Notes
    -----
    Non-finite values: a NaN or inf in an *unmasked* query or key at position t never changes
    an output before t (all methods). A non-finite *value* ``v_t`` does reach earlier outputs
    through a matrix product (``0 * nan`` is NaN): in the chunked form the outputs from the
    start of t's chunk (``t - t % chunk_size``), in the quadratic form all outputs; only the
    recurrent form keeps every output before t. See the documentation page "Numerics and
    non-finite values".

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
    layout, q, k, v = standard_layout(seq_axis, q=q, k=k, v=v)
    log_decay = standard_log_decay(layout, log_decay)
    inputs = check_qkv(q, k, v, causal=True)
    eps, checked_chunk_size = check_options(eps=eps, chunk_size=chunk_size, inputs=inputs)
    chunk_size = chunk_size if checked_chunk_size is None else checked_chunk_size  # an int
    check_method(method, METHODS)
    check_normalize(normalize)
    check_flag("return_state", return_state)
    scale = check_scale(scale)
    xp, T = inputs.xp, q.shape[-2]
    shapes = (layout.caller_shape(tuple(q.shape)), layout.caller_shape(tuple(k.shape)))

    def features(q: Array, k: Array, keep: Array | None) -> tuple[Array, Array]:
        # A feature map acts on each token alone, so the chunked form maps block by block.
        fq, fk = apply_feature_map(inputs, feature_map, q, k, shapes=shapes)
        # phi(0) is not 0: masked keys are selected away again after the map.
        return fq, select(xp, keep, fk)

    # The feature size, from one token (the chunked form maps its own blocks).
    d_phi = features(q[..., : min(T, 1), :], k[..., : min(T, 1), :], None)[0].shape[-1]
    d_v = v.shape[-1]
    # The recurrent form takes values above 0 as 0 itself (no operation before its loop).
    decay = check_log_decay(
        inputs, log_decay, length=T, d_phi=d_phi, layout=layout, clamp=method != "recurrent"
    )
    arrays = [q, k, inputs.to_work_dtype(v)] + ([] if decay is None else [decay])

    def scaled(q: Array, k: Array, keep: Array | None) -> tuple[Array, Array]:
        fq, fk = features(q, k, keep)
        return (fq if scale == 1.0 else fq * scale), fk

    def algorithm(arrays: list[Array], state: Any, keep: Array | None) -> tuple[Array, Any]:
        q, k, v, *rest = arrays
        g = rest[0] if rest else None
        S, z = state
        if method == "chunked" and scans_tokens(xp, v):
            out, S, z = _scanned_chunked(
                xp, *scaled(q, k, keep), v, S, z, g, chunk_size=chunk_size, eps=eps,
                normalize=normalize,
            )  # fmt: skip
        elif method == "chunked":
            out, S, z = causal_chunked(
                xp, features, q, k, v, S, z, mask=keep, chunk_size=chunk_size, eps=eps,
                log_decay=g, normalize=normalize, scale=scale,
            )  # fmt: skip
        elif method == "recurrent":  # scales the queries itself (on the loop's arrays)
            out, S, z = causal_recurrent(
                xp, *features(q, k, keep), v, S, z, eps=eps, log_decay=g, normalize=normalize,
                scale=scale,
            )  # fmt: skip
        else:
            out, S, z = quadratic(
                xp, *scaled(q, k, keep), v, S, z, causal=True, eps=eps, log_decay=g,
                normalize=normalize,
            )  # fmt: skip
        return out, LinearAttentionState(S, z)

    def check_initial_state(initial_state: Any, leading: tuple) -> LinearAttentionState:
        S, z = check_state(inputs, initial_state, leading, d_phi, d_v, name="initial_state")
        return LinearAttentionState(S, z)

    return run_sequences(
        inputs,
        layout,
        arrays,
        algorithm,
        length=T,
        check_state=check_initial_state,
        initial_state=initial_state,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
    )


def _scanned_chunked(
    xp: Any,
    fq: Array,
    fk: Array,
    v: Array,
    S: Array,
    z: Array,
    decay: Array | None,
    *,
    chunk_size: int,
    eps: float,
    normalize: bool,
) -> tuple[Array, Array, Array]:
    """The chunked form where the backend scans its forward
    (``_backend.execution.scans_tokens``): the values of the scan over tokens, the derivatives
    of the chunked form (``fq``, ``fk`` mapped and masked already)."""

    def scanned(fq: Array, fk: Array, v: Array, S: Array, z: Array, g: Array | None) -> Any:
        return causal_recurrent(
            xp, fq, fk, v, S, z, eps=eps, log_decay=g, normalize=normalize, scanned=True
        )

    def chunked(fq: Array, fk: Array, v: Array, S: Array, z: Array, g: Array | None) -> Any:
        return causal_chunked(
            xp, lambda q, k, _: (q, k), fq, fk, v, S, z, log_decay=g, chunk_size=chunk_size,
            eps=eps, normalize=normalize,
        )  # fmt: skip

    return with_derivatives_of(scanned, chunked)(fq, fk, v, S, z, decay)


def linear_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap | None = None,
    *,
    eps: float = DEFAULT_EPS,
    attention_mask: Array | None = None,
    seq_axis: int = DEFAULT_SEQ_AXIS,
    normalize: bool = True,
) -> Array:
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
        Added to the normalizer; positive and finite in the work dtype.
    attention_mask : array of bool, optional
        True for real keys: ``(batch, T_k)``, or the shape of ``k`` without its feature axis
        (size-1 axes broadcast), as for :func:`causal_linear_attention`. Masked keys and values
        add to neither S nor z whatever they hold. When ``T_q == T_k`` (self-attention) the
        outputs at masked positions are also exactly zero.
    seq_axis : int
        The axis of T in ``q``, ``k`` and ``v`` (default -2); the output keeps the layout.
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
        Mismatched shapes or devices, ``eps`` not positive and finite in the work dtype.

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
    layout, q, k, v = standard_layout(seq_axis, q=q, k=k, v=v)
    inputs = check_qkv(q, k, v, causal=False)
    eps, _ = check_options(eps=eps, inputs=inputs)
    check_normalize(normalize)
    xp = inputs.xp
    mask = query_mask = None
    if attention_mask is not None:
        mask = check_mask(inputs, attention_mask, k.shape[-2], layout)
        query_mask = mask if q.shape[-2] == k.shape[-2] else None
    k, v = select(xp, mask, k), select(xp, mask, v)
    shapes = (layout.caller_shape(tuple(q.shape)), layout.caller_shape(tuple(k.shape)))
    fq, fk = apply_feature_map(inputs, feature_map, select(xp, query_mask, q), k, shapes=shapes)
    fk = select(xp, mask, fk)
    v = inputs.to_work_dtype(v)
    S = matmul(xp, xp.matrix_transpose(fk), v)
    out = matmul(xp, fq, S)
    if normalize:
        z = xp.sum(fk, axis=-2)
        out = out / (matmul(xp, fq, z[..., None]) + eps)
    return layout.restore(finish(inputs, out, query_mask))


def masked_kernel_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap | None = None,
    *,
    causal: bool = True,
    eps: float = DEFAULT_EPS,
    seq_axis: int = DEFAULT_SEQ_AXIS,
    log_decay: Array | float | None = None,
    normalize: bool = True,
) -> Array:
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
        Added to the row sums ``A 1``; positive and finite in the work dtype.
    seq_axis : int
        The axis of T in ``q``, ``k`` and ``v`` (default -2); the output keeps the layout.
    log_decay : float or array, optional
        Log decay ``g_t <= 0``, as in :func:`causal_linear_attention` (array values above 0
        are taken as 0); needs ``causal=True``.
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
        Mismatched shapes or devices, ``eps`` not positive and finite in the work dtype,
        ``log_decay`` with ``causal=False``.

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
    layout, q, k, v = standard_layout(seq_axis, q=q, k=k, v=v)
    log_decay = standard_log_decay(layout, log_decay)
    check_flag("causal", causal)  # before check_qkv, which branches on it
    inputs = check_qkv(q, k, v, causal=causal)
    eps, _ = check_options(eps=eps, inputs=inputs)
    check_normalize(normalize)
    if log_decay is not None and not causal:
        raise ValueError("log_decay needs causal=True (a decay runs forward in time)")
    shapes = (layout.caller_shape(tuple(q.shape)), layout.caller_shape(tuple(k.shape)))
    fq, fk = apply_feature_map(inputs, feature_map, q, k, shapes=shapes)
    v = inputs.to_work_dtype(v)
    S, z = check_state(inputs, None, inputs.batch_shape, fq.shape[-1], v.shape[-1], name="state")
    decay = check_log_decay(
        inputs, log_decay, length=k.shape[-2], d_phi=fq.shape[-1], layout=layout
    )
    out, _, _ = quadratic(
        inputs.xp, fq, fk, v, S, z, causal=causal, eps=eps, log_decay=decay, normalize=normalize
    )
    return layout.restore(finish(inputs, out, None))
