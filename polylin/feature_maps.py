"""Positive feature maps phi for linear attention.

A feature map turns queries and keys into non-negative features so that ``phi(q) . phi(k)`` is a
valid (non-negative) attention weight. Any callable from array to array is accepted by the
attention functions; the ones here are written against the array API standard and work on every
backend.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

__all__ = ["RELU_EPS", "elu_plus_one", "relu"]

#: Added by :func:`relu` so that a row of features is never all zero.
RELU_EPS = 1e-6


def elu_plus_one(x: Any, /) -> Any:
    """The default feature map, ``elu(x) + 1``: smooth and strictly positive.

    Equals ``x + 1`` for ``x > 0`` and ``exp(x)`` otherwise. Output size equals input size;
    cost is a few elementwise passes.

    Parameters
    ----------
    x : array
        Queries or keys, any shape, real floating dtype.

    Returns
    -------
    array
        ``elu(x) + 1``, same shape, dtype, library and device as ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.feature_maps import elu_plus_one
    >>> elu_plus_one(np.array([-1.0, 0.0, 2.0]))
    array([0.36787944, 1.        , 3.        ])
    """
    xp = array_api_compat.array_namespace(x)
    # exp of the clipped value, not where(x > 0, x + 1, exp(x)): the discarded branch of a
    # where still overflows for large x and poisons gradients with inf * 0 = nan.
    return xp.exp(xp.clip(x, max=0.0)) + xp.clip(x, min=0.0)


def relu(x: Any, /) -> Any:
    """``max(x, 0) + RELU_EPS``: the positive part, lifted by a small epsilon.

    The epsilon (:data:`RELU_EPS`, ``1e-6``) keeps every feature strictly positive, so a query
    whose features would all be zero still gets a well-defined, non-zero normalizer.

    Parameters
    ----------
    x : array
        Queries or keys, any shape, real floating dtype.

    Returns
    -------
    array
        Same shape, dtype, library and device as ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.feature_maps import relu
    >>> relu(np.array([-1.0, 0.5]))
    array([1.000e-06, 5.000e-01])
    """
    xp = array_api_compat.array_namespace(x)
    return xp.clip(x, min=0.0) + RELU_EPS
