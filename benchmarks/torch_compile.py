"""How long ``torch.compile(polylin.causal_linear_attention)`` takes to build, and what it gains.

For each sequence length, forward alone (under ``torch.no_grad``) and forward + backward: the
time of the first compiled call (tracing and code generation included), then the median of
repeated eager and compiled calls, interleaved in the same run, and their ratio.

    python benchmarks/torch_compile.py [--lengths 256 4096] [--batch 2] [--heads 4] [--dim 64]

Absolute times depend on the machine and its load; read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import polylin


def _median_seconds(call, fns, repeats: int, clock) -> list[float]:
    """Median time of each of ``fns``, calls interleaved so that a change of load hits all."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, record in zip(fns, times):
            start = clock()
            call(fn)
            record.append(clock() - start)
    return [statistics.median(record) for record in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time calls by this process's CPU time (steadier on a shared machine with "
        "--threads 1); the first compiled call is always wall time (compilation uses workers)",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
        f"(batch, heads, T, d) = ({args.batch}, {args.heads}, T, {args.dim}), "
        f"{'CPU' if args.cpu_time else 'wall'} time"
    )
    for T in args.lengths:
        shape = (args.batch, args.heads, T, args.dim)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        for mode in ("forward", "forward+backward"):
            torch._dynamo.reset()
            eager = polylin.causal_linear_attention
            compiled = torch.compile(eager)

            def call(fn, mode=mode, q=q, k=k, v=v):
                if mode == "forward":
                    with torch.no_grad():
                        fn(q, k, v)
                else:
                    fn(q, k, v).sum().backward()

            start = time.perf_counter()
            call(compiled)
            first = time.perf_counter() - start
            call(eager)  # warm-up
            t_eager, t_compiled = _median_seconds(call, [eager, compiled], args.repeats, clock)
            print(
                f"T={T:6d} {mode:17s} first compiled call {first:6.1f} s   "
                f"eager {t_eager * 1e3:9.2f} ms   compiled {t_compiled * 1e3:9.2f} ms   "
                f"eager/compiled {t_eager / t_compiled:5.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
