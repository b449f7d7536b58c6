"""Benchmark of the delta rule on PyTorch CPU: ratios measured in one run.

    python benchmarks/delta_rule.py [--repeats 5] [--threads N] [--chunk-size C] [--json out.json]

float32, batch x heads = 8, d_k = d_v = 64, unit keys, per-token beta (and per-token decay for
the gated rule). Reported, each as a ratio of medians measured in the same run (absolute times
on a shared machine are noise; the implementations being compared are timed in alternation):

- forward at T = 4096: recurrent / chunked (the parallel form's speed-up), and the same ratio
  for ``causal_linear_attention`` (its per-token loop against its chunked form: what a chunked
  form costing as much as plain linear attention's can reach against a per-token loop);
- forward at T = 4096: delta chunked / ``causal_linear_attention`` chunked (the price of the
  delta rule over plain linear attention), ungated and gated;
- forward + backward (``out.sum().backward()``) of the chunked form: time(16k) / time(4k)
  (4.0 is linear in T).

Three clocks per call: wall, user CPU time and user + system CPU time of the process
(``getrusage``). On a machine shared with other jobs, waiting for a core does not count on the CPU
clocks; with ``--threads 1`` they are the work done. System time is mostly page faults of
freshly allocated memory.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

import polylin
from polylin import causal_linear_attention, delta_rule_attention

BATCH, HEADS, D = 2, 4, 64


def inputs(length: int, *, grad: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, length)
    q = torch.randn(*shape, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(*shape, D, generator=g), dim=-1)
    v = torch.randn(*shape, D, generator=g)
    beta = torch.sigmoid(torch.randn(*shape, 1, generator=g))
    log_decay = -torch.nn.functional.softplus(torch.randn(*shape, 1, generator=g)) / 16
    out = {"q": q, "k": k, "v": v, "beta": beta, "log_decay": log_decay}
    if grad:
        for x in out.values():
            x.requires_grad_(True)
    return out


CLOCKS = ("wall", "user", "cpu")


def _now() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall": time.perf_counter(),
        "user": usage.ru_utime,
        "cpu": usage.ru_utime + usage.ru_stime,
    }


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict]:
    """Median seconds per call on each clock, the calls timed in alternation after a warm-up."""
    for fn in calls.values():
        fn()
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CLOCKS} for n in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = _now()
            fn()
            stop = _now()
            for c in CLOCKS:
                times[name][c].append(stop[c] - start[c])
    return {n: {c: statistics.median(t[c]) for c in CLOCKS} for n, t in times.items()}


def forward(repeats: int, chunk: dict[str, int]) -> dict[str, float]:
    x = inputs(4096)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["log_decay"]
    with torch.no_grad():
        fast = interleaved(
            {
                "delta_chunked": lambda: delta_rule_attention(q, k, v, beta, **chunk),
                "gated_delta_chunked": lambda: delta_rule_attention(
                    q, k, v, beta, log_decay=g, **chunk
                ),
                "linear_chunked": lambda: causal_linear_attention(q, k, v),
            },
            repeats,
        )
        # The per-token loops are slow: fewer repeats (at least 3), each loop timed beside one
        # more chunked call of its own function.
        slow = interleaved(
            {
                "delta_recurrent": lambda: delta_rule_attention(q, k, v, beta, method="recurrent"),
                "delta_chunked_again": lambda: delta_rule_attention(q, k, v, beta, **chunk),
                "linear_recurrent": lambda: causal_linear_attention(q, k, v, method="recurrent"),
                "linear_chunked_again": lambda: causal_linear_attention(q, k, v),
            },
            max(3, repeats // 2),
        )
    return {**fast, **slow}


def forward_backward(repeats: int, chunk: dict[str, int]) -> dict[str, float]:
    calls = {}
    for length in (4096, 16384):
        x = inputs(length, grad=True)

        def step(x: dict[str, torch.Tensor] = x) -> None:
            out = delta_rule_attention(
                x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"], **chunk
            )
            out.sum().backward()
            for t in x.values():
                t.grad = None

        calls[f"gated_delta_fwd_bwd_{length}"] = step
    return interleaved(calls, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="of the delta rule (default: the library's)"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    times = {**forward(args.repeats, chunk), **forward_backward(args.repeats, chunk)}
    pairs = {
        "recurrent / chunked (forward, T=4096)": ("delta_recurrent", "delta_chunked_again"),
        "linear attention: recurrent / chunked (forward)": (
            "linear_recurrent",
            "linear_chunked_again",
        ),
        "delta chunked / linear chunked (forward, T=4096)": ("delta_chunked", "linear_chunked"),
        "gated delta chunked / linear chunked (forward, T=4096)": (
            "gated_delta_chunked",
            "linear_chunked",
        ),
        "fwd+bwd time(16k) / time(4k) (gated, chunked)": (
            "gated_delta_fwd_bwd_16384",
            "gated_delta_fwd_bwd_4096",
        ),
    }
    ratios = {
        name: {c: times[a][c] / times[b][c] for c in CLOCKS} for name, (a, b) in pairs.items()
    }
    load = os.getloadavg()
    meta = {
        "polylin": polylin.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(load[0], 1),
        "shape": f"batch {BATCH} x heads {HEADS}, d_k = d_v = {D}, float32",
        "chunk_size": args.chunk_size
        or inspect.signature(delta_rule_attention).parameters["chunk_size"].default,
        "repeats": args.repeats,
    }
    print(f"{'ratio of medians':56s} " + " ".join(f"{c:>7s}" for c in CLOCKS))
    for name, value in ratios.items():
        print(f"{name:56s} " + " ".join(f"{value[c]:7.2f}" for c in CLOCKS))
    print(
        f"(delta rule chunk {meta['chunk_size']}, {meta['threads']} threads, "
        f"load average {meta['loadavg_1m']})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "seconds": times, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
