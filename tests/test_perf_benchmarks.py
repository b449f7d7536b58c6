"""benchmarks/decoding.py and benchmarks/forward.py at tiny sizes: rows, goals, JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


def test_decoding_benchmark(tmp_path):
    from benchmarks import decoding

    out = tmp_path / "decoding.json"
    report = decoding.main(
        ["--shapes", "1,1,8;2,2,8", "--tokens", "2", "--samples", "3", "--json", str(out)]
    )
    assert {(r["backend"], r["op"]) for r in report["rows"]} == {
        (b, op) for b in ("numpy", "torch")
        for op in ("step", "delta_rule_step", "dplr_delta_rule_step")
    }  # fmt: skip
    small, large = (r for r in report["rows"] if r["op"] == "step" and r["backend"] == "numpy")
    assert "floor_us" not in small and large["floor_us"] > 0 and large["stream_floor_us"] > 0
    assert all(g["met"] == (g["value"] <= g["limit"]) for g in report["goals"])
    assert len(report["goals"]) == 6 + 2 * 6  # prepared/bare at 1x1, two floors at the other
    assert json.loads(out.read_text())["goals"] == report["goals"]


def test_forward_benchmark(tmp_path):
    pytest.importorskip("einops")  # fla's naive form
    from benchmarks import forward

    out = tmp_path / "forward.json"
    report = forward.main(
        ["--lengths", "128", "--threads", "1", "--repeats", "1", "--json", str(out)]
    )
    (row,) = report["rows"]
    for name in ("undecayed", "scalar", "channel", "fla naive", "default"):
        assert row[name] > 0
    names = [g["name"] for g in report["goals"]]
    assert "scalar / fla naive, T=128, 1 threads" in names
    assert json.loads(out.read_text())["rows"] == report["rows"]
