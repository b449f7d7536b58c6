"""The delta rules' chunk on the CPU: a shorter chunk against a longer one (32 against 64
unless ``--chunks`` names others), in one process, alternating.

On one eager CPU thread the delta rules run chunks of at most
``polylin._forms.delta.chunked.ONE_THREAD_CHUNK`` tokens for keys of up to 128 channels; this
benchmark lifts that cap for its calls, so that each chunk runs as asked, checks that the two
chunks give the same outputs (to float32 round-off), then times them interleaved (medians; the
ratio is the shorter chunk's time over the longer one's). Forward, or forward and backward with
``--backward`` (PyTorch). Usage::

    python benchmarks/delta_chunks.py [--backend torch|numpy] [--threads 1] [--backward]
        [--chunks 32 64] [--repeats 5] [--quick] [--json out.json]

(glibc told to keep freed memory, ``MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=2147483648``, makes the figures steadier.) The page "Delta rule" quotes
its figures.
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

import polylin._forms.delta.chunked as delta_chunked
from benchmarks.timing import command_line, interleaved_times, run_metadata, write_report
from polylin import delta_rule_attention
from polylin.testing import Backend

#: (batch, heads, T, d, gate): the page's shapes; gate "none", "scalar" or "channel" (KDA).
SHAPES = [
    (1, 16, 512, 64, "scalar"),
    (1, 16, 4096, 64, "scalar"),
    (1, 32, 512, 128, "scalar"),
    (1, 16, 512, 128, "channel"),
    (2, 8, 4096, 64, "none"),
    (2, 8, 4096, 128, "scalar"),
    (1, 8, 16384, 64, "scalar"),
    (2, 8, 4096, 64, "channel"),
    (1, 4, 2048, 256, "scalar"),
]
QUICK_SHAPES = [(1, 2, 96, 16, "scalar"), (1, 2, 96, 16, "channel")]
#: The chunks compared unless ``--chunks`` names others: (shorter, longer).
CHUNKS = (32, 64)


@contextlib.contextmanager
def chunks_as_asked(longest: int = max(CHUNKS)) -> Iterator[None]:
    """Every chunk up to ``longest`` runs as asked: the one-thread cap lifted for the
    duration."""
    cap = delta_chunked.ONE_THREAD_CHUNK
    delta_chunked.ONE_THREAD_CHUNK = max(cap, longest)
    try:
        yield
    finally:
        delta_chunked.ONE_THREAD_CHUNK = cap


def make_inputs(shape: tuple, seed: int = 0) -> dict[str, np.ndarray]:
    """Unit keys and queries, ``beta`` in (0, 1), log decays in (-0.1, 0] (float32)."""
    B, H, T, d, gate = shape
    rng = np.random.default_rng(seed)

    def unit() -> np.ndarray:
        x = rng.standard_normal((B, H, T, d))
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    arrays = {"q": unit(), "k": unit(), "v": rng.standard_normal((B, H, T, d))}
    arrays["beta"] = rng.uniform(0.05, 1.0, (B, H, T, 1))
    if gate != "none":
        arrays["g"] = -0.1 * rng.random((B, H, T, 1 if gate == "scalar" else d))
    return {name: x.astype(np.float32) for name, x in arrays.items()}


def _call(x: dict[str, Any], chunk: int, backward: bool) -> Callable[[Any], Any]:
    """One timed call at ``chunk`` (the repeat index is ignored)."""

    def run(_: Any = None) -> Any:
        out, state = delta_rule_attention(
            x["q"], x["k"], x["v"], x["beta"], log_decay=x.get("g"), chunk_size=chunk,
            return_state=True,
        )  # fmt: skip
        if backward:
            (out.sum() + state.sum()).backward()
            for leaf in x.values():
                leaf.grad = None
        return out

    return run


def compare(
    backend: Backend, shape: tuple, *, repeats: int, backward: bool,
    chunks: tuple[int, int] = CHUNKS,
) -> dict[str, Any]:
    """The shorter of ``chunks`` against the longer on one shape: both outputs checked against
    each other, then timed interleaved; medians in seconds and their ratio."""
    x = {name: backend.from_numpy(a, "float32") for name, a in make_inputs(shape).items()}
    if backward:
        for leaf in x.values():
            leaf.requires_grad_(True)
    short, long = sorted(chunks)
    calls = [_call(x, chunk, backward) for chunk in (short, long)]
    with chunks_as_asked(long):
        outputs = [backend.to_numpy(call().detach() if backward else call()) for call in calls]
        scale = float(np.abs(outputs[1]).max())
        error = float(np.abs(outputs[0] - outputs[1]).max())
        if not error <= 1e-4 * max(scale, 1.0):
            raise AssertionError(f"{shape}: chunks {short} and {long} differ by {error:.2e}")
        (t_short, _), (t_long, _) = interleaved_times(calls, repeats)
    B, H, T, d, gate = shape
    return {"batch": B, "heads": H, "T": T, "d": d, "gate": gate, "error": error,
            "short": short, "long": long, "short_s": t_short, "long_s": t_long,
            "ratio": t_short / t_long}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "numpy"), default="torch")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--backward", action="store_true", help="forward and backward (torch)")
    parser.add_argument("--chunks", type=int, nargs=2, default=list(CHUNKS),
                        metavar=("SHORT", "LONG"), help="the two chunks compared")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    backend = Backend.TORCH if args.backend == "torch" else Backend.NUMPY
    if args.backward and backend is not Backend.TORCH:
        parser.error("--backward needs --backend torch")
    if backend is Backend.TORCH:
        backend.module().set_num_threads(args.threads)
    if min(args.chunks) < 1 or args.chunks[0] == args.chunks[1]:
        parser.error("--chunks: two different chunk lengths of at least 1 token")
    short, long = sorted(args.chunks)
    rows = []
    print(f"| batch x heads, T, d, gate | chunk {short} | chunk {long} | {short} / {long} |\n"
          "|---|---|---|---|")  # fmt: skip
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        row = compare(backend, shape, repeats=args.repeats, backward=args.backward,
                      chunks=(short, long))  # fmt: skip
        rows.append(row)
        print(f"| {row['batch']} x {row['heads']}, {row['T']}, {row['d']}, {row['gate']} | "
              f"{row['short_s'] * 1e3:.2f} ms | {row['long_s'] * 1e3:.2f} ms | "
              f"{row['ratio']:.2f} |", flush=True)  # fmt: skip
    meta = run_metadata(
        command_line("delta_chunks.py", argv),
        backend=args.backend, threads=args.threads, backward=args.backward,
    )  # fmt: skip
    return write_report({"meta": meta, "rows": rows, "goals": []}, args.json)


if __name__ == "__main__":
    main()
