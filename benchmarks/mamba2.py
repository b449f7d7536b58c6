"""Mamba-2 on the CPU: polylin's layer against transformers' pure-PyTorch fallback.

    python benchmarks/mamba2.py [--lengths 1024 4096] [--threads 1 2] [--hidden 768]
                                [--repeats 5] [--json PATH]

``polylin.torch.Mamba2`` and transformers' ``Mamba2Mixer`` (its ``torch_forward``, what runs
without the CUDA kernels of ``mamba_ssm``) with the same weights (the layers share their
parameter names; the polylin layer's state dict is loaded into transformers'), checked equal
first. PyTorch CPU, float32, batch 1, ``head_dim`` 64, ``state_size`` 128, ``expand`` 2 (so
``2 hidden / 64`` heads), one group, each layer at its own default chunk size (polylin 64,
transformers 256, ``--chunk``); forward under ``torch.no_grad`` and
forward+backward (``sum().backward()`` to the input and every parameter), calls interleaved,
median of ``--repeats``. The ratio is polylin's time over transformers'.
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

from benchmarks.timing import interleaved_times, run_metadata, write_report  # noqa: E402
from polylin.torch import Mamba2  # noqa: E402

HEAD_DIM, STATE_SIZE, CHUNK = 64, 128, 256  # CHUNK: transformers' default chunk_size


def layers(
    hidden: int, *, head_dim: int = HEAD_DIM, state_size: int = STATE_SIZE, chunk: int = CHUNK
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """polylin's Mamba-2 layer (its default chunk size) and transformers' ``Mamba2Mixer``
    (``chunk_size=chunk``) with the same weights."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    heads = 2 * hidden // head_dim
    torch.manual_seed(0)
    ours = Mamba2(hidden_size=hidden, head_dim=head_dim, state_size=state_size)
    config = Mamba2Config(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim, state_size=state_size,
        n_groups=1, expand=2, chunk_size=chunk, num_hidden_layers=1,
    )  # fmt: skip
    theirs = Mamba2Mixer(config, layer_idx=0)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def check(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor) -> float:
    """The largest difference of the two layers' outputs on ``x``; raises above float32
    round-off."""
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    return float((a - b).abs().max())


def calls(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[Any], Any]]:
    def forward(_: Any) -> Any:
        with torch.no_grad():
            return layer(x)

    def forward_backward(_: Any) -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    return {"forward": forward, "forward+backward": forward_backward}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--state-size", type=int, default=STATE_SIZE)
    parser.add_argument("--chunk", type=int, default=CHUNK, help="transformers' chunk_size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "metadata": run_metadata("python benchmarks/mamba2.py", hidden=args.hidden),
        "rows": [],
        "goals": [],
    }
    ours, theirs = layers(args.hidden, head_dim=args.head_dim, state_size=args.state_size,
                          chunk=args.chunk)  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        for length in args.lengths:
            x = torch.randn(1, length, args.hidden, generator=torch.Generator().manual_seed(1))
            x.requires_grad_(True)
            diff = check(ours, theirs, x)
            mine, peer = calls(ours, x), calls(theirs, x)
            for mode in mine:
                times = interleaved_times([mine[mode], peer[mode]], args.repeats)
                (t_ours, _), (t_peer, _) = times
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
    return write_report(report, args.json)


if __name__ == "__main__":
    main()
