"""Scale-out demonstration: causal linear attention on a ``dask.distributed`` cluster.

``python benchmarks/run.py dask`` generates queries, keys and values lazily with a seeded
``dask.array`` random generator, several times larger in total than one worker's memory limit,
chunked along the batch and head axes so that one task chain holds one chunk of a few heads. The
unchanged :func:`polylin.causal_linear_attention` builds the task graph; each output chunk is
reduced to per-(batch, head) sums on the workers, so only a ``(batch, heads)`` table travels
back to the client. The same graph runs on local clusters of 1, 2, ... worker processes (one
thread each, each limited to ``--memory-limit``); for each run it records the wall time, the
throughput (tokens and input bytes per second), the CPU seconds the workers used (so a machine
shared with other work shows as fewer busy cores), the peak resident memory of each worker
(sampled by the worker's monitor every 0.5 s), the bytes spilled to disk, and a checksum (the
same for every cluster size: the inputs are seeded). One chunk is recomputed eagerly with NumPy
to check the distributed result, and one chunk's work is timed without Dask on a worker, the
rate a perfect scheduler would reach. ``--repeats`` alternates the cluster sizes and reports
medians. Progress is printed as chunks complete; the results go to
``<out>/dask-scaleout.json``.

The same code runs on a multi-machine cluster: pass ``--scheduler tcp://host:8786`` to use a
running ``dask scheduler`` and its workers instead of local clusters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from polylin import causal_linear_attention

__all__ = ["add_arguments", "build_graph", "eager_chunk_seconds", "run", "scaleout"]

#: Shapes of the full run and of ``--quick``: (batch, heads, T, d, heads per Dask chunk).
FULL = {"batch": 16, "heads": 16, "seq_len": 16384, "dim": 64, "heads_per_chunk": 4}
QUICK = {"batch": 2, "heads": 4, "seq_len": 512, "dim": 16, "heads_per_chunk": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the scale-out run's flags on ``parser`` and set its entry point."""
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="cluster sizes to run, in worker processes (default: 1 2)",
    )
    parser.add_argument(
        "--memory-limit", default="1GB", help="memory limit of each worker (default 1GB)"
    )
    parser.add_argument("--batch", type=int, help=f"batch size (default {FULL['batch']})")
    parser.add_argument("--heads", type=int, help=f"heads (default {FULL['heads']})")
    parser.add_argument(
        "--seq-len", type=int, help=f"sequence length T (default {FULL['seq_len']})"
    )
    parser.add_argument("--dim", type=int, help=f"d_k = d_v (default {FULL['dim']})")
    parser.add_argument(
        "--heads-per-chunk",
        type=int,
        help=f"heads in one Dask chunk (default {FULL['heads_per_chunk']})",
    )
    parser.add_argument(
        "--chunk-size", type=int, default=64, help="polylin's chunk_size (default 64)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per cluster size, alternating the order of sizes (default 1)",
    )
    parser.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="use a running cluster (tcp://host:8786) instead of local ones",
    )
    parser.add_argument("--quick", action="store_true", help=f"a small smoke run: {QUICK}")
    parser.add_argument(
        "--out",
        default="bench-results",
        help="folder for dask-scaleout.json (default bench-results)",
    )
    parser.set_defaults(func=run)


def build_graph(
    *,
    batch: int,
    heads: int,
    seq_len: int,
    dim: int,
    heads_per_chunk: int,
    chunk_size: int,
    dtype: str,
    seed: int,
) -> tuple[Any, tuple[Any, Any, Any]]:
    """The lazy inputs and the lazy ``(batch, heads)`` float64 sums of the attention output."""
    import dask.array as da

    rng = da.random.default_rng(seed)
    # One generating task per chunk makes that chunk's q, k and v together (as a projection
    # of one block of hidden states would): a chunk's task chain then starts on one worker.
    # Three separate generators give three root tasks that the scheduler places apart, and
    # keys and values travel between workers (measured: more bytes moved than the inputs hold).
    qkv = rng.standard_normal(
        (3, batch, heads, seq_len, dim), chunks=(3, 1, heads_per_chunk, seq_len, dim), dtype=dtype
    )
    q, k, v = qkv[0], qkv[1], qkv[2]
    out = causal_linear_attention(q, k, v, chunk_size=chunk_size)
    return da.sum(out, axis=(-2, -1), dtype="float64"), (q, k, v)


def _worker_stats(dask_worker: Any) -> dict[str, float]:
    """Peak resident memory seen by the worker's monitor, bytes it spilled to disk, and bytes
    it sent to other workers (or the client)."""
    memory = list(dask_worker.monitor.quantities["memory"])
    spilled = sent = 0
    for key, value in getattr(dask_worker, "digests_total", {}).items():
        # e.g. ("memory-monitor", "disk-write", "bytes") and ("get-data", "memory-read", "bytes")
        if "bytes" in str(key) and "disk-write" in str(key):
            spilled += value
        if "bytes" in str(key) and "get-data" in str(key):
            sent += value
    return {
        "peak_rss_bytes": max(memory) if memory else float("nan"),
        "spilled_bytes": spilled,
        "sent_bytes": sent,
    }


def eager_chunk_seconds(
    *, heads: int, seq_len: int, dim: int, chunk_size: int, dtype: str, seed: int, repeats: int = 3
) -> float:
    """Median seconds for one Dask chunk's work done eagerly with NumPy in this process.

    The same work as one task chain of the graph (generate q, k, v for ``heads`` heads, attend,
    sum), without Dask: run on a worker, it is the per-worker rate that a perfect scheduler
    would reach, against which the cluster's throughput is compared.
    """
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        rng = np.random.default_rng(seed + r)
        q, k, v = (rng.standard_normal((1, heads, seq_len, dim), dtype=dtype) for _ in range(3))
        causal_linear_attention(q, k, v, chunk_size=chunk_size).sum(dtype=np.float64)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _run_once(client: Any, sums: Any, label: str) -> tuple[np.ndarray, float]:
    """Compute ``sums`` on ``client`` with progress lines; return it and the wall time."""
    from distributed import as_completed, futures_of

    start = time.perf_counter()
    persisted = client.persist(sums)
    futures = futures_of(persisted)
    done = 0
    step = max(1, len(futures) // 8)
    for _ in as_completed(futures):
        done += 1
        if done % step == 0 or done == len(futures):
            print(
                f"  [{label}] {done}/{len(futures)} chunks done, "
                f"{time.perf_counter() - start:6.1f}s",
                flush=True,
            )
    result = np.asarray(persisted.compute())
    return result, time.perf_counter() - start


def _check_one_chunk(
    client: Any, inputs: tuple, sums: np.ndarray, heads_per_chunk: int, chunk_size: int
) -> float:
    """Max relative error of the first chunk's sums against an eager NumPy run."""
    block = tuple(np.asarray(x[:1, :heads_per_chunk].compute()) for x in inputs)
    eager = causal_linear_attention(*block, chunk_size=chunk_size)
    expected = eager.sum(axis=(-2, -1), dtype=np.float64)
    got = sums[:1, :heads_per_chunk]
    return float(np.max(np.abs(got - expected) / np.maximum(np.abs(expected), 1.0)))


def _worker_cpu_seconds() -> float:
    """User + system CPU seconds used so far by the calling (worker) process."""
    import psutil  # a dependency of distributed

    times = psutil.Process().cpu_times()
    return times.user + times.system


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    sizes = dict(QUICK if args.quick else FULL)
    for name in sizes:
        if getattr(args, name, None) is not None:
            sizes[name] = getattr(args, name)
    return sizes


def _one_run(args: argparse.Namespace, sizes: dict[str, int], n_workers: int | None) -> dict:
    """Start a cluster of ``n_workers`` (or connect to ``--scheduler``), time the graph once."""
    from distributed import Client, LocalCluster

    itemsize = np.dtype(args.dtype).itemsize
    tokens = sizes["batch"] * sizes["heads"] * sizes["seq_len"]
    input_bytes = 3 * tokens * sizes["dim"] * itemsize
    eager_tokens = sizes["heads_per_chunk"] * sizes["seq_len"]
    graph_kwargs = {**sizes, "chunk_size": args.chunk_size, "dtype": args.dtype, "seed": args.seed}
    if args.scheduler:
        cluster, client = None, Client(args.scheduler)
        n_workers = len(client.scheduler_info()["workers"])
    else:
        cluster = LocalCluster(
            n_workers=n_workers,
            threads_per_worker=1,
            processes=True,
            memory_limit=args.memory_limit,
            dashboard_address=":0",  # any free port: other clusters may hold 8787
            silence_logs=logging.ERROR,
        )
        client = Client(cluster)
    label = f"{n_workers} worker{'s' if n_workers > 1 else ''}"
    try:
        # Warm-up on a tiny graph: worker processes import NumPy and Dask before the timer.
        warm, _ = build_graph(**{**graph_kwargs, **QUICK, "batch": n_workers})
        client.compute(warm).result()
        sums, inputs = build_graph(**graph_kwargs)
        print(f" {label}: {len(sums.__dask_graph__())} tasks", flush=True)
        # The same chunk's work without Dask, on one worker (one BLAS thread, like the tasks),
        # then on every worker at once: what this machine gives N processes right now.
        eager_kwargs = {
            "heads": sizes["heads_per_chunk"],
            "seq_len": sizes["seq_len"],
            "dim": sizes["dim"],
            "chunk_size": args.chunk_size,
            "dtype": args.dtype,
            "seed": args.seed,
        }
        addresses = sorted(client.scheduler_info()["workers"])
        together = client.gather(  # also warms every worker up for the solo run
            [
                client.submit(eager_chunk_seconds, **eager_kwargs, workers=[a], pure=False)
                for a in addresses
            ]
        )
        eager = client.submit(
            eager_chunk_seconds, **eager_kwargs, workers=addresses[:1], pure=False
        ).result()
        machine_speedup = (
            len(addresses) * eager / statistics.mean(together) if len(addresses) > 1 else 1.0
        )
        load_before = os.getloadavg()[0]
        cpu_before = client.run(_worker_cpu_seconds)
        result, seconds = _run_once(client, sums, label)
        cpu_after = client.run(_worker_cpu_seconds)
        load_after = os.getloadavg()[0]
        stats = client.run(_worker_stats)
        alive = len(client.scheduler_info()["workers"])
        error = _check_one_chunk(client, inputs, result, sizes["heads_per_chunk"], args.chunk_size)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    cpu = sum(cpu_after[w] - cpu_before.get(w, 0.0) for w in cpu_after)
    checksum = float(result.sum())
    run_ = {
        "workers": n_workers,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "input_GB_per_s": input_bytes / seconds / 1e9,
        "worker_cpu_seconds": cpu,
        "cores_busy": cpu / seconds,
        "tokens_per_cpu_second": tokens / cpu,
        "eager_numpy_chunk_seconds": eager,
        "eager_numpy_tokens_per_s": eager_tokens / eager,
        "efficiency_vs_eager": (tokens / seconds) / (n_workers * eager_tokens / eager),
        "eager_all_workers_at_once_chunk_seconds": together,
        "machine_parallel_speedup": machine_speedup,
        "load_average_before_after": [load_before, load_after],
        "peak_worker_rss_bytes": [s["peak_rss_bytes"] for s in stats.values()],
        "spilled_bytes": sum(s["spilled_bytes"] for s in stats.values()),
        "sent_between_workers_bytes": sum(s["sent_bytes"] for s in stats.values()),
        "workers_alive_at_end": alive,
        "checksum": checksum,
        "first_chunk_max_rel_error": error,
    }
    print(
        f" {label}: {seconds:.1f}s, {run_['tokens_per_s'] / 1e6:.3f} M tokens/s, "
        f"{run_['input_GB_per_s']:.3f} GB/s of input, {run_['cores_busy']:.2f} cores busy "
        f"({run_['efficiency_vs_eager']:.0%} of {n_workers} x eager NumPy; eager NumPy on all "
        f"workers at once runs {machine_speedup:.2f}x one worker's rate); "
        f"load {load_before:.1f}->{load_after:.1f}; peak worker RSS "
        f"{max(run_['peak_worker_rss_bytes']) / 1e6:.0f} MB; spilled "
        f"{run_['spilled_bytes'] / 1e6:.0f} MB; sent between workers "
        f"{run_['sent_between_workers_bytes'] / 1e6:.0f} MB; checksum {checksum:.6e}; "
        f"first chunk vs NumPy: {error:.1e}",
        flush=True,
    )
    return run_


def scaleout(args: argparse.Namespace) -> dict[str, Any]:
    """Run the graph on each cluster size and return the results (see the module docstring).

    With ``--repeats R`` the cluster sizes alternate (1, 2, 2, 1, 1, 2, ...) so that a change in
    the machine's load during the run biases no size; the summary holds medians per size.
    """
    sizes = _sizes(args)
    itemsize = np.dtype(args.dtype).itemsize
    tokens = sizes["batch"] * sizes["heads"] * sizes["seq_len"]
    input_bytes = 3 * tokens * sizes["dim"] * itemsize
    chunk_bytes = 3 * sizes["heads_per_chunk"] * sizes["seq_len"] * sizes["dim"] * itemsize
    n_blocks = sizes["batch"] * -(-sizes["heads"] // sizes["heads_per_chunk"])
    print(
        f"dask scale-out: q, k, v of shape ({sizes['batch']}, {sizes['heads']}, "
        f"{sizes['seq_len']}, {sizes['dim']}) {args.dtype}, {input_bytes / 1e9:.2f} GB in all, "
        f"generated lazily in {n_blocks} chunks of {chunk_bytes / 1e6:.1f} MB; "
        f"workers limited to {args.memory_limit}",
        flush=True,
    )
    counts: list[int | None] = [None] if args.scheduler else list(args.workers)
    runs = []
    for r in range(args.repeats):
        for n_workers in counts if r % 2 == 0 else counts[::-1]:
            runs.append(_one_run(args, sizes, n_workers))
    summary = []
    for n in sorted({r["workers"] for r in runs}):
        mine = [r for r in runs if r["workers"] == n]
        seconds = statistics.median(r["seconds"] for r in mine)
        summary.append(
            {
                "workers": n,
                "median_seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "input_GB_per_s": input_bytes / seconds / 1e9,
                "cores_busy": statistics.median(r["cores_busy"] for r in mine),
                "tokens_per_cpu_second": statistics.median(
                    r["tokens_per_cpu_second"] for r in mine
                ),
                "efficiency_vs_eager": statistics.median(r["efficiency_vs_eager"] for r in mine),
                "machine_parallel_speedup": statistics.median(
                    r["machine_parallel_speedup"] for r in mine
                ),
                "max_peak_worker_rss_bytes": max(max(r["peak_worker_rss_bytes"]) for r in mine),
                "spilled_bytes": max(r["spilled_bytes"] for r in mine),
                "sent_between_workers_bytes": statistics.median(
                    r["sent_between_workers_bytes"] for r in mine
                ),
                "repeats": len(mine),
            }
        )
    for row in summary:
        row["speedup_vs_fewest_workers"] = summary[0]["median_seconds"] / row["median_seconds"]
        print(
            f"summary: {row['workers']} worker(s): median {row['median_seconds']:.1f}s, "
            f"{row['tokens_per_s'] / 1e6:.3f} M tokens/s, speed-up "
            f"{row['speedup_vs_fewest_workers']:.2f}x (eager NumPy: "
            f"{row['machine_parallel_speedup']:.2f}x), {row['cores_busy']:.2f} cores busy, "
            f"{row['tokens_per_cpu_second'] / 1e6:.3f} M tokens per worker CPU second",
            flush=True,
        )
    return {
        "command": "python benchmarks/run.py dask" + (" --quick" if args.quick else ""),
        "shape": [sizes["batch"], sizes["heads"], sizes["seq_len"], sizes["dim"]],
        "dtype": args.dtype,
        "chunk_size": args.chunk_size,
        "dask_chunk": [1, sizes["heads_per_chunk"], sizes["seq_len"], sizes["dim"]],
        "n_dask_chunks": n_blocks,
        "input_bytes": input_bytes,
        "worker_memory_limit": args.memory_limit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "summary": summary,
        "runs": runs,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python benchmarks/run.py dask``: run, print, write the JSON."""
    results = scaleout(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("dask-scaleout-quick.json" if args.quick else "dask-scaleout.json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return 0
