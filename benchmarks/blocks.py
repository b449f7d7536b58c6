"""Block size of the chunked forms against the threads, each configuration in a fresh process.

    python benchmarks/blocks.py [--threads 1 2] [--rows 4096 8192] [--runs 2] [--form gdn|gla]
        [--json out.json]

PyTorch CPU, float32, d = 64, forward at T = 4096 and 16384 and forward + backward at
T = 4096: ``gdn`` the gated delta rule (scalar gate) at batch x heads = 8, ``gla`` linear
attention with a gate per channel (GLA: identity features, no normalizer, queries scaled by
``d ** -0.5``) at ggml's 32 heads. ``--rows`` is the block of all threads together, in rows
(batch x tokens; ``gla``: of its features and values, 4096 rows of d = 64 being 2 MiB). Each
(threads, rows per block, case) runs in a process of its own, ``--runs`` processes per
configuration in alternation, and reports the median wall-clock time of 7 calls after two
untimed ones, with its system time. A fresh process per configuration because the page faults
a call pays depend on what the process freed before: timed in one process, a larger block's
allocations raise glibc's mmap and trim thresholds for the smaller blocks timed after it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's polylin
    sys.path.insert(0, str(ROOT))
CASES = (("forward", 4096), ("forward", 16384), ("fwd+bwd", 4096))


def child(
    threads: int, rows: int, kind: str, length: int, d: int = 64, calls: int = 7, form: str = "gdn"
) -> dict:
    """Time one configuration in this process: ``{"ms": median wall, "sys_ms": its system
    time}``, blocks of ``rows`` rows (``BLOCK_ROWS`` set to ``rows / threads``; ``gla``:
    ``BLOCK_BYTES`` to the bytes of ``rows / threads`` rows)."""
    import torch

    import polylin
    import polylin._forms.delta.chunked
    import polylin._forms.linear.chunked

    torch.set_num_threads(threads)
    polylin._forms.delta.chunked.BLOCK_ROWS = max(1, rows // threads)
    polylin._forms.linear.chunked.BLOCK_BYTES = max(1, rows * 2 * d * 4 // threads)
    g = torch.Generator().manual_seed(0)
    shape = (1, 32, length) if form == "gla" else (2, 4, length)
    q, v = (torch.randn(*shape, d, generator=g) for _ in range(2))
    k = torch.nn.functional.normalize(torch.randn(*shape, d, generator=g), dim=-1)
    beta = torch.sigmoid(torch.randn(*shape, 1, generator=g))
    gate = -torch.nn.functional.softplus(torch.randn(*shape, 1, generator=g)) / 16
    if form == "gla":  # a gate per channel, as GLA's logsigmoid(x) / 16
        gate = torch.nn.functional.logsigmoid(torch.randn(*shape, d, generator=g)) / 16
    xs = [q, k, v, beta, gate]
    backward = kind == "fwd+bwd"
    for x in xs:
        x.requires_grad_(backward)

    def call() -> None:
        if form == "gla":
            out = polylin.causal_linear_attention(
                q, k, v, polylin.feature_maps.identity, log_decay=gate, normalize=False,
                scale=d**-0.5)  # fmt: skip
        else:
            out = polylin.delta_rule_attention(q, k, v, beta, log_decay=gate)
        if backward:
            out.sum().backward()
            for x in xs:
                x.grad = None

    wall, system = [], []
    with torch.set_grad_enabled(backward):
        call()
        call()
        for _ in range(calls):
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
            call()
            wall.append(time.perf_counter() - start)
            system.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - before)
    return {"ms": statistics.median(wall) * 1e3, "sys_ms": statistics.median(system) * 1e3}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--form", choices=("gdn", "gla"), default="gdn")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        threads, rows, kind, length = args.child
        print(json.dumps(child(int(threads), int(rows), kind, int(length), form=args.form)))
        return []
    results = []
    for threads in args.threads:
        for kind, length in CASES:
            row: dict = {"threads": threads, "pass": kind, "T": length}
            for _ in range(args.runs):
                for rows in args.rows:
                    done = subprocess.run(
                        [sys.executable, __file__, "--child", str(threads), str(rows), kind,
                         str(length), "--form", args.form],
                        capture_output=True, text=True, check=True, cwd=ROOT,
                    )  # fmt: skip
                    row.setdefault(rows, []).append(json.loads(done.stdout))
            results.append(row)
            cells = "  ".join(
                f"{rows} rows: "
                + ", ".join(f"{r['ms']:.1f} ms (sys {r['sys_ms']:.0f})" for r in row[rows])
                for rows in args.rows
            )
            print(f"threads {threads}, {kind:8s} T {length:6d}: {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
