"""The chunked forward of linear attention: gates, threads, fla's naive form and polylin 0.1.0.

    python benchmarks/forward.py [--lengths 1024 4096 16384] [--threads 1 2] [--repeats 5]
                                 [--json PATH]

PyTorch CPU, float32, batch x heads = 2 x 4, d = 64, under ``torch.no_grad``, for each number of
threads (``torch.set_num_threads``) and length, calls interleaved and each one checked against
polylin first:

- ``undecayed``: ``causal_linear_attention(q, k, v, feature_map=identity, normalize=False)``;
- ``scalar``: the same with a scalar gate per token, ``log_decay`` ``(B, H, T, 1)`` in
  ``(-0.1, 0]``;
- ``channel``: a gate per channel, ``(B, H, T, d)``;
- ``channel floor``: the per-channel call with its intra-chunk scores factored over the whole
  chunk, ``((Q * exp(b)) (K * exp(-b))^T)`` masked (``b`` the in-chunk cumulative log decay):
  one matmul and no levels, the least elementwise work any factored form does. Not a usable
  form (``exp(-b)`` overflows once a chunk's log decay passes -88 in float32, and loses
  precision long before); it bounds what a per-channel gate can cost in eager PyTorch;
- ``fla naive``: flash-linear-attention's pure-PyTorch ``naive_chunk_simple_gla`` (its
  ``(B, T, H, d)`` layout, ``scale=1``), the scalar-gated peer;
- ``default`` and ``0.1.0 default``: ``causal_linear_attention(q, k, v)`` (``elu + 1``,
  normalized) of this checkout and of polylin 0.1.0 (commit 3dd6957, extracted with
  ``git archive`` into a temporary folder and imported as ``polylin_010``; skipped outside a
  git checkout).

Ratios are of medians in the same run: ``scalar / fla naive``, ``channel / undecayed``,
``default / 0.1.0 default`` (the goals), ``channel floor / undecayed`` (the bound of the
second), and the time per token as the threads grow.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.baselines import fla_naive  # noqa: E402
from benchmarks.timing import goal, interleaved_times, run_metadata, write_report  # noqa: E402
from polylin import causal_linear_attention  # noqa: E402
from polylin._forms.linear import chunked as _chunked  # noqa: E402
from polylin.feature_maps import identity  # noqa: E402

#: polylin 0.1.0, the release the undecayed forward must not regress from.
RELEASE_0_1_0 = "3dd6957"

#: The goals of the performance issue: (numerator, denominator, limit).
GOALS = [("scalar", "fla naive", 1.0), ("channel", "undecayed", 1.5), ("default", "0.1.0", 1.0)]


def load_release(folder: Path) -> Any | None:
    """polylin 0.1.0's package from this checkout's history, imported as ``polylin_010``."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", RELEASE_0_1_0, "polylin"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    (folder / "polylin").rename(folder / "polylin_010")
    sys.path.insert(0, str(folder))
    return importlib.import_module("polylin_010")


def _factored_channel_gate(
    xp: Any, Q: Any, K: Any, G: Any, scale: float = 1.0
) -> tuple[Any, Any, Any, Any]:
    """The per-channel ``_channel_gate`` of ``polylin._forms.linear.chunked`` factored over the
    whole chunk (``channel floor``); ``scale`` multiplies the queries, not the scores."""
    b = torch.cumsum(G, dim=-2)
    whole = torch.exp(b[..., -1:, :])
    queries, keys = Q * torch.exp(b), K * torch.exp(-b)  # the two exponentials it needs
    scores = torch.tril(queries @ keys.transpose(-1, -2))
    return scores, (queries if scale == 1.0 else queries * scale), keys * whole, whole


@contextlib.contextmanager
def factored_channel_gate() -> Iterator[None]:
    """polylin's chunked form with :func:`_factored_channel_gate` for its per-channel scores."""
    levels = _chunked._channel_gate
    _chunked._channel_gate = _factored_channel_gate
    try:
        yield
    finally:
        _chunked._channel_gate = levels


def channel_floor(q: Any, k: Any, v: Any, log_decay: Any) -> Any:
    with factored_channel_gate():
        return causal_linear_attention(
            q, k, v, feature_map=identity, normalize=False, log_decay=log_decay
        )


def cases(length: int, old: Any | None) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    B, H, D = 2, 4, 64
    q, k, v = (torch.randn(B, H, length, D, generator=g) * 0.5 for _ in range(3))
    scalar = -0.1 * torch.rand(B, H, length, 1, generator=g)
    channel = -0.1 * torch.rand(B, H, length, D, generator=g)
    fla_layout = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    fla_gate = scalar[..., 0].transpose(1, 2).contiguous()
    naive = fla_naive("simple_gla").naive_chunk_simple_gla
    plain = {"feature_map": identity, "normalize": False}
    out: dict[str, Callable[[], torch.Tensor]] = {
        "undecayed": lambda: causal_linear_attention(q, k, v, **plain),
        "scalar": lambda: causal_linear_attention(q, k, v, log_decay=scalar, **plain),
        "channel": lambda: causal_linear_attention(q, k, v, log_decay=channel, **plain),
        "channel floor": lambda: channel_floor(q, k, v, channel),
        "fla naive": lambda: naive(*fla_layout, fla_gate, scale=1.0)[0].transpose(1, 2),
        "default": lambda: causal_linear_attention(q, k, v),
    }
    if old is not None:
        out["0.1.0"] = lambda: old.causal_linear_attention(q, k, v)
    return out


def check(calls: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Each peer computes what the polylin call it is compared with computes."""
    with torch.no_grad():
        pairs = [("fla naive", "scalar"), ("channel floor", "channel"), ("0.1.0", "default")]
        for peer, ours in pairs:
            if peer in calls:
                torch.testing.assert_close(calls[peer](), calls[ours](), rtol=1e-4, atol=1e-4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "metadata": run_metadata("python benchmarks/forward.py", release=RELEASE_0_1_0),
        "rows": [],
        "goals": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        old = load_release(Path(folder))
        for threads in args.threads:
            torch.set_num_threads(threads)
            for length in args.lengths:
                calls = cases(length, old)
                check(calls)
                with torch.no_grad():
                    times = interleaved_times(
                        [lambda _, f=f: f() for f in calls.values()], args.repeats
                    )
                row = {"threads": threads, "T": length}
                row.update({name: med for name, (med, _) in zip(calls, times)})
                report["rows"].append(row)
                print_row(row)
    for row in report["rows"]:
        for num, den, limit in GOALS:
            if den in row:
                name = f"{num} / {den}, T={row['T']}, {row['threads']} threads"
                report["goals"].append(goal(name, row[num] / row[den], limit))
        row["channel floor / undecayed"] = row["channel floor"] / row["undecayed"]
        print(
            f"threads {row['threads']} T {row['T']:>6}: channel floor / undecayed "
            f"{row['channel floor / undecayed']:.2f}"
        )
    return write_report(report, args.json)


def print_row(row: dict[str, Any]) -> None:
    times = "  ".join(
        f"{name} {row[name] * 1e3:.1f}" for name in row if name not in ("threads", "T")
    )
    print(f"threads {row['threads']} T {row['T']:>6}: {times} (ms)", flush=True)


if __name__ == "__main__":
    main()
