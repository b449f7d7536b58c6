"""Backend policy: the one place that decides by array library or device.

Everything else in the core is written against the array API standard alone. The few decisions
that do depend on which library runs a computation (whether it executes eagerly on the CPU,
whether a constant it made may be cached) are taken here, so that a new backend is taught in one
module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Any

from array_api_compat import (
    is_array_api_strict_namespace,
    is_dask_array,
    is_dask_namespace,
    is_jax_namespace,
    is_numpy_namespace,
    is_torch_namespace,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_EPS",
    "cacheable",
    "compiled",
    "eager_constants",
    "eager_cpu",
    "is_tracer",
    "materialized",
    "stacked_qr",
    "unsupported_array",
]

#: Default added to the normalizer of every normalized entry point.
DEFAULT_EPS = 1e-6

#: Default chunk length of the chunked forms.
DEFAULT_CHUNK_SIZE = 64


def eager_cpu(xp: Any, dev: Any) -> bool:
    """Whether ``xp`` runs each operation at once on the CPU (where cache blocking pays).

    NumPy, array-api-strict and PyTorch on the CPU do; lazy libraries (Dask, JAX under ``jit``)
    and accelerators (CuPy, PyTorch CUDA) prefer few large operations.
    """
    if is_numpy_namespace(xp) or is_array_api_strict_namespace(xp):
        return True
    return is_torch_namespace(xp) and str(dev) == "cpu"


def cacheable(x: Any) -> bool:
    """Whether a freshly made constant array may be reused by later calls.

    Not a JAX tracer (a constant made inside ``jit`` must not outlive its trace), and not a
    PyTorch inference tensor (made under ``torch.inference_mode``, it could not be saved for
    backward by a later training step).
    """
    if is_tracer(x):
        return False
    is_inference = getattr(x, "is_inference", None)
    return not (callable(is_inference) and is_inference())


def stacked_qr(xp: Any) -> bool:
    """Whether ``xp.linalg.qr`` (where ``xp`` has it) factors a stack ``(..., M, N)`` at once.

    Dask's ``qr`` takes one two-dimensional matrix, in a single column of chunks.
    """
    return not is_dask_namespace(xp)


def eager_constants(xp: Any) -> AbstractContextManager[Any]:
    """A context in which arrays computed from Python data alone are concrete and cacheable.

    A projection built from a seed depends on no input, so it should be computed once, at
    once, and kept: under JAX, outside any trace (``jax.ensure_compile_time_eval``: inside
    ``jit`` it would otherwise be recomputed by every call of the compiled function and could
    not be cached); under PyTorch, outside ``inference_mode`` (an inference tensor could not be
    saved for backward by a later training step). The library is already imported whenever its
    namespace is in use, so it is taken from ``sys.modules``, not imported here.
    """
    if is_jax_namespace(xp) and "jax" in sys.modules:
        return sys.modules["jax"].ensure_compile_time_eval()
    if is_torch_namespace(xp) and "torch" in sys.modules:
        return sys.modules["torch"].inference_mode(False)
    return nullcontext()


def materialized(x: Any) -> Any:
    """``x`` computed now where the library is lazy (Dask persists it), else ``x`` itself.

    For a constant that is kept and reused: a lazy array would repeat its whole computation
    in every result that uses it.
    """
    return x.persist() if is_dask_array(x) else x


def compiled(
    xp: Any, function: Callable[..., Any], /, *, static_argnames: tuple[str, ...]
) -> Callable[..., Any]:
    """``function`` compiled as one program where ``xp``'s library compiles, else itself.

    JAX compiles every operation it runs eagerly for each new shape: a build of a few dozen
    operations costs seconds, one ``jax.jit`` program a fraction of that (and is reused for
    every call with the same shapes and static arguments). The compiled function is kept, so
    calls with new seeds reuse the program.
    """
    if is_jax_namespace(xp) and "jax" in sys.modules:
        return _jitted(function, static_argnames)
    return function


@cache
def _jitted(function: Callable[..., Any], static_argnames: Hashable) -> Callable[..., Any]:
    return sys.modules["jax"].jit(function, static_argnames=static_argnames)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a JAX tracer: a value only known when the traced function runs.

    Detected by class name so that the core never imports JAX.
    """
    return any(cls.__name__ == "Tracer" for cls in type(x).__mro__)


def unsupported_array(x: Any) -> str | None:
    """Why ``x`` is an array polylin must refuse, or ``None``.

    Each of these is accepted by ``array_api_compat`` but would compute something else than the
    caller meant: a ``numpy.ma.MaskedArray`` (its mask would be ignored), a NumPy array of an
    ``ml_dtypes`` dtype such as bfloat16 (not a dtype of NumPy's array API), a sparse PyTorch
    tensor. Probed by module and attribute names, without importing the libraries.
    """
    module = type(x).__module__
    if module.startswith("numpy.ma"):
        return (
            "is a numpy.ma.MaskedArray, whose mask polylin would ignore; pass "
            "np.ma.getdata(x) (or x.filled(0)) and the valid positions as attention_mask"
        )
    if module == "numpy" and getattr(getattr(x, "dtype", None), "kind", None) == "V":
        return (
            f"has dtype {x.dtype} (an ml_dtypes extension type), which NumPy's array API does not "
            "support; NumPy inputs may be float16, float32 or float64 (for bfloat16 use "
            "PyTorch or JAX, or cast with x.astype(np.float32))"
        )
    if module == "torch":
        layout = str(getattr(x, "layout", "torch.strided"))
        if layout != "torch.strided":
            return f"is a sparse PyTorch tensor (layout {layout}); pass a dense one (x.to_dense())"
    return None
