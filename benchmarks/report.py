"""The CPU report: the printed summary and the plot of ``bench.json``.

Every ratio is taken between two measurements of the same run (same machine state, same
inputs); the targets are judged by :mod:`benchmarks.targets`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot", "summarize"]

_MB = 2**20


def _key(row: dict) -> tuple:
    return (row["backend"], row["method"], row["T"], row["d"], row.get("pass", "forward"))


def _median(
    report: dict, backend: str, method: str, T: int, d: int, mode: str = "forward"
) -> float | None:
    for row in report["results"]:
        if _key(row) == (backend, method, T, d, mode):
            if row.get("extrapolated"):
                return None
            return row.get("median_s")
    return None


def _row(
    report: dict, backend: str, method: str, T: int, d: int, mode: str = "forward"
) -> dict | None:
    for row in report["results"]:
        if _key(row) == (backend, method, T, d, mode):
            return row
    return None


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
    keys = sorted({(r["backend"], r["d"], r.get("pass", "forward")) for r in results})
    for backend, d, mode in keys:
        rows = [r for r in results if _key(r)[0::3] == (backend, d) and _key(r)[4] == mode]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        lens = sorted({r["T"] for r in rows})
        batch = rows[0]["batch"]
        lines.append("")
        lines.append(
            f"{backend}, {mode}, d={d}, batch x heads={batch}, {rows[0]['dtype']}: median time "
            "(x = time / polylin chunked time; ~ = extrapolated per token)"
        )
        lines.append("      T " + "".join(f"{m:>20}" for m in methods) + "   chunked GEMM%")
        for T in lens:
            base = _median(report, backend, "chunked", T, d, mode)
            cells = []
            for m in methods:
                row = _row(report, backend, m, T, d, mode) or {}
                t = row.get("median_s")
                if t is None:
                    cells.append(f"{'-':>20}")
                    continue
                mark = "~" if row.get("extrapolated") else ""
                ratio = f" ({t / base:.1f}x)" if base and m != "chunked" else ""
                cells.append(f"{mark + _fmt_time(t) + ratio:>20}")
            frac = (_row(report, backend, "chunked", T, d, mode) or {}).get("gemm_fraction")
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
    series = list(dict.fromkeys((r["backend"], r["method"], _key(r)[4]) for r in results))
    styles = {"numpy": "-", "torch": "--"}
    for col, d in enumerate(dims):
        ax_t, ax_m = axes[0][col], axes[1][col]
        for backend, method, mode in series:
            rows = sorted(
                (r for r in results
                 if _key(r) == (backend, method, r["T"], d, mode) and r.get("median_s")),
                key=lambda r: r["T"],
            )
            if not rows:
                continue
            style = styles.get(backend, ":")
            label = f"{method} ({backend})" + ("" if mode == "forward" else f", {mode}")
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
