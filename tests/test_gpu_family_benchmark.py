"""benchmarks/gpu_family.py on the CPU (its ``--device cpu`` smoke mode): every op and pass is
measured and checked against polylin's float64 result, the decoding loops run, the ratios and
goals are computed from the rows; with a stand-in for fla, the comparison rows too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import gpu_family
from polylin.compat import fla as compat
from polylin.testing import Backend

pytestmark = pytest.mark.only_backend(Backend.TORCH)

SMOKE = [
    "--device", "cpu", "--seq-lens", "64", "--dims", "8", "--dtypes", "float32", "bfloat16",
    "--batch", "1", "--heads", "2", "--repeats", "1", "--decode-batches", "1", "2",
    "--decode-tokens", "3",
]  # fmt: skip

#: float32 outputs of order 1-10 against float64; bfloat16: a few roundings of outputs ~1-10.
ATOL = {"float32": 1e-4, "bfloat16": 0.5}


def _run(tmp_path, *extra: str) -> tuple[int, dict]:
    path = tmp_path / "family.json"
    code = gpu_family.main([*SMOKE, "--json", str(path), *extra])
    return code, json.loads(path.read_text())


def test_smoke_run_measures_every_op_and_pass(backend, tmp_path, capsys):
    code, report = _run(tmp_path)
    assert code == 0
    assert report["schema"] == gpu_family.SCHEMA
    rows = report["rows"]
    for op in gpu_family.OPS:
        for dtype in ("float32", "bfloat16"):
            for mode in ("forward", "forward+backward"):
                (row,) = [r for r in rows if (r["op"], r["dtype"], r["mode"], r["impl"])
                          == (op, dtype, mode, "polylin")]  # fmt: skip
                assert row["ms"] > 0
                if mode == "forward":
                    assert row["max_abs_diff"] <= ATOL[dtype], row
        (numpy_row,) = [r for r in rows if r["op"] == op and r["impl"] == "polylin_numpy"]
        assert numpy_row["dtype"] == "float32" and numpy_row["max_abs_diff"] <= ATOL["float32"]
    decoded = {(r["op"], r["batch"]) for r in report["decoding"]}
    assert decoded == {(op, b) for op in gpu_family.DECODE_OPS for b in (1, 2)}
    assert all(r["us_per_token"] > 0 for r in report["decoding"])
    assert "fla not run" in report["meta"]["fla"]
    goals = {g["ratio"]: g for g in report["goals"]}
    assert goals["polylin/fla"]["met"] is None and goals["polylin/sdpa"]["met"] is None
    assert goals["cupy/polylin"]["cells"] == len(gpu_family.OPS)
    out = capsys.readouterr().out
    assert "goal [not measured] polylin/fla <= 2.0" in out
    assert "decode fused_recurrent_kda batch 2" in out
    assert gpu_family.main(["--summary-of", str(tmp_path / "family.json")]) == 0
    assert capsys.readouterr().out == out.split("polylin GPU family benchmark on", 1)[1].join(
        ["polylin GPU family benchmark on", ""]
    )


def test_ratios_and_goals_against_a_stand_in_for_fla(backend, tmp_path, monkeypatch):
    """fla's ops replaced by polylin's twins (same names and signatures): every cell gets a
    polylin/fla ratio, the goal judges the cells at T = 8192 only, and the decoding loops of
    the two agree."""
    stand_in = SimpleNamespace(**{name: getattr(compat, name) for name in compat.__all__})
    monkeypatch.setattr(gpu_family, "load_fla", lambda device: (stand_in, "fla stand-in"))
    code, report = _run(tmp_path, "--ops", "chunk_gla", "chunk_kda", "--dtypes", "float32")
    assert code == 0
    fla_rows = [r for r in report["rows"] if r["impl"] == "fla"]
    assert len(fla_rows) == 2 * 2  # two ops, two passes
    assert all(r["max_abs_diff"] <= ATOL["float32"] for r in fla_rows if r["mode"] == "forward")
    ratios = [r for r in report["ratios"] if r["ratio"] == "polylin/fla"]
    assert len(ratios) == 4 and all(r["value"] > 0 for r in ratios)
    goal = next(g for g in report["goals"] if g["ratio"] == "polylin/fla")
    assert goal["cells"] == 0 and goal["met"] is None  # T = 64 here: the goal is at 8192
    decode = [r for r in report["decoding"] if "max_abs_diff_vs_polylin" in r]
    assert decode and all(r["max_abs_diff_vs_polylin"] == 0.0 for r in decode)


def test_goals_judge_the_cells_they_name():
    report = {"ratios": [
        {"ratio": "polylin/fla", "T": 8192, "dtype": "bfloat16", "value": 1.5},
        {"ratio": "polylin/fla", "T": 4096, "dtype": "bfloat16", "value": 9.0},
        {"ratio": "polylin/sdpa", "T": 4096, "dtype": "bfloat16", "value": 0.5},
        {"ratio": "polylin/sdpa", "T": 1024, "dtype": "bfloat16", "value": 3.0},
        {"ratio": "polylin/sdpa", "T": 8192, "dtype": "float32", "value": 3.0},
        {"ratio": "cupy/polylin", "T": 1024, "dtype": "float32", "value": 1.4},
    ]}  # fmt: skip
    goals = {g["ratio"]: g for g in gpu_family.goals(report)}
    assert (goals["polylin/fla"]["cells"], goals["polylin/fla"]["met"]) == (1, True)
    assert (goals["polylin/sdpa"]["cells"], goals["polylin/sdpa"]["met"]) == (1, True)
    assert (goals["cupy/polylin"]["worst"], goals["cupy/polylin"]["met"]) == (1.4, False)


def test_cuda_device_without_gpu_says_so(backend, tmp_path, capsys):
    if backend.module().cuda.is_available():
        pytest.skip("a CUDA device is present: the real benchmark runs in backends/gpu-check.sh")
    assert gpu_family.main(["--device", "cuda", "--json", str(tmp_path / "x.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_profile_smoke_run_measures_every_op_and_variant(backend, tmp_path):
    """benchmarks/gpu_profile.py on the CPU: every op at every chunk size (and the gated delta
    rule with the levels' inverse) has both passes timed; decoding is timed; the summary names
    every row. (Graph replay and the kernel profile need CUDA.)"""
    from benchmarks import gpu_profile

    path = tmp_path / "profile.json"
    argv = "--device cpu --T 48 --d 8 --batch 1 --heads 2 --dtype float32 --chunks 16 32"
    argv = [*argv.split(), "--repeats", "1", "--json", str(path)]
    assert gpu_profile.main(argv) == 0
    report = json.loads(path.read_text())
    assert report["schema"] == gpu_profile.SCHEMA
    seen = {(r["op"], r["variant"]) for r in report["rows"] if r["forward_backward_ms"] > 0}
    want = {(op, f"chunk {c}") for op in gpu_family.OPS for c in (16, 32)}
    assert seen == want | {("chunk_gated_delta_rule", "levels")}
    assert [r["batch"] for r in report["decoding"] if r["eager_us"] > 0] == [1, 64]
    text = gpu_profile.summarize(report)
    assert all(f"{op:24s} chunk 16" in text for op in gpu_family.OPS)


def test_profile_chunk_size_reaches_the_chunked_forms(backend, monkeypatch):
    """The profile's chunk-size context sets the chunk size the delta rule and linear attention
    forms receive, and restores the forms after it."""
    import polylin.attention
    import polylin.delta_rule
    from benchmarks import gpu_profile

    seen = []
    saved = polylin.delta_rule.delta_chunked
    monkeypatch.setattr(
        polylin.delta_rule,
        "delta_chunked",
        lambda *a, **k: seen.append(k["chunk_size"]) or saved(*a, **k),
    )
    torch = backend.module()
    x = gpu_family.make_inputs(torch, 1, 20, 2, 8, "float32", "cpu")
    linear = polylin.attention.causal_chunked
    with gpu_profile.chunk_size(128):
        gpu_family.op_call(compat, "chunk_gated_delta_rule", x)()
    assert seen == [128]
    assert polylin.attention.causal_chunked is linear
    gpu_family.op_call(compat, "chunk_gated_delta_rule", x)()
    assert seen == [128, 64]


def test_a_call_past_its_limit_is_an_error_not_the_end_of_the_run():
    """``time_limit`` interrupts a call that runs past it (a stuck autotuning), restores the
    previous handler, and a limit of 0 is none."""
    import signal
    import time

    handler = signal.getsignal(signal.SIGALRM)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"0\.2 s"), gpu_family.time_limit(0.2):
        time.sleep(5)
    assert time.perf_counter() - start < 2
    assert signal.getsignal(signal.SIGALRM) == handler
    with gpu_family.time_limit(0):
        time.sleep(0.01)
