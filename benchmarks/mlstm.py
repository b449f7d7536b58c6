"""The mLSTM on the CPU: polylin's chunked form against transformers' fallback kernel.

    python benchmarks/mlstm.py [--lengths 1024 4096 16384] [--threads 1 2] [--heads 4]
                               [--d-qk 64] [--d-v 64] [--chunk 64] [--repeats 3] [--json PATH]

:func:`polylin.mlstm` (``method="chunked"``) and transformers' ``mlstm_chunkwise_native_autograd``
(what ``xLSTMForCausalLM`` trains with when the ``xlstm`` package is absent) on the same inputs,
xLSTM's layout ``(B, H, T, d)`` with ``(B, H, T)`` gate pre-activations, both at chunk size
``--chunk``, PyTorch CPU, float32, batch 1. Both are checked first against a float64 run of
polylin's recurrent-equal chunked form (itself checked against the recurrence in the tests):
their float32 errors, measured against ``|h| + 1`` (the mLSTM's output is a ratio whose
denominator may come close to 0), must be of the same size. Forward under ``torch.no_grad`` and
forward+backward (``sum().backward()`` to q, k, v and both gates), calls interleaved, median of
``--repeats``. The ratio is polylin's time over transformers'; the goal is at most 0.5 at
T = 4096 forward+backward, and time per token that does not grow with T.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.timing import goal, interleaved_times, run_metadata, write_report  # noqa: E402
from polylin import mlstm  # noqa: E402


def fallback() -> Callable[..., Any]:
    """transformers' ``mlstm_chunkwise_native_autograd``."""
    from transformers.models.xlstm import modeling_xlstm

    return modeling_xlstm.mlstm_chunkwise_native_autograd


def inputs(length: int, heads: int, d_qk: int, d_v: int, *, seed: int = 0) -> list[torch.Tensor]:
    """``q, k, v, i, f`` in xLSTM's layout, float32; input gates of xLSTM's scale (pre-activations
    spread over about +-10), forget gates mostly close to 1."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, heads, length, d_qk, generator=g)
    v = torch.randn(1, heads, length, d_v, generator=g)
    i = 3.0 * torch.randn(1, heads, length, generator=g)
    f = torch.randn(1, heads, length, generator=g) + 3.0
    return [q, k, v, i, f]


def ours(arrays: list[torch.Tensor], chunk: int) -> torch.Tensor:
    q, k, v, i, f = arrays
    return mlstm(q, k, v, i[..., None], f[..., None], chunk_size=chunk)


def theirs(arrays: list[torch.Tensor], chunk: int) -> torch.Tensor:
    return fallback()(*arrays, chunk_size=chunk)


def check(arrays: list[torch.Tensor], chunk: int) -> dict[str, float]:
    """float32 errors of both against float64, relative to ``|h| + 1``; raises if polylin's is
    more than twice transformers' (or above 1e-2)."""
    exact = ours([x.double() for x in arrays], chunk)
    with torch.no_grad():
        errors = {
            name: float(((fn(arrays, chunk).double() - exact).abs() / (exact.abs() + 1)).max())
            for name, fn in (("polylin", ours), ("transformers", theirs))
        }
    if not errors["polylin"] <= max(2 * errors["transformers"], 1e-5) or errors["polylin"] > 1e-2:
        raise AssertionError(f"polylin's float32 error is out of line: {errors}")
    return errors


def calls(fn: Callable[..., Any], arrays: list[torch.Tensor], chunk: int) -> dict[str, Any]:
    def forward(_: Any) -> Any:
        with torch.no_grad():
            return fn(arrays, chunk)

    def forward_backward(_: Any) -> None:
        for x in arrays:
            x.grad = None
        fn(arrays, chunk).sum().backward()

    return {"forward": forward, "forward+backward": forward_backward}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-qk", type=int, default=64)
    parser.add_argument("--d-v", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "metadata": run_metadata(
            "python benchmarks/mlstm.py", heads=args.heads, d_qk=args.d_qk, d_v=args.d_v,
            chunk=args.chunk,
        ),
        "rows": [],
        "goals": [],
    }  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for length in args.lengths:
            arrays = inputs(length, args.heads, args.d_qk, args.d_v)
            errors = check(arrays, args.chunk)
            for x in arrays:
                x.requires_grad_(True)
            mine, peer = calls(ours, arrays, args.chunk), calls(theirs, arrays, args.chunk)
            for mode in mine:
                (t_ours, _), (t_peer, _) = interleaved_times([mine[mode], peer[mode]], args.repeats)
                row = {
                    "threads": threads, "T": length, "pass": mode, "polylin_s": t_ours,
                    "transformers_s": t_peer, "ratio": t_ours / t_peer, "errors": errors,
                }  # fmt: skip
                report["rows"].append(row)
                print(
                    f"threads {threads} T {length:>6} {mode:<16}: polylin {t_ours * 1e3:8.1f} ms, "
                    f"transformers {t_peer * 1e3:8.1f} ms, polylin / transformers "
                    f"{row['ratio']:.2f} (float32 errors {errors['polylin']:.1e} and "
                    f"{errors['transformers']:.1e})",
                    flush=True,
                )
    rows = report["rows"]
    for r in rows:
        if r["T"] == 4096 and r["pass"] == "forward+backward":
            report["goals"].append(goal(f"polylin / transformers, T 4096 fwd+bwd, {r['threads']} "
                                        "threads", r["ratio"], 0.5))  # fmt: skip
    for threads in args.threads:
        for mode in ("forward", "forward+backward"):
            mine = sorted((r["T"], r["polylin_s"] / r["T"]) for r in rows
                          if r["threads"] == threads and r["pass"] == mode)  # fmt: skip
            if len(mine) > 1:  # time per token, longest over shortest: 1 is linear
                growth = mine[-1][1] / mine[0][1]
                report["goals"].append(goal(
                    f"polylin time per token T {mine[-1][0]} / T {mine[0][0]}, {mode}, "
                    f"{threads} threads", growth, 1.5))  # fmt: skip
    return write_report(report, args.json)


if __name__ == "__main__":
    main()
