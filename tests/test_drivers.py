"""The backend drivers (polylin.testing) and ``python -m polylin``: no global side effects, no
NumPy needed to import them, the ``bench`` command delegates to a clone or says why it cannot."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import polylin.__main__ as cli
import polylin.testing as testing
from polylin.testing import STRICT_FLAGS, Backend

ROOT = Path(__file__).resolve().parent.parent


def _probe_every_driver() -> None:
    testing._unavailable_reason.cache_clear()  # ask afresh, as a new process would
    for b in Backend:
        if b.unavailable_reason() is None:
            b.module()
            b.namespace()
            b.float_dtypes()
            b.to_numpy(b.from_numpy([1.0, 2.0], "float32"))


@pytest.mark.only_backend(Backend.JAX)
def test_probing_leaves_jax_x64_alone(backend):
    import jax

    before = jax.config.read("jax_enable_x64")
    try:
        for x64 in (False, True):
            jax.config.update("jax_enable_x64", x64)
            _probe_every_driver()
            assert jax.config.read("jax_enable_x64") is x64
            assert ("float64" in backend.float_dtypes()) is x64
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.mark.only_backend(Backend.JAX)
def test_float64_without_x64_is_refused_not_narrowed(backend):
    import jax

    with jax.enable_x64(False), pytest.raises(ValueError, match="jax_enable_x64"):
        backend.from_numpy([1.0], "float64")


@pytest.mark.only_backend(Backend.ARRAY_API_STRICT)
def test_probing_leaves_array_api_strict_flags_alone(backend):
    strict = backend.module()
    chosen = {"api_version": "2023.12", "boolean_indexing": True, "data_dependent_shapes": True}
    try:
        strict.set_array_api_strict_flags(**chosen)
        _probe_every_driver()
        flags = strict.get_array_api_strict_flags()
        assert {k: flags[k] for k in chosen} == chosen
    finally:
        strict.set_array_api_strict_flags(**STRICT_FLAGS)


@pytest.mark.only_backend(Backend.NUMPY)
def test_drivers_and_cli_import_without_numpy(backend):
    """With NumPy hidden, polylin, its drivers and the CLI import; the NumPy driver says why it
    cannot run, and ``backends`` lists every driver."""
    code = textwrap.dedent("""
        import sys
        sys.modules["numpy"] = None  # import numpy now raises ImportError
        import polylin, polylin.testing
        from polylin.testing import Backend
        reason = Backend.NUMPY.unavailable_reason()
        assert reason is not None and "numpy" in reason, reason
        from polylin.__main__ import main
        assert main(["backends"]) == 0
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "POLYLIN_BACKENDS": "numpy", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert {line.split()[0] for line in out.stdout.splitlines()} == {b.value for b in Backend}


def test_bench_delegates_to_the_clone(monkeypatch, capsys):
    """``bench`` runs the clone's benchmarks/run.py in a process of its own (the library never
    imports the benchmarks), with the arguments that follow it and its exit code."""
    calls = []

    def run(argv, cwd):
        calls.append((argv, cwd))
        return subprocess.CompletedProcess(argv, 3)

    monkeypatch.setattr(cli.subprocess, "run", run)
    assert cli.main(["bench", "--quick", "--out", "x"]) == 3
    assert cli.main(["bench", "gpu", "--device", "cpu"]) == 3
    script = str(cli.BENCHMARKS)
    assert calls == [
        ([sys.executable, script, "cpu", "--quick", "--out", "x"], cli.BENCHMARKS.parent.parent),
        ([sys.executable, script, "gpu", "--device", "cpu"], cli.BENCHMARKS.parent.parent),
    ]


def test_bench_from_an_installed_wheel_says_where_the_benchmarks_are(monkeypatch, capsys):
    monkeypatch.setattr(cli, "BENCHMARKS", Path("/site-packages/benchmarks/run.py"))
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "not installed with the package" in err and "python benchmarks/run.py" in err


def test_selected_backends_names_and_errors():
    assert testing.selected_backends(names="numpy, torch") == [Backend.NUMPY, Backend.TORCH]
    with pytest.raises(ValueError, match="unknown backend"):
        testing.selected_backends(names="numpy,tensorflow")
    assert testing.selected_backends(names="") == list(Backend)


@pytest.mark.only_backend(Backend.NUMPY)
def test_demo_prints_one_row_per_dtype_and_method(backend, capsys):
    assert cli.main(["demo", "--seq-len", "9", "--repeats", "1", "--backends", "numpy"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r and r[0] == "numpy"]
    assert [(r[2], r[3]) for r in rows] == [
        (d, m) for d in ("float64", "float32") for m in ("chunked", "recurrent", "quadratic")
    ]
    assert all(float(r[4]) < {"float64": 1e-12, "float32": 1e-5}[r[2]] for r in rows)


@pytest.mark.only_backend(Backend.NUMPY)
def test_demo_runs_the_per_token_method_on_a_prefix(backend, capsys):
    """The recurrent loop runs the first --recurrent-len tokens, its error taken against the
    same rows of the reference; the other methods run the whole sequence."""
    argv = ["demo", "--seq-len", "40", "--recurrent-len", "5", "--repeats", "1"]
    assert cli.main([*argv, "--backends", "numpy"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in rows if r and r[0] == "numpy"]
    assert {(r[3], int(r[-1])) for r in rows} == {("chunked", 40), ("recurrent", 5),
                                                  ("quadratic", 40)}  # fmt: skip
    assert all(float(r[4]) < {"float64": 1e-12, "float32": 1e-5}[r[2]] for r in rows)


@pytest.mark.parametrize(
    "argv", [["--seq-len", "0"], ["--dim", "0"], ["--batch", "-1"], ["--repeats", "0"],
             ["--dim", "x"], ["--recurrent-len", "0"]],
)  # fmt: skip
def test_demo_sizes_must_be_positive_ints(argv, capsys):
    """A size below 1 is a usage error naming the option (exit status 2), not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *argv, "--backends", "numpy"])
    assert exit_info.value.code == 2
    assert f"argument {argv[0]}: expected a positive int, got" in capsys.readouterr().err
