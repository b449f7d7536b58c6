"""Backend policy: the one place that decides by array library or device.

Everything else in the core is written against the array API standard alone. The few decisions
that do depend on which library runs a computation (whether it executes eagerly on the CPU,
whether a constant it made may be cached) are taken here, so that a new backend is taught in one
module.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import (
    is_array_api_strict_namespace,
    is_numpy_namespace,
    is_torch_namespace,
)

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_EPS", "cacheable", "eager_cpu"]

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
    if any(cls.__name__ == "Tracer" for cls in type(x).__mro__):
        return False
    is_inference = getattr(x, "is_inference", None)
    return not (callable(is_inference) and is_inference())
