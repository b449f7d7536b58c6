"""``python -m polylin``: a demo table across backends, and the backend list."""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import METHODS, __version__, causal_linear_attention, masked_kernel_attention
from .testing import Backend

DESCRIPTION = """\
polylin: linear (kernelized, softmax-free) attention, one array-API implementation for NumPy,
PyTorch, CuPy, JAX, Dask and array-api-strict.

  python -m polylin demo       run every method on every usable backend; print errors and times
  python -m polylin backends   list the backends and why an unusable one cannot run here
  python -m polylin bench ...  from a clone of the repository: python benchmarks/run.py ...

Library use:  from polylin import causal_linear_attention;  out = causal_linear_attention(q, k, v)
"""

#: Where the benchmarks live in a clone (they are not installed with the package).
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"

#: The methods that loop over tokens in Python: the demo runs them on a prefix.
PER_TOKEN = ("recurrent",)

NOT_INSTALLED = """\
polylin's benchmarks are not installed with the package (this polylin is {where}).
They live beside the library in its source repository; from a clone:

  python benchmarks/run.py --help        (or: make bench)
"""


def _usable(names: Sequence[str] | None) -> list[Backend]:
    chosen = [Backend(n) for n in names] if names else list(Backend)
    return [b for b in chosen if b.available()]


#: Seconds of timed repeats a call gets (at least one repeat). On Dask, whose every call
#: builds its graph anew (the warm-up is a call like the others), a call whose warm-up took
#: longer is not repeated: the warm-up's time is shown.
REPEAT_BUDGET = 1.0


def _time_call(backend: Backend, fn: Callable[[], Any], repeats: int) -> tuple[object, float]:
    start = time.perf_counter()
    out = backend.synchronize(fn())  # warm-up (and compile, where a backend does)
    warm_up = time.perf_counter() - start
    if warm_up > REPEAT_BUDGET and backend is Backend.DASK:
        return out, warm_up
    times = []
    for _ in range(min(repeats, max(1, int(REPEAT_BUDGET / max(warm_up, 1e-9))))):
        start = time.perf_counter()
        out = backend.synchronize(fn())
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a usage error naming the option otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def demo(args: argparse.Namespace) -> int:
    """Run the three methods on every usable backend and print a table.

    The per-token methods (``recurrent``) run on the first ``--recurrent-len`` tokens only,
    their error taken against the same rows of the reference (a causal output depends on its
    prefix alone): a Python loop over tokens costs a lazy backend such as Dask a graph per
    token, minutes at the full length.
    """
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq_len)
    q = rng.standard_normal((*shape, args.dim))
    k = rng.standard_normal((*shape, args.dim))
    v = rng.standard_normal((*shape, args.dim))
    reference = masked_kernel_attention(q, k, v)  # float64 NumPy, the quadratic form
    print(
        f"polylin {__version__} demo: causal linear attention, batch={args.batch}, "
        f"T={args.seq_len}, d={args.dim}; error = max |out - float64 masked-kernel reference|"
        f" over the first T tokens\n"
    )
    header = (
        f"{'backend':<17} {'device':<8} {'dtype':<9} {'method':<10} {'max error':>10} {'time':>10}"
        f" {'T':>6}"
    )
    print(header)
    print("-" * len(header))
    for backend in _usable(args.backends):
        device = "gpu" if backend.is_gpu else "cpu"
        for dtype in [d for d in ("float64", "float32") if d in backend.float_dtypes()]:
            for method in METHODS:
                length = min(args.seq_len, args.recurrent_len) if method in PER_TOKEN else None
                xs = [backend.from_numpy(x[:, :length], dtype) for x in (q, k, v)]
                call = functools.partial(causal_linear_attention, *xs, method=method)
                out, seconds = _time_call(backend, call, args.repeats)
                error = float(np.max(np.abs(backend.to_numpy(out) - reference[:, :length])))
                print(
                    f"{backend.value:<17} {device:<8} {dtype:<9} {method:<10} "
                    f"{error:>10.2e} {seconds * 1e3:>8.2f}ms {length or args.seq_len:>6}"
                )
    skipped = [b for b in Backend if not b.available()]
    if skipped:
        print("\nnot run here:")
        for b in skipped:
            print(f"  {b.value:<17} {b.unavailable_reason()}")
    for b in _usable(args.backends):
        if "float64" not in b.float_dtypes():  # JAX in its default mode
            print(f"\n{b.value}: no float64 here (JAX_ENABLE_X64=1 turns on JAX's 64-bit mode)")
    return 0


def backends(args: argparse.Namespace) -> int:
    """List the backend drivers and whether each can run here."""
    for b in Backend:
        reason = b.unavailable_reason()
        print(f"{b.value:<17} {'ok' if reason is None else 'unavailable: ' + reason}")
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/run.py`` of the clone this polylin was imported from, if there is one."""
    if not BENCHMARKS.is_file():
        print(NOT_INSTALLED.format(where=BENCHMARKS.parent.parent), file=sys.stderr)
        return 2
    rest: list[str] = list(args.args)
    if not rest or rest[0].startswith("-"):
        rest = ["cpu", *rest]  # `python -m polylin bench --quick`: the CPU benchmark
    # A process of its own, from the clone's folder: the library never imports the benchmarks.
    done = subprocess.run([sys.executable, str(BENCHMARKS), *rest], cwd=BENCHMARKS.parent.parent)
    return done.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m polylin",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"polylin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,backends,bench}")

    p_demo = sub.add_parser("demo", help="run every method on every usable backend")
    p_demo.add_argument("--batch", type=_positive_int, default=4, help="batch x heads (default 4)")
    p_demo.add_argument(
        "--seq-len", type=_positive_int, default=256, help="sequence length T (default 256)"
    )
    p_demo.add_argument("--dim", type=_positive_int, default=32, help="d_k = d_v (default 32)")
    p_demo.add_argument(
        "--recurrent-len", type=_positive_int, default=16,
        help="tokens the per-token (recurrent) method runs (default 16)",
    )  # fmt: skip
    p_demo.add_argument(
        "--repeats", type=_positive_int, default=3, help="timed repeats (median shown)"
    )
    p_demo.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        choices=[b.value for b in Backend],
        help="backends to run (default: every usable one)",
    )
    p_demo.set_defaults(func=demo)

    p_list = sub.add_parser("backends", help="list backends and their availability")
    p_list.set_defaults(func=backends)

    p_bench = sub.add_parser(
        "bench",
        help="from a clone: run benchmarks/run.py with the arguments that follow",
        add_help=False,
    )
    p_bench.add_argument("args", nargs=argparse.REMAINDER)
    p_bench.set_defaults(func=bench)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after it belongs to benchmarks/run.py
        return bench(argparse.Namespace(args=argv[1:]))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
