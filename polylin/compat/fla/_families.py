"""The translation each family of fla ops shares: one fla call as one polylin call.

``linear_family`` calls :func:`polylin.causal_linear_attention`, ``delta_family``
:func:`polylin.delta_rule_attention` (a one-token recurrent call as the prepared
:func:`polylin.delta_rule_step`, ``_decode``), ``dplr_family`` :func:`polylin.dplr_delta_rule`;
the op modules check fla's options and pick the family.
"""

from __future__ import annotations

from typing import Any

from ... import DEFAULT_DPLR_CHUNK_SIZE, LinearAttentionState
from ...attention import causal_linear_attention
from ...delta_rule import delta_rule_attention
from ...dplr import dplr_delta_rule
from ...feature_maps import identity
from ...interop import Array, array_namespace, check_static, device
from ._args import (
    FlaHeads,
    default_scale,
    in_common_dtype,
    offsets_of,
    pop_chunk_size,
    reject,
    reject_head_first,
    work_dtype,
)
from ._decode import plan_token, run_token, token_plan

__all__ = [
    "FLA_NORMALIZER_EPS",
    "Result",
    "delta_family",
    "dplr_chunk_options",
    "dplr_family",
    "fla_result",
    "linear_family",
    "reject_gate_options",
    "simple_gate",
    "static_flags",
]


#: fla's normalized linear attention adds this to ``q . z``.
FLA_NORMALIZER_EPS = 1e-10


Result = tuple[Array, Any]


def static_flags(**flags: Any) -> None:
    """fla's flags are taken by truthiness, as fla takes them; a traced one (under
    ``jax.jit``) has none until the function runs: a ``TypeError`` that says how to keep it
    static, not JAX's error about a boolean conversion."""
    for name, value in flags.items():
        check_static(name, value)


def simple_gate(op: str, g: Any, g_gamma: Any, q: Any) -> Any:
    """fla's head-wise gate: ``g`` ``(B, T, H)`` per token or ``g_gamma`` ``(H,)`` per head."""
    if g is not None and g_gamma is not None:
        raise ValueError(f"{op}: pass one of `g` or `g_gamma`, not both")
    if g_gamma is None:
        return g
    return array_namespace(q).reshape(g_gamma, (1, 1, g_gamma.shape[0]))


def linear_family(
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
    static_flags(
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
        identity,
        method=method,
        chunk_size=chunk_size,
        eps=FLA_NORMALIZER_EPS,
        initial_state=state,
        return_state=True,
        cu_seqlens=offsets,
        seq_axis=heads.seq_axis,
        log_decay=heads.per_value_head(log_decay, "g", channels=True),
        normalize=normalize,
        scale=default_scale(scale, k.shape[-1]),
    )
    o = heads.output(o)
    S_out = heads.state_out(final.S, v_first=state_v_first) if output_final_state else None
    if normalize:
        return o, (S_out, heads.normalizer_out(final.z))
    return o, S_out


def delta_family(
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
    static_flags(
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
            return fla_result(heads, o, S, q.dtype, output_final_state, v_first=state_v_first)
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
        plan_token(
            arrays, options, heads, dtype=dtype, work_dtype=work_dtype(xp, dtype), scale=scale,
            qk_l2norm=bool(use_qk_l2norm_in_kernel),
        )  # fmt: skip
    return fla_result(heads, o, S, out_dtype, output_final_state, v_first=state_v_first)


def fla_result(
    heads: FlaHeads, o: Any, S: Any, out_dtype: Any, output_final_state: bool, *, v_first: bool
) -> Result:
    """polylin's output and final state as fla returns them: ``o`` in ``out_dtype``."""
    o = heads.output(o if o.dtype == out_dtype else heads.xp.astype(o, out_dtype))
    return o, heads.state_out(S, v_first=v_first) if output_final_state else None


def reject_gate_options(op: str, kwargs: dict[str, Any], **given: tuple[Any, Any]) -> None:
    """fla's in-kernel activations (``A_log``, ``dt_bias``, sigmoid of ``beta``): unsupported."""
    use_beta_sigmoid, _ = given.get("use_beta_sigmoid_in_kernel", (False, False))
    allow_neg, _ = given.get("allow_neg_eigval", (False, False))
    if allow_neg and not use_beta_sigmoid:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    reject(op, kwargs, **given)


def dplr_family(
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
    static_flags(output_final_state=output_final_state)
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
    return fla_result(heads, o, S, out_dtype, output_final_state, v_first=False)


def dplr_chunk_options(
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
    return pop_chunk_size(op, {"chunk_size": chunk_size}, None, DEFAULT_DPLR_CHUNK_SIZE)
