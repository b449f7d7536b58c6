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

from .._backend.execution import compiling_any
from .._backend.namespace import is_tracer

__all__ = ["PER_CALL", "PlanCache", "PreparedStep", "call_signature"]

#: In a plan: "this argument is an array, converted at every call" (its signature guarantees
#: that every call with the plan has an array there too).
PER_CALL: Any = object()


def _signature(x: Any) -> Hashable:
    """What the checks of a step read from one argument (``None`` if it cannot be had)."""
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _KINDS.setdefault(type(x), _kind(x))
    if kind == "array":
        return (type(x), x.shape, x.dtype, _hashable(getattr(x, "device", None)))
    if kind == "number":  # Python and NumPy scalars: the checks read their value
        return (type(x), float(x))
    if kind == "value":
        return (type(x), x)
    if kind == "tuple":  # a LinearAttentionState
        parts = tuple(_signature(part) for part in x)
        return None if None in parts else (type(x), parts)
    return None


def _hashable(device: Any) -> Hashable:
    """A device as a key: itself, or its type and ``repr`` where it does not hash (CuPy's)."""
    try:
        hash(device)
    except TypeError:
        return (type(device), repr(device))
    return device


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


class PlanCache:
    """The plans of a plain step function, by the signature of its call and its options.

    The plain steps (:func:`~polylin.step`, :func:`~polylin.delta_rule_step`) keep the plans
    of their last few signatures here, so that a decoding loop written with them is checked in
    full once per signature, as a :class:`PreparedStep` is, and pays the comparison of the
    signature after that. A call whose signature or options cannot be keyed (a traced array,
    an unhashable option, a feature map that is not one of :mod:`polylin.feature_maps`'
    functions) is checked in full every time. Options are keyed by type and value, so
    ``scale=1`` and ``scale=True`` are different keys and each is checked.
    """

    __slots__ = ("_plans", "_size")

    def __init__(self, size: int = 8) -> None:
        self._plans: dict[Hashable, Any] = {}
        self._size = size

    def plan(
        self, plan: Callable[..., tuple[Any, Any]], args: tuple, options: tuple
    ) -> tuple[Any, Any]:
        """``plan(*args)``'s ``(plan, checked)``, or ``(the kept plan, None)`` for a call of a
        signature and options seen before (``plan`` must close over ``options``).

        While ``torch.compile`` traces the call nothing is looked up or kept: the compiled graph
        holds the plan, and Dynamo cannot compare the keys of other libraries' calls (a NumPy
        dtype) when the cache is full and its oldest plan goes."""
        if compiling_any(args):
            return plan(*args)
        key = call_signature(args)
        if key is not None:
            option_key = tuple(map(_option_signature, options))
            if None in option_key:
                key = None
            else:
                key = (key, option_key)
                kept = self._plans.get(key)
                if kept is not None:
                    return kept, None
        made, checked = plan(*args)
        if key is not None:
            if len(self._plans) >= self._size:  # the oldest goes first
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = made
        return made, checked


def _option_signature(x: Any) -> Hashable:
    """An option as a key: its type and value (a feature map of polylin's by identity), or
    ``None`` where that does not decide the checks."""
    if x is None or isinstance(x, (bool, str, int, float)):
        return (type(x), x)
    if callable(x) and getattr(x, "__module__", None) == "polylin.feature_maps" and (
        type(x).__name__ == "function"
    ):
        return (type(x), x)
    return None


class PreparedStep:
    """A decoding step that checks its arguments once per signature, then only computes.

    Build one with :func:`~polylin.prepare_step`, :func:`~polylin.prepare_delta_rule_step`,
    :func:`~polylin.prepare_dplr_step`, :func:`~polylin.prepare_mlstm_step` or
    :func:`~polylin.prepare_selective_scan_step`, and call it like the step it prepares
    (without the options given to ``prepare_*``), once per token. The first call, and any call
    whose arrays differ in library, shape, dtype or device (or whose numbers differ) from the
    one before it, is checked like the plain step and raises the same errors; the others run
    the arithmetic alone. Outputs equal the plain step's exactly.

    Parameters
    ----------
    plan : callable
        The step's checks: ``plan(*args) -> (plan, checked)``, ``args`` in the order of
        ``names``.
    run : callable
        The step's arithmetic: ``run(plan, *args, checked=None)``.
    name : str
        The prepared step's name, for messages.
    names : tuple of str
        The per-token arguments in order.
    required : int
        How many of them must be given (positionally).
    positional_only : int
        How many of them cannot be passed by keyword; the others can.
    positional : int
        How many can be passed positionally at most.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import delta_rule_step, prepare_delta_rule_step
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 4))
    >>> decode = prepare_delta_rule_step()
    >>> o_t, S = decode(q, k, v, 0.5, log_decay=-0.1)
    >>> bool(np.array_equal(o_t, delta_rule_step(q, k, v, 0.5, log_decay=-0.1)[0]))
    True
    """

    __slots__ = (
        "_key", "_keywords", "_name", "_names", "_plan", "_plan_fn", "_run_fn", "_sizes", "_split"
    )  # fmt: skip

    def __init__(
        self,
        plan: Callable[..., tuple[Any, Any]],
        run: Callable[..., Any],
        *,
        name: str,
        names: tuple[str, ...],
        required: int,
        positional_only: int,
        positional: int,
    ) -> None:
        self._plan_fn, self._run_fn, self._name, self._names = plan, run, name, names
        self._keywords = frozenset(names[positional_only:])
        self._sizes = (required, positional)
        # Per number of positional arguments: the names they take, and the names left.
        self._split = tuple((frozenset(names[:n]), names[n:]) for n in range(len(names) + 1))
        self._key: Hashable = None
        self._plan: Any = None

    @staticmethod
    def signature(args: tuple) -> Hashable:
        """What a step's checks read from the arguments ``args``: the signature of a call.

        Each array's type, shape, dtype and device, each number's value, which arguments are
        ``None``; ``None`` where one argument's signature cannot be had (a traced array, an
        object polylin does not know). Two calls of the same (not ``None``) signature pass or
        fail the same checks, so a caller that keeps its own per-call work (a translation of
        another library's layout) can key it on this.
        """
        return call_signature(args)

    def __repr__(self) -> str:
        return f"<prepared {self._name}({', '.join(self._names)})>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One token: the step's ``(o_t, state)`` (see the ``prepare_*`` function)."""
        n, (required, positional) = len(args), self._sizes
        if not required <= n <= positional:
            raise self._argument_error(args, kwargs)
        given, rest = self._split[n]
        if kwargs and not (self._keywords.issuperset(kwargs) and given.isdisjoint(kwargs)):
            raise self._argument_error(args, kwargs)
        call = args + tuple(map(kwargs.get, rest))
        key = call_signature(call)
        if key is not None and key == self._key:
            return self._run_fn(self._plan, *call)
        plan, checked = self._plan_fn(*call)
        self._key, self._plan = key, plan
        return self._run_fn(plan, *call, checked=checked)

    def _argument_error(self, args: tuple, kwargs: dict[str, Any]) -> TypeError:
        required, positional = self._sizes
        if not required <= len(args) <= positional:
            return TypeError(
                f"{self._name} takes {required} to {positional} positional arguments "
                f"({', '.join(self._names[:positional])}), got {len(args)}"
            )
        unknown = sorted(set(kwargs) - self._keywords)
        if unknown:
            return TypeError(f"{self._name} got unexpected keyword arguments {unknown}")
        return TypeError(f"{self._name} got an argument both by position and by keyword")
