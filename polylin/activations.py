"""Elementwise activations of the layers' blocks, written so that no exponential overflows.

The standard has ``exp`` and ``log1p`` but no sigmoid, SiLU or softplus. Each is written here
from ``exp`` of a number ``<= 0`` only: finite for every finite input in every dtype, with
finite gradients (a ``where`` whose unused branch overflows would still give NaN gradients).
On PyTorch, whose CPU ``where`` is slow, the same functions run as its own kernels
(:func:`polylin._backend.ops.native_activation`).
"""

from __future__ import annotations

from ._backend.namespace import array_namespace
from ._backend.ops import native_activation
from ._typing import Array

__all__ = ["sigmoid", "silu", "softplus"]


def sigmoid(x: Array, /) -> Array:
    """The logistic function ``1 / (1 + exp(-x))``, from ``exp(-|x|)`` alone.

    Parameters
    ----------
    x : array
        Any real floating array.

    Returns
    -------
    array
        ``sigmoid(x)`` in ``[0, 1]``, the shape, library and dtype of ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.activations import sigmoid
    >>> sigmoid(np.array([-1000.0, 0.0, 1000.0]))
    array([0. , 0.5, 1. ])
    """
    native = native_activation("sigmoid", x)  # PyTorch: its own kernel (a fast where-free one)
    if native is not None:
        return native
    xp = array_namespace(x)
    # exp(-|x|) <= 1, with -|x| as a selection: at 0 its gradient is -1 (abs' gives 0 there).
    e = xp.exp(xp.where(x >= 0, -x, x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x: Array, /) -> Array:
    """SiLU (swish): ``x * sigmoid(x)``.

    Parameters
    ----------
    x : array
        Any real floating array.

    Returns
    -------
    array
        The shape, library and dtype of ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.activations import silu
    >>> silu(np.array([-1000.0, 0.0, 2.0])).round(4)
    array([-0.    ,  0.    ,  1.7616])
    """
    native = native_activation("silu", x)
    return x * sigmoid(x) if native is None else native


def softplus(x: Array, /) -> Array:
    """``log(1 + exp(x))``, computed as ``max(x, 0) + log1p(exp(-|x|))``.

    Exact for every finite ``x`` (no threshold above which it returns ``x``): large positive
    inputs never reach ``exp``. Its gradient is ``sigmoid(x)`` everywhere, 0.5 at 0.

    Parameters
    ----------
    x : array
        Any real floating array.

    Returns
    -------
    array
        ``softplus(x) > 0`` (0 only where it underflows), the shape, library and dtype of ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.activations import softplus
    >>> softplus(np.array([-1000.0, 0.0, 1000.0])).tolist()
    [0.0, 0.6931471805599453, 1000.0]
    """
    native = native_activation("softplus", x)
    if native is not None:
        return native
    xp = array_namespace(x)
    positive = x >= 0
    # -|x| as a selection so that both pieces take x = 0 from the same side: the gradient
    # there is 1 - 1/2, not 1 or 0.
    return xp.where(positive, x, 0.0) + xp.log1p(xp.exp(xp.where(positive, -x, x)))
