"""Layers converted by rebinding the kernel names their ``forward`` calls.

transformers computes the Gated DeltaNet and KDA layers with module-level kernel functions that
its decorators resolve once, at import, to flash-linear-attention's Triton kernels when fla is
installed, and to slow pure-PyTorch copies otherwise (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ...). A converted layer gets its own ``forward``: the class's
function with those kernel names bound to polylin's.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

from ._registry import Conversion


def rebind(func: Any, kernels: dict[str, Callable[..., Any]]) -> Any:
    """``func`` with the global names in ``kernels`` bound to them.

    Decorators (transformers' ``force_accelerate_hooks``) are kept: each wrapper is rebuilt
    around the rebound function it wraps (found through ``__wrapped__``).
    """
    inner = getattr(func, "__wrapped__", None)
    if inner is None:
        missing = [name for name in kernels if name not in func.__code__.co_names]
        if len(missing) == len(kernels):
            raise TypeError(f"{func.__qualname__} calls none of the kernels {sorted(kernels)}")
        scope = {**func.__globals__, **kernels}
        rebound = types.FunctionType(
            func.__code__, scope, func.__name__, func.__defaults__, func.__closure__
        )
        rebound.__kwdefaults__ = func.__kwdefaults__
        functools.update_wrapper(rebound, func)
        # A leaf stays a leaf (update_wrapper points __wrapped__ at func): rebinding it again
        # rebinds it, rather than taking func for a decorator's inner function.
        del rebound.__wrapped__  # type: ignore[attr-defined]
        return rebound
    new_inner = rebind(inner, kernels)
    cells = tuple(
        types.CellType(new_inner) if cell.cell_contents is inner else cell
        for cell in func.__closure__ or ()
    )
    if not any(cell.cell_contents is new_inner for cell in cells):
        raise TypeError(f"cannot rebind the kernels of {func.__qualname__}: unknown decorator")
    wrapper: Any = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, cells
    )
    wrapper.__kwdefaults__ = func.__kwdefaults__
    functools.update_wrapper(wrapper, func)
    wrapper.__wrapped__ = new_inner
    return wrapper


def by_rebinding(
    family: str, models: tuple[str, ...], kernels: dict[str, Callable[..., Any]]
) -> Conversion:
    """A :class:`Conversion` that rebinds ``kernels`` (names the class's forward calls)."""

    @functools.cache
    def polylin(cls: Any) -> Any:
        return rebind(cls.forward, kernels)

    @functools.cache
    def fallback(cls: Any) -> Any:
        module = sys.modules[cls.__module__]
        # transformers' own pure-PyTorch functions, under whatever its decorators resolved
        # (the hub decorator's __wrapped__; a plain function as it is, as LFM3's).
        originals = {name: getattr(module, name) for name in kernels}
        return rebind(
            cls.forward, {name: getattr(f, "__wrapped__", f) for name, f in originals.items()}
        )

    return Conversion(family, models, polylin, fallback, dict(kernels))
