"""What ``seq_axis=1`` costs: ``(B, T, H, D)`` inputs against ``(B, H, T, D)`` ones.

PyTorch CPU, float32, forward (and forward+backward) of ``causal_linear_attention``:

- ``bhtd``: contiguous ``(B, H, T, D)`` inputs, the default ``seq_axis=-2`` (the reference);
- ``seq_axis=1``: contiguous ``(B, T, H, D)`` inputs, ``seq_axis=1`` (polylin moves the axis);
- ``manual``: ``(B, T, H, D)`` inputs transposed by hand (``x.transpose(1, 2).contiguous()``),
  then the output transposed back: what a user writes without ``seq_axis``.

Timings are interleaved, repeated, and reported as medians and ratios to ``bhtd`` measured in the
same run. Usage: ``python benchmarks/seq_axis.py [--batch 4 --heads 8 --dim 64 --T 1024 4096]``
(one thread by default: ratios are steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from polylin import causal_linear_attention


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backward", action="store_true", help="forward+backward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, "
        f"{'forward+backward' if args.backward else 'forward'}"
    )
    print(
        f"{'T':>6} {'bhtd ms':>9} {'seq_axis=1 ms':>14} {'ratio':>6} {'manual ms':>10} {'ratio':>6}"
    )
    for T in args.T:
        shape = (args.batch, T, args.heads, args.dim)
        bthd = [torch.randn(shape, requires_grad=args.backward) for _ in range(3)]
        bhtd = [x.detach().transpose(1, 2).contiguous().requires_grad_(args.backward) for x in bthd]

        def run(out):
            if args.backward:
                out.sum().backward()

        cases = {
            "bhtd": lambda bhtd=bhtd: run(causal_linear_attention(*bhtd)),
            "seq_axis": lambda bthd=bthd: run(causal_linear_attention(*bthd, seq_axis=1)),
            "manual": lambda bthd=bthd: run(
                causal_linear_attention(*(x.transpose(1, 2).contiguous() for x in bthd)).transpose(
                    1, 2
                )
            ),
        }
        with torch.no_grad() if not args.backward else torch.enable_grad():
            for fn in cases.values():  # warm up
                fn()
            times = {name: [] for name in cases}
            for _ in range(args.repeats):  # interleaved, so load changes hit every case alike
                for name, fn in cases.items():
                    times[name] += _time(fn, 1)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(
            f"{T:>6} {med['bhtd']:>9.2f} {med['seq_axis']:>14.2f} "
            f"{med['seq_axis'] / med['bhtd']:>6.2f} {med['manual']:>10.2f} "
            f"{med['manual'] / med['bhtd']:>6.2f}"
        )


if __name__ == "__main__":
    main()
