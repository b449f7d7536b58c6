"""Every core: the chunked path against the plain chunked form as the threads grow.

    python benchmarks/threads.py [--threads 1 2 4] [--seq-lens 4096 16384] [--dims 64 128]
                                 [--allocators default resident] [--backends numpy torch]
                                 [--repeats 5] [--json PATH]

For each number of threads, a fresh process runs the CPU sweep (``benchmarks/run.py cpu``,
methods ``chunked`` and ``plain``, forward and forward+backward, batch x heads = 8, float32)
with PyTorch's intra-op threads (``--threads``) and ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` set to that number: OpenBLAS reads its thread
count once, when NumPy is imported, so the threads cannot change within one process. Every
ratio is of two medians of the same process; NumPy has no backward, so it has forward rows
only.

Each sweep runs once per *allocator regime* (``--allocators``), because page faults move these
ratios more than the threads do. glibc returns a freed buffer above its mmap threshold (128 KiB
in a fresh process, raised to the size of the largest such buffer freed so far, at most 32 MiB)
to the system, and trims the top of its heap above twice that: in ``default`` a process that has
freed no large array yet pays a page fault per 4 KiB of every large temporary, at every call,
as a first call or a short script does (polylin's first eager call raises both thresholds as far
as glibc's rule goes, ``polylin/_backend/allocator.py``; ``glibc`` leaves them as they come).
``resident`` sets ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` so high that every buffer comes from the heap and stays there: no
page faults after the first call, as in a long-running process whose allocator has settled,
and the algorithms compared on their arithmetic. The report gives, per regime, backend, pass,
d and T:

- ``chunked / plain`` at each number of threads (the goals: at most 0.7 forward and 0.75
  forward+backward with the libraries' default threads, the machine's cores);
- the time per token of each form and its speed-up over one thread;
- the chunked path's fraction of the GEMM rate measured in the same process (forward).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.timing import (  # noqa: E402
    ALLOCATORS,
    allocator_environment,
    goal,
    run_metadata,
    write_report,
)

#: The goals of the performance issue with the default threads: pass -> chunked / plain limit.
LIMITS = {"forward": 0.7, "forward+backward": 0.75}

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def sweep(threads: int, allocator: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One CPU sweep of ``chunked`` and ``plain`` in a process with ``threads`` threads and the
    ``allocator`` regime's environment."""
    env = allocator_environment(allocator, dict(os.environ))
    env.update({name: str(threads) for name in _THREAD_VARIABLES})
    command = [
        sys.executable, str(ROOT / "benchmarks" / "run.py"), "cpu",
        "--methods", "chunked", "plain", "--passes", "forward", "forward+backward",
        "--backends", *args.backends, "--threads", str(threads),
        "--seq-lens", *map(str, args.seq_lens), "--dims", *map(str, args.dims),
        "--batch", str(args.batch), "--repeats", str(args.repeats),
        "--decode-positions", "1", "--decode-steps", "1", "--gemm-size", str(args.gemm_size),
        "--no-memory", "--no-plot", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # the sweep's own message (its progress bar is on stderr too)
        sys.exit(
            f"benchmarks/run.py cpu failed ({threads} threads, {allocator}):\n{done.stderr[-4000:]}"
        )
    return json.loads((out / "bench.json").read_text())


def rows(threads: int, allocator: str, bench: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep's chunked and plain medians side by side, one row per backend, pass, d, T."""
    timed: dict[tuple, dict[str, Any]] = {}
    for r in bench["results"]:
        if r.get("median_s") is None or r.get("extrapolated"):
            continue
        key = (r["backend"], r["pass"], r["d"], r["T"])
        timed.setdefault(key, {})[r["method"]] = r
    out = []
    for (backend, mode, d, T), by_method in sorted(timed.items()):
        if {"chunked", "plain"} - set(by_method):
            continue
        chunked, plain = by_method["chunked"], by_method["plain"]
        tokens = chunked["batch"] * T
        out.append({
            "allocator": allocator, "backend": backend, "pass": mode, "d": d, "T": T,
            "threads": threads,
            "chunked_s": chunked["median_s"], "plain_s": plain["median_s"],
            "ratio": chunked["median_s"] / plain["median_s"],
            "chunked_us_per_token": chunked["median_s"] / tokens * 1e6,
            "plain_us_per_token": plain["median_s"] / tokens * 1e6,
            "gemm_fraction": chunked.get("gemm_fraction"),
            "chunked_faults_per_call": chunked.get("minor_faults_per_call"),
            "plain_faults_per_call": plain.get("minor_faults_per_call"),
        })  # fmt: skip
    return out


def _case(r: dict[str, Any]) -> tuple:
    return r["allocator"], r["backend"], r["pass"], r["d"], r["T"]


def speedups(table: list[dict[str, Any]]) -> None:
    """Each row's speed-up over the same case on one thread (where one thread was run)."""
    single = {_case(r): r for r in table if r["threads"] == 1}
    for r in table:
        one = single.get(_case(r))
        for form in ("chunked", "plain"):
            r[f"{form}_speedup"] = None if one is None else one[f"{form}_s"] / r[f"{form}_s"]


def print_table(table: list[dict[str, Any]]) -> None:
    def speedup(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    print(
        "allocator  backend  pass              d      T  threads  chunked  plain  chunked/plain"
        "  us/token chunked, plain  speed-up chunked, plain  GEMM%  faults/call chunked, plain"
    )
    for r in sorted(table, key=lambda r: (*_case(r), r["threads"])):
        gemm = "-" if r["gemm_fraction"] is None else f"{100 * r['gemm_fraction']:.0f}%"
        print(
            f"{r['allocator']:<10} {r['backend']:<8} {r['pass']:<16} {r['d']:>3} {r['T']:>6}"
            f" {r['threads']:>8}  {r['chunked_s'] * 1e3:6.1f}ms {r['plain_s'] * 1e3:6.1f}ms"
            f" {r['ratio']:>8.2f}  {r['chunked_us_per_token']:8.3f}, {r['plain_us_per_token']:.3f}"
            f"  {speedup(r['chunked_speedup']):>14}, {speedup(r['plain_speedup'])}  {gemm}"
            f"  {r['chunked_faults_per_call']:.0f}, {r['plain_faults_per_call']:.0f}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--default-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="the threads the goals are judged at (default: the CPU count)",
    )
    parser.add_argument(
        "--allocators", nargs="+", default=["default", "resident"], choices=list(ALLOCATORS),
        help="allocator regimes (default: default resident; module docstring)",
    )  # fmt: skip
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--backends", nargs="+", default=["numpy", "torch"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "metadata": run_metadata("python benchmarks/threads.py", threads=args.threads),
        "rows": [],
        "gemm_flops_per_s": {},
        "goals": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        for allocator in args.allocators:  # regime by regime, the threads alternating within
            for threads in args.threads:
                bench = sweep(threads, allocator, args, Path(folder) / f"{allocator}-{threads}")
                report["rows"] += rows(threads, allocator, bench)
                report["gemm_flops_per_s"][f"{allocator}, {threads}"] = bench["gemm_flops_per_s"]
                load = os.getloadavg()[0]
                print(f"{allocator}, {threads} threads: load average {load:.2f}", flush=True)
    speedups(report["rows"])
    print_table(report["rows"])
    for r in report["rows"]:
        if r["threads"] == args.default_threads:
            name = f"{r['backend']} {r['pass']} chunked / plain, T={r['T']}, d={r['d']}"
            report["goals"].append(
                goal(f"{name}, {r['threads']} threads, {r['allocator']}", r["ratio"],
                     LIMITS[r["pass"]])
            )  # fmt: skip
    return write_report(report, args.json)


if __name__ == "__main__":
    main()
