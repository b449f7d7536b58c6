"""The short causal convolution on a compiled kernel (Numba): one pass over the sequence.

The array-API form of the depthwise causal convolution (:func:`~._backend.depthwise.causal_taps`)
reads the inputs after the state, ``[S; x]``, as one concatenated array, and makes a product
and ``width - 1`` multiply-adds over the whole sequence: on NumPy each a pass that writes a new
array. :func:`conv_rows` computes each output row from its ``width`` input rows, read where they
are (the state's rows or the sequence's), the same sums in the same order, each product and
addition rounded as NumPy rounds them (compiled without contracting them: the same bits). It
also writes the state after the sequence, the last ``width - 1`` inputs. At SSM_CONV's shape
(3328 channels, T = 512, width 4, float32, one Zen 3 core) the kernel took 1.1 ms against 5.5 ms
for NumPy's taps (and the concatenation before them), and a decoding token 2.2 against 18 us.

It runs on NumPy arrays, float32 and float64, where Numba is installed and ``POLYLIN_COMPILED``
is not ``0``; a long call's rows are split between threads (``NUMBA_NUM_THREADS``, NumPy's
taps use one: 0.13x their time on two). PyTorch keeps its own kernels: its depthwise
convolution took as long (1.03x, one thread) and its four small operations of a decoding token
less time (0.85x) than the kernel with the tensors' NumPy views. This module imports no array
library (rule 1 of ARCHITECTURE.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

from .compiled import in_parts, kernel_threads, numba_module, numpy_views
from .execution import compiling
from .namespace import loaded_numpy

__all__ = ["CONV_PART_SIZE", "compiled_conv", "conv_rows"]

#: The least outputs times taps each thread of a call gets (handing a part to another thread
#: and waiting for it takes some microseconds).
CONV_PART_SIZE = 1 << 20


def conv_rows(
    S: Any, x: Any, taps: Any, bias: Any, biased: bool, out: Any, S_out: Any, lo: int, hi: int
) -> None:
    """``out[p, t] = bias + sum_i e[p, t + i] * taps[i]`` for the rows ``r = p T + t`` from
    ``lo`` to ``hi``, where ``e = [S[p]; x[p]]`` along the tokens: ``S`` ``(P, W - 1, C)``,
    ``x`` ``(P, T, C)``, ``taps`` ``(W, C)`` (the weight transposed), ``bias`` ``(C,)`` added
    first where ``biased``; ``out`` ``(P, T, C)``. With row ``t = T - 1`` also the state after
    the sequence, ``S_out[p] = e[p, T:]`` ``(P, W - 1, C)``. The array-API form's order: the
    bias plus the first tap's product, then one multiply-add per tap."""
    T, C = out.shape[1], out.shape[2]
    W = taps.shape[0]
    for r in range(lo, hi):
        p, t = r // T, r % T
        row = out[p, t]
        for i in range(W):
            k = t + i  # the input row in e
            source, tap = (S[p, k] if k < W - 1 else x[p, k - W + 1]), taps[i]
            if i > 0:
                for c in range(C):
                    row[c] = row[c] + source[c] * tap[c]
            elif biased:
                for c in range(C):
                    row[c] = bias[c] + source[c] * tap[c]
            else:
                for c in range(C):
                    row[c] = source[c] * tap[c]
        if t == T - 1:
            for j in range(W - 1):
                k = T + j
                S_out[p, j] = S[p, k] if k < W - 1 else x[p, k - W + 1]


@cache
def _kernel() -> Callable[..., None] | None:
    """:func:`conv_rows` compiled (no contraction: NumPy's roundings), or ``None``."""
    numba = numba_module()
    if numba is None:
        return None
    return numba.njit(cache=True, nogil=True)(conv_rows)


def compiled_conv(S: Any, x: Any, weight: Any, bias: Any | None) -> tuple[Any, Any] | None:
    """The depthwise causal convolution of the NumPy arrays ``x`` ``(..., T, C)`` after the
    state ``S`` ``(..., W - 1, C)`` (the same leading dimensions), ``weight`` ``(C, W)``,
    ``bias`` ``(C,)`` or ``None``: ``(out, S_T)``, the sums of
    :func:`~._backend.depthwise.causal_taps` and the state after ``x`` (a new array). ``None``
    where the kernel does not run: Numba missing or turned off, another library, mixed or
    other dtypes than float32 and float64, width 1, no tokens."""
    if compiling(S):  # traced by torch.compile: nothing here is looked at
        return None
    numpy = loaded_numpy()
    if numpy is None or type(S) is not numpy.ndarray:  # PyTorch: its own kernels (module doc)
        return None
    run = _kernel()
    if run is None or weight.shape[1] < 2 or x.shape[-2] == 0:
        return None
    views = numpy_views(S, [x, weight] + ([] if bias is None else [bias]))
    if views is None:
        return None
    state, xs, w = views[:3]
    *lead, T, C = xs.shape
    W, P = w.shape[1], math.prod(lead)
    taps = numpy.ascontiguousarray(w.T)
    out = numpy.empty((P, T, C), dtype=xs.dtype)
    S_out = numpy.empty((P, W - 1, C), dtype=xs.dtype)
    args = [
        numpy.ascontiguousarray(state.reshape(P, W - 1, C)),
        numpy.ascontiguousarray(xs.reshape(P, T, C)), taps,
        views[3] if bias is not None else taps[0], bias is not None, out, S_out,
    ]  # fmt: skip
    parts = min(P * T, kernel_threads(False), P * T * C * W // CONV_PART_SIZE)
    if parts > 1:
        in_parts(run, args, P * T, parts)
    else:
        run(*args, 0, P * T)
    return out.reshape(*lead, T, C), S_out.reshape(*lead, W - 1, C)
