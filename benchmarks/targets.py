"""Performance targets: read from ``targets.toml`` beside this file, judged on one report.

The targets are data, not code: each entry of ``targets.toml`` names the rows of a report table
whose ratio (or value) it bounds; the syntax is described at the top of that file. Every ratio
is taken between two measurements of the same run; a target whose measurements are not in the
report (another ``--seq-lens``, a backend not run) says ``not measured`` instead of guessing.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["TARGETS_FILE", "evaluate", "load"]

TARGETS_FILE = Path(__file__).with_name("targets.toml")

#: Keys that identify a measurement; ratio rows are paired on those the selectors agree on.
KEYS = ("backend", "impl", "method", "T", "d", "dtype", "pass", "position")

#: Values a row has when its report predates the field.
_DEFAULTS = {"pass": "forward"}

_COMPARISONS: dict[str, tuple[str, Callable[[float, float], bool]]] = {
    "at_most": ("<=", operator.le),
    "at_least": (">=", operator.ge),
    "below": ("<", operator.lt),
    "above": (">", operator.gt),
}


def load(kind: str, path: Path = TARGETS_FILE) -> list[dict[str, Any]]:
    """The ``[[kind]]`` entries (``"cpu"`` or ``"gpu"``) of the targets file."""
    with open(path, "rb") as f:
        return list(tomllib.load(f).get(kind, []))


def _get(row: dict, key: str) -> Any:
    return row.get(key, _DEFAULTS.get(key))


def _usable(row: dict, field: str) -> bool:
    if row.get("extrapolated") or row.get("skipped") or row.get("status", "ok") != "ok":
        return False
    return row.get(field) is not None


def _resolve(value: Any, roles: dict[str, str]) -> Any:
    if isinstance(value, str) and value.startswith("$"):
        return roles.get(value[1:], value)
    return value


def _matches(row: dict, selector: dict, rows: list[dict], roles: dict[str, str]) -> bool:
    for key, want in selector.items():
        have = _get(row, key)
        want = _resolve(want, roles)
        if isinstance(want, dict):
            if have is None or ("at_least" in want and have < want["at_least"]):
                return False
            if "at_most" in want and have > want["at_most"]:
                return False
        elif want in ("min", "max"):
            present = [_get(r, key) for r in rows if _get(r, key) is not None]
            if not present or have != (min(present) if want == "min" else max(present)):
                return False
        elif have != want:
            return False
    return True


def _pair_keys(num: dict, den: dict) -> list[str]:
    differ = {k for k in set(num) & set(den) if num[k] != den[k]}
    differ |= set(num) ^ set(den)
    return [k for k in KEYS if k not in differ]


def _groups(rows: list[dict], keys: list[str]) -> Iterable[dict[str, Any]]:
    if not keys:
        yield {}
        return
    present = sorted(
        {tuple(_get(r, k) for k in keys) for r in rows},
        key=lambda t: [(x is None, type(x).__name__, 0 if x is None else x) for x in t],
    )
    for values in present:
        yield dict(zip(keys, values))


def _judge(spec: dict, name: str, cells: list[dict]) -> dict[str, Any]:
    (how,) = [k for k in _COMPARISONS if k in spec]
    symbol, ok = _COMPARISONS[how]
    limit = spec[how]
    for cell in cells:
        cell["met"] = bool(ok(cell["value"], limit))
    if not cells:
        measured, met, status = None, None, "not measured"
    else:
        worst = max if how in ("at_most", "below") else min
        measured = worst(c["value"] for c in cells)
        met = all(c["met"] for c in cells)
        status = "met" if met else "missed"
    return {
        "target": name,
        "measured": measured,
        "limit": limit,
        "comparison": symbol,
        "unit": "x",
        "met": met,
        "status": status,
        "cells": cells,
    }


def _cell(keys: Iterable[str], row: dict, value: float) -> dict[str, Any]:
    return {**{k: _get(row, k) for k in keys if _get(row, k) is not None}, "value": value}


def evaluate(report: dict, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Judge ``specs`` (from :func:`load`) on ``report``; one entry per target and group.

    Each entry has ``target`` (its name), ``measured`` (the ratio or value; over several cells
    the worst one), ``limit``, ``comparison``, ``met`` (``None`` when not measured), ``status``
    (``met``, ``missed``, ``not measured``) and ``cells`` (every pair of rows judged).
    """
    roles = report.get("backends", {})
    out = []
    for spec in specs:
        table = [dict(r) for r in report.get(spec.get("table", "results"), [])]
        field = spec.get("field", "median_s")
        for group in _groups(table, spec.get("for_each", [])):
            rows = [r for r in table if all(_get(r, k) == v for k, v in group.items())]
            fmt = {**group, "backends": roles}
            if "select" in spec:
                chosen = [r for r in rows if _matches(r, spec["select"], rows, roles)]
                cells = [_cell(KEYS, r, r[field]) for r in chosen if _usable(r, field)]
                out.append(_judge(spec, spec["name"].format(**fmt), cells))
                continue
            num_sel, den_sel = spec["numerator"], spec["denominator"]
            nums = [r for r in rows if _matches(r, num_sel, rows, roles)]
            dens = [r for r in rows if _matches(r, den_sel, rows, roles)]
            if nums and dens and all(a is b for a, b in itertools.product(nums, dens)):
                continue  # one row is both ends: nothing to compare
            pair = _pair_keys(num_sel, den_sel)
            cells = []
            for a, b in itertools.product(nums, dens):
                if any(_get(a, k) != _get(b, k) for k in pair):
                    continue
                if _usable(a, field) and _usable(b, field) and b[field]:
                    cells.append(_cell(pair, a, a[field] / b[field]))
                    fmt.update(num=a, den=b)
            if nums and dens and "num" not in fmt:
                fmt.update(num=nums[0], den=dens[0])
            try:
                name = spec["name"].format(**fmt)
            except (KeyError, IndexError):  # a name that quotes rows that are not there
                if not nums or not dens:
                    continue
                raise
            out.append(_judge(spec, name, cells))
    return out
