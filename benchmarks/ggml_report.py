"""The report of ``benchmarks/ggml_ops.py``: rows, the issue's goals and a Markdown table.

Each row is polylin's time on one case, thread count and backend, the median over the passes,
and its ratio to ggml's time in the same pass (median and range). The goals: prefill at most
1.0x ggml's time at equal threads, 0.5x from T = 512; one decoding token at most 1.2x at the
2 MiB states, 2x at the others; and for prefill from T = 512, two threads at least
:data:`TWO_THREADS` times faster than one (judged as the two-thread time over the one-thread
time, at most its inverse), with ggml's own gain in the goal's name.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from benchmarks.timing import goal

if TYPE_CHECKING:
    from benchmarks.ggml_ops import Case

#: The gain a second thread must give a prefill call from T = 512.
TWO_THREADS = 1.6


def limit(case: Case) -> float:
    """The issue's goal for polylin / ggml on ``case`` at equal threads."""
    if case.phase == "decode":  # the 2 MiB states are memory-bound for both
        return 1.2 if case.family in ("gdn", "kda") and case.size("d") == 128 else 2.0
    return 0.5 if case.size("T") >= 512 else 1.0


def combine(
    chosen: list[Case], passes: list[dict[str, Any]], backends: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows (per case, threads, backend) and goals from the passes' raw measurements: each
    pass's ratio is of two measurements of that pass; the row has the median and range."""
    rows, goals = [], []
    for case in chosen:
        for threads in sorted({p["threads"] for p in passes}):
            mine = [p for p in passes if p["threads"] == threads]
            ggml = [next((r["seconds"] for r in p["ggml"] if case.matches(r)), None)
                    for p in mine]  # fmt: skip
            for backend in backends:
                own = [next(r for r in p["polylin"]
                            if r["case"] == case.name and r["backend"] == backend)
                       for p in mine]  # fmt: skip
                row = {"case": case.name, "op": case.op, "phase": case.phase,
                       "threads": threads, "backend": backend,
                       "error": max(r["error"] for r in own),
                       "polylin_s": statistics.median(r["seconds"] for r in own)}  # fmt: skip
                for key in ("floor_s", "compile_s", "products_share", "operations_share",
                            "products_flops", "recurrence_flops", "faults_per_call"):
                    if all(key in r for r in own):
                        row[key] = statistics.median(r[key] for r in own)
                ratios = [r["seconds"] / g for r, g in zip(own, ggml) if g]
                if ratios:
                    row.update(ggml_s=statistics.median(g for g in ggml if g),
                               ratio=statistics.median(ratios), ratio_min=min(ratios),
                               ratio_max=max(ratios))  # fmt: skip
                    if "floor_s" in row:
                        row["floor_ratio"] = statistics.median(
                            r["floor_s"] / g for r, g in zip(own, ggml) if g)
                    if "recurrence_flops" in row:  # ggml's rate on its loop's arithmetic
                        row["ggml_gflops"] = row["recurrence_flops"] / row["ggml_s"] * 1e-9
                    goals.append(goal(f"{case.name}, {backend} / ggml, {threads} thread(s)",
                                      row["ratio"], limit(case)))  # fmt: skip
                rows.append(row)
        if case.phase == "prefill" and case.size("T") >= 512:
            goals.extend(_second_thread(case, rows, backends))
    return rows, goals


def _second_thread(
    case: Case, rows: list[dict[str, Any]], backends: list[str]
) -> list[dict[str, Any]]:
    """The goal of two threads over one for ``case``'s rows of each backend (none without both
    thread counts): the two-thread time over the one-thread time, at most ``1 / TWO_THREADS``."""
    out = []
    for backend in backends:
        times = {r["threads"]: r for r in rows if (r["case"], r["backend"]) == (case.name, backend)}
        if 1 not in times or 2 not in times:
            continue
        one, two = times[1], times[2]
        ggml = (f" (ggml {one['ggml_s'] / two['ggml_s']:.2f}x)"
                if "ggml_s" in one and "ggml_s" in two else "")  # fmt: skip
        gain = one["polylin_s"] / two["polylin_s"]
        out.append(goal(f"{case.name}, {backend}: two threads' time / one's, {gain:.2f}x{ggml}",
                        two["polylin_s"] / one["polylin_s"], 1 / TWO_THREADS))  # fmt: skip
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: one line per case and thread count (with ``--floors``,
    PyTorch's floor as a last column, at prefill with its products' flops over the loop's)."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    what = " / ggml" if any("ratio" in r for r in rows) else ""
    floors = any("floor_s" in r for r in rows)
    lines = ["| op, shape | threads | ggml | " + " | ".join(f"{b}{what}" for b in backends)
             + " | max error |" + (f" torch's floor{what} |" if floors else ""),
             "|---" * (4 + len(backends) + floors) + "|"]  # fmt: skip
    for key in dict.fromkeys((r["case"], r["threads"]) for r in rows):
        mine = [r for r in rows if (r["case"], r["threads"]) == key]
        ggml = mine[0].get("ggml_s")
        cells = [f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
                 if "ratio" in r else f"{r['polylin_s'] * 1e3:.3f} ms" for r in mine]  # fmt: skip
        floor = next((r for r in mine if "floor_s" in r), None)
        if floors:  # the floor over ggml's time, or itself where ggml has no row
            cell = "-" if floor is None else f"{floor['floor_ratio']:.2f}" if (
                "floor_ratio" in floor) else f"{floor['floor_s'] * 1e3:.3f} ms"  # fmt: skip
            if floor is not None and floor.get("recurrence_flops"):  # prefill's arithmetic
                share = floor["products_flops"] / floor["recurrence_flops"]
                cell += f" ({share:.2f}x the loop's flops)"
            cells.append(cell)
        lines.append(f"| {key[0]} | {key[1]} | "
                     f"{'-' if ggml is None else f'{ggml * 1e3:.3f} ms'} | "
                     + " | ".join(cells[:len(backends)])
                     + f" | {max(r['error'] for r in mine):.1e} |"
                     + "".join(f" {c} |" for c in cells[len(backends):]))  # fmt: skip
    return "\n".join(lines)
