"""Feature maps phi for linear attention.

A feature map turns queries and keys into features so that ``phi(q) . phi(k)`` is a valid
(positive) attention weight. Any callable from array to array is accepted by the attention
functions; the ones here are written against the array API standard and work on every backend.

========================  ====================  ==============  ===============================
map                       output size           positivity      approximates
========================  ====================  ==============  ===============================
:func:`elu_plus_one`      ``d``                 features > 0    nothing in particular (default)
:func:`relu`              ``d``                 features > 0    nothing in particular
:func:`identity`          ``d``                 caller's job    whatever the caller mapped
:func:`favor_plus`        ``num_features``      features > 0    ``exp(q . k / sqrt(d))``
:func:`taylor_exp`        ``1 + d + d**2``      kernel >= 1/2   ``exp(q . k)`` to second order
:func:`dpfp`              ``2 * d * nu``        features >= 0   nothing in particular
========================  ====================  ==============  ===============================

The attention functions cast 16-bit inputs to float32 *before* calling the map, so inside
:func:`~polylin.causal_linear_attention` a map always computes in float32 or float64.
"""

from __future__ import annotations

import math
import operator
import random
from functools import lru_cache
from typing import Any

from ._policy import array_namespace, cacheable, device

__all__ = [
    "FAVOR_MAX_KEY_EXPONENT",
    "FAVOR_MAX_QUERY_EXPONENT",
    "RELU_EPS",
    "DPFPFeatureMap",
    "FavorPlusFeatureMap",
    "dpfp",
    "elu_plus_one",
    "favor_plus",
    "identity",
    "relu",
    "taylor_exp",
]

#: Added by :func:`relu` so that a row of features is never all zero.
RELU_EPS = 1e-6

#: Largest exponent a :func:`favor_plus` key feature may reach, whatever the key (while
#: ``max_i |w_i|**2 / 2 <= FAVOR_MAX_KEY_EXPONENT + FAVOR_MAX_QUERY_EXPONENT``, i.e. up to
#: ``dim`` of about 200): keeps ``exp`` and the sums over many keys finite in float32, whose
#: ``exp`` overflows above about 88.7.
FAVOR_MAX_KEY_EXPONENT = 64.0

#: Largest exponent a :func:`favor_plus` query feature may reach (the cap on ``key_offset``).
FAVOR_MAX_QUERY_EXPONENT = 80.0


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _zero(xp: Any, x: Any) -> Any:
    """A 0-d zero of ``x``'s dtype and device: the second argument of ``minimum``/``maximum``.

    An array, not the Python scalar ``0.0``: array-api-compat promotes a scalar through
    ``torch.result_type``, which ``torch.compile`` cannot trace (a graph break per call).
    """
    return xp.zeros((), dtype=x.dtype, device=device(x))


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
    xp = array_namespace(x)
    zero = _zero(xp, x)
    # exp of min(x, 0), not where(x > 0, x + 1, exp(x)): the discarded branch of a
    # where still overflows for large x and poisons gradients with inf * 0 = nan.
    return xp.exp(xp.minimum(x, zero)) + xp.maximum(x, zero)


def relu(x: Any, /) -> Any:
    """``max(x, 0) + RELU_EPS``: the positive part, lifted by a small epsilon.

    The epsilon (:data:`RELU_EPS`, ``1e-6``) keeps every feature strictly positive, so a query
    whose features would all be zero still gets a well-defined, non-zero normalizer. Output size
    equals input size; cost is one elementwise pass.

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
    >>> relu(np.array([-1.0, 0.5])).round(3)
    array([0. , 0.5])
    >>> relu(np.array([-1.0])) > 0  # never exactly zero
    array([ True])
    """
    xp = array_namespace(x)
    return xp.maximum(x, _zero(xp, x)) + RELU_EPS


def identity(x: Any, /) -> Any:
    """No map: the inputs already are features.

    Use it when queries and keys were mapped beforehand (by a learned map, say). Keeping them
    non-negative, so that every ``q_t . k_s`` is a valid weight and every normalizer is positive,
    is then the caller's responsibility: nothing is checked (that would need a data-dependent
    branch, which lazy backends cannot take). Output size equals input size; no cost.

    Parameters
    ----------
    x : array
        Already mapped queries or keys, any shape.

    Returns
    -------
    array
        ``x`` itself.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_linear_attention
    >>> from polylin.feature_maps import identity
    >>> q = k = np.ones((3, 2))
    >>> v = np.array([[3.0], [1.0], [2.0]])
    >>> causal_linear_attention(q, k, v, identity).round(5)  # equal weights: running means
    array([[3.],
           [2.],
           [2.]])
    """
    return x


def taylor_exp(x: Any, /) -> Any:
    """Second-order Taylor features of ``exp``: ``[1, x, vec(x x^T) / sqrt(2)]``.

    The kernel is exactly ``phi(x) . phi(y) = 1 + x.y + (x.y)**2 / 2``, the Taylor expansion of
    ``exp(x.y)`` to second order, as in the Based architecture (Arora et al. 2024). Individual
    features can be negative but every weight is positive: ``1 + t + t**2/2 = ((1 + t)**2 + 1)/2
    >= 1/2``. To approximate ``softmax(q k^T / sqrt(d))`` pass ``x * d**-0.25``.

    Output size is ``1 + d + d**2`` (fine for the small head sizes Based uses, d = 16: 273
    features; 4161 for d = 64); cost is one outer product per row.

    Parameters
    ----------
    x : array
        Queries or keys, shape ``(..., d)``, real floating dtype.

    Returns
    -------
    array
        Shape ``(..., 1 + d + d**2)``, same dtype, library and device as ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.feature_maps import taylor_exp
    >>> x, y = np.array([0.5, -1.0]), np.array([2.0, 0.25])
    >>> taylor_exp(x).shape
    (7,)
    >>> t = x @ y
    >>> bool(np.isclose(taylor_exp(x) @ taylor_exp(y), 1 + t + t**2 / 2))
    True
    """
    xp = array_namespace(x)
    d = x.shape[-1]
    lead = tuple(x.shape[:-1])
    outer = xp.reshape(x[..., :, None] * x[..., None, :], (*lead, d * d))
    ones = xp.ones((*lead, 1), dtype=x.dtype, device=device(x))
    return xp.concat([ones, x, outer * (1.0 / math.sqrt(2.0))], axis=-1)


class DPFPFeatureMap:
    """Deterministic parameter-free projection features; made by :func:`dpfp`.

    Calling the object maps ``x`` of shape ``(..., d)`` to ``(..., 2 * d * nu)`` non-negative
    features. Prefer the factory :func:`dpfp`, which documents the map.

    Parameters
    ----------
    nu : int
        Number of rolls, ``>= 1``.

    Attributes
    ----------
    nu : int
        Number of rolls; the output has ``2 * d * nu`` features.

    See Also
    --------
    dpfp : The factory, with the formula.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.feature_maps import DPFPFeatureMap
    >>> phi = DPFPFeatureMap(1)
    >>> phi(np.array([[1.0, -2.0]]))  # r = [1, 0, 0, 2]; r * roll(r, 1) = [2, 0, 0, 0]
    array([[2., 0., 0., 0.]])
    >>> phi.num_features(2)
    4
    """

    def __init__(self, nu: int) -> None:
        self.nu = _check_positive_int("nu", nu)

    def __repr__(self) -> str:
        return f"dpfp(nu={self.nu})"

    def num_features(self, dim: int) -> int:
        """The output size for inputs with ``dim`` features: ``2 * dim * nu``."""
        return 2 * dim * self.nu

    def __call__(self, x: Any, /) -> Any:
        """Map ``x`` of shape ``(..., d)`` to non-negative features ``(..., 2 * d * nu)``."""
        xp = array_namespace(x)
        zero = _zero(xp, x)
        r = xp.concat([xp.maximum(x, zero), xp.maximum(-x, zero)], axis=-1)
        return xp.concat([r * xp.roll(r, shift=j, axis=-1) for j in range(1, self.nu + 1)], axis=-1)


def dpfp(nu: int = 1) -> DPFPFeatureMap:
    """Deterministic parameter-free projection (DPFP, Schlag, Irie and Schmidhuber 2021).

    ``r = [relu(x), relu(-x)]`` (size ``2d``), then the products of ``r`` with its rolls by
    ``1 .. nu`` positions, concatenated: ``phi(x) = [r * roll(r, 1), ..., r * roll(r, nu)]``.
    Features are non-negative (not strictly: a row can be all zero, e.g. ``x = 0``, and then its
    output is zero, kept finite by ``eps``). Output size ``2 * d * nu``; cost ``nu``
    elementwise products, no parameters, no randomness.

    Parameters
    ----------
    nu : int
        Number of rolls, ``>= 1``; larger gives more (sparser) features.

    Returns
    -------
    DPFPFeatureMap
        A callable ``phi``, with a ``nu`` attribute.

    Raises
    ------
    TypeError
        ``nu`` is not an int.
    ValueError
        ``nu < 1``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.feature_maps import dpfp
    >>> phi = dpfp(nu=2)
    >>> phi
    dpfp(nu=2)
    >>> phi(np.array([1.0, -2.0]))  # r = [1, 0, 0, 2]
    array([2., 0., 0., 0., 0., 0., 0., 0.])
    """
    return DPFPFeatureMap(nu)


@lru_cache(maxsize=64)
def _favor_projection(
    dim: int, num_features: int, seed: int, orthogonal: bool
) -> tuple[tuple[float, ...], ...]:
    """The ``(num_features, dim)`` random projection as nested tuples of Python floats.

    Pure Python (``random.Random(seed)``) so that every backend gets bit-identical rows. Orthogonal
    blocks: a ``dim x dim`` Gaussian matrix orthonormalized by modified Gram-Schmidt (its rows are
    then Haar-distributed), each row rescaled by the norm of a fresh Gaussian ``dim``-vector so that
    row norms are chi-distributed as for i.i.d. Gaussian rows.
    """
    rng = random.Random(seed)

    def gaussian_row() -> list[float]:
        return [rng.gauss(0.0, 1.0) for _ in range(dim)]

    if not orthogonal:
        return tuple(tuple(gaussian_row()) for _ in range(num_features))
    rows: list[list[float]] = []
    while len(rows) < num_features:
        block: list[list[float]] = []
        for _ in range(dim):
            row = gaussian_row()
            for basis in block:
                dot = sum(map(operator.mul, row, basis))
                row = [a - dot * b for a, b in zip(row, basis)]
            norm = math.sqrt(sum(map(operator.mul, row, row)))
            block.append([a / norm for a in row])
        rows.extend(block[: num_features - len(rows)])
    norms = [math.sqrt(math.fsum(a * a for a in gaussian_row())) for _ in rows]
    return tuple(tuple(a * n for a in row) for row, n in zip(rows, norms))


class FavorPlusFeatureMap:
    """Performer's positive random features for the softmax kernel; made by :func:`favor_plus`.

    Keys are mapped by calling the object, queries by :meth:`map_query` (the attention functions
    do this automatically). Prefer the factory :func:`favor_plus`, which documents the map; the
    class is public for ``isinstance`` checks and type hints.

    Parameters
    ----------
    dim : int
        Size of the inputs' last axis, ``>= 1``.
    num_features : int
        Number of random features, ``>= 1``.
    seed : int
        Seed of the projection.
    orthogonal : bool
        Orthogonal blocks of rows, or i.i.d. Gaussian rows.

    Attributes
    ----------
    dim : int
        Size of the inputs' last axis.
    num_features : int
        Output size ``m``.
    seed : int
        Seed of the projection.
    orthogonal : bool
        Whether the projection rows come in orthogonal blocks.
    key_offset : float
        Data-independent constant subtracted from every key exponent (and added to every query
        exponent): ``max_i |w_i|**2 / 2 - FAVOR_MAX_KEY_EXPONENT``, clipped to
        ``[0, FAVOR_MAX_QUERY_EXPONENT]``; zero unless ``dim`` is large (above about 100).

    See Also
    --------
    favor_plus : The factory, with the formula and the numerical details.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.feature_maps import FavorPlusFeatureMap
    >>> phi = FavorPlusFeatureMap(4, 8, seed=0, orthogonal=True)
    >>> phi(np.zeros((3, 4))).shape  # keys
    (3, 8)
    >>> phi.map_query(np.zeros(4)).max() * np.sqrt(8)  # queries: row max shifted to exp(0)
    np.float64(1.0)
    """

    def __init__(self, dim: int, num_features: int, seed: int, orthogonal: bool) -> None:
        self.dim = _check_positive_int("dim", dim)
        self.num_features = _check_positive_int("num_features", num_features)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.seed = seed
        self.orthogonal = orthogonal
        rows = _favor_projection(dim, num_features, seed, orthogonal)
        self._matrix = [list(col) for col in zip(*rows)]  # (dim, num_features), for x @ W
        bound = max(math.fsum(a * a for a in row) for row in rows) / 2.0
        self.key_offset = min(max(0.0, bound - FAVOR_MAX_KEY_EXPONENT), FAVOR_MAX_QUERY_EXPONENT)
        self._cache: dict[tuple[str, str, str], Any] = {}

    def __repr__(self) -> str:
        return (
            f"favor_plus(dim={self.dim}, num_features={self.num_features}, seed={self.seed}, "
            f"orthogonal={self.orthogonal})"
        )

    def projection(self, x: Any, /) -> Any:
        """The ``(dim, num_features)`` projection in ``x``'s library, device and dtype (cached)."""
        xp = array_namespace(x)
        dev = device(x)
        key = (xp.__name__, str(dev), str(x.dtype))
        matrix = self._cache.get(key)
        if matrix is None:
            matrix = xp.asarray(self._matrix, dtype=x.dtype, device=dev)
            if cacheable(matrix):
                self._cache[key] = matrix
        return matrix

    def _exponent(self, x: Any) -> Any:
        """``w_i . x' - |x'|**2 / 2`` with ``x' = x * dim**-0.25``, shape ``(..., m)``."""
        if x.ndim < 1 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{self!r} maps inputs of shape (..., {self.dim}), got {tuple(x.shape)}"
            )
        xp = array_namespace(x)
        scaled = x * self.dim**-0.25
        half_norm = xp.sum(scaled * scaled, axis=-1, keepdims=True) * 0.5
        return xp.matmul(scaled, self.projection(x)) - half_norm

    def __call__(self, x: Any, /) -> Any:
        """Key features ``exp(w_i . x' - |x'|**2 / 2 - key_offset) / sqrt(m)``, shape ``(..., m)``.

        No data-dependent shift: a shift that depended on the key would not cancel, and one that
        depended on other keys would break causality, state passing and ``step``. The exponent is
        at most ``max_i |w_i|**2 / 2 - key_offset`` for any ``x``: ``FAVOR_MAX_KEY_EXPONENT``
        unless ``dim`` is above about 200.
        """
        xp = array_namespace(x)
        exponent = self._exponent(x)
        if self.key_offset:
            exponent = exponent - self.key_offset
        return xp.exp(exponent) * (1.0 / math.sqrt(self.num_features))

    def map_query(self, x: Any, /) -> Any:
        """Query features, shifted per row by their largest exponent (the shift cancels).

        ``exp(w_i . x' - |x'|**2 / 2 - max_j(...) + key_offset) / sqrt(m)``: a factor common to
        all features of one query divides out of ``phi(q) S / phi(q) . z`` (up to ``eps``), and
        ``+ key_offset`` undoes the keys' offset so the weights ``phi(q) . phi(k)`` do not depend
        on it. Every query feature is at most ``exp(key_offset) / sqrt(m)``.
        """
        xp = array_namespace(x)
        exponent = self._exponent(x)
        exponent = exponent - xp.max(exponent, axis=-1, keepdims=True)
        if self.key_offset:
            exponent = exponent + self.key_offset
        return xp.exp(exponent) * (1.0 / math.sqrt(self.num_features))


def favor_plus(
    dim: int, num_features: int = 256, *, seed: int = 0, orthogonal: bool = True
) -> FavorPlusFeatureMap:
    r"""FAVOR+ positive random features (Performer, Choromanski et al. 2021) for softmax.

    Returns a feature map ``phi`` with ``E[phi(q) . phi(k)] = exp(q . k / sqrt(dim))`` (up to a
    per-query factor that cancels), so linear attention with it approximates
    ``softmax(Q K^T / sqrt(d)) V``, better as ``num_features`` grows. With ``x' = x dim**-0.25``
    and projection rows ``w_i``::

        phi(x)_i = exp(w_i . x' - |x'|^2 / 2) / sqrt(m)

    Numerically stabilized: queries (:meth:`FavorPlusFeatureMap.map_query`) are shifted by their
    row maximum, which cancels exactly between numerator and normalizer; keys get no
    data-dependent shift (it would not cancel, and would break causality and state passing).
    A key exponent is at most ``max_i |w_i|^2 / 2`` (about ``dim / 2``) whatever the key; where
    that could overflow float32 (``dim`` above about 100) a data-independent constant
    ``key_offset`` is subtracted from every key exponent and added back to every query exponent,
    so the weights ``phi(q) . phi(k)`` are unchanged (a key-only offset would shrink them all
    and let ``eps`` dominate the normalizer). This bounds every feature for ``dim`` up to about
    200; beyond, keys nearly aligned with a projection row and of norm about ``dim**0.75`` can
    still overflow float32.

    The projection has ``num_features`` rows in orthogonal blocks of ``dim`` Gaussian rows with
    chi-distributed norms (or i.i.d. Gaussian rows with ``orthogonal=False``). It is drawn once,
    at construction, from Python's ``random.Random(seed)`` and orthonormalized by Gram-Schmidt
    in pure Python, not from a NumPy generator as Performer's code does: polylin's core imports
    no array library, and this way the same seed gives bit-identical rows on every backend. It
    is moved to the input's library, device and dtype on first use and cached there (not inside
    a JAX trace, nor under ``torch.inference_mode``).

    Output size ``num_features``; features strictly positive (they can underflow to zero for
    keys far from every ``w_i``); cost one ``(..., dim) x (dim, m)`` matmul and ``m``
    exponentials per row.

    Parameters
    ----------
    dim : int
        Size of the queries' and keys' last axis (the head size ``d``), ``>= 1``.
    num_features : int
        Number of random features ``m``, ``>= 1``.
    seed : int
        Seed of the projection; the same seed gives the same map on every backend.
    orthogonal : bool
        Orthogonal blocks (lower variance) or i.i.d. Gaussian rows.

    Returns
    -------
    FavorPlusFeatureMap
        A callable (keys) with a ``map_query`` method (queries) and attributes ``dim``,
        ``num_features``, ``seed``, ``orthogonal``.

    Raises
    ------
    TypeError
        ``dim``, ``num_features`` or ``seed`` is not an int, ``orthogonal`` not a bool.
    ValueError
        ``dim < 1`` or ``num_features < 1``; later, inputs whose last axis is not ``dim``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import linear_attention
    >>> from polylin.feature_maps import favor_plus
    >>> phi = favor_plus(16, num_features=512, seed=0)
    >>> phi
    favor_plus(dim=16, num_features=512, seed=0, orthogonal=True)
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 32, 16))
    >>> q, k = q / 2, k / 2  # the estimator's variance grows like exp(|q + k|^2 / sqrt(d))
    >>> scores = np.exp(q @ k.T / 4.0)
    >>> softmax = scores @ v / scores.sum(-1, keepdims=True)
    >>> approx = linear_attention(q, k, v, phi)
    >>> bool(np.linalg.norm(approx - softmax) < 0.2 * np.linalg.norm(softmax))
    True
    """
    return FavorPlusFeatureMap(dim, num_features, seed, orthogonal)
