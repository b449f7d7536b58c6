"""Type names shared by polylin's signatures.

The array API standard has no static type that every library's arrays satisfy (NumPy, PyTorch,
CuPy, JAX, Dask and array-api-strict arrays share no base class), so :data:`Array` names the
concept for readers and tools while type checkers treat it as ``Any``. It is the one place to
tighten when a standard array protocol is available.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Array", "Namespace"]

#: An array of any array-API library (the inputs' library, device and dtype are kept).
Array: TypeAlias = Any

#: An array-API namespace, as returned by ``array_api_compat.array_namespace``.
Namespace: TypeAlias = Any
