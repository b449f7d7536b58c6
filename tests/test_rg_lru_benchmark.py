"""benchmarks/rg_lru.py at a tiny size: the layers are checked equal before timing; one row
per threads, length and pass; a different layer is refused."""

from __future__ import annotations

import json

import pytest


def test_rg_lru_benchmark(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks import rg_lru

    out = tmp_path / "rg_lru.json"
    report = rg_lru.main([
        "--lengths", "40", "--threads", "1", "--width", "16", "--heads", "2", "--repeats", "1",
        "--json", str(out),
    ])  # fmt: skip
    assert [r["pass"] for r in report["rows"]] == ["forward", "forward+backward"]
    for r in report["rows"]:
        assert r["ratio"] == r["polylin_s"] / r["transformers_s"] and r["max_diff"] < 1e-4
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_rg_lru_check_refuses_a_different_layer():
    pytest.importorskip("transformers")
    import torch

    from benchmarks import rg_lru

    theirs, ours = rg_lru.layers(16, 2)
    with torch.no_grad():
        ours.recurrent_param.add_(1.0)  # other decays: a different function
    with pytest.raises(AssertionError):
        rg_lru.check(theirs, ours, torch.randn(1, 20, 16))
