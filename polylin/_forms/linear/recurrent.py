"""The recurrent form: one rank-1 state update per token (the textbook loop).

With a log decay ``g_t`` the state decays before token t is added (token t is never decayed at
its own step)::

    S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T        z_t = exp(g_t) * z_{t-1} + phi(k_t)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ..._backend.compiled import compiled_tokens
from ..._backend.execution import scan
from ..._backend.fused import StepRows, fused_linear_step
from ..._backend.ops import add_outer, nonpositive, unstack, vector_times_matrix

__all__ = ["causal_recurrent", "recurrent_step"]


def recurrent_step(
    xp: Any,
    fq: Any,
    fk: Any,
    v: Any,
    S: Any,
    z: Any,
    eps: float,
    *,
    log_decay: Any | None = None,
    normalize: bool = True,
    rows: StepRows | None = None,
) -> tuple[Any, Any, Any]:
    """Advance the state by one token and return ``(output, S, z)``.

    ``fq``, ``fk`` are mapped features ``(..., d_phi)``, ``v`` is ``(..., d_v)``, ``S`` and ``z``
    the state before the token, ``log_decay`` ``(..., 1 or d_phi)`` or None. Cost and memory
    are independent of the position. ``rows``: what the caller found about the per-token
    arrays where the fused PyTorch step applies (``_backend.fused.fused_step_rows``).
    """
    factor = None if log_decay is None else xp.exp(log_decay)
    compiled = compiled_tokens("linear", [fq, fk, v], factor, S, z, step=True)  # NumPy, torch
    if compiled is not None:
        numerator, S, z, normalizer = compiled
        return (numerator / (normalizer + eps) if normalize else numerator), S, z
    fused = fused_linear_step(fq, fk, v, factor, S, z, rows=rows)  # PyTorch, a state a row
    if fused is not None:
        numerator, S, z = fused
    else:
        if factor is not None:
            S = factor[..., :, None] * S
            z = factor * z
        S = add_outer(xp, S, (fk, v))
        z = z + fk
        numerator = vector_times_matrix(xp, fq, S)
    if not normalize:
        return numerator, S, z
    normalizer = xp.sum(fq * z, axis=-1, keepdims=True)
    return numerator / (normalizer + eps), S, z


def causal_recurrent(
    xp: Any,
    fq: Any,
    fk: Any,
    v: Any,
    S: Any,
    z: Any,
    *,
    eps: float,
    log_decay: Any | None = None,
    normalize: bool = True,
    scanned: bool = False,
    scale: float = 1.0,
) -> tuple[Any, Any, Any]:
    """Causal linear attention by T sequential state updates, from the state ``(S, z)``.

    ``scale`` multiplies the mapped queries ``fq``; ``log_decay`` values above 0 are taken as 0
    here (:func:`polylin._inputs.gates.check_log_decay` with ``clamp=False``), where the
    factors are formed: the compiled loop on PyTorch tensors then runs with no operation of
    PyTorch's on the sequence before or after it (``_backend.compiled.compiled_tokens``).

    The tokens are taken apart by one ``unstack`` per input (not a slice per token, whose
    backward would be quadratic in T) and the outputs joined by one ``stack``. The leading
    dimensions of the inputs broadcast (grouped heads); the state has the broadcast ones.
    ``scanned``: the same :func:`recurrent_step` per token as one scan
    (``_backend.execution.scan``, where ``_backend.execution.scans_tokens``), compiled once
    instead of unrolled T times.
    """
    T = fq.shape[-2]
    if T == 0:  # the broadcast leading dimensions (grouped heads) are the state's
        return xp.broadcast_to(v, (*S.shape[:-2], *v.shape[-2:])), S, z
    compiled = None
    if not scanned:  # one compiled loop
        compiled = compiled_tokens(
            "linear", [fq, fk, v], log_decay, S, z, step=False, log=True, scale=scale,
            eps=eps if normalize else None,
        )  # fmt: skip
    if compiled is not None:  # (out, S, z, the normalizers)
        return compiled[0], compiled[1], compiled[2]
    if scale != 1.0:
        fq = fq * scale
    if log_decay is not None:
        log_decay = nonpositive(xp, log_decay)
    if scanned:
        step = partial(recurrent_step, xp, eps=eps, normalize=normalize)
        return _scan(xp, (fq, fk, v), (S, z), step, log_decay)
    tokens = [unstack(xp, x, axis=-2) for x in (fq, fk, v)]
    decays: Sequence[Any | None]
    if log_decay is None:
        decays = [None] * T
    elif log_decay.shape[-2] == 1:
        decays = [log_decay[..., 0, :]] * T
    else:
        decays = unstack(xp, log_decay, axis=-2)
    outputs = []
    for q_t, k_t, v_t, g_t in zip(*tokens, decays):
        o, S, z = recurrent_step(xp, q_t, k_t, v_t, S, z, eps, log_decay=g_t, normalize=normalize)
        outputs.append(o)
    return xp.stack(outputs, axis=-2), S, z


def _scan(
    xp: Any,
    tokens: tuple[Any, Any, Any],
    state: tuple[Any, Any],
    step: Callable[..., Any],
    log_decay: Any | None,
) -> tuple[Any, Any, Any]:
    """:func:`causal_recurrent` with ``scanned=True`` (T >= 1): ``step(q_t, k_t, v_t, S, z,
    log_decay=g_t)`` once per token, inside one scan."""
    per_token = list(tokens)
    g = None  # a decay shared by every token
    if log_decay is not None and log_decay.shape[-2] == 1:
        g = log_decay[..., 0, :]
    elif log_decay is not None:
        per_token.append(log_decay)
    xs = tuple(xp.moveaxis(x, -2, 0) for x in per_token)  # tokens first: (T, ..., d)

    def token(carry: tuple[Any, Any], x: tuple[Any, ...]) -> tuple[tuple[Any, Any], Any]:
        q_t, k_t, v_t, *g_t = x
        o, S_t, z_t = step(q_t, k_t, v_t, *carry, log_decay=g_t[0] if g_t else g)
        return (S_t, z_t), o

    (S, z), outputs = scan(token, state, xs)
    return xp.moveaxis(outputs, 0, -2), S, z
