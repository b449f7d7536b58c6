"""benchmarks/compat.py at tiny sizes: every row is measured, after its outputs were checked."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="the compat benchmark times PyTorch models")
pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
pytest.importorskip("einops", reason="fla's naive forms need einops (the bench extra)")
if __import__("importlib.util").util.find_spec("fla") is None:
    pytest.skip("fla-core is not installed (the bench extra)", allow_module_level=True)

from benchmarks import compat


def test_quick_run_records_every_row(tmp_path):
    out = tmp_path / "compat.json"
    result = compat.main(["--quick", "--json", str(out), "--markdown", str(tmp_path)])
    assert json.loads(out.read_text()) == result
    rows = {(r["model"], r["what"]) for r in result["rows"]}
    for model in ("qwen3_next", "kimi_linear"):
        for what in ("prefill", "decode per token", "forward+backward"):
            assert (model, what) in rows
            if what != "decode per token":  # the same step with a kernel that takes no time
                assert (model, f"{what}, no-time kernel") in rows
    ops = {r["model"] for r in result["rows"] if r["what"] == "forward"}
    assert ops == {f"fla.chunk_{name}" for name in compat.OPS}
    for r in result["rows"]:
        assert r["speedup"] > 0 and all(t > 0 for t in r["seconds"].values())
    assert result["transformers"] and result["fla"] == "0.6.0"
    tables = (tmp_path / "compat_models.md").read_text(), (tmp_path / "compat_ops.md").read_text()
    assert "| qwen3_next | prefill | 64 |" in tables[0]
    assert "| kimi_linear | forward+backward, no-time kernel | 64 |" in tables[0]
    assert "`fla.chunk_gated_delta_rule` | `naive_chunk_gated_delta_rule`" in tables[1]


def test_no_time_kernel_has_the_kernels_shapes_and_gradients():
    torch = pytest.importorskip("torch")
    q, k = (torch.randn(1, 5, 2, 8, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 5, 4, 6, requires_grad=True)
    g, beta = (torch.rand(1, 5, 4, requires_grad=True) for _ in range(2))
    out, state = compat.no_time_kernel(q, k, v, g=g, beta=beta, output_final_state=True)
    assert out.shape == v.shape and state.shape == (1, 4, 8, 6) and not state.any()
    out.sum().backward()
    assert all(x.grad is not None for x in (q, k, v, g, beta))
    assert compat.no_time_kernel(q, k, v, g=g, beta=beta)[1] is None


def test_a_difference_that_is_not_positive_is_timed_again(monkeypatch):
    """Decoding's time per token is a difference of two generate calls' times: where the
    machine made it 0 or negative, the calls are timed again with twice the runs."""
    runs = []
    seconds = iter([{"a 1": 2.0, "a 5": 1.0}, {"a 1": 1.0, "a 5": 1.0},
                    {"a 1": 1.0, "a 5": 3.0}])  # fmt: skip

    def timed(calls, repeats, stat):
        runs.append(repeats)
        return next(seconds)

    monkeypatch.setattr(compat, "alternate", timed)
    assert compat.per_token_seconds({}, ["a"], 4, 1) == {"a": 0.5}
    assert runs == [3, 6, 12]
