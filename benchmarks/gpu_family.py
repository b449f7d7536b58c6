"""The recurrence family on the GPU: polylin against flash-linear-attention's Triton kernels.

    python benchmarks/gpu_family.py [--device cuda] [--seq-lens 8192 4096 16384 1024 65536]
        [--dims 64 128] [--dtypes bfloat16 float32] [--batch 2] [--heads 16]
        [--compile-ops OP ...] [--time-budget 150] [--json bench-family.json]

Run by ``backends/gpu-check.sh`` after ``benchmarks/run.py gpu`` (plain linear attention). Each
op below is one of flash-linear-attention's, which :mod:`polylin.compat.fla` provides under the
same name and signature; every implementation gets the same arguments, in fla's layout
``(B, T, H, d)`` with fla's default ``scale = d ** -0.5``:

- ``fla``: fla's own op (Triton), where ``fla`` imports and the device is CUDA;
- ``polylin``: :mod:`polylin.compat.fla`'s op on the same torch tensors;
- ``polylin_compiled`` (``--compile-ops``): ``torch.compile`` of that call for the ops named,
  at the first sequence length, dimension and dtype only, while at least 90 s of the budget
  are left (its compile time is recorded);
- ``polylin_graphed`` (CUDA): polylin's op replayed as CUDA graphs, the forward captured by
  ``torch.cuda.graph`` and the forward + backward by ``torch.cuda.make_graphed_callables``: the
  same kernels without the host's launch overhead (polylin's ops never synchronize, so they
  capture); decoding too, one token's call from a state;
- ``polylin_cupy``: :mod:`polylin.compat.fla`'s op on CuPy views of the same tensors (DLPack;
  float32 only, forward only). With ``--device cpu``, NumPy stands in for CuPy;
- ``sdpa``: flash softmax attention (``scaled_dot_product_attention(is_causal=True)``) on the
  same ``q, k, v``: the full-attention layers of the hybrid models, a different function.

Ops: ``chunk_linear_attn`` (``normalize=False``), ``chunk_simple_gla`` (a log decay per token),
``chunk_gla`` (one per key channel), ``chunk_gated_delta_rule`` and ``chunk_kda`` (both with
``use_qk_l2norm_in_kernel=True``, as Qwen3-Next and Kimi Linear call them). Passes: the
forward under ``torch.no_grad`` and forward + backward (``out.float().sum().backward()``).

Every output is compared with polylin's float64 result for the same op on the same device
(``max_abs_diff``). Decoding: the ops' one-token twins (``fused_recurrent_linear_attn``,
``fused_recurrent_gated_delta_rule``, ``fused_recurrent_kda``) called with ``T = 1`` and the
state of the previous token, batch 1 and 64, median time per token over a loop. Host
synchronization: each polylin op runs once under ``torch.cuda.set_sync_debug_mode("error")``,
where an operation that waits for the device raises; the result is recorded per op.

The decoding loops run first (seconds), then the cells in the order given (T = 8k first: the
goals are stated there) until ``--time-budget`` seconds are spent; the JSON is rewritten after
every cell, so a run cut short keeps what it measured. ``--device cpu`` runs the same code on
the CPU with tiny sizes (fla and the synchronization check are skipped there): the test
suite's smoke test. ``--summary-of JSON`` prints the summary of a report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.timing import run_metadata, time_call  # noqa: E402
from polylin.compat import fla as compat  # noqa: E402
from polylin.testing import Backend  # noqa: E402

SCHEMA = "polylin-bench-gpu-family/1"
#: Seconds of the budget that must be left to start a compilation (it cannot be interrupted).
COMPILE_RESERVE_S = 90.0
JSON_NAME = "bench-family.json"

#: op -> (its per-token inputs besides q, k, v, its extra keyword arguments).
OPS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "chunk_gated_delta_rule": (("g_token", "beta"), {"use_qk_l2norm_in_kernel": True}),
    "chunk_kda": (("g_channel", "beta"), {"use_qk_l2norm_in_kernel": True}),
    "chunk_linear_attn": ((), {"normalize": False}),
    "chunk_simple_gla": (("g_token",), {}),
    "chunk_gla": (("g_channel",), {}),
}

#: decoding op -> (the chunk op whose inputs it takes, its extra keyword arguments).
DECODE_OPS: dict[str, tuple[str, dict[str, Any]]] = {
    "fused_recurrent_linear_attn": ("chunk_linear_attn", {}),
    "fused_recurrent_gated_delta_rule": (
        "chunk_gated_delta_rule", {"use_qk_l2norm_in_kernel": True},
    ),
    "fused_recurrent_kda": ("chunk_kda", {"use_qk_l2norm_in_kernel": True}),
}  # fmt: skip

#: The goals of the GPU issue, as (ratio, limit, where).
GOALS = (
    ("polylin/fla", 2.0, "T = 8192, each op and pass, the best of eager, compiled and graphed"),
    ("polylin/sdpa", 1.0, "T >= 4096, bfloat16, each op and pass"),
    ("cupy/polylin", 1.3, "each op, forward, float32"),
)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """A ``TimeoutError`` raised in the block after ``seconds`` (``SIGALRM``; where there is no
    such signal, or off the main thread, no limit). A Triton autotuning that takes minutes for
    one shape is then one recorded error, not the end of the run's budget."""
    if (
        seconds <= 0
        or not hasattr(signal, "SIGALRM")
        or (threading.current_thread() is not threading.main_thread())
    ):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no result within {seconds:g} s (--call-limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _keyword_inputs(names: tuple[str, ...], x: dict[str, Any]) -> dict[str, Any]:
    key = {"g_token": "g", "g_channel": "g", "beta": "beta"}
    return {key[name]: x[name] for name in names}


def make_inputs(torch: Any, B: int, T: int, H: int, d: int, dtype: str, device: str) -> dict:
    """Random inputs in fla's layout: unit-scale ``q, k, v``, log decays in ``(-inf, 0)``
    (``logsigmoid / 16``, per token ``(B, T, H)`` and per channel ``(B, T, H, d)``), ``beta``
    in ``(0, 1)``; the dtype given."""
    F = torch.nn.functional
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g, device=device)

    x = {
        "q": randn(B, T, H, d),
        "k": randn(B, T, H, d),
        "v": randn(B, T, H, d),
        "g_token": F.logsigmoid(randn(B, T, H)) / 16,
        "g_channel": F.logsigmoid(randn(B, T, H, d)) / 16,
        "beta": torch.sigmoid(randn(B, T, H)),
    }
    return {name: t.to(getattr(torch, dtype)) for name, t in x.items()}


def op_call(module: Any, op: str, x: dict[str, Any]) -> Callable[[], Any]:
    """``module.<op>`` (fla's, polylin's twin or a compiled one) on the arrays of ``x`` at the
    time of the call: a call returning the output."""
    names, options = OPS[op]
    fn = getattr(module, op)
    return lambda: fn(x["q"], x["k"], x["v"], **_keyword_inputs(names, x), **options)[0]


def _backward(call: Callable[[], Any], x: dict[str, Any]) -> Callable[[], Any]:
    """Forward + backward of ``call`` on leaves made from ``x`` (``x`` is rebound in place)."""
    leaves = {name: t.detach().requires_grad_(True) for name, t in x.items()}
    x.update(leaves)

    def run() -> Any:
        for t in leaves.values():
            t.grad = None
        call().float().sum().backward()
        return leaves["q"].grad

    return run


def load_fla(device: str) -> tuple[Any | None, str]:
    """``fla.ops`` and its version, or ``None`` and why not."""
    if device != "cuda":
        return None, "fla not run: its Triton kernels need a CUDA device"
    try:
        import fla  # optional: only on the GPU machine, carried as a wheel
        import fla.ops
    except Exception as exc:  # ImportError, or a Triton/torch mismatch raising something else
        return None, f"fla not importable ({type(exc).__name__}: {exc})"
    return fla.ops, f"fla {getattr(fla, '__version__', 'unknown')}"


def second_backend(device: str) -> tuple[Backend, Callable[[Any], Any]] | None:
    """CuPy on CUDA (NumPy on the CPU) and a converter from torch tensors, or ``None``."""
    if device == "cuda":
        try:
            import cupy

            cupy.zeros(1)
        except Exception:
            return None
        return Backend.CUPY, cupy.from_dlpack
    import numpy as np

    return Backend.NUMPY, lambda t: np.asarray(t.detach())


class Run:
    """The state of one benchmark run: its report, its clock and its budget."""

    def __init__(self, args: argparse.Namespace, torch: Any) -> None:
        self.args, self.torch = args, torch
        self.backend = Backend.TORCH_CUDA if args.device == "cuda" else Backend.TORCH
        self.start = time.perf_counter()
        self.fla, fla_note = load_fla(args.device)
        self.second = second_backend(args.device)
        self.report: dict[str, Any] = {
            "schema": SCHEMA,
            "meta": run_metadata(
                "python benchmarks/gpu_family.py " + " ".join(sys.argv[1:]),
                device=args.device, fla=fla_note, batch=args.batch, heads=args.heads,
                gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            ),
            "rows": [], "decoding": [], "synchronization": {}, "ratios": [], "goals": [],
        }  # fmt: skip

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.start > self.args.time_budget

    def write(self) -> None:
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.report, indent=2) + "\n")

    def time(self, backend: Backend, fn: Callable[[], Any]) -> tuple[float, Any]:
        """The median of ``fn``'s timed calls and their :class:`Timing`, within
        ``--call-limit`` seconds (a ``TimeoutError`` past it)."""
        with time_limit(self.args.call_limit):
            timing = time_call(backend, fn, repeats=self.args.repeats, budget_s=2.0)
        return timing.median, timing

    def record(self, **fields: Any) -> None:
        self.report["rows"].append(fields)


def _max_diff(torch: Any, out: Any, reference: Any) -> float:
    out = torch.as_tensor(out, device=reference.device)
    return float((out.double() - reference).abs().max())


def measure_cell(run: Run, op: str, T: int, d: int, dtype: str, compiled: bool) -> None:
    """Every implementation of ``op`` at one size and dtype, both passes."""
    torch, args = run.torch, run.args
    base = make_inputs(torch, args.batch, T, args.heads, d, dtype, args.device)
    reference = op_call(compat, op, {n: t.double() for n, t in base.items()})().double()
    cell = {"op": op, "T": T, "d": d, "dtype": dtype}
    impls: dict[str, Any] = {"polylin": compat}
    if run.fla is not None:
        impls["fla"] = run.fla
    for name, module in impls.items():
        for mode in ("forward", "forward+backward"):
            x = dict(base)
            call = op_call(module, op, x)
            fn = _no_grad(torch, call) if mode == "forward" else _backward(call, x)
            try:
                seconds, timing = run.time(run.backend, fn)
            except Exception as exc:  # record, never stop the run
                run.record(**cell, impl=name, mode=mode, error=f"{type(exc).__name__}: {exc}")
                continue
            diff = _max_diff(torch, timing.output, reference) if mode == "forward" else None
            run.record(**cell, impl=name, mode=mode, ms=1e3 * seconds, max_abs_diff=diff)
    if args.device == "cuda":
        _measure_graphed(run, op, base, reference, cell)
    if compiled and args.time_budget - (time.perf_counter() - run.start) > COMPILE_RESERVE_S:
        _measure_compiled(run, op, base, reference, cell)
    if run.second is not None and dtype == "float32":
        backend, convert = run.second
        x = {n: convert(t) for n, t in base.items()}
        call = op_call(compat, op, x)
        seconds, timing = run.time(backend, call)
        diff = _max_diff(torch, timing.output, reference)
        run.record(**cell, impl=f"polylin_{backend.value}", mode="forward", ms=1e3 * seconds,
                   max_abs_diff=diff)  # fmt: skip
    if op == "chunk_linear_attn" and args.device == "cuda" and dtype == "bfloat16":
        _measure_sdpa(run, base, cell)


def _no_grad(torch: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return call()

    return run


def _measure_compiled(run: Run, op: str, base: dict, reference: Any, cell: dict) -> None:
    """``torch.compile`` of polylin's op, both passes; the first call's time is the compile."""
    torch = run.torch
    compiled = SimpleNamespace(**{op: torch.compile(getattr(compat, op), dynamic=False)})
    for mode in ("forward", "forward+backward"):
        x = dict(base)
        call = op_call(compiled, op, x)
        fn = _no_grad(torch, call) if mode == "forward" else _backward(call, x)
        start = time.perf_counter()
        try:
            run.backend.synchronize(fn())  # the compilation
            compile_s = time.perf_counter() - start
            seconds, timing = run.time(run.backend, fn)
        except Exception as exc:
            run.record(**cell, impl="polylin_compiled", mode=mode,
                       error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            continue
        diff = _max_diff(torch, timing.output, reference) if mode == "forward" else None
        run.record(**cell, impl="polylin_compiled", mode=mode, ms=1e3 * seconds,
                   max_abs_diff=diff, compile_s=compile_s)  # fmt: skip


def graph_forward(torch: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` (a forward, run under ``no_grad``) captured once as a CUDA graph: a call that
    replays it and returns its output buffer. Warmed up on a side stream, as capture requires
    (lazy initializations and cached constants happen there, outside the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = call()

    def replay() -> Any:
        graph.replay()
        return out

    return replay


def _measure_graphed(run: Run, op: str, base: dict, reference: Any, cell: dict) -> None:
    """polylin's op replayed as CUDA graphs: the forward captured with ``torch.cuda.graph``, the
    forward + backward with ``torch.cuda.make_graphed_callables`` (both the user's own PyTorch
    calls; polylin's ops never synchronize with the host, so they capture)."""
    torch = run.torch
    names, options = OPS[op]
    keys = ("q", "k", "v", *names)
    fn = getattr(compat, op)

    def positional(*arrays: Any) -> Any:
        x = dict(zip(keys, arrays))
        return fn(x["q"], x["k"], x["v"], **_keyword_inputs(names, x), **options)[0]

    for mode in ("forward", "forward+backward"):
        try:
            with time_limit(run.args.call_limit):  # the capture (warm-up calls included)
                if mode == "forward":
                    timed = graph_forward(torch, lambda: positional(*(base[n] for n in keys)))
                else:
                    leaves = [base[n].detach().clone().requires_grad_(True) for n in keys]
                    graphed = torch.cuda.make_graphed_callables(positional, tuple(leaves))

                    def timed(graphed: Any = graphed, leaves: list = leaves) -> Any:
                        for t in leaves:
                            t.grad = None
                        graphed(*leaves).float().sum().backward()
                        return leaves[0].grad

            seconds, timing = run.time(run.backend, timed)
        except Exception as exc:
            run.record(**cell, impl="polylin_graphed", mode=mode,
                       error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            continue
        diff = _max_diff(torch, timing.output, reference) if mode == "forward" else None
        run.record(**cell, impl="polylin_graphed", mode=mode, ms=1e3 * seconds,
                   max_abs_diff=diff)  # fmt: skip


def _measure_sdpa(run: Run, base: dict, cell: dict) -> None:
    torch = run.torch
    F = torch.nn.functional
    q, k, v = (base[n].transpose(1, 2).contiguous() for n in ("q", "k", "v"))  # (B, H, T, d)
    for mode in ("forward", "forward+backward"):
        x = {"q": q, "k": k, "v": v}

        def call(x: dict = x) -> Any:
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)

        fn = _no_grad(torch, call) if mode == "forward" else _backward(call, x)
        try:
            seconds, _ = run.time(run.backend, fn)
        except Exception as exc:
            run.record(**{**cell, "op": "sdpa"}, impl="sdpa", mode=mode, error=str(exc))
            continue
        run.record(**{**cell, "op": "sdpa"}, impl="sdpa", mode=mode, ms=1e3 * seconds)


def check_synchronization(run: Run, d: int) -> None:
    """Whether each polylin op waits for the device inside a call (CUDA only)."""
    torch = run.torch
    x = make_inputs(torch, 1, 256, 2, d, "float32", "cuda")
    for op in OPS:
        call = op_call(compat, op, x)
        call()  # first call: lazy initializations are not the op's
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            run.report["synchronization"][op] = "none"
        except RuntimeError as exc:
            run.report["synchronization"][op] = f"synchronizes: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode("default")


def decode_loop(
    fn: Callable[..., Any],
    tokens: list[dict[str, Any]],
    names: tuple[str, ...],
    options: dict[str, Any],
    torch: Any,
) -> Callable[[], Any]:
    """A decoding loop: ``fn`` once per token (``T = 1``), each call given the state the one
    before returned; the call returns the outputs joined along T."""

    def loop() -> Any:
        state, outs = None, []
        for x in tokens:
            o, state = fn(
                x["q"], x["k"], x["v"], **_keyword_inputs(names, x), **options,
                initial_state=state, output_final_state=True,
            )  # fmt: skip
            outs.append(o)
        return torch.cat(outs, dim=1)

    return loop


def measure_decoding(run: Run, batch: int, d: int, tokens: int) -> None:
    """Per-token time of each one-token op in a loop that feeds the state into the next."""
    torch, args = run.torch, run.args
    x = make_inputs(torch, batch, tokens, args.heads, d, "float32", args.device)
    per_token = [{n: t[:, i : i + 1].contiguous() for n, t in x.items()} for i in range(tokens)]
    impls: dict[str, Any] = {"polylin": compat}
    if run.fla is not None:
        impls["fla"] = run.fla
    for op, (chunk_op, options) in DECODE_OPS.items():
        names, _ = OPS[chunk_op]
        outputs = {}
        for name, module in impls.items():
            loop = decode_loop(getattr(module, op), per_token, names, options, torch)
            with torch.no_grad():
                seconds, timing = run.time(run.backend, loop)
            outputs[name] = timing.output
            row = {"op": op, "batch": batch, "d": d, "impl": name}
            run.report["decoding"].append({**row, "us_per_token": 1e6 * seconds / tokens})
            if name == "polylin" and args.device == "cuda":
                _decode_graphed(run, getattr(module, op), per_token[0], names, options, row)
        if "fla" in outputs:
            diff = float((outputs["fla"].double() - outputs["polylin"].double()).abs().max())
            run.report["decoding"][-1]["max_abs_diff_vs_polylin"] = diff


def _decode_graphed(
    run: Run,
    fn: Callable[..., Any],
    x: dict[str, Any],
    names: tuple[str, ...],
    options: dict[str, Any],
    row: dict[str, Any],
) -> None:
    """One token's call from a state, captured as a CUDA graph and replayed: the time per
    token without the host's launch overhead (what a decoding loop under CUDA graphs pays)."""
    torch = run.torch
    state = fn(x["q"], x["k"], x["v"], **_keyword_inputs(names, x), **options,
               output_final_state=True)[1]  # fmt: skip

    def call() -> Any:
        return fn(x["q"], x["k"], x["v"], **_keyword_inputs(names, x), **options,
                  initial_state=state, output_final_state=True)[0]  # fmt: skip

    try:
        seconds, _ = run.time(run.backend, graph_forward(torch, call))
    except Exception as exc:
        run.report["decoding"].append({**row, "impl": "polylin_graphed",
                                       "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
        return
    run.report["decoding"].append({**row, "impl": "polylin_graphed", "us_per_token": 1e6 * seconds})


def ratios(report: dict) -> list[dict]:
    """polylin over fla, polylin over flash softmax attention, CuPy over torch, per cell."""
    times: dict[tuple, float] = {}
    for r in report["rows"]:
        if "ms" in r:
            times[(r["op"], r["T"], r["d"], r["dtype"], r["mode"], r["impl"])] = r["ms"]
    out = []
    for (op, T, d, dtype, mode, impl), ms in sorted(times.items()):
        if impl != "polylin":
            continue
        best = min(
            ms,
            *(times.get((op, T, d, dtype, mode, impl), math.inf)
              for impl in ("polylin_compiled", "polylin_graphed")),
        )  # fmt: skip
        cell = {"op": op, "T": T, "d": d, "dtype": dtype, "mode": mode}
        theirs = times.get((op, T, d, dtype, mode, "fla"))
        if theirs is not None:
            out.append({**cell, "ratio": "polylin/fla", "value": best / theirs})
        sdpa = times.get(("sdpa", T, d, dtype, mode, "sdpa"))
        if sdpa is not None:
            out.append({**cell, "ratio": "polylin/sdpa", "value": best / sdpa})
        for second in ("polylin_cupy", "polylin_numpy"):
            other = times.get((op, T, d, dtype, mode, second))
            if other is not None:
                out.append({**cell, "ratio": "cupy/polylin", "value": other / ms})
    return out


def goals(report: dict) -> list[dict]:
    """Each goal of :data:`GOALS`: the cells it covers, met where every ratio is at its limit."""
    out = []
    for ratio, limit, where in GOALS:
        cells = [
            r for r in report["ratios"]
            if r["ratio"] == ratio
            and (ratio != "polylin/fla" or r["T"] == 8192)
            and (ratio != "polylin/sdpa" or (r["T"] >= 4096 and r["dtype"] == "bfloat16"))
        ]  # fmt: skip
        worst = max((r["value"] for r in cells), default=None)
        out.append({
            "ratio": ratio, "limit": limit, "where": where, "cells": len(cells), "worst": worst,
            "met": None if worst is None else worst <= limit,
        })  # fmt: skip
    return out


def summarize(report: dict) -> str:
    """The report as text: times per cell, decoding, synchronization, goals."""
    lines = [f"polylin GPU family benchmark on {report['meta']['device']}: {report['meta']['fla']}"]
    lines.append(f"{'op':24s} {'T':>6s} {'d':>4s} {'dtype':9s} {'pass':17s} {'impl':17s} "
                 f"{'ms':>9s} {'max|diff|':>10s}")  # fmt: skip
    for r in report["rows"]:
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'error':>9s}"
        diff = r.get("max_abs_diff")
        lines.append(f"{r['op']:24s} {r['T']:6d} {r['d']:4d} {r['dtype']:9s} {r['mode']:17s} "
                     f"{r['impl']:17s} {ms} {'' if diff is None else f'{diff:10.2e}'}"
                     + (f"  {r['error'][:80]}" if "error" in r else ""))  # fmt: skip
    for r in report["decoding"]:
        took = f"{r['us_per_token']:.1f} us/token" if "us_per_token" in r else r.get("error")
        lines.append(f"decode {r['op']} batch {r['batch']} d {r['d']} {r['impl']}: {took}")
    for op, result in report["synchronization"].items():
        lines.append(f"host synchronization in {op}: {result}")
    for r in report["ratios"]:
        lines.append(f"{r['ratio']} {r['op']} T={r['T']} d={r['d']} {r['dtype']} {r['mode']}: "
                     f"{r['value']:.2f}")  # fmt: skip
    for g in report["goals"]:
        state = {None: "not measured", True: "met", False: "MISS"}[g["met"]]
        worst = "" if g["worst"] is None else f", worst {g['worst']:.2f} of {g['cells']} cells"
        lines.append(f"goal [{state}] {g['ratio']} <= {g['limit']} ({g['where']}){worst}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 4096, 16384, 1024, 65536])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compile-ops",
        nargs="*",
        default=[],
        choices=list(OPS),
        help="also time torch.compile of these ops (first cell only)",
    )
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--time-budget", type=float, default=150.0, help="seconds")
    parser.add_argument(
        "--call-limit", type=float, default=45.0,
        help="seconds for one implementation's warm-up and timed calls (0: none)",
    )  # fmt: skip
    parser.add_argument("--json", default=JSON_NAME)
    parser.add_argument("--summary-of", metavar="JSON", help="print a report's summary only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.summary_of:
        print(summarize(json.loads(Path(args.summary_of).read_text())))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke test", file=sys.stderr)
        return 2
    run = Run(args, torch)
    print(f"polylin GPU family benchmark: {run.report['meta']['fla']}", flush=True)
    if args.device == "cuda":
        with contextlib.suppress(Exception):
            check_synchronization(run, args.dims[0])
    for batch in args.decode_batches:  # first: a few seconds, never starved by long cells
        measure_decoding(run, batch, args.dims[0], args.decode_tokens)
    first = True
    for T in args.seq_lens:
        for d in args.dims:
            for dtype in args.dtypes:
                for op in args.ops:
                    if run.out_of_time():
                        break
                    measure_cell(run, op, T, d, dtype, compiled=first and op in args.compile_ops)
                    run.write()
                first = False
    run.report["ratios"] = ratios(run.report)
    run.report["goals"] = goals(run.report)
    run.report["meta"]["seconds"] = time.perf_counter() - run.start
    run.write()
    print(summarize(run.report))
    return 0 if not any("error" in r for r in run.report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
