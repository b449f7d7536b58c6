"""Backend policy: the one place that decides by array library or device.

Everything else in the core is written against the array API standard alone. The few decisions
that do depend on which library runs a computation (whether it executes eagerly on the CPU,
whether a constant it made may be cached) are taken here, so that a new backend is taught in one
module.

The core also asks this module, not ``array_api_compat`` directly, for an array's namespace and
device. For PyTorch tensors the answer is found without array-api-compat's
``functools.lru_cache``-wrapped helpers: ``torch.compile`` cannot trace through a cache, warns at
every call site and traces the wrapped function, which made a compiled call slow to build and
noisy. Every other library goes through ``array_api_compat`` unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import array_api_compat

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_EPS",
    "array_namespace",
    "cacheable",
    "cumulative_sum",
    "device",
    "eager_cpu",
    "is_array",
]

#: Default added to the normalizer of every normalized entry point.
DEFAULT_EPS = 1e-6

#: Default chunk length of the chunked forms.
DEFAULT_CHUNK_SIZE = 64


def _torch_namespace(x: Any) -> Any | None:
    """array-api-compat's PyTorch namespace if ``x`` is a torch tensor, else ``None``.

    Reads ``sys.modules`` instead of importing torch: if torch was never imported, ``x`` cannot
    be one of its tensors.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    from array_api_compat import torch as torch_namespace  # imports torch: only once it is

    return torch_namespace


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array of a library that polylin can run on."""
    return _torch_namespace(x) is not None or array_api_compat.is_array_api_obj(x)


def array_namespace(x: Any) -> Any:
    """The array-API namespace of ``x`` (``array_api_compat.array_namespace`` of one array)."""
    xp = _torch_namespace(x)
    return array_api_compat.array_namespace(x) if xp is None else xp


def device(x: Any) -> Any:
    """The device of ``x`` (``array_api_compat.device``)."""
    return x.device if _torch_namespace(x) is not None else array_api_compat.device(x)


def cumulative_sum(xp: Any, x: Any, /, *, axis: int, include_initial: bool = False) -> Any:
    """``xp.cumulative_sum(x, axis=axis, include_initial=include_initial)``, traceable.

    For PyTorch, ``torch.cumsum`` itself: array-api-compat's wrapper resolves a namespace through
    its cached helpers, which ``torch.compile`` warns about. Call this instead of
    ``xp.cumulative_sum`` everywhere in the core.
    """
    if _torch_namespace(x) is None:
        return xp.cumulative_sum(x, axis=axis, include_initial=include_initial)
    inclusive = sys.modules["torch"].cumsum(x, dim=axis)
    if not include_initial:
        return inclusive
    shape = list(x.shape)
    shape[axis] = 1
    initial = xp.zeros(tuple(shape), dtype=inclusive.dtype, device=x.device)
    return xp.concat([initial, inclusive], axis=axis)


def _library(xp: Any) -> str:
    """The library behind a namespace: ``"torch"`` for torch and array-api-compat's wrapper."""
    return getattr(xp, "__name__", "").removeprefix("array_api_compat.")


def eager_cpu(xp: Any, dev: Any) -> bool:
    """Whether ``xp`` runs each operation at once on the CPU (where cache blocking pays).

    NumPy, array-api-strict and PyTorch on the CPU do (not under ``torch.compile``); lazy
    libraries (Dask, JAX under ``jit``) and accelerators (CuPy, PyTorch CUDA) prefer few large
    operations.
    """
    library = _library(xp)
    if library in ("numpy", "array_api_strict"):
        return True
    if library != "torch" or str(dev) != "cpu":
        return False
    # Under torch.compile the whole call becomes one graph that the compiler fuses and
    # schedules: blocks would only unroll into a graph that grows with T.
    return not sys.modules["torch"].compiler.is_compiling()


def cacheable(x: Any) -> bool:
    """Whether a freshly made constant array may be reused by later calls.

    Not a JAX tracer (a constant made inside ``jit`` must not outlive its trace), not a tensor
    made while ``torch.compile`` traces (a placeholder of the graph being built), and not a
    PyTorch inference tensor (made under ``torch.inference_mode``, it could not be saved for
    backward by a later training step).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return not (torch.compiler.is_compiling() or x.is_inference())
    return not any(cls.__name__ == "Tracer" for cls in type(x).__mro__)
