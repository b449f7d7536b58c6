"""One-token calls of fla's recurrent delta ops, as a model's decoding loop makes them.

transformers calls ``fused_recurrent_gated_delta_rule`` (and the KDA twin) once per generated
token, with ``T = 1`` and arguments of the same shapes every time. The first call of each
signature (:meth:`polylin.PreparedStep.signature` of the fla arguments, and the options) runs
the fully checked :func:`polylin.delta_rule_attention`, whose errors speak fla's terms; it then
keeps a :func:`polylin.prepare_delta_rule_step` for that signature, and later calls of the same
signature run the prepared step: fla's layout translated, the step's arithmetic, nothing checked
twice.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

from ... import PreparedStep, prepare_delta_rule_step
from ._args import FlaHeads

__all__ = ["TokenCall", "TokenPlan", "plan_token", "run_token", "token_plan"]


class TokenPlan(NamedTuple):
    """What a checked one-token call keeps: the prepared step, fla's heads and the dtypes."""

    step: PreparedStep
    heads: FlaHeads
    dtype: Any  # the inputs' common dtype
    work_dtype: Any  # the state's


#: Plans by call signature; a model has a handful (one per layer shape and dtype).
_PLANS: dict[Hashable, TokenPlan] = {}
_MAX_PLANS = 64


class TokenCall:
    """The step arguments of one token in fla's layout: ``(B, 1, H, d)`` inputs."""

    __slots__ = ("args", "heads", "log_decay")

    def __init__(self, heads: FlaHeads, q: Any, k: Any, v: Any, beta: Any, g: Any, state: Any):
        xp, B, H, G = heads.xp, heads.batch, heads.heads, heads.groups
        q_t, k_t = (xp.reshape(x, (B, H, 1, x.shape[-1])) for x in (q, k))
        v_t = xp.reshape(v, (B, H, G, v.shape[-1]))
        beta_t = 1.0 if beta is None else xp.reshape(beta, (B, H, G, 1))
        if g is not None:
            g = xp.reshape(g, (B, H, G, 1 if g.ndim == 3 else g.shape[-1]))
        self.heads, self.args, self.log_decay = heads, (q_t, k_t, v_t, beta_t, state), g

    def run(self, step: PreparedStep) -> tuple[Any, Any]:
        """The step's ``(o_t, state)``; ``o_t`` as a sequence output, ``(B, 1, H, G, d_v)``."""
        o_t, S = step(*self.args, log_decay=self.log_decay)
        return self.heads.xp.reshape(o_t, (o_t.shape[0], 1, *o_t.shape[1:])), S


def _key(arrays: tuple[Any, ...], options: tuple[Any, ...]) -> Hashable:
    signature = PreparedStep.signature(arrays)
    return None if signature is None else (signature, options)


def token_plan(arrays: tuple[Any, ...], options: tuple[Any, ...]) -> TokenPlan | None:
    """The plan kept for a call with these fla arguments and options, if one was checked."""
    key = _key(arrays, options)
    return None if key is None else _PLANS.get(key)


def plan_token(
    arrays: tuple[Any, ...],
    options: tuple[Any, ...],
    heads: FlaHeads,
    *,
    dtype: Any,
    work_dtype: Any,
    scale: float,
    qk_l2norm: bool,
) -> None:
    """Keep a prepared step for a call whose arguments the full op has just accepted."""
    key = _key(arrays, options)
    if key is None:
        return
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    step = prepare_delta_rule_step(scale=scale, qk_l2norm=qk_l2norm)
    _PLANS[key] = TokenPlan(step, heads, dtype, work_dtype)


def run_token(
    kept: TokenPlan,
    q: Any,
    k: Any,
    v: Any,
    beta: Any,
    g: Any,
    state: Any,
    *,
    v_first: bool,
) -> tuple[FlaHeads, Any, Any]:
    """``(heads, o, S)`` of a call of a kept plan's signature: the step's arithmetic only.

    The signature fixed the arrays' dtypes, so their common dtype is the plan's.
    """
    heads, dtype = kept.heads, kept.dtype
    xp = heads.xp
    q, k, v, beta, g = (
        x if x is None or x.dtype == dtype else xp.astype(x, dtype) for x in (q, k, v, beta, g)
    )
    state = heads.state_in(state, kept.work_dtype, v_first=v_first)
    return (heads, *TokenCall(heads, q, k, v, beta, g, state).run(kept.step))
