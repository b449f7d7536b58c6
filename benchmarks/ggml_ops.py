"""polylin against llama.cpp's ggml CPU kernels, on the same shapes: prefill and decode.

    python benchmarks/ggml_ops.py [--threads 1 2] [--repeats 7] [--json PATH] [--cache DIR]
                                  [--allocator default|glibc|resident] [--blas default|avx512|intel]
                                  [--skip-ggml] [--build-only] [--quick]

Builds ggml's ``test-backend-ops`` from the llama.cpp vendored in the pinned llama-cpp-python
sdist (downloaded with pip, built with cmake, CPU only, ``-DGGML_NATIVE=ON``) into a cache
folder outside the checkout (``~/.cache/polylin-ggml``, or ``--cache``), with three changes to
the test program, none to the kernels: the thread count comes from ``GGML_PERF_THREADS``, perf
cases for the shapes below that its list lacks are added, and a timed graph holds fewer copies
of the op (``GGML_PERF_CPU_MIB``). It then runs ``test-backend-ops perf -b CPU -o <OP>`` for
``GATED_DELTA_NET`` (scalar gate and KDA), ``SSM_SCAN``, ``RWKV_WKV7``, ``GATED_LINEAR_ATTN``
and ``SSM_CONV``, one case at a time (``-o <OP> -p <its parameters>``), and right after
each times polylin on the same shape (float32, one sequence) on PyTorch and NumPy (and, with
``--backends``, compiled by ``torch.compile`` or ``jax.jit``) with the same thread count (a
worker process pinned to that many cores, one per pass and thread count): each polylin call
first checked against a float64 loop of ggml's own semantics (read from
``ggml/src/ggml-cpu/ops.cpp``), then timed (the mean over at least a second, as ggml's
``us/run``; the median is recorded too). The two sides of a ratio are seconds apart, so a
machine whose speed drifts from one minute to the next weighs on both alike; the report gives
polylin's time over ggml's in each pass, per op, shape and thread count.

``--allocator`` starts polylin's workers in a regime of glibc's (``benchmarks/timing.py``,
``ALLOCATORS``; else this shell's); each row records their page faults per timed call.
``--blas avx512`` gives them the products' 512-bit kernels on AMD, ``--blas intel`` MKL's
kernels for Intel's processors on any (``blas_path.py``).

Where cmake or a C++ compiler is missing the ggml side is skipped with a message (exit 0); the
polylin side still runs (its checks included). Absolute times on a shared machine are noise:
read the ratios, and rerun on a quiet machine for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks import blas_path, ggml_floors  # noqa: E402
from benchmarks.ggml_report import combine, table  # noqa: E402
from benchmarks.timing import (  # noqa: E402
    ALLOCATORS,
    allocator_environment,
    allocator_regime,
    apply_allocator_regime,
    command_line,
    run_metadata,
    second_of_calls,
    write_report,
)
from polylin import (  # noqa: E402
    LinearAttentionState,
    causal_conv1d,
    causal_conv1d_step,
    causal_linear_attention,
    delta_rule_attention,
    dplr_delta_rule,
    prepare_delta_rule_step,
    prepare_dplr_step,
    prepare_step,
)
from polylin._backend.compiled import compiled_available  # noqa: E402
from polylin.activations import softplus  # noqa: E402
from polylin.feature_maps import identity  # noqa: E402
from polylin.testing import Backend  # noqa: E402

#: Numba's: the compiled token loops' threads on NumPy arrays (``polylin._backend.compiled``).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                     "NUMBA_NUM_THREADS")  # fmt: skip

SDIST = "llama-cpp-python==0.3.36"
SDIST_DIR = "llama_cpp_python-0.3.36"
DEFAULT_CACHE = Path.home() / ".cache" / "polylin-ggml"
OPS = ("GATED_DELTA_NET", "SSM_SCAN", "RWKV_WKV7", "GATED_LINEAR_ATTN", "SSM_CONV")

#: perf cases added to test-backend-ops (its own list has GDN 32x128, SSM_SCAN and SSM_CONV)
EXTRA_CASES = """
    // polylin benchmarks/ggml_ops.py: shapes its comparison needs
    test_cases.emplace_back(new test_gated_delta_net(GGML_TYPE_F32, 16, 64, 512, 1));
    test_cases.emplace_back(new test_gated_delta_net(GGML_TYPE_F32, 16, 64, 4096, 1));
    test_cases.emplace_back(
        new test_gated_delta_net(GGML_TYPE_F32, 16, 128, 512, 1, 1, false, true));
    test_cases.emplace_back(new test_rwkv_wkv7(GGML_TYPE_F32, 32, 64, 512, 1));
    test_cases.emplace_back(new test_rwkv_wkv7(GGML_TYPE_F32, 32, 64, 1, 1));
    test_cases.emplace_back(new test_gla(GGML_TYPE_F32, 32, 64, 512, 1));
    test_cases.emplace_back(new test_gla(GGML_TYPE_F32, 32, 64, 1, 1));
"""
ANCHOR = "    // GATED_DELTA_NET: realistic model configurations\n"
THREADS_OLD = "ggml_backend_set_n_threads_fn(backend.get(), std::max<int>(1, N_THREADS/2));"
THREADS_NEW = ("ggml_backend_set_n_threads_fn(backend.get(), getenv(\"GGML_PERF_THREADS\") ? "
               "atoi(getenv(\"GGML_PERF_THREADS\")) : std::max<int>(1, N_THREADS/2));")
#: how many copies of the op one timed graph holds: 8 GiB of traffic (or 8 GFLOP) by default,
#: 30-60 s a case for these ops on one core; the environment lowers it (the loop still runs
#: for at least one second)
TARGETS = (
    ("const uint64_t target_flops_cpu =   8ULL * GFLOP;",
     "const uint64_t target_flops_cpu = getenv(\"GGML_PERF_CPU_GFLOP\") ? "
     "atoll(getenv(\"GGML_PERF_CPU_GFLOP\")) * GFLOP : 8ULL * GFLOP;"),
    ("const size_t target_size_cpu =  8 * GB;",
     "const size_t target_size_cpu = getenv(\"GGML_PERF_CPU_MIB\") ? "
     "(size_t) atoll(getenv(\"GGML_PERF_CPU_MIB\")) << 20 : 8 * GB;"),
)
PERF_ENV = {"GGML_PERF_CPU_GFLOP": "1", "GGML_PERF_CPU_MIB": "256"}
CMAKE_PROJECT = """cmake_minimum_required(VERSION 3.14)
project(polylin_ggml C CXX)
set(CMAKE_CXX_STANDARD 17)
add_subdirectory({ggml} ggml)
add_executable(test-backend-ops test-backend-ops-polylin.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
"""


def _say(message: str) -> None:
    print(f"ggml_ops: {message}", file=sys.stderr, flush=True)


def _missing_tools() -> list[str]:
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    return missing


def build_ggml(cache: Path) -> Path | None:
    """``test-backend-ops`` built in ``cache`` (reused when there), or ``None`` with a message."""
    binary = cache / "build" / "test-backend-ops"
    patched = cache / "test-backend-ops-polylin.cpp"
    missing = _missing_tools()
    if missing and not binary.exists():
        _say(f"{', '.join(missing)} not found: the ggml side is skipped")
        return None
    cache.mkdir(parents=True, exist_ok=True)
    source = cache / SDIST_DIR / "vendor" / "llama.cpp"
    if not source.exists():
        _say(f"downloading the {SDIST} sdist into {cache}")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             SDIST, "-d", str(cache)], capture_output=True, text=True)
        if done.returncode != 0:
            _say(f"pip download failed, the ggml side is skipped:\n{done.stderr[-2000:]}")
            return None
        shutil.unpack_archive(str(cache / f"{SDIST_DIR}.tar.gz"), str(cache))
    text = (source / "tests" / "test-backend-ops.cpp").read_text()
    changes = ((ANCHOR, EXTRA_CASES + ANCHOR), (THREADS_OLD, THREADS_NEW), *TARGETS)
    if any(old not in text for old, _ in changes):
        _say("test-backend-ops.cpp is not the expected version: the ggml side is skipped")
        return None
    for old, new in changes:
        text = text.replace(old, new)
    if binary.exists() and patched.exists() and patched.read_text() == text:
        return binary
    if missing:
        _say(f"{', '.join(missing)} not found: the ggml side is skipped")
        return None
    patched.write_text(text)
    (cache / "CMakeLists.txt").write_text(CMAKE_PROJECT.format(ggml=(source / "ggml").as_posix()))
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    steps = [
        ["cmake", "-S", str(cache), "-B", str(cache / "build"), *generator,
         "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
         "-DGGML_BACKEND_DL=OFF", "-DGGML_CPU=ON"],
        ["cmake", "--build", str(cache / "build"), "--target", "test-backend-ops",
         "-j", str(os.cpu_count() or 1)],
    ]
    _say(f"building test-backend-ops in {cache / 'build'} (several minutes)")
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            _say(f"{' '.join(step[:2])} failed, the ggml side is skipped:\n"
                 f"{(done.stdout + done.stderr)[-3000:]}")
            return None
    return binary if binary.exists() else None


# -- the ggml side: run test-backend-ops perf, parse its lines ------------------------------

_LINE = re.compile(r"^\s*([A-Z0-9_]+)\((.*)\):\s+(\d+) runs -\s+([0-9.]+) us/run")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_perf(text: str) -> list[dict[str, Any]]:
    """The rows of ``test-backend-ops perf``'s console output: op, parameters, us per run."""
    rows = []
    for line in _ANSI.sub("", text).splitlines():
        match = _LINE.match(line)
        if match:
            op, params, runs, us = match.groups()
            rows.append({"op": op, "params": _params(params), "runs": int(runs),
                         "seconds": float(us) * 1e-6})
    return rows


def _params(text: str) -> dict[str, str]:
    """``type=f32,ne_a=[515,3328,1,1],kda=1`` as a dict of strings (brackets kept whole)."""
    out, depth, start = {}, 0, 0
    for i, char in enumerate(text + ","):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            name, _, value = text[start:i].partition("=")
            out[name.strip()] = value.strip()
            start = i + 1
    return out


def pin(threads: int) -> None:
    """This process on the first ``threads`` of the cores it may use (where it may use more):
    ggml's and polylin's runs of one thread count share the same cores (the cores of a
    virtual machine differ in speed by up to 2x from one minute to the next), and XLA sizes its
    thread pool by the cores allowed (``XLA_FLAGS`` set no thread count)."""
    if hasattr(os, "sched_setaffinity") and threads < len(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])


def run_ggml(binary: Path, threads: int, case: Case | None = None) -> list[dict[str, Any]]:
    """One perf run on ``threads`` threads of the five ops, or of ``case`` alone (its op and a
    filter on its parameters); each case runs for >= 1 s."""
    env = dict(os.environ, GGML_PERF_THREADS=str(threads), **PERF_ENV)
    command = [str(binary), "perf", "-b", "CPU", "-o", ",".join(OPS)]
    if case is not None:
        command[-1] = case.op
        command += ["-p", case.params_filter()]
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          preexec_fn=partial(pin, threads))  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"test-backend-ops failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return parse_perf(done.stdout)


# -- the shapes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One comparison: ggml's op and parameters, polylin's family and sizes."""

    name: str
    op: str
    phase: str  # "prefill" or "decode"
    family: str  # gdn, kda, ssm, wkv7, gla, conv
    sizes: tuple[tuple[str, int], ...]  # H, d, T (ssm: N; conv: C)
    ggml: tuple[tuple[str, str], ...]  # the parameters that pick ggml's row

    def size(self, name: str) -> int:
        """One of the sizes."""
        return dict(self.sizes)[name]

    def matches(self, row: dict[str, Any]) -> bool:
        """Whether a parsed ggml row is this case's."""
        return row["op"] == self.op and all(row["params"].get(n) == v for n, v in self.ggml)

    def params_filter(self) -> str:
        """A regular expression (ECMAScript, ``test-backend-ops -p``) that the parameters of
        this case's ggml row match: each ``name=value`` a whole entry of the list."""
        return "".join(f"(?=.*(^|,){re.escape(f'{n}={v}')}(,|$))" for n, v in self.ggml)


def _delta(heads: int, dim: int, length: int, kda: bool) -> Case:
    family, label = ("kda", "KDA") if kda else ("gdn", "GDN")
    return Case(
        f"{label} {heads}x{dim} T={length}", "GATED_DELTA_NET",
        "decode" if length == 1 else "prefill", family,
        (("H", heads), ("d", dim), ("T", length)),
        (("head_count", str(heads)), ("head_size", str(dim)), ("n_seq_tokens", str(length)),
         ("n_seqs", "1"), ("v_repeat", "1"), ("permuted", "0"), ("kda", str(int(kda))),
         ("K", "1")),
    )  # fmt: skip


def _heads(op: str, family: str, label: str, heads: int, dim: int, length: int) -> Case:
    return Case(
        f"{label} {heads}x{dim} T={length}", op, "decode" if length == 1 else "prefill", family,
        (("H", heads), ("d", dim), ("T", length)),
        (("head_count", str(heads)), ("head_size", str(dim)), ("n_seq_tokens", str(length)),
         ("n_seqs", "1")),
    )  # fmt: skip


def _ssm(heads: int, dim: int, state: int, length: int) -> Case:
    return Case(
        f"SSM {heads}x{dim} N={state} T={length}", "SSM_SCAN",
        "decode" if length == 1 else "prefill", "ssm",
        (("H", heads), ("d", dim), ("N", state), ("T", length)),
        (("d_state", str(state)), ("head_dim", str(dim)), ("n_head", str(heads)),
         ("n_group", "1"), ("n_seq_tokens", str(length)), ("n_seqs", "1"),
         ("xbc_overlap", "0"), ("K", "1"), ("weak_decay", "0")),
    )  # fmt: skip


def _conv(channels: int, length: int) -> Case:
    return Case(
        f"conv {channels} T={length}", "SSM_CONV", "decode" if length == 1 else "prefill", "conv",
        (("C", channels), ("T", length)),
        (("ne_a", f"[{length + 3},{channels},1,1]"), ("ne_b", f"[4,{channels},1,1]")),
    )  # fmt: skip


def cases(quick: bool = False) -> list[Case]:
    """The issue's shapes (``quick``: tiny ones with no ggml row, for the smoke test)."""
    if quick:
        return [
            *(_delta(2, 16, t, False) for t in (24, 1)), _delta(2, 16, 24, True),
            *(_ssm(3, 8, 16, t) for t in (24, 1)),
            *(_heads("RWKV_WKV7", "wkv7", "WKV7", 2, 16, t) for t in (24, 1)),
            *(_heads("GATED_LINEAR_ATTN", "gla", "GLA", 2, 16, t) for t in (24, 1)),
            *(_conv(40, t) for t in (24, 1)),
        ]  # fmt: skip
    return [
        *(_delta(32, 128, t, False) for t in (64, 512, 1024)),
        *(_delta(16, 64, t, False) for t in (512, 4096)),
        _delta(16, 128, 512, True),
        _ssm(48, 64, 128, 512),
        _heads("RWKV_WKV7", "wkv7", "WKV7", 32, 64, 512),
        _heads("GATED_LINEAR_ATTN", "gla", "GLA", 32, 64, 512),
        _conv(3328, 512),
        _delta(32, 128, 1, False), _delta(16, 64, 1, False), _delta(32, 128, 1, True),
        _ssm(48, 64, 128, 1),
        _heads("RWKV_WKV7", "wkv7", "WKV7", 32, 64, 1),
        _heads("GATED_LINEAR_ATTN", "gla", "GLA", 32, 64, 1),
        _conv(3328, 1),
    ]  # fmt: skip


# -- inputs and the float64 references of ggml's semantics (ggml-cpu/ops.cpp) ----------------


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 inputs in polylin's layout, batch 1, time on axis 1 (ggml's ``[T, H, d]``)."""
    rng = np.random.default_rng(seed)
    sizes = dict(case.sizes)
    length = sizes["T"]
    if case.family == "conv":
        channels = sizes["C"]
        return {"x": rng.standard_normal((1, length, channels)),
                "weight": rng.standard_normal((channels, 4)) / 2,
                "state": rng.standard_normal((1, 3, channels))}  # fmt: skip
    heads, dim = sizes["H"], sizes["d"]
    shape = (1, length, heads, dim)
    if case.family == "ssm":
        state = sizes["N"]
        return {"x": rng.standard_normal(shape), "dt": rng.uniform(-1, 1, (1, length, heads)),
                "A": -rng.uniform(0.5, 1.0, heads),
                "B": rng.standard_normal((1, length, 1, state)),
                "C": rng.standard_normal((1, length, 1, state)),
                "S": rng.standard_normal((1, heads, state, dim)) / 4}  # fmt: skip
    out = {"q": rng.standard_normal(shape), "k": rng.standard_normal(shape),
           "v": rng.standard_normal(shape),
           "S": rng.standard_normal((1, heads, dim, dim)) / 4}  # fmt: skip
    if case.family in ("gdn", "kda"):  # ggml's test: q, k l2-normalized before the op
        width = dim if case.family == "kda" else 1
        out.update(q=_unit(out["q"]), k=_unit(out["k"]),
                   g=-rng.uniform(1e-4, 0.5, (1, length, heads, width)),
                   beta=rng.uniform(0, 1, (1, length, heads, 1)))  # fmt: skip
    elif case.family == "gla":  # ggml takes the gate itself; polylin its log
        out["g"] = -rng.uniform(1e-3, 0.3, shape)
        out["k"] = out["k"] * dim**-0.5
    else:  # wkv7: RWKV-7's a = -kk, b = kk * in-context rate, log w = -exp(...)
        kk = _unit(rng.standard_normal(shape))
        out.update(a=-kk, b=kk * rng.uniform(0, 1, shape), k=out["k"] * dim**-0.5,
                   g=-np.exp(rng.uniform(-6, -0.5, shape)))  # fmt: skip
    return out


def reference(case: Case, x: dict[str, np.ndarray]) -> np.ndarray:
    """ggml's token loop in float64: the output, in polylin's layout."""
    if case.family == "conv":  # SSM_CONV: out[t, c] = sum_i [state; x][t + i, c] w[c, i]
        padded = np.concatenate([x["state"], x["x"]], axis=1)
        length = x["x"].shape[1]
        return sum(padded[:, i : i + length] * x["weight"][:, i] for i in range(4))
    length = x["x" if case.family == "ssm" else "q"].shape[1]
    S = x["S"][0].copy()  # (H, d_k, d_v): S[i][j] of ggml's comments
    outs = []
    for t in range(length):
        if case.family == "ssm":  # SSM_SCAN: dt' = softplus(dt), S = exp(dt' A) S + B (x dt')
            dt = np.logaddexp(0.0, x["dt"][0, t])
            S = S * np.exp(dt * x["A"])[:, None, None] + (
                x["B"][0, t, 0][None, :, None] * (x["x"][0, t] * dt[:, None])[:, None, :])
            outs.append(np.einsum("hij,i->hj", S, x["C"][0, t, 0]))
            continue
        q, k, v, g = (x[n][0, t] for n in ("q", "k", "v", "g"))
        if case.family in ("gdn", "kda"):  # GATED_DELTA_NET: decay, delta, write, read
            S = S * np.exp(g)[:, :, None]
            delta = (v - np.einsum("hij,hi->hj", S, k)) * x["beta"][0, t]
            S = S + k[:, :, None] * delta[:, None, :]
            outs.append(np.einsum("hij,hi->hj", S, q) / np.sqrt(v.shape[-1]))
        elif case.family == "gla":  # GATED_LINEAR_ATTN: S = g S + k v^T, o = scale S^T q
            S = S * np.exp(g)[:, :, None] + k[:, :, None] * v[:, None, :]
            outs.append(np.einsum("hij,hi->hj", S, q) / np.sqrt(q.shape[-1]))
        else:  # RWKV_WKV7: S = diag(w) S + b (a^T S) + k v^T, o = S^T r
            sa = np.einsum("hi,hij->hj", x["a"][0, t], S)
            S = S * np.exp(g)[:, :, None] + k[:, :, None] * v[:, None, :] + (
                x["b"][0, t][:, :, None] * sa[:, None, :])
            outs.append(np.einsum("hij,hi->hj", S, q))
    return np.stack(outs)[None]


# -- polylin's calls -------------------------------------------------------------------------


#: The delta rules' chunk here: what an eager CPU call without a gradient runs by default on
#: any number of threads at d = 128 (``ONE_THREAD_CHUNK``; at d = 64 such a call runs 16,
#: ``FORWARD_CHUNK``), and the faster one compiled at these head sizes (0.66-0.90x the time of
#: 64, compiling 1.7-4.5x longer: ``docs/delta_rule.md``).
DELTA_CHUNK = 32


def token_loop(case: Case, backend: Backend) -> bool:
    """Whether a prefill runs its recurrent form, polylin's compiled token loop
    (``polylin._backend.compiled``: Numba installed, NumPy or PyTorch), instead of the chunked
    form: where a head's state is at most 64 x 64 (16 KiB in float32), and for the delta rules
    (the gated delta rule, KDA) at any size. At ggml's shapes on a Zen 4 core
    (``docs/performance.md``, "Compiled token loops"), with the states of a token row updated
    together, the loop took 0.73-0.86x the chunked form's time for the delta rules at 128
    channels on PyTorch (one and two threads; 0.40-0.76x on NumPy), and 1.26-1.44x for
    Mamba-2's state of 128 (linear attention's loop)."""
    if case.family == "conv" or backend not in (Backend.NUMPY, Backend.TORCH):
        return False
    if not compiled_available():
        return False
    sizes = dict(case.sizes)
    delta_rule = case.family in ("gdn", "kda")
    return max(sizes["d"], sizes.get("N", 0)) <= 64 or delta_rule


def polylin_call(case: Case, backend: Backend, x: dict[str, Any]) -> Callable[[], Any]:
    """polylin's fastest call for ``case`` on arrays ``x`` of ``backend`` (float32); it
    returns what polylin returns, the final state included (:func:`output` picks the output).
    Compiled (``--backends torch.compile``), the state is then computed too, as a model needs."""
    xp = backend.namespace()
    decode = case.phase == "decode"
    token = {n: a[:, 0] for n, a in x.items() if n not in ("A", "S", "weight", "state")}
    method = "recurrent" if token_loop(case, backend) else "chunked"
    if case.family == "conv":
        if decode:
            return lambda: causal_conv1d_step(token["x"], x["weight"], state=x["state"])
        return lambda: causal_conv1d(
            x["x"], x["weight"], state=x["state"], seq_axis=1, return_state=True)
    if case.family in ("gdn", "kda"):
        scale = case.size("d") ** -0.5
        if decode:
            step = prepare_delta_rule_step(scale=scale)
            return lambda: step(token["q"], token["k"], token["v"], token["beta"], x["S"],
                                log_decay=token["g"])  # fmt: skip
        return lambda: delta_rule_attention(
            x["q"], x["k"], x["v"], x["beta"], log_decay=x["g"], scale=scale,
            initial_state=x["S"], return_state=True, seq_axis=1, method=method,
            chunk_size=DELTA_CHUNK)  # fmt: skip
    if case.family == "wkv7":
        if decode:
            step = prepare_dplr_step()
            return lambda: step(*(token[n] for n in ("q", "k", "v", "a", "b")), x["S"],
                                log_decay=token["g"])  # fmt: skip
        return lambda: dplr_delta_rule(
            x["q"], x["k"], x["v"], x["a"], x["b"], log_decay=x["g"], initial_state=x["S"],
            return_state=True, seq_axis=1, method=method)  # fmt: skip
    state = LinearAttentionState(x["S"], xp.zeros(x["S"].shape[:-1], dtype=x["S"].dtype))
    if case.family == "gla":
        scale = case.size("d") ** -0.5
        if decode:
            step = prepare_step(identity, normalize=False, scale=scale)
            return lambda: step(token["q"], token["k"], token["v"], state, log_decay=token["g"])
        return lambda: causal_linear_attention(
            x["q"], x["k"], x["v"], identity, log_decay=x["g"], normalize=False, scale=scale,
            initial_state=state, return_state=True, seq_axis=1, method=method)  # fmt: skip

    def ssm_inputs(at: dict[str, Any]) -> tuple[Any, Any]:  # x dt', dt' A
        # polylin's softplus (PyTorch's own kernel there): ggml's returns dt above 20, which
        # differs from log(1 + exp(dt)) by less than 3e-9.
        dt = softplus(at["dt"])[..., None]
        return at["x"] * dt, dt * x["A"][:, None]

    if decode:
        step = prepare_step(identity, normalize=False)

        def ssm_token() -> Any:
            v, log_decay = ssm_inputs(token)
            return step(token["C"], token["B"], v, state, log_decay=log_decay)

        return ssm_token

    def ssm() -> Any:
        v, log_decay = ssm_inputs(x)
        return causal_linear_attention(
            x["C"], x["B"], v, identity, log_decay=log_decay, normalize=False,
            initial_state=state, return_state=True, seq_axis=1, method=method)  # fmt: skip

    return ssm


def output(case: Case, result: Any) -> Any:
    """The output in :func:`polylin_call`'s ``result``, in the layout of :func:`reference`."""
    return result[0][:, None] if case.phase == "decode" else result[0]


# -- polylin's side: checked, then timed (in a worker per pass and thread count) -----------

#: The largest error allowed against the float64 reference, relative to the output's scale.
TOLERANCE = 1e-3

#: Seconds between a case's check and its timing on more than one thread: the threads of
#: NumPy's BLAS and PyTorch's OpenMP spin on after their last product (OpenBLAS's for up to
#: 2^28 cycles, a tenth of a second at 2.6 GHz), and a token loop split between two threads
#: then shares a core with them, at one thread's speed (``docs/performance.md``, "Two threads
#: beside other pools"): the case before, a chunked form's, must not slow the next one down.
SETTLE_S = 0.3
#: ``torch.compile`` is polylin's PyTorch call compiled whole (``--backends torch.compile``),
#: ``jax.jit`` its JAX call under ``jax.jit`` (the arrays traced arguments)
BACKENDS = {
    "numpy": Backend.NUMPY,
    "torch": Backend.TORCH,
    "torch.compile": Backend.TORCH,
    "jax.jit": Backend.JAX,
}


def _checked(case: Case, name: str, got: Any, want: np.ndarray, backend: Backend) -> float:
    """The error of ``got`` against the float64 ``want`` relative to its scale; raises above
    :data:`TOLERANCE` (or on another shape)."""
    got = backend.to_numpy(got).astype(np.float64)
    error = float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))
    if got.shape != want.shape or not error <= TOLERANCE:
        raise AssertionError(f"{case.name} on {name}: shape {got.shape} vs "
                             f"{want.shape}, error {error:.2e} > {TOLERANCE}")  # fmt: skip
    return error


def time_polylin(
    chosen: list[Case], backends: list[str], repeats: int, budget_s: float, floors: bool = False,
    settle_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Each case on each backend: the error against :func:`reference`, then, ``settle_s``
    seconds later (:data:`SETTLE_S`), the times.

    A call whose error exceeds :data:`TOLERANCE` raises: nothing unchecked is timed. On
    ``torch.compile`` and ``jax.jit`` the first call's time (the compilation) is ``compile_s``. With
    ``floors``, PyTorch's rows get ``floor_s`` (``benchmarks/ggml_floors.py``): prefill, the
    time of the call's matrix products (and ``products_share``, ``operations_share``, and their
    arithmetic against the loop's, ``products_flops`` and ``recurrence_flops``);
    decoding, the bare state passes, checked like the call (none for the convolution's
    prefill and the token loop's)."""
    rows = []
    for case in chosen:
        inputs = make_inputs(case)
        want = reference(case, inputs)
        for name in backends:
            backend = BACKENDS[name]
            x = {n: backend.from_numpy(a, "float32") for n, a in inputs.items()}
            fn = _compiled(case, name, x) if name.endswith((".compile", ".jit")) else (
                polylin_call(case, backend, x))  # fmt: skip
            extra: dict[str, Any] = {}
            start = time.perf_counter()
            error = _checked(case, name, output(case, fn()), want, backend)
            if name.endswith((".compile", ".jit")):
                extra["compile_s"] = time.perf_counter() - start
            time.sleep(settle_s)  # the pools of the check and of the case before go quiet
            mean, median, faults = second_of_calls(fn, repeats, budget_s)
            if floors and name == "torch":
                extra.update(_floor(case, fn, mean, x, want, repeats, budget_s))
            rows.append({"case": case.name, "backend": name, "error": error, "seconds": mean,
                         "median_s": median, "faults_per_call": faults, **extra})  # fmt: skip
    return rows


def _compiled(case: Case, name: str, x: dict[str, Any]) -> Callable[[], Any]:
    """polylin's call compiled whole: ``torch.compile`` (``dynamic=False``) or ``jax.jit`` with
    the arrays as traced arguments (so that XLA cannot fold the inputs into constants), each
    call waited for."""
    if name == "torch.compile":
        import torch

        torch._dynamo.reset()
        return torch.compile(polylin_call(case, Backend.TORCH, x), dynamic=False)
    import jax

    jitted = jax.jit(lambda arrays: polylin_call(case, Backend.JAX, arrays)())
    return lambda: jax.block_until_ready(jitted(x))


def _floor(
    case: Case, fn: Callable[[], Any], mean: float, x: dict[str, Any], want: np.ndarray,
    repeats: int, budget_s: float,
) -> dict[str, Any]:
    """``floor_s`` of a PyTorch row (see :func:`time_polylin`); none for the prefills without
    matrix products: the convolution's, and those run by the compiled token loop
    (:func:`token_loop`)."""
    if case.phase == "prefill" and (case.family == "conv" or token_loop(case, Backend.TORCH)):
        return {}
    if case.phase == "prefill":
        products, operations = ggml_floors.profile_shares(fn)
        loop = ggml_floors.recurrence_flops(case.family, dict(case.sizes))
        return {"floor_s": products * mean, "products_share": products,
                "operations_share": operations, "products_flops": ggml_floors.product_flops(fn),
                "recurrence_flops": loop}  # fmt: skip
    passes = ggml_floors.state_passes(case.family, x)
    _checked(case, "torch, bare state passes", passes(), want, Backend.TORCH)
    return {"floor_s": second_of_calls(passes, repeats, budget_s)[0]}


def _worker(args: argparse.Namespace) -> None:
    """Run in a fresh process whose thread variables are set: for each case name read from
    standard input, time that case and print its rows as one line of JSON."""
    threads = args.threads[0]
    pin(threads)  # before any library starts a thread: a thread keeps the cores it started on
    apply_allocator_regime()
    import torch

    torch.set_num_threads(threads)
    chosen = {c.name: c for c in cases(args.quick)}
    print(json.dumps("ready"), flush=True)  # imported: ggml's runs no longer share the cores
    for line in sys.stdin:
        case = chosen[line.strip()]
        print(json.dumps(time_polylin([case], args.backends, args.repeats, args.budget,
                                      args.floors, SETTLE_S if threads > 1 else 0.0)),
              flush=True)  # fmt: skip


class PolylinWorker:
    """:func:`time_polylin` in a fresh process with ``threads`` threads everywhere, one case at
    a time (:meth:`time`): its time is taken right after ggml's for the same case, so that a
    machine whose speed drifts from one minute to the next weighs on both sides of a ratio
    alike."""

    def __init__(self, args: argparse.Namespace, threads: int) -> None:
        env = allocator_environment(args.allocator, dict(os.environ))
        env = blas_path.environment(args.blas, env, args.blas_library)
        env.update({name: str(threads) for name in _THREAD_VARIABLES})
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads",
                   str(threads), "--repeats", str(args.repeats), "--budget", str(args.budget),
                   "--backends", *args.backends]  # fmt: skip
        if args.quick:
            command.append("--quick")
        if args.floors:
            command.append("--floors")
        # Its standard error is this process's: a pipe nobody reads could fill and stall it.
        self._process = subprocess.Popen(
            command, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._read("its start")  # its imports slowed ggml's first case down 1.8x

    def time(self, case: Case) -> list[dict[str, Any]]:
        """The rows of ``case`` (one per backend)."""
        assert self._process.stdin is not None
        self._process.stdin.write(case.name + "\n")
        self._process.stdin.flush()
        return self._read(case.name)

    def _read(self, what: str) -> Any:
        """The worker's next line of JSON (``what``: for the error message)."""
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.communicate()
            raise RuntimeError(f"the polylin worker failed on {what} (its errors above)")
        return json.loads(line)

    def close(self) -> None:
        """End the worker (its standard input closed, it returns)."""
        self._process.communicate()


def run_pass(
    args: argparse.Namespace, binary: Path | None, chosen: list[Case], threads: int
) -> dict[str, Any]:
    """One pass on ``threads`` threads: for each case ggml's time, then polylin's, in one worker
    process for the pass or (``--fresh``) a worker of its own, started before ggml's run."""
    shared = None if args.fresh else PolylinWorker(args, threads)
    ggml: list[dict[str, Any]] = []
    polylin: list[dict[str, Any]] = []
    try:
        for case in chosen:
            worker = shared or PolylinWorker(args, threads)
            try:
                if binary is not None and not args.quick:
                    ggml += run_ggml(binary, threads, case)
                polylin += worker.time(case)
            finally:
                if worker is not shared:
                    worker.close()
    finally:
        if shared is not None:
            shared.close()
    return {"threads": threads, "ggml": ggml, "polylin": polylin}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Build ggml's perf program if needed, run both sides, print and return the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of repeats a call")
    parser.add_argument("--backends", nargs="+", default=["numpy", "torch"],
                        choices=list(BACKENDS))
    parser.add_argument("--only", nargs="+", choices=OPS, help="these ggml ops only")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--skip-ggml", action="store_true", help="polylin's side only")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, no ggml rows")
    parser.add_argument(
        "--floors", action="store_true",
        help="PyTorch's floors too: prefill's matrix products, decoding's bare state passes")
    parser.add_argument(
        "--allocator", choices=list(ALLOCATORS),
        help="glibc's regime for polylin's worker processes (default: this shell's)")
    parser.add_argument(
        "--fresh", action="store_true",
        help="a worker process of its own for each case: a process's first calls, whose "
             "allocator has not seen the earlier cases' frees")
    parser.add_argument("--blas", choices=blas_path.PATHS)  # default: this shell's
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # checked by the parent; pinned before any library starts its threads
        _worker(args)
        return None
    for name in args.backends:
        reason = BACKENDS[name].unavailable_reason()
        if reason is not None:
            parser.error(f"--backends {name}: {reason}")
    try:
        args.blas_library = blas_path.prepare(args.blas, args.cache)
    except RuntimeError as error:
        parser.error(f"--blas {args.blas}: {error}")
    binary = None if args.skip_ggml else build_ggml(args.cache)
    if args.build_only:
        print(binary if binary is not None else "ggml not built")
        return None
    chosen = [c for c in cases(args.quick) if args.only is None or c.op in args.only]
    passes = []
    for index in range(args.passes):
        for threads in args.threads:
            _say(f"pass {index + 1}/{args.passes}, {threads} thread(s)")
            passes.append(run_pass(args, binary, chosen, threads))
    rows, goals = combine(chosen, passes, args.backends)
    print(table(rows))
    report = {
        "meta": run_metadata(command_line("ggml_ops.py", argv),
                             ggml=None if binary is None else str(binary), sdist=SDIST,
                             allocator=allocator_regime(args.allocator), fresh=args.fresh,
                             blas=blas_path.regime(args.blas, args.blas_library)),
        "rows": rows, "passes": passes, "goals": goals,
    }  # fmt: skip
    return write_report(report, args.json)


if __name__ == "__main__":
    main()
