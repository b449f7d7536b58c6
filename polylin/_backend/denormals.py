"""Subnormal numbers flushed to zero while a chunked form runs on PyTorch's CPU.

A strong decay drives the chunked forms' decay factors, the products made from them and the
decayed states below the smallest normal number (``1.2e-38`` in float32: ``exp(-87.3)``),
where x86 and ARM cores take a slow path for every operation with a subnormal operand or
result. A gated delta rule whose gate reaches -6 per token (ggml's test inputs times 20) then
ran at 32 heads x 128, T = 512, in 450-520 ms instead of 47-51 ms (one thread), Mamba-2's scan
at five times its gates 150 ms instead of 33; KDA and GLA 4.6-6.3x.

:func:`flushing_denormals` sets the calling thread's flush-to-zero mode
(``torch.set_flush_denormal``: subnormal results and operands read as 0) for the call, and
restores the mode it found (read by a probe: half of the smallest normal number is 0 only in
that mode). It changes no number above ``1.2e-38`` (float32) or ``2.2e-308`` (float64): a
flushed value is smaller than any float32 or float64 output's resolution by far. PyTorch's
other intra-op threads keep their own mode (the delta rule above on two threads: 160 ms,
292 ms without, 27 ms at ggml's own gates); ``torch.compile``, ``torch.func``
transforms, other libraries and the backward pass run as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .execution import compiling, torch_transforming
from .namespace import torch_module, torch_namespace_of

__all__ = ["flushing_denormals"]


def _flushing(torch: Any) -> bool:
    """Whether the calling thread flushes subnormal numbers to zero now."""
    tiny = torch.finfo(torch.float32).tiny  # the default dtype and device could differ
    return bool(torch.full((), tiny, dtype=torch.float32, device="cpu") * 0.5 == 0)


@contextmanager
def flushing_denormals(x: Any) -> Iterator[None]:
    """Flush subnormal numbers to zero on the calling thread while the block runs, where ``x``
    is a PyTorch tensor on the CPU run eagerly (module docstring); elsewhere nothing."""
    if (torch_namespace_of(x) is None or x.device.type != "cpu" or compiling(x)
            or torch_transforming(x)):  # fmt: skip
        yield
        return
    torch = torch_module()
    if _flushing(torch) or not torch.set_flush_denormal(True):
        yield  # already flushing (the caller's choice, kept), or a CPU without the mode
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
