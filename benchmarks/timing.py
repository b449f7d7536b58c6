"""How every benchmark measures: one timer, peak memory, the GEMM rate, run metadata, progress.

Times are wall-clock medians of repeats after a warm-up call, each stopped by the backend's
synchronization (device work and lazy graphs are finished inside the timer). Peak memory is
measured in a separate, untimed call: ``tracemalloc`` for NumPy and array-api-strict (NumPy
reports its buffers to it), the profiler's allocator events for PyTorch (the CPU allocator has
no counters of its own; on CUDA, ``torch.cuda.max_memory_allocated``); other backends report
``None``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from polylin.testing import Backend

from .model import gemm_flops

__all__ = [
    "ALLOCATORS",
    "Progress",
    "Timing",
    "allocator_environment",
    "allocator_regime",
    "apply_allocator_regime",
    "command_line",
    "gemm_rate",
    "goal",
    "interleaved_times",
    "peak_memory",
    "run_metadata",
    "second_of_calls",
    "time_call",
    "write_report",
]


@dataclass
class Timing:
    """Times of one benchmarked call (seconds), minor page faults per call, the last output."""

    times: list[float] = field(default_factory=list)
    warmup: float = 0.0
    faults: float = 0.0
    output: Any = None

    @property
    def median(self) -> float:
        """Median of the timed repeats."""
        return statistics.median(self.times)


def time_call(
    backend: Backend, fn: Callable[[], Any], *, repeats: int, budget_s: float
) -> Timing:
    """Warm up once, then time up to ``repeats`` calls (fewer if one call is slow).

    ``budget_s`` caps the time spent on repeats: a call that takes 2 s with a 3 s budget gets
    one repeat. Page faults (``ru_minflt``) are counted over the timed calls.

    """
    start = time.perf_counter()
    backend.synchronize(fn())
    warmup = time.perf_counter() - start
    n = max(1, min(repeats, int(budget_s / max(warmup, 1e-9))))
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        out = None  # free the previous output before the next call
        start = time.perf_counter()
        out = backend.synchronize(fn())
        times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return Timing(times=times, warmup=warmup, faults=faults / n, output=out)


def interleaved_times(fns: list[Any], repeats: int) -> list[tuple[float, float]]:
    """``(median, minimum)`` seconds of each of ``fns`` (called with the repeat index), calls
    interleaved so that a change of load hits all; on a loaded machine the minimum is the
    closer estimate of the work itself."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn(0)  # warm-up
    for i in range(repeats):
        for fn, record in zip(fns, times):
            start = time.perf_counter()
            fn(i + 1)
            record.append(time.perf_counter() - start)
    return [(statistics.median(record), min(record)) for record in times]


def peak_memory(backend: Backend, fn: Callable[[], Any]) -> int | None:
    """Peak bytes allocated during one call of ``fn`` beyond what existed before it.

    """
    if backend in (Backend.NUMPY, Backend.ARRAY_API_STRICT):
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            out = fn()
            peak = tracemalloc.get_traced_memory()[1] - base
            del out
        finally:
            tracemalloc.stop()
        return peak
    if backend is Backend.TORCH:
        return _torch_cpu_peak(fn)
    if backend is Backend.TORCH_CUDA:
        torch = backend.module()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak
    return None


def _torch_cpu_peak(fn: Callable[[], Any]) -> int:
    # The profiler sees every allocation and free of the CPU allocator: an op's own (self)
    # allocations at its start, frees outside ops as "[memory]" events. Their running sum in
    # time order is the memory in use; its maximum is the peak.
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    # The profiler's C++ side logs start/stop lines straight to file descriptor 2, which
    # would break the progress bar's line; Python-level errors still raise.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def gemm_rate(backend: Backend, n: int, *, dtype: str = "float32", repeats: int = 3) -> float:
    """``n x n @ n x n`` matrix multiply rate of ``backend`` in ``dtype``, in flop/s (median).

    """
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = (backend.from_numpy(rng.standard_normal((n, n)), dtype) for _ in range(2))
    xp = backend.namespace()
    timing = time_call(backend, lambda: xp.matmul(a, b), repeats=repeats, budget_s=10.0)
    return gemm_flops(n) / timing.median


#: glibc's variables that decide whether freed memory stays in the process.
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

#: Set by the ``glibc`` regime: its worker turns polylin's raise of glibc's thresholds off
#: before its first call (:func:`apply_allocator_regime`).
UNRAISED = "POLYLIN_BENCH_UNRAISED"

#: The environment of each allocator regime a benchmark's worker process can run under.
#: ``default``: glibc as it comes, what a user gets. A buffer above its mmap threshold (128 KiB
#: in a fresh process, raised to the largest such buffer freed so far, at most 32 MiB) is a
#: fresh mapping, and the heap's top is given back above twice that threshold: each 4 KiB page
#: of such memory is a page fault when next touched. polylin's first eager call raises both as
#: far as glibc's rule goes (``polylin/_backend/allocator.py``). ``glibc``: the same without
#: that raise (polylin before it; every other library). ``resident``: both thresholds so high
#: that every buffer comes from the heap and stays there, no page faults after the first call.
ALLOCATORS: dict[str, dict[str, str]] = {
    "default": {},
    "glibc": {UNRAISED: "1"},
    "resident": {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31)},
}


def allocator_environment(allocator: str | None, env: dict[str, str]) -> dict[str, str]:
    """A copy of ``env`` in the regime ``allocator`` of :data:`ALLOCATORS` (glibc's own variables
    and :data:`UNRAISED` from ``env`` dropped, the regime's set), or as it is for ``None``."""
    if allocator is None:
        return dict(env)
    dropped = (*ALLOCATOR_VARIABLES, UNRAISED)
    kept = {name: value for name, value in env.items() if name not in dropped}
    return {**kept, **ALLOCATORS[allocator]}


def apply_allocator_regime() -> None:
    """In a worker process, before polylin's first call: the part of the ``glibc`` regime that
    an environment variable of glibc's cannot set (:data:`UNRAISED`)."""
    if os.environ.get(UNRAISED) == "1":
        from polylin._backend.allocator import leave_thresholds

        leave_thresholds()


def allocator_regime(allocator: str | None) -> dict[str, str]:
    """For a report: the regime ``allocator`` (``None``: this process's environment, named
    ``inherited``), glibc's variables it sets and ``LD_PRELOAD`` (another allocator) if set."""
    env = allocator_environment(allocator, dict(os.environ))
    named = (*ALLOCATOR_VARIABLES, UNRAISED, "LD_PRELOAD")
    return {"name": allocator or "inherited", **{n: env[n] for n in named if n in env}}


def second_of_calls(
    fn: Callable[[], Any], repeats: int, budget_s: float
) -> tuple[float, float, float]:
    """``(mean, median)`` seconds of ``fn`` after a warm-up, and the minor page faults per call:
    at least 3 and up to ``repeats`` calls within ``budget_s``, then more until a second has
    passed. ggml's ``us/run`` is a mean over at least a second, and the ratios use the mean too:
    on a loaded machine a median of short calls would keep the quiet moments ggml's does not
    (``benchmarks/ggml_ops.py``)."""
    start = time.perf_counter()
    fn()  # warm-up
    first = time.perf_counter() - start
    times: list[float] = []
    least = max(3, min(repeats, int(budget_s / max(first, 1e-9))))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    while len(times) < least or sum(times) < 1.0:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.fmean(times), statistics.median(times), faults / len(times)


def goal(name: str, value: float, limit: float) -> dict[str, Any]:
    """One goal of a report: a measured ratio and the limit it must stay at or under."""
    return {"name": name, "value": value, "limit": limit, "met": value <= limit}


def write_report(report: dict[str, Any], path: Any | None) -> dict[str, Any]:
    """Print ``report["goals"]`` (met or MISS), write the report as JSON to ``path`` if given."""
    for g in report["goals"]:
        print(f"{'met ' if g['met'] else 'MISS'} {g['name']}: {g['value']:.2f} "
              f"(at most {g['limit']})")
    if path is not None:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return report


#: The vector extensions :func:`cpu_model` names, widest first: the first one present.
VECTOR_FLAGS = ("avx512f", "avx2", "avx", "sse4_2", "asimd", "neon")


def cpu_model(cpuinfo: str | None = None) -> dict[str, Any]:
    """The processor's name and its widest vector extension (``/proc/cpuinfo`` on Linux):
    compiled loops such as ggml's run 2-3x faster with AVX-512 than with AVX2, so ratios
    against them are read per processor. Empty where the file is absent."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "model": fields.get("model name", ""),
        "family": fields.get("cpu family", ""),
        "vector": next((flag for flag in VECTOR_FLAGS if flag in flags), ""),
    }


def command_line(script: str, argv: list[str] | None) -> str:
    """The command a report names: ``python benchmarks/<script>`` and its arguments (``argv``, or
    this process's when ``None``)."""
    return " ".join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def run_metadata(command: str, **extra: Any) -> dict[str, Any]:
    """What a report needs to be read right: versions, machine, threads, load, start time."""
    from polylin import __version__

    meta: dict[str, Any] = {
        "polylin": __version__, "python": platform.python_version(),
        "platform": platform.platform(), "machine": platform.machine(),
        "processor": platform.processor(), "cpu_count": os.cpu_count(), "cpu": cpu_model(),
        "command": command,
        "load_average_start": list(os.getloadavg()),
        "thread_env": {
            name: os.environ[name]
            for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
            if name in os.environ
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in ("numpy", "torch"):
        with contextlib.suppress(ImportError):
            meta[name] = importlib.import_module(name).__version__
    if "torch" in meta:
        torch = importlib.import_module("torch")
        meta["torch_threads"] = torch.get_num_threads()
        meta["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    meta.update(extra)
    return meta


class Progress:
    """A one-line progress bar on stderr (``\\r``-updated), with the elapsed time.

    """

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.width = width
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self._last = 0

    def elapsed(self) -> float:
        """Seconds since the bar was created."""
        return time.perf_counter() - self.start

    def show(self, label: str) -> None:
        """Redraw the bar with ``label`` as the current task."""
        filled = self.width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"[{bar}] {self.done}/{self.total} {self.elapsed():6.1f}s {label}"
        )
        pad = max(0, self._last - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last = len(line)

    def step(self, label: str = "") -> None:
        """Count one task as done."""
        self.done += 1
        self.show(label)

    def close(self) -> None:
        """End the line."""
        self.stream.write("\n")
        self.stream.flush()
