"""Time and memory per generated token: polylin's fixed-size state against a softmax KV cache.

    python examples/decode_vs_kv_cache.py --out runs/decode

For each context length (doubling up to ``--max-context``, 64k tokens by default), one attention
layer (``--heads`` x ``--d-head``, batch 1, float32) decodes ``--tokens`` new tokens after a
context of that length, two ways, in the same run and on the same keys and values:

- **polylin**: the context is prefilled into a :class:`polylin.LinearAttentionState` with the
  chunked form (in pieces, continued with ``initial_state=``), then each token is one
  :func:`polylin.step`. The state is ``heads x (d x d + d)`` numbers whatever the context.
- **softmax + KV cache**: the context's keys and values sit in a preallocated cache; each token
  writes its key and value into it and attends over all of it (``softmax(K q / sqrt(d)) V``).
  The cache is ``2 x heads x context x d`` numbers and each token reads all of it.

Reported per context: the median time per token, the bytes each method carries between tokens
(state or cache), and, with NumPy, the measured peak memory of decoding (``tracemalloc``: the
state or cache plus every temporary of the decoding steps). It prints a table and writes
``decode.json`` and ``decode.png`` (with matplotlib) to ``--out``.

On a busy machine, run NumPy with one BLAS thread (``OPENBLAS_NUM_THREADS=1``, set before Python
starts): a multi-threaded matrix-vector product over a large KV cache otherwise waits for cores
that other processes hold, and a token can take a hundred times longer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from charlm import positive_int

from polylin import LinearAttentionState, causal_linear_attention, step

MiB = 2**20
PREFILL_PIECE = 4096  # tokens per prefill call: bounds the prefill's temporaries


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where decode.json/.png go")
    parser.add_argument(
        "--max-context", type=positive_int, default=65536, help="longest context (tokens)"
    )
    parser.add_argument("--points", type=positive_int, default=7, help="context lengths, doubling")
    parser.add_argument("--tokens", type=positive_int, default=32, help="decoded tokens per cell")
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--d-head", type=positive_int, default=64)
    parser.add_argument("--backend", choices=("numpy", "torch"), default="numpy")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="PyTorch CPU threads (for NumPy set OPENBLAS_NUM_THREADS before starting Python)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.backend == "torch" and importlib.util.find_spec("torch") is None:
        parser.error("--backend torch: PyTorch is not installed")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    return args


class Library:
    """The few library-specific operations: array creation, copies, timing synchronization."""

    def __init__(self, name: str, threads: int | None) -> None:
        self.name = name
        if name == "torch":
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.torch = torch  # the tensors here never require grad: no autograd graph
        from array_api_compat import array_namespace

        self.xp = array_namespace(self.asarray(np.zeros(1, np.float32)))

    def asarray(self, x: np.ndarray) -> Any:
        return self.torch.from_numpy(x) if self.name == "torch" else x

    def copy(self, x: Any) -> Any:
        return self.xp.asarray(x, copy=True)

    def empty(self, shape: tuple[int, ...]) -> Any:
        return self.xp.empty(shape, dtype=self.xp.float32)


def prefill_state(lib: Library, k: Any, v: Any) -> LinearAttentionState:
    """The state after the context, prefilled with the chunked form in pieces."""
    state = None
    for start in range(0, k.shape[-2], PREFILL_PIECE):
        piece_k = k[..., start : start + PREFILL_PIECE, :]
        piece_v = v[..., start : start + PREFILL_PIECE, :]
        # The outputs are not needed, only the state: the keys serve as queries.
        _, state = causal_linear_attention(
            piece_k, piece_k, piece_v, initial_state=state, return_state=True
        )
    return state


def kv_cache(lib: Library, k: Any, v: Any, extra: int) -> tuple[Any, Any]:
    """A preallocated cache holding the context's keys and values, with room for ``extra``."""
    heads, context, d = k.shape[-3:]
    cache_k, cache_v = (
        lib.empty((1, heads, context + extra, d)),
        lib.empty((1, heads, context + extra, d)),
    )
    cache_k[..., :context, :] = k
    cache_v[..., :context, :] = v
    return cache_k, cache_v


def softmax_decode(
    lib: Library, cache_k: Any, cache_v: Any, length: int, q_t: Any, k_t: Any, v_t: Any
) -> Any:
    """One token of softmax attention: append (k_t, v_t) at ``length``, attend over the cache."""
    xp = lib.xp
    cache_k[..., length, :] = k_t
    cache_v[..., length, :] = v_t
    keys, values = cache_k[..., : length + 1, :], cache_v[..., : length + 1, :]
    scores = (keys @ q_t[..., None])[..., 0] / math.sqrt(q_t.shape[-1])  # (1, heads, length+1)
    weights = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))  # exp of numbers <= 0
    weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return (weights[..., None, :] @ values)[..., 0, :]


def time_tokens(run, n: int, sync) -> float:
    """Median seconds per call of ``run(i)`` over ``n`` calls, after one warm-up call."""
    run(0)
    times = []
    for i in range(n):
        start = time.perf_counter()
        sync(run(i + 1))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(lib: Library, args: argparse.Namespace, context: int, rng: np.random.Generator) -> dict:
    heads, d = args.heads, args.d_head
    k = lib.asarray(rng.standard_normal((1, heads, context, d), dtype=np.float32))
    v = lib.asarray(rng.standard_normal((1, heads, context, d), dtype=np.float32))
    new = [
        lib.asarray(rng.standard_normal((3, 1, heads, d), dtype=np.float32))
        for _ in range(args.tokens + 1)
    ]
    sync = (lambda x: x) if lib.name == "numpy" else (lambda x: x.sum().item())

    state = prefill_state(lib, k, v)
    current = {"state": state}

    def polylin_token(i: int) -> Any:
        q_t, k_t, v_t = new[i][0], new[i][1], new[i][2]
        o_t, current["state"] = step(q_t, k_t, v_t, current["state"])
        return o_t

    cache_k, cache_v = kv_cache(lib, k, v, args.tokens + 1)

    def softmax_token(i: int) -> Any:
        q_t, k_t, v_t = new[i][0], new[i][1], new[i][2]
        return softmax_decode(lib, cache_k, cache_v, context + i, q_t, k_t, v_t)

    # Alternate the two, twice, so that a busy spell of the machine hits both alike; keep the
    # better of the two medians of each.
    polylin_times, softmax_times = [], []
    for _ in range(2):
        polylin_times.append(time_tokens(polylin_token, args.tokens, sync))
        softmax_times.append(time_tokens(softmax_token, args.tokens, sync))
    polylin_s, softmax_s = min(polylin_times), min(softmax_times)

    state_bytes = sum(math.prod(x.shape) * x.itemsize for x in (state.S, state.z))
    cache_bytes = 2 * heads * (context + 1) * d * 4  # keys and values after the first new token
    row = {
        "context": context,
        "polylin_ms_per_token": polylin_s * 1e3,
        "softmax_ms_per_token": softmax_s * 1e3,
        "state_bytes": state_bytes,
        "kv_cache_bytes": cache_bytes,
        "polylin_peak_bytes": None,
        "softmax_peak_bytes": None,
    }
    if lib.name == "numpy":
        row["polylin_peak_bytes"] = traced_peak(
            lambda: _decode_copies(lib, state, None, new, context, polylin=True)
        )
        row["softmax_peak_bytes"] = traced_peak(
            lambda: _decode_copies(lib, None, (k, v), new, context, polylin=False)
        )
    return row


def _decode_copies(lib, state, context_kv, new, context, *, polylin) -> None:
    """Decode two tokens from a fresh copy of the state or cache (allocated while traced)."""
    if polylin:
        current = LinearAttentionState(lib.copy(state.S), lib.copy(state.z))
        for i in range(2):
            _, current = step(new[i][0], new[i][1], new[i][2], current)
    else:
        cache_k, cache_v = kv_cache(lib, *context_kv, 2)
        for i in range(2):
            softmax_decode(lib, cache_k, cache_v, context + i, new[i][0], new[i][1], new[i][2])


def traced_peak(run) -> int:
    """Peak bytes NumPy allocated during ``run()`` (NumPy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / MiB:.2f} MiB" if n >= MiB / 10 else f"{n / 1024:.1f} KiB"


def table(rows: list[dict]) -> str:
    header = (
        f"{'context':>8} | {'polylin ms/tok':>14} | {'softmax+KV ms/tok':>17} | {'ratio':>6} | "
        f"{'state':>10} | {'KV cache':>10} | {'peak polylin':>12} | {'peak softmax':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['context']:>8} | {r['polylin_ms_per_token']:>14.3f} | "
            f"{r['softmax_ms_per_token']:>17.3f} | "
            f"{r['softmax_ms_per_token'] / r['polylin_ms_per_token']:>5.1f}x | "
            f"{fmt_bytes(r['state_bytes']):>10} | {fmt_bytes(r['kv_cache_bytes']):>10} | "
            f"{fmt_bytes(r['polylin_peak_bytes']):>12} | {fmt_bytes(r['softmax_peak_bytes']):>12}"
        )
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    ctx = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
    left.plot(ctx, [r["polylin_ms_per_token"] for r in rows], "o-", label="polylin step (state)")
    left.plot(ctx, [r["softmax_ms_per_token"] for r in rows], "s-", label="softmax + KV cache")
    left.set_ylabel("ms per generated token")
    right.plot(ctx, [r["state_bytes"] / MiB for r in rows], "o-", label="polylin state")
    right.plot(ctx, [r["kv_cache_bytes"] / MiB for r in rows], "s-", label="KV cache")
    if rows[0]["polylin_peak_bytes"] is not None:
        right.plot(
            ctx,
            [r["polylin_peak_bytes"] / MiB for r in rows],
            "o:",
            label="polylin, peak while decoding",
        )
        right.plot(
            ctx,
            [r["softmax_peak_bytes"] / MiB for r in rows],
            "s:",
            label="softmax, peak while decoding",
        )
    right.set_ylabel("MiB: state or cache, and peak")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def settings(args: argparse.Namespace) -> dict:
    """The options and the thread settings of the environment, for the record."""
    threads = {name: os.environ.get(name) for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    return vars(args) | {"out": str(args.out), "environment": threads}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lib = Library(args.backend, args.threads)
    contexts = sorted({args.max_context >> i for i in range(args.points)} - {0})
    title = (
        f"one layer, {args.heads} heads x d={args.d_head}, batch 1, float32, {args.backend}; "
        f"median of {args.tokens} tokens"
    )
    print(title)
    rng = np.random.default_rng(args.seed)
    rows = []
    for context in contexts:
        rows.append(measure(lib, args, context, rng))
        print(f"  context {context}: done", file=sys.stderr)
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode.json").write_text(
            json.dumps({"settings": settings(args), "rows": rows}, indent=1) + "\n"
        )
        plot(args.out / "decode.png", rows, title)
        print(f"wrote {args.out}/decode.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
