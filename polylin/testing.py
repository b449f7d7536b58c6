"""Backend drivers shared by the tests, the benchmark and the CLI.

Each :class:`Backend` knows whether it can run here (and why not), its array namespace and device,
how to make an array from a NumPy array on that device, how to bring a result back to NumPy, and
how to wait for queued work before a timer stops. Downstream users can use the drivers to
cross-check their own array-API code on every library installed.

This module (with ``__main__``) is the only place in polylin that imports array libraries, and
it imports each one lazily, only when that backend is used; it imports without NumPy (moving
data to and from NumPy needs NumPy, of course).

Asking a driver anything changes no global setting of its library. In particular JAX runs in
the mode its caller chose (``jax_enable_x64`` is read, never set: without it JAX has no
float64, and :meth:`Backend.float_dtypes` says so), and array-api-strict keeps its caller's
flags. The test suite sets both explicitly (``tests/conftest.py``): x64 on, and the strict
flags of :data:`STRICT_FLAGS`.
"""

from __future__ import annotations

import enum
import importlib
import os
from functools import cache
from typing import TYPE_CHECKING, Any

from ._typing import Array, Namespace

if TYPE_CHECKING:
    import numpy as np

__all__ = ["STRICT_API_VERSION", "STRICT_FLAGS", "Backend", "selected_backends"]

#: The standard version array-api-strict is pinned to in tests.
STRICT_API_VERSION = "2024.12"

#: The flags the test suite gives array-api-strict (``set_array_api_strict_flags(**STRICT_FLAGS)``):
#: the pinned standard version, and no feature whose output shape depends on data.
STRICT_FLAGS = {
    "api_version": STRICT_API_VERSION,
    "boolean_indexing": False,
    "data_dependent_shapes": False,
}


class Backend(enum.Enum):
    """The array libraries (and devices) polylin is tested on.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.testing import Backend
    >>> b = Backend.NUMPY
    >>> b.unavailable_reason() is None
    True
    >>> x = b.from_numpy(np.ones((2, 3), dtype=np.float32))
    >>> b.to_numpy(x * 2).sum()
    np.float32(12.0)
    """

    NUMPY = "numpy"
    ARRAY_API_STRICT = "array_api_strict"
    TORCH = "torch"
    TORCH_CUDA = "torch:cuda"
    CUPY = "cupy"
    JAX = "jax"
    JAX_CUDA = "jax:cuda"
    DASK = "dask"

    def __str__(self) -> str:
        return self.value

    @property
    def library(self) -> str:
        """The importable module name of the array library."""
        return {"jax": "jax.numpy", "dask": "dask.array"}.get(
            self.value.split(":")[0], self.value.split(":")[0]
        )

    @property
    def is_gpu(self) -> bool:
        """Whether arrays of this backend live on a GPU."""
        return self in (Backend.TORCH_CUDA, Backend.CUPY, Backend.JAX_CUDA)

    def unavailable_reason(self) -> str | None:
        """``None`` if this backend can run here, else a short reason to show in a skip."""
        return _unavailable_reason(self)

    def available(self) -> bool:
        """Whether this backend can run here."""
        return self.unavailable_reason() is None

    def module(self) -> Any:
        """The array library's own module (``numpy``, ``torch``, ``cupy``, ...), as configured
        by its caller: importing it here changes no setting."""
        return importlib.import_module(self.library)

    def namespace(self) -> Namespace:
        """The array-API namespace polylin resolves for this backend's arrays."""
        import array_api_compat

        return array_api_compat.array_namespace(self._probe())

    def _probe(self) -> Array:
        """A small array of this backend on its device (made without NumPy)."""
        mod = self.module()
        if self is Backend.DASK:
            return mod.zeros((1,))
        if self.device is not None:
            return mod.asarray([0.0], device=self.device)
        return mod.asarray([0.0])

    @property
    def device(self) -> Any:
        """The device arrays are created on (``None`` for the library default)."""
        if self is Backend.TORCH:
            return self.module().device("cpu")
        if self is Backend.TORCH_CUDA:
            return self.module().device("cuda")
        if self is Backend.JAX_CUDA:
            return importlib.import_module("jax").devices("gpu")[0]
        return None

    def float_dtypes(self) -> list[str]:
        """Names of the floating dtypes this backend supports here and now, widest first.

        JAX has float64 only while ``jax_enable_x64`` is on (read, not set).
        """
        names = ["float64", "float32"]
        if self in (Backend.JAX, Backend.JAX_CUDA) and not _jax_x64():
            names.remove("float64")
        if self is not Backend.ARRAY_API_STRICT:
            names.append("float16")
        if self in (Backend.TORCH, Backend.TORCH_CUDA, Backend.JAX, Backend.JAX_CUDA):
            names.append("bfloat16")
        return names

    def dtype(self, name: str) -> Any:
        """The library's dtype object called ``name``."""
        if self is Backend.DASK:
            import numpy as np

            return np.dtype(name)
        return getattr(self.module(), name)

    def from_numpy(self, x: np.ndarray, dtype: str | None = None, chunks: Any = None) -> Array:
        """A copy of ``x`` as an array of this backend on its device, optionally cast to ``dtype``.

        ``chunks`` is passed to Dask (default: one chunk) and ignored elsewhere. A ``dtype``
        this backend lacks here (see :meth:`float_dtypes`) raises ``ValueError``.
        """
        import numpy as np

        if dtype is not None and dtype.startswith("float") and dtype not in self.float_dtypes():
            hint = " (JAX needs jax_enable_x64 for float64)" if dtype == "float64" else ""
            raise ValueError(f"dtype={dtype!r}: {self} has no {dtype} here{hint}")
        mod = self.module()
        x = np.asarray(x)
        if self in (Backend.TORCH, Backend.TORCH_CUDA, Backend.JAX_CUDA):
            out = mod.asarray(x.copy(), device=self.device)
        elif self is Backend.DASK:
            out = mod.from_array(x.copy(), chunks=chunks if chunks is not None else -1)
        else:
            out = mod.asarray(x.copy())
        return out if dtype is None else self._cast(out, dtype)

    def _cast(self, x: Array, dtype: str) -> Array:
        return self.namespace().astype(x, self.dtype(dtype))

    def to_numpy(self, x: Array) -> np.ndarray:
        """A NumPy copy of ``x`` (computing it if lazy); 16-bit floats come back as float32."""
        import numpy as np

        if self in (Backend.TORCH, Backend.TORCH_CUDA):
            x = x.detach()
            if x.dtype == self.module().bfloat16:
                x = x.float()
            return x.cpu().numpy()
        if self is Backend.CUPY:
            return x.get()
        if self is Backend.DASK:
            return np.asarray(x.compute() if hasattr(x, "compute") else x)
        if self is Backend.ARRAY_API_STRICT:
            return np.asarray(x._array)
        out = np.asarray(x)
        # JAX's bfloat16 (ml_dtypes) is not a NumPy float kind: widen it for NumPy users.
        return out.astype(np.float32) if "bfloat16" in str(out.dtype) else out

    def synchronize(self, x: Array | None = None) -> Array | None:
        """Wait for queued device work (and compute a lazy ``x``); returns ``x``."""
        if self is Backend.TORCH_CUDA:
            self.module().cuda.synchronize()
        elif self is Backend.CUPY:
            self.module().cuda.get_current_stream().synchronize()
        elif self in (Backend.JAX, Backend.JAX_CUDA) and x is not None:
            x.block_until_ready()
        elif self is Backend.DASK and x is not None:
            x = x.compute()
        return x


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _jax_x64() -> bool:
    """Whether JAX has 64-bit types in this thread now (its config or an enable_x64 context)."""
    import jax

    return bool(jax.config.read("jax_enable_x64"))


@cache
def _unavailable_reason(backend: Backend) -> str | None:
    try:
        mod = importlib.import_module(backend.library)
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"{backend.library} is not installed ({_first_line(exc)})"
    try:
        if backend is Backend.TORCH_CUDA and not mod.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        if backend is Backend.CUPY:
            try:
                count = mod.cuda.runtime.getDeviceCount()
            except Exception as exc:
                return f"no CUDA device for CuPy ({type(exc).__name__})"
            if count < 1:
                return "no CUDA device for CuPy"
        if backend is Backend.JAX_CUDA:
            try:
                importlib.import_module("jax").devices("gpu")
            except Exception as exc:  # RuntimeError: no gpu platform in this jaxlib
                return f"no CUDA device for JAX ({type(exc).__name__})"
        if backend is Backend.DASK:
            importlib.import_module("dask.array")
        backend.namespace()
    except Exception as exc:
        return f"{backend} cannot run here ({_first_line(exc)})"
    return None


def selected_backends(
    env_var: str = "POLYLIN_BACKENDS", *, names: str | None = None
) -> list[Backend]:
    """The backends named in ``$POLYLIN_BACKENDS`` (or in ``names``; comma separated), or all.

    Parameters
    ----------
    env_var : str
        The environment variable to read.
    names : str, optional
        Comma-separated backend names to use instead of the environment variable.

    Returns
    -------
    list of Backend
        The named backends in the order given, or every backend when none is named.

    Raises
    ------
    ValueError
        When a name is not a backend's.

    Examples
    --------
    >>> from polylin.testing import selected_backends
    >>> selected_backends(names="numpy, torch")
    [<Backend.NUMPY: 'numpy'>, <Backend.TORCH: 'torch'>]
    """
    names = (os.environ.get(env_var, "") if names is None else names).strip()
    if not names:
        return list(Backend)
    try:
        return [Backend(n.strip()) for n in names.split(",") if n.strip()]
    except ValueError:
        known = ", ".join(b.value for b in Backend)
        raise ValueError(f"{env_var}={names!r}: unknown backend; known: {known}") from None
