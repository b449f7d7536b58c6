"""One-token calls of fla's recurrent delta ops, as a model's decoding loop makes them.

transformers calls ``fused_recurrent_gated_delta_rule`` (and the KDA twin) once per generated
token, with ``T = 1`` and arguments of the same shapes every time. The first call of each
signature (each array's type, shape, dtype and device, and the options) runs the fully checked
:func:`polylin.delta_rule_attention`, whose errors speak fla's terms; it then keeps the plan of
:func:`polylin.delta_rule_step` for that signature, and later calls of the same signature run
only the step's arithmetic (``polylin._inputs.steps`` explains why a signature decides the checks).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .._inputs.sequences import StepPlan
from .._inputs.steps import call_signature
from ..delta_rule import _plan_step, _run_step
from ._fla_args import FlaHeads

__all__ = ["TokenCall", "plan_token", "run_token", "token_plan"]

#: Plans by call signature; a model has a handful (one per layer shape and dtype).
_PLANS: dict[Hashable, tuple[StepPlan, FlaHeads]] = {}
_MAX_PLANS = 64


class TokenCall:
    """The step arguments of one token in fla's layout: ``(B, 1, H, d)`` inputs."""

    __slots__ = ("args", "heads")

    def __init__(self, heads: FlaHeads, q: Any, k: Any, v: Any, beta: Any, g: Any, state: Any):
        xp, B, H, G = heads.xp, heads.batch, heads.heads, heads.groups
        q_t, k_t = (xp.reshape(x, (B, H, 1, x.shape[-1])) for x in (q, k))
        v_t = xp.reshape(v, (B, H, G, v.shape[-1]))
        beta_t = 1.0 if beta is None else xp.reshape(beta, (B, H, G, 1))
        if g is not None:
            g = xp.reshape(g, (B, H, G, 1 if g.ndim == 3 else g.shape[-1]))
        self.heads, self.args = heads, (q_t, k_t, v_t, beta_t, state, g)

    def run(self, plan: StepPlan) -> tuple[Any, Any]:
        """The step's ``(o_t, state)``; ``o_t`` as a sequence output, ``(B, 1, H, G, d_v)``."""
        o_t, S = _run_step(plan, *self.args)
        return self.heads.xp.reshape(o_t, (o_t.shape[0], 1, *o_t.shape[1:])), S


def _key(arrays: tuple[Any, ...], options: tuple[Any, ...]) -> Hashable:
    signature = call_signature(arrays)
    return None if signature is None else (signature, options)


def token_plan(
    arrays: tuple[Any, ...], options: tuple[Any, ...]
) -> tuple[StepPlan, FlaHeads] | None:
    """The plan kept for a call with these fla arguments and options, if one was checked."""
    key = _key(arrays, options)
    return None if key is None else _PLANS.get(key)


def plan_token(
    arrays: tuple[Any, ...],
    options: tuple[Any, ...],
    call: TokenCall,
    *,
    scale: float,
    qk_l2norm: bool,
) -> None:
    """Keep the step's plan for a call whose arguments the full op has just accepted."""
    key = _key(arrays, options)
    if key is None:
        return
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan, _ = _plan_step(*call.args, scale=scale, qk_l2norm=qk_l2norm)
    _PLANS[key] = (plan, call.heads)


def run_token(
    kept: tuple[StepPlan, FlaHeads],
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
    plan, heads = kept
    xp, dtype = heads.xp, plan.inputs.dtype
    q, k, v, beta, g = (
        x if x is None or x.dtype == dtype else xp.astype(x, dtype) for x in (q, k, v, beta, g)
    )
    state = heads.state_in(state, plan.inputs.work_dtype, v_first=v_first)
    return (heads, *TokenCall(heads, q, k, v, beta, g, state).run(plan))
