"""The benchmark behind ``python -m polylin bench`` (and ``make bench``).

It sweeps method x backend x T x d on the CPU backends (NumPy and PyTorch by default, any other
by ``--backends``), with the baselines in the same run:

- ``chunked``: polylin's default path (what is being measured);
- ``plain``: a plain, unblocked chunked form in array-API code
  (:func:`polylin.bench.baselines.plain_chunked`);
- ``quadratic``: polylin's masked kernel form, skipped where its T x T matrices would pass
  ``--quadratic-budget-mb``;
- ``recurrent``: polylin's per-token form, and ``seed``: the design note's PyTorch loop as
  written; both are timed up to ``--loop-max-len`` and extrapolated per token beyond
  (marked ``~`` in the table, ``"extrapolated": true`` in the JSON);
- ``sdpa``: PyTorch's causal softmax attention (a different function, timed only).

It also times a large float32 matmul per backend, so that the chunked path's useful flops per
second can be given as a fraction of the machine's GEMM rate; decoding with
:func:`polylin.step` at several positions; and the chunked path's peak memory for one long
head. Times are medians of repeats after a warm-up; every ratio is taken within the same run.
Results go to ``bench.json`` and, with matplotlib, ``bench.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..testing import Backend

__all__ = ["METHODS", "SCHEMA", "add_arguments", "run"]

#: Version tag of the JSON report; bump it when fields change meaning.
SCHEMA = "polylin-bench/1"

#: What the sweep can time; ``seed`` and ``sdpa`` are PyTorch-only.
METHODS = ("chunked", "plain", "quadratic", "recurrent", "seed", "sdpa")

#: Growth order of each method's time in T, used to skip calls predicted to be too slow.
_ORDER = {"quadratic": 2, "sdpa": 2}

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

#: The reference lengths the targets are stated at.
T_REF, T_LONG, D_GEMM = 4096, 16384, 128

JSON_NAME, PNG_NAME = "bench.json", "bench.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the benchmark's flags on ``parser`` and set its entry point."""
    backends = [b.value for b in Backend]
    parser.add_argument(
        "--backends", nargs="+", default=["numpy", "torch"], choices=backends, metavar="NAME",
        help=f"backends to sweep (default: numpy torch; any of {', '.join(backends)})",
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="NAME",
        help=f"what to time (default: all of {', '.join(METHODS)})",
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


def _is_torch(backend: Backend) -> bool:
    return backend in (Backend.TORCH, Backend.TORCH_CUDA)


def _default_chunk_size() -> int:
    from .. import causal_linear_attention

    return inspect.signature(causal_linear_attention).parameters["chunk_size"].default


def _calls(args: argparse.Namespace, backend: Backend, xs: list[Any]) -> dict[str, Callable]:
    from .. import causal_linear_attention
    from .baselines import plain_chunked, sdpa, seed_loop

    q, k, v = xs
    chunk = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    calls = {
        "chunked": lambda: causal_linear_attention(q, k, v, **chunk),
        "plain": lambda: plain_chunked(q, k, v, chunk_size=args.chunk_size_used),
        "quadratic": lambda: causal_linear_attention(q, k, v, method="quadratic"),
        "recurrent": lambda: causal_linear_attention(q, k, v, method="recurrent"),
    }
    if _is_torch(backend):
        calls["seed"] = lambda: seed_loop(q, k, v)
        calls["sdpa"] = lambda: sdpa(q, k, v)
    return {m: calls[m] for m in args.methods if m in calls}


def _inputs(backend: Backend, batch: int, T: int, d: int, dtype: str, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        backend.from_numpy(rng.standard_normal((batch, T, d), dtype=np.float32), dtype)
        for _ in range(3)
    ]


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def _skip_reason(
    args: argparse.Namespace, method: str, T: int, batch: int, last: tuple[int, float] | None
) -> str | None:
    if method == "quadratic":
        # the scores, the masked scores and the mask: about three T x T matrices per head
        need = 3 * batch * T * T * _itemsize(args.dtype) / 2**20
        if need > args.quadratic_budget_mb:
            return f"T x T matrices need ~{need:.0f} MB > --quadratic-budget-mb"
    if last is not None:
        T0, t0 = last
        predicted = t0 * (T / T0) ** _ORDER.get(method, 1)
        if predicted > args.max_call_seconds:
            return f"predicted {predicted:.1f} s per call > --max-call-seconds"
    return None


def _max_abs_diff(backend: Backend, a: Any, b: Any) -> float:
    import numpy as np

    return float(np.max(np.abs(backend.to_numpy(a) - backend.to_numpy(b)), initial=0.0))


def _sweep(args, backends, report, progress) -> None:
    from .baselines import chunked_useful_flops
    from .measure import peak_memory, time_call

    for backend in backends:
        for d in args.dims:
            last: dict[str, tuple[int, float]] = {}
            for T in args.seq_lens:
                xs = _inputs(backend, args.batch, T, d, args.dtype)
                calls = _calls(args, backend, xs)
                reference = None
                for method, fn in calls.items():
                    progress.show(f"{backend} d={d} T={T} {method}")
                    row = {
                        "backend": backend.value, "method": method, "T": T, "d": d,
                        "batch": args.batch, "dtype": args.dtype,
                        "input_bytes": 3 * args.batch * T * d * _itemsize(args.dtype),
                    }
                    loop = method in ("seed", "recurrent")
                    if loop and T > args.loop_max_len:
                        if method in last:
                            T0, t0 = last[method]
                            row.update(median_s=t0 / T0 * T, extrapolated=True)
                            row["note"] = f"per-token time at T={T0} times T"
                        else:
                            row["skipped"] = "longer than --loop-max-len, nothing to extrapolate"
                        report["results"].append(row)
                        progress.step()
                        continue
                    reason = _skip_reason(args, method, T, args.batch, last.get(method))
                    if reason:
                        row["skipped"] = reason
                        report["results"].append(row)
                        progress.step()
                        continue
                    timing = time_call(
                        backend, fn, repeats=args.repeats, budget_s=args.cell_seconds
                    )
                    last[method] = (T, timing.median)
                    row.update(
                        median_s=timing.median, times_s=timing.times, warmup_s=timing.warmup,
                        minor_faults_per_call=timing.faults, extrapolated=False,
                    )
                    out, timing.output = timing.output, None
                    if method == "chunked":
                        reference = out
                    elif reference is not None and method != "sdpa":
                        row["max_abs_diff_vs_chunked"] = _max_abs_diff(backend, out, reference)
                    del out
                    if method in ("chunked", "plain"):
                        flops = chunked_useful_flops(args.batch, T, d, d, args.chunk_size_used)
                        row["useful_flops"] = flops
                        gemm = report["gemm_flops_per_s"].get(backend.value)
                        if gemm:
                            row["gemm_fraction"] = flops / timing.median / gemm
                    if not args.no_memory and not loop:  # a loop's memory is its outputs
                        row["peak_bytes"] = peak_memory(backend, fn)
                    report["results"].append(row)
                    progress.step()
                del xs


def _decode(args, backends, report, progress) -> None:
    import numpy as np

    from .. import LinearAttentionState, causal_linear_attention, step
    from .measure import time_call

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
    from .. import causal_linear_attention
    from .measure import peak_memory

    if args.no_memory:
        return
    d, T = args.dims[0], args.memory_len
    for backend in backends:
        progress.show(f"{backend} memory check T={T}")
        q, k, v = _inputs(backend, 1, T, d, args.dtype, seed=3)
        peak = peak_memory(backend, lambda q=q, k=k, v=v: causal_linear_attention(q, k, v))
        inputs = 3 * T * d * _itemsize(args.dtype)
        report["memory_check"].append({
            "backend": backend.value, "T": T, "d": d, "batch": 1, "dtype": args.dtype,
            "peak_bytes": peak, "input_bytes": inputs,
            "peak_over_inputs": None if peak is None else peak / inputs,
            "t_by_t_bytes": T * T * _itemsize(args.dtype),
        })
        progress.step()
        del q, k, v


def _meta(args: argparse.Namespace, argv: list[str]) -> dict:
    import numpy as np

    from .. import __version__

    meta = {
        "polylin": __version__, "python": platform.python_version(),
        "platform": platform.platform(), "machine": platform.machine(),
        "processor": platform.processor(), "cpu_count": os.cpu_count(),
        "numpy": np.__version__, "command": "python -m polylin bench " + " ".join(argv),
        "chunk_size": args.chunk_size_used,
        "load_average_start": list(os.getloadavg()),
        "thread_env": {
            name: os.environ[name]
            for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
            if name in os.environ
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return meta


def _task_count(args: argparse.Namespace, backends: list[Backend]) -> int:
    per_cell = 0
    for backend in backends:
        per_cell += sum(
            1 for m in args.methods if m not in ("seed", "sdpa") or _is_torch(backend)
        )
    total = per_cell * len(args.dims) * len(args.seq_lens) + 2 * len(backends)
    return total + len(backends) * len(args.decode_positions)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark: sweep, decode, memory check; print the summary; write JSON and PNG."""
    from . import report as reporting
    from .measure import Progress, gemm_rate

    args = _resolve(args)
    args.chunk_size_used = args.chunk_size or _default_chunk_size()
    backends, unavailable = _usable(args.backends)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    argv = getattr(args, "argv", None) or sys.argv[2:]
    report: dict[str, Any] = {
        "schema": SCHEMA, "meta": _meta(args, argv), "unavailable": unavailable,
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
    report["targets"] = reporting.targets(report)
    print(reporting.summarize(report))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / JSON_NAME).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out_dir / JSON_NAME}")
    if not args.no_plot:
        png = reporting.plot(report, out_dir / PNG_NAME)
        print(f"wrote {png}" if png else "matplotlib is not installed: no plot (pip install "
              "'polylin[bench]')")
    return 1 if report.get("interrupted") else 0
