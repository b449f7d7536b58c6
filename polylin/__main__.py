"""``python -m polylin``: a demo table across backends, the backend list, and the benchmark."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from . import METHODS, __version__, causal_linear_attention, masked_kernel_attention
from .testing import Backend

DESCRIPTION = """\
polylin: linear (kernelized, softmax-free) attention, one array-API implementation for NumPy,
PyTorch, CuPy, JAX, Dask and array-api-strict.

  python -m polylin demo       run every method on every usable backend; print errors and times
  python -m polylin backends   list the backends and why an unusable one cannot run here
  python -m polylin bench      benchmark methods, backends and sequence lengths (JSON + plot)
  python -m polylin bench-gpu  GPU benchmark against fla, SDPA and the seed loop (JSON + plot)
  python -m polylin bench-dask scale-out run on local Dask clusters of 1 and 2 workers (JSON)

Library use:  from polylin import causal_linear_attention;  out = causal_linear_attention(q, k, v)
"""


def _usable(names: Sequence[str] | None) -> list[Backend]:
    chosen = [Backend(n) for n in names] if names else list(Backend)
    return [b for b in chosen if b.available()]


def _time_call(backend: Backend, fn, repeats: int) -> tuple[object, float]:
    out = backend.synchronize(fn())  # warm-up (and compile, where a backend does)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = backend.synchronize(fn())
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def demo(args: argparse.Namespace) -> int:
    """Run the three methods on every usable backend and print a table."""
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq_len)
    q = rng.standard_normal((*shape, args.dim))
    k = rng.standard_normal((*shape, args.dim))
    v = rng.standard_normal((*shape, args.dim))
    reference = masked_kernel_attention(q, k, v)  # float64 NumPy, the quadratic form
    print(
        f"polylin {__version__} demo: causal linear attention, batch={args.batch}, "
        f"T={args.seq_len}, d={args.dim}; error = max |out - float64 masked-kernel reference|\n"
    )
    header = (
        f"{'backend':<17} {'device':<8} {'dtype':<9} {'method':<10} {'max error':>10} {'time':>10}"
    )
    print(header)
    print("-" * len(header))
    for backend in _usable(args.backends):
        device = "gpu" if backend.is_gpu else "cpu"
        for dtype in ("float64", "float32"):
            xs = [backend.from_numpy(x, dtype) for x in (q, k, v)]
            for method in METHODS:
                out, seconds = _time_call(
                    backend,
                    lambda xs=xs, method=method: causal_linear_attention(*xs, method=method),
                    args.repeats,
                )
                error = float(np.max(np.abs(backend.to_numpy(out) - reference)))
                print(
                    f"{backend.value:<17} {device:<8} {dtype:<9} {method:<10} "
                    f"{error:>10.2e} {seconds * 1e3:>8.2f}ms"
                )
    skipped = [b for b in Backend if not b.available()]
    if skipped:
        print("\nnot run here:")
        for b in skipped:
            print(f"  {b.value:<17} {b.unavailable_reason()}")
    return 0


def backends(args: argparse.Namespace) -> int:
    """List the backend drivers and whether each can run here."""
    for b in Backend:
        reason = b.unavailable_reason()
        print(f"{b.value:<17} {'ok' if reason is None else 'unavailable: ' + reason}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m polylin",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"polylin {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="{demo,backends,bench,bench-gpu,bench-dask}"
    )

    p_demo = sub.add_parser("demo", help="run every method on every usable backend")
    p_demo.add_argument("--batch", type=int, default=4, help="batch x heads (default 4)")
    p_demo.add_argument("--seq-len", type=int, default=256, help="sequence length T (default 256)")
    p_demo.add_argument("--dim", type=int, default=32, help="d_k = d_v (default 32)")
    p_demo.add_argument("--repeats", type=int, default=3, help="timed repeats (median shown)")
    p_demo.add_argument(
        "--backends", nargs="+", metavar="NAME", choices=[b.value for b in Backend],
        help="backends to run (default: every usable one)",
    )
    p_demo.set_defaults(func=demo)

    p_list = sub.add_parser("backends", help="list backends and their availability")
    p_list.set_defaults(func=backends)

    from .bench import add_arguments  # the benchmark keeps its own flags

    p_bench = sub.add_parser("bench", help="benchmark methods, backends and lengths")
    add_arguments(p_bench)

    from .bench import gpu  # the GPU benchmark (backends/gpu-check.sh runs it); lazy imports

    p_bench_gpu = sub.add_parser(
        "bench-gpu", help="GPU benchmark: polylin vs seed loop, quadratic, SDPA, fla"
    )
    gpu.add_arguments(p_bench_gpu)

    from .bench.dask_scaleout import add_arguments as add_dask_arguments

    p_dask = sub.add_parser("bench-dask", help="Dask scale-out run on local clusters (JSON)")
    add_dask_arguments(p_dask)

    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
