"""Benchmark of the generalized delta rule (RWKV-7) on PyTorch CPU: ratios measured in one run.

    python benchmarks/dplr.py [--repeats 3] [--threads N] [--chunk-size C] [--peer-lengths 4096]
                              [--json out.json]

float32, batch x heads = 8, d_k = d_v = 64, RWKV-7's inputs (``a = -kk``, ``b = kk * a_lr``,
per-channel log decays ``-exp(w)`` with decays in ``(exp(-exp(0.5)), 1)``). Reported, each as a
ratio of medians of calls timed in alternation in the same run, on three clocks (wall, user CPU
time, user + system CPU time of the process; see ``benchmarks/delta_rule.py``):

- forward at each of ``--peer-lengths``: polylin chunked / flash-linear-attention's pure-PyTorch
  ``dplr_chunkwise`` (its ``naive.py``, chunk 32, loaded by file path; checked against polylin
  first);
- forward + backward (``out.sum().backward()``): polylin / fla's ``dplr_chunkwise`` at the same
  lengths, and polylin's time(16k) / time(4k) (4.0 is linear in T);
- forward at T = 4096: the DPLR chunked form / the gated delta rule's chunked form on the same
  inputs (the DPLR call given the substitution that makes it the gated delta rule: keys
  ``beta k``, ``a = k``, ``b = -beta exp(g) k``, so both compute the same function), and with
  RWKV-7's per-channel decays.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.baselines import fla_naive  # noqa: E402
from benchmarks.delta_rule import CLOCKS, interleaved  # noqa: E402
from benchmarks.timing import run_metadata  # noqa: E402
from polylin import delta_rule_attention, dplr_delta_rule  # noqa: E402

BATCH, HEADS, D = 2, 4, 64
FLA_CHUNK = 32


def fla_dplr_chunkwise() -> Any:
    """fla's ``dplr_chunkwise`` (``fla/ops/generalized_delta_rule/dplr/naive.py``); ``None``
    without fla-core."""
    try:
        return fla_naive("generalized_delta_rule/dplr").dplr_chunkwise
    except ImportError:
        return None


def rwkv7_inputs(length: int, *, grad: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, length, D)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    kk = torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)
    a_lr = torch.rand(*shape, generator=g)
    log_decay = -torch.exp(torch.rand(*shape, generator=g) * 6.5 - 6.0)
    x = {"q": q, "k": k, "v": v, "a": -kk, "b": kk * a_lr, "log_decay": log_decay}
    if grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


def delta_inputs(length: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, length)
    q = torch.randn(*shape, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(*shape, D, generator=g), dim=-1)
    v = torch.randn(*shape, D, generator=g)
    beta = torch.sigmoid(torch.randn(*shape, 1, generator=g))
    log_decay = -torch.nn.functional.softplus(torch.randn(*shape, 1, generator=g)) / 16
    return {"q": q, "k": k, "v": v, "beta": beta, "log_decay": log_decay}


def polylin_call(x: dict[str, torch.Tensor], chunk: dict[str, int]) -> torch.Tensor:
    return dplr_delta_rule(
        x["q"], x["k"], x["v"], x["a"], x["b"], log_decay=x["log_decay"], **chunk
    )


def fla_call(fla: Any, x: dict[str, torch.Tensor]) -> torch.Tensor:
    # fla scales q by d_k ** -0.5 itself: undo it so both compute the same function.
    out, _ = fla(
        x["q"] * D**0.5, x["k"], x["v"], x["a"], x["b"], x["log_decay"], chunk_size=FLA_CHUNK
    )
    return out


def check_peer(fla: Any, chunk: dict[str, int]) -> float:
    """The largest difference between fla's chunkwise form and polylin's, relative to the
    largest output (T = 256): the peer computes the same function."""
    x = rwkv7_inputs(256, seed=3)
    with torch.no_grad():
        ours, theirs = polylin_call(x, chunk), fla_call(fla, x)
    error = float((ours - theirs).abs().max() / ours.abs().max())
    if not error < 1e-4:
        raise AssertionError(f"fla's dplr_chunkwise differs from polylin: {error:.2e}")
    return error


def forward_vs_peer(fla: Any, lengths: list[int], repeats: int, chunk: dict) -> dict:
    times = {}
    for length in lengths:
        x = rwkv7_inputs(length)
        with torch.no_grad():
            calls = {f"polylin_fwd_{length}": lambda x=x: polylin_call(x, chunk)}
            if fla is not None:
                calls[f"fla_fwd_{length}"] = lambda x=x: fla_call(fla, x)
            times.update(interleaved(calls, repeats))
    return times


def forward_backward(fla: Any, peer_lengths: list[int], repeats: int, chunk: dict) -> dict:
    times = {}
    for length in sorted({4096, 16384, *peer_lengths}):
        x = rwkv7_inputs(length, grad=True)

        def ours(x: dict[str, torch.Tensor] = x) -> None:
            polylin_call(x, chunk).sum().backward()
            for t in x.values():
                t.grad = None

        calls = {f"polylin_fwd_bwd_{length}": ours}
        if fla is not None and length in peer_lengths:

            def theirs(x: dict[str, torch.Tensor] = x) -> None:
                fla_call(fla, x).sum().backward()
                for t in x.values():
                    t.grad = None

            calls[f"fla_fwd_bwd_{length}"] = theirs
        times.update(interleaved(calls, repeats))
    return times


def versus_gated_delta(repeats: int, chunk: dict) -> dict:
    """The DPLR chunked forward against the gated delta rule's on the same inputs (T = 4096)."""
    x = delta_inputs(4096)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["log_decay"]
    keys, a, b = beta * k, k, -beta * torch.exp(g) * k
    r = rwkv7_inputs(4096)
    with torch.no_grad():
        same = float(
            (
                dplr_delta_rule(q, keys, v, a, b, log_decay=g, **chunk)
                - delta_rule_attention(q, k, v, beta, log_decay=g, **chunk)
            )
            .abs()
            .max()
        )
        assert same < 1e-3, same
        return interleaved(
            {
                "gated_delta_chunked": lambda: delta_rule_attention(
                    q, k, v, beta, log_decay=g, **chunk
                ),
                "dplr_as_gated_delta": lambda: dplr_delta_rule(
                    q, keys, v, a, b, log_decay=g, **chunk
                ),
                "dplr_rwkv7": lambda: polylin_call(r, chunk),
            },
            repeats,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--chunk-size", type=int, default=None, help="polylin's chunk size")
    parser.add_argument(
        "--peer-lengths", type=int, nargs="*", default=[4096, 16384], help="T against fla"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    fla = fla_dplr_chunkwise()
    peer_error = None if fla is None else check_peer(fla, chunk)
    times = {
        **forward_vs_peer(fla, args.peer_lengths, args.repeats, chunk),
        **forward_backward(fla, args.peer_lengths, args.repeats, chunk),
        **versus_gated_delta(args.repeats, chunk),
    }
    pairs = {}
    for length in args.peer_lengths:
        pairs[f"polylin / fla chunkwise (forward, T={length})"] = (
            f"polylin_fwd_{length}",
            f"fla_fwd_{length}",
        )
        pairs[f"polylin / fla chunkwise (fwd+bwd, T={length})"] = (
            f"polylin_fwd_bwd_{length}",
            f"fla_fwd_bwd_{length}",
        )
    pairs["fwd+bwd time(16k) / time(4k) (polylin chunked)"] = (
        "polylin_fwd_bwd_16384",
        "polylin_fwd_bwd_4096",
    )
    pairs["DPLR as gated delta / gated delta (forward, T=4096)"] = (
        "dplr_as_gated_delta",
        "gated_delta_chunked",
    )
    pairs["DPLR RWKV-7 decays / gated delta (forward, T=4096)"] = (
        "dplr_rwkv7",
        "gated_delta_chunked",
    )
    ratios = {
        name: {c: times[a][c] / times[b][c] for c in CLOCKS}
        for name, (a, b) in pairs.items()
        if a in times and b in times
    }
    meta = run_metadata(
        " ".join(sys.argv),
        shape=f"batch {BATCH} x heads {HEADS}, d_k = d_v = {D}, float32",
        chunk_size=args.chunk_size
        or inspect.signature(dplr_delta_rule).parameters["chunk_size"].default,
        fla_chunk=FLA_CHUNK,
        fla_vs_polylin_max_relative_difference=peer_error,
        repeats=args.repeats,
    )
    print(f"{'ratio of medians':56s} " + " ".join(f"{c:>7s}" for c in CLOCKS))
    for name, value in ratios.items():
        print(f"{name:56s} " + " ".join(f"{value[c]:7.2f}" for c in CLOCKS))
    print(
        f"(polylin chunk {meta['chunk_size']}, {meta['torch_threads']} threads, load average "
        f"{meta['load_average_start'][0]:.1f}, fla checked: {peer_error})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "seconds": times, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
