"""Smoke tests of ``python -m polylin bench`` at tiny sizes (no performance assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polylin.__main__ import main
from polylin.bench import METHODS, SCHEMA
from polylin.bench.baselines import chunked_useful_flops, plain_chunked
from polylin.bench.measure import Progress
from polylin.bench.report import summarize, targets
from polylin.testing import Backend

from .reference import masked_kernel, seed_loop


def _run(tmp_path, capsys, *extra):
    code = main(["bench", "--quick", "--out", str(tmp_path), *extra])
    captured = capsys.readouterr()
    report = json.loads((tmp_path / "bench.json").read_text())
    return code, captured, report


def test_quick_numpy_run_writes_json_plot_and_progress(tmp_path, capsys):
    code, captured, report = _run(tmp_path, capsys, "--backends", "numpy")
    assert code == 0
    assert report["schema"] == SCHEMA
    assert "\r[" in captured.err and "/" in captured.err  # the progress bar, on stderr
    assert "targets" in captured.out and "GEMM rate" in captured.out
    rows = report["results"]
    assert {r["method"] for r in rows} == {"chunked", "plain", "quadratic", "recurrent"}
    assert {r["T"] for r in rows} == {64, 128} and {r["backend"] for r in rows} == {"numpy"}
    for r in rows:
        assert r["median_s"] > 0 and len(r["times_s"]) >= 1
        assert (r["method"] == "recurrent") == ("peak_bytes" not in r)  # loops: no memory pass
        assert r.get("peak_bytes", 1) > 0
        if r["method"] != "chunked":
            assert r["max_abs_diff_vs_chunked"] < 1e-4  # every method computes the same thing
    chunked = [r for r in rows if r["method"] == "chunked"]
    assert all(0 < r["gemm_fraction"] for r in chunked)
    assert report["gemm_flops_per_s"]["numpy"] > 0
    assert [r["position"] for r in report["decode"]] == [1, 64]
    (check,) = report["memory_check"]
    assert check["peak_bytes"] > 0 and check["T"] == 128
    assert {t["target"].split(",")[0] for t in report["targets"]} >= {
        "torch chunked / torch plain chunked",
    }
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_quick_torch_run_has_the_torch_baselines(tmp_path, capsys):
    if not Backend.TORCH.available():
        pytest.skip(Backend.TORCH.unavailable_reason())
    code, captured, report = _run(
        tmp_path, capsys, "--backends", "torch", "--no-plot", "--seq-lens", "32", "96",
        "--loop-max-len", "32",
    )
    assert code == 0
    rows = {(r["method"], r["T"]): r for r in report["results"]}
    assert {m for m, _ in rows} == set(METHODS)
    # the loops are timed up to --loop-max-len and extrapolated per token beyond
    assert rows[("seed", 32)]["extrapolated"] is False
    assert rows[("seed", 96)]["extrapolated"] is True
    assert rows[("seed", 96)]["median_s"] == pytest.approx(rows[("seed", 32)]["median_s"] * 3)
    assert rows[("seed", 32)]["max_abs_diff_vs_chunked"] < 1e-4
    assert rows[("sdpa", 32)]["median_s"] > 0
    assert "~" in captured.out  # extrapolated times are marked in the table
    assert not (tmp_path / "bench.png").exists()


def test_quadratic_budget_skips_with_reason(tmp_path, capsys):
    _, _, report = _run(
        tmp_path, capsys, "--backends", "numpy", "--methods", "chunked", "quadratic",
        "--quadratic-budget-mb", "0.01", "--no-plot", "--no-memory",
    )
    skipped = [r for r in report["results"] if r["method"] == "quadratic"]
    assert skipped and all("--quadratic-budget-mb" in r["skipped"] for r in skipped)
    assert all("peak_bytes" not in r for r in report["results"])
    assert report["memory_check"] == []


def test_plain_chunked_matches_oracle_and_seed(rng):
    q, k, v = (rng.standard_normal((2, 37, 5)) for _ in range(3))
    expected = masked_kernel(q, k, v)
    np.testing.assert_allclose(plain_chunked(q, k, v, chunk_size=8), expected, atol=1e-10)
    np.testing.assert_allclose(seed_loop(q, k, v), expected, atol=1e-10)


def test_seed_loop_baseline_matches_oracle(rng):
    torch = pytest.importorskip("torch")
    from polylin.bench.baselines import seed_loop as torch_seed

    q, k, v = (rng.standard_normal((2, 20, 4)) for _ in range(3))
    out = torch_seed(*(torch.asarray(x) for x in (q, k, v)))
    np.testing.assert_allclose(out.numpy(), masked_kernel(q, k, v), atol=1e-10)


def test_useful_flops_counts_state_and_causal_half():
    # per token: 4 d_k d_v (state update and read-out) + C (d_k + d_v) (causal half of the chunk)
    assert chunked_useful_flops(2, 10, 3, 5, 4) == 2 * 10 * (4 * 15 + 4 * 8)
    assert chunked_useful_flops(1, 3, 2, 2, 64) == 3 * (16 + 3 * 4)  # chunk capped at T


def test_targets_compare_against_limits():
    def row(backend, method, T, d, t, **kw):
        return {"backend": backend, "method": method, "T": T, "d": d, "median_s": t,
                "batch": 8, "dtype": "float32", **kw}

    report = {
        "results": [
            row("torch", "chunked", 4096, 64, 1.0), row("torch", "plain", 4096, 64, 2.0),
            row("torch", "seed", 4096, 64, 20.0), row("numpy", "chunked", 4096, 64, 4.0),
            row("torch", "chunked", 16384, 64, 4.5),
            row("torch", "chunked", 4096, 128, 1.0, gemm_fraction=0.3),
        ],
        "decode": [
            {"backend": "torch", "position": 1, "d": 64, "per_token_s": 1.0},
            {"backend": "torch", "position": 65536, "d": 64, "per_token_s": 1.2},
        ],
        "memory_check": [{"backend": "torch", "T": 65536, "d": 64, "peak_over_inputs": 0.7,
                          "peak_bytes": 7, "t_by_t_bytes": 2**34}],
    }
    got = {t["target"]: (t["measured"], t["met"]) for t in targets(report)}
    assert got["torch chunked / torch plain chunked, T=4096, d=64"] == (0.5, True)
    assert got["seed loop / torch chunked (speed-up), T=4096, d=64"] == (20.0, False)
    assert got["numpy chunked / torch plain chunked, T=4096, d=64"] == (2.0, False)
    assert got["torch chunked time(T=16384) / time(T=4096), d=64"] == (4.5, True)
    assert got["torch chunked time(T=16384) / time(T=4096), d=128"] == (None, None)
    assert got["torch chunked useful flop rate / GEMM rate, T=4096, d=128"] == (0.3, False)
    assert got["torch chunked peak extra memory / inputs, T=65536, one head, d=64"] == (
        0.7, True)
    flat = got["torch decode time per token at position 65536 / at position 1 (flat)"]
    assert flat == (pytest.approx(1.2), True)
    report.update(meta={}, gemm_flops_per_s={}, targets=targets(report))
    text = summarize(report)
    assert "NOT met" in text and "(2.0x)" in text  # ratios printed next to times


def test_progress_bar_counts_to_total():
    import io

    stream = io.StringIO()
    bar = Progress(3, stream=stream, width=6)
    for label in ("a", "b", "c"):
        bar.step(label)
    bar.close()
    last = stream.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("[######] 3/3") and last.rstrip().endswith("c")


def test_lazy_backend_runs_and_decodes_from_a_materialized_state(tmp_path, capsys):
    if not Backend.DASK.available():
        pytest.skip(Backend.DASK.unavailable_reason())
    code, _, report = _run(
        tmp_path, capsys, "--backends", "dask", "--methods", "chunked", "plain",
        "--seq-lens", "32", "--no-plot", "--decode-positions", "1", "8",
    )
    assert code == 0
    assert [r["position"] for r in report["decode"]] == [1, 8]
    assert all(r["per_token_s"] > 0 for r in report["decode"])
    assert report["memory_check"][0]["peak_bytes"] is None  # no allocator counters for Dask
    plain = next(r for r in report["results"] if r["method"] == "plain")
    assert plain["max_abs_diff_vs_chunked"] < 1e-4
