"""Turning a benchmark report into the targets table, the printed summary and the plot.

Every ratio is taken between two measurements of the same run (same machine state, same
inputs). The targets are those of the performance issue; a target whose measurements are not in
the report (another ``--seq-lens``, a backend not run) says so instead of guessing.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot", "summarize", "targets"]

_MB = 2**20


def _median(report: dict, backend: str, method: str, T: int, d: int) -> float | None:
    for row in report["results"]:
        if (row["backend"], row["method"], row["T"], row["d"]) == (backend, method, T, d):
            if row.get("extrapolated"):
                return None
            return row.get("median_s")
    return None


def _row(report: dict, backend: str, method: str, T: int, d: int) -> dict | None:
    for row in report["results"]:
        if (row["backend"], row["method"], row["T"], row["d"]) == (backend, method, T, d):
            return row
    return None


def _target(name: str, value: float | None, limit: float, *, at_most: bool, unit: str = "x"):
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {
        "target": name, "measured": value, "limit": limit,
        "comparison": "<=" if at_most else ">=", "unit": unit, "met": met,
    }


def targets(report: dict) -> list[dict]:
    """The issue's targets, each with the measured value and whether it is met.

    Examples
    --------
    >>> from polylin.bench.report import targets
    >>> empty = {"results": [], "decode": [], "memory_check": [], "gemm_flops_per_s": {}}
    >>> [t["met"] for t in targets(empty)][:2]
    [None, None]
    """
    from . import D_GEMM, T_LONG, T_REF

    d0 = 64
    out = []
    chunked = _median(report, "torch", "chunked", T_REF, d0)
    plain = _median(report, "torch", "plain", T_REF, d0)
    seed = _median(report, "torch", "seed", T_REF, d0)
    numpy_chunked = _median(report, "numpy", "chunked", T_REF, d0)
    out.append(_target(
        f"torch chunked / torch plain chunked, T={T_REF}, d={d0}",
        chunked / plain if chunked and plain else None, 0.75, at_most=True,
    ))
    out.append(_target(
        f"seed loop / torch chunked (speed-up), T={T_REF}, d={d0}",
        seed / chunked if chunked and seed else None, 25.0, at_most=False,
    ))
    out.append(_target(
        f"numpy chunked / torch plain chunked, T={T_REF}, d={d0}",
        numpy_chunked / plain if numpy_chunked and plain else None, 1.5, at_most=True,
    ))
    backends = sorted({r["backend"] for r in report["results"]})
    dims = sorted({r["d"] for r in report["results"]})
    for backend in backends:
        for d in dims:
            short = _median(report, backend, "chunked", T_REF, d)
            long = _median(report, backend, "chunked", T_LONG, d)
            out.append(_target(
                f"{backend} chunked time(T={T_LONG}) / time(T={T_REF}), d={d}",
                long / short if long and short else None, 5.0, at_most=True,
            ))
    for row in report["memory_check"]:
        out.append(_target(
            f"{row['backend']} chunked peak extra memory / inputs, T={row['T']}, one head, "
            f"d={row['d']}",
            row["peak_over_inputs"], 4.0, at_most=True,
        ))
    for backend in backends:
        row = _row(report, backend, "chunked", T_REF, D_GEMM)
        out.append(_target(
            f"{backend} chunked useful flop rate / GEMM rate, T={T_REF}, d={D_GEMM}",
            None if row is None else row.get("gemm_fraction"), 0.35, at_most=False,
        ))
    for backend in backends:
        steps = [r for r in report["decode"] if r["backend"] == backend]
        if len(steps) >= 2:
            first, last = steps[0], steps[-1]
            out.append(_target(
                f"{backend} decode time per token at position {last['position']} / at "
                f"position {first['position']} (flat)",
                last["per_token_s"] / first["per_token_s"], 1.5, at_most=True,
            ))
    return out


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds * 1e6:.1f}us"


def summarize(report: dict) -> str:
    """The printed report: times with ratios, memory, GEMM fractions, decode, targets.

    Examples
    --------
    >>> from polylin.bench.report import summarize
    >>> empty = {"meta": {}, "results": [], "decode": [], "memory_check": [],
    ...          "gemm_flops_per_s": {}, "targets": []}
    >>> "targets" in summarize(empty)
    True
    """
    meta = report.get("meta", {})
    lines = [
        f"polylin bench: {meta.get('command', '')}",
        f"machine: {meta.get('platform', '?')}, {meta.get('cpu_count', '?')} CPUs, torch threads "
        f"{meta.get('torch_threads', '-')} {meta.get('thread_env') or ''}, load average "
        f"{[round(x, 1) for x in meta.get('load_average_start', [])]} -> "
        f"{[round(x, 1) for x in meta.get('load_average_end', [])]} (other work on the machine "
        "makes times noisy; compare the ratios, taken within this run)",
    ]
    load = meta.get("load_average_start") or [0.0]
    if load[0] > 0.5 * (meta.get("cpu_count") or 1):
        lines.append(
            f"WARNING: load average {load[0]:.1f} on {meta.get('cpu_count')} CPUs at the start: "
            "other processes compete for the cores, and multi-threaded libraries stall on "
            "every parallel operation; these times are not representative (see "
            "docs/performance.md, 'Noise')"
        )
    for backend, rate in report.get("gemm_flops_per_s", {}).items():
        lines.append(f"float32 GEMM rate, {backend}: {rate / 1e9:.1f} GFLOP/s")
    for backend, reason in report.get("unavailable", {}).items():
        lines.append(f"not run: {backend} ({reason})")
    results = report["results"]
    keys = sorted({(r["backend"], r["d"]) for r in results})
    for backend, d in keys:
        rows = [r for r in results if r["backend"] == backend and r["d"] == d]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        lens = sorted({r["T"] for r in rows})
        batch = rows[0]["batch"]
        lines.append("")
        lines.append(
            f"{backend}, d={d}, batch x heads={batch}, {rows[0]['dtype']}: median time "
            "(x = time / polylin chunked time; ~ = extrapolated per token)"
        )
        lines.append("      T " + "".join(f"{m:>20}" for m in methods) + "   chunked GEMM%")
        for T in lens:
            base = _median(report, backend, "chunked", T, d)
            cells = []
            for m in methods:
                row = _row(report, backend, m, T, d) or {}
                t = row.get("median_s")
                if t is None:
                    cells.append(f"{'-':>20}")
                    continue
                mark = "~" if row.get("extrapolated") else ""
                ratio = f" ({t / base:.1f}x)" if base and m != "chunked" else ""
                cells.append(f"{mark + _fmt_time(t) + ratio:>20}")
            frac = (_row(report, backend, "chunked", T, d) or {}).get("gemm_fraction")
            frac_s = f"{100 * frac:13.0f}%" if frac is not None else f"{'-':>14}"
            lines.append(f"{T:>7} " + "".join(cells) + " " + frac_s)
        mem_rows = [r for r in rows if r.get("peak_bytes") is not None]
        if mem_rows:
            lines.append(
                "  peak extra memory, MB (x inputs): "
                + "; ".join(
                    f"{m} T={r['T']}: {r['peak_bytes'] / _MB:.0f} "
                    f"({r['peak_bytes'] / r['input_bytes']:.1f}x)"
                    for m in ("chunked", "plain", "quadratic")
                    for r in mem_rows
                    if r["method"] == m and r["T"] == max(x["T"] for x in mem_rows
                                                          if x["method"] == m)
                )
            )
    if report["decode"]:
        lines.append("")
        lines.append("decode with polylin.step: time per token")
        for row in report["decode"]:
            seed = _per_token(report, row["backend"], "seed", row["d"])
            rec = _per_token(report, row["backend"], "recurrent", row["d"])
            extra = ""
            if rec:
                extra += f"  (polylin recurrent, whole sequence: {_fmt_time(rec)}/token)"
            if seed:
                extra += f"  (seed loop: {_fmt_time(seed)}/token)"
            lines.append(
                f"  {row['backend']:<8} position {row['position']:>7}: "
                f"{_fmt_time(row['per_token_s'])}{extra}"
            )
    for row in report["memory_check"]:
        if row["peak_bytes"] is None:
            continue
        lines.append(
            f"memory, {row['backend']} chunked, one head, T={row['T']}, d={row['d']}: peak extra "
            f"{row['peak_bytes'] / _MB:.1f} MB = {row['peak_over_inputs']:.2f}x the inputs "
            f"(a T x T matrix would be {row['t_by_t_bytes'] / _MB:.0f} MB)"
        )
    lines.append("")
    lines.append("targets")
    for t in report.get("targets", []):
        value = "not measured" if t["measured"] is None else f"{t['measured']:.2f}"
        verdict = {True: "met", False: "NOT met", None: "-"}[t["met"]]
        lines.append(f"  {t['target']}: {value} (target {t['comparison']} {t['limit']}) {verdict}")
    return "\n".join(lines)


def _per_token(report: dict, backend: str, method: str, d: int) -> float | None:
    timed = [
        r for r in report["results"]
        if r["backend"] == backend and r["method"] == method and r["d"] == d
        and r.get("median_s") and not r.get("extrapolated")
    ]
    if not timed:
        return None
    row = max(timed, key=lambda r: r["T"])
    return row["median_s"] / row["T"]


def plot(report: dict, path: Path) -> Path | None:
    """Time and peak memory against T, log-log, one column per d; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results = report["results"]
    dims = sorted({r["d"] for r in results})
    if not dims:
        return None
    fig, axes = plt.subplots(2, len(dims), figsize=(6 * len(dims), 8), squeeze=False)
    series = list(dict.fromkeys((r["backend"], r["method"]) for r in results))
    styles = {"numpy": "-", "torch": "--"}
    for col, d in enumerate(dims):
        ax_t, ax_m = axes[0][col], axes[1][col]
        for backend, method in series:
            rows = sorted(
                (r for r in results
                 if (r["backend"], r["method"], r["d"]) == (backend, method, d)
                 and r.get("median_s")),
                key=lambda r: r["T"],
            )
            if not rows:
                continue
            style = styles.get(backend, ":")
            label = f"{method} ({backend})"
            timed = [r for r in rows if not r.get("extrapolated")]
            line = None
            if timed:
                (line,) = ax_t.plot(
                    [r["T"] for r in timed], [r["median_s"] for r in timed], style,
                    marker="o", label=label,
                )
            extra = [r for r in rows if r.get("extrapolated")]
            if extra:
                color = line.get_color() if line is not None else None
                ax_t.plot(
                    [r["T"] for r in [*timed[-1:], *extra]],
                    [r["median_s"] for r in [*timed[-1:], *extra]],
                    ":", color=color, marker="x",
                    label=None if line is not None else label + ", extrapolated",
                )
            mem = [r for r in timed if r.get("peak_bytes")]
            if mem:
                ax_m.plot(
                    [r["T"] for r in mem], [r["peak_bytes"] / _MB for r in mem], style,
                    marker="o", label=label, color=line.get_color() if line else None,
                )
        batch = results[0]["batch"]
        ax_t.set(xscale="log", yscale="log", xlabel="T", ylabel="median time (s)",
                 title=f"time, d={d}, batch x heads={batch} (dotted: extrapolated)")
        ax_m.set(xscale="log", yscale="log", xlabel="T", ylabel="peak extra memory (MB)",
                 title=f"peak memory, d={d}")
        for ax in (ax_t, ax_m):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"polylin bench: {report.get('meta', {}).get('command', '')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
