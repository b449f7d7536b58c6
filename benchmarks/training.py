"""Training and decay benchmark (issues 12 and 14): forward+backward, peak memory, decay.

Not installed, not a test: run it and read the ratios. Every ratio compares timings taken in the
same run, interleaved (one repeat of each candidate in turn) and reduced to the minimum over the
repeats, which is the least disturbed by other load on a shared machine.

Usage::

    python benchmarks/training.py [--quick] [--threads N] [--json out.json] [--only SECTION ...]

Sections: ``torch`` (PyTorch CPU forward+backward vs a plain chunked form, T = 1k..16k (64k
without --quick), d = 64 and 128), ``memory`` (peak resident memory of forward+backward at
T = 65536, one head, d = 64, each candidate in a fresh process), ``jax`` (``jit(grad)`` vs the
forward at T = 16384), ``decay`` (scalar and per-channel decay vs the undecayed chunked forward
and vs the recurrent form at T = 4096, forward+backward with decay at 4k and 16k), ``peers``
(forward+backward beside fast-transformers' compiled causal product and flash-linear-attention's
chunk reference at T = 4k and 16k, where they are installed; not run by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH_HEADS = 8


def plain_chunked_torch(q, k, v, chunk=64, eps=1e-6):
    """The plain chunked form as a PyTorch user writes it: elu+1, per-chunk K^T V, cumsum,
    tril(Q K^T), a separate normalizer, autograd through all of it (T a multiple of chunk)."""
    import torch
    import torch.nn.functional as F

    b, T, d = q.shape
    n = T // chunk
    Q = (F.elu(q) + 1).reshape(b, n, chunk, d)
    K = (F.elu(k) + 1).reshape(b, n, chunk, d)
    V = v.reshape(b, n, chunk, v.shape[-1])
    kv = torch.cumsum(K.transpose(-1, -2) @ V, dim=1) - K.transpose(-1, -2) @ V  # exclusive
    z = torch.cumsum(K.sum(-2), dim=1) - K.sum(-2)
    scores = torch.tril(Q @ K.transpose(-1, -2))
    num = Q @ kv + scores @ V
    den = (Q * z[:, :, None, :]).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    return (num / (den + eps)).reshape(b, T, -1)


def polylin_torch_elu(q, k, v):
    """polylin's chunked form with the plain form's feature map (``F.elu(x) + 1``, one fused
    PyTorch op with its own backward) instead of ``elu_plus_one`` (an autograd function on
    PyTorch, with an exact ``exp``): the algorithm alone, compared on equal terms."""
    import torch.nn.functional as F

    from polylin import causal_linear_attention

    return causal_linear_attention(q, k, v, lambda x: F.elu(x) + 1)


def interleaved(candidates: dict, repeats: int, user: dict | None = None) -> dict:
    """Minimum seconds of each candidate, measured in turn ``repeats`` times after a warm-up.

    ``user``, if given, receives each candidate's minimum user CPU time: it leaves out the page
    faults of freshly mapped memory (system time), which depend on what the allocator kept from
    the calls before, not on the candidate (glibc maps arrays of 32 MiB and more afresh).
    """
    for f in candidates.values():
        f()
    best = dict.fromkeys(candidates, float("inf"))
    if user is not None:
        user.update(dict.fromkeys(candidates, float("inf")))
    for _ in range(repeats):
        for name, f in candidates.items():
            start, start_user = time.perf_counter(), _user_seconds()
            f()
            best[name] = min(best[name], time.perf_counter() - start)
            if user is not None:
                user[name] = min(user[name], _user_seconds() - start_user)
    return best


def _user_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def torch_training(lengths, dims, repeats):
    import torch

    from polylin import causal_linear_attention

    rows = []
    for d in dims:
        for T in lengths if d == dims[0] else [T for T in lengths if T <= 16384]:
            torch.manual_seed(0)
            q, k, v = (torch.randn(BATCH_HEADS, T, d, requires_grad=True) for _ in range(3))

            def fwd_bwd(fn, xs=(q, k, v)):
                def run():
                    fn(*xs).sum().backward()
                    for x in xs:
                        x.grad = None

                return run

            def fwd(fn, xs=(q, k, v)):
                def run():
                    with torch.no_grad():
                        fn(*xs)

                return run

            user: dict = {}
            t = interleaved(
                {
                    "polylin_fwd_bwd": fwd_bwd(causal_linear_attention),
                    "polylin_torch_elu_fwd_bwd": fwd_bwd(polylin_torch_elu),
                    "plain_fwd_bwd": fwd_bwd(plain_chunked_torch),
                    "polylin_fwd": fwd(causal_linear_attention),
                    "plain_fwd": fwd(plain_chunked_torch),
                },
                repeats if T <= 16384 else 1,
                user,
            )
            row = {"T": T, "d": d, **{k: round(s * 1e3, 2) for k, s in t.items()}}
            row["user_fwd_bwd"] = {k: round(user[k] * 1e3, 2) for k in t if "fwd_bwd" in k}
            row["fwd_bwd_ratio"] = round(t["polylin_fwd_bwd"] / t["plain_fwd_bwd"], 3)
            row["fwd_bwd_ratio_torch_elu"] = round(
                t["polylin_torch_elu_fwd_bwd"] / t["plain_fwd_bwd"], 3
            )
            row["fwd_ratio"] = round(t["polylin_fwd"] / t["plain_fwd"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    growth = _growth(rows, dims[0])
    print(json.dumps(growth), flush=True)
    return [*rows, growth]


def _growth(rows: list, d: int) -> dict:
    """time(16k) / time(4k) of each forward+backward, wall and user CPU time."""
    at = {row["T"]: row for row in rows if row["d"] == d}
    growth: dict = {"d": d}
    for name in ("polylin", "polylin_torch_elu", "plain"):
        key = f"{name}_fwd_bwd"
        growth[f"{name}_16k_over_4k"] = round(at[16384][key] / at[4096][key], 2)
        user = at[16384]["user_fwd_bwd"][key] / at[4096]["user_fwd_bwd"][key]
        growth[f"{name}_16k_over_4k_user"] = round(user, 2)
    return growth


def _memory_child(candidate: str, T: int) -> None:
    """Run one forward+backward and print the peak resident set growth (bytes)."""
    import torch

    from polylin import causal_linear_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, 64, requires_grad=True) for _ in range(3))
    fn = {"polylin": causal_linear_attention, "plain": plain_chunked_torch}[candidate]
    fn(q[:, :4096], k[:, :4096], v[:, :4096]).sum().backward()  # warm up the libraries
    q.grad = k.grad = v.grad = None
    # Reset the resident-set high-water mark (Linux): the peak then covers this call only.
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    fn(q, k, v).sum().backward()
    rss = (_status_kib("VmHWM") - base) * 1024
    # What autograd keeps for the backward (unique storages, the inputs excluded): exact and
    # repeatable, where the resident-set peak also moves with the allocator's reuse of freed
    # memory (+-10% between identical runs here).
    saved: dict[int, int] = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = fn(q, k, v)
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    del out
    print(rss, sum(n for ptr, n in saved.items() if ptr not in inputs))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory(T=65536):
    out = {"T": T, "d": 64, "batch_heads": 1}
    for candidate in ("polylin", "plain"):
        result = subprocess.run(
            [sys.executable, __file__, "--memory-child", candidate, str(T)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rss, saved = (int(n) for n in result.stdout.split()[-2:])
        out[f"{candidate}_MiB"] = round(rss / 2**20, 1)
        out[f"{candidate}_saved_MiB"] = round(saved / 2**20, 1)
    out["ratio"] = round(out["polylin_MiB"] / out["plain_MiB"], 3)
    out["saved_ratio"] = round(out["polylin_saved_MiB"] / out["plain_saved_MiB"], 3)
    print(json.dumps(out), flush=True)
    return out


def fast_transformers_causal(q, k, v, eps=1e-6):
    """fast-transformers' ``CausalLinearAttention`` on ``(b, T, d)``: ``elu + 1``, its compiled
    causal product (a C++ kernel with its own backward) and its normalizer."""
    import torch.nn.functional as F
    from fast_transformers.causal_product import causal_dot_product

    Q, K = F.elu(q) + 1, F.elu(k) + 1
    numerator = causal_dot_product(Q[:, None], K[:, None], v[:, None])[:, 0]  # (N, H, L, D)
    return numerator / ((Q * K.cumsum(1)).sum(-1, keepdim=True) + eps)


def fla_chunk_reference(q, k, v):
    """fla's ``naive_chunk_linear_attn`` (autograd, chunk 64) on ``(b, T, d)`` with ``elu + 1``
    and its normalizer, in its ``(B, T, H, D)`` layout."""
    import torch.nn.functional as F

    from benchmarks.baselines import fla_naive

    Q, K = F.elu(q) + 1, F.elu(k) + 1
    naive = fla_naive("linear_attn").naive_chunk_linear_attn
    out = naive(Q[:, :, None], K[:, :, None], v[:, :, None], scale=1.0, normalize=True)
    return out[:, :, 0]


def peers(lengths, repeats):
    """Forward+backward of polylin beside fast-transformers and fla's chunk reference, where
    installed (issue 12's table); each is first checked against polylin's output."""
    import torch

    from polylin import causal_linear_attention

    candidates = {"polylin": causal_linear_attention, "plain": plain_chunked_torch}
    skipped = {}
    for name, fn in (("fast_transformers", fast_transformers_causal), ("fla", fla_chunk_reference)):
        try:
            small = [torch.randn(2, 128, 16) for _ in range(3)]  # fast-transformers: float32
            expected = causal_linear_attention(*small)
            error = (fn(*small) - expected).abs().max().item()
        except ImportError as exc:
            skipped[name] = str(exc)
            continue
        if error > 1e-4:  # float32 round-off (outputs are of order 1)
            raise AssertionError(f"{name} differs from polylin by {error}")
        candidates[name] = fn
    rows: list = [{"skipped": skipped}] if skipped else []
    if skipped:
        print(json.dumps(rows[0]), flush=True)
    for T in lengths:
        torch.manual_seed(0)
        xs = [torch.randn(BATCH_HEADS, T, 64, requires_grad=True) for _ in range(3)]

        def fwd_bwd(fn, xs=xs):
            def run():
                fn(*xs).sum().backward()
                for x in xs:
                    x.grad = None

            return run

        t = interleaved({n: fwd_bwd(fn) for n, fn in candidates.items()}, repeats)
        row = {"T": T, **{f"{n}_fwd_bwd": round(s * 1e3, 2) for n, s in t.items()}}
        row.update(
            {
                f"polylin_over_{n}": round(t["polylin"] / s, 3)
                for n, s in t.items()
                if n != "polylin"
            }
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def jax_grad(T, repeats):
    import jax
    import numpy as np

    from polylin import causal_linear_attention

    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(rng.standard_normal((BATCH_HEADS, T, 64)), dtype="float32")
               for _ in range(3))  # fmt: skip
    forward = jax.jit(causal_linear_attention)
    grad = jax.jit(jax.grad(lambda q, k, v: causal_linear_attention(q, k, v).sum(), (0, 1, 2)))
    t = interleaved(
        {
            "forward": lambda: forward(q, k, v).block_until_ready(),
            "grad": lambda: jax.block_until_ready(grad(q, k, v)),
        },
        repeats,
    )
    row = {"T": T, **{k: round(s * 1e3, 2) for k, s in t.items()}}
    row["grad_over_forward"] = round(t["grad"] / t["forward"], 3)
    print(json.dumps(row), flush=True)
    return row


def decay(repeats, lengths=(4096, 16384)):
    import torch

    from polylin import causal_linear_attention

    torch.manual_seed(0)
    T = 4096
    q, k, v = (torch.randn(BATCH_HEADS, T, 64) for _ in range(3))
    gates = {
        "none": None,
        "scalar": -torch.rand(BATCH_HEADS, T, 1),
        "channel": -torch.rand(BATCH_HEADS, T, 64),
    }

    def fwd(method, g):
        def run():
            with torch.no_grad():
                causal_linear_attention(q, k, v, method=method, log_decay=g, normalize=False)

        return run

    t = interleaved({f"chunked_{n}": fwd("chunked", g) for n, g in gates.items()}, repeats)
    rec = interleaved({f"recurrent_{n}": fwd("recurrent", g) for n, g in gates.items()}, 1)
    forward = {"T": T, **{k: round(s * 1e3, 2) for k, s in {**t, **rec}.items()}}
    for n in ("none", "scalar", "channel"):  # "none": the bound a decayed form cannot pass
        forward[f"{n}_over_none"] = round(t[f"chunked_{n}"] / t["chunked_none"], 3)
        forward[f"recurrent_over_chunked_{n}"] = round(rec[f"recurrent_{n}"] / t[f"chunked_{n}"], 1)
    print(json.dumps(forward), flush=True)
    training = []
    for T in lengths:
        q, k, v = (torch.randn(BATCH_HEADS, T, 64, requires_grad=True) for _ in range(3))
        g_scalar = (-torch.rand(BATCH_HEADS, T, 1)).requires_grad_(True)
        g_channel = (-torch.rand(BATCH_HEADS, T, 64)).requires_grad_(True)

        def fwd_bwd(g, xs=(q, k, v)):
            def run():
                causal_linear_attention(*xs, log_decay=g, normalize=False).sum().backward()
                for x in (*xs, g):
                    if x is not None:
                        x.grad = None

            return run

        user: dict = {}
        t = interleaved(
            {"none": fwd_bwd(None), "scalar": fwd_bwd(g_scalar), "channel": fwd_bwd(g_channel)},
            max(1, repeats // 2),
            user,
        )
        row = {"T": T, **{f"fwd_bwd_{k}": round(s * 1e3, 2) for k, s in t.items()}}
        row.update({f"user_fwd_bwd_{k}": round(s * 1e3, 2) for k, s in user.items()})
        print(json.dumps(row), flush=True)
        training.append(row)
    if len(training) == 2:
        growth = {}
        for n in ("none", "scalar", "channel"):
            for clock, key in (("", f"fwd_bwd_{n}"), ("_user", f"user_fwd_bwd_{n}")):
                growth[f"{n}_16k_over_4k{clock}"] = round(training[1][key] / training[0][key], 2)
        print(json.dumps(growth), flush=True)
        training.append(growth)
    return {"forward": forward, "training": training}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no T = 64k, fewer repeats")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=["torch", "memory", "jax", "decay"])
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        _memory_child(args.memory_child[0], int(args.memory_child[1]))
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    results = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
        }
    }
    print(json.dumps(results["machine"]), flush=True)
    if "torch" in args.only:
        lengths = [1024, 4096, 16384] + ([] if args.quick else [65536])
        results["torch"] = torch_training(lengths, [64] if args.quick else [64, 128], repeats)
    if "memory" in args.only:
        results["memory"] = peak_memory()
    if "jax" in args.only:
        results["jax"] = jax_grad(16384, repeats)
    if "decay" in args.only:
        results["decay"] = decay(repeats)
    if "peers" in args.only:
        results["peers"] = peers([4096, 16384], repeats)
    results["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
