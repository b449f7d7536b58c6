"""benchmarks/decoding.py and benchmarks/forward.py at tiny sizes: rows, goals, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


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
    for name in ("undecayed", "scalar", "channel", "channel floor", "fla naive", "default"):
        assert row[name] > 0
    assert row["channel floor / undecayed"] == row["channel floor"] / row["undecayed"]
    from polylin._forms.linear import chunked

    # the floor's patch undone
    assert chunked._channel_gate.__module__ == "polylin._forms.linear.chunked"
    names = [g["name"] for g in report["goals"]]
    assert "scalar / fla naive, T=128, 1 threads" in names
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_threads_benchmark(tmp_path):
    """benchmarks/threads.py: one sweep process per thread count, chunked beside plain,
    speed-ups over one thread, goals judged at the default threads only."""
    from benchmarks import threads

    out = tmp_path / "threads.json"
    report = threads.main([
        "--threads", "1", "2", "--default-threads", "2", "--seq-lens", "128", "--dims", "16",
        "--batch", "2", "--repeats", "1", "--gemm-size", "64", "--json", str(out),
    ])  # fmt: skip
    cases = {(r["allocator"], r["backend"], r["pass"], r["threads"]) for r in report["rows"]}
    assert cases == {
        (allocator, backend, mode, n) for n in (1, 2) for allocator in ("default", "resident")
        for backend, mode in [("numpy", "forward"), ("torch", "forward"),
                              ("torch", "forward+backward")]
    }  # fmt: skip
    for r in report["rows"]:
        assert r["ratio"] == pytest.approx(r["chunked_s"] / r["plain_s"])
        if r["threads"] == 1:
            assert r["chunked_speedup"] == r["plain_speedup"] == 1
        else:
            assert r["chunked_speedup"] > 0 and r["plain_speedup"] > 0
        assert (r["gemm_fraction"] is None) == (r["pass"] != "forward")
        assert r["chunked_faults_per_call"] >= 0 and r["plain_faults_per_call"] >= 0
    assert len(report["gemm_flops_per_s"]) == 4
    assert len(report["goals"]) == 6 and all("2 threads" in g["name"] for g in report["goals"])
    assert json.loads(out.read_text())["goals"] == report["goals"]


def test_mamba2_benchmark(tmp_path):
    """benchmarks/mamba2.py: transformers' Mamba2Mixer with polylin's weights gives polylin's
    output before either is timed; one row per threads, length and pass."""
    pytest.importorskip("transformers")
    from benchmarks import mamba2

    out = tmp_path / "mamba2.json"
    report = mamba2.main([
        "--lengths", "40", "--threads", "1", "--hidden", "32", "--head-dim", "8",
        "--state-size", "4", "--chunk", "16", "--repeats", "1", "--json", str(out),
    ])  # fmt: skip
    assert [r["pass"] for r in report["rows"]] == ["forward", "forward+backward"]
    for r in report["rows"]:
        assert r["ratio"] == r["polylin_s"] / r["transformers_s"] and r["max_diff"] < 1e-4
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_mamba2_check_refuses_a_different_layer():
    pytest.importorskip("transformers")
    import torch

    from benchmarks import mamba2

    ours, theirs = mamba2.layers(32, head_dim=8, state_size=4, chunk=16)
    with torch.no_grad():
        theirs.D.add_(1.0)  # a different skip connection: a different function
    with pytest.raises(AssertionError):
        mamba2.check(ours, theirs, torch.randn(1, 20, 32))


def test_array_blocks_benchmark(tmp_path):
    """benchmarks/array_blocks.py: each block on torch, NumPy and JAX is checked against the torch
    module before it is timed; a row per block and implementation, ratios to the module."""
    from benchmarks import array_blocks

    out = tmp_path / "blocks.json"
    report = array_blocks.main([
        "--lengths", "20", "--hidden", "128", "--repeats", "1", "--decode-tokens", "1",
        "--json", str(out),
    ])  # fmt: skip
    impls = {r["impl"] for r in report["rows"]}
    assert {"torch module", "block on torch", "block on NumPy"} <= impls
    for r in report["rows"]:
        assert r["max_diff"] < 1e-4 and r["forward_ratio"] == r["forward_s"] / next(
            m["forward_s"] for m in report["rows"]
            if m["impl"] == "torch module" and m["block"] == r["block"]
        )
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_allocator_environment_sets_the_regime_and_keeps_the_rest():
    """benchmarks/timing.py: ``default`` drops glibc's variables and the ``glibc`` regime's own
    from the environment given, ``glibc`` sets its own, ``resident`` sets glibc's both high;
    everything else is kept and the mapping given is not modified."""
    from benchmarks.timing import ALLOCATOR_VARIABLES, UNRAISED, allocator_environment

    given = {"MALLOC_TRIM_THRESHOLD_": "1", UNRAISED: "1", "PATH": "/bin"}
    assert allocator_environment("default", given) == {"PATH": "/bin"}
    assert allocator_environment("glibc", given) == {"PATH": "/bin", UNRAISED: "1"}
    assert allocator_environment("resident", given) == {
        "PATH": "/bin", "MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31),
    }  # fmt: skip
    assert given == {"MALLOC_TRIM_THRESHOLD_": "1", UNRAISED: "1", "PATH": "/bin"}
    assert set(ALLOCATOR_VARIABLES) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}


@pytest.mark.parametrize("regime, raised", [("default", True), ("glibc", False)])
def test_allocator_regime_of_a_worker(regime, raised):
    """A worker started in the ``glibc`` regime turns polylin's raise of glibc's thresholds off
    before its first call (``apply_allocator_regime``); in ``default`` polylin raises them at
    its first eager call. Run in a fresh interpreter each: the raise happens once a process."""
    from benchmarks.timing import allocator_environment

    script = (
        "import numpy as np, polylin, polylin._backend.allocator as a\n"
        "from benchmarks.timing import apply_allocator_regime\n"
        "apply_allocator_regime()\n"
        "calls = []\n"
        "a._glibc = lambda: calls.append(1) or False\n"
        "x = np.ones((1, 4, 2), dtype=np.float32)\n"
        "polylin.causal_linear_attention(x, x, x)\n"
        "print(len(calls))\n"
    )
    env = allocator_environment(regime, dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == (["1"] if raised else ["0"])


def test_ggml_ops_benchmark_polylin_side(tmp_path, monkeypatch):
    """benchmarks/ggml_ops.py at tiny shapes without ggml: every op's polylin call checked
    against the float64 loop of ggml's semantics, then timed, on both libraries, in a worker
    started in the allocator regime asked for (``--allocator``), its page faults counted."""
    import subprocess

    from benchmarks import ggml_ops

    started, real = [], subprocess.Popen

    def popen(command, *args, **kwargs):
        if "--worker" in command:
            started.append(kwargs["env"])
        return real(command, *args, **kwargs)

    monkeypatch.setattr(ggml_ops.subprocess, "Popen", popen)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    out = tmp_path / "ggml.json"
    report = ggml_ops.main([
        "--quick", "--skip-ggml", "--passes", "1", "--threads", "1", "--repeats", "1",
        "--allocator", "default", "--json", str(out),
    ])  # fmt: skip
    assert [("MALLOC_MMAP_THRESHOLD_" in env, env["OMP_NUM_THREADS"]) for env in started] == [
        (False, "1")
    ]
    assert report["meta"]["allocator"] == {"name": "default"}
    names = [c.name for c in ggml_ops.cases(quick=True)]
    assert [(r["case"], r["backend"]) for r in report["rows"]] == [
        (n, b) for n in names for b in ("numpy", "torch")
    ]
    assert {r["op"] for r in report["rows"]} == set(ggml_ops.OPS)
    assert all(r["error"] <= ggml_ops.TOLERANCE and r["polylin_s"] > 0 for r in report["rows"])
    assert all(r["faults_per_call"] >= 0 for r in report["rows"])
    assert all("ratio" not in r for r in report["rows"]) and report["goals"] == []
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_ggml_ops_fresh_starts_a_worker_for_each_case(monkeypatch):
    """``--fresh``: each case is timed in a worker process of its own (in the ``glibc`` regime
    here: glibc's thresholds as they come), and the report says so."""
    from benchmarks import ggml_ops
    from benchmarks.timing import UNRAISED

    started, real = [], subprocess.Popen

    def popen(command, *args, **kwargs):
        if "--worker" in command:
            started.append(kwargs["env"].get(UNRAISED))
        return real(command, *args, **kwargs)

    monkeypatch.setattr(ggml_ops.subprocess, "Popen", popen)
    report = ggml_ops.main([
        "--quick", "--skip-ggml", "--passes", "1", "--threads", "1", "--repeats", "1",
        "--only", "SSM_CONV", "--allocator", "glibc", "--fresh",
    ])  # fmt: skip
    cases = [c.name for c in ggml_ops.cases(quick=True) if c.op == "SSM_CONV"]
    assert len(cases) > 1 and started == ["1"] * len(cases)
    assert [r["case"] for r in report["rows"] if r["backend"] == "torch"] == cases
    assert report["meta"]["fresh"] is True
    assert report["meta"]["allocator"] == {"name": "glibc", UNRAISED: "1"}


def test_ggml_ops_filter_picks_each_case_alone():
    """Each case's ``test-backend-ops -p`` filter (run one case at a time, paired with polylin's
    time) matches its own parameter list in any order, and no other case's: a value must be a
    whole entry (``head_count=32`` is not ``head_count=320``)."""
    import re

    from benchmarks import ggml_ops

    chosen = ggml_ops.cases()
    listed = {c.name: ["type=f32", *(f"{n}={v}" for n, v in c.ggml)] for c in chosen}
    for case in chosen:
        pattern = case.params_filter()
        assert re.search(pattern, ",".join(listed[case.name]))
        assert re.search(pattern, ",".join(reversed(listed[case.name])))
        for other in chosen:
            if other.op == case.op and other.name != case.name:
                assert not re.search(pattern, ",".join(listed[other.name])), other.name
        longer = [entry + "0" if entry.startswith(case.ggml[0][0] + "=") else entry
                  for entry in listed[case.name]]  # fmt: skip
        assert not re.search(pattern, ",".join(longer))


def test_ggml_ops_token_loop_where_it_was_faster(monkeypatch):
    """The prefill's method in the comparison: the compiled loop for states of at most 64 x 64,
    and for the delta rules at any size; the chunked form otherwise (Mamba-2's scan at a
    state of 128), and everywhere without the kernels."""
    from benchmarks import ggml_ops

    numpy, torch = ggml_ops.Backend.NUMPY, ggml_ops.Backend.TORCH
    chosen = {c.name: c for c in ggml_ops.cases() if c.phase == "prefill"}
    monkeypatch.setattr(ggml_ops, "compiled_available", lambda: True)
    for backend in (numpy, torch):
        loop = {name for name, c in chosen.items() if ggml_ops.token_loop(c, backend)}
        assert loop == {name for name in chosen if not name.startswith(("SSM", "conv"))}
    monkeypatch.setattr(ggml_ops, "compiled_available", lambda: False)
    assert not any(ggml_ops.token_loop(c, b) for c in chosen.values() for b in (numpy, torch))


def test_ggml_ops_floors(monkeypatch):
    """``--floors``: PyTorch's rows get a floor below their own time (prefill: the share of the
    call's matrix products; decoding: the bare state passes, checked against the float64 loop;
    the convolution's prefill has none, nor a prefill run by the compiled token loop), and the
    table shows it."""
    from benchmarks import ggml_ops

    wanted = [("gdn", "decode"), ("gla", "prefill"), ("conv", "prefill")]
    chosen = [c for c in ggml_ops.cases(quick=True) if (c.family, c.phase) in wanted]
    if ggml_ops.token_loop(chosen[1], ggml_ops.Backend.TORCH):  # GLA's small prefill: the loop
        rows = ggml_ops.time_polylin(chosen[1:2], ["torch"], 1, 0.05, floors=True)
        assert "floor_s" not in rows[0] and "products_share" not in rows[0]
    monkeypatch.setattr(ggml_ops, "token_loop", lambda case, backend: False)  # chunked forms
    rows = ggml_ops.time_polylin(chosen, ["torch"], 1, 0.05, floors=True)
    gdn, gla, conv = (next(r for r in rows if r["case"] == c.name) for c in chosen)
    assert 0 < gla["products_share"] <= gla["operations_share"] <= 1.5
    assert gla["floor_s"] == pytest.approx(gla["products_share"] * gla["seconds"])
    assert 0 < gdn["floor_s"] and "products_share" not in gdn and "floor_s" not in conv
    # GLA 2 x 16 at T = 24: the loop's decay, update and read, 5 flops per state element
    assert gla["recurrence_flops"] == 5 * 16 * 16 * 2 * 24 and gla["products_flops"] > 0
    combined, _ = ggml_ops.combine(chosen, [{"threads": 1, "ggml": [], "polylin": rows}], ["torch"])
    text = ggml_ops.table(combined)
    assert "torch's floor |" in text and f"{gdn['floor_s'] * 1e3:.3f} ms |" in text
    share = gla["products_flops"] / gla["recurrence_flops"]
    assert f"{gla['floor_s'] * 1e3:.3f} ms ({share:.2f}x the loop's flops) |" in text


def test_ggml_ops_times_a_case_after_the_pools_settle(monkeypatch):
    """A case is timed ``settle_s`` after its check (the threads of the products before it stop
    spinning)."""
    from benchmarks import ggml_ops

    slept, timed = [], []
    real = ggml_ops.second_of_calls

    def second_of_calls(fn, repeats, budget_s):
        timed.append(list(slept))
        return real(fn, repeats, budget_s)

    monkeypatch.setattr(ggml_ops.time, "sleep", slept.append)
    monkeypatch.setattr(ggml_ops, "second_of_calls", second_of_calls)
    case = next(c for c in ggml_ops.cases(quick=True) if c.family == "gla")
    ggml_ops.time_polylin([case], ["numpy"], 1, 0.01, settle_s=ggml_ops.SETTLE_S)
    assert timed == [[ggml_ops.SETTLE_S]] and ggml_ops.SETTLE_S >= 0.2  # OpenBLAS's 2^28 cycles
    ggml_ops.time_polylin([case], ["numpy"], 1, 0.01)
    assert timed[1:] == [[ggml_ops.SETTLE_S, 0.0]]


def test_ggml_ops_worker_settles_on_more_than_one_thread(monkeypatch, capsys):
    """The worker waits :data:`SETTLE_S` before each timing on two threads, not on one."""
    import argparse
    import io

    import torch

    from benchmarks import ggml_ops

    seen = []

    def time_polylin(chosen, backends, repeats, budget_s, floors, settle_s=0.0):
        seen.append(settle_s)
        return []

    monkeypatch.setattr(ggml_ops, "pin", lambda threads: None)
    monkeypatch.setattr(ggml_ops, "apply_allocator_regime", lambda: None)
    monkeypatch.setattr(ggml_ops, "time_polylin", time_polylin)
    name = ggml_ops.cases(quick=True)[0].name
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            monkeypatch.setattr(ggml_ops.sys, "stdin", io.StringIO(name + "\n"))
            ggml_ops._worker(argparse.Namespace(
                threads=[threads], quick=True, backends=["numpy"], repeats=1, budget=0.01,
                floors=False))  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert seen == [0.0, ggml_ops.SETTLE_S]


def test_ggml_report_judges_the_second_thread_from_t_512():
    """Prefill from T = 512 with both thread counts gets a goal of two threads over one per
    backend: the two-thread time over the one-thread time, at most 1 / 1.6, ggml's own gain
    in its name; shorter prefill and decoding get none."""
    from benchmarks import ggml_ops, ggml_report

    cases = {c.name: c for c in ggml_ops.cases()}
    chosen = [cases["GLA 32x64 T=512"], cases["GDN 32x128 T=64"], cases["GLA 32x64 T=1"]]
    seconds = {(1, "torch"): 10.0, (2, "torch"): 6.0, (1, "numpy"): 9.0, (2, "numpy"): 8.0}

    def one_pass(threads):
        ggml = [{"op": c.op, "params": dict(c.ggml), "seconds": 4.0 / threads} for c in chosen]
        polylin = [{"case": c.name, "backend": b, "error": 0.0, "seconds": seconds[threads, b]}
                   for c in chosen for b in ("torch", "numpy")]  # fmt: skip
        return {"threads": threads, "ggml": ggml, "polylin": polylin}

    rows, goals = ggml_report.combine(chosen, [one_pass(1), one_pass(2)], ["torch", "numpy"])
    second = [g for g in goals if "two threads" in g["name"]]
    assert [g["name"] for g in second] == [
        "GLA 32x64 T=512, torch: two threads' time / one's, 1.67x (ggml 2.00x)",
        "GLA 32x64 T=512, numpy: two threads' time / one's, 1.12x (ggml 2.00x)",
    ]
    assert [g["value"] for g in second] == [pytest.approx(0.6), pytest.approx(8 / 9)]
    assert [g["met"] for g in second] == [True, False] and second[0]["limit"] == 1 / 1.6
    assert len(goals) == len(second) + len(rows) == 2 + 3 * 2 * 2  # and one per row's ratio
    _, alone = ggml_report.combine(chosen, [one_pass(1)], ["torch"])  # one thread count: none
    assert not any("two threads" in g["name"] for g in alone)


def test_ggml_floor_products_count_in_place_products():
    """A product added in place (``baddbmm_``, as the delta rules' loops write) is a product
    of the prefill floor; an elementwise operation is not."""
    import torch

    from benchmarks import ggml_floors

    a, b, c = torch.randn(64, 128, 128), torch.randn(64, 128, 128), torch.zeros(64, 128, 128)
    products, operations = ggml_floors.profile_shares(lambda: c.baddbmm_(a, b), calls=2)
    assert products > 0.5 * operations > 0
    products, operations = ggml_floors.profile_shares(lambda: c.mul_(0.5), calls=2)
    assert products == 0 < operations


def test_ggml_floor_counts_each_products_arithmetic_once():
    """Two flops per multiply-add of every product (batched, added in place, matrix-vector:
    whose kernel is itself a product, counted once), ``n^2`` per column of a triangular solve;
    elementwise work counts nothing."""
    import torch

    from benchmarks import ggml_floors

    a, b, c = torch.randn(4, 5, 6), torch.randn(4, 6, 7), torch.zeros(4, 5, 7)
    m, v = torch.randn(5, 6), torch.randn(6)
    L = torch.eye(16) + torch.randn(3, 16, 16).tril(-1)
    cases = [
        (lambda: a @ b, 2 * 4 * 5 * 6 * 7), (lambda: c.baddbmm_(a, b), 2 * 4 * 5 * 6 * 7),
        (lambda: m @ v, 2 * 5 * 6), (lambda: v @ v, 2 * 6), (lambda: a * 2.0, 0),
        (lambda: torch.linalg.solve_triangular(L, b.new_ones(3, 16, 8), upper=False),
         3 * 16 * 8 * 16),
    ]  # fmt: skip
    assert [ggml_floors.product_flops(fn) for fn, _ in cases] == [want for _, want in cases]
    sizes = {"H": 3, "d": 4, "N": 5, "T": 7, "C": 6}
    assert ggml_floors.recurrence_flops("gdn", sizes) == 7 * 16 * 3 * 7
    assert ggml_floors.recurrence_flops("ssm", sizes) == 5 * 20 * 3 * 7
    assert ggml_floors.recurrence_flops("wkv7", sizes) == 9 * 16 * 3 * 7
    assert ggml_floors.recurrence_flops("conv", sizes) == 2 * 4 * 6 * 7


@pytest.mark.parametrize("family", ["gdn", "kda", "ssm", "wkv7", "gla", "conv"])
def test_ggml_floor_state_passes_are_the_step(family):
    """The bare state passes compute ggml's token (the float64 loop), and leave the inputs."""
    import numpy as np
    import torch

    from benchmarks import ggml_floors, ggml_ops

    case = next(c for c in ggml_ops.cases() if c.family == family and c.phase == "decode")
    inputs = ggml_ops.make_inputs(case)
    x = {n: torch.from_numpy(a).float() for n, a in inputs.items()}
    before = {n: a.clone() for n, a in x.items()}
    got = ggml_floors.state_passes(family, x)().double().numpy()
    want = ggml_ops.reference(case, inputs)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= 1e-6 * max(1.0, np.max(np.abs(want)))  # float32
    assert all(torch.equal(x[n], before[n]) for n in x)


@pytest.mark.parametrize("compiler", ["torch.compile", "jax.jit"])
@pytest.mark.parametrize("family", ["gla", "gdn"])
def test_ggml_ops_compiled_row(compiler, family):
    """``torch.compile`` and ``jax.jit``: polylin's call compiled whole, checked, timed, its
    compile time kept."""
    from benchmarks import ggml_ops

    if (reason := ggml_ops.BACKENDS[compiler].unavailable_reason()) is not None:
        pytest.skip(reason)
    case = next(c for c in ggml_ops.cases(quick=True) if c.family == family)
    (row,) = ggml_ops.time_polylin([case], [compiler], 1, 0.05)
    assert row["backend"] == compiler and row["error"] <= ggml_ops.TOLERANCE
    assert row["compile_s"] > row["seconds"] > 0


def test_ggml_ops_refuses_a_missing_backend(monkeypatch, capsys):
    """A backend that cannot run here is refused by name before anything is built or timed."""
    from benchmarks import ggml_ops

    monkeypatch.setattr(ggml_ops.Backend, "unavailable_reason", lambda self: "not installed")
    with pytest.raises(SystemExit):
        ggml_ops.main(["--quick", "--skip-ggml", "--backends", "jax.jit"])
    assert "--backends jax.jit: not installed" in capsys.readouterr().err


@pytest.mark.parametrize(("threads", "want"), [(1, [[3]]), (2, [[3, 5]]), (3, [])])
def test_ggml_ops_pins_each_side_to_the_same_cores(monkeypatch, threads, want):
    """ggml's process and polylin's worker of one thread count run on the first cores allowed
    (none pinned where it would use them all)."""
    from benchmarks import ggml_ops

    calls = []
    monkeypatch.setattr(ggml_ops.os, "sched_getaffinity", lambda pid: {7, 5, 3}, raising=False)
    monkeypatch.setattr(ggml_ops.os, "sched_setaffinity", lambda pid, cores: calls.append(cores),
                        raising=False)  # fmt: skip
    ggml_ops.pin(threads)
    assert calls == want


def test_ggml_ops_check_refuses_a_wrong_output(monkeypatch):
    from benchmarks import ggml_ops

    case = next(c for c in ggml_ops.cases(quick=True) if c.family == "wkv7")
    reference = ggml_ops.reference
    monkeypatch.setattr(ggml_ops, "reference", lambda c, x: reference(c, x) * 1.01)
    with pytest.raises(AssertionError, match="WKV7 2x16 T=24 on numpy"):
        ggml_ops.time_polylin([case], ["numpy"], 1, 0.1)


def test_ggml_ops_parses_perf_lines_and_skips_without_a_compiler(monkeypatch, tmp_path, capsys):
    from benchmarks import ggml_ops

    text = ("  \x1b[1mGATED_DELTA_NET(type=f32,head_count=16,head_size=64,n_seq_tokens=512,"
            "n_seqs=1,v_repeat=1,permuted=0,kda=0,K=1)\x1b[0m:   12 runs -  8123.50 us/run - "
            "  100 kB/run\n  SSM_CONV(type=f32,ne_a=[515,3328,1,1],ne_b=[4,3328,1,1]):  "
            "626 runs - 7337.51 us/run\n  Backend CPU: OK\n")  # fmt: skip
    rows = ggml_ops.parse_perf(text)
    assert [(r["op"], r["runs"]) for r in rows] == [("GATED_DELTA_NET", 12), ("SSM_CONV", 626)]
    assert rows[0]["seconds"] == pytest.approx(8.1235e-3)
    cases = {c.name: c for c in ggml_ops.cases()}
    assert cases["GDN 16x64 T=512"].matches(rows[0])
    assert not cases["KDA 16x128 T=512"].matches(rows[0])
    assert cases["conv 3328 T=512"].matches(rows[1]) and not cases["conv 3328 T=1"].matches(rows[1])
    monkeypatch.setattr(ggml_ops.shutil, "which", lambda name: None)
    assert ggml_ops.build_ggml(tmp_path / "cache") is None
    assert "not found: the ggml side is skipped" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, chunks",
    [(["--backend", "numpy"], (32, 64)), (["--backward"], (32, 64)),
     (["--chunks", "32", "16"], (16, 32))],
)
def test_delta_chunks_benchmark(tmp_path, options, chunks):
    """The shorter chunk against the longer, each checked against the other, the cap restored
    afterwards."""
    import polylin._forms.delta.chunked as chunked
    from benchmarks import delta_chunks

    cap = chunked.ONE_THREAD_CHUNK
    out = tmp_path / "chunks.json"
    report = delta_chunks.main(["--quick", "--repeats", "2", "--json", str(out), *options])
    assert [(r["T"], r["gate"]) for r in report["rows"]] == [(96, "scalar"), (96, "channel")]
    for row in report["rows"]:
        assert (row["short"], row["long"]) == chunks
        assert row["error"] < 1e-4 and row["short_s"] > 0 and row["long_s"] > 0
        assert row["ratio"] == pytest.approx(row["short_s"] / row["long_s"])
    assert chunked.ONE_THREAD_CHUNK == cap
    assert json.loads(out.read_text())["rows"] == report["rows"]


@pytest.mark.parametrize("backward", [False, True])
def test_short_conv_benchmark(tmp_path, backward):
    """PyTorch's convolution against the taps as products, each checked against the other, in
    both dtypes; the threshold restored afterwards, and ``chosen`` as ``causal_conv1d``
    chooses."""
    pytest.importorskip("torch")
    import polylin._backend.depthwise as depthwise
    from benchmarks import short_conv

    least = depthwise.NATIVE_MIN_VALUES, depthwise.GRADIENT_MIN_VALUES
    out = tmp_path / "conv.json"
    options = ["--quick", "--repeats", "2", "--json", str(out)] + (["--backward"] * backward)
    report = short_conv.main(options)
    shapes = [(r["T"], r["channels"], r["width"], r["dtype"]) for r in report["rows"]]
    assert shapes == [(8, 16, 4, "float32"), (40, 512, 3, "float32"), (8, 16, 4, "float64"),
                      (40, 512, 3, "float64")]  # fmt: skip
    for row in report["rows"]:
        assert row["error"] < 1e-5 and row["kernel_s"] > 0 and row["taps_s"] > 0
        assert row["ratio"] == pytest.approx(row["kernel_s"] / row["taps_s"])
        assert row["backward"] is backward
    assert [r["chosen"] for r in report["rows"]] == [False, not backward, False, False]
    assert (depthwise.NATIVE_MIN_VALUES, depthwise.GRADIENT_MIN_VALUES) == least
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_delta_chunks_runs_each_chunk_as_asked():
    """Inside the benchmark's context one thread runs 64 when asked (the cap lifted)."""
    import polylin._forms.delta.chunked as chunked
    from benchmarks import delta_chunks

    execution = {"accelerator": False, "in_loop": True}
    assert chunked.chunk_length(64, 4096, 64, **execution) == 32
    with delta_chunks.chunks_as_asked():
        assert chunked.chunk_length(64, 4096, 64, **execution) == 64
    assert chunked.chunk_length(64, 4096, 64, **execution) == 32
