"""flash-linear-attention's ops, computed by polylin: ``from polylin.compat import fla``.

Each function has the name, signature, defaults, layout and return value of the fla 0.6.0 op of
the same name (``fla.ops.<family>.chunk`` / ``fused_recurrent``): inputs ``(B, T, H, d)``,
values and gates with ``HV`` heads (a multiple of ``H``: grouped value heads), ``scale=None``
meaning ``d_k ** -0.5`` (``chunk_rwkv7`` defaults to 1, as fla's does), states
``(N, HV, d_k, d_v)``, ``cu_seqlens`` offsets with ``B == 1``, and a return value
``(o, final_state or None)``. They take arrays of any array-API library (NumPy, PyTorch on CPU
or GPU, JAX, CuPy, ...) and return the inputs' library, device and dtype. ``chunk_*`` run
polylin's chunked form, ``fused_recurrent_*`` its per-token recurrence: the same function
either way. An integer array argument is a ``TypeError`` naming it, and a first argument whose
shape reads as ``T < H`` (``1 < q.shape[1] < q.shape[2]``: head-first ``(B, H, T, d)`` inputs,
which compute a wrong answer) warns with a ``UserWarning``.

The ops: ``chunk_linear_attn``, ``chunk_simple_gla``, ``chunk_gla`` and their
``fused_recurrent_*`` twins, ``chunk_retention`` (linear attention and its gated forms);
``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda`` and their twins (the delta
family); ``chunk_dplr_delta_rule``, ``chunk_rwkv7``, their twins and
``fused_mul_recurrent_rwkv7`` (the generalized delta rule, RWKV-7).

They translate arguments only: every number comes from :func:`polylin.causal_linear_attention`,
:func:`polylin.delta_rule_attention` or :func:`polylin.dplr_delta_rule`. An fla option polylin
does not compute (a gate applied inside the kernel, reverse scans, context parallelism) raises
``NotImplementedError`` naming it.
See the documentation page "Coming from flash-linear-attention".
"""

from __future__ import annotations

import math
from typing import Any

from .._backend.execution import check_static
from .._backend.namespace import array_namespace, device, is_array
from .._inputs.state import LinearAttentionState
from .._typing import Array
from ..attention import causal_linear_attention
from ..delta_rule import delta_rule_attention
from ..dplr import dplr_delta_rule
from ._fla_args import (
    FlaHeads,
    ScaledQuery,
    check_inputs,
    default_scale,
    describe,
    in_common_dtype,
    offsets_of,
    pop_chunk_size,
    reject,
    reject_head_first,
    state_v_first_alias,
    work_dtype,
)
from ._fla_decode import TokenCall, plan_token, run_token, token_plan
from ._fla_docs import fla_doc

__all__ = [
    "FLA_VERSION",
    "chunk_delta_rule",
    "chunk_dplr_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_kda",
    "chunk_linear_attn",
    "chunk_retention",
    "chunk_rwkv7",
    "chunk_simple_gla",
    "fused_mul_recurrent_rwkv7",
    "fused_recurrent_delta_rule",
    "fused_recurrent_dplr_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_kda",
    "fused_recurrent_linear_attn",
    "fused_recurrent_rwkv7",
    "fused_recurrent_simple_gla",
]

#: The flash-linear-attention release whose signatures these functions follow.
FLA_VERSION = "0.6.0"

#: fla's normalized linear attention adds this to ``q . z``.
_FLA_NORMALIZER_EPS = 1e-10

Result = tuple[Array, Any]


def _static_flags(**flags: Any) -> None:
    """fla's flags are taken by truthiness, as fla takes them; a traced one (under
    ``jax.jit``) has none until the function runs: a ``TypeError`` that says how to keep it
    static, not JAX's error about a boolean conversion."""
    for name, value in flags.items():
        check_static(name, value)


# --------------------------------------------------------------------------------------------
# The linear-attention family: causal_linear_attention(..., log_decay=..., normalize=...)
# --------------------------------------------------------------------------------------------


def _linear_family(
    q: Any,
    k: Any,
    v: Any,
    *,
    log_decay: Any,
    scale: float | None,
    initial_state: Any,
    output_final_state: bool,
    normalize: bool,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any = None,
    state_v_first: bool = False,
    method: str,
    chunk_size: int = 64,
) -> Result:
    """One fla linear-attention op as one :func:`polylin.causal_linear_attention` call."""
    _static_flags(
        output_final_state=output_final_state, normalize=normalize, state_v_first=state_v_first
    )
    kv_init, z_init = initial_state, None
    if normalize and isinstance(initial_state, tuple):
        kv_init, z_init = initial_state
    offsets = offsets_of(cu_seqlens, cu_seqlens_cpu)
    heads = FlaHeads.of(q, k, v, offsets, kv_init if kv_init is not None else z_init)
    dtype = work_dtype(heads.xp, q.dtype)
    state = None
    if kv_init is not None or z_init is not None:
        n_states = len(offsets) - 1 if offsets is not None else heads.batch
        d_k, d_v = k.shape[-1], v.shape[-1]
        S = heads.state_in(kv_init, dtype, v_first=state_v_first)
        if S is None:
            S = heads.zeros_state(n_states, (d_k, d_v), dtype, device(q))
        if z_init is None:
            z = heads.zeros_state(n_states, (d_k,), dtype, device(q))
        else:
            z = heads.normalizer_in(z_init, dtype)
        state = LinearAttentionState(S, z)
    o, final = causal_linear_attention(
        heads.query_key(q),
        heads.query_key(k),
        heads.per_value_head(v, "v"),
        ScaledQuery(default_scale(scale, k.shape[-1])),
        method=method,
        chunk_size=chunk_size,
        eps=_FLA_NORMALIZER_EPS,
        initial_state=state,
        return_state=True,
        cu_seqlens=offsets,
        seq_axis=heads.seq_axis,
        log_decay=heads.per_value_head(log_decay, "g", channels=True),
        normalize=normalize,
    )
    o = heads.output(o)
    S_out = heads.state_out(final.S, v_first=state_v_first) if output_final_state else None
    if normalize:
        return o, (S_out, heads.normalizer_out(final.z))
    return o, S_out


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
    return _linear_family(
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
    return _linear_family(
        q, k, v, log_decay=None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, normalize=normalize, cu_seqlens=cu_seqlens,
        method="recurrent",
    )  # fmt: skip


def _simple_gate(op: str, g: Any, g_gamma: Any, q: Any) -> Any:
    """fla's head-wise gate: ``g`` ``(B, T, H)`` per token or ``g_gamma`` ``(H,)`` per head."""
    if g is not None and g_gamma is not None:
        raise ValueError(f"{op}: pass one of `g` or `g_gamma`, not both")
    if g_gamma is None:
        return g
    return array_namespace(q).reshape(g_gamma, (1, 1, g_gamma.shape[0]))


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
    return _linear_family(
        q, k, v, log_decay=_simple_gate("chunk_simple_gla", g, g_gamma, q), scale=scale,
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
    return _linear_family(
        q, k, v, log_decay=_simple_gate("fused_recurrent_simple_gla", g, g_gamma, q),
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        normalize=False, cu_seqlens=cu_seqlens, state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip


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
    return _linear_family(
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
    return _linear_family(
        q, k, v, log_decay=gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, normalize=False, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip


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
    return _linear_family(
        q, k, v, log_decay=_simple_gate("chunk_retention", None, g_gamma, q), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, normalize=False,
        cu_seqlens=cu_seqlens, method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The delta family: delta_rule_attention(..., log_decay=...)
# --------------------------------------------------------------------------------------------


def _delta_family(
    op: str,
    q: Any,
    k: Any,
    v: Any,
    beta: Any,
    g: Any,
    *,
    scale: float | None,
    initial_state: Any,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any = None,
    state_v_first: bool = False,
    method: str,
    chunk_size: int = 64,
) -> Result:
    """One fla delta-rule op as one :func:`polylin.delta_rule_attention` call.

    A recurrent call of one token (a decoding loop's) runs as :func:`polylin.delta_rule_step`
    once a call of its signature has been checked (``_fla_decode``).
    """
    _static_flags(
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        state_v_first=state_v_first,
    )  # fmt: skip
    offsets = offsets_of(cu_seqlens, cu_seqlens_cpu)
    decoding = (
        method == "recurrent" and offsets is None and getattr(q, "shape", (0, 0))[1:2] == (1,)
    )
    if decoding:
        arrays = (q, k, v, beta, g, initial_state)
        # A 0-d array scale is a number here: the key must hash.
        key_scale = None if scale is None else float(scale)
        options = (key_scale, bool(use_qk_l2norm_in_kernel), state_v_first)
        kept = token_plan(arrays, options)
        if kept is not None:
            heads, o, S = run_token(kept, q, k, v, beta, g, initial_state, v_first=state_v_first)
            return _fla_result(heads, o, S, q.dtype, output_final_state, v_first=state_v_first)
    heads = FlaHeads.of(q, k, v, offsets, initial_state)
    xp = heads.xp
    out_dtype = q.dtype
    dtype, (q, k, v, beta, g) = in_common_dtype(xp, q, k, v, beta, g)
    state = heads.state_in(initial_state, work_dtype(xp, dtype), v_first=state_v_first)
    scale = default_scale(scale, k.shape[-1])
    o, S = delta_rule_attention(
        heads.query_key(q),
        heads.query_key(k),
        heads.per_value_head(v, "v"),
        1.0 if beta is None else heads.per_value_head(beta, "beta"),
        log_decay=heads.per_value_head(g, "g", channels=True),
        scale=scale,
        qk_l2norm=bool(use_qk_l2norm_in_kernel),
        method=method,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=True,
        cu_seqlens=offsets,
        seq_axis=heads.seq_axis,
    )
    if decoding:
        call = TokenCall(heads, q, k, v, beta, g, state)
        plan_token(arrays, options, call, scale=scale, qk_l2norm=bool(use_qk_l2norm_in_kernel))
    return _fla_result(heads, o, S, out_dtype, output_final_state, v_first=state_v_first)


def _fla_result(
    heads: FlaHeads, o: Any, S: Any, out_dtype: Any, output_final_state: bool, *, v_first: bool
) -> Result:
    """polylin's output and final state as fla returns them: ``o`` in ``out_dtype``."""
    o = heads.output(o if o.dtype == out_dtype else heads.xp.astype(o, out_dtype))
    return o, heads.state_out(S, v_first=v_first) if output_final_state else None


@fla_doc
def chunk_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_delta_rule`` (DeltaNet).

    ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    q, k : array
        Queries and keys, ``(B, T, H, K)``; unit keys (or ``use_qk_l2norm_in_kernel``) keep the
        recurrence stable.
    <v_hv>
    <beta>
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <cu_seqlens>
    <cu_seqlens_cpu>
    **kwargs
        ``chunk_size`` (16, 32 or 64); ``head_first`` raises fla's ``DeprecationWarning``; any other
        option raises ``NotImplementedError`` naming it.

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_delta_rule, fused_recurrent_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> o, _ = chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    >>> o_r, _ = fused_recurrent_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    >>> bool(np.allclose(o, o_r))
    True
    """
    check_inputs(
        "chunk_delta_rule", q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state
    )
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_delta_rule", kwargs, (16, 32, 64))
    reject("chunk_delta_rule", kwargs)
    return _delta_family(
        "chunk_delta_rule", q, k, v, beta, None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, method="chunked",
        chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    beta: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Array | None = None,
) -> Result:
    """Compute fla's ``fused_recurrent_delta_rule``: :func:`chunk_delta_rule`, token by token.

    Parameters
    ----------
    <q_k>
    <v_hv>
    beta : array, optional
        The learning rate per token, ``(B, T, HV)``; ``None`` means 1, as in fla.
    scale : float, optional
        Multiplies the queries, positive; default ``K ** -0.5``.
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <cu_seqlens>

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> o, S = fused_recurrent_delta_rule(
    ...     q, k, v, use_qk_l2norm_in_kernel=True, output_final_state=True
    ... )
    >>> o.shape, S.shape
    ((1, 8, 2, 4), (1, 2, 4, 4))
    """
    check_inputs(
        "fused_recurrent_delta_rule", q=q, k=k, v=v, beta=beta, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    if scale is not None and not scale > 0:
        raise ValueError("scale must be positive")
    return _delta_family(
        "fused_recurrent_delta_rule", q, k, v, beta, None, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        method="recurrent",
    )  # fmt: skip


def _reject_gate_options(op: str, kwargs: dict[str, Any], **given: tuple[Any, Any]) -> None:
    """fla's in-kernel activations (``A_log``, ``dt_bias``, sigmoid of ``beta``): unsupported."""
    use_beta_sigmoid, _ = given.get("use_beta_sigmoid_in_kernel", (False, False))
    allow_neg, _ = given.get("allow_neg_eigval", (False, False))
    if allow_neg and not use_beta_sigmoid:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    reject(op, kwargs, **given)


@fla_doc
def chunk_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    chunk_indices: Array | None = None,
    cp_context: Any | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_gated_delta_rule`` (Gated DeltaNet).

    ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T`` with ``a_t = exp(g_t)``,
    ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array
        Log decay per token and value head, ``(B, T, HV)`` (``<= 0``).
    <beta>
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    <beta_options>
    <state_v_first_hv>
    <cu_seqlens>
    <cu_seqlens_cpu>
    chunk_indices : array, optional
        The precomputed varlen chunk table of fla, derived from ``cu_seqlens``: ignored.
    <cp_context>
    **kwargs
        ``chunk_size`` (16, 32 or 64); ``head_first`` raises fla's ``DeprecationWarning``; any
        other option raises ``NotImplementedError`` naming it (``use_gate_in_kernel``,
        ``A_log``, ``dt_bias`` among them: compute ``g`` first).

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_gated_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 2, 8, 2, 4))
    >>> v = rng.standard_normal((2, 8, 4, 3))      # 4 value heads on 2 query/key heads
    >>> g = -rng.uniform(0, 1, (2, 8, 4))          # log decay
    >>> beta = rng.uniform(0, 1, (2, 8, 4))        # learning rate
    >>> o, state = chunk_gated_delta_rule(
    ...     q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True
    ... )
    >>> o.shape, state.shape
    ((2, 8, 4, 3), (2, 4, 4, 3))
    """
    check_inputs(
        "chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    reject_head_first(kwargs)
    chunk_size = pop_chunk_size("chunk_gated_delta_rule", kwargs, (16, 32, 64))
    _reject_gate_options(
        "chunk_gated_delta_rule", kwargs,
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False), cp_context=(cp_context, None),
    )  # fmt: skip
    return _delta_family(
        "chunk_gated_delta_rule", q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
        method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


def _gated_delta_landing(op: str, **landed: Any) -> str:
    """The error of a call ``(q, k, v, g, beta, more...)`` in fla 0.6's order ``(q, k, v, g,
    gk, gv, beta, scale, ...)``: which argument landed where, and the call by keyword."""
    where = ", ".join(f"`{name}` got {describe(x)}" for name, x in landed.items() if x is not None)
    return (
        f"polylin.compat.fla.{op} takes (q, k, v, g, gk, gv, beta, scale, initial_state, ...) "
        "in this order, as fla 0.6 does: a call (q, k, v, g, beta, ...) puts beta in `gk` and "
        f"the next positional arguments in `gv`, `beta`, `scale`, ...: {where} (a (B, T, HV) "
        "array in `gk` is beta's shape, not a gate's (B, T, HV, K)). Pass beta and what follows "
        f"by keyword: {op}(q, k, v, g, beta=beta, scale=..., initial_state=...)."
    )


@fla_doc
def fused_recurrent_gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array | None = None,
    gk: Array | None = None,
    gv: Array | None = None,
    beta: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_gated_delta_rule``: the gated delta rule, token by token.

    :func:`chunk_gated_delta_rule` computes the same function in chunks.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array, optional
        Log decay per token and value head, ``(B, T, HV)``.
    gk : array, optional
        Log decay per key channel, ``(B, T, HV, K)`` (the KDA transition, as
        :func:`fused_recurrent_kda`); not together with ``g``. A ``(B, T, HV)`` array here
        beside ``g`` is read as ``beta``: the call ``(q, k, v, g, beta)`` of fla's own docs for
        this op (whose fifth positional parameter is ``gk``) computes what
        ``(q, k, v, g=g, beta=beta)`` does; with ``gv`` or ``beta`` also given it raises
        ``TypeError`` saying where each argument landed.
    gv : array, optional
        Value gates: not supported.
    beta : array, optional
        The learning rate per token, ``(B, T, HV)``; ``None`` means 1.
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported: compute ``g`` first.
    A_log, dt_bias : array, optional
        The in-kernel gate's parameters: not supported.
    <beta_options>
    <state_v_first_hv>
    <cu_seqlens>
    <kwargs_state_layout>

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 9, 2, 4))
    >>> g, beta = -rng.uniform(0, 1, (1, 9, 2)), rng.uniform(0, 1, (1, 9, 2))
    >>> prefill, S = chunk_gated_delta_rule(
    ...     q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], output_final_state=True
    ... )
    >>> o_t, S = fused_recurrent_gated_delta_rule(
    ...     q[:, 8:], k[:, 8:], v[:, 8:], g=g[:, 8:], beta=beta[:, 8:], initial_state=S,
    ...     output_final_state=True,
    ... )
    >>> whole, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    >>> bool(np.allclose(o_t, whole[:, 8:]))
    True
    """
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    op = "fused_recurrent_gated_delta_rule"
    if g is not None and gk is not None and is_array(gk) and gk.ndim == 3:
        # The call (q, k, v, g, beta) of fla's docs: fla 0.6's fifth parameter is gk, and a
        # (B, T, HV) array there, beside g, is beta (a gate gk is (B, T, HV, K)).
        if gv is not None or beta is not None:
            raise TypeError(_gated_delta_landing(op, gk=gk, gv=gv, beta=beta, scale=scale))
        gk, beta = None, gk
    check_inputs(op, q=q, k=k, v=v, g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state)
    _reject_gate_options(
        op, kwargs, gv=(gv, None), use_gate_in_kernel=(use_gate_in_kernel, False),
        A_log=(A_log, None), dt_bias=(dt_bias, None),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False),
    )  # fmt: skip
    if g is not None and gk is not None:
        raise NotImplementedError(
            f"polylin.compat.fla.{op} does not support `g` and `gk` together (pass one gate, "
            "gk=g[..., None] + gk; if the fifth positional argument was meant as beta: fla "
            "0.6's fifth parameter is gk, pass beta=... by keyword)"
        )
    return _delta_family(
        op, q, k, v, beta, gk if gk is not None else g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip


@fla_doc
def chunk_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    cu_seqlens_cpu: Array | None = None,
    cp_context: Any | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``chunk_kda`` (Kimi Delta Attention): the delta rule, a decay per key channel.

    ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array
        Log decay per token, value head and key channel, ``(B, T, HV, K)``.
    <beta>
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported: compute ``g`` first.
    <beta_options>
    <safe_gate>
    lower_bound : float, optional
        The in-kernel gate's bound: not supported.
    <disable_recompute>
    return_intermediate_states : bool
        Not supported.
    <state_v_first_hv>
    <cu_seqlens>
    <cu_seqlens_cpu>
    <cp_context>
    use_graph : bool
        CUDA graph capture: not supported.
    max_num_seqs : int, optional
        Used with ``use_graph`` only: not supported.
    **kwargs
        ``chunk_size`` (32 or 64); ``head_first`` raises fla's ``DeprecationWarning``; any other
        option raises ``NotImplementedError`` naming it.

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import chunk_kda, fused_recurrent_kda
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    >>> o_r, _ = fused_recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    >>> bool(np.allclose(o, o_r))
    True
    """
    check_inputs(
        "chunk_kda", q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state
    )
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    chunk_size = pop_chunk_size("chunk_kda", kwargs, (32, 64))
    _reject_gate_options(
        "chunk_kda", kwargs, use_gate_in_kernel=(use_gate_in_kernel, False),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False), lower_bound=(lower_bound, None),
        return_intermediate_states=(return_intermediate_states, False),
        cp_context=(cp_context, None), use_graph=(use_graph, False),
        max_num_seqs=(max_num_seqs, None),
    )  # fmt: skip
    return _delta_family(
        "chunk_kda", q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
        method="chunked", chunk_size=chunk_size,
    )  # fmt: skip


@fla_doc
def fused_recurrent_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Array | None = None,
    **kwargs: Any,
) -> Result:
    """Compute fla's ``fused_recurrent_kda``: :func:`chunk_kda`, token by token.

    Parameters
    ----------
    <q_k>
    <v_hv>
    g : array
        Log decay per token, value head and key channel, ``(B, T, HV, K)``.
    <beta>
    A_log, dt_bias : array, optional
        The in-kernel gate's parameters: not supported (compute ``g`` first).
    <scale>
    <initial_state_hv>
    <output_final_state>
    <use_qk_l2norm_in_kernel>
    use_gate_in_kernel : bool
        Not supported.
    <beta_options>
    lower_bound : float, optional
        The in-kernel gate's bound: not supported.
    <state_v_first_hv>
    <cu_seqlens>
    <kwargs_state_layout>

    Returns
    -------
    <o_hv>
    <final_state_hv>

    Raises
    ------
    <raises_not_implemented>
    <raises_shape_rules>

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.compat.fla import fused_recurrent_kda
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 8, 2, 4))
    >>> g = -rng.uniform(0, 1, (1, 8, 2, 4))
    >>> beta = rng.uniform(0, 1, (1, 8, 2))
    >>> fused_recurrent_kda(q, k, v, g, beta)[0].shape
    (1, 8, 2, 4)
    """
    check_inputs(
        "fused_recurrent_kda", q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    state_v_first = state_v_first_alias(kwargs, state_v_first)
    _reject_gate_options(
        "fused_recurrent_kda", kwargs, A_log=(A_log, None), dt_bias=(dt_bias, None),
        use_gate_in_kernel=(use_gate_in_kernel, False),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False), lower_bound=(lower_bound, None),
    )  # fmt: skip
    return _delta_family(
        "fused_recurrent_kda", q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, state_v_first=state_v_first, method="recurrent",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The generalized delta rule (DPLR, RWKV-7): dplr_delta_rule(..., log_decay=...)
# --------------------------------------------------------------------------------------------


def _dplr_family(
    q: Any,
    k: Any,
    v: Any,
    a: Any,
    b: Any,
    gk: Any,
    *,
    scale: float | None,
    initial_state: Any,
    output_final_state: bool,
    cu_seqlens: Any,
    cu_seqlens_cpu: Any = None,
    method: str,
    chunk_size: int = 64,
    gate_name: str = "gk",
) -> Result:
    """One fla DPLR op as one :func:`polylin.dplr_delta_rule` call (fla's ``a`` is polylin's
    ``a``, its ``b`` polylin's ``b``, its ``gk`` polylin's ``log_decay``)."""
    _static_flags(output_final_state=output_final_state)
    offsets = offsets_of(cu_seqlens, cu_seqlens_cpu)
    heads = FlaHeads.of(q, k, v, offsets, initial_state)
    xp = heads.xp
    out_dtype = q.dtype
    dtype, (q, k, v, a, b, gk) = in_common_dtype(xp, q, k, v, a, b, gk)
    o, S = dplr_delta_rule(
        heads.query_key(q),
        heads.query_key(k),
        heads.per_value_head(v, "v"),
        heads.per_key_head(a, "a"),
        heads.per_key_head(b, "b"),
        log_decay=heads.per_key_head(gk, gate_name),
        scale=default_scale(scale, k.shape[-1]),
        method=method,
        chunk_size=chunk_size,
        initial_state=heads.state_in(initial_state, work_dtype(xp, dtype)),
        return_state=True,
        cu_seqlens=offsets,
        seq_axis=heads.seq_axis,
    )
    return _fla_result(heads, o, S, out_dtype, output_final_state, v_first=False)


def _dplr_chunk_options(
    op: str,
    kwargs: dict[str, Any],
    *,
    chunk_size: int | None,
    lower_bound: float | None,
    cp_context: Any,
) -> int:
    """fla's chunked DPLR options: the chunk size, ``lower_bound``'s check, what is rejected.

    ``safe_gate``, ``disable_recompute`` and a negative ``lower_bound`` are speed hints of fla's
    kernels (the function is the same): accepted, ignored.
    """
    reject_head_first(kwargs)
    if lower_bound is not None and lower_bound >= 0:
        raise ValueError(
            f"`lower_bound` must be negative (gk is a log-decay < 0), got {lower_bound}."
        )
    reject(op, kwargs, cp_context=(cp_context, None))
    return pop_chunk_size(op, {"chunk_size": chunk_size}, None)


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
        The chunk length, a power of 2 (default 64; fla's default is 16: the same function).
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
    chunk_size = _dplr_chunk_options(
        "chunk_dplr_delta_rule", kwargs, chunk_size=chunk_size, lower_bound=lower_bound,
        cp_context=cp_context,
    )  # fmt: skip
    return _dplr_family(
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
    return _dplr_family(
        q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, method="recurrent",
    )  # fmt: skip


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
        The chunk length, a power of 2 (default 64; fla's default is 16: the same function).
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
    chunk_size = _dplr_chunk_options(
        "chunk_rwkv7", {}, chunk_size=chunk_size, lower_bound=lower_bound,
        cp_context=cp_context,
    )  # fmt: skip
    return _dplr_family(
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
    return _dplr_family(
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
    return _dplr_family(
        r, k, v, -kk, kk * a, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, method="recurrent",
        gate_name="w",
    )  # fmt: skip
