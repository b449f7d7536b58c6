"""What passing ``(batch, T, heads, d)`` tensors as transposed views costs the chunked form.

Times ``causal_linear_attention`` on contiguous ``(batch, heads, T, d)`` inputs, on transposed
views of ``(batch, T, heads, d)`` inputs, and on those views copied first (``.contiguous()`` /
``np.ascontiguousarray``), interleaved, by this process's CPU time on one thread.

    OPENBLAS_NUM_THREADS=1 python benchmarks/layout_cost.py [--T 4096] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import polylin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = (args.batch, args.T, args.heads, args.dim)
    rng = np.random.default_rng(0)
    for library in ("torch", "numpy"):
        arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
        if library == "torch":
            arrays = [torch.from_numpy(a) for a in arrays]
            views = [a.transpose(1, 2) for a in arrays]
            copy = torch.Tensor.contiguous
        else:
            views = [a.transpose(0, 2, 1, 3) for a in arrays]
            copy = np.ascontiguousarray
        contiguous = [copy(v) for v in views]
        cases = {
            "contiguous (batch, heads, T, d)": lambda c=contiguous: c,
            "views of (batch, T, heads, d)": lambda v=views: v,
            "views copied first": lambda v=views, copy=copy: [copy(x) for x in v],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, inputs in cases.items():
                start = time.process_time()
                polylin.causal_linear_attention(*inputs())
                times[name].append(time.process_time() - start)
        base = statistics.median(times["contiguous (batch, heads, T, d)"])
        for name, record in times.items():
            median = statistics.median(record)
            print(f"{library:6s} {name:32s} {median * 1e3:8.2f} ms  x{median / base:.2f}")


if __name__ == "__main__":
    main()
