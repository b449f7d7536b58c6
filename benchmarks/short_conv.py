"""The short causal convolution on PyTorch's CPU: its own depthwise convolution against the
taps as products, on the same inputs, in one process, alternating.

``causal_conv1d`` sums its taps with PyTorch's ``conv2d`` where that is the faster
(``polylin._backend.depthwise``: float32 on the CPU, at least ``NATIVE_MIN_VALUES`` outputs,
with a gradient ``GRADIENT_MIN_VALUES`` and a backward of its own) and as products (one
``addcmul`` per tap) elsewhere. This benchmark times both on every shape, in float32 and
float64, forward or (``--backward``) forward and backward: ``kernel_taps`` (the kernel,
whatever the dtype) against ``causal_taps`` with the kernel turned off for the call. The two
outputs are checked against each other first. Usage::

    python benchmarks/short_conv.py [--threads 1] [--dtypes float32 float64] [--backward]
        [--repeats 15] [--quick] [--json out.json]

The ratio is the kernel's median time over the products'; ``chosen`` says whether
``causal_conv1d`` takes the kernel on that call. (glibc told to keep freed memory,
``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648``, makes the figures
steadier.) The page "Performance" quotes its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import polylin._backend.depthwise as depthwise
from benchmarks.timing import command_line, interleaved_times, run_metadata, write_report
from polylin.testing import Backend

#: (batch, T, channels, width): ggml's SSM_CONV; Qwen3-Next's projections at T = 2048
#: (2 x 16 x 128 keys and 32 x 128 values); a batch of four; short prompts; a decoding-sized
#: call; Mamba-2's width at a small model; the smallest calls.
SHAPES = [
    (1, 512, 3328, 4),
    (1, 2048, 8192, 4),
    (4, 2048, 1024, 4),
    (2, 64, 256, 4),
    (1, 16, 8192, 4),
    (8, 1024, 64, 2),
    (1, 8, 16, 4),
    (1, 1, 3328, 4),
]
QUICK_SHAPES = [(1, 8, 16, 4), (2, 40, 512, 3)]


@contextlib.contextmanager
def kernel_off() -> Iterator[None]:
    """``causal_taps`` as products for the duration, whatever the size."""
    least = depthwise.NATIVE_MIN_VALUES, depthwise.GRADIENT_MIN_VALUES
    depthwise.NATIVE_MIN_VALUES = depthwise.GRADIENT_MIN_VALUES = sys.maxsize
    try:
        yield
    finally:
        depthwise.NATIVE_MIN_VALUES, depthwise.GRADIENT_MIN_VALUES = least


def _call(x: dict[str, Any], length: int, kernel: bool, backward: bool) -> Callable[..., Any]:
    """One timed call: the state and the inputs joined (as ``causal_conv1d`` does), then the
    taps by the kernel or as products, and with ``backward`` the gradient of the outputs
    against ``x["cotangent"]``."""
    torch = Backend.TORCH.module()

    def run(_: Any = None) -> Any:
        ext = torch.cat([x["state"], x["x"]], dim=-2)
        if kernel:
            out = depthwise.kernel_taps(ext, x["weight"], None)
        else:
            with kernel_off():
                out = depthwise.causal_taps(torch, ext, x["weight"], None, length)
        if backward:
            out.backward(x["cotangent"])
            x["x"].grad = x["weight"].grad = None
        return out

    return run


def compare(shape: tuple, dtype: str, *, repeats: int, backward: bool) -> dict[str, Any]:
    """The kernel against the products on one shape and dtype: the outputs checked against
    each other, then timed interleaved; medians in seconds and their ratio."""
    batch, length, channels, width = shape
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((batch, length, channels)),
              "weight": rng.standard_normal((channels, width)) / 2,
              "state": rng.standard_normal((batch, width - 1, channels)),
              "cotangent": rng.standard_normal((batch, length, channels))}  # fmt: skip
    x = {name: Backend.TORCH.from_numpy(a, dtype) for name, a in arrays.items()}
    if backward:
        x["x"].requires_grad_(True)
        x["weight"].requires_grad_(True)
    calls = [_call(x, length, kernel, backward) for kernel in (True, False)]
    kernel_out, taps_out = (call().detach().double().numpy() for call in calls)
    error = float(np.abs(kernel_out - taps_out).max()) / max(1.0, float(np.abs(taps_out).max()))
    if not error <= (1e-5 if dtype == "float32" else 1e-12):
        raise AssertionError(f"{shape} {dtype}: the kernel and the products differ by {error:.2e}")
    (kernel_s, _), (taps_s, _) = interleaved_times(calls, repeats)
    least = depthwise.GRADIENT_MIN_VALUES if backward else depthwise.NATIVE_MIN_VALUES
    chosen = dtype == "float32" and width > 1 and batch * length * channels >= least
    return {"batch": batch, "T": length, "channels": channels, "width": width, "dtype": dtype,
            "backward": backward, "error": error, "kernel_s": kernel_s, "taps_s": taps_s,
            "ratio": kernel_s / taps_s, "chosen": chosen}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "float64"),
                        default=["float32", "float64"])  # fmt: skip
    parser.add_argument("--backward", action="store_true", help="forward and backward")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    Backend.TORCH.module().set_num_threads(args.threads)
    rows = []
    print("| batch, T, channels, width | dtype | conv2d | products | conv2d / products | "
          "chosen |\n|---|---|---|---|---|---|")  # fmt: skip
    for dtype in args.dtypes:
        for shape in QUICK_SHAPES if args.quick else SHAPES:
            row = compare(shape, dtype, repeats=args.repeats, backward=args.backward)
            rows.append(row)
            print(f"| {', '.join(map(str, shape))} | {dtype} | {row['kernel_s'] * 1e3:.3f} ms | "
                  f"{row['taps_s'] * 1e3:.3f} ms | {row['ratio']:.2f} | "
                  f"{'yes' if row['chosen'] else 'no'} |", flush=True)  # fmt: skip
    meta = run_metadata(
        command_line("short_conv.py", argv),
        threads=args.threads, backward=args.backward,
    )  # fmt: skip
    return write_report({"meta": meta, "rows": rows, "goals": []}, args.json)


if __name__ == "__main__":
    main()
