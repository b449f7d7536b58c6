"""The GPU benchmark behind ``python -m polylin bench-gpu`` (run by ``backends/gpu-check.sh``).

What it times, on the same inputs ``(batch, heads, T, d)``:

- ``polylin_chunked`` on PyTorch (``torch:cuda``) and on CuPy (float32 only: CuPy has no
  bfloat16), forward and, for PyTorch, forward + backward (``out.sum().backward()``);
- ``polylin_chunked_tf32``: the same PyTorch call with TF32 matmuls switched on for the call only
  (float32 inputs), to show what the precision setting is worth;
- ``masked_quadratic``: polylin's masked kernel form, skipped where its T x T matrices would not
  fit a memory cap;
- ``sdpa``: PyTorch's ``scaled_dot_product_attention(is_causal=True)`` (softmax attention: a
  different function, timed only), restricted to the flash kernel, else the memory-efficient one;
- ``fla_chunk``: ``fla.ops.linear_attn.chunk_linear_attn(normalize=True, scale=1.0)`` from
  flash-linear-attention, when it can be imported, on the same inputs converted to its
  ``(B, T, H, D)`` layout (outside the timer) with polylin's ``elu(x) + 1`` applied to q and k
  inside the timed call;
- ``seed_loop``: the design note's per-token PyTorch loop, timed at a short length; its cost at
  every other length is the per-token cost times T, recorded as an *extrapolation*.

Every output is compared with polylin's float64 chunked result on the same device
(``max_abs_diff_vs_float64``) and checked to be on the input's device. Times are medians of
repeats after a warm-up, each stopped by the backend's synchronization. Results go to JSON after
every cell (so a run cut short keeps what it measured) and to a PNG when matplotlib is there.

``--device cpu`` runs the same code paths on the CPU with NumPy standing in for CuPy; the test
suite uses it as a smoke test with tiny sizes. Nothing here changes global precision settings:
the TF32 variant sets and restores them around its own call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__, causal_linear_attention, masked_kernel_attention
from ..testing import Backend
from .baselines import seed_loop  # the design note's loop, shared with the CPU benchmark

__all__ = ["DEFAULT_SEQ_LENS", "SCHEMA", "add_arguments", "run", "seed_loop", "summarize"]

#: Version tag of the JSON report; bump it when fields change meaning.
SCHEMA = "polylin-bench-gpu/1"

#: Sequence lengths, 8k first: the targets are stated at T = 8k, so a run cut short by its time
#: budget still has them.
DEFAULT_SEQ_LENS = (8192, 1024, 2048, 4096, 16384, 32768, 65536)

PASSES = ("forward", "forward+backward")
JSON_NAME = "bench-gpu.json"
PNG_NAME = "bench-gpu.png"


class _Skip(Exception):
    """An implementation cannot run this cell; the message says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the GPU benchmark's flags on ``parser`` and set its entry point.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``bench-gpu`` subparser (or any parser).

    Examples
    --------
    >>> import argparse
    >>> from polylin.bench.gpu import add_arguments
    >>> p = argparse.ArgumentParser()
    >>> add_arguments(p)
    >>> args = p.parse_args(["--device", "cpu", "--seq-lens", "64", "--dims", "8"])
    >>> args.device, args.seq_lens, args.dims, args.dtypes
    ('cpu', [64], [8], ['float32', 'bfloat16'])
    """
    a = parser.add_argument
    a("--device", choices=("cuda", "cpu"), default="cuda",
      help="cuda: torch:cuda and CuPy (default); cpu: torch and NumPy (smoke test)")
    a("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS), metavar="T",
      help="sequence lengths, run in this order (default: 8k first, then 1k ... 64k)")
    a("--dims", type=int, nargs="+", default=[64, 128], metavar="D", help="d_k = d_v")
    a("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    a("--batch", type=int, default=2, help="batch B (default 2)")
    a("--heads", type=int, default=16, help="heads H (default 16; B x H = 32)")
    a("--chunk-size", type=int, default=64, help="polylin chunk size C (default 64)")
    a("--repeats", type=int, default=5, help="timed repeats per measurement (median kept)")
    a("--max-seconds", type=float, default=1.0,
      help="stop repeating a measurement once its runs took this long (at least one timed run)")
    a("--seed-loop-len", type=int, default=256,
      help="T at which the per-token seed loop is timed; longer T are extrapolated")
    a("--quadratic-max-gib", type=float, default=None,
      help="skip the masked quadratic form above this estimate (default 24 on cuda, 1 on cpu)")
    a("--matmul-size", type=int, default=None,
      help="n of the n x n x n matmul that measures the machine's rate (default 8192 / 256)")
    a("--no-backward", action="store_true", help="forward passes only")
    a("--time-budget", type=float, default=None, metavar="SECONDS",
      help="stop starting new measurements after this long; what ran is kept")
    a("--out", default="bench-gpu-results", help="folder for bench-gpu.json and bench-gpu.png")
    a("--no-plot", action="store_true", help="skip the PNG")
    a("--summary-of", metavar="JSON", default=None,
      help="print the summary of an earlier report and exit (runs nothing)")
    parser.set_defaults(func=run)


# --------------------------------------------------------------------------------------------
# context: the device, the libraries, the clock


@dataclass
class _Context:
    args: argparse.Namespace
    torch: Any
    device: Any
    torch_backend: Backend
    second_backend: Backend  # CuPy on cuda, NumPy on cpu
    deadline: float | None
    report: dict
    out_dir: Path
    fla: Callable | None = None
    fla_reason: str | None = None
    seed_done: set = field(default_factory=set)

    @property
    def on_cuda(self) -> bool:
        return self.args.device == "cuda"

    def sync(self, x: Any = None) -> Any:
        if self.on_cuda:
            # Device-wide: also waits for CuPy's stream (cudaDeviceSynchronize).
            self.torch.cuda.synchronize()
        return x

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def free(self) -> None:
        if self.on_cuda:
            self.torch.cuda.empty_cache()
            if self.second_backend is Backend.CUPY and self.second_backend.available():
                self.second_backend.module().get_default_memory_pool().free_all_blocks()


def _time(ctx: _Context, fn: Callable[[], Any]) -> tuple[Any, list[float]]:
    """Warm up once, then time up to ``repeats`` runs (fewer when one run is slow)."""
    start = time.perf_counter()
    out = ctx.sync(fn())
    warm = time.perf_counter() - start
    repeats = max(1, min(ctx.args.repeats, int(ctx.args.max_seconds / max(warm, 1e-9))))
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = ctx.sync(fn())
        times.append(time.perf_counter() - start)
    return out, times


@contextlib.contextmanager
def _float32_matmul_precision(torch: Any, precision: str) -> Iterator[None]:
    """Set torch's float32 matmul precision for a block and restore the caller's setting."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _load_fla(device: str) -> tuple[Callable, str]:
    """``fla.ops.linear_attn.chunk_linear_attn`` and fla's version, or raise :class:`_Skip`."""
    if device != "cuda":
        raise _Skip("fla not run: its Triton kernels need a CUDA device")
    try:
        import fla  # optional: only on the GPU machine, carried as a wheel
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as exc:  # ImportError, or a Triton/torch mismatch raising something else
        raise _Skip(f"fla not importable ({type(exc).__name__}: {exc})") from None
    return chunk_linear_attn, str(getattr(fla, "__version__", "unknown"))


# --------------------------------------------------------------------------------------------
# the implementations


@dataclass
class _Cell:
    T: int
    d: int
    dtype: str
    q: Any  # torch tensors (B, H, T, d) on the device
    k: Any
    v: Any
    oracle: Any  # polylin float64 chunked output on the device


def _leaves(torch: Any, *xs: Any) -> list[Any]:
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _backward_of(torch: Any, forward: Callable[..., Any], leaves: list[Any]) -> Callable[[], None]:
    def run() -> None:
        for x in leaves:
            x.grad = None
        forward(*leaves).sum().backward()

    return run


def _impl_polylin_torch(ctx: _Context, c: _Cell, *, tf32: bool = False) -> dict:
    torch, C = ctx.torch, ctx.args.chunk_size
    if tf32 and (c.dtype != "float32" or not ctx.on_cuda):
        raise _Skip("TF32 applies to float32 matmuls on CUDA only")

    def forward(q: Any, k: Any, v: Any) -> Any:
        if tf32:
            with _float32_matmul_precision(torch, "high"):
                return causal_linear_attention(q, k, v, chunk_size=C)
        return causal_linear_attention(q, k, v, chunk_size=C)

    passes = {"forward": (lambda: forward(c.q, c.k, c.v), lambda out: out)}
    if not ctx.args.no_backward and not tf32:
        passes["forward+backward"] = (_backward_of(torch, forward, _leaves(torch, c.q, c.k, c.v)),
                                      None)
    return passes


def _impl_polylin_second(ctx: _Context, c: _Cell) -> dict:
    backend, torch = ctx.second_backend, ctx.torch
    reason = backend.unavailable_reason()
    if reason is not None:
        raise _Skip(f"{backend}: {reason}")
    if c.dtype == "bfloat16":
        raise _Skip(f"{backend} has no bfloat16")
    mod = backend.module()
    # DLPack: the very same device memory as the torch inputs, no host round trip.
    q, k, v = (mod.from_dlpack(x.detach()) for x in (c.q, c.k, c.v))
    C = ctx.args.chunk_size

    def back(out: Any) -> Any:
        return torch.from_dlpack(out)

    return {"forward": (lambda: causal_linear_attention(q, k, v, chunk_size=C), back)}


def _impl_quadratic(ctx: _Context, c: _Cell) -> dict:
    torch = ctx.torch
    cap = ctx.args.quadratic_max_gib
    if cap is None:
        cap = 24.0 if ctx.on_cuda else 1.0
    bh = c.q.shape[0] * c.q.shape[1]
    need = 3 * bh * c.T * c.T * 4 / 2**30  # scores, mask product, normalizer pass (float32)
    if need > cap:
        raise _Skip(f"T x T matrices need ~{need:.0f} GiB > cap {cap:g} GiB")
    passes = {"forward": (lambda: masked_kernel_attention(c.q, c.k, c.v), lambda out: out)}
    if not ctx.args.no_backward:
        passes["forward+backward"] = (
            _backward_of(torch, masked_kernel_attention, _leaves(torch, c.q, c.k, c.v)), None)
    return passes


def _impl_sdpa(ctx: _Context, c: _Cell) -> dict:
    torch = ctx.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    # Never the math fallback on the GPU: it builds the T x T matrix.
    candidates = [("flash", SDPBackend.FLASH_ATTENTION),
                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    if not ctx.on_cuda:
        candidates.append(("math", SDPBackend.MATH))
    q1, k1, v1 = (x[:, :1, :64] for x in (c.q, c.k, c.v))  # a cheap probe of kernel support
    errors = []
    for name, kernel in candidates:
        try:
            with warnings.catch_warnings(), sdpa_kernel([kernel]):
                warnings.simplefilter("ignore")
                sdpa(q1, k1, v1, is_causal=True)
        except RuntimeError as exc:
            errors.append(f"{name}: {str(exc).splitlines()[0][:120]}")
            continue

        def forward(q: Any, k: Any, v: Any, kernel: Any = kernel) -> Any:
            with sdpa_kernel([kernel]):
                return sdpa(q, k, v, is_causal=True)

        passes = {"forward": (lambda: forward(c.q, c.k, c.v), None)}
        if not ctx.args.no_backward:
            passes["forward+backward"] = (
                _backward_of(torch, forward, _leaves(torch, c.q, c.k, c.v)), None)
        passes["variant"] = name
        return passes
    raise _Skip("no SDPA kernel without the T x T matrix: " + "; ".join(errors))


def _impl_fla(ctx: _Context, c: _Cell) -> dict:
    torch = ctx.torch
    if ctx.fla is None:
        raise _Skip(ctx.fla_reason or "fla not importable")
    chunk_linear_attn = ctx.fla
    # fla wants (B, T, H, D); converted once, outside the timer.
    q, k, v = (x.transpose(1, 2).contiguous() for x in (c.q, c.k, c.v))

    def forward(q: Any, k: Any, v: Any) -> Any:
        # fla applies no feature map: polylin's elu(x) + 1 goes in first. scale=1.0: fla's
        # normalizer is (scale q) . cumsum(k) + 1e-10, so the scale only moves that epsilon.
        phi_q = torch.nn.functional.elu(q) + 1.0
        phi_k = torch.nn.functional.elu(k) + 1.0
        out, _ = chunk_linear_attn(phi_q, phi_k, v, scale=1.0, normalize=True)
        return out

    passes = {"forward": (lambda: forward(q, k, v), lambda out: out.transpose(1, 2))}
    if not ctx.args.no_backward:
        passes["forward+backward"] = (_backward_of(torch, forward, _leaves(torch, q, k, v)), None)
    return passes


IMPLS: dict[str, Callable[[_Context, _Cell], dict]] = {
    "polylin_chunked": _impl_polylin_torch,
    "polylin_chunked_tf32": lambda ctx, c: _impl_polylin_torch(ctx, c, tf32=True),
    "polylin_chunked@second": _impl_polylin_second,
    "masked_quadratic": _impl_quadratic,
    "sdpa": _impl_sdpa,
    "fla_chunk": _impl_fla,
}


# --------------------------------------------------------------------------------------------
# measuring


def _device_of(x: Any) -> str:
    dev = getattr(x, "device", None)
    if dev is None:
        return "cpu"
    return str(dev)


def _diff(torch: Any, out: Any, oracle: Any) -> float:
    return float((out.to(torch.float64) - oracle).abs().max())


def _record(report: dict, **fields: Any) -> dict:
    report["results"].append(fields)
    return fields


def _measure_impl(ctx: _Context, cell: _Cell, name: str) -> None:
    base = {"T": cell.T, "d": cell.d, "dtype": cell.dtype, "impl": name.split("@")[0],
            "backend": str(ctx.second_backend if name.endswith("@second") else ctx.torch_backend)}
    try:
        passes = IMPLS[name](ctx, cell)
    except _Skip as skip:
        for p in PASSES:
            _record(ctx.report, **base, **{"pass": p}, status="skipped", reason=str(skip))
        return
    except Exception as exc:
        _record(ctx.report, **base, **{"pass": "forward"}, status="error",
                reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        ctx.free()
        return
    variant = passes.pop("variant", None)
    for p in PASSES:
        if p not in passes:
            reason = "backward not run (--no-backward)" if ctx.args.no_backward else \
                "forward only for this implementation"
            _record(ctx.report, **base, **{"pass": p}, status="skipped", reason=reason)
            continue
        if ctx.out_of_time():
            _record(ctx.report, **base, **{"pass": p}, status="skipped", reason="time budget")
            continue
        fn, to_torch = passes[p]
        rec = {**base, "pass": p}
        if variant:
            rec["variant"] = variant
        try:
            if ctx.on_cuda:
                ctx.torch.cuda.reset_peak_memory_stats()
            out, times = _time(ctx, fn)
            rec.update(status="ok", median_s=statistics.median(times), times_s=times,
                       repeats=len(times))
            if ctx.on_cuda and base["backend"] == "torch:cuda":
                rec["peak_allocated_bytes"] = int(ctx.torch.cuda.max_memory_allocated())
            if to_torch is not None and out is not None:
                back = to_torch(out)
                rec["output_library"] = type(out).__module__.split(".")[0]
                rec["output_device"] = str(back.device)
                rec["output_on_input_device"] = back.device == cell.q.device
                rec["max_abs_diff_vs_float64"] = _diff(ctx.torch, back, cell.oracle)
            if name.startswith("polylin_chunked") and p == "forward":
                rec["model_flops"] = _chunked_flops(cell, ctx)
        except Exception as exc:  # OOM and friends: keep going with the next measurement
            rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        _record(ctx.report, **rec)
        out = None
        ctx.free()


def _chunked_flops(cell: _Cell, ctx: _Context) -> float:
    """Matmul flops of the chunked forward (the model used for the hardware fraction)."""
    B, H = cell.q.shape[0], cell.q.shape[1]
    T, d, C = cell.T, cell.d, min(ctx.args.chunk_size, cell.T)
    # Q K^T (C x C per chunk), scores V and Q S with the ones column (d + 1), K^T V increments.
    per_head = 2 * T * C * d + 2 * T * C * (d + 1) + 2 * 2 * T * d * (d + 1)
    return float(B * H * per_head)


def _seed(ctx: _Context, cell: _Cell) -> None:
    key = (cell.d, cell.dtype)
    if key in ctx.seed_done or ctx.out_of_time():
        return
    ctx.seed_done.add(key)
    torch = ctx.torch
    Ts = min(ctx.args.seed_loop_len, cell.T)
    B, H = cell.q.shape[0], cell.q.shape[1]
    q, k, v = (x[:, :, :Ts, :].reshape(B * H, Ts, cell.d) for x in (cell.q, cell.k, cell.v))
    rec = {"impl": "seed_loop", "backend": str(ctx.torch_backend), "d": cell.d,
           "dtype": cell.dtype, "T_measured": Ts, "pass": "forward"}
    try:
        out, times = _time(ctx, lambda: seed_loop(q, k, v))
        per_token = statistics.median(times) / Ts
        oracle = cell.oracle[:, :, :Ts, :].reshape(B * H, Ts, cell.d)  # causal: a prefix
        rec.update(status="ok", median_s=statistics.median(times), times_s=times,
                   per_token_s=per_token, output_device=_device_of(out),
                   max_abs_diff_vs_float64=_diff(torch, out, oracle),
                   extrapolated_s={str(T): per_token * T for T in ctx.args.seq_lens},
                   note=f"timed at T={Ts} only; other lengths are per-token cost x T "
                        "(an extrapolation, not a measurement)")
    except Exception as exc:
        rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
    ctx.report["seed_loop"].append(rec)


def _matmul_rates(ctx: _Context) -> None:
    torch = ctx.torch
    n = ctx.args.matmul_size or (8192 if ctx.on_cuda else 256)
    variants = [("float32", "float32", None), ("bfloat16", "bfloat16", None)]
    if ctx.on_cuda:
        variants.insert(1, ("float32_tf32", "float32", "high"))
    for label, dtype, precision in variants:
        if ctx.out_of_time():
            break
        a = torch.randn(n, n, device=ctx.device, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, device=ctx.device, dtype=getattr(torch, dtype))
        with (_float32_matmul_precision(torch, precision) if precision
              else contextlib.nullcontext()):
            _, times = _time(ctx, lambda a=a, b=b: torch.matmul(a, b))
        ctx.report["matmul_tflops"][label] = 2 * n**3 / statistics.median(times) / 1e12
        del a, b
    ctx.report["matmul_size"] = n
    ctx.free()


def _make_cell(ctx: _Context, T: int, d: int, dtype: str) -> _Cell:
    torch = ctx.torch
    gen = torch.Generator(device=ctx.device).manual_seed(1000 * T + d)
    shape = (ctx.args.batch, ctx.args.heads, T, d)
    q, k, v = (torch.randn(shape, generator=gen, device=ctx.device, dtype=torch.float32)
               .to(getattr(torch, dtype)) for _ in range(3))
    # The oracle sees the same dtype-rounded inputs, in float64 on the same device.
    oracle = causal_linear_attention(*(x.to(torch.float64) for x in (q, k, v)),
                                     chunk_size=ctx.args.chunk_size)
    return _Cell(T, d, dtype, q, k, v, oracle)


# --------------------------------------------------------------------------------------------
# report: ratios, targets, summary, files


def _lookup(report: dict) -> dict:
    table = {}
    for r in report["results"]:
        if r.get("status") == "ok":
            table[(r["impl"], r["backend"], r["T"], r["d"], r["dtype"], r["pass"])] = r["median_s"]
    return table


def _ratios(report: dict) -> list[dict]:
    """Time ratios measured in the same run (< 1: the numerator is faster)."""
    table = _lookup(report)
    torch_b = report["backends"]["torch"]
    second_b = report["backends"]["second"]
    pairs = [
        ("polylin_over_fla", ("polylin_chunked", torch_b), ("fla_chunk", torch_b)),
        ("polylin_over_sdpa", ("polylin_chunked", torch_b), ("sdpa", torch_b)),
        ("polylin_over_quadratic", ("polylin_chunked", torch_b), ("masked_quadratic", torch_b)),
        ("second_over_torch", ("polylin_chunked", second_b), ("polylin_chunked", torch_b)),
        ("tf32_over_highest", ("polylin_chunked_tf32", torch_b), ("polylin_chunked", torch_b)),
    ]
    out = []
    keys = sorted({k[2:] for k in table})
    for T, d, dtype, p in keys:
        for label, num, den in pairs:
            a, b = table.get((*num, T, d, dtype, p)), table.get((*den, T, d, dtype, p))
            if a is not None and b is not None:
                out.append({"ratio": label, "T": T, "d": d, "dtype": dtype, "pass": p,
                            "value": a / b})
    return out


def _targets(report: dict) -> list[dict]:
    """The issue's targets, judged only on what this run measured."""
    ratios = report["ratios"]

    def pick(label: str, pred: Callable[[dict], bool]) -> list[dict]:
        return [r for r in ratios if r["ratio"] == label and pred(r)]

    def judge(name: str, rows: list[dict], ok: Callable[[float], bool]) -> dict:
        if not rows:
            return {"target": name, "status": "not measured", "cells": []}
        cells = [{**{k: r[k] for k in ("T", "d", "dtype", "pass")}, "ratio": r["value"],
                  "met": ok(r["value"])} for r in rows]
        return {"target": name, "status": "met" if all(c["met"] for c in cells) else "missed",
                "cells": cells}

    return [
        judge("polylin torch chunked within 3x of fla chunk_linear_attn at T=8k, forward",
              pick("polylin_over_fla", lambda r: r["T"] == 8192 and r["pass"] == "forward"),
              lambda x: x <= 3.0),
        judge("polylin torch chunked faster than SDPA (flash) from T=8k on",
              pick("polylin_over_sdpa", lambda r: r["T"] >= 8192), lambda x: x < 1.0),
        judge(f"{report['backends']['second']} within 1.5x of {report['backends']['torch']} "
              "on the same inputs",
              pick("second_over_torch", lambda r: True), lambda x: x <= 1.5),
    ]


def summarize(report: dict) -> str:
    """A plain-text summary of a report: forward/backward times, ratios and targets.

    Parameters
    ----------
    report : dict
        The JSON report written by :func:`run` (loaded with ``json.load``).

    Returns
    -------
    str
        Lines for a terminal or a log.

    Examples
    --------
    >>> from polylin.bench.gpu import summarize
    >>> print(summarize({"meta": {"device": "cpu"}, "results": [], "seed_loop": [],
    ...                  "ratios": [], "targets": []}))
    polylin bench-gpu on cpu: 0 measurements ok, 0 skipped, 0 errors
    """
    meta = report.get("meta", {})
    results = report.get("results", [])
    n = {s: sum(r.get("status") == s for r in results) for s in ("ok", "skipped", "error")}
    lines = [f"polylin bench-gpu on {meta.get('device', '?')}: {n['ok']} measurements ok, "
             f"{n['skipped']} skipped, {n['error']} errors"]
    if meta.get("stopped_early"):
        lines.append("stopped early: time budget reached (cells not run: "
                     f"{meta.get('cells_not_run')})")
    if meta.get("fla"):
        lines.append(f"fla: {meta['fla']}")
    if report.get("matmul_tflops"):
        rates = ", ".join(f"{k} {v:.1f}" for k, v in report["matmul_tflops"].items())
        lines.append(f"matmul rate (TFLOP/s, n={report.get('matmul_size')}): {rates}")
    ok = [r for r in results if r.get("status") == "ok"]
    if ok:
        lines.append(f"{'T':>6} {'d':>4} {'dtype':<9} {'pass':<17} {'impl':<21} {'backend':<11} "
                     f"{'ms':>10} {'max|diff|':>10}")
        for r in sorted(ok, key=lambda r: (r["d"], r["dtype"], r["pass"], r["T"], r["impl"])):
            diff = r.get("max_abs_diff_vs_float64")
            lines.append(f"{r['T']:>6} {r['d']:>4} {r['dtype']:<9} {r['pass']:<17} "
                         f"{r['impl']:<21} {r['backend']:<11} {r['median_s'] * 1e3:>10.3f} "
                         f"{'' if diff is None else f'{diff:.2e}':>10}")
    for s in report.get("seed_loop", []):
        if s.get("status") == "ok":
            lines.append(f"seed loop d={s['d']} {s['dtype']}: "
                         f"{s['per_token_s'] * 1e6:.1f} us/token at T={s['T_measured']} "
                         "(longer T: extrapolated)")
    errors = [r for r in results if r.get("status") == "error"]
    for r in errors[:10]:
        lines.append(f"error: {r['impl']} T={r.get('T')} d={r.get('d')} {r.get('dtype')} "
                     f"{r.get('pass')}: {r.get('reason')}")
    for t in report.get("targets", []):
        lines.append(f"target [{t['status']}]: {t['target']}")
        for c in t["cells"]:
            lines.append(f"    T={c['T']} d={c['d']} {c['dtype']} {c['pass']}: ratio "
                         f"{c['ratio']:.2f} {'met' if c['met'] else 'missed'}")
    return "\n".join(lines)


def _write(report: dict, out_dir: Path) -> Path:
    path = out_dir / JSON_NAME
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
    return path


def _plot(report: dict, out_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    ok = [r for r in report["results"] if r.get("status") == "ok"]
    combos = sorted({(r["d"], r["dtype"]) for r in ok})
    if not combos:
        return None
    every = sorted({(r["impl"], r["backend"]) for r in ok})
    colors = {s: f"C{i % 10}" for i, s in enumerate(every)}  # one colour per series, all panels
    fig, axes = plt.subplots(len(PASSES), len(combos), figsize=(4.2 * len(combos), 7),
                             squeeze=False, sharex=True)
    for col, (d, dtype) in enumerate(combos):
        for row, p in enumerate(PASSES):
            ax = axes[row][col]
            series = sorted({(r["impl"], r["backend"]) for r in ok
                             if r["d"] == d and r["dtype"] == dtype and r["pass"] == p})
            for impl, backend in series:
                pts = sorted((r["T"], r["median_s"]) for r in ok if r["impl"] == impl
                             and r["backend"] == backend and r["d"] == d
                             and r["dtype"] == dtype and r["pass"] == p)
                ax.plot([t for t, _ in pts], [s * 1e3 for _, s in pts], marker="o",
                        color=colors[(impl, backend)], label=f"{impl} [{backend}]")
            if p == "forward":
                for s in report["seed_loop"]:
                    if s.get("status") == "ok" and s["d"] == d and s["dtype"] == dtype:
                        ext = sorted((int(t), v) for t, v in s["extrapolated_s"].items())
                        ax.plot([t for t, _ in ext], [v * 1e3 for _, v in ext], "k:",
                                label="seed loop (extrapolated)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{p}, d={d}, {dtype}", fontsize=9)
            ax.set_xlabel("T")
            ax.set_ylabel("median ms")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(f"polylin bench-gpu on {report['meta'].get('device_name', '?')}", fontsize=10)
    fig.tight_layout()
    path = out_dir / PNG_NAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# entry point


def _meta(ctx: _Context, argv: Sequence[str]) -> dict:
    torch = ctx.torch
    meta = {
        "polylin": __version__,
        "device": ctx.args.device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "argv": list(argv),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": {"batch": ctx.args.batch, "heads": ctx.args.heads,
                  "chunk_size": ctx.args.chunk_size},
        # polylin never changes these; they are recorded so the numbers can be read right.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_allow_tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "env": {k: os.environ.get(k) for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUPY_TF32",
                                                 "NVIDIA_TF32_OVERRIDE", "POLYLIN_BACKENDS")},
        "timing": "median of up to --repeats runs after one warm-up, each ended by a device "
                  "synchronize; inputs are made and converted outside the timer",
        "fla": None,
    }
    if ctx.on_cuda:
        props = torch.cuda.get_device_properties(0)
        meta["device_name"] = props.name
        meta["device_memory_bytes"] = int(props.total_memory)
        meta["cuda"] = torch.version.cuda
    else:
        meta["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
    return meta


def run(args: argparse.Namespace) -> int:
    """Run the GPU benchmark described by ``args``; write JSON (and PNG) to ``args.out``.

    Parameters
    ----------
    args : argparse.Namespace
        Flags from :func:`add_arguments`.

    Returns
    -------
    int
        0 when it ran (measurements that failed are recorded, not raised), 2 when the device
        asked for is not there.

    Examples
    --------
    >>> import argparse, json, tempfile
    >>> from polylin.bench.gpu import add_arguments, run
    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> out = tempfile.mkdtemp()
    >>> args = p.parse_args(["--device", "cpu", "--seq-lens", "32", "--dims", "4",
    ...                      "--dtypes", "float32", "--batch", "1", "--heads", "2",
    ...                      "--repeats", "1", "--seed-loop-len", "8", "--no-plot",
    ...                      "--out", out])
    >>> import contextlib, io
    >>> with contextlib.redirect_stdout(io.StringIO()):
    ...     code = run(args)
    >>> code
    0
    >>> report = json.load(open(out + "/bench-gpu.json"))
    >>> sorted({r["impl"] for r in report["results"] if r["status"] == "ok"})
    ['masked_quadratic', 'polylin_chunked', 'sdpa']
    """
    if args.summary_of:
        print(summarize(json.loads(Path(args.summary_of).read_text())))
        return 0
    try:
        import torch
    except ImportError as exc:
        print(f"bench-gpu needs PyTorch ({exc})", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench-gpu --device cuda: no CUDA device here (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 2
    torch_backend = Backend.TORCH_CUDA if args.device == "cuda" else Backend.TORCH
    second = Backend.CUPY if args.device == "cuda" else Backend.NUMPY
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.time_budget if args.time_budget is not None else None
    report: dict = {"schema": SCHEMA, "meta": {}, "libraries": {}, "matmul_tflops": {},
                    "backends": {"torch": str(torch_backend), "second": str(second)},
                    "results": [], "seed_loop": [], "ratios": [], "targets": []}
    ctx = _Context(args, torch, torch.device(args.device), torch_backend, second, deadline,
                   report, out_dir)
    report["meta"] = _meta(ctx, sys.argv)
    report["libraries"]["cupy"] = None
    if second is Backend.CUPY and second.available():
        report["libraries"]["cupy"] = second.module().__version__
    report["meta"]["second_backend_unavailable"] = second.unavailable_reason()
    try:
        ctx.fla, fla_version = _load_fla(args.device)
        report["meta"]["fla"] = f"fla {fla_version}: chunk_linear_attn(normalize=True, scale=1.0)"
    except _Skip as skip:
        ctx.fla_reason = str(skip)
        report["meta"]["fla"] = str(skip)
    print(f"polylin bench-gpu: {report['meta']['device_name']}, torch {torch.__version__}, "
          f"second backend {second}, {report['meta']['fla']}", flush=True)

    _matmul_rates(ctx)
    cells = [(T, d, dtype) for T in args.seq_lens for d in args.dims for dtype in args.dtypes]
    not_run = []
    for i, (T, d, dtype) in enumerate(cells):
        if ctx.out_of_time():
            not_run = cells[i:]
            break
        print(f"[{time.monotonic() - started:7.1f}s] T={T} d={d} {dtype}", flush=True)
        try:
            cell = _make_cell(ctx, T, d, dtype)
        except Exception as exc:
            _record(report, impl="inputs", backend=str(torch_backend), T=T, d=d, dtype=dtype,
                    **{"pass": "forward"}, status="error",
                    reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            ctx.free()
            continue
        for name in IMPLS:
            _measure_impl(ctx, cell, name)
        _seed(ctx, cell)
        del cell
        ctx.free()
        report["ratios"] = _ratios(report)
        report["targets"] = _targets(report)
        _write(report, out_dir)
    report["meta"]["stopped_early"] = bool(not_run)
    report["meta"]["cells_not_run"] = [list(c) for c in not_run]
    report["meta"]["seconds"] = time.monotonic() - started
    report["ratios"] = _ratios(report)
    report["targets"] = _targets(report)
    path = _write(report, out_dir)
    png = None if args.no_plot else _plot(report, out_dir)
    print(summarize(report))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m polylin.bench.gpu``: the same as ``python -m polylin bench-gpu``."""
    parser = argparse.ArgumentParser(prog="python -m polylin.bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
