"""The code path of the libraries' matrix products on an AMD processor with AVX-512.

PyTorch's CPU wheels link Intel's MKL, which on a processor that is not Intel's runs kernels of
256-bit registers at most (MKL 2024.2 on AMD Zen 5: ``mkl_blas_def_sgemm_kernel_0_zen``), and
NumPy's OpenBLAS (0.3.31) takes its Haswell kernels (256-bit) on the same processor, while its
AVX-512 units run ggml's loops. Two settings of a process's environment, read when the
libraries load, give both their 512-bit kernels:

- MKL: a small library preloaded (``LD_PRELOAD``) whose ``mkl_serv_intel_cpu_true`` returns 1
  (``mkl_intel_path.c`` beside this module) answers the check by which MKL decides that it
  runs on an Intel processor; MKL then chooses its kernels by the processor's features, as on
  Intel's;
- OpenBLAS: ``OPENBLAS_CORETYPE=SkylakeX``, OpenBLAS's own variable.

:data:`PATHS` names the regimes a benchmark's worker processes can start in (``None``: as the
shell has it): ``avx512`` both settings, which needs a processor with AVX-512 (elsewhere a
512-bit kernel stops the process on an illegal instruction); ``intel`` MKL's path for Intel's
processors alone (OpenBLAS's own choice), for any x86 processor: on an AMD Zen 3 (AVX2, no
AVX-512) it gives MKL's AVX2 kernels in place of its AMD path's. Both need a C compiler (``cc``)
to build the library, once, into a cache folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "LIBRARY", "OPENBLAS_CORETYPE", "PATHS", "SOURCE", "build_library", "environment",
    "has_avx512", "prepare", "regime",
]

#: ``default``: each library's own choice; ``avx512``: MKL's path for Intel's processors and
#: OpenBLAS's SkylakeX kernels; ``intel``: MKL's path for Intel's processors alone.
PATHS = ("default", "avx512", "intel")

#: The C source of the preloaded library.
SOURCE = Path(__file__).resolve().with_name("mkl_intel_path.c")

#: The preloaded library's file name.
LIBRARY = "libmkl_intel_path.so"

#: OpenBLAS's kernels on the ``avx512`` path.
OPENBLAS_CORETYPE = "SkylakeX"


def has_avx512(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the processor has AVX-512 (its ``avx512f`` flag; ``False`` where
    ``cpuinfo`` cannot be read, as on a system other than Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(
        "avx512f" in line.split(":", 1)[1].split()
        for line in text.splitlines()
        if line.startswith("flags") and ":" in line
    )


def build_library(cache: Path) -> Path:
    """The preloaded library, built from :data:`SOURCE` into ``cache`` (reused when it is
    there and newer than the source). Raises ``RuntimeError`` without a C compiler or where
    the build fails."""
    library = cache / LIBRARY
    if library.exists() and library.stat().st_mtime >= SOURCE.stat().st_mtime:
        return library
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) to build the MKL library")
    cache.mkdir(parents=True, exist_ok=True)
    command = [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return library


def prepare(path: str | None, cache: Path) -> Path | None:
    """The library the regime ``path`` preloads (built into ``cache``), ``None`` for
    ``default`` and ``None``. Raises ``RuntimeError`` where this processor or system cannot run
    it."""
    if path not in ("avx512", "intel"):
        return None
    if path == "avx512" and not has_avx512():
        raise RuntimeError("this processor has no AVX-512")
    return build_library(cache)


def environment(
    path: str | None, env: dict[str, str], library: Path | None = None
) -> dict[str, str]:
    """A copy of ``env`` for the regime ``path`` of :data:`PATHS` (``None``: as it is):
    OpenBLAS's core type and this library (by its file name) dropped from it, then for
    ``avx512`` and ``intel`` ``library`` (:func:`build_library`) preloaded first, for
    ``avx512`` OpenBLAS's core type set. Other preloaded libraries (another allocator) are
    kept."""
    if path is None:
        return dict(env)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    dropped = ("LD_PRELOAD", "OPENBLAS_CORETYPE")
    out = {name: value for name, value in env.items() if name not in dropped}
    preload = [p for p in env.get("LD_PRELOAD", "").split() if Path(p).name != LIBRARY]
    if path in ("avx512", "intel"):
        if library is None:
            raise ValueError(f"the {path} path needs the library (build_library)")
        preload.insert(0, str(library))
    if path == "avx512":
        out["OPENBLAS_CORETYPE"] = OPENBLAS_CORETYPE
    if preload:
        out["LD_PRELOAD"] = " ".join(preload)
    return out


def regime(path: str | None, library: Path | None = None) -> dict[str, str]:
    """For a report: the regime's name (``inherited`` for ``None``) and the variables that
    choose the libraries' kernels in its environment (this process's, with ``library`` for
    ``avx512`` and ``intel``)."""
    env = environment(path, dict(os.environ), library)
    named = ("LD_PRELOAD", "OPENBLAS_CORETYPE", "MKL_ENABLE_INSTRUCTIONS")
    return {"name": path or "inherited", **{n: env[n] for n in named if n in env}}
