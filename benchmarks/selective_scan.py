"""The selective scan (Mamba-1) on the CPU: polylin against transformers' PyTorch fallback.

    python benchmarks/selective_scan.py [--lengths 1024 4096 16384] [--threads 1 2]
                                        [--channels 256] [--state-size 16] [--repeats 3]
                                        [--json PATH]

:func:`polylin.selective_scan` (its default ``method="chunked"``) and transformers'
``mamba_selective_scan`` (the code ``MambaMixer.slow_forward`` runs without mamba_ssm's CUDA
kernels: one Python step per token over ``(batch, D, N)``) on the same inputs, in
transformers' layout ``(batch, D, T)`` (polylin reads them through transposed views), checked
equal first. PyTorch CPU, float32, batch 1, D = 256, N = 16, ``dt_softplus`` with a bias,
the skip ``D`` and the gate ``z``, the final state returned; forward under ``torch.no_grad`` and
forward+backward (``sum().backward()`` to every input), calls interleaved, median of
``--repeats``. The ratio is polylin's time over transformers'; the goal is at most 0.5 at
T = 4096, forward+backward. transformers' backward slices its ``(batch, D, T, N)`` arrays once
per token, and each slice's gradient is a zero-filled array of that whole size: its
forward+backward is quadratic in T, and is timed up to ``--peer-max-length`` only (polylin's
alone above it, to show that polylin's is linear).
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
from polylin import selective_scan  # noqa: E402


def inputs(
    length: int, channels: int, state_size: int, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Mamba-1's arguments in transformers' layout, each a leaf that requires its gradient."""
    g = torch.Generator().manual_seed(seed)
    arrays = {
        "x": torch.randn(1, channels, length, generator=g),
        "dt": torch.randn(1, channels, length, generator=g) - 2.0,
        "A": -torch.exp(torch.randn(channels, state_size, generator=g)),
        "B": torch.randn(1, state_size, length, generator=g),
        "C": torch.randn(1, state_size, length, generator=g),
        "D": torch.randn(channels, generator=g),
        "z": torch.randn(1, channels, length, generator=g),
        "dt_bias": 0.1 * torch.randn(channels, generator=g),
    }
    return {name: a.requires_grad_(True) for name, a in arrays.items()}


def ours(a: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """polylin's selective scan on transformers' layout; ``(y (batch, D, T), state)``."""
    y, state = selective_scan(
        a["x"].mT, a["dt"].mT, a["A"], a["B"].mT, a["C"].mT, D=a["D"], z=a["z"].mT,
        dt_bias=a["dt_bias"], dt_softplus=True, return_state=True,
    )  # fmt: skip
    return y.mT, state


def theirs(a: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``mamba_selective_scan`` (its sequential fallback)."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    return mamba_selective_scan(
        a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"], delta_bias=a["dt_bias"],
        delta_softplus=True, return_last_state=True,
    )  # fmt: skip


def check(a: dict[str, torch.Tensor]) -> float:
    """The largest difference of the two outputs; raises above float32 round-off."""
    with torch.no_grad():
        (y, h), (y_ref, h_ref) = ours(a), theirs(a)
    torch.testing.assert_close(y, y_ref, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(h, h_ref, rtol=1e-3, atol=1e-4)
    return float((y - y_ref).abs().max())


def calls(fn: Callable[..., Any], a: dict[str, torch.Tensor]) -> dict[str, Callable[[Any], Any]]:
    def forward(_: Any) -> Any:
        with torch.no_grad():
            return fn(a)

    def forward_backward(_: Any) -> None:
        for t in a.values():
            t.grad = None
        fn(a)[0].sum().backward()

    return {"forward": forward, "forward+backward": forward_backward}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--state-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--peer-max-length",
        type=int,
        default=4096,
        help="time transformers' forward+backward up to this T (it is quadratic in T)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "metadata": run_metadata(
            "python benchmarks/selective_scan.py",
            channels=args.channels,
            state_size=args.state_size,
        ),
        "rows": [],
        "goals": [],
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        for length in args.lengths:
            a = inputs(length, args.channels, args.state_size)
            diff = check(a)
            mine, peer = calls(ours, a), calls(theirs, a)
            for mode in mine:
                if mode == "forward+backward" and length > args.peer_max_length:
                    ((t_ours, _),) = interleaved_times([mine[mode]], args.repeats)
                    t_peer = float("nan")
                else:
                    pair = [mine[mode], peer[mode]]
                    (t_ours, _), (t_peer, _) = interleaved_times(pair, args.repeats)
                row = {
                    "threads": threads, "T": length, "pass": mode, "polylin_s": t_ours,
                    "transformers_s": t_peer, "ratio": t_ours / t_peer, "max_diff": diff,
                }  # fmt: skip
                report["rows"].append(row)
                print(
                    f"threads {threads} T {length:>6} {mode:<16}: polylin {t_ours * 1e3:.1f} ms, "
                    f"transformers {t_peer * 1e3:.1f} ms, polylin / transformers "
                    f"{row['ratio']:.2f} (outputs within {diff:.1e})",
                    flush=True,
                )
                if length == 4096 and mode == "forward+backward":
                    name = f"T=4096 fwd+bwd, {threads} threads, polylin / transformers"
                    report["goals"].append(goal(name, row["ratio"], 0.5))
    return write_report(report, args.json)


if __name__ == "__main__":
    main()
