"""How a library executes: eager or lazy, traced or compiled, threads, cached constants.

The decisions that depend on how a computation runs (whether it executes eagerly on the CPU,
whether JAX traces it, whether ``torch.compile`` builds a graph from it, whether a constant it
made may be cached) are taken here, so that a new backend is taught in one place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Any

import array_api_compat

from .namespace import (
    DASK_NAMESPACES,
    JAX_NAMESPACES,
    device,
    is_tracer,
    library_name,
    loaded_torch,
    torch_module,
    torch_namespace_of,
)

__all__ = [
    "adds_in_place",
    "blas_threaded_qr",
    "branch",
    "branches_in_program",
    "cacheable",
    "chains_decay",
    "check_static",
    "compiled",
    "compiling",
    "compiling_any",
    "cpu_threads",
    "eager_accelerator",
    "eager_constants",
    "eager_cpu",
    "materialized",
    "outside_graph",
    "reads_values",
    "records_gradient",
    "rows_in_whole_chunks",
    "scan",
    "scans_chunks",
    "scans_tokens",
    "splits_chunks_on_concat",
    "stacked_qr",
    "torch_transforming",
    "with_derivatives_of",
]


def eager_cpu(xp: Any, dev: Any) -> bool:
    """Whether ``xp`` runs each operation at once on the CPU (where cache blocking pays).

    NumPy, array-api-strict and PyTorch on the CPU do (not under ``torch.compile``); lazy
    libraries (Dask, JAX under ``jit``) and accelerators (CuPy, PyTorch CUDA) prefer few large
    operations.
    """
    library = library_name(xp)
    if library in ("numpy", "array_api_strict"):
        return True
    if library != "torch" or str(dev) != "cpu":
        return False
    # Under torch.compile the whole call becomes one graph that the compiler fuses and
    # schedules: blocks would only unroll into a graph that grows with T.
    return not torch_module().compiler.is_compiling()


def reads_values(xp: Any, x: Any) -> bool:
    """Whether a computation on ``x`` may branch on its values (read one Python number).

    Eager CPU backends (:func:`eager_cpu`), where the read costs a reduction and nothing more.
    Not where ``x`` has no values yet (JAX tracing, ``torch.compile``), where a read would
    compute a lazy graph twice (Dask), on accelerators, where it would make the host wait for
    the device (unmeasured there), nor inside a ``torch.func`` transform (``vmap`` refuses
    data-dependent control flow).
    """
    return eager_cpu(xp, device(x)) and not torch_transforming(x)


def adds_in_place(*arrays: Any) -> bool:
    """Whether :func:`~polylin._backend.ops.add_matmul` with ``fresh=True`` writes into its
    fresh array and nothing records the call for a gradient: PyTorch tensors outside
    ``torch.func`` transforms, with gradient mode off or none of ``arrays`` requiring one.
    (Accumulating into a scaled fresh array that way measured faster forward but slower to
    differentiate: :mod:`polylin._forms.linear.grouped`.)"""
    return torch_namespace_of(arrays[0]) is not None and not records_gradient(*arrays)


def records_gradient(*arrays: Any) -> bool:
    """Whether a computation on ``arrays`` (``None`` entries skipped) may be recorded for a
    gradient: PyTorch tensors with gradient mode on and one of them requiring a gradient, or
    inside a ``torch.func`` transform (which may differentiate). Never for other libraries:
    NumPy and array-api-strict have no gradients, JAX's are taken from a traced program."""
    given = [x for x in arrays if x is not None]
    if torch_namespace_of(given[0]) is None:
        return False
    if torch_transforming(given[0]):
        return True
    return torch_module().is_grad_enabled() and any(x.requires_grad for x in given)


def torch_transforming(x: Any) -> bool:
    """Whether ``x`` is a tensor seen inside a ``torch.func`` transform (``vmap``, ``grad``,
    ``jvp``): there a read of its values is refused (``vmap``) and an in-place operation has
    no batching rule (a slow fallback and a warning). False while ``torch.compile`` traces."""
    if torch_namespace_of(x) is None or compiling(x):
        return False
    functorch = getattr(torch_module()._C, "_functorch", None)
    level = getattr(functorch, "maybe_current_level", None)
    return level is not None and level() is not None


def chains_decay(x: Any) -> bool:
    """Whether a decayed prefix over the chunk axis (``S_{n+1} = decay_n * S_n + U_n``) is a
    chain, one fused multiply-add per chunk, where it would otherwise be a scan of logarithmic
    depth: ``torch.compile`` tracing for the CPU (eager CPU backends chain their blocks' few
    chunks anyway).

    Inductor fuses the scan's levels, each of which reads the last one twice, into loops that
    compute the earlier levels again for every reader: the compiled scan took 2.2-3.8x the eager
    call's time on Mamba-2's shapes at T = 512 and 2048, the compiled chain 1.2-1.6x
    (``docs/performance.md``, "Against llama.cpp's ggml kernels"). The chain unrolls into the
    graph, one link per chunk: at T = 8192 (128 chunks) it compiled in 2.1-2.4x the scan's time
    and ran in 0.4x its time. Under ``jax.jit`` on the CPU the chain is one ``lax.scan``
    (:func:`scans_chunks`); other lazy libraries and accelerators keep the log-depth scan.
    """
    return compiling(x) and str(device(x)) == "cpu"


def eager_accelerator(xp: Any, dev: Any) -> bool:
    """Whether ``xp`` runs each operation at once on an accelerator: CuPy, PyTorch on a device
    other than the CPU (not under ``torch.compile``).

    There every operation is a kernel launch that the host pays for (on an H200, eager
    PyTorch's host side is most of a chunked delta rule's time at T = 8192: ``docs/gpu.md``),
    and a batched matmul copies each strided operand at every call. The chunked forms make their
    inputs dense once and the delta rules take longer chunks (fewer sequential steps) there.
    """
    library = library_name(xp)
    if library == "cupy":
        return True
    if library != "torch" or str(dev) == "cpu":
        return False
    return not torch_module().compiler.is_compiling()


def cpu_threads(xp: Any) -> int:
    """The threads one operation of ``xp`` runs on, on the CPU: PyTorch's
    ``torch.get_num_threads()``; 1 for every other library (NumPy's elementwise operations run
    on one thread, its BLAS threads only the matrix products).

    The blocks of the delta rules' chunked forms on eager CPU backends grow with it: a block's
    operations are split between the threads, and blocks sized for one thread's cache left two
    threads waiting on each other at every one of their small operations
    (``docs/performance.md``, "Blocks and threads")."""
    if library_name(xp) != "torch":
        return 1
    return max(1, int(torch_module().get_num_threads()))


def scans_tokens(xp: Any, x: Any) -> bool:
    """Whether the chunked linear attention runs its forward as a scan over the tokens.

    JAX tracing for the CPU (under ``jax.jit``): XLA compiles a scan's small state update into
    one tight loop, which measured 1.4-4.2x faster than the chunked form's forward at T = 4096
    (``docs/performance.md``, "Decay on JAX"), while the chunked form's derivatives stay 3-10x
    faster than the scan's. The two are combined by :func:`with_derivatives_of`. Eager JAX keeps
    the chunked form (a scan would be traced anew at every call); so do accelerators.
    """
    if library_name(xp) not in JAX_NAMESPACES or sys.modules.get("jax") is None or not is_tracer(x):
        return False
    return str(sys.modules["jax"].default_backend()) == "cpu"


def scans_chunks(xp: Any, x: Any) -> bool:
    """Whether the sequential loop over chunks of the delta rules' chunked forms runs as one
    scan instead of a Python loop.

    JAX tracing for the CPU (under ``jax.jit``): a Python loop would unroll into a graph that
    grows with T, and XLA's compile time and run time grew faster than T with it (the gated
    delta rule at 16 heads x 64, T = 4096: 29 s to compile and 4.4x ggml's time unrolled;
    ``docs/performance.md``, "Against llama.cpp's ggml kernels"). A scan is compiled once
    whatever T; a scan over blocks of chunks, each with its scan over chunks, keeps a block's
    intermediates in cache as on eager CPUs (0.58-1.00x the time of one block). Eager JAX
    keeps the Python loop (a scan would be traced anew at every call); so do accelerators,
    unmeasured.
    """
    return scans_tokens(xp, x)


def branches_in_program(xp: Any, x: Any) -> bool:
    """Whether a choice between two constructions by the values of ``x`` is made inside the
    compiled program, by :func:`branch`, where it cannot read them (:func:`reads_values`).

    JAX tracing for the CPU (under ``jax.jit``): ``lax.cond`` compiles both and runs one. A
    per-channel gate's intra-chunk matrices factored through each chunk's middle token where
    bounded, chosen so, took 0.67x (RWKV-7) and 0.79x (KDA) the time of the levels alone
    forward and 0.59-0.72x with the gradient at ggml's shapes, and 0.91-1.12x where the gates
    exceed the bound and the levels run (``docs/performance.md``, "The bound checked inside a
    compiled JAX program"). ``torch.compile`` keeps the levels: its ``torch.cond`` took strided
    inputs as dense in the compiled branch (a stride assertion at run time); eager JAX reads
    no values; accelerators are unmeasured.
    """
    return scans_tokens(xp, x)


def branch(pred: Any, if_true: Callable[[], Any], if_false: Callable[[], Any]) -> Any:
    """``jax.lax.cond(pred, if_true, if_false)``: the result of one of two functions of no
    arguments (their arrays captured) that return arrays of the same shapes. Only where
    :func:`branches_in_program` is true (JAX is then imported).

    Each function runs under ``jax.checkpoint``: the derivatives recompute it from the captured
    arrays. Without it ``cond``'s gradient keeps the residuals of both functions (zeros for
    the one that did not run), and the factored gradient above took 0.82-1.01x the levels'
    time instead of 0.59-0.72x.
    """
    jax = sys.modules["jax"]
    return jax.lax.cond(pred, jax.checkpoint(if_true), jax.checkpoint(if_false))


def scan(step: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any) -> tuple[Any, Any]:
    """``jax.lax.scan(step, carry, xs)``: ``step`` once per leading index of ``xs``. Only where
    :func:`scans_tokens` or :func:`scans_chunks` is true (JAX is then imported)."""
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
    torch = loaded_torch()
    return torch is not None and isinstance(x, torch.Tensor) and torch.compiler.is_compiling()


def compiling_any(args: tuple) -> bool:
    """Whether one of ``args`` is a tensor that ``torch.compile`` is tracing (:func:`compiling`
    of each, asking torch once: a step's per-call lookup pays 0.2 us for it, not 1.3)."""
    torch = loaded_torch()
    return (
        torch is not None
        and torch.compiler.is_compiling()
        and any(isinstance(x, torch.Tensor) for x in args)
    )


def outside_graph(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run eagerly when called from code that ``torch.compile`` traces.

    Only call it where :func:`compiling` is true (torch is then imported).
    """
    return torch_module().compiler.disable(function)


def cacheable(x: Any) -> bool:
    """Whether a freshly made constant array may be reused by later calls.

    Not a JAX tracer (a constant made inside ``jit`` must not outlive its trace), not a tensor
    made while ``torch.compile`` traces (a placeholder of the graph being built), and not a
    PyTorch inference tensor (made under ``torch.inference_mode``, it could not be saved for
    backward by a later training step).
    """
    if torch_namespace_of(x) is not None:
        return not (compiling(x) or x.is_inference())
    return not is_tracer(x)


def blas_threaded_qr(xp: Any) -> bool:
    """Whether ``xp.linalg.qr`` is NumPy's: LAPACK on the BLAS's own thread pool.

    NumPy and array-api-strict (which wraps it) factor each small matrix through thousands of
    BLAS calls, each split over OpenBLAS's (or MKL's) threads: on a machine whose cores are
    busy, every call waits for threads that are not scheduled, and the 32 QRs of 128 x 128
    that ``favor_plus(128, 4096)`` needs took 25 s instead of 0.1 s. Their elementwise
    operations run on one thread, so the caller builds such factors from those instead.
    """
    return library_name(xp) in ("numpy", "array_api_strict")


def stacked_qr(xp: Any) -> bool:
    """Whether ``xp.linalg.qr`` (where ``xp`` has it) factors a stack ``(..., M, N)`` at once.

    Dask's ``qr`` takes one two-dimensional matrix, in a single column of chunks.
    """
    return library_name(xp) not in DASK_NAMESPACES


def eager_constants(xp: Any) -> AbstractContextManager[Any]:
    """A context in which arrays computed from Python data alone are concrete and cacheable.

    A projection built from a seed depends on no input, so it should be computed once, at
    once, and kept: under JAX, outside any trace (``jax.ensure_compile_time_eval``: inside
    ``jit`` it would otherwise be recomputed by every call of the compiled function and could
    not be cached); under PyTorch, outside ``inference_mode`` (an inference tensor could not be
    saved for backward by a later training step). The library is already imported whenever its
    namespace is in use, so it is taken from ``sys.modules``, not imported here.
    """
    library = library_name(xp)
    if library in JAX_NAMESPACES and sys.modules.get("jax") is not None:
        return sys.modules["jax"].ensure_compile_time_eval()
    if library == "torch" and loaded_torch() is not None:
        torch = torch_module()
        # While torch.compile traces, a constant is part of the graph being built (and
        # Dynamo cannot enter inference_mode): there is nothing to keep eagerly.
        return nullcontext() if torch.compiler.is_compiling() else torch.inference_mode(False)
    return nullcontext()


def materialized(x: Any) -> Any:
    """``x`` computed now where the library is lazy (Dask persists it), else ``x`` itself.

    For a constant that is kept and reused: a lazy array would repeat its whole computation
    in every result that uses it.
    """
    if torch_namespace_of(x) is not None:
        return x
    return x.persist() if array_api_compat.is_dask_array(x) else x


def splits_chunks_on_concat(x: Any) -> bool:
    """Whether ``x`` is a Dask array: a concatenation gives it one chunk per piece.

    An array assembled from pieces level by level (the per-channel scores of a chunk) would
    then end with one chunk, and tasks, per smallest piece; such code places its pieces by
    selection instead. Elsewhere concatenation is the cheaper way (its backward is a slice).
    """
    return torch_namespace_of(x) is None and array_api_compat.is_dask_array(x)


def rows_in_whole_chunks(x: Any, rows: int) -> Any:
    """``x`` with its Dask chunks along axis -2 whole multiples of ``rows``; else ``x`` itself.

    The chunked forms reshape the sequence axis into ``(chunks, rows)``. A Dask chunk boundary
    inside a chunk of ``rows`` (the zero padding of a short last chunk is concatenated, and
    makes one) would be carried into every reshape after it, splitting each level of the
    per-channel scores into ever smaller pieces: thousands of tasks for a few rows.
    """
    if torch_namespace_of(x) is not None or not array_api_compat.is_dask_array(x):
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
    if library_name(xp) in JAX_NAMESPACES and sys.modules.get("jax") is not None:
        return _jitted(function, static_argnames)
    return function


@cache
def _jitted(function: Callable[..., Any], static_argnames: Hashable) -> Callable[..., Any]:
    return sys.modules["jax"].jit(function, static_argnames=static_argnames)


def check_static(name: str, value: Any) -> None:
    """Refuse a traced value for an option that decides the computation's structure.

    A flag, ``chunk_size`` or ``eps`` must be a Python value under ``jax.jit``: a traced one is a
    ``TypeError`` saying how to keep it static. polylin's flag checks call it; a flag taken by
    truthiness (the fla ops') calls it alone.

    Parameters
    ----------
    name : str
        The option's name, as the caller wrote it.
    value : object
        Its value.

    Raises
    ------
    TypeError
        ``value`` is traced by ``jax.jit``.

    Examples
    --------
    >>> from polylin.interop import check_static
    >>> check_static("normalize", True)  # a Python value: nothing to say
    """
    if is_tracer(value):
        raise TypeError(
            f"{name} must be static under jax.jit, got a traced value: pass it in "
            f"static_argnames=({name!r},) or bind it with functools.partial"
        )
