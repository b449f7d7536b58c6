"""Benchmark of the delta rule on PyTorch CPU: ratios measured in one run.

    python benchmarks/delta_rule.py [--repeats 5] [--threads N] [--chunk-size C]
        [--peers [T:d[:kinds] ...]] [--memory] [--json out.json]

float32, batch x heads = 8, d_k = d_v = 64, unit keys, per-token beta (and per-token decay for
the gated rule). Reported, each as a ratio of medians measured in the same run (absolute times
on a shared machine are noise; the implementations being compared are timed in alternation):

- forward at T = 4096: recurrent / chunked (the parallel form's speed-up), and the same ratio
  for ``causal_linear_attention`` (its per-token loop against its chunked form: what a chunked
  form costing as much as plain linear attention's can reach against a per-token loop);
- forward at T = 4096: delta chunked / ``causal_linear_attention`` chunked (the price of the
  delta rule over plain linear attention), ungated and gated;
- forward + backward (``out.sum().backward()``) of the chunked form: time(16k) / time(4k)
  (4.0 is linear in T), for the scalar gate and the per-channel gate (KDA);
- forward at T = 4096: KDA chunked / scalar-gated chunked (the price of one gate per channel);
- ``--peers``: forward and forward + backward beside the pure-PyTorch chunked forms that models
  ship (transformers' ``torch_chunk_gated_delta_rule`` and ``chunk_kimi_delta_attention``,
  flash-linear-attention's ``naive_chunk_gated_delta_rule`` and ``naive_chunk_kda``), each
  first checked against polylin on small inputs, at the sizes given (default
  :data:`PEER_SIZES`);
- ``--memory``: peak resident memory of a forward + backward with grouped heads (G = 4: q and
  k of ``(B, H, 1, T, d)``) against the same call with q and k repeated to ``(B, H, 4, T, d)``.

Three clocks per call: wall, user CPU time and user + system CPU time of the process
(``getrusage``). On a machine shared with other jobs, waiting for a core does not count on the CPU
clocks; with ``--threads 1`` they are the work done. System time is mostly page faults of
freshly allocated memory.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.baselines import fla_naive  # noqa: E402
from benchmarks.timing import run_metadata  # noqa: E402
from polylin import causal_linear_attention, delta_rule_attention  # noqa: E402

BATCH, HEADS, D = 2, 4, 64


def inputs(
    length: int, *, grad: bool = False, seed: int = 0, d: int = D
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, length)
    q = torch.randn(*shape, d, generator=g)
    k = torch.nn.functional.normalize(torch.randn(*shape, d, generator=g), dim=-1)
    v = torch.randn(*shape, d, generator=g)
    beta = torch.sigmoid(torch.randn(*shape, 1, generator=g))
    log_decay = -torch.nn.functional.softplus(torch.randn(*shape, 1, generator=g)) / 16
    channels = -torch.nn.functional.softplus(torch.randn(*shape, d, generator=g)) / 16
    out = {"q": q, "k": k, "v": v, "beta": beta, "log_decay": log_decay, "channels": channels}
    if grad:
        for x in out.values():
            x.requires_grad_(True)
    return out


CLOCKS = ("wall", "user", "cpu")


def _now() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall": time.perf_counter(),
        "user": usage.ru_utime,
        "cpu": usage.ru_utime + usage.ru_stime,
    }


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict]:
    """Median seconds per call on each clock, the calls timed in alternation, each right after
    an untimed call of its own (its steady state, whatever the call before it allocated)."""
    for fn in calls.values():
        fn()
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CLOCKS} for n in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            fn()  # untimed: the memory the call before released is mapped again here
            start = _now()
            fn()
            stop = _now()
            for c in CLOCKS:
                times[name][c].append(stop[c] - start[c])
    return {n: {c: statistics.median(t[c]) for c in CLOCKS} for n, t in times.items()}


def forward(repeats: int, chunk: dict[str, int]) -> dict[str, float]:
    x = inputs(4096)
    q, k, v, beta, g, gc = (x[n] for n in ("q", "k", "v", "beta", "log_decay", "channels"))
    with torch.no_grad():
        fast = interleaved(
            {
                "delta_chunked": lambda: delta_rule_attention(q, k, v, beta, **chunk),
                "gated_delta_chunked": lambda: delta_rule_attention(
                    q, k, v, beta, log_decay=g, **chunk
                ),
                "kda_chunked": lambda: delta_rule_attention(q, k, v, beta, log_decay=gc, **chunk),
                "linear_chunked": lambda: causal_linear_attention(q, k, v),
            },
            repeats,
        )
        # The per-token loops are slow: fewer repeats (at least 3), each loop timed beside one
        # more chunked call of its own function.
        slow = interleaved(
            {
                "delta_recurrent": lambda: delta_rule_attention(q, k, v, beta, method="recurrent"),
                "delta_chunked_again": lambda: delta_rule_attention(q, k, v, beta, **chunk),
                "linear_recurrent": lambda: causal_linear_attention(q, k, v, method="recurrent"),
                "linear_chunked_again": lambda: causal_linear_attention(q, k, v),
            },
            max(3, repeats // 2),
        )
    return {**fast, **slow}


def forward_backward(repeats: int, chunk: dict[str, int]) -> dict[str, float]:
    calls = {}
    for length in (4096, 16384):
        x = inputs(length, grad=True)
        for name, gate in (("gated_delta", "log_decay"), ("kda", "channels")):

            def step(x: dict[str, torch.Tensor] = x, gate: str = gate) -> None:
                out = delta_rule_attention(
                    x["q"], x["k"], x["v"], x["beta"], log_decay=x[gate], **chunk
                )
                out.sum().backward()
                for t in x.values():
                    t.grad = None

            calls[f"{name}_fwd_bwd_{length}"] = step
    return interleaved(calls, repeats)


def _transformers(model: str, name: str) -> Callable[..., Any]:
    """A pure-PyTorch function of transformers' model code (its own torch path: a hub or fla
    kernel it may be wrapped with needs Triton)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    fn = getattr(module, name)
    return getattr(fn, "__wrapped__", fn)


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, ...)`` -> ``(B, T, H, ...)``, contiguous (the peers' layout)."""
    return x.transpose(1, 2).contiguous()


def peer_calls() -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """The peers, each a function of polylin-layout ``(q, k, v, beta, g)`` in its own layout:
    ``{name: fn}`` and ``{name: why skipped}``. Names end in ``_gdn`` (scalar gate, ``g`` of
    ``(B, H, T, 1)``) or ``_kda`` (``g`` of ``(B, H, T, d)``); all use ``scale = d ** -0.5``."""
    found: dict[str, Callable[..., Any]] = {}
    skipped: dict[str, str] = {}
    loaders: dict[str, Callable[[], Callable[..., Any]]] = {
        "transformers_gdn": lambda: _transformers("qwen3_next", "torch_chunk_gated_delta_rule"),
        "transformers_kda": lambda: _transformers("kimi_linear", "chunk_kimi_delta_attention"),
        "fla_naive_gdn": lambda: fla_naive("gated_delta_rule").naive_chunk_gated_delta_rule,
        "fla_naive_kda": lambda: fla_naive("kda").naive_chunk_kda,
    }
    for name, load in loaders.items():
        try:
            fn = load()
        except ImportError as exc:
            skipped[name] = str(exc)
            continue
        found[name] = fn
    return found, skipped


def peer(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A peer as a function of ``(B, T, H, d)`` inputs, beta ``(B, T, H)`` and g ``(B, T, H)``
    or ``(B, T, H, d)``, returning ``(B, T, H, d_v)`` (every peer takes ``(q, k, v, g, beta)``
    and returns ``(out, state)``)."""
    return lambda q, k, v, beta, g: fn(q, k, v, g, beta, chunk_size=64)[0]


def peer_inputs(x: dict[str, torch.Tensor], kind: str) -> list[torch.Tensor]:
    """The peers' layout of polylin's inputs: ``(B, T, H, d)``, beta and a scalar g
    ``(B, T, H)``."""
    g = x["channels"] if kind == "kda" else x["log_decay"][..., 0]
    return [_bthd(t) for t in (x["q"], x["k"], x["v"], x["beta"][..., 0], g)]


def check_peer(name: str, fn: Callable[..., torch.Tensor], length: int = 128, d: int = D) -> float:
    """The largest difference between a peer and polylin (float32, unit keys; fla's KDA
    reference needs T a multiple of its chunk): round-off only, or an AssertionError."""
    x = inputs(length, seed=1, d=d)
    kind = name.rsplit("_", 1)[1]
    with torch.no_grad():
        theirs = fn(*peer_inputs(x, kind))
    q, k, v, beta = (x[n] for n in ("q", "k", "v", "beta"))
    g = x["channels"] if kind == "kda" else x["log_decay"]
    ours = delta_rule_attention(q, k, v, beta, log_decay=g, scale=d**-0.5)
    error = (theirs - _bthd(ours)).abs().max().item()
    if error > 1e-4:  # float32 round-off (outputs are of order 1)
        raise AssertionError(f"{name} differs from polylin by {error}")
    return error


#: The peers' sizes (``--peers T:d[:kinds]``): both gates at T = 4096, d = 64; the scalar gate
#: (GDN) also at T = 16384 and d = 128. The KDA peers take 11-100x polylin's time, which makes
#: them minutes per call at the larger sizes.
PEER_SIZES = ("4096:64", "16384:64:gdn", "4096:128:gdn")


def peer_size(spec: str) -> tuple[int, int, tuple[str, ...]]:
    """``"T:d"`` or ``"T:d:kind,kind"`` -> ``(T, d, kinds)`` (kinds ``gdn`` and ``kda``)."""
    length, d, *kinds = spec.split(":")
    return int(length), int(d), tuple(kinds[0].split(",")) if kinds else ("gdn", "kda")


def peers(
    repeats: int, length: int = 4096, d: int = D, kinds: tuple[str, ...] = ("gdn", "kda")
) -> dict[str, Any]:
    """Forward and forward + backward of polylin and each peer at ``length`` and ``d``
    (seconds)."""
    found, skipped = peer_calls()
    x = inputs(length, grad=True, d=d)
    calls: dict[str, Callable[[], object]] = {}
    checked = {}
    for kind, gate in (("gdn", "log_decay"), ("kda", "channels")):
        if kind not in kinds:
            continue
        ours = [x[n] for n in ("q", "k", "v", "beta", gate)]
        candidates = {f"polylin_{kind}": (lambda *a: delta_rule_attention(
            a[0], a[1], a[2], a[3], log_decay=a[4], scale=d**-0.5), ours)}  # fmt: skip
        for name, fn in found.items():
            if name.endswith(kind):
                wrapped = peer(fn)
                checked[name] = check_peer(name, wrapped, d=d)
                theirs = [t.detach().requires_grad_(True) for t in peer_inputs(x, kind)]
                candidates[name] = (wrapped, theirs)
        for name, (fn, args) in candidates.items():

            def fwd(fn: Callable[..., Any] = fn, args: list = args) -> None:
                with torch.no_grad():
                    fn(*args)

            def fwd_bwd(fn: Callable[..., Any] = fn, args: list = args) -> None:
                fn(*args).sum().backward()
                for t in args:
                    t.grad = None

            calls[f"{name}_fwd"] = fwd
            calls[f"{name}_fwd_bwd"] = fwd_bwd
    return {"seconds": interleaved(calls, repeats), "skipped": skipped, "errors": checked}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(layout: str, length: int) -> None:
    """One forward + backward of grouped heads (G = 4), q and k shared (``grouped``) or
    repeated per value head (``repeated``); prints the peak resident set growth in bytes."""
    torch.manual_seed(0)
    groups = 4
    shape = (BATCH, HEADS, 1, length, D)
    q, k = torch.randn(shape), torch.nn.functional.normalize(torch.randn(shape), dim=-1)
    if layout == "repeated":
        q, k = (t.repeat(1, 1, groups, 1, 1) for t in (q, k))
    lead = (BATCH, HEADS, groups, length)
    v = torch.randn(*lead, D)
    beta = torch.sigmoid(torch.randn(*lead, 1))
    g = -torch.nn.functional.softplus(torch.randn(*lead, 1)) / 16
    xs = [t.requires_grad_(True) for t in (q, k, v, beta, g)]

    # What autograd keeps for the backward (unique storages, the inputs excluded): exact and
    # repeatable. The resident-set peak of a call after a warm-up moves with the allocator's
    # reuse of freed memory, so the first call is measured, from the process's own baseline.
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark (Linux)
    base = _status_kib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = delta_rule_attention(*xs[:4], log_decay=xs[4])
    out.sum().backward()
    peak = (_status_kib("VmHWM") - base) * 1024
    inputs = {t.untyped_storage().data_ptr() for t in xs}
    print(peak, sum(n for ptr, n in saved.items() if ptr not in inputs))


def peak_memory(length: int = 4096) -> dict[str, float]:
    """Peak resident memory (MiB) of a grouped call and of the same call with q, k repeated."""
    import subprocess

    out: dict[str, float] = {}
    root = str(Path(__file__).resolve().parents[1])  # this checkout's polylin, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for layout in ("grouped", "repeated"):
        done = subprocess.run(
            [sys.executable, __file__, "--memory-child", layout, str(length)],
            capture_output=True, text=True, check=True, env=env,
        )  # fmt: skip
        peak, saved = (int(n) for n in done.stdout.split()[-2:])
        out[f"{layout}_MiB"] = round(peak / 2**20, 1)
        out[f"{layout}_saved_MiB"] = round(saved / 2**20, 1)
    out["grouped_over_repeated"] = round(out["grouped_MiB"] / out["repeated_MiB"], 3)
    out["saved_grouped_over_repeated"] = round(
        out["grouped_saved_MiB"] / out["repeated_saved_MiB"], 3
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="of the delta rule (default: the library's; one CPU thread runs chunks of at most 32 "
        "for keys of up to 128 channels, whatever is asked)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        metavar="T:d[:kinds]",
        default=None,
        help=f"time the peers (no size given: {' '.join(PEER_SIZES)})",
    )
    parser.add_argument("--memory", action="store_true", help="grouped vs repeated peak memory")
    parser.add_argument("--memory-child", nargs=2, metavar=("LAYOUT", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child[0], int(args.memory_child[1]))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    times = {**forward(args.repeats, chunk), **forward_backward(args.repeats, chunk)}
    pairs = {
        "recurrent / chunked (forward, T=4096)": ("delta_recurrent", "delta_chunked_again"),
        "linear attention: recurrent / chunked (forward)": (
            "linear_recurrent",
            "linear_chunked_again",
        ),
        "delta chunked / linear chunked (forward, T=4096)": ("delta_chunked", "linear_chunked"),
        "gated delta chunked / linear chunked (forward, T=4096)": (
            "gated_delta_chunked",
            "linear_chunked",
        ),
        "KDA chunked / gated delta chunked (forward, T=4096)": (
            "kda_chunked",
            "gated_delta_chunked",
        ),
        "fwd+bwd time(16k) / time(4k) (gated, chunked)": (
            "gated_delta_fwd_bwd_16384",
            "gated_delta_fwd_bwd_4096",
        ),
        "fwd+bwd time(16k) / time(4k) (KDA, chunked)": ("kda_fwd_bwd_16384", "kda_fwd_bwd_4096"),
    }
    extra: dict[str, Any] = {}
    if args.peers is not None:
        extra["peers"] = {}
        for spec in args.peers or PEER_SIZES:
            length, d, kinds = peer_size(spec)
            result = peers(args.repeats, length, d, kinds)
            at = f"T={length}, d={d}"
            times.update({f"{name} ({at})": t for name, t in result["seconds"].items()})
            extra["peers"][at] = {"skipped": result["skipped"], "max_error": result["errors"]}
            for name in result["errors"]:
                kind = name.rsplit("_", 1)[1]
                for mode in ("fwd", "fwd_bwd"):
                    pairs[f"polylin / {name} ({mode.replace('_', '+')}, {at})"] = (
                        f"polylin_{kind}_{mode} ({at})",
                        f"{name}_{mode} ({at})",
                    )
    ratios = {
        name: {c: times[a][c] / times[b][c] for c in CLOCKS} for name, (a, b) in pairs.items()
    }
    if args.memory:
        extra["memory"] = peak_memory()
    meta = run_metadata(
        " ".join(sys.argv),
        shape=f"batch {BATCH} x heads {HEADS}, d_k = d_v = {D}, float32",
        chunk_size=args.chunk_size
        or inspect.signature(delta_rule_attention).parameters["chunk_size"].default,
        repeats=args.repeats,
    )
    print(f"{'ratio of medians':60s} " + " ".join(f"{c:>7s}" for c in CLOCKS))
    for name, value in ratios.items():
        print(f"{name:60s} " + " ".join(f"{value[c]:7.2f}" for c in CLOCKS))
    for name, value in extra.items():
        print(f"{name}: {json.dumps(value)}")
    print(
        f"(delta rule chunk {meta['chunk_size']}, {meta['torch_threads']} threads, "
        f"load average {meta['load_average_start'][0]:.1f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "seconds": times, "ratios": ratios, **extra}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
