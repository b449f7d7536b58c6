"""Where polylin's GPU time goes: kernel counts and times, chunk sizes, CUDA graphs.

    python benchmarks/gpu_profile.py [--device cuda] [--T 8192] [--d 64] [--dtype bfloat16]
        [--ops chunk_gated_delta_rule ...] [--chunks 64 128 256] [--time-budget 120]
        [--json bench-profile.json]

For each op of :mod:`benchmarks.gpu_family` (fla's names, polylin's :mod:`polylin.compat.fla`
twins, fla's layout and arguments) at one size, and for each chunk size given (the chunked
form's ``chunk_size``, set under the compat op), it records:

- the forward (under ``torch.no_grad``) and forward + backward medians;
- the forward replayed as a CUDA graph (``torch.cuda.graph``): the same kernels without the
  host's launch overhead, which is what ``torch.compile(mode="reduce-overhead")`` or a user's
  own graph capture gets (polylin's calls never synchronize with the host, so they capture);
- at the first chunk size, a ``torch.profiler`` trace of one forward: the number of kernels,
  their summed device time against the wall time (a call whose kernels fill little of its wall
  time is bound by launches), and the kernels that take the most time;
- for the gated delta rule, the same with the intra-chunk inverse built by the levels of
  :mod:`polylin._forms.common.intra_chunk` instead of a batched triangular solve.

Decoding: one token of ``fused_recurrent_gated_delta_rule`` per call, eager and replayed as a
CUDA graph, batch 1 and 64. ``--device cpu`` runs the same code with tiny sizes (no graphs,
no CUDA profile): the smoke test. The JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

import polylin.attention as attention_module  # noqa: E402
import polylin.delta_rule as delta_module  # noqa: E402
from benchmarks.gpu_family import OPS, graph_forward, make_inputs, op_call  # noqa: E402
from benchmarks.timing import run_metadata, time_call  # noqa: E402
from polylin._forms.delta import chunked as delta_chunked_module  # noqa: E402
from polylin.compat import fla as compat  # noqa: E402
from polylin.testing import Backend  # noqa: E402

SCHEMA = "polylin-bench-gpu-profile/1"


@contextlib.contextmanager
def chunk_size(size: int) -> Iterator[None]:
    """Every chunked form called in the block runs with ``chunk_size=size`` (the delta rules'
    shortest chunk on accelerators, ``ACCELERATOR_CHUNK``, lowered to it too)."""
    saved = delta_module.delta_chunked, attention_module.causal_chunked
    floor = delta_chunked_module.ACCELERATOR_CHUNK
    delta_chunked_module.ACCELERATOR_CHUNK = min(floor, size)

    def delta(*args: Any, **kwargs: Any) -> Any:
        return saved[0](*args, **{**kwargs, "chunk_size": size})

    def linear(*args: Any, **kwargs: Any) -> Any:
        return saved[1](*args, **{**kwargs, "chunk_size": size})

    delta_module.delta_chunked, attention_module.causal_chunked = delta, linear
    try:
        yield
    finally:
        delta_module.delta_chunked, attention_module.causal_chunked = saved
        delta_chunked_module.ACCELERATOR_CHUNK = floor


@contextlib.contextmanager
def levels() -> Iterator[None]:
    """The delta rule's intra-chunk inverse from the levels, not a triangular solve."""
    saved = delta_chunked_module.unit_lower_solver
    delta_chunked_module.unit_lower_solver = lambda xp, x: None
    try:
        yield
    finally:
        delta_chunked_module.unit_lower_solver = saved


class Profile:
    """One run: its arguments, clock, report and JSON."""

    def __init__(self, args: argparse.Namespace, torch: Any) -> None:
        self.args, self.torch = args, torch
        self.cuda = args.device == "cuda"
        self.backend = Backend.TORCH_CUDA if self.cuda else Backend.TORCH
        self.start = time.perf_counter()
        self.report: dict[str, Any] = {
            "schema": SCHEMA,
            "meta": run_metadata(
                "python benchmarks/gpu_profile.py " + " ".join(sys.argv[1:]),
                device=args.device, T=args.T, d=args.d, dtype=args.dtype, batch=args.batch,
                heads=args.heads,
            ),
            "rows": [], "profiles": [], "decoding": [],
        }  # fmt: skip

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.args.time_budget

    def add(self, key: str, row: dict[str, Any]) -> None:
        self.report[key].append(row)
        print(json.dumps(row), flush=True)
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.report, indent=2) + "\n")

    def median_ms(self, fn: Callable[[], Any]) -> float:
        return 1e3 * time_call(self.backend, fn, repeats=self.args.repeats, budget_s=2.0).median


def _no_grad(torch: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return call()

    return run


def graph_ms(p: Profile, call: Callable[[], Any]) -> float:
    """Median milliseconds of ``call``'s forward replayed as a CUDA graph."""
    return p.median_ms(graph_forward(p.torch, call))


def kernel_profile(p: Profile, call: Callable[[], Any]) -> dict[str, Any]:
    """Kernel count, summed kernel time and wall time of one forward; the top kernels."""
    torch = p.torch
    activity = torch.profiler.ProfilerActivity
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]) as prof:
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: p.args.top]
    return {
        "kernels": len(kernels),
        "kernel_ms": sum(e.device_time for e in kernels) / 1e3,
        "wall_ms": 1e3 * wall,
        "top": [{"name": n, "count": len(t), "ms": sum(t) / 1e3} for n, t in top],
    }


def measure(p: Profile, op: str, variant: str, context: Any, first: bool) -> None:
    torch, args = p.torch, p.args
    base = make_inputs(torch, args.batch, args.T, args.heads, args.d, args.dtype, args.device)
    row: dict[str, Any] = {"op": op, "variant": variant}
    with context:
        call = op_call(compat, op, dict(base))
        try:
            row["forward_ms"] = p.median_ms(_no_grad(torch, call))
            leaves = {n: t.detach().requires_grad_(True) for n, t in base.items()}
            grad_call = op_call(compat, op, leaves)

            def backward() -> Any:
                for t in leaves.values():
                    t.grad = None
                grad_call().float().sum().backward()
                return leaves["q"].grad

            row["forward_backward_ms"] = p.median_ms(backward)
            if p.cuda:
                row["graph_forward_ms"] = graph_ms(p, call)
                if first:
                    p.add("profiles", {"op": op, "variant": variant, **kernel_profile(p, call)})
        except Exception as exc:  # record, never stop the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    p.add("rows", row)


def measure_decoding(p: Profile, batch: int) -> None:
    """One token of the gated delta rule per call: eager, and a CUDA graph of the call."""
    torch, args = p.torch, p.args
    x = make_inputs(torch, batch, 1, args.heads, args.d, "float32", args.device)
    state = torch.zeros(batch, args.heads, args.d, args.d, device=args.device)
    fn = compat.fused_recurrent_gated_delta_rule

    def call() -> Any:
        return fn(x["q"], x["k"], x["v"], g=x["g_token"], beta=x["beta"], initial_state=state,
                  output_final_state=True, use_qk_l2norm_in_kernel=True)[0]  # fmt: skip

    row: dict[str, Any] = {"op": "fused_recurrent_gated_delta_rule", "batch": batch}
    try:
        row["eager_us"] = 1e3 * p.median_ms(_no_grad(torch, call))
        if p.cuda:
            row["graph_us"] = 1e3 * graph_ms(p, call)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    p.add("decoding", row)


def summarize(report: dict[str, Any]) -> str:
    """The report as text: decoding, then one line per op and variant, then the profiles."""
    lines = [f"polylin GPU profile: {report['meta'].get('command', '')}"]
    for r in report["decoding"]:
        lines.append(
            f"decode {r['op']} batch {r['batch']}: "
            + ", ".join(f"{k} {r[k]:.1f}" for k in ("eager_us", "graph_us") if k in r)
            + r.get("error", "")
        )
    for r in report["rows"]:
        times = ", ".join(
            f"{k} {r[k]:.3f}"
            for k in ("forward_ms", "forward_backward_ms", "graph_forward_ms")
            if k in r
        )
        lines.append(f"{r['op']:24s} {r['variant']:10s} {times} {r.get('error', '')}")
    for r in report["profiles"]:
        lines.append(
            f"profile {r['op']} {r['variant']}: {r['kernels']} kernels, "
            f"{r['kernel_ms']:.2f} ms in kernels of {r['wall_ms']:.2f} ms wall"
        )
        lines.extend(f"    {t['ms']:8.3f} ms {t['count']:5d}x {t['name']}" for t in r["top"])
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=8, help="kernels listed per profile")
    parser.add_argument("--time-budget", type=float, default=120.0, help="seconds")
    parser.add_argument("--json", default="bench-profile.json")
    parser.add_argument("--summary-of", metavar="JSON", help="print a report's summary only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.summary_of:
        print(summarize(json.loads(Path(args.summary_of).read_text())))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke test", file=sys.stderr)
        return 2
    p = Profile(args, torch)
    for batch in (1, 64):
        measure_decoding(p, batch)
    plan = [(op, f"chunk {c}", chunk_size(c), i == 0) for i, c in enumerate(args.chunks)
            for op in args.ops]  # fmt: skip
    if "chunk_gated_delta_rule" in args.ops:  # the intra-chunk inverse from the levels
        plan.insert(len(args.ops), ("chunk_gated_delta_rule", "levels", levels(), True))
    for op, variant, context, first in plan:
        if p.out_of_time():
            break
        measure(p, op, variant, context, first)
    return 0 if not any("error" in r for r in p.report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
