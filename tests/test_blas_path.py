"""benchmarks/blas_path.py: the products' 512-bit kernels on an AMD processor, and
benchmarks/ggml_ops.py's ``--blas``."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from benchmarks import blas_path

COMPILER = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n", True),
        ("flags\t\t: fpu avx2 avx512bw avx512_vnni\n", False),  # no avx512f
        ("model name\t: avx512f\nflags\t\t: fpu avx2\n", False),  # flags only
        (None, False),  # no such file
    ],
)
def test_has_avx512_reads_the_processors_flags(tmp_path, text, want):
    cpuinfo = tmp_path / "cpuinfo"
    if text is not None:
        cpuinfo.write_text(text)
    assert blas_path.has_avx512(cpuinfo) is want


def test_environment_sets_each_path_and_keeps_the_rest(tmp_path):
    """``avx512`` preloads the library first and sets OpenBLAS's core type; ``intel`` preloads
    it and leaves OpenBLAS its choice; ``default`` drops both (the library by its file name);
    another preloaded library and everything else stay; ``None`` keeps the environment as it
    is; the mapping given is not modified."""
    library = tmp_path / blas_path.LIBRARY
    given = {"PATH": "/bin", "LD_PRELOAD": "/lib/libtcmalloc.so", "OPENBLAS_CORETYPE": "Zen"}
    before = dict(given)
    assert blas_path.environment("avx512", given, library) == {
        "PATH": "/bin", "LD_PRELOAD": f"{library} /lib/libtcmalloc.so",
        "OPENBLAS_CORETYPE": "SkylakeX",
    }  # fmt: skip
    assert blas_path.environment("intel", given, library) == {
        "PATH": "/bin", "LD_PRELOAD": f"{library} /lib/libtcmalloc.so"
    }
    assert blas_path.environment("default", given) == {
        "PATH": "/bin", "LD_PRELOAD": "/lib/libtcmalloc.so"
    }
    ours = {"PATH": "/bin", "LD_PRELOAD": f"/elsewhere/{blas_path.LIBRARY}"}
    assert blas_path.environment("default", ours) == {"PATH": "/bin"}
    assert blas_path.environment("avx512", ours, library)["LD_PRELOAD"] == str(library)
    assert blas_path.environment(None, given) == given  # the shell's, as it is
    assert given == before
    with pytest.raises(ValueError, match="path must be one of"):
        blas_path.environment("fast", given)
    for path in ("avx512", "intel"):
        with pytest.raises(ValueError, match=f"the {path} path needs the library"):
            blas_path.environment(path, given)


@needs_compiler
def test_build_library_makes_mkls_check_say_intel(tmp_path):
    """The built library answers MKL's check with 1, and is reused once built."""
    library = blas_path.build_library(tmp_path)
    assert library == tmp_path / blas_path.LIBRARY
    assert ctypes.CDLL(str(library)).mkl_serv_intel_cpu_true() == 1
    built = library.stat().st_mtime_ns
    assert blas_path.build_library(tmp_path) == library
    assert library.stat().st_mtime_ns == built


def test_build_library_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(blas_path.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        blas_path.build_library(tmp_path)
    assert not (tmp_path / blas_path.LIBRARY).exists()


def test_prepare_builds_only_for_avx512_and_only_where_the_processor_has_it(
    tmp_path, monkeypatch
):
    assert blas_path.prepare("default", tmp_path) is None
    assert blas_path.prepare(None, tmp_path) is None
    monkeypatch.setattr(blas_path, "has_avx512", lambda: False)
    with pytest.raises(RuntimeError, match="no AVX-512"):
        blas_path.prepare("avx512", tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_compiler
def test_prepare_builds_for_intel_without_avx512(tmp_path, monkeypatch):
    """MKL's Intel path alone runs on any x86 processor: no AVX-512 asked."""
    monkeypatch.setattr(blas_path, "has_avx512", lambda: False)
    assert blas_path.prepare("intel", tmp_path) == tmp_path / blas_path.LIBRARY


def test_ggml_ops_refuses_avx512_without_it(monkeypatch, capsys):
    pytest.importorskip("torch")
    from benchmarks import ggml_ops

    monkeypatch.setattr(blas_path, "has_avx512", lambda: False)
    with pytest.raises(SystemExit):
        ggml_ops.main(["--quick", "--skip-ggml", "--blas", "avx512"])
    assert "--blas avx512: this processor has no AVX-512" in capsys.readouterr().err


@needs_compiler
@pytest.mark.parametrize("path", ["avx512", "intel"])
def test_ggml_ops_workers_start_on_the_path(tmp_path, monkeypatch, path):
    """``--blas avx512``: the worker's environment preloads the library and sets OpenBLAS's
    core type (``intel``: the library alone), the report's meta names them, and polylin's calls
    pass ggml's check. (On a processor without AVX-512 the ``avx512`` worker itself runs on
    the default path.)"""
    pytest.importorskip("torch")
    from benchmarks import ggml_ops

    runs_here = path == "intel" or blas_path.has_avx512()
    started, real = [], subprocess.Popen

    def popen(command, *args, **kwargs):  # subprocess's own: the library's build too
        if "--worker" not in command:
            return real(command, *args, **kwargs)
        started.append(kwargs["env"])
        if not runs_here:
            kwargs["env"] = blas_path.environment("default", kwargs["env"])
        return real(command, *args, **kwargs)

    monkeypatch.setattr(blas_path, "has_avx512", lambda: True)
    monkeypatch.setattr(ggml_ops.subprocess, "Popen", popen)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    report = ggml_ops.main([
        "--quick", "--skip-ggml", "--passes", "1", "--threads", "1", "--repeats", "1",
        "--backends", "torch", "numpy", "--only", "SSM_SCAN", "--blas", path,
        "--cache", str(tmp_path),
    ])  # fmt: skip
    library = str(tmp_path / blas_path.LIBRARY)
    coretype = {"avx512": {"OPENBLAS_CORETYPE": "SkylakeX"}, "intel": {}}[path]
    assert [(env["LD_PRELOAD"], env.get("OPENBLAS_CORETYPE")) for env in started] == [
        (library, coretype.get("OPENBLAS_CORETYPE"))
    ]
    assert report["meta"]["blas"] == {"name": path, "LD_PRELOAD": library, **coretype}
    assert report["rows"] and all(r["error"] <= ggml_ops.TOLERANCE for r in report["rows"])
