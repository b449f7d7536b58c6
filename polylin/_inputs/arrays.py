"""The one check of an array argument: same library and device as the inputs, a floating
dtype where one is needed, a known shape; and the small predicates the other checks share.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from .._backend.allocator import raise_thresholds
from .._backend.namespace import array_namespace, is_array, unsupported_array
from .._backend.namespace import device as device_of
from .._backend.ops import broadcast_shape

if TYPE_CHECKING:
    pass

__all__ = [
    "broadcast_shapes",
    "broadcasts_to",
    "check_beside",
    "check_device",
    "check_floating",
    "check_known_shape",
    "is_real_number",
    "library_name",
    "namespace_of",
    "other_device",
    "work_dtype_for",
]


def library_name(x: Any) -> str:
    """A short library name for error messages."""
    module = type(x).__module__.split(".")[0]
    return {"jaxlib": "jax"}.get(module, module)


def namespace_of(**arrays: Any) -> Any:
    """Return the array-API namespace shared by the named arrays.

    Raises a ``TypeError`` naming the argument that is not an array, or that comes from another
    library than the first one.
    """
    xp = None
    first = ""
    for name, x in arrays.items():
        if not is_array(x):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        problem = unsupported_array(x)
        if problem is not None:
            raise TypeError(f"{name} {problem}")
        try:
            this = array_namespace(x)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        if xp is None:
            xp, first = this, name
        elif this is not xp:
            raise TypeError(
                f"{name} is a {library_name(x)} array but {first} is a "
                f"{library_name(arrays[first])} "
                "array; pass arrays from one library"
            )
    if xp is not None:
        raise_thresholds(xp, arrays[first])  # the process's first eager call: once
    return xp


def other_device(device: Any, x: Any) -> bool:
    """Whether ``x`` is known to live on another device than ``device``.

    A JAX tracer has no device (``None``) while an array closed over under ``jit`` has one:
    that is not a mismatch.
    """
    other = device_of(x)
    return device is not None and other is not None and other != device


def is_real_number(x: Any) -> bool:
    """Whether ``x`` is a real number (Python or NumPy scalar), not a bool and not an array.

    NumPy scalars are arrays to array-api-compat, but a caller means a number: they broadcast
    whatever the layout, and are checked like Python numbers.

    Parameters
    ----------
    x : object
        Anything.

    Returns
    -------
    bool
        Whether polylin takes ``x`` as a number.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.interop import is_real_number
    >>> is_real_number(0.5), is_real_number(np.float32(0.5)), is_real_number(True)
    (True, True, False)
    """
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_device(xp: Any, device: Any, first: str, **arrays: Any) -> None:
    for name, x in arrays.items():
        other = device_of(x)
        if other_device(device, x):
            raise ValueError(f"{name} is on device {other} but {first} is on device {device}")


def check_beside(xp: Any, device: Any, name: str, x: Any, *, query: str = "q") -> None:
    """The one check of an array given beside the inputs (a state, a mask, a gate, a
    coefficient): an array of their library ``xp`` (a ``TypeError`` otherwise) on their
    ``device`` (a ``ValueError``), each message naming ``x`` as ``name`` and the inputs by
    ``query``. Its dtype and shape are the caller's to check: what each argument may hold
    differs."""
    if namespace_of(**{name: x}) is not xp:
        raise TypeError(f"{name} must be an array of the same library as {query}")
    if other_device(device, x):
        raise ValueError(f"{name} is on device {device_of(x)} but {query} is on device {device}")


def work_dtype_for(xp: Any, dtype: Any) -> Any:
    """The dtype to accumulate in: float32 for 16-bit floats, the dtype itself otherwise.

    Bit width is read from ``finfo`` rather than compared to ``xp.float16``: not every namespace
    has float16 or bfloat16, and NumPy's ``dtype == None`` comparisons are a trap.

    Parameters
    ----------
    xp : namespace
        The array-API namespace of the inputs.
    dtype : dtype
        A real floating dtype of ``xp``.

    Returns
    -------
    dtype
        The dtype polylin computes in for inputs of ``dtype``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.interop import array_namespace, work_dtype_for
    >>> xp = array_namespace(np.ones(1))
    >>> work_dtype_for(xp, xp.float16) == xp.float32, work_dtype_for(xp, xp.float64) == xp.float64
    (True, True)
    """
    return xp.float32 if xp.finfo(dtype).bits < 32 else dtype


def check_floating(xp: Any, name: str, x: Any) -> None:
    """Refuse an array whose dtype is not a real floating one, naming it.

    Parameters
    ----------
    xp : namespace
        The array-API namespace of ``x``.
    name : str
        The argument's name, as the caller wrote it.
    x : array
        The argument.

    Raises
    ------
    TypeError
        ``x`` has an integer, boolean or complex dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.interop import array_namespace, check_floating
    >>> x = np.arange(3)
    >>> check_floating(array_namespace(x), "q", x)
    Traceback (most recent call last):
    ...
    TypeError: q must have a real floating dtype, got int64
    """
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")


def check_known_shape(name: str, x: Any) -> None:
    # Lazy libraries may not know a size until they compute (the standard says None, Dask
    # says nan); every algorithm needs static sizes to lay out its chunks.
    if any(s is None or (isinstance(s, float) and s != s) for s in x.shape):
        raise ValueError(
            f"{name} has unknown dimensions {tuple(x.shape)}; polylin needs every size known "
            f"(for a Dask array, call {name}.compute_chunk_sizes() first)"
        )


def broadcast_shapes(shapes: dict[str, tuple]) -> tuple:
    """The broadcast shape of the named shapes (the usual rules: aligned from the right, a size
    of 1 stretches); a ``ValueError`` naming the arguments and their shapes if they do not
    broadcast. Only shapes are combined: nothing is copied.
    """
    try:
        return broadcast_shape(*shapes.values())
    except ValueError as exc:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"the leading dimensions of {listed} do not broadcast ({exc})") from None


def broadcasts_to(got: tuple, expected: tuple, core: int) -> bool:
    """Whether a state of shape ``got`` serves ``expected``: the last ``core`` axes equal, the
    leading ones broadcast (a state shared by a batch, or by grouped heads)."""
    lead, full = got[: len(got) - core], expected[: len(expected) - core]
    return (
        got[len(got) - core :] == expected[len(expected) - core :]
        and len(lead) <= len(full)
        and all(g in (1, f) for g, f in zip(reversed(lead), reversed(full)))
    )
