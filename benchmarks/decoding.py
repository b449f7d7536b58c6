"""Decoding overhead: polylin's step functions against their bare arithmetic and the traffic floor.

    python benchmarks/decoding.py [--threads 1] [--tokens 16] [--samples 300] [--json PATH]

For each library (NumPy, PyTorch CPU) and each step (``step``: linear attention with
``elu + 1``; ``delta_rule_step``: the gated delta rule with per-token ``beta`` and gate arrays,
as a Gated DeltaNet layer calls it; ``dplr_delta_rule_step``: the generalized rule with ``a``,
``b`` and a per-channel gate, as RWKV-7 calls it), float32, three ways of running a decoding
loop that feeds each token's state into the next:

- **plain**: the public step function, which checks every argument at every token;
- **prepared**: the same step from ``prepare_step`` / ``prepare_delta_rule_step`` /
  ``prepare_dplr_step``, which checks once per signature (``polylin/_prepared.py``);
- **bare**: the same update written directly in that library (the feature map, the state
  update and the read-out, nothing else), checked equal to polylin first.

At one head (``(batch, heads, d) = (1, 1, 64)``) the ratios to *bare* are per-call overhead.
At more (``(8, 8, 64)``, a 1 MiB float32 state) they are compared with the **traffic
floor**: one read
of the state for ``k^T S`` and ``q^T S`` and one read and one write to update it, timed two ways
in the same library and run (``floor_time``): on the state itself, which stays in cache, and at
the memory bandwidth of a 64 MiB array (written in place: no page faults).

Each sample times ``--tokens`` consecutive tokens of one variant; variants are interleaved
sample by sample so a change of load hits all; the per-token median over ``--samples`` samples
is reported. Read the ratios (absolute times depend on the machine and its load).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

import polylin  # noqa: E402
from benchmarks.timing import goal, interleaved_times, run_metadata, write_report  # noqa: E402

#: The goals of the performance issue, as (ratio name, limit).
LIMITS = {"prepared/bare": 2.0, "prepared/floor": 1.3, "prepared/stream_floor": 1.3}
EPS = 1e-6


class Lib:
    """The handful of operations the bare updates need, spelled the library's own way."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.m: Any = np if name == "numpy" else torch

    def array(self, x: np.ndarray) -> Any:
        return x if self.name == "numpy" else torch.from_numpy(x)

    def elu1(self, x: Any) -> Any:
        if self.name == "numpy":
            return np.exp(np.minimum(x, 0)) + np.maximum(x, 0)
        return torch.nn.functional.elu(x) + 1

    def rowsum(self, x: Any) -> Any:
        if self.name == "numpy":
            return x.sum(-1, keepdims=True)
        return x.sum(-1, keepdim=True)


def bare_step(lib: Lib, q: Any, k: Any, v: Any, state: Any) -> tuple[Any, Any]:
    S, z = state
    fq, fk = lib.elu1(q), lib.elu1(k)
    S = S + fk[..., :, None] * v[..., None, :]
    z = z + fk
    out = (fq[..., None, :] @ S)[..., 0, :] / (lib.rowsum(fq * z) + EPS)
    return out, (S, z)


def bare_delta(lib: Lib, q: Any, k: Any, v: Any, beta: Any, g: Any, S: Any) -> tuple[Any, Any]:
    S = S * lib.m.exp(g)[..., None]
    correction = beta * (v - (k[..., None, :] @ S)[..., 0, :])
    S = S + k[..., :, None] * correction[..., None, :]
    return (q[..., None, :] @ S)[..., 0, :], S


def bare_dplr(
    lib: Lib, q: Any, k: Any, v: Any, a: Any, b: Any, w: Any, S: Any
) -> tuple[Any, Any]:
    read = a[..., None, :] @ S
    S = S * lib.m.exp(w)[..., :, None]
    S = S + b[..., :, None] * read + k[..., :, None] * v[..., None, :]
    return (q[..., None, :] @ S)[..., 0, :], S


def tokens(lib: Lib, shape: tuple, n: int, seed: int = 0) -> dict[str, list[Any]]:
    """``n`` tokens of every per-token input, float32."""
    rng = np.random.default_rng(seed)
    d = shape[-1]

    def draw(make: Callable[[], np.ndarray]) -> list[Any]:
        return [lib.array(make().astype(np.float32)) for _ in range(n)]

    def unit() -> np.ndarray:
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    return {
        "q": draw(lambda: rng.standard_normal(shape)),
        "k": draw(unit),
        "v": draw(lambda: rng.standard_normal(shape)),
        "beta": draw(lambda: rng.uniform(0.2, 0.8, (*shape[:-1], 1))),
        "g": draw(lambda: -rng.uniform(0.01, 0.2, (*shape[:-1], 1))),
        "w": draw(lambda: -rng.uniform(0.01, 0.5, (*shape[:-1], d))),
        "b": draw(lambda: 0.5 * rng.uniform(0.0, 1.0, shape)),
    }


def loops(lib: Lib, shape: tuple, n: int) -> dict[str, dict[str, Callable[[int], Any]]]:
    """Per step: a decoding loop of ``n`` tokens for each variant, each returning its outputs
    and its final state."""
    x = tokens(lib, shape, n)
    q, k, v, beta, g, w, b = (x[name] for name in ("q", "k", "v", "beta", "g", "w", "b"))
    a = [-key for key in k]  # RWKV-7: a = -kk, b = kk * a_lr (here b drawn independently)
    d = shape[-1]
    S0 = lib.array((0.1 * np.random.default_rng(1).standard_normal((*shape, d))).astype("f4"))
    z0 = lib.array(np.ones(shape, dtype=np.float32))
    step0 = polylin.LinearAttentionState(S0, z0)
    prepared = {
        "step": polylin.prepare_step(),
        "delta_rule_step": polylin.prepare_delta_rule_step(),
        "dplr_delta_rule_step": polylin.prepare_dplr_step(),
    }

    def run(update: Callable[..., tuple[Any, Any]], state: Any, *per_token: list) -> Callable:
        def loop(_: int) -> tuple[list, Any]:
            s, outs = state, []
            for t in range(n):
                o, s = update(*(arrays[t] for arrays in per_token), s)
                outs.append(o)
            return outs, s

        return loop

    linear = polylin.step
    delta, dplr = polylin.delta_rule_step, polylin.dplr_delta_rule_step
    fast_linear, fast_delta, fast_dplr = (prepared[name] for name in prepared)
    return {
        "step": {
            "plain": run(lambda q, k, v, s: linear(q, k, v, s), step0, q, k, v),
            "prepared": run(lambda q, k, v, s: fast_linear(q, k, v, s), step0, q, k, v),
            "bare": run(lambda q, k, v, s: bare_step(lib, q, k, v, s), step0, q, k, v),
        },
        "delta_rule_step": {
            "plain": run(
                lambda q, k, v, be, g, s: delta(q, k, v, be, s, log_decay=g),
                S0, q, k, v, beta, g,
            ),
            "prepared": run(
                lambda q, k, v, be, g, s: fast_delta(q, k, v, be, s, log_decay=g),
                S0, q, k, v, beta, g,
            ),
            "bare": run(
                lambda q, k, v, be, g, s: bare_delta(lib, q, k, v, be, g, s),
                S0, q, k, v, beta, g,
            ),
        },
        "dplr_delta_rule_step": {
            "plain": run(
                lambda q, k, v, a, b, w, s: dplr(q, k, v, a, b, s, log_decay=w),
                S0, q, k, v, a, b, w,
            ),
            "prepared": run(
                lambda q, k, v, a, b, w, s: fast_dplr(q, k, v, a, b, s, log_decay=w),
                S0, q, k, v, a, b, w,
            ),
            "bare": run(
                lambda q, k, v, a, b, w, s: bare_dplr(lib, q, k, v, a, b, w, s),
                S0, q, k, v, a, b, w,
            ),
        },
    }  # fmt: skip


def check_equal(lib: Lib, variants: dict[str, Callable[[int], Any]]) -> None:
    """Every variant gives the outputs of the plain step (float32 round-off)."""
    reference, _ = variants["plain"](0)
    for name, loop in variants.items():
        outs, _ = loop(0)
        for got, want in zip(outs, reference):
            np.testing.assert_allclose(
                np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6, err_msg=name
            )


def floor_time(lib: Lib, shape: tuple, samples: int) -> dict[str, float]:
    """The traffic floor of a step on a state of ``shape + (d,)``, two ways (microseconds).

    ``floor_us``: one read (``sum``) plus one read-and-write (``S * 0.5``) of the state itself,
    as fast as the library streams it (a 1 MiB state stays in cache). ``stream_floor_us``: the
    same three passes over the state's bytes at the bandwidth of ``multiply(X, 0.5, out=Y)``
    on 64 MiB arrays (memory bandwidth: the floor of a state that leaves the cache between
    tokens).
    """
    d = shape[-1]
    rng = np.random.default_rng(2)
    S = lib.array(rng.standard_normal((*shape, d)).astype(np.float32))
    big = lib.array(rng.standard_normal(2**24).astype(np.float32))
    out = big * 1.0  # written in place: a new 64 MiB array would time page faults
    (read, _), (update, _) = interleaved_times([lambda _: S.sum(), lambda _: S * 0.5], samples)
    ((stream, _),) = interleaved_times(
        [lambda _: lib.m.multiply(big, 0.5, out=out)], max(samples // 30, 5)
    )
    bandwidth = 2 * big.nbytes / stream  # one read and one write of big
    return {
        "read_us": read * 1e6, "read_write_us": update * 1e6, "floor_us": (read + update) * 1e6,
        "stream_floor_us": 3 * S.nbytes / bandwidth * 1e6,
    }  # fmt: skip


def measure(lib: Lib, shape: tuple, n: int, samples: int) -> list[dict[str, Any]]:
    rows = []
    floor = floor_time(lib, shape, samples) if math.prod(shape[:-1]) > 1 else None
    for op, variants in loops(lib, shape, n).items():
        check_equal(lib, variants)
        times = interleaved_times(list(variants.values()), samples)
        per_token = {name: med / n * 1e6 for name, (med, _) in zip(variants, times)}
        row: dict[str, Any] = {"backend": lib.name, "op": op, "shape": list(shape)}
        row.update({f"{name}_us": us for name, us in per_token.items()})
        row["plain/bare"] = per_token["plain"] / per_token["bare"]
        row["prepared/bare"] = per_token["prepared"] / per_token["bare"]
        if floor is not None:
            row.update(floor)
            for name in ("plain", "prepared", "bare"):
                row[f"{name}/floor"] = per_token[name] / floor["floor_us"]
                row[f"{name}/stream_floor"] = per_token[name] / floor["stream_floor_us"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per timed sample")
    parser.add_argument("--samples", type=int, default=300, help="timed samples per variant")
    parser.add_argument("--shapes", default="1,1,64;8,8,64", help="(batch, heads, d) list")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes.split(";")]
    report: dict[str, Any] = {
        "metadata": run_metadata("python benchmarks/decoding.py", threads=args.threads),
        "rows": [],
    }
    with torch.inference_mode():
        for shape in shapes:
            for name in ("numpy", "torch"):
                report["rows"].extend(measure(Lib(name), shape, args.tokens, args.samples))
    print(f"float32, torch threads {args.threads}; us per token (median of {args.samples} x "
          f"{args.tokens} tokens)")
    print(f"{'backend':8} {'op':21} {'shape':10} {'plain':>8} {'prepared':>9} {'bare':>8} "
          f"{'prep/bare':>9} {'floor':>7} {'prep/floor':>10} {'stream':>7} {'prep/stream':>11}")
    for r in report["rows"]:
        floor = (
            f"{r['floor_us']:7.1f} {r['prepared/floor']:10.2f} {r['stream_floor_us']:7.1f} "
            f"{r['prepared/stream_floor']:11.2f}" if "floor_us" in r else ""
        )
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['backend']:8} {r['op']:21} {shape:10} {r['plain_us']:8.1f} "
              f"{r['prepared_us']:9.1f} {r['bare_us']:8.1f} {r['prepared/bare']:9.2f} {floor}")
    report["goals"] = goals(report["rows"])
    return write_report(report, args.json)


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals: prepared/bare at most 2 at (1, 1, 64); prepared/floor at most 1.3
    at (8, 8, 64)."""
    out = []
    for r in rows:
        keys = ["prepared/floor", "prepared/stream_floor"] if "floor_us" in r else ["prepared/bare"]
        shape = "x".join(map(str, r["shape"]))
        out.extend(
            goal(f"{r['backend']} {r['op']} {shape} {key}", r[key], LIMITS[key]) for key in keys
        )
    return out

if __name__ == "__main__":
    main()
