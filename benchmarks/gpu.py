"""The GPU benchmark: ``python benchmarks/run.py gpu`` (run by ``backends/gpu-check.sh``).

What it times, on the same inputs ``(batch, heads, T, d)``, with the implementations of
:mod:`benchmarks.registry`:

- ``chunked`` on PyTorch (``torch:cuda``) and on CuPy (float32 only: CuPy has no
  bfloat16), forward and, for PyTorch, forward + backward (``out.sum().backward()``);
- ``chunked_tf32``: the same PyTorch call with TF32 matmuls switched on for the call only
  (float32 inputs), to show what the precision setting is worth;
- ``quadratic``: polylin's masked kernel form, skipped where its T x T matrices would not
  fit a memory cap;
- ``sdpa``: PyTorch's ``scaled_dot_product_attention(is_causal=True)`` (softmax attention: a
  different function, timed only), restricted to the flash kernel, else the memory-efficient one;
- ``fla_chunk``: ``fla.ops.linear_attn.chunk_linear_attn(normalize=True, scale=1.0)`` from
  flash-linear-attention, when it can be imported, on the same inputs converted to its
  ``(B, T, H, D)`` layout (outside the timer) with polylin's ``elu(x) + 1`` applied to q and k
  inside the timed call;
- ``seed_loop``: the original per-token PyTorch loop, timed at a short length; its cost at
  every other length is the per-token cost times T, recorded as an *extrapolation*.

Every output is compared with polylin's float64 chunked result on the same device
(``max_abs_diff_vs_float64``) and checked to be on the input's device. Times are medians of
repeats after a warm-up, each stopped by the backend's synchronization (the timer, the flop
model, the run metadata and the targets file are those of the CPU benchmark). Results go to
JSON after every cell (so a run cut short keeps what it measured) and to a PNG when matplotlib
is there.

``--device cpu`` runs the same code paths on the CPU with NumPy standing in for CuPy; the test
suite uses it as a smoke test with tiny sizes. Nothing here changes global precision settings:
the TF32 variant sets and restores them around its own call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polylin import causal_linear_attention
from polylin.testing import Backend

from . import baselines
from . import targets as target_file
from .model import chunked_useful_flops, gemm_flops, quadratic_bytes
from .registry import MODES, REGISTRY, Setup, Skip, _float32_matmul_precision, make_call
from .timing import run_metadata, time_call

__all__ = ["DEFAULT_SEQ_LENS", "JSON_NAME", "PNG_NAME", "SCHEMA", "add_arguments", "run",
           "summarize"]

#: Version tag of the JSON report; bump it when fields change meaning.
#: 2: implementations named as in the registry, the shared flop model, targets with cells.
SCHEMA = "polylin-bench-gpu/2"

#: Sequence lengths, 8k first: the targets are stated at T = 8k, so a run cut short by its time
#: budget still has them.
DEFAULT_SEQ_LENS = (8192, 1024, 2048, 4096, 16384, 32768, 65536)

PASSES = MODES
JSON_NAME = "bench-gpu.json"
PNG_NAME = "bench-gpu.png"

#: What runs in each cell: (implementation, backend role). The "second" backend is CuPy on
#: CUDA (NumPy with --device cpu), fed the torch inputs through DLPack.
RUNS = (
    ("chunked", "torch"),
    ("chunked_tf32", "torch"),
    ("chunked", "second"),
    ("quadratic", "torch"),
    ("sdpa", "torch"),
    ("fla_chunk", "torch"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the GPU benchmark's flags on ``parser`` and set its entry point.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The ``bench-gpu`` subparser (or any parser).

    Examples
    --------
    >>> import argparse
XX    """
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
    seed_done: set = field(default_factory=set)

    @property
    def on_cuda(self) -> bool:
        return self.args.device == "cuda"

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def free(self) -> None:
        if self.on_cuda:
            self.torch.cuda.empty_cache()
            if self.second_backend is Backend.CUPY and self.second_backend.available():
                self.second_backend.module().get_default_memory_pool().free_all_blocks()


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


def _measure_impl(ctx: _Context, cell: _Cell, name: str, role: str) -> None:
    impl = REGISTRY[name]
    backend = ctx.torch_backend if role == "torch" else ctx.second_backend
    base = {"T": cell.T, "d": cell.d, "dtype": cell.dtype, "impl": name, "backend": str(backend)}
    setup = Setup(backend, dtype=cell.dtype, chunk_size=ctx.args.chunk_size, dim=cell.d,
                  on_gpu=ctx.on_cuda)
    try:
        xs = _inputs_for(ctx, cell, backend)
        if name == "quadratic":
            cap = ctx.args.quadratic_max_gib
            cap = (24.0 if ctx.on_cuda else 1.0) if cap is None else cap
            need = quadratic_bytes(cell.q.shape[0] * cell.q.shape[1], cell.T, "float32") / 2**30
            if need > cap:
                raise Skip(f"T x T matrices need ~{need:.0f} GiB > cap {cap:g} GiB")
        calls = {p: make_call(impl, setup, xs, p) for p in PASSES[:1]}
    except Skip as skip:
        for p in PASSES:
            _record(ctx.report, **base, **{"pass": p}, status="skipped", reason=str(skip))
        return
    except Exception as exc:
        _record(ctx.report, **base, **{"pass": "forward"}, status="error",
                reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        ctx.free()
        return
    variant = getattr(impl.build(setup), "variant", None) if name == "sdpa" else None
    for p in PASSES:
        if ctx.out_of_time():
            _record(ctx.report, **base, **{"pass": p}, status="skipped", reason="time budget")
            continue
        rec: dict[str, Any] = {**base, "pass": p}
        if variant:
            rec["variant"] = variant
        try:
            if p != "forward":
                if ctx.args.no_backward:
                    raise Skip("backward not run (--no-backward)")
                if name == "chunked_tf32":
                    raise Skip("forward only for this implementation")
                calls[p] = make_call(impl, setup, xs, p)
        except Skip as skip:
            _record(ctx.report, **rec, status="skipped", reason=str(skip))
            continue
        try:
            if ctx.on_cuda:
                ctx.torch.cuda.reset_peak_memory_stats()
            timing = time_call(backend, calls[p], repeats=ctx.args.repeats,
                               budget_s=ctx.args.max_seconds)
            out, timing.output = timing.output, None
            rec.update(status="ok", median_s=timing.median, times_s=timing.times,
                       repeats=len(timing.times))
            if ctx.on_cuda and backend is Backend.TORCH_CUDA:
                rec["peak_allocated_bytes"] = int(ctx.torch.cuda.max_memory_allocated())
            if p == "forward" and impl.compare and out is not None:
                back = _to_torch(ctx, out, backend)
                if impl.from_layout is not None:
                    back = impl.from_layout(back)
                rec["output_library"] = type(out).__module__.split(".")[0]
                rec["output_device"] = str(back.device)
                rec["output_on_input_device"] = back.device == cell.q.device
                rec["max_abs_diff_vs_float64"] = _diff(ctx.torch, back, cell.oracle)
            if name.startswith("chunked") and p == "forward":
                rec["model_flops"] = _chunked_flops(cell, ctx)
        except Exception as exc:  # OOM and friends: keep going with the next measurement
            rec.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        _record(ctx.report, **rec)
        out = None
        ctx.free()


def _inputs_for(ctx: _Context, cell: _Cell, backend: Backend) -> list[Any]:
    if backend is ctx.torch_backend:
        return [cell.q, cell.k, cell.v]
    reason = backend.unavailable_reason()
    if reason is not None:
        raise Skip(f"{backend}: {reason}")
    if cell.dtype == "bfloat16":
        raise Skip(f"{backend} has no bfloat16")
    # DLPack: the very same device memory as the torch inputs, no host round trip.
    return [backend.module().from_dlpack(x.detach()) for x in (cell.q, cell.k, cell.v)]


def _to_torch(ctx: _Context, out: Any, backend: Backend) -> Any:
    return out if backend is ctx.torch_backend else ctx.torch.from_dlpack(out)


def _chunked_flops(cell: _Cell, ctx: _Context) -> float:
    """Useful flops of the chunked forward (the shared model, :mod:`benchmarks.model`)."""
    B, H = cell.q.shape[0], cell.q.shape[1]
    return float(chunked_useful_flops(B * H, cell.T, cell.d, cell.d, ctx.args.chunk_size))


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
        timing = time_call(ctx.torch_backend, lambda: baselines.seed_loop(q, k, v),
                           repeats=ctx.args.repeats, budget_s=ctx.args.max_seconds)
        out, times = timing.output, timing.times
        per_token = timing.median / Ts
        oracle = cell.oracle[:, :, :Ts, :].reshape(B * H, Ts, cell.d)  # causal: a prefix
        rec.update(status="ok", median_s=timing.median, times_s=times,
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
        with _float32_matmul_precision(precision or torch.get_float32_matmul_precision()):
            timing = time_call(ctx.torch_backend, lambda a=a, b=b: torch.matmul(a, b),
                               repeats=ctx.args.repeats, budget_s=ctx.args.max_seconds)
        ctx.report["matmul_tflops"][label] = gemm_flops(n) / timing.median / 1e12
        del a, b, timing
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
        ("polylin_over_fla", ("chunked", torch_b), ("fla_chunk", torch_b)),
        ("polylin_over_sdpa", ("chunked", torch_b), ("sdpa", torch_b)),
        ("polylin_over_quadratic", ("chunked", torch_b), ("quadratic", torch_b)),
        ("second_over_torch", ("chunked", second_b), ("chunked", torch_b)),
        ("tf32_over_highest", ("chunked_tf32", torch_b), ("chunked", torch_b)),
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
    """The targets of ``benchmarks/targets.toml`` (``[[gpu]]``), judged on this run only."""
    return target_file.evaluate(report, target_file.load("gpu"))


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
    >>> from benchmarks.gpu import summarize
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
            where = " ".join(f"{k}={c[k]}" for k in ("T", "d", "dtype", "pass") if k in c)
            lines.append(f"    {where}: ratio {c['value']:.2f} "
                         f"{'met' if c['met'] else 'missed'}")
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
    meta = run_metadata(
        "python benchmarks/run.py gpu " + " ".join(argv),
        device=ctx.args.device,
        shape={"batch": ctx.args.batch, "heads": ctx.args.heads,
               "chunk_size": ctx.args.chunk_size},
        # polylin never changes these; they are recorded so the numbers can be read right.
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        torch_allow_tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
        env={k: os.environ.get(k) for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUPY_TF32",
                                            "NVIDIA_TF32_OVERRIDE", "POLYLIN_BACKENDS")},
        timing="median of up to --repeats runs after one warm-up, each ended by the backend's "
               "synchronize; inputs are made and converted outside the timer",
        fla=None,
    )
    if ctx.on_cuda:
        props = torch.cuda.get_device_properties(0)
        meta["device_name"] = props.name
        meta["device_memory_bytes"] = int(props.total_memory)
        meta["cuda"] = torch.version.cuda
    else:
        meta["device_name"] = f"CPU ({meta['processor'] or meta['machine']})"
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
    """
    if args.summary_of:
        print(summarize(json.loads(Path(args.summary_of).read_text())))
        return 0
    try:
        import torch
    except ImportError as exc:
        print(f"the GPU benchmark needs PyTorch ({exc})", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu --device cuda: no CUDA device here (use --device cpu for a smoke run)",
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
    report["meta"] = _meta(ctx, getattr(args, "argv", None) or sys.argv[2:])
    report["libraries"]["cupy"] = None
    if second is Backend.CUPY and second.available():
        report["libraries"]["cupy"] = second.module().__version__
    report["meta"]["second_backend_unavailable"] = second.unavailable_reason()
    try:
        _, fla_version = baselines.load_fla(args.device)
        report["meta"]["fla"] = f"fla {fla_version}: chunk_linear_attn(normalize=True, scale=1.0)"
    except ImportError as exc:
        report["meta"]["fla"] = str(exc)
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
        for name, role in RUNS:
            _measure_impl(ctx, cell, name, role)
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
