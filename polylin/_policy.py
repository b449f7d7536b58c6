"""Backend policy: the one place that decides by array library or device.

Everything else in the core is written against the array API standard alone. The few decisions
that do depend on which library runs a computation (whether it executes eagerly on the CPU,
whether a constant it made may be cached) are taken here, so that a new backend is taught in one
module.

The core also asks this module, not ``array_api_compat`` directly, for an array's namespace and
device. For PyTorch tensors the answer is found without array-api-compat's
``functools.lru_cache``-wrapped helpers: ``torch.compile`` cannot trace through a cache, warns at
every call site and traces the wrapped function, which made a compiled call slow to build and
noisy. Every other library goes through ``array_api_compat`` unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Any

import array_api_compat

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_EPS",
    "add_matmul",
    "add_outer",
    "array_namespace",
    "cacheable",
    "compiled",
    "compiling",
    "cpu_threads",
    "cumulative_sum",
    "device",
    "eager_constants",
    "eager_cpu",
    "is_array",
    "is_tracer",
    "keep_lower",
    "materialized",
    "native_activation",
    "native_elu_plus_one",
    "nonpositive",
    "outside_graph",
    "resolve_torch_namespace",
    "rows_in_whole_chunks",
    "scan",
    "scans_tokens",
    "splits_chunks_on_concat",
    "stacked_qr",
    "unit_lower_solver",
    "unstack",
    "unsupported_array",
    "vector_times_matrix",
    "with_derivatives_of",
    "zero_of",
]

#: Default added to the normalizer of every normalized entry point.
DEFAULT_EPS = 1e-6

#: Default chunk length of the chunked forms.
DEFAULT_CHUNK_SIZE = 64


def _torch_namespace(x: Any) -> Any | None:
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


def _torch() -> Any:
    """The torch module where a tensor was seen (a module global under tracing, see below)."""
    return _TORCH if _TORCH is not None else sys.modules["torch"]


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
if "torch" in sys.modules:  # imported before polylin, the usual order
    resolve_torch_namespace()


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array of a library that polylin can run on."""
    # Plain Python values are answered here: torch.compile warns in array-api-compat's cached
    # check. Exact types: NumPy scalars subclass float and are arrays to array-api-compat.
    if x is None or type(x) in (bool, int, float, complex, str):
        return False
    return _torch_namespace(x) is not None or array_api_compat.is_array_api_obj(x)


def _is_numpy_array(x: Any) -> bool:
    """Whether ``x`` is exactly a ``numpy.ndarray`` (not a subclass, not a NumPy scalar)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(x) is numpy.ndarray


def zero_of(xp: Any, x: Any) -> Any:
    """A 0-d zero of ``x``'s dtype and device. NumPy: one read-only zero per dtype, made once
    (allocating it took longer than the ``minimum`` it serves in a decoding step's feature map).
    """
    if not _is_numpy_array(x):
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
    microseconds a call: a decoding step asks several times).
    """
    xp = _torch_namespace(x)
    if xp is not None:
        return xp
    global _NUMPY_NAMESPACE
    if _is_numpy_array(x):
        if _NUMPY_NAMESPACE is None:
            _NUMPY_NAMESPACE = array_api_compat.array_namespace(x)
        return _NUMPY_NAMESPACE
    return array_api_compat.array_namespace(x)


_NUMPY_NAMESPACE: Any = None  # array-api-compat's NumPy namespace, once an array was seen


def device(x: Any) -> Any:
    """The device of ``x`` (``array_api_compat.device``)."""
    if _torch_namespace(x) is not None:
        return x.device
    return "cpu" if _is_numpy_array(x) else array_api_compat.device(x)


def cumulative_sum(xp: Any, x: Any, /, *, axis: int, include_initial: bool = False) -> Any:
    """``xp.cumulative_sum(x, axis=axis, include_initial=include_initial)``, traceable.

    For PyTorch, ``torch.cumsum`` itself: array-api-compat's wrapper resolves a namespace through
    its cached helpers, which ``torch.compile`` warns about. Call this instead of
    ``xp.cumulative_sum`` everywhere in the core.
    """
    if _torch_namespace(x) is None:
        return xp.cumulative_sum(x, axis=axis, include_initial=include_initial)
    inclusive = _torch().cumsum(x, dim=axis)
    if not include_initial:
        return inclusive
    shape = list(x.shape)
    shape[axis] = 1
    initial = xp.zeros(tuple(shape), dtype=inclusive.dtype, device=x.device)
    return xp.concat([initial, inclusive], axis=axis)


def unstack(xp: Any, x: Any, /, *, axis: int) -> tuple[Any, ...]:
    """``xp.unstack(x, axis=axis)``, with a contiguous gradient on PyTorch.

    array-api-compat unstacks a tensor by iterating over ``moveaxis(x, axis, 0)``: autograd
    then stacks the pieces' gradients along axis 0 and moves the axis back, a gradient in a
    permuted layout that the backward of the reshape before the unstack copies whole (one
    copy of each input per training step). ``torch.unbind`` along ``axis`` stacks them in
    place. Call this instead of ``xp.unstack`` everywhere in the core.
    """
    if _torch_namespace(x) is None:
        return tuple(xp.unstack(x, axis=axis))
    return tuple(_torch().unbind(x, dim=axis))


def native_activation(name: str, x: Any) -> Any | None:
    """``sigmoid``, ``silu`` or ``softplus`` of ``x`` by PyTorch's own kernels for a tensor, or
    ``None`` elsewhere (the array-API forms of :mod:`polylin.activations` run there).

    The array-API forms select with ``where`` so that no exponential overflows and every
    gradient is finite; PyTorch's CPU ``where`` is slow (8.6 ms on 1.8 M float32 values, one
    thread, against 0.4-1.9 ms for ``exp``, ``clamp`` or ``sigmoid``), and the SiLU of a
    (1, 1024, 1792) activation took 40 ms against 0.47 ms for ``F.silu``. ``torch.sigmoid`` and
    ``F.silu`` are as exact and their gradients as finite. PyTorch's ``softplus`` returns ``x``
    above a threshold (20), which is not exact in float64, so softplus is written as
    ``maximum(x, 0) + log1p(exp(-|x|))``: no selection, and on PyTorch the gradient is
    ``sigmoid(x)`` everywhere, 1/2 at 0 (``maximum`` splits a tie, ``abs``' derivative is 0
    there).
    """
    if _torch_namespace(x) is None:
        return None
    torch = _torch()
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "softplus":
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return torch.maximum(x, zero) + torch.log1p(torch.exp(-torch.abs(x)))
    raise ValueError(f"no native activation {name!r}")


def native_elu_plus_one(x: Any) -> Any | None:
    """``elu(x) + 1`` by the library's own autograd registration, or ``None`` where it has none.

    PyTorch's autograd would keep the ``exp`` output of the array-API form for the backward (an
    array the size of ``x``); :mod:`polylin.torch._feature_maps` keeps only ``x``. Imported
    only for a tensor, that is once torch is. Not while ``torch.compile`` traces: its compiler
    chooses what to keep for the backward itself (and Dynamo cannot trace a custom forward-mode
    rule).
    """
    if _torch_namespace(x) is None or compiling(x):
        return None
    from .torch._feature_maps import elu_plus_one

    return elu_plus_one(x)


def _library(xp: Any) -> str:
    """The library behind a namespace: ``"torch"`` for torch and array-api-compat's wrapper.

    By name, not with array-api-compat's ``is_*_namespace`` helpers: those are
    ``lru_cache``-wrapped, which ``torch.compile`` warns about.
    """
    return getattr(xp, "__name__", "").removeprefix("array_api_compat.")


_JAX = ("jax.numpy", "jax.experimental.array_api")
_DASK = ("dask.array",)


def keep_lower(xp: Any, x: Any, mask: Any, *, strict: bool = False) -> Any:
    """``where(mask, x, 0)`` for the lower-triangular ``mask`` of ``causal_mask(..., strict)``:
    the entries on and below the diagonal (below it when ``strict``) of the last two axes,
    exact zeros elsewhere (whatever ``x`` holds there: ``inf``, ``nan``). PyTorch: ``tril``,
    the same selection, which measured twice as fast as a broadcast ``where`` on a chunk's
    scores. A broadcast view is made contiguous first: ``tril`` of one (a scalar gate's
    repeated log decays) measured 8x slower than the copy and ``tril`` together."""
    if _torch_namespace(x) is not None:
        return _torch().tril(x.contiguous(), diagonal=-1 if strict else 0)
    return xp.where(mask, x, 0.0)


def add_outer(xp: Any, S: Any, *pairs: tuple[Any, Any]) -> Any:
    """``S + sum_i x_i y_i^T`` over the last two axes for ``pairs`` of ``x_i`` ``(..., m)`` and
    ``y_i`` ``(..., n)``: a rank-1 (or rank-2) state update. PyTorch: one ``addcmul`` per pair,
    which never writes the outer product out and measured twice as fast on a decoding step's
    state (a temporary of the state's size less). NumPy, two pairs on a state of at least
    :data:`_RANK_TWO_MATMUL` elements: one matmul of the stacked factors, one state-sized
    temporary instead of two and one addition instead of two (0.4-0.7x the time of the two
    outer products from 32768 elements on; below 16384 stacking the factors costs more than it
    saves)."""
    if _torch_namespace(S) is not None:
        for x, y in pairs:
            S = _torch().addcmul(S, x[..., :, None], y[..., None, :])
        return S
    if len(pairs) == 2 and _is_numpy_array(S) and S.size >= _RANK_TWO_MATMUL:
        (x1, y1), (x2, y2) = pairs
        xs = xp.stack(xp.broadcast_arrays(x1, x2), axis=-1)  # (..., m, 2)
        ys = xp.stack(xp.broadcast_arrays(y1, y2), axis=-2)  # (..., 2, n)
        return S + xs @ ys
    for x, y in pairs:
        S = S + x[..., :, None] * y[..., None, :]
    return S


#: The state size (elements) from which :func:`add_outer` adds two outer products on NumPy as
#: one matmul (measured at d = 64 for batch x heads 1 to 64: equal at 16384, faster above).
_RANK_TWO_MATMUL = 2**15


def add_matmul(xp: Any, c: Any, a: Any, b: Any) -> Any:
    """``c + a @ b`` for ``a``, ``b``, ``c`` of the same leading dimensions (at least one).
    PyTorch: one ``baddbmm`` of the flattened batch, which writes the sum once instead of the
    product and then the sum (a block's read-out, ``(2, 4, 16, 64, 64)``, one thread: 0.7x the
    time of the matmul and the addition)."""
    if _torch_namespace(c) is not None:
        *lead, m, n = c.shape
        flat = [x.reshape(-1, *x.shape[-2:]) for x in (c, a, b)]
        return _torch().baddbmm(*flat).reshape(*lead, m, n)
    return c + a @ b


def unit_lower_solver(xp: Any, x: Any) -> Callable[[Any], Any] | None:
    """A function of ``A`` ``(..., C, C)`` that returns ``(I + strictly_lower(A))^{-1}``
    (``A``'s diagonal and upper triangle are never read) where the library of ``x`` has a
    batched triangular solve that differentiates: PyTorch's ``linalg.solve_triangular``, eager
    or compiled. ``None`` elsewhere: the array-API levels of
    :func:`polylin._intra_chunk.intra_chunk` invert it instead."""
    if _torch_namespace(x) is None:
        return None
    torch = _torch()

    def solve(A: Any) -> Any:
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape)
        return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)

    return solve


def vector_times_matrix(xp: Any, x: Any, S: Any) -> Any:
    """``(x[..., None, :] @ S)[..., 0, :]`` for ``x`` ``(..., m)`` and ``S`` ``(..., m, n)`` of
    the same leading dimensions. PyTorch: one ``bmm`` of the flattened batch, which measured
    2.3x faster than ``@`` on a decoding step's five-dimensional state (7 against 16 us)."""
    if _torch_namespace(S) is not None:
        torch = _torch()
        m, n = S.shape[-2:]
        product = torch.bmm(x.reshape(-1, 1, m), S.reshape(-1, m, n))
        return product.reshape(*S.shape[:-2], n)
    return (x[..., None, :] @ S)[..., 0, :]


def nonpositive(xp: Any, x: Any) -> Any:
    """``where(x > 0, 0, x)``: values above 0 taken as 0, NaN kept, the gradient 1 wherever
    ``x <= 0`` (``minimum`` would halve it at 0 on PyTorch and JAX). PyTorch: one ``clamp``,
    whose gradient is the same; NumPy (no gradients): one ``minimum``. One operation instead
    of two, in every decoding step."""
    if _torch_namespace(x) is not None:
        return _torch().clamp(x, max=0.0)
    if _is_numpy_array(x):
        return xp.minimum(x, 0.0)
    return xp.where(x > 0.0, 0.0, x)


def eager_cpu(xp: Any, dev: Any) -> bool:
    """Whether ``xp`` runs each operation at once on the CPU (where cache blocking pays).

    NumPy, array-api-strict and PyTorch on the CPU do (not under ``torch.compile``); lazy
    libraries (Dask, JAX under ``jit``) and accelerators (CuPy, PyTorch CUDA) prefer few large
    operations.
    """
    library = _library(xp)
    if library in ("numpy", "array_api_strict"):
        return True
    if library != "torch" or str(dev) != "cpu":
        return False
    # Under torch.compile the whole call becomes one graph that the compiler fuses and
    # schedules: blocks would only unroll into a graph that grows with T.
    return not _torch().compiler.is_compiling()


def cpu_threads(xp: Any) -> int:
    """The threads one operation of ``xp`` runs on, on the CPU: PyTorch's
    ``torch.get_num_threads()``; 1 for every other library (NumPy's elementwise operations run
    on one thread, its BLAS threads only the matrix products).

    The blocks of the delta rules' chunked forms on eager CPU backends grow with it: a block's
    operations are split between the threads, and blocks sized for one thread's cache left two
    threads waiting on each other at every one of their small operations
    (``docs/performance.md``, "Blocks and threads")."""
    if _library(xp) != "torch":
        return 1
    return max(1, int(_torch().get_num_threads()))


def scans_tokens(xp: Any, x: Any) -> bool:
    """Whether the chunked linear attention runs its forward as a scan over the tokens.

    JAX tracing for the CPU (under ``jax.jit``): XLA compiles a scan's small state update into
    one tight loop, which measured 1.4-4.2x faster than the chunked form's forward at T = 4096
    (``docs/performance.md``, "Decay on JAX"), while the chunked form's derivatives stay 3-10x
    faster than the scan's. The two are combined by :func:`with_derivatives_of`. Eager JAX keeps
    the chunked form (a scan would be traced anew at every call); so do accelerators.
    """
    if _library(xp) not in _JAX or "jax" not in sys.modules or not is_tracer(x):
        return False
    return str(sys.modules["jax"].default_backend()) == "cpu"


def scan(step: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any) -> tuple[Any, Any]:
    """``jax.lax.scan(step, carry, xs)``: ``step`` once per leading index of ``xs``. Only where
    :func:`scans_tokens` is true (JAX is then imported)."""
    return sys.modules["jax"].lax.scan(step, carry, xs)


def with_derivatives_of(
    forward: Callable[..., Any], reference: Callable[..., Any]
) -> Callable[..., Any]:
    """``forward``'s values with ``reference``'s derivatives (the same function, computed two
    ways): a ``jax.custom_jvp`` whose tangents are ``reference``'s, so that forward and reverse
    differentiation (``jax.grad``, ``jax.jvp``) run ``reference``. Only where
    :func:`scans_tokens` is true."""
    jax = sys.modules["jax"]
    combined = jax.custom_jvp(forward)

    @combined.defjvp
    def _tangents(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        return forward(*primals), jax.jvp(reference, primals, tangents)[1]

    return combined


def compiling(x: Any) -> bool:
    """Whether ``x`` is a tensor that ``torch.compile`` is tracing into a graph.

    Such code runs once, to build the graph: no locks (Dynamo cannot trace them) and no caching
    of what it makes (the tensors are placeholders of the graph being built).
    """
    torch = _TORCH if _TORCH is not None else sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and torch.compiler.is_compiling()


def outside_graph(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run eagerly when called from code that ``torch.compile`` traces.

    Only call it where :func:`compiling` is true (torch is then imported).
    """
    return _torch().compiler.disable(function)


def cacheable(x: Any) -> bool:
    """Whether a freshly made constant array may be reused by later calls.

    Not a JAX tracer (a constant made inside ``jit`` must not outlive its trace), not a tensor
    made while ``torch.compile`` traces (a placeholder of the graph being built), and not a
    PyTorch inference tensor (made under ``torch.inference_mode``, it could not be saved for
    backward by a later training step).
    """
    if _torch_namespace(x) is not None:
        return not (compiling(x) or x.is_inference())
    return not is_tracer(x)


def stacked_qr(xp: Any) -> bool:
    """Whether ``xp.linalg.qr`` (where ``xp`` has it) factors a stack ``(..., M, N)`` at once.

    Dask's ``qr`` takes one two-dimensional matrix, in a single column of chunks.
    """
    return _library(xp) not in _DASK


def eager_constants(xp: Any) -> AbstractContextManager[Any]:
    """A context in which arrays computed from Python data alone are concrete and cacheable.

    A projection built from a seed depends on no input, so it should be computed once, at
    once, and kept: under JAX, outside any trace (``jax.ensure_compile_time_eval``: inside
    ``jit`` it would otherwise be recomputed by every call of the compiled function and could
    not be cached); under PyTorch, outside ``inference_mode`` (an inference tensor could not be
    saved for backward by a later training step). The library is already imported whenever its
    namespace is in use, so it is taken from ``sys.modules``, not imported here.
    """
    library = _library(xp)
    if library in _JAX and "jax" in sys.modules:
        return sys.modules["jax"].ensure_compile_time_eval()
    if library == "torch" and _TORCH is not None:
        torch = _torch()
        # While torch.compile traces, a constant is part of the graph being built (and
        # Dynamo cannot enter inference_mode): there is nothing to keep eagerly.
        return nullcontext() if torch.compiler.is_compiling() else torch.inference_mode(False)
    return nullcontext()


def materialized(x: Any) -> Any:
    """``x`` computed now where the library is lazy (Dask persists it), else ``x`` itself.

    For a constant that is kept and reused: a lazy array would repeat its whole computation
    in every result that uses it.
    """
    if _torch_namespace(x) is not None:
        return x
    return x.persist() if array_api_compat.is_dask_array(x) else x


def splits_chunks_on_concat(x: Any) -> bool:
    """Whether ``x`` is a Dask array: a concatenation gives it one chunk per piece.

    An array assembled from pieces level by level (the per-channel scores of a chunk) would
    then end with one chunk, and tasks, per smallest piece; such code places its pieces by
    selection instead. Elsewhere concatenation is the cheaper way (its backward is a slice).
    """
    return _torch_namespace(x) is None and array_api_compat.is_dask_array(x)


def rows_in_whole_chunks(x: Any, rows: int) -> Any:
    """``x`` with its Dask chunks along axis -2 whole multiples of ``rows``; else ``x`` itself.

    The chunked forms reshape the sequence axis into ``(chunks, rows)``. A Dask chunk boundary
    inside a chunk of ``rows`` (the zero padding of a short last chunk is concatenated, and
    makes one) would be carried into every reshape after it, splitting each level of the
    per-channel scores into ever smaller pieces: thousands of tasks for a few rows.
    """
    if _torch_namespace(x) is not None or not array_api_compat.is_dask_array(x):
        return x
    axis = x.ndim - 2
    sizes = x.chunks[axis]
    if all(size % rows == 0 for size in sizes):
        return x
    return x.rechunk({axis: rows * max(1, -(-max(sizes) // rows))})


def compiled(
    xp: Any, function: Callable[..., Any], /, *, static_argnames: tuple[str, ...]
) -> Callable[..., Any]:
    """``function`` compiled as one program where ``xp``'s library compiles, else itself.

    JAX compiles every operation it runs eagerly for each new shape: a build of a few dozen
    operations costs seconds, one ``jax.jit`` program a fraction of that (and is reused for
    every call with the same shapes and static arguments). The compiled function is kept, so
    calls with new seeds reuse the program.
    """
    if _library(xp) in _JAX and "jax" in sys.modules:
        return _jitted(function, static_argnames)
    return function


@cache
def _jitted(function: Callable[..., Any], static_argnames: Hashable) -> Callable[..., Any]:
    return sys.modules["jax"].jit(function, static_argnames=static_argnames)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a JAX tracer: a value only known when the traced function runs.

    Detected by class name so that the core never imports JAX. Python numbers and torch tensors
    are answered first: ``torch.compile`` cannot walk the class hierarchy of a builtin type.
    """
    if x is None or isinstance(x, (bool, int, float, complex, str)):
        return False
    if _torch_namespace(x) is not None:
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
