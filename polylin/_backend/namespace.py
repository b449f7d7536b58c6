"""Which library and device an array belongs to: namespaces, devices, tracers.

The core asks this module, not ``array_api_compat`` directly, for an array's namespace and
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
    "DASK_NAMESPACES",
    "JAX_NAMESPACES",
    "array_namespace",
    "device",
    "is_array",
    "is_numpy_array",
    "is_tracer",
    "library_name",
    "loaded_numpy",
    "loaded_torch",
    "resolve_torch_namespace",
    "torch_module",
    "torch_namespace_of",
    "unsupported_array",
    "zero_of",
]


def torch_namespace_of(x: Any) -> Any | None:
    """array-api-compat's PyTorch namespace if ``x`` is a torch tensor, else ``None``.

    Reads ``sys.modules`` instead of importing torch: if torch was never imported, ``x`` cannot
    be one of its tensors.
    """
    torch = _TORCH
    if torch is None:  # not resolved yet: torch was imported after polylin, or never
        torch = sys.modules.get("torch")
        if torch is None:
            return None
    if not isinstance(x, torch.Tensor):
        return None
    if _TORCH_NAMESPACE is None:
        resolve_torch_namespace()
    return _TORCH_NAMESPACE


def torch_module() -> Any:
    """The torch module where a tensor was seen (a module global under tracing, see below)."""
    return _TORCH if _TORCH is not None else sys.modules["torch"]


def loaded_torch() -> Any | None:
    """The torch module if torch is imported (resolved, or in ``sys.modules``), else ``None``."""
    return _TORCH if _TORCH is not None else sys.modules.get("torch")


def resolve_torch_namespace() -> None:
    """Look up array-api-compat's PyTorch namespace once torch is imported (it imports torch).

    Done when polylin is imported after torch (and by ``polylin.torch``), not at the first call:
    a first call traced by ``torch.compile`` would see this module's globals change, guard on
    them, and compile the function a second time at the next call.
    """
    global _TORCH, _TORCH_NAMESPACE
    from array_api_compat import torch as torch_namespace

    _TORCH, _TORCH_NAMESPACE = sys.modules.get("torch"), torch_namespace


# Module globals, not sys.modules: a traced call reads no dictionary that imports can change
# while torch.compile installs its guards (which iterate over what the trace read).
_TORCH: Any = None  # the torch module, once resolved


_TORCH_NAMESPACE: Any = None  # array-api-compat's torch namespace, once torch is imported


# A module blocked with ``sys.modules[name] = None`` (how a program proves it runs without
# it) is in sys.modules but not imported: only a module object counts.
if sys.modules.get("torch") is not None:  # imported before polylin, the usual order
    resolve_torch_namespace()


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array of a library that polylin can run on.

    Parameters
    ----------
    x : object
        Anything.

    Returns
    -------
    bool
        ``False`` for ``None``, Python numbers and strings, ``True`` for an array of an
        array-API library (NumPy scalars included).

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.interop import is_array
    >>> is_array(np.zeros(3)), is_array(0.5), is_array(None)
    (True, False, False)
    """
    # Plain Python values are answered here: torch.compile warns in array-api-compat's cached
    # check. Exact types: NumPy scalars subclass float and are arrays to array-api-compat.
    if x is None or type(x) in (bool, int, float, complex, str):
        return False
    return torch_namespace_of(x) is not None or array_api_compat.is_array_api_obj(x)


def loaded_numpy() -> Any | None:
    """The numpy module if it is imported, else ``None`` (never imports it)."""
    return sys.modules.get("numpy")


def is_numpy_array(x: Any) -> bool:
    """Whether ``x`` is exactly a ``numpy.ndarray`` (not a subclass, not a NumPy scalar)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(x) is numpy.ndarray


def zero_of(xp: Any, x: Any) -> Any:
    """A 0-d zero of ``x``'s dtype and device. NumPy: one read-only zero per dtype, made once
    (allocating it took longer than the ``minimum`` it serves in a decoding step's feature map).
    """
    if not is_numpy_array(x):
        return xp.zeros((), dtype=x.dtype, device=device(x))
    zero = _NUMPY_ZEROS.get(x.dtype)
    if zero is None:
        zero = xp.zeros((), dtype=x.dtype)
        zero.flags.writeable = False
        _NUMPY_ZEROS[x.dtype] = zero
    return zero


_NUMPY_ZEROS: dict[Any, Any] = {}  # dtype -> read-only 0-d zero (see zero_of)


def array_namespace(x: Any) -> Any:
    """The array-API namespace of ``x`` (``array_api_compat.array_namespace`` of one array).

    Tensors and NumPy arrays are answered without array-api-compat's general lookup (a few
    microseconds a call: a decoding step asks several times); under ``torch.compile`` the
    namespace is one that compiles without graph breaks.

    Parameters
    ----------
    x : array
        An array of any array-API library.

    Returns
    -------
    namespace
        The namespace polylin computes with for ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.interop import array_namespace
    >>> xp = array_namespace(np.ones(3))
    >>> float(xp.sum(xp.ones(3)))
    3.0
    """
    xp = torch_namespace_of(x)
    if xp is not None:
        return xp
    global _NUMPY_NAMESPACE
    if is_numpy_array(x):
        if _NUMPY_NAMESPACE is None:
            _NUMPY_NAMESPACE = array_api_compat.array_namespace(x)
        return _NUMPY_NAMESPACE
    return array_api_compat.array_namespace(x)


_NUMPY_NAMESPACE: Any = None  # array-api-compat's NumPy namespace, once an array was seen


def device(x: Any) -> Any:
    """The device of ``x`` (``array_api_compat.device``).

    Parameters
    ----------
    x : array
        An array of any array-API library.

    Returns
    -------
    device
        Its device, as its library names it (``"cpu"`` for NumPy).

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.interop import device
    >>> device(np.ones(3))
    'cpu'
    """
    if torch_namespace_of(x) is not None:
        return x.device
    return "cpu" if is_numpy_array(x) else array_api_compat.device(x)


def library_name(xp: Any) -> str:
    """The library behind a namespace: ``"torch"`` for torch and array-api-compat's wrapper.

    By name, not with array-api-compat's ``is_*_namespace`` helpers: those are
    ``lru_cache``-wrapped, which ``torch.compile`` warns about.
    """
    return getattr(xp, "__name__", "").removeprefix("array_api_compat.")


JAX_NAMESPACES = ("jax.numpy", "jax.experimental.array_api")


DASK_NAMESPACES = ("dask.array",)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a JAX tracer: a value only known when the traced function runs.

    Detected by class name so that the core never imports JAX. Python numbers and torch tensors
    are answered first: ``torch.compile`` cannot walk the class hierarchy of a builtin type.
    """
    if x is None or isinstance(x, (bool, int, float, complex, str)):
        return False
    if torch_namespace_of(x) is not None:
        return False
    cls = type(x)
    tracer = _TRACER_TYPES.get(cls)
    if tracer is None:
        tracer = _TRACER_TYPES.setdefault(
            cls, any(base.__name__ == "Tracer" for base in cls.__mro__)
        )
    return tracer


#: Whether each type seen by :func:`is_tracer` is a JAX tracer (one lookup, not an MRO walk).
_TRACER_TYPES: dict[type, bool] = {}


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
