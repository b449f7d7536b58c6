"""The library's own CPU kernels: token loops compiled by Numba, where it is installed.

A decoding step of an eager library is a dozen operations, each a pass over the state or a
few microseconds of dispatch; a compiled loop makes one pass and one call. Each kernel here
runs one recurrence over ``T`` tokens of ``n`` independent states, reading the state it is
given and writing a new one (the caller's state is never written), in the input's precision (its
results agree with the array-API step's to rounding; the order of the sums differs):

- :func:`delta_tokens`: ``S' = diag(a) S``, ``e = beta (v - S'^T k)``, ``S_t = S' + k e^T``,
  ``o = S_t^T q`` (the gated delta rule, KDA);
- :func:`linear_tokens`: ``S_t = diag(a) S + k v^T``, ``z_t = a z + k``, ``o = S_t^T q``
  (linear attention with a scalar or per-channel decay: RetNet, GLA, Mamba-2's scan);
- :func:`dplr_tokens`: ``S_t = diag(a) S + b (a'^T S) + k v^T``, ``o = S_t^T q`` (RWKV-7).

Each head's state alternates between two buffers from token to token (its row ``i`` read from
one, written to the other): where a loop read and wrote the same row, the compiler could not
prove the two apart and left it unvectorized (GLA's loop at 32 heads x 64, T = 512: 70 ms
against 16 ms). Multiply-adds may be fused (``fastmath={"contract"}``, nothing reassociated:
11 ms). The functions are plain Python over arrays (a reference anyone can read) and are
compiled with ``numba.njit`` at their first use (:func:`kernel`; cached on disk where the
package folder or Numba's cache folder is writable). Numba is optional: without it, or with
the environment variable ``POLYLIN_COMPILED=0``, :func:`compiled_tokens` answers ``None`` and
the array-API forms run. Only NumPy arrays and PyTorch CPU tensors without a gradient to
record qualify (:func:`compiled_tokens`): Numba reads them as NumPy arrays that share their
memory. This module imports no array library (rule 1 of ARCHITECTURE.md): a tensor's NumPy
view is made by the tensor's own library, and the results are allocated by the NumPy that
the arrays' views show to be imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import cache
from typing import Any

from .execution import compiling, torch_transforming
from .namespace import loaded_numpy, torch_module, torch_namespace_of

__all__ = [
    "compiled_available",
    "compiled_tokens",
    "delta_tokens",
    "dplr_tokens",
    "kernel",
    "linear_tokens",
]

#: Set to ``0`` to run the array-API forms where a compiled kernel would run.
ENVIRONMENT = "POLYLIN_COMPILED"


def delta_tokens(
    q: Any, k: Any, v: Any, beta: Any, decay: Any, S: Any, out: Any, S_out: Any
) -> None:
    """The gated delta rule over ``T`` tokens: ``q, k`` ``(n, T, m)``, ``v`` ``(n, T, c)``,
    ``beta`` ``(n, T, 1)``, ``decay`` ``(n or 1, T or 1, m or 1)`` (``exp(g)``; ones for no
    decay), ``S`` ``(n, m, c)`` read; ``out`` ``(n, T, c)`` and ``S_out`` ``(n, m, c)`` written."""
    n, T, m = k.shape
    c = v.shape[2]
    dt, di = int(decay.shape[1] > 1), int(decay.shape[2] > 1)  # broadcast axes read at 0
    for h in range(n):
        dh = h if decay.shape[0] > 1 else 0
        source = S[h]
        spare = S_out[h] if T == 1 else S_out[h].copy()  # the other buffer (module docstring)
        error = v[h, 0].copy()  # (c,): S'^T k, then beta (v - S'^T k)
        for t in range(T):
            state = S_out[h] if (T - 1 - t) % 2 == 0 else spare
            error[:] = 0
            for i in range(m):
                key = decay[dh, t * dt, i * di] * k[h, t, i]
                row = source[i]
                for j in range(c):
                    error[j] += key * row[j]
            b = beta[h, t, 0]
            for j in range(c):
                error[j] = b * (v[h, t, j] - error[j])
            o = out[h, t]
            o[:] = 0
            for i in range(m):
                a = decay[dh, t * dt, i * di]
                ki = k[h, t, i]
                qi = q[h, t, i]
                row = source[i]
                new = state[i]
                for j in range(c):
                    x = a * row[j] + ki * error[j]
                    new[j] = x
                    o[j] += qi * x
            source = state


def linear_tokens(
    q: Any, k: Any, v: Any, decay: Any, S: Any, z: Any, out: Any, S_out: Any, z_out: Any,
    den: Any,
) -> None:
    """Linear attention over ``T`` tokens: ``q, k`` ``(n, T, m)``, ``v`` ``(n, T, c)``, ``decay``
    as for :func:`delta_tokens`, ``S`` ``(n, m, c)`` and ``z`` ``(n, m)`` read; ``out``
    ``(n, T, c)`` (the numerators ``S_t^T q``), ``S_out``, ``z_out`` and ``den`` ``(n, T, 1)``
    (the normalizers ``z_t^T q``) written."""
    n, T, m = k.shape
    c = v.shape[2]
    dt, di = int(decay.shape[1] > 1), int(decay.shape[2] > 1)  # broadcast axes read at 0
    for h in range(n):
        dh = h if decay.shape[0] > 1 else 0
        source = S[h]
        spare = S_out[h] if T == 1 else S_out[h].copy()  # the other buffer (module docstring)
        z_source = z[h]
        z_state = z_out[h]
        for t in range(T):
            state = S_out[h] if (T - 1 - t) % 2 == 0 else spare
            o = out[h, t]
            o[:] = 0
            total = 0 * z_source[0]
            for i in range(m):
                a = decay[dh, t * dt, i * di]
                ki = k[h, t, i]
                qi = q[h, t, i]
                z_state[i] = ki + a * z_source[i]
                total += qi * z_state[i]
                row = source[i]
                new = state[i]
                for j in range(c):
                    x = a * row[j] + ki * v[h, t, j]
                    new[j] = x
                    o[j] += qi * x
            den[h, t, 0] = total
            source = state
            z_source = z_state


def dplr_tokens(
    q: Any, k: Any, v: Any, a: Any, b: Any, decay: Any, S: Any, out: Any, S_out: Any
) -> None:
    """The generalized delta rule over ``T`` tokens: ``q, k, a, b`` ``(n, T, m)``, ``v``
    ``(n, T, c)``, ``decay`` as for :func:`delta_tokens`, ``S`` ``(n, m, c)`` read; ``out``
    ``(n, T, c)`` and ``S_out`` written. ``a^T S`` is read before the decay."""
    n, T, m = k.shape
    c = v.shape[2]
    dt, di = int(decay.shape[1] > 1), int(decay.shape[2] > 1)  # broadcast axes read at 0
    for h in range(n):
        dh = h if decay.shape[0] > 1 else 0
        source = S[h]
        spare = S_out[h] if T == 1 else S_out[h].copy()  # the other buffer (module docstring)
        read = v[h, 0].copy()  # (c,): a^T S
        for t in range(T):
            state = S_out[h] if (T - 1 - t) % 2 == 0 else spare
            read[:] = 0
            for i in range(m):
                ai = a[h, t, i]
                row = source[i]
                for j in range(c):
                    read[j] += ai * row[j]
            o = out[h, t]
            o[:] = 0
            for i in range(m):
                ai = decay[dh, t * dt, i * di]
                bi = b[h, t, i]
                ki = k[h, t, i]
                qi = q[h, t, i]
                row = source[i]
                new = state[i]
                for j in range(c):
                    x = (ai * row[j] + bi * read[j]) + ki * v[h, t, j]
                    new[j] = x
                    o[j] += qi * x
            source = state


_KERNELS: dict[str, Callable[..., None]] = {
    "delta": delta_tokens,
    "linear": linear_tokens,
    "dplr": dplr_tokens,
}


@cache
def _numba() -> Any | None:
    """Numba, or ``None`` where it is not installed or ``POLYLIN_COMPILED=0`` (read once)."""
    if os.environ.get(ENVIRONMENT, "1").strip() == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


def compiled_available() -> bool:
    """Whether the compiled kernels run (Numba installed, ``POLYLIN_COMPILED`` not ``0``)."""
    return _numba() is not None


@cache
def kernel(name: str) -> Callable[..., None] | None:
    """The kernel ``name`` (``"delta"``, ``"linear"``, ``"dplr"``) compiled by Numba (no Python
    objects, the GIL released), or ``None`` where Numba is not there (:func:`compiled_available`).
    Each dtype compiles once per process, or once per machine where the cache folder is
    writable."""
    numba = _numba()
    if numba is None:
        return None
    return numba.njit(cache=True, nogil=True, fastmath={"contract"})(_KERNELS[name])


def _views(S: Any, arrays: list[Any]) -> list[Any] | None:
    """NumPy arrays sharing the memory of ``S`` and ``arrays``: NumPy arrays themselves, or
    PyTorch CPU tensors' views where no gradient is recorded (not traced by ``torch.compile``,
    not in a ``torch.func`` transform); all of one dtype, float32 or float64. ``None``
    otherwise."""
    numpy = loaded_numpy()
    if numpy is None:
        return None
    if type(S) is numpy.ndarray:
        if S.dtype.char not in "fd" or not all(
            type(x) is numpy.ndarray and x.dtype == S.dtype for x in arrays
        ):  # fmt: skip
            return None
        return [S, *arrays]
    if torch_namespace_of(S) is None:
        return None
    torch = torch_module()
    if (not S.is_cpu or S.dtype not in (torch.float32, torch.float64)
            or torch_transforming(S)):  # fmt: skip
        return None
    grad = torch.is_grad_enabled()
    views = []
    for x in (S, *arrays):
        if not (isinstance(x, torch.Tensor) and x.is_cpu and x.dtype == S.dtype):
            return None
        if x.requires_grad:
            if grad:
                return None
            x = x.detach()
        views.append(x.numpy())
    return views


def compiled_tokens(
    name: str, tokens: list[Any], decay: Any | None, S: Any, z: Any | None = None, *,
    step: bool,
) -> tuple[Any, ...] | None:
    """Kernel ``name`` (:func:`kernel`) over the per-token arrays ``tokens`` (in the kernel's
    order: ``q, k, v`` and ``beta`` or ``a, b``) and ``decay`` (``exp(g)``, or ``None``) from
    the state ``S`` ``(..., m, c)`` (and ``z`` ``(..., m)`` for ``"linear"``).

    For one token (``step``) the arrays are ``(..., width)``, else ``(..., T, width)`` (the
    decay's ``T`` may be 1: shared by the tokens); their leading dimensions broadcast to the
    state's. Returns, in the caller's library, ``(out, S_T)``, for ``"linear"`` ``(out, S_T,
    z_T, den)`` with the normalizers ``den`` ``(..., 1)`` or ``(..., T, 1)``; ``None`` where the
    kernels do not run: Numba missing or turned off, another library or device, a gradient to
    record, another dtype, or leading dimensions that do not broadcast to the state's."""
    if torch_namespace_of(S) is not None and compiling(S):  # traced: the graph's own ops
        return None
    run = kernel(name)
    if run is None:
        return None
    given = [*tokens] + [x for x in (decay, z) if x is not None]
    views = _views(S, given)
    if views is None or (z is not None and tuple(z.shape) != tuple(S.shape[:-1])):
        return None
    numpy: Any = loaded_numpy()  # imported: views were made
    lead = tuple(S.shape[:-2])
    T = 1 if step else tokens[0].shape[-2]
    n, (m, c), dtype = math.prod(lead), S.shape[-2:], views[0].dtype
    flat: list[Any] = []
    for x in views[1 : len(tokens) + 1 + (decay is not None)]:
        rows = T if len(flat) < len(tokens) or step else x.shape[-2]  # a decay may be shared
        want = lead if step else (*lead, rows)
        if x.shape[:-1] != want:
            if not _broadcasts(x.shape[:-1], want):
                return None
            x = numpy.broadcast_to(x, (*want, x.shape[-1]))
        flat.append(numpy.ascontiguousarray(x.reshape(n, 1 if step else rows, x.shape[-1])))
    if decay is None:
        flat.append(numpy.ones((1, 1, 1), dtype=dtype))
    flat.append(numpy.ascontiguousarray(views[0].reshape(n, m, c)))
    out, S_T = numpy.empty((n, T, c), dtype=dtype), numpy.empty((n, m, c), dtype=dtype)
    results = [out, S_T]
    if z is not None:
        results += [numpy.empty((n, m), dtype=dtype), numpy.empty((n, T, 1), dtype=dtype)]
        flat.append(numpy.ascontiguousarray(views[-1].reshape(n, m)))
    run(*flat, *results)
    per_token = lead if step else (*lead, T)
    shapes = [(*per_token, c), S.shape, (*lead, m), (*per_token, 1)]
    results = [x.reshape(shape) for x, shape in zip(results, shapes)]
    if views[0] is not S:  # PyTorch: tensors sharing the results' memory
        results = [torch_module().from_numpy(x) for x in results]
    return tuple(results)


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether the leading dimensions ``shape`` broadcast to ``to`` (never the other way)."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(shape[::-1], to[::-1]))
