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

import array
import math
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ._backend.execution import (
    blas_threaded_qr,
    cacheable,
    check_static,
    compiled,
    compiling,
    eager_constants,
    materialized,
    outside_graph,
    stacked_qr,
)
from ._backend.namespace import array_namespace, device, zero_of
from ._backend.ops import native_elu_plus_one
from ._typing import Array

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
    "resolve_feature_map",
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


def _zero(xp: Any, x: Array) -> Array:
    """A 0-d zero of ``x``'s dtype and device: the second argument of ``minimum``/``maximum``.

    An array, not the Python scalar ``0.0``: array-api-compat promotes a scalar through
    ``torch.result_type``, which ``torch.compile`` cannot trace (a graph break per call).
    """
    return zero_of(xp, x)


def elu_plus_one(x: Array, /) -> Array:
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
    native = native_elu_plus_one(x)  # PyTorch: a backward that keeps only x
    if native is not None:
        return native
    xp = array_namespace(x)
    # exp(min(x, 0)) + max(x, 0): exp only ever sees values <= 0 (no overflow; not
    # where(x > 0, x + 1, exp(x)), whose discarded exp(x) overflows and poisons gradients with
    # inf * 0 = nan), and the limits at -inf and +inf are exactly 0 and inf (a sum of the halves
    # x / 2 -+ |x| / 2 was inf - inf = nan there). At x = 0 JAX and PyTorch give each of
    # minimum and maximum half the gradient: the derivative is 1, as on either side. The zero
    # is a 0-d array (see _zero). A PyTorch tensor was answered above by its autograd function.
    zero = _zero(xp, x)
    return xp.exp(xp.minimum(x, zero)) + xp.maximum(x, zero)


def relu(x: Array, /) -> Array:
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


def identity(x: Array, /) -> Array:
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


def taylor_exp(x: Array, /) -> Array:
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

    def __call__(self, x: Array, /) -> Array:
        """Map ``x`` of shape ``(..., d)`` to non-negative features ``(..., 2 * d * nu)``."""
        xp = array_namespace(x)
        zero = _zero(xp, x)
        r = xp.concat([xp.maximum(x, zero), xp.maximum(-x, zero)], axis=-1)
        # A product with a zero factor is 0 even where the other is inf (x = +-inf): selected,
        # since inf * 0 is nan.
        nonzero = r > 0
        products = []
        for j in range(1, self.nu + 1):
            both = nonzero & xp.roll(nonzero, shift=j, axis=-1)
            products.append(xp.where(both, r * xp.roll(r, shift=j, axis=-1), zero))
        return xp.concat(products, axis=-1)


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


#: Largest total size of the FAVOR+ projections kept by :func:`favor_plus` maps, in bytes (a
#: ``(128, 4096)`` float64 projection takes 4 MiB); the least recently used go first.
_PROJECTION_CACHE_BYTES = 64 * 2**20

# (dim, num_features, seed, orthogonal, namespace, device, dtype) -> (dim, num_features) array,
# shared by every map with the same parameters; least recently used first.
_projection_cache: OrderedDict[tuple[Any, ...], tuple[Any, int]] = OrderedDict()
_projection_cache_lock = threading.Lock()


def _chi_norms(rng: random.Random, dim: int, count: int) -> list[float]:
    """``count`` draws of the norm of a Gaussian ``dim``-vector: ``sqrt(chi2(dim))``."""
    return [math.sqrt(2.0 * rng.gammavariate(dim / 2.0, 1.0)) for _ in range(count)]


def _favor_row_norms(dim: int, num_features: int, seed: int) -> list[float]:
    """The projection's row norms, the first draws of ``random.Random(seed)``."""
    return _chi_norms(random.Random(seed), dim, num_features)


def _build_dtype(xp: Any, dev: Any) -> Any:
    """float64 where ``xp`` has it on ``dev``, else float32 (JAX without x64)."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is None:
        return xp.float64
    floats = info().dtypes(device=dev, kind="real floating")
    return xp.float64 if "float64" in floats else xp.float32


def _from_floats(xp: Any, values: list[float], dtype: Any, dev: Any) -> Any:
    """A 1-D array of Python floats through the buffer protocol, much faster than a list.

    The buffer's item type matches ``dtype`` (PyTorch reads a buffer as raw bytes of ``dtype``).
    """
    buffer = array.array("d" if dtype == xp.float64 else "f", values)
    return xp.asarray(memoryview(buffer), dtype=dtype, device=dev)


def _orthonormal_columns(xp: Any, gaussian: Any) -> Any:
    """``Q`` of ``gaussian = Q R`` with ``diag(R) > 0``, for a stack ``(blocks, n, n)``.

    With that sign convention (Mezzadri 2007) ``Q`` is Haar-distributed when ``gaussian`` has
    i.i.d. Gaussian entries; a plain Householder ``Q`` is not (its signs follow ``R``'s).
    The library's own ``linalg.qr`` where it has one, except NumPy's (see
    :func:`_gram_schmidt`).
    """
    if not hasattr(xp, "linalg") or blas_threaded_qr(xp):
        return _gram_schmidt(xp, gaussian)
    if stacked_qr(xp):
        q, r = xp.linalg.qr(gaussian)
    else:  # one matrix at a time (Dask)
        factors = [xp.linalg.qr(gaussian[i, ...]) for i in range(gaussian.shape[0])]
        q = xp.stack([factor[0] for factor in factors])
        r = xp.stack([factor[1] for factor in factors])
    diagonal = xp.linalg.diagonal(r)
    return xp.where(diagonal[..., None, :] < 0.0, -q, q)


def _gram_schmidt(xp: Any, gaussian: Any) -> Any:
    """The positive-diagonal ``Q`` of a stack ``(blocks, n, n)``, from elementwise operations.

    Classical Gram-Schmidt with each column projected twice ("twice is enough", Giraud et al.
    2005): the same factor as a Householder QR to round-off (within 1e-14 of NumPy's for
    ``(32, 128, 128)`` Gaussian blocks), orthonormal to round-off. Products and sums only, no
    matrix product: NumPy runs those on one thread, where its ``linalg.qr`` (and any matrix
    product of this size) waits for BLAS threads, seconds per block on busy cores (see
    ``polylin._backend.execution.blas_threaded_qr``). Also the path of namespaces without ``linalg``
    (an optional extension of the standard). Columns are handled as rows (contiguous sums).
    """
    rows = xp.permute_dims(gaussian, (0, 2, 1))  # (blocks, n, n): row j is column j
    done: list[Any] = []
    basis = None  # (blocks, j, n): the first j orthonormal rows
    for j in range(rows.shape[-2]):
        row = rows[:, j : j + 1, :]  # (blocks, 1, n)
        if basis is not None:
            for _ in range(2):
                coefficients = xp.sum(basis * row, axis=-1, keepdims=True)  # (blocks, j, 1)
                row = row - xp.sum(basis * coefficients, axis=-2, keepdims=True)
        row = row / xp.sqrt(xp.sum(row * row, axis=-1, keepdims=True))
        done.append(row)
        basis = xp.concat(done, axis=-2)
    return xp.permute_dims(basis, (0, 2, 1))


def _favor_projection(
    xp: Any, dev: Any, dtype: Any, dim: int, num_features: int, seed: int, orthogonal: bool
) -> Any:
    """The ``(dim, num_features)`` FAVOR+ projection, built in ``xp`` on ``dev`` in ``dtype``.

    One stream, ``random.Random(seed)``, read in pure Python so that every backend starts from
    the same numbers: the ``num_features`` row norms (chi-distributed, for
    :attr:`FavorPlusFeatureMap.key_offset`), then the uniforms of a Box-Muller transform (radii
    first, then angles) that gives the Gaussian blocks. Orthogonal: ``ceil(m / dim)`` blocks of
    ``dim x dim`` Gaussians, each orthonormalized by a sign-fixed QR (Haar-distributed
    directions); i.i.d.: ``m`` Gaussian ``dim``-vectors normalized to unit length. Either way
    each direction is scaled by its own norm, so the rows have the marginal law of Gaussian rows.
    """
    rng = random.Random(seed)
    norms = _chi_norms(rng, dim, num_features)
    blocks = -(-num_features // dim) if orthogonal else 1
    pairs = (blocks * dim * (dim if orthogonal else num_features) + 1) // 2
    draw = rng.random
    radii = [1.0 - draw() for _ in range(pairs)]  # in (0, 1]: the logarithm below is finite
    angles = [draw() for _ in range(pairs)]
    build = _build_dtype(xp, dev)
    assemble = compiled(xp, _assemble_projection, static_argnames=("xp", "dim", "orthogonal"))
    matrix = assemble(
        *(_from_floats(xp, values, build, dev) for values in (radii, angles, norms)),
        xp=xp,
        dim=dim,
        orthogonal=orthogonal,
    )
    return matrix if dtype == build else xp.astype(matrix, dtype)


def _assemble_projection(
    radii: Any, angles: Any, norms: Any, /, *, xp: Any, dim: int, orthogonal: bool
) -> Any:
    """The projection from its uniforms and norms: Box-Muller, then orthonormal blocks."""
    num_features = norms.shape[0]
    blocks = -(-num_features // dim) if orthogonal else 1
    width = dim if orthogonal else num_features
    radius = xp.sqrt(-2.0 * xp.log(radii))
    angle = angles * (2.0 * math.pi)
    gaussian = xp.concat([radius * xp.cos(angle), radius * xp.sin(angle)])
    gaussian = xp.reshape(gaussian[: blocks * dim * width], (blocks, dim, width))
    if orthogonal:
        directions = _orthonormal_columns(xp, gaussian)  # (blocks, dim, dim)
        directions = xp.reshape(xp.permute_dims(directions, (1, 0, 2)), (dim, blocks * dim))
        directions = directions[:, :num_features]
    else:
        directions = gaussian[0, ...]
        directions = directions / xp.sqrt(xp.sum(directions * directions, axis=0, keepdims=True))
    return directions * norms


def _cached_favor_projection(
    x: Any, dim: int, num_features: int, seed: int, orthogonal: bool
) -> Any:
    """:func:`_favor_projection` in ``x``'s library, device and dtype, from a bounded LRU cache."""
    xp = array_namespace(x)
    dev = device(x)
    key = (dim, num_features, seed, orthogonal, xp.__name__, str(dev), str(x.dtype))
    if compiling(x):  # torch.compile traces no lock and no Python RNG: read the cache only
        entry = _projection_cache.get(key)
        if entry is not None:
            return entry[0]
        # First use: built eagerly, outside the graph (one graph break, on this call only).
        build = outside_graph(_cached_favor_projection)
        return build(x, dim, num_features, seed, orthogonal)
    with _projection_cache_lock:
        entry = _projection_cache.get(key)
        if entry is not None:
            _projection_cache.move_to_end(key)
            return entry[0]
    with eager_constants(xp):
        matrix = _favor_projection(xp, dev, x.dtype, dim, num_features, seed, orthogonal)
    matrix = materialized(matrix)
    size = dim * num_features * (xp.finfo(x.dtype).bits // 8)
    if cacheable(matrix) and size <= _PROJECTION_CACHE_BYTES:
        with _projection_cache_lock:
            _projection_cache[key] = (matrix, size)
            total = sum(entry_size for _, entry_size in _projection_cache.values())
            while total > _PROJECTION_CACHE_BYTES:
                _, (_, dropped) = _projection_cache.popitem(last=False)
                total -= dropped
    return matrix


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
        check_static("orthogonal", orthogonal)
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.seed = seed
        self.orthogonal = orthogonal
        # The rows' norms are drawn in Python (the projection itself only on first use, in the
        # input's library), so the offset is a plain float, the same on every backend.
        bound = max(_favor_row_norms(dim, num_features, seed)) ** 2 / 2.0
        self.key_offset = min(max(0.0, bound - FAVOR_MAX_KEY_EXPONENT), FAVOR_MAX_QUERY_EXPONENT)

    def __repr__(self) -> str:
        return (
            f"favor_plus(dim={self.dim}, num_features={self.num_features}, seed={self.seed}, "
            f"orthogonal={self.orthogonal})"
        )

    def projection(self, x: Array, /) -> Array:
        """The ``(dim, num_features)`` projection in ``x``'s library, device and dtype.

        Built on first use with array operations of that library (in float64 where it has it,
        then cast) and kept in a module-level cache shared by every map with the same
        parameters, bounded in bytes (least recently used entries go first).
        """
        return _cached_favor_projection(x, self.dim, self.num_features, self.seed, self.orthogonal)

    def _exponent(self, x: Any) -> Any:
        """``w_i . x' - |x'|**2 / 2`` with ``x' = x * dim**-0.25``, shape ``(..., m)``."""
        if x.ndim < 1 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{self!r} maps inputs of shape (..., {self.dim}), got {tuple(x.shape)}"
            )
        xp = array_namespace(x)
        if not xp.isdtype(x.dtype, "real floating"):
            raise TypeError(f"{self!r} maps real floating inputs, got x of dtype {x.dtype}")
        scaled = x * self.dim**-0.25
        half_norm = xp.sum(scaled * scaled, axis=-1, keepdims=True) * 0.5
        return xp.matmul(scaled, self.projection(x)) - half_norm

    def __call__(self, x: Array, /) -> Array:
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

    def map_query(self, x: Array, /) -> Array:
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

    The projection has ``num_features`` rows in orthogonal blocks of ``dim`` rows (or i.i.d.
    Gaussian rows with ``orthogonal=False``), each scaled by its own chi-distributed norm, so
    every row has the law of a Gaussian row. Only the norms are drawn at construction; the
    matrix is built on first use, with array operations of the input's library: Python's
    ``random.Random(seed)`` gives the norms and the uniforms of a Box-Muller transform, and
    the Gaussian blocks are orthonormalized by that library's QR with the sign fix that makes
    them Haar-distributed (by Gram-Schmidt where it has no ``linalg``, and on NumPy, whose
    QR waits for BLAS threads on busy cores), in float64 where the library has it. Not a
    NumPy generator as in Performer's code: polylin's core imports no array library, and this
    way the same seed gives the same rows, to round-off, on every backend. The matrix is
    cached per (parameters, library, device, dtype) in one bounded cache shared by all maps;
    inside ``jax.jit`` or ``torch.inference_mode`` it is still built eagerly, once, and cached.

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


def resolve_feature_map(
    feature_map: Callable[[Any], Any] | None, /, *, dim: int | str = "d_k"
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """The maps of the queries and of the keys that a ``feature_map`` argument stands for.

    Every entry point resolves its ``feature_map`` argument with this function; a layer that
    takes a feature map checks it with it when it is built.

    Parameters
    ----------
    feature_map : callable or None
        A feature map (array to array), or ``None`` for :func:`elu_plus_one`.
    dim : int or str, default "d_k"
        The key size, shown in the error for a factory passed uncalled.

    Returns
    -------
    tuple of callable
        ``(map_query, map_key)``: a map may treat queries differently from keys (FAVOR+ shifts
        each query row by its max, which cancels between numerator and normalizer; a per-key
        shift would not), through its ``map_query`` attribute.

    Raises
    ------
    TypeError
        If ``feature_map`` is not callable, or is a factory of this module passed itself
        (``favor_plus`` for ``favor_plus(d_k)``): the message says how to call it.

    Examples
    --------
    >>> from polylin.feature_maps import elu_plus_one, favor_plus, resolve_feature_map
    >>> resolve_feature_map(None) == (elu_plus_one, elu_plus_one)
    True
    >>> favor = favor_plus(8, seed=0)
    >>> map_query, map_key = resolve_feature_map(favor)
    >>> map_key is favor and map_query == favor.map_query
    True
    """
    if feature_map is None:
        return elu_plus_one, elu_plus_one
    if not callable(feature_map):
        raise TypeError(
            f"feature_map must be a callable from array to array, got {type(feature_map).__name__}"
        )
    if feature_map is favor_plus or feature_map is dpfp:
        call = f"favor_plus({dim})" if feature_map is favor_plus else "dpfp()"
        raise TypeError(
            f"feature_map={feature_map.__name__} is the factory that builds a feature map, not "
            f"a feature map: call it, e.g. feature_map={call}"
        )
    return getattr(feature_map, "map_query", feature_map), feature_map
