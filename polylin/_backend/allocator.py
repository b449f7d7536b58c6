"""The C library's allocator and the temporaries of eager CPU calls.

An eager call on the CPU (NumPy, array-api-strict, PyTorch) takes its temporaries from the
process's allocator at every call, and frees them before it returns. glibc serves a block
above its *mmap threshold* with a fresh mapping, and gives the top of its heap back to the
system above its *trim threshold*: the next call then touches new pages, one page fault per
4 KiB. Both thresholds start at 128 KiB (the trim threshold twice the other once it moves) and
rise by glibc's own rule to the size of the largest mapped block freed so far, up to 32 MiB on
64-bit systems. A process that has not freed such a block faults at every call: KDA at
ggml's shape (16 heads x 128, T = 512) made 6663 faults per call and took 1.4x its time in a
process of its own, NumPy's gated delta rule at 32 heads x 128, T = 64, 2400 and 1.7x
(``docs/performance.md``, "glibc's thresholds raised at the first call").

:func:`raise_thresholds` frees one block just under that largest size, once, the first time
an eager CPU call runs, so that glibc's rule raises both thresholds as far as it goes (32 and
64 MiB), as it would after the process freed such a block itself: blocks up to 32 MiB then
come from the heap, and up to 64 MiB of freed memory stays in it for the next call. Where the
process set its thresholds (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES``, ``mallopt``) glibc's rule is off and nothing changes; elsewhere than glibc
on Linux nothing is done.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

from .execution import eager_cpu
from .namespace import device

__all__ = ["largest_dynamic_threshold", "leave_thresholds", "raise_thresholds"]

#: Whether :func:`raise_thresholds` has run (or found nothing to do) in this process.
_DONE = False


def largest_dynamic_threshold() -> int:
    """glibc's ``DEFAULT_MMAP_THRESHOLD_MAX``: the largest mmap threshold its rule sets, 4 MiB
    times the size of a C ``long`` (32 MiB on 64-bit systems)."""
    return 4 * 2**20 * ctypes.sizeof(ctypes.c_long)


def _glibc() -> bool:
    """Whether this process runs on glibc (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def leave_thresholds() -> None:
    """Never raise glibc's thresholds in this process (:func:`raise_thresholds` then returns at
    once): the benchmarks' regime of glibc's thresholds as they come."""
    global _DONE
    _DONE = True


def raise_thresholds(xp: Any, x: Any) -> None:
    """Before the first eager CPU call of the process (``xp`` on the device of its array ``x``:
    :func:`~polylin._backend.execution.eager_cpu`),
    free one block of just under :func:`largest_dynamic_threshold` bytes through the C
    library's ``malloc``, where that is glibc's (module docstring). Every later call returns
    at once.

    The block is never touched: glibc maps it and unmaps it (no page is faulted), and its
    size, header and flag bits included, stays at or under the largest threshold, which glibc
    compares them with. Safe from several threads: a second block at worst.
    """
    global _DONE
    if _DONE or not eager_cpu(xp, device(x)):
        return
    _DONE = True
    if not _glibc():
        return
    try:
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    block = malloc(largest_dynamic_threshold() - 2 * os.sysconf("SC_PAGE_SIZE"))
    if block:
        free(block)
