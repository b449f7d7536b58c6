"""glibc's allocation thresholds, raised once by the process's first eager call
(``polylin/_backend/allocator.py``): blocks that an eager call frees stay in the heap for the
next call, where glibc would otherwise give them back to the system and fault them in again.

Each test runs a fresh interpreter, which counts the minor page faults of a cycle of two
2 MiB blocks (allocated, written and freed through ``malloc``) before and after one polylin
call on NumPy arrays.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import ctypes, resource
    import numpy as np
    import polylin

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    SIZE = 2 * 2**20

    def cycle():
        blocks = [libc.malloc(SIZE), libc.malloc(SIZE)]
        for block in blocks:
            libc.memset(block, 1, SIZE)
        for block in blocks:
            libc.free(block)

    def faults():
        cycle()
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            cycle()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 10

    before = faults()
    x = np.ones((2, 8, 4), dtype=np.float32)
    polylin.causal_linear_attention(x, x, x)
    print(before, faults())
    """
)

MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="glibc's allocator (Linux) only: elsewhere polylin leaves the allocator alone",
)


def _faults(**env: str) -> tuple[float, float]:
    """The child's faults per cycle before and after its polylin call, in an environment
    without the malloc variables but ``env``'s."""
    dropped = (*MALLOC_VARIABLES, "LD_PRELOAD")
    environ = {k: v for k, v in os.environ.items() if k not in dropped}
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT,
        env={**environ, **env}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(float, done.stdout.split())
    return before, after


def test_first_eager_call_keeps_freed_blocks_in_the_heap():
    """glibc as it comes gives the freed blocks back (a fault per page of them at every cycle,
    1024 for two 2 MiB blocks); after polylin's first call they stay in the heap (no fault)."""
    before, after = _faults()
    if before < 256:
        pytest.skip(f"this process's allocator keeps freed blocks already ({before} faults)")
    assert after < 16, (before, after)


def test_thresholds_the_process_set_are_kept():
    """``MALLOC_MMAP_THRESHOLD_`` set (here to glibc's own initial 128 KiB) turns glibc's rule
    off: polylin's first call changes nothing, every 2 MiB block is mapped afresh."""
    before, after = _faults(MALLOC_MMAP_THRESHOLD_="131072")
    assert before >= 512, before
    assert after >= before / 2, (before, after)
