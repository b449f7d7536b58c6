"""Grouped heads: a grouped call against the same call on ``H x G`` heads with q and k repeated.

PyTorch CPU, float32. The grouped call takes ``q, k`` of shape ``(B, H, 1, T, d)`` and ``v`` of
shape ``(B, H, G, T, d)``; the repeated call takes ``q`` and ``k`` copied to ``(B, H, G, T, d)``
(the copy is made before the timer and outside the peak of the call, so that peak favours
the repeated call; the inputs' bytes are reported beside it). Two cases: ``linear`` (the
default feature map, normalized, no gate) and ``mamba2`` (Mamba-2's shared B and C: the
identity map, ``normalize=False``, a scalar gate per token and value head). For each pass
(forward, forward+backward): the minimum over interleaved repeats of the wall time and of the
process CPU time, and the peak memory of one call
(``benchmarks.timing.peak_memory``: the profiler's running sum of the CPU allocator's
allocations and frees), with the ratios grouped / repeated taken in the same run.

Usage: ``python benchmarks/grouped.py [--batch 2 --heads 4 --groups 4 --T 4096 --dim 64]
[--threads 1] [--repeats 5] [--json out.json]`` (one thread by default: steadier ratios on a
shared machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.timing import peak_memory  # noqa: E402
from polylin import causal_linear_attention  # noqa: E402
from polylin.feature_maps import identity  # noqa: E402
from polylin.testing import Backend  # noqa: E402

PASSES = ("forward", "forward+backward")


def _call(case: str, backward: bool, q: Any, k: Any, v: Any, g: Any) -> Callable[[], None]:
    """One call of the case; with ``backward`` on fresh leaves (the inputs' copies are views)."""
    options: dict[str, Any] = {}
    if case == "mamba2":
        options = {"feature_map": identity, "normalize": False, "log_decay": g}

    def run() -> None:
        if not backward:
            with torch.no_grad():
                causal_linear_attention(q, k, v, **options)
            return
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        extra = dict(options)
        if case == "mamba2":
            extra["log_decay"] = g.detach().requires_grad_()
        causal_linear_attention(*leaves, **extra).sum().backward()

    return run


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    B, H, G, T, d = args.batch, args.heads, args.groups, args.T, args.dim
    q, k = (torch.randn(B, H, 1, T, d) for _ in range(2))
    v = torch.randn(B, H, G, T, d)
    g = -torch.rand(B, H, G, T, 1) * 0.1
    q_flat, k_flat = (x.expand(B, H, G, T, d).contiguous() for x in (q, k))
    rows = []
    for case in ("linear", "mamba2"):
        for pass_ in PASSES:
            backward = pass_ == "forward+backward"
            calls = {
                "grouped": _call(case, backward, q, k, v, g),
                "repeated": _call(case, backward, q_flat, k_flat, v, g),
            }
            wall: dict[str, list[float]] = {name: [] for name in calls}
            cpu: dict[str, list[float]] = {name: [] for name in calls}
            for fn in calls.values():
                fn()  # warm up
            for _ in range(args.repeats):  # interleaved: load changes hit both alike
                for name, fn in calls.items():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    fn()
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
            row: dict[str, Any] = {
                "case": case, "pass": pass_, "batch": B, "heads": H, "groups": G, "T": T, "d": d,
            }  # fmt: skip
            inputs = {"grouped": (q, k, v), "repeated": (q_flat, k_flat, v)}
            for name, fn in calls.items():
                row[f"{name}_input_bytes"] = sum(x.numel() * x.element_size() for x in inputs[name])
                row[f"{name}_s"] = min(wall[name])
                row[f"{name}_cpu_s"] = min(cpu[name])
                row[f"{name}_peak_bytes"] = peak_memory(Backend.TORCH, fn)
            rows.append(row)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'case':7} {'pass':17} {'grouped ms':>10} {'repeated ms':>11} {'cpu ratio':>9} "
        f"{'grouped MiB':>11} {'repeated MiB':>12} {'memory ratio':>12} "
        f"{'with inputs':>11}   (MiB: peak of the call; ratios grouped / repeated)"
    ]
    for r in rows:

        def with_inputs(name: str, r: dict[str, Any] = r) -> int:
            return r[f"{name}_peak_bytes"] + r[f"{name}_input_bytes"]

        lines.append(
            f"{r['case']:7} {r['pass']:17} {r['grouped_s'] * 1e3:10.1f} "
            f"{r['repeated_s'] * 1e3:11.1f} {r['grouped_cpu_s'] / r['repeated_cpu_s']:9.2f} "
            f"{r['grouped_peak_bytes'] / 2**20:11.1f} {r['repeated_peak_bytes'] / 2**20:12.1f} "
            f"{r['grouped_peak_bytes'] / r['repeated_peak_bytes']:12.2f} "
            f"{with_inputs('grouped') / with_inputs('repeated'):11.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="key heads H")
    parser.add_argument("--groups", type=int, default=4, help="value heads per key head G")
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, "
        f"B={args.batch} H={args.heads} G={args.groups} T={args.T} d={args.dim}"
    )
    print(report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
