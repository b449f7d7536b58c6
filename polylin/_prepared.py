"""Decoding steps that validate once per loop instead of once per token.

A step function's checks (libraries, devices, dtypes, shapes, option values) depend on the
*signature* of its arguments only: each array's type, shape, dtype and device, each number's
value, which arguments are ``None``. Its data never decides them (lazy and traced backends could
not read it). A decoding loop calls the step with the same signature at every token, so a
:class:`PreparedStep` checks the first call fully, keeps the resulting plan, and from then on
compares the signature (a few microseconds) and runs only the arithmetic. A call of any other
signature is checked fully again, so a prepared step is exactly as safe as the plain one: an
error names the argument as the plain step's does.

Each step module supplies two functions: ``plan(*args) -> (plan, checked)``, the full
validation (which may compute what it had to compute to validate, such as the mapped features,
and pass it on as ``checked``), and ``run(plan, *args, checked=None) -> result``, conversion and
arithmetic only. The plain step is ``run(*plan(...))``: the same code computes both.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable
from typing import Any

from ._policy import is_tracer

__all__ = ["PreparedStep", "call_signature"]


def _signature(x: Any) -> Hashable:
    """What the checks of a step read from one argument (``None`` if it cannot be had)."""
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _KINDS.setdefault(type(x), _kind(x))
    if kind == "array":
        return (type(x), x.shape, x.dtype, getattr(x, "device", None))
    if kind == "number":  # Python and NumPy scalars: the checks read their value
        return (type(x), float(x))
    if kind == "value":
        return (type(x), x)
    if kind == "tuple":  # a LinearAttentionState
        parts = tuple(_signature(part) for part in x)
        return None if None in parts else (type(x), parts)
    return None


def _kind(x: Any) -> str:
    if x is None or isinstance(x, (bool, str)):
        return "value"
    if isinstance(x, numbers.Real):
        return "number"
    if isinstance(x, tuple):
        return "tuple"
    if getattr(x, "shape", None) is None or is_tracer(x):  # jax.jit traces a step once anyway
        return "other"
    return "array"


#: The kind of argument each type is, as :func:`_kind` finds it: one lookup per argument.
_KINDS: dict[type, str] = {}


def call_signature(args: tuple) -> Hashable:
    """The signature of a call (positional arguments), or ``None`` where one is unknown."""
    parts = tuple(_signature(x) for x in args)
    return None if None in parts else parts


class PreparedStep:
    """A decoding step that checks its arguments once per signature, then only computes.

    Build one with :func:`~polylin.prepare_step`, :func:`~polylin.prepare_delta_rule_step` or
    :func:`~polylin.prepare_dplr_step`; call it like the step it prepares, once per token. The
    first call, and any call whose arrays differ in library, shape, dtype or device (or whose
    numbers differ) from the one before it, is checked like the plain step and raises the same
    errors; the others run the arithmetic alone. Outputs equal the plain step's exactly.

    Parameters
    ----------
    plan : callable
        The step's checks: ``plan(*args) -> (plan, checked)`` (built by the ``prepare_*``
        functions, not by hand).
    run : callable
        The step's arithmetic: ``run(plan, *args, checked=None)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import PreparedStep, prepare_step
    >>> isinstance(prepare_step(), PreparedStep)
    True
    """

    __slots__ = ("_key", "_plan", "_plan_fn", "_run_fn")

    def __init__(self, plan: Callable[..., tuple[Any, Any]], run: Callable[..., Any]) -> None:
        self._plan_fn, self._run_fn = plan, run
        self._key: Hashable = None
        self._plan: Any = None

    def _call(self, args: tuple) -> Any:
        key = call_signature(args)
        if key is not None and key == self._key:
            return self._run_fn(self._plan, *args)
        plan, checked = self._plan_fn(*args)
        self._key, self._plan = key, plan
        return self._run_fn(plan, *args, checked=checked)
