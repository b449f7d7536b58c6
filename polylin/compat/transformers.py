"""Run transformers' Gated DeltaNet and Kimi Delta Attention layers on polylin's kernels.

transformers (5.23.0) computes these layers with module-level kernel functions that its
decorators resolve once, at import, to flash-linear-attention's Triton kernels when fla is
installed, and to slow pure-PyTorch copies otherwise (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ...). :func:`use_polylin` points one model's layers at
:mod:`polylin.compat.fla` instead: each layer gets its own ``forward``, the class's function
with those kernel names bound to polylin's. Nothing global changes: other models, other layers
and the classes themselves keep their kernels, and ``del layer.forward`` undoes it.

This module imports torch and transformers only when a function is called.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from ..compat import fla

__all__ = ["LAYER_CLASSES", "use_polylin", "use_transformers_fallback"]


def _kernel(twin: Callable[..., Any], *, chunked: bool) -> Callable[..., Any]:
    """transformers' kernel signature (``torch_chunk_gated_delta_rule`` and its kin) on ``twin``."""

    def kernel(
        query: Any,
        key: Any,
        value: Any,
        g: Any,
        beta: Any,
        chunk_size: int = 64,
        initial_state: Any = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        # Other keywords are the model's own (attention kwargs): transformers drops them too.
        options = {"chunk_size": chunk_size} if chunked else {}
        return twin(
            query, key, value, g=g, beta=beta, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, **options,
        )  # fmt: skip

    kernel.__name__ = kernel.__qualname__ = f"polylin_{twin.__name__}"
    return kernel


_GATED_DELTA: dict[str, Callable[..., Any]] = {
    "torch_chunk_gated_delta_rule": _kernel(fla.chunk_gated_delta_rule, chunked=True),
    "torch_recurrent_gated_delta_rule": _kernel(
        fla.fused_recurrent_gated_delta_rule, chunked=False
    ),
}
_KDA: dict[str, Callable[..., Any]] = {
    "chunk_kimi_delta_attention": _kernel(fla.chunk_kda, chunked=True),
    "recurrent_kimi_delta_attention": _kernel(fla.fused_recurrent_kda, chunked=False),
}

#: The layer classes (by name) :func:`use_polylin` converts, and the kernel names each calls.
#: Checked on transformers 5.23.0 (``tests/test_compat_transformers.py``).
LAYER_CLASSES: dict[str, dict[str, Callable[..., Any]]] = {
    "Qwen3NextGatedDeltaNet": _GATED_DELTA,
    "Qwen3_5GatedDeltaNet": _GATED_DELTA,
    "Qwen3_5MoeGatedDeltaNet": _GATED_DELTA,
    "KimiLinearDeltaAttention": _KDA,
}


def _rebind(func: Any, kernels: dict[str, Callable[..., Any]]) -> Any:
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
        return functools.update_wrapper(rebound, func)
    new_inner = _rebind(inner, kernels)
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


@functools.cache
def _forward_for(cls: Any, source: str) -> Any:
    """The class's ``forward`` on ``source``'s kernels (built once per class)."""
    kernels = LAYER_CLASSES[cls.__name__]
    if source == "transformers":
        module = __import__(cls.__module__, fromlist=["_"])
        # transformers' own pure-PyTorch functions, under whatever its decorators resolved.
        kernels = {name: getattr(module, name).__wrapped__ for name in kernels}
    return _rebind(cls.forward, kernels)


def _convert(model: Any, source: str) -> Any:
    converted = 0
    for layer in model.modules():
        cls: Any = type(layer)
        if cls.__name__ in LAYER_CLASSES:
            layer.forward = types.MethodType(_forward_for(cls, source), layer)
            converted += 1
    if converted == 0:
        raise ValueError(
            f"{type(model).__name__} has no layer polylin can run (looked for "
            f"{', '.join(sorted(LAYER_CLASSES))})"
        )
    return model


def use_polylin(model: Any) -> Any:
    """Point the model's Gated DeltaNet / Kimi Delta Attention layers at polylin's kernels.

    Each such layer (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi-Linear; see
    :data:`LAYER_CLASSES`) calls :func:`polylin.compat.fla.chunk_gated_delta_rule` and
    :func:`~polylin.compat.fla.fused_recurrent_gated_delta_rule` (or the ``kda`` pair) where
    transformers would call fla's Triton kernels or its pure-PyTorch fallbacks. Prefill,
    training (autograd) and cached decoding all go through them; the causal convolution and
    every other part of the model are unchanged.

    Parameters
    ----------
    model : transformers.PreTrainedModel or torch.nn.Module
        Any module containing such layers (converted in place).

    Returns
    -------
    model
        The same model.

    Raises
    ------
    ValueError
        The model has no such layer.

    Examples
    --------
    >>> from polylin.compat.transformers import use_polylin
    >>> model = use_polylin(model)  # doctest: +SKIP
    """
    return _convert(model, "polylin")


def use_transformers_fallback(model: Any) -> Any:
    """Point the same layers at transformers' own pure-PyTorch functions.

    transformers picks fla's Triton kernels whenever ``fla`` imports, even where they cannot
    run (a CPU): this runs its reference code instead, for comparisons and benchmarks.

    Parameters
    ----------
    model : transformers.PreTrainedModel or torch.nn.Module
        Any module containing such layers (converted in place).

    Returns
    -------
    model
        The same model.

    Raises
    ------
    ValueError
        The model has no such layer.

    Examples
    --------
    >>> from polylin.compat.transformers import use_transformers_fallback
    >>> reference = use_transformers_fallback(model)  # doctest: +SKIP
    """
    return _convert(model, "transformers")
