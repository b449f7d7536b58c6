"""Feature-map measurements: approximation of softmax attention, and backward memory.

``python benchmarks/run.py feature-maps approx`` prints the table of ``docs/feature_maps.md``:
for each feature map (and number of features), the relative error of linear attention with it
against exact softmax attention ``softmax(Q K^T / sqrt(d)) V`` on the same random inputs, causal
and non-causal, averaged over seeds (each seed draws new inputs and, for FAVOR+, a new
projection). All in float64 NumPy, so the error is the map's, not round-off.

``python benchmarks/run.py feature-maps memory`` measures what the backward pass of PyTorch
autograd keeps alive for each method at T = 4096: the bytes of the tensors saved for backward
(``torch.autograd.graph.saved_tensors_hooks``, distinct storages, the inputs themselves not
counted), and on a CUDA device also the peak allocated memory of forward + backward. It prints
ratios to the chunked method, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polylin import METHODS, causal_linear_attention, linear_attention
from polylin.feature_maps import dpfp, elu_plus_one, favor_plus, relu, taylor_exp

__all__ = ["approximation_table", "backward_memory", "main", "softmax_attention"]


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool) -> np.ndarray:
    """Exact softmax attention ``softmax(Q K^T / sqrt(d)) V`` in NumPy (the target)."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def _scaled(phi: Callable[[Any], Any], dim: int) -> Callable[[Any], Any]:
    """``phi(x * dim**-0.25)``: a kernel of ``q . k`` becomes one of ``q . k / sqrt(dim)``."""
    return lambda x: phi(x * dim**-0.25)


def _uniform(v: np.ndarray, *, causal: bool) -> np.ndarray:
    """Equal weights on every visible key: the no-information baseline."""
    if causal:
        return np.cumsum(v, axis=-2) / np.arange(1, v.shape[-2] + 1)[:, None]
    return np.broadcast_to(v.mean(-2, keepdims=True), v.shape)


def _candidates(dim: int, favor_features: Sequence[int]) -> list[tuple[str, int, Callable]]:
    """(label, number of features, factory(seed) -> feature map or None for the baseline)."""
    rows: list[tuple[str, int, Callable]] = [
        ("uniform weights (baseline)", 0, lambda seed: None),
        ("elu_plus_one", dim, lambda seed: elu_plus_one),
        ("relu", dim, lambda seed: relu),
        ("dpfp(nu=1)", 2 * dim, lambda seed: dpfp(1)),
        ("dpfp(nu=3)", 6 * dim, lambda seed: dpfp(3)),
        ("taylor_exp(x d^-1/4)", 1 + dim + dim * dim, lambda seed: _scaled(taylor_exp, dim)),
    ]
    for m in favor_features:
        rows.append((f"favor_plus(m={m})", m, lambda seed, m=m: favor_plus(dim, m, seed=seed)))
    for m in favor_features:
        rows.append(
            (
                f"favor_plus(m={m}, orthogonal=False)",
                m,
                lambda seed, m=m: favor_plus(dim, m, seed=seed, orthogonal=False),
            )
        )
    return rows


def approximation_table(
    *,
    dim: int = 16,
    seq_len: int = 256,
    scale: float = 1.0,
    heads: int = 4,
    seeds: Sequence[int] = (0, 1, 2),
    favor_features: Sequence[int] = (16, 64, 256, 1024, 4096),
) -> list[dict[str, Any]]:
    """Relative error of linear attention with each map against softmax attention.

    Inputs are ``q, k ~ N(0, scale**2)``, ``v ~ N(0, 1)``, shape ``(heads, seq_len, dim)``; the
    error is ``||O - O_softmax||_F / ||O_softmax||_F``, averaged over ``seeds``.

    Parameters
    ----------
    dim : int
        Head size d.
    seq_len : int
        Sequence length T.
    scale : float
        Standard deviation of query and key entries (the logits ``q . k / sqrt(d)`` then have
        standard deviation ``scale**2``).
    heads : int
        Independent heads per seed.
    seeds : sequence of int
        Seeds of the inputs and of the FAVOR+ projections.
    favor_features : sequence of int
        Numbers of FAVOR+ features to measure.

    Returns
    -------
    list of dict
        One row per map: ``map``, ``features``, ``causal``, ``noncausal`` (mean relative errors).

    Examples
    --------
    >>> from benchmarks.feature_maps import approximation_table
    >>> rows = approximation_table(dim=4, seq_len=16, seeds=(0,), favor_features=(8,))
    >>> [row["map"] for row in rows][:3]
    ['uniform weights (baseline)', 'elu_plus_one', 'relu']
    """
    rows = []
    for label, features, make in _candidates(dim, favor_features):
        errors: dict[str, list[float]] = {"causal": [], "noncausal": []}
        for seed in seeds:
            rng = np.random.default_rng(1000 + seed)
            q, k = rng.standard_normal((2, heads, seq_len, dim)) * scale
            v = rng.standard_normal((heads, seq_len, dim))
            phi = make(seed)
            for causal in (True, False):
                target = softmax_attention(q, k, v, causal=causal)
                if phi is None:
                    out = _uniform(v, causal=causal)
                elif causal:
                    out = causal_linear_attention(q, k, v, phi)
                else:
                    out = linear_attention(q, k, v, phi)
                err = np.linalg.norm(out - target) / np.linalg.norm(target)
                errors["causal" if causal else "noncausal"].append(float(err))
        rows.append(
            {
                "map": label,
                "features": features,
                "causal": float(np.mean(errors["causal"])),
                "noncausal": float(np.mean(errors["noncausal"])),
            }
        )
    return rows


def _saved_bytes(fn: Callable[[], Any], exclude: Sequence[Any]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    import torch

    excluded = {x.untyped_storage().data_ptr() for x in exclude}
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def backward_memory(
    *,
    seq_len: int = 4096,
    dim: int = 64,
    batch: int = 1,
    heads: int = 1,
    chunk_size: int = 64,
    dtype: str = "float32",
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Memory that PyTorch autograd keeps for the backward pass, per method.

    Parameters
    ----------
    seq_len, dim, batch, heads : int
        Input shape ``(batch, heads, seq_len, dim)`` for q, k and v.
    chunk_size : int
        Chunk size of the chunked method.
    dtype : str
        PyTorch dtype name of the inputs.
    device : str
        PyTorch device; on ``"cuda"`` the peak allocated memory of forward + backward is also
        measured (``torch.cuda.max_memory_allocated`` above what the inputs hold).

    Returns
    -------
    list of dict
        One row per method: ``method``, ``saved_bytes``, ``peak_bytes`` (CUDA only, else
        ``None``), and ``saved_ratio_to_chunked``.

    Examples
    --------
    >>> from benchmarks.feature_maps import backward_memory
    >>> rows = backward_memory(seq_len=64, dim=4, chunk_size=16)
    >>> [row["method"] for row in rows]
    ['chunked', 'recurrent', 'quadratic']
    >>> rows[2]["saved_bytes"] > rows[0]["saved_bytes"]  # T x T scores vs per-chunk blocks
    True
    """
    import torch

    gen = torch.Generator().manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    shape = (batch, heads, seq_len, dim)
    base = [torch.randn(shape, generator=gen).to(device=device, dtype=torch_dtype) for _ in "qkv"]
    rows = []
    for method in METHODS:
        xs = [x.clone().requires_grad_(True) for x in base]

        def forward(xs: list[Any] = xs, method: str = method) -> Any:
            return causal_linear_attention(*xs, method=method, chunk_size=chunk_size)

        saved = _saved_bytes(forward, xs)
        peak = None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            forward().sum().backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
        rows.append({"method": method, "saved_bytes": saved, "peak_bytes": peak})
    chunked = rows[0]
    for row in rows:
        row["saved_ratio_to_chunked"] = row["saved_bytes"] / chunked["saved_bytes"]
        if row["peak_bytes"] is not None:
            row["peak_ratio_to_chunked"] = row["peak_bytes"] / chunked["peak_bytes"]
    return rows


def _print_approximation(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"relative error vs softmax attention: d={args.dim}, T={args.seq_len}, "
        f"q,k ~ N(0, {args.scale}^2), {args.heads} heads x {len(args.seeds)} seeds"
    )
    print("| map | features | causal | non-causal |")
    print("|---|---:|---:|---:|")
    for row in rows:
        features = row["features"] or "-"
        print(f"| `{row['map']}` | {features} | {row['causal']:.3f} | {row['noncausal']:.3f} |")


def _print_memory(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"backward memory: (batch, heads, T, d) = ({args.batch}, {args.heads}, {args.seq_len}, "
        f"{args.dim}), {args.dtype} on {args.device}, chunk_size={args.chunk_size}"
    )
    print("| method | saved for backward | ratio to chunked | peak (CUDA) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.1f} MiB"
        ratio = f"{row['peak_ratio_to_chunked']:.1f}" if row["peak_bytes"] is not None else "-"
        print(
            f"| {row['method']} | {row['saved_bytes'] / 2**20:.1f} MiB | "
            f"{row['saved_ratio_to_chunked']:.1f} | {peak} | {ratio} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python benchmarks/run.py feature-maps {approx,memory} [options]``.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status (0).

    Examples
    --------
    >>> from benchmarks.feature_maps import main
    >>> main(["memory", "--seq-len", "32", "--dim", "4", "--chunk-size", "8"])  # doctest: +ELLIPSIS
    backward memory: ...
    | chunked | ... | 1.0 | - | - |
    ...
    0
    """
    parser = argparse.ArgumentParser(prog="python benchmarks/run.py feature-maps")
    sub = parser.add_subparsers(dest="command", required=True)
    approx = sub.add_parser("approx", help="approximation error to softmax attention")
    approx.add_argument("--dim", type=int, default=16)
    approx.add_argument("--seq-len", type=int, default=256)
    approx.add_argument("--scale", type=float, default=1.0)
    approx.add_argument("--heads", type=int, default=4)
    approx.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    approx.add_argument("--features", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    memory = sub.add_parser("memory", help="backward memory per method (PyTorch)")
    memory.add_argument("--seq-len", type=int, default=4096)
    memory.add_argument("--dim", type=int, default=64)
    memory.add_argument("--batch", type=int, default=1)
    memory.add_argument("--heads", type=int, default=1)
    memory.add_argument("--chunk-size", type=int, default=64)
    memory.add_argument("--dtype", default="float32")
    memory.add_argument("--device", default="cpu")
    for p in (approx, memory):
        p.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "approx":
        rows = approximation_table(
            dim=args.dim,
            seq_len=args.seq_len,
            scale=args.scale,
            heads=args.heads,
            seeds=args.seeds,
            favor_features=args.features,
        )
        _print_approximation(rows, args)
    else:
        rows = backward_memory(
            seq_len=args.seq_len,
            dim=args.dim,
            batch=args.batch,
            heads=args.heads,
            chunk_size=args.chunk_size,
            dtype=args.dtype,
            device=args.device,
        )
        _print_memory(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": args.command, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
