"""The GPU benchmark's code paths, run on the CPU with tiny sizes (``--device cpu``).

No performance is asserted: these tests check that every implementation runs, that outputs are
compared with the float64 oracle and land on the input's device, that the fla adapter converts
layouts and applies the feature map correctly, that the time budget stops a run cleanly, and
that ratios and targets are judged only on what was measured.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import baselines, gpu
from benchmarks.run import main
from polylin.testing import Backend

from .reference import ATOL, seed_loop

pytestmark = pytest.mark.only_backend(Backend.TORCH)

SEQ_LENS = (48, 32)  # 48 is not a multiple of the chunk size
TINY = ["--device", "cpu", "--seq-lens", *map(str, SEQ_LENS), "--dims", "8",
        "--dtypes", "float32", "bfloat16", "--batch", "1", "--heads", "2", "--chunk-size", "16",
        "--repeats", "1", "--seed-loop-len", "8", "--matmul-size", "32"]


def _bench(out, *extra):
    code = main(["gpu", *TINY, "--out", str(out), *extra])
    report = json.loads((out / gpu.JSON_NAME).read_text())
    return code, report


def _rows(report, **where):
    return [r for r in report["results"] if all(r.get(k) == v for k, v in where.items())]


@pytest.fixture(scope="module")
def _smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu")
    code, report = _bench(out)
    return code, report, out


@pytest.fixture
def smoke(backend, _smoke_run):
    return _smoke_run


def test_smoke_run_measures_every_cpu_implementation(smoke):
    code, report, out = smoke
    assert code == 0
    assert report["schema"] == gpu.SCHEMA
    assert report["backends"] == {"torch": "torch", "second": "numpy"}
    assert report["meta"]["stopped_early"] is False
    cells = {(T, "float32") for T in SEQ_LENS} | {(T, "bfloat16") for T in SEQ_LENS}
    for impl, backend, passes, dtypes in [
        ("chunked", "torch", gpu.PASSES, ("float32", "bfloat16")),
        ("chunked", "numpy", ("forward",), ("float32",)),
        ("quadratic", "torch", gpu.PASSES, ("float32", "bfloat16")),
        ("sdpa", "torch", gpu.PASSES, ("float32", "bfloat16")),
    ]:
        for T, dtype in cells:
            if dtype not in dtypes:
                continue
            for p in passes:
                (row,) = _rows(report, impl=impl, backend=backend, T=T, dtype=dtype, **{"pass": p})
                assert row["status"] == "ok", row
                assert row["median_s"] > 0 and row["repeats"] >= 1
    assert (out / gpu.PNG_NAME).stat().st_size > 0


@pytest.mark.parametrize("impl", ["chunked", "quadratic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_match_float64_oracle_on_input_device(smoke, impl, dtype):
    _, report, _ = smoke
    rows = _rows(report, impl=impl, dtype=dtype, status="ok", **{"pass": "forward"})
    assert {r["T"] for r in rows} == set(SEQ_LENS)
    for r in rows:
        assert r["output_on_input_device"] is True
        assert r["output_device"] == "cpu"
        # The oracle sees the same dtype-rounded inputs: only accumulation/output rounding.
        assert r["max_abs_diff_vs_float64"] <= ATOL[dtype], r


def test_second_library_returns_its_own_arrays(smoke):
    _, report, _ = smoke
    rows = _rows(report, backend="numpy", status="ok")
    assert rows
    for r in rows:
        assert r["output_library"] == "numpy"
        assert r["max_abs_diff_vs_float64"] <= ATOL["float32"]
    (skipped,) = _rows(report, backend="numpy", T=32, dtype="bfloat16", **{"pass": "forward"})
    assert skipped["status"] == "skipped" and "bfloat16" in skipped["reason"]


def test_unavailable_paths_are_recorded_with_reasons(smoke):
    _, report, _ = smoke
    assert "fla" in report["meta"]["fla"] and "CUDA" in report["meta"]["fla"]
    for r in _rows(report, impl="fla_chunk"):
        assert r["status"] == "skipped" and "fla" in r["reason"]
    for r in _rows(report, impl="chunked_tf32"):
        assert r["status"] == "skipped" and "TF32" in r["reason"]


def test_seed_loop_is_timed_short_and_extrapolated(smoke):
    _, report, _ = smoke
    assert {(s["d"], s["dtype"]) for s in report["seed_loop"]} == {(8, "float32"), (8, "bfloat16")}
    for s in report["seed_loop"]:
        assert s["status"] == "ok", s
        assert s["T_measured"] == 8
        assert "extrapolation" in s["note"]
        assert set(s["extrapolated_s"]) == {str(T) for T in SEQ_LENS}
        for T, seconds in s["extrapolated_s"].items():
            assert seconds == pytest.approx(s["per_token_s"] * int(T))
        assert s["max_abs_diff_vs_float64"] <= ATOL[s["dtype"]]


def test_ratios_come_from_the_same_run(smoke):
    _, report, _ = smoke
    labels = {r["ratio"] for r in report["ratios"]}
    assert {"polylin_over_sdpa", "polylin_over_quadratic", "second_over_torch"} <= labels
    medians = {(r["impl"], r["backend"], r["T"], r["dtype"], r["pass"]): r["median_s"]
               for r in report["results"] if r["status"] == "ok"}
    for r in report["ratios"]:
        if r["ratio"] == "second_over_torch":
            key = (r["T"], r["dtype"], r["pass"])
            expected = medians[("chunked", "numpy", *key)] / medians[
                ("chunked", "torch", *key)]
            assert r["value"] == pytest.approx(expected)


def test_summary_of_an_earlier_report(smoke, capsys):
    _, report, out = smoke
    assert main(["gpu", "--summary-of", str(out / gpu.JSON_NAME)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("polylin bench-gpu on cpu:")
    assert "seed loop d=8 float32" in text and "extrapolated" in text
    assert text.strip() == gpu.summarize(report).strip()


def test_time_budget_stops_cleanly(backend, tmp_path):
    code, report = _bench(tmp_path, "--time-budget", "0", "--no-plot")
    assert code == 0
    assert report["meta"]["stopped_early"] is True
    assert len(report["meta"]["cells_not_run"]) == len(SEQ_LENS) * 2
    assert report["results"] == []
    assert all(t["status"] == "not measured" for t in report["targets"])


def _fake_fla_chunk_linear_attn(q, k, v, scale=None, initial_state=None,
                                output_final_state=False, normalize=True, cu_seqlens=None):
    """fla's documented semantics, in plain torch: (B, T, H, D), no feature map, normalizer
    ``(scale q) . cumsum(k) + 1e-10``. Stands in for the Triton kernel on the CPU."""
    assert normalize is True and scale == 1.0
    # A layout mix-up in the adapter (heads read as time) shows up as a large output error.
    import torch

    qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))  # (B, H, T, D)
    scores = torch.tril(scale * qh @ kh.transpose(-1, -2))
    out = (scores @ vh) / (scores.sum(-1, keepdim=True) + 1e-10)
    return out.transpose(1, 2).to(q.dtype), None


def test_fla_adapter_converts_layout_and_applies_the_feature_map(backend, tmp_path, monkeypatch):
    calls = []

    def fake_load(device):
        calls.append(device)
        return _fake_fla_chunk_linear_attn, "fake"

    monkeypatch.setattr(baselines, "load_fla", fake_load)
    code, report = _bench(tmp_path, "--no-plot")
    assert code == 0 and set(calls) == {"cpu"}
    assert report["meta"]["fla"].startswith("fla fake")
    rows = _rows(report, impl="fla_chunk")
    assert len(rows) == len(SEQ_LENS) * 2 * len(gpu.PASSES)
    for r in rows:
        assert r["status"] == "ok", r
        if r["pass"] == "forward":
            assert r["output_on_input_device"] is True
            assert r["max_abs_diff_vs_float64"] <= ATOL[r["dtype"]], r
    assert any(r["ratio"] == "polylin_over_fla" for r in report["ratios"])


def test_cuda_device_without_gpu_says_so(backend, tmp_path, capsys):
    if backend.module().cuda.is_available():
        pytest.skip("a CUDA device is present: the real benchmark runs in backends/gpu-check.sh")
    assert main(["gpu", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_seed_loop_is_the_original_loop(backend, rng):
    q, k, v = rng.standard_normal((3, 2, 11, 4))
    out = baselines.seed_loop(*(backend.from_numpy(x) for x in (q, k, v)))
    np.testing.assert_allclose(backend.to_numpy(out), seed_loop(q, k, v), rtol=0, atol=1e-12)


def test_flops_follow_the_shared_model(smoke):
    """The GPU report counts the chunked path's flops with the CPU benchmark's model."""
    from benchmarks.model import chunked_useful_flops

    _, report, _ = smoke
    (row,) = _rows(report, impl="chunked", backend="torch", T=48, dtype="float32",
                   **{"pass": "forward"})
    assert row["model_flops"] == chunked_useful_flops(1 * 2, 48, 8, 8, 16)


def test_gpu_check_script_names_files_that_exist():
    """backends/gpu-check.sh runs on a borrowed machine with no second try: every test file it
    names must exist, and every test-only module it imports must be among the carried wheels or
    the machine's own packages (docs/contributing.md)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = (root / "backends" / "gpu-check.sh").read_text()
    named = set(re.findall(r"tests/[\w/]+\.py", script))
    assert named, "the script names no test file"
    assert [n for n in sorted(named) if not (root / n).is_file()] == []
    wheels = re.search(r"^GPU_WHEELS = (.*)$", (root / "Makefile").read_text(), re.M).group(1)
    carried = {w.split("==")[0].replace("-", "_") for w in wheels.split()}
    conftest = (root / "tests" / "conftest.py").read_text()
    imported = set(re.findall(r"^(?:from|import) (array_api_\w+)", conftest, re.M))
    assert imported <= carried, f"conftest imports {imported - carried}, not in GPU_WHEELS"
