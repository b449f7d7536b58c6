"""The CPU benchmark: ``python benchmarks/run.py cpu`` (and ``make bench``).

It sweeps implementation x backend x T x d on the CPU backends (NumPy and PyTorch by default,
any other by ``--backends``), with the baselines in the same run (implementations from
:mod:`benchmarks.registry`):

- ``chunked``: polylin's default path (what is being measured);
- ``plain``: a plain, unblocked chunked form in array-API code;
- ``quadratic``: polylin's masked kernel form, skipped where its T x T matrices would pass
  ``--quadratic-budget-mb``;
- ``recurrent``: polylin's per-token form, and ``seed``: the original PyTorch loop as
  written; both are timed up to ``--loop-max-len`` and extrapolated per token beyond
  (marked ``~`` in the table, ``"extrapolated": true`` in the JSON);
- ``sdpa``: PyTorch's causal softmax attention (a different function, timed only).

``--passes forward forward+backward`` also times the backward pass (PyTorch autograd,
``jax.grad``) and its peak memory. It also times a large float32 matmul per backend, so that the
chunked path's useful flops per second (:func:`benchmarks.model.chunked_useful_flops`) can be
given as a fraction of the machine's GEMM rate; decoding with :func:`polylin.step` at several
positions; and the chunked path's peak memory for one long head. Times are medians of repeats
after a warm-up; every ratio is taken within the same run; the targets come from
``benchmarks/targets.toml``. Results go to ``bench.json`` and, with matplotlib, ``bench.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polylin import DEFAULT_CHUNK_SIZE
from polylin.testing import Backend

from . import targets as target_file
from .model import ITEMSIZE, chunked_useful_flops, quadratic_bytes
from .registry import MODES, REGISTRY, Setup, Skip, make_call

__all__ = ["JSON_NAME", "METHODS", "PNG_NAME", "SCHEMA", "add_arguments", "run"]

#: Version tag of the JSON report; bump it when fields change meaning.
SCHEMA = "polylin-bench/1"

#: What the sweep times by default (``seed`` and ``sdpa`` run on PyTorch only).
METHODS = ("chunked", "plain", "quadratic", "recurrent", "seed", "sdpa")

#: (full default, --quick default) of the sizing flags.
_DEFAULTS = {
    "seq_lens": ([256, 1024, 4096, 16384, 65536], [64, 128]),
    "dims": ([64, 128], [16]),
    "batch": (8, 2),
    "repeats": (5, 1),
    "cell_seconds": (2.0, 0.5),
    "loop_max_len": (4096, 128),
    "decode_positions": ([1, 1024, 65536], [1, 64]),
    "decode_steps": (50, 3),
    "memory_len": (65536, 128),
    "gemm_size": (2048, 64),
}

JSON_NAME, PNG_NAME = "bench.json", "bench.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the benchmark's flags on ``parser`` and set its entry point."""
    backends = [b.value for b in Backend]
    parser.add_argument(
        "--backends", nargs="+", default=["numpy", "torch"], choices=backends, metavar="NAME",
        help=f"backends to sweep (default: numpy torch; any of {', '.join(backends)})",
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=sorted(REGISTRY), metavar="NAME",
        help=f"implementations to time (default: {' '.join(METHODS)}; any of "
        f"{', '.join(sorted(REGISTRY))})",
    )
    parser.add_argument(
        "--passes", nargs="+", default=["forward"], choices=MODES, metavar="PASS",
        help="forward, and/or forward+backward (out.sum().backward(), jax.grad) (default: "
        "forward)",
    )
    parser.add_argument("--seq-lens", nargs="+", type=int, help="T values (256 ... 65536)")
    parser.add_argument("--dims", nargs="+", type=int, help="d = d_k = d_v values (64 128)")
    parser.add_argument("--batch", type=int, help="batch x heads (default 8)")
    parser.add_argument("--dtype", default="float32", help="input dtype (default float32)")
    parser.add_argument(
        "--chunk-size", type=int, default=None,
        help="chunk size for polylin and the plain form (default: polylin's default)",
    )
    parser.add_argument("--repeats", type=int, help="timed repeats after a warm-up (default 5)")
    parser.add_argument(
        "--cell-seconds", type=float,
        help="time budget for the repeats of one call; slow calls get fewer (default 2)",
    )
    parser.add_argument(
        "--max-call-seconds", type=float, default=10.0,
        help="skip a call whose time, predicted from the previous T, passes this (default 10)",
    )
    parser.add_argument(
        "--loop-max-len", type=int,
        help="longest T at which the per-token loops (seed, recurrent) are timed; longer ones "
        "are extrapolated per token (default 4096)",
    )
    parser.add_argument(
        "--quadratic-budget-mb", type=float, default=2048.0,
        help="skip the quadratic form where its T x T matrices would pass this (default 2048)",
    )
    parser.add_argument(
        "--decode-positions", nargs="+", type=int,
        help="positions at which one decoding step is timed (default 1 1024 65536)",
    )
    parser.add_argument("--decode-steps", type=int, help="timed decoding steps (default 50)")
    parser.add_argument(
        "--memory-len", type=int,
        help="T of the one-head memory check of the chunked path (default 65536)",
    )
    parser.add_argument("--gemm-size", type=int, help="n of the n x n GEMM rate probe (2048)")
    parser.add_argument("--threads", type=int, help="PyTorch intra-op threads (default: as is)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory passes")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument(
        "--out", default="bench-results", help="output folder (default bench-results)"
    )
    parser.set_defaults(func=run)


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    for name, (full, quick) in _DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)
    args.seq_lens = sorted(set(args.seq_lens))
    return args


def _usable(names: list[str]) -> tuple[list[Backend], dict[str, str]]:
    usable, skipped = [], {}
    for name in names:
        backend = Backend(name)
        reason = backend.unavailable_reason()
        if reason is None:
            usable.append(backend)
        else:
            skipped[name] = reason
    return usable, skipped


def _calls(
    args: argparse.Namespace, backend: Backend, xs: list[Any], d: int, mode: str
) -> dict[str, Callable[[], Any] | str]:
    """Each implementation's call in ``mode``, or the reason it cannot run (skipped quietly
    when it does not run on this backend at all)."""
    setup = Setup(backend, dtype=args.dtype, chunk_size=args.chunk_size_used, dim=d)
    calls: dict[str, Callable[[], Any] | str] = {}
    for name in args.methods:
        impl = REGISTRY[name]
        if impl.unavailable(backend) is not None:
            continue
        try:
            calls[name] = make_call(impl, setup, xs, mode)
        except Skip as skip:
            calls[name] = str(skip)
    return calls


def _inputs(backend: Backend, batch: int, T: int, d: int, dtype: str, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        backend.from_numpy(rng.standard_normal((batch, T, d), dtype=np.float32), dtype)
        for _ in range(3)
    ]


def _skip_reason(
    args: argparse.Namespace, method: str, T: int, batch: int, last: tuple[int, float] | None
) -> str | None:
    if REGISTRY[method].order >= 2 and method != "sdpa":  # sdpa: flash kernels, no T x T
        need = quadratic_bytes(batch, T, args.dtype) / 2**20
        if need > args.quadratic_budget_mb:
            return f"T x T matrices need ~{need:.0f} MB > --quadratic-budget-mb"
    if last is not None:
        T0, t0 = last
        predicted = t0 * (T / T0) ** REGISTRY[method].order
        if predicted > args.max_call_seconds:
            return f"predicted {predicted:.1f} s per call > --max-call-seconds"
    return None


def _max_abs_diff(backend: Backend, a: Any, b: Any) -> float:
    import numpy as np

    return float(np.max(np.abs(backend.to_numpy(a) - backend.to_numpy(b)), initial=0.0))


def _row_skip(args, method: str, T: int, last: dict) -> dict[str, Any] | None:
    """The row's fields when ``method`` is not timed at ``T`` (extrapolated or skipped)."""
    if REGISTRY[method].loop and T > args.loop_max_len:
        if method in last:
            T0, t0 = last[method]
            return {"median_s": t0 / T0 * T, "extrapolated": True,
                    "note": f"per-token time at T={T0} times T"}
        return {"skipped": "longer than --loop-max-len, nothing to extrapolate"}
    reason = _skip_reason(args, method, T, args.batch, last.get(method))
    return None if reason is None else {"skipped": reason}


def _sweep(args, backends, report, progress) -> None:
    from .timing import peak_memory, time_call

    for backend in backends:
        for d in args.dims:
            for mode in args.passes:
                last: dict[str, tuple[int, float]] = {}
                for T in args.seq_lens:
                    xs = _inputs(backend, args.batch, T, d, args.dtype)
                    reference = None
                    for method, fn in _calls(args, backend, xs, d, mode).items():
                        progress.show(f"{backend} d={d} T={T} {method} {mode}")
                        row: dict[str, Any] = {
                            "backend": backend.value, "method": method, "T": T, "d": d,
                            "batch": args.batch, "dtype": args.dtype, "pass": mode,
                            "input_bytes": 3 * args.batch * T * d * ITEMSIZE[args.dtype],
                        }
                        skipped = (
                            {"skipped": fn} if isinstance(fn, str)
                            else _row_skip(args, method, T, last)
                        )
                        if skipped is not None:
                            row.update(skipped)
                            report["results"].append(row)
                            progress.step()
                            continue
                        assert not isinstance(fn, str)
                        timing = time_call(
                            backend, fn, repeats=args.repeats, budget_s=args.cell_seconds
                        )
                        last[method] = (T, timing.median)
                        row.update(
                            median_s=timing.median, times_s=timing.times,
                            warmup_s=timing.warmup, minor_faults_per_call=timing.faults,
                            extrapolated=False,
                        )
                        out, timing.output = timing.output, None
                        if method == "chunked":
                            reference = out
                        elif reference is not None and REGISTRY[method].compare:
                            row["max_abs_diff_vs_chunked"] = _max_abs_diff(
                                backend, out, reference
                            )
                        del out
                        if method in ("chunked", "plain") and mode == "forward":
                            flops = chunked_useful_flops(
                                args.batch, T, d, d, args.chunk_size_used
                            )
                            row["useful_flops"] = flops
                            gemm = report["gemm_flops_per_s"].get(backend.value)
                            if gemm:
                                row["gemm_fraction"] = flops / timing.median / gemm
                        if not args.no_memory and not REGISTRY[method].loop:
                            row["peak_bytes"] = peak_memory(backend, fn)  # a loop's: outputs
                        report["results"].append(row)
                        progress.step()
                    del xs


def _decode(args, backends, report, progress) -> None:
    import numpy as np

    from polylin import LinearAttentionState, causal_linear_attention, step

    from .timing import time_call

    d = args.dims[0]
    for backend in backends:
        for position in args.decode_positions:
            progress.show(f"{backend} decode at position {position}")
            q, k, v = _inputs(backend, args.batch, position, d, args.dtype, seed=1)
            _, state = causal_linear_attention(q, k, v, return_state=True)
            # materialized (a lazy state would replay the prefill at every step)
            state = LinearAttentionState(
                *(backend.from_numpy(backend.to_numpy(x)) for x in state)
            )
            del q, k, v
            rng = np.random.default_rng(2)
            q_t, k_t, v_t = (
                backend.from_numpy(rng.standard_normal((args.batch, d)), args.dtype)
                for _ in range(3)
            )
            timing = time_call(
                backend,
                lambda state=state, q_t=q_t, k_t=k_t, v_t=v_t: step(q_t, k_t, v_t, state)[0],
                repeats=args.decode_steps, budget_s=args.cell_seconds,
            )
            report["decode"].append({
                "backend": backend.value, "position": position, "d": d, "batch": args.batch,
                "dtype": args.dtype, "per_token_s": timing.median, "steps": len(timing.times),
            })
            progress.step()


def _memory_check(args, backends, report, progress) -> None:
    from polylin import causal_linear_attention

    from .timing import peak_memory

    if args.no_memory:
        return
    d, T = args.dims[0], args.memory_len
    for backend in backends:
        progress.show(f"{backend} memory check T={T}")
        q, k, v = _inputs(backend, 1, T, d, args.dtype, seed=3)
        peak = peak_memory(backend, lambda q=q, k=k, v=v: causal_linear_attention(q, k, v))
        inputs = 3 * T * d * ITEMSIZE[args.dtype]
        report["memory_check"].append({
            "backend": backend.value, "T": T, "d": d, "batch": 1, "dtype": args.dtype,
            "peak_bytes": peak, "input_bytes": inputs,
            "peak_over_inputs": None if peak is None else peak / inputs,
            "t_by_t_bytes": T * T * ITEMSIZE[args.dtype],
        })
        progress.step()
        del q, k, v


def _task_count(args: argparse.Namespace, backends: list[Backend]) -> int:
    per_cell = sum(
        1 for b in backends for m in args.methods if REGISTRY[m].unavailable(b) is None
    )
    total = per_cell * len(args.dims) * len(args.seq_lens) * len(args.passes)
    return total + len(backends) * (2 + len(args.decode_positions))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark: sweep, decode, memory check; print the summary; write JSON and PNG."""
    from . import report as reporting
    from .timing import Progress, gemm_rate, run_metadata

    args = _resolve(args)
    args.chunk_size_used = args.chunk_size or DEFAULT_CHUNK_SIZE
    backends, unavailable = _usable(args.backends)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    argv = getattr(args, "argv", None) or sys.argv[2:]
    meta = run_metadata(
        "python benchmarks/run.py cpu " + " ".join(argv), chunk_size=args.chunk_size_used
    )
    report: dict[str, Any] = {
        "schema": SCHEMA, "meta": meta, "unavailable": unavailable,
        "gemm_flops_per_s": {}, "results": [], "decode": [], "memory_check": [],
    }
    progress = Progress(_task_count(args, backends))
    try:
        for backend in backends:
            progress.show(f"{backend} GEMM rate n={args.gemm_size}")
            report["gemm_flops_per_s"][backend.value] = gemm_rate(backend, args.gemm_size)
            progress.step()
        _sweep(args, backends, report, progress)
        _decode(args, backends, report, progress)
        _memory_check(args, backends, report, progress)
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        progress.close()
    report["meta"]["load_average_end"] = list(os.getloadavg())
    report["meta"]["seconds"] = round(progress.elapsed(), 1)
    report["targets"] = target_file.evaluate(report, target_file.load("cpu"))
    print(reporting.summarize(report))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JSON_NAME).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out_dir / JSON_NAME}")
    if not args.no_plot:
        png = reporting.plot(report, out_dir / PNG_NAME)
        print(f"wrote {png}" if png else "matplotlib is not installed: no plot (pip install "
              "matplotlib)")
    return 1 if report.get("interrupted") else 0
