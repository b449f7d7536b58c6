"""RG-LRU (RecurrentGemma) on the CPU: polylin against transformers' PyTorch code.

    python benchmarks/rg_lru.py [--lengths 1024 4096 16384] [--threads 1 2] [--width 512]
                                [--heads 8] [--repeats 3] [--json PATH]

transformers' ``RecurrentGemmaRglru`` layer as it is (its gates, then ``_rnn_scan``: one Python
step per token over ``(batch, lru_width)``) and the same layer converted by
:func:`polylin.compat.transformers.use_polylin` (the same gates, then :func:`polylin.rg_lru`,
the chunked scan), on the same inputs, checked equal first. PyTorch CPU, float32, batch 1,
``lru_width`` 512 in 8 heads, random parameters, a reset at position 0; forward under
``torch.no_grad`` and forward+backward (``sum().backward()`` to the input and every
parameter), calls interleaved, median of ``--repeats``. The ratio is polylin's time over
transformers'; the goal is at most 0.5 at T = 4096, forward+backward. transformers' loop
writes each token's state into a slice of its output (``contextualized_states[:, t] = ...``),
and the backward of each slice assignment handles the whole output: its forward+backward is
quadratic in T, and is timed up to ``--peer-max-length`` only.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.timing import goal, interleaved_times, run_metadata, write_report  # noqa: E402
from polylin.compat.transformers import use_polylin  # noqa: E402


def layers(width: int, heads: int, *, seed: int = 0) -> tuple[Any, Any]:
    """transformers' ``RecurrentGemmaRglru`` with random parameters, and a converted copy."""
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    torch.manual_seed(seed)
    config = RecurrentGemmaConfig(lru_width=width, num_attention_heads=heads, hidden_size=width)
    layer = RecurrentGemmaRglru(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) / (width // heads) ** 0.5)
    return layer, use_polylin(copy.deepcopy(layer))


def run(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """One call of the layer from an empty state (as in training)."""
    layer.recurrent_states = None
    positions = torch.arange(x.shape[1])[None]
    return layer(x, positions)


def check(theirs: Any, ours: Any, x: torch.Tensor) -> float:
    """The largest difference of the two outputs; raises above float32 round-off."""
    with torch.no_grad():
        y, y_ref = run(ours, x), run(theirs, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    return float((y - y_ref).abs().max())


def calls(layer: Any, x: torch.Tensor) -> dict[str, Callable[[Any], Any]]:
    def forward(_: Any) -> Any:
        with torch.no_grad():
            return run(layer, x)

    def forward_backward(_: Any) -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        run(layer, x).sum().backward()

    return {"forward": forward, "forward+backward": forward_backward}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
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
        "metadata": run_metadata("python benchmarks/rg_lru.py", width=args.width, heads=args.heads),
        "rows": [],
        "goals": [],
    }
    theirs, ours = layers(args.width, args.heads)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for length in args.lengths:
            x = torch.randn(1, length, args.width, generator=torch.Generator().manual_seed(1))
            x.requires_grad_(True)
            diff = check(theirs, ours, x)
            mine, peer = calls(ours, x), calls(theirs, x)
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
