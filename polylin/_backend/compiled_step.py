"""Decoding steps on the compiled kernels, prepared once per signature of their arrays.

:func:`~polylin._backend.compiled.compiled_tokens` finds out at every call what the arrays are:
their library and dtype, how they broadcast against the state and lie in memory. A decoding
loop calls a step with arrays of one signature (library, shape, dtype, device: what
``_inputs.steps`` keys its plans on) token after token, so :func:`compiled_step` finds that out
once, at the plan's first call, and each call of the :class:`CompiledStep` it returns pays the
NumPy views, the small operations around the kernel on them (the decay's exponential, the
scale, the normalization), the kernel and the wrapping of its results. PyTorch's own small
operations cost a few microseconds each where NumPy's cost one or two: a step of the gated
delta rule at 16 heads of 64 took 63 us this way against 135 us through the general path
(``docs/performance.md``, "Decoding").

This module imports no array library (rule 1 of ARCHITECTURE.md), as ``compiled``.
"""

from __future__ import annotations

import math
from typing import Any

from . import compiled
from .execution import compiling, torch_transforming
from .namespace import loaded_numpy, torch_module, torch_namespace_of

__all__ = ["CompiledStep", "compiled_step"]

#: ``l2_normalize``'s ``eps`` (``_backend.ops``): the same normalization, on NumPy views.
L2_EPS = 1e-6

#: The least bytes of states from which a step writes its new state and output at multiples
#: of 64 bytes (``compiled.aligned_empty``), so that the next step reads them so too: above a
#: core's L2 cache the state's passes dominate the step (Zen 4, one thread: the gated delta rule
#: at 32 x 128, 2 MiB, 0.89-0.92x the time; Mamba-2's scan, 1.5 MiB, 0.85-0.95x), below it the
#: alignment's 2-4 us are not won back (16 x 64 x 64: 1.08x).
ALIGNED_STEP_BYTES = 1 << 20


def compiled_step(
    name: str,
    tokens: list[Any],
    decay: Any | None,
    S: Any,
    z: Any | None = None,
    *,
    log: bool,
    scale: float = 1.0,
    scale_output: bool = False,
    l2norm: bool = False,
    eps: float | None = None,
) -> CompiledStep | None:
    """Kernel ``name``'s step for arrays of the signature of ``tokens``, ``decay``, ``S`` (and
    ``z``), as a step's plan sees them at its first call; ``None`` where the kernels do not run
    on them (see ``compiled_tokens``: Numba missing or turned off, another library or device,
    another dtype, per-token arrays that do not broadcast to the state's leading dimensions).

    ``tokens`` are the kernel's per-token arrays ``(..., width)`` (``q, k, v`` and ``beta`` or
    ``a, b``), ``S`` ``(..., m, c)`` the state, ``z`` ``(..., m)`` linear attention's
    normalizer state. ``decay``: the log decay ``g`` of the step where ``log`` (its values
    above 0 taken as 0, then ``exp``), else the decay factor itself, or ``None`` (no decay).
    Then, in this order: ``l2norm`` normalizes ``q`` and ``k``; ``scale`` multiplies ``q``, or
    the output where ``scale_output``; ``eps`` (``"linear"`` only) divides the output by its
    normalizer plus ``eps``, where it is not ``None``.
    """
    if compiling(S) or compiled.kernel(name) is None:
        return None
    numpy = loaded_numpy()
    given = [*tokens, S] + [x for x in (decay, z) if x is not None]
    if numpy is not None and type(S) is numpy.ndarray:
        tensors = False
        if not all(type(x) is numpy.ndarray for x in given):
            return None
        dtypes = {x.dtype for x in given}
    else:
        torch = torch_module() if torch_namespace_of(S) is not None else None
        if torch is None or not all(isinstance(x, torch.Tensor) for x in given):
            return None
        if not all(x.device.type == "cpu" for x in given):
            return None
        tensors, dtypes = True, {x.dtype for x in given}
        try:  # the tensor's library imports NumPy for its view
            S.detach().numpy()
        except (RuntimeError, TypeError):
            return None
        numpy = loaded_numpy()
    if numpy is None:
        return None
    dtype = next(iter(dtypes))
    if len(dtypes) != 1 or str(dtype).rpartition(".")[2] not in ("float32", "float64"):
        return None
    lead = tuple(S.shape[:-2])
    shapes = [_token_shape(tuple(x.shape), lead) for x in tokens]
    decay_shape = None if decay is None else _token_shape(tuple(decay.shape), lead, shared=True)
    if None in shapes or (decay is not None and decay_shape is None):
        return None
    if z is not None and tuple(z.shape) != tuple(S.shape[:-1]):
        return None
    return CompiledStep(
        numpy, name, tensors, lead, tuple(S.shape[-2:]), shapes, decay_shape,
        log=log, scale=scale, scale_output=scale_output, l2norm=l2norm, eps=eps,
        linear=z is not None, dtype=numpy.dtype(str(dtype).rpartition(".")[2]),
    )  # fmt: skip


def _token_shape(shape: tuple, lead: tuple, *, shared: bool = False) -> tuple | None:
    """How the kernels read a per-token array of ``shape`` for states of leading dimensions
    ``lead``: ``(shape to broadcast to or None, 4-D shape)``; a decay shared by every state
    (``shared``, leading sizes all 1) stays one row. ``None`` where it does not broadcast."""
    if not shape:
        return None
    within, width = shape[:-1], shape[-1]
    if not compiled.broadcasts(within, lead):
        return None
    n = math.prod(lead)
    if within == lead:
        return (None, (n, 1, 1, width))
    if shared and math.prod(within) == 1:
        return (None, (1, 1, 1, width))
    return ((*lead, width), (n, 1, 1, width))


class CompiledStep:
    """One decoding step on a compiled kernel, for the arrays of one signature
    (:func:`compiled_step`). Called with the step's arrays as :func:`compiled_step` was, it
    returns the new ``(out, S)`` (``"linear"``: ``(out, S, z)``) in their library, or ``None``
    where a call cannot run on the kernel after all (a tensor that records a gradient, one seen
    by ``torch.func`` or ``torch.compile``): the caller's general path runs then."""

    __slots__ = (
        "_decay_shape", "_dtype", "_empty", "_eps", "_l2norm", "_lead", "_linear", "_log",
        "_name", "_numpy", "_ones", "_scale", "_scale_output", "_shapes", "_state", "_tensors",
    )  # fmt: skip

    def __init__(
        self, numpy: Any, name: str, tensors: bool, lead: tuple,
        state: tuple, shapes: list, decay_shape: tuple | None, *, log: bool, scale: float,
        scale_output: bool, l2norm: bool, eps: float | None, linear: bool, dtype: Any,
    ) -> None:  # fmt: skip
        self._numpy, self._name, self._tensors, self._lead = numpy, name, tensors, lead
        self._state, self._shapes, self._decay_shape = state, shapes, decay_shape
        self._log, self._scale, self._scale_output = log, float(scale), scale_output
        self._l2norm, self._eps, self._linear, self._dtype = l2norm, eps, linear, dtype
        self._ones = numpy.ones((1, 1, 1, 1), dtype=dtype)
        size = math.prod(lead) * math.prod(state) * numpy.dtype(dtype).itemsize
        self._empty = compiled.aligned_empty if size >= ALIGNED_STEP_BYTES else _empty

    def __call__(
        self, tokens: list[Any], decay: Any | None, S: Any, z: Any | None = None
    ) -> tuple[Any, ...] | None:
        numpy, run = self._numpy, compiled.kernel(self._name)  # cached: looked up, not built
        if run is None:
            return None
        given = [*tokens, S] + [x for x in (decay, z) if x is not None]
        if self._tensors:
            if torch_transforming(S) or compiling(S):
                return None
            try:  # raises where a gradient is required
                given = [x.numpy() for x in given]
            except (RuntimeError, TypeError):
                return None
        flat = [self._read(x, shape) for x, shape in zip(given, self._shapes)]
        if self._l2norm:
            flat[0], flat[1] = (
                x / numpy.sqrt(numpy.sum(x * x, axis=-1, keepdims=True) + L2_EPS)
                for x in flat[:2]
            )
        if self._scale != 1.0 and not self._scale_output:
            flat[0] = flat[0] * self._scale
        flat.append(self._decay(given[len(tokens) + 1]) if decay is not None else self._ones)
        n, (m, c), dtype = math.prod(self._lead), self._state, self._dtype
        flat.append(numpy.ascontiguousarray(given[len(tokens)].reshape(n, m, c)))
        results = [self._empty(numpy, (n, 1, 1, c), dtype), self._empty(numpy, (n, m, c), dtype)]
        if self._linear:
            flat.append(numpy.ascontiguousarray(given[-1].reshape(n, m)))
            den = None if self._eps is None else numpy.empty((n, 1, 1, 1), dtype=dtype)
            results += [numpy.empty((n, m), dtype=dtype), den]  # no normalizers: none computed
        run(*flat, *results, 1, 0, n)  # one token: the states one by one
        out = results[0]
        if self._scale != 1.0 and self._scale_output:
            out *= self._scale
        if self._eps is not None:  # linear attention's normalization
            den = results[3]
            den += self._eps
            out /= den
        done = [out.reshape(*self._lead, c), results[1].reshape(*self._lead, m, c)]
        if self._linear:
            done.append(results[2].reshape(*self._lead, m))
        if self._tensors:
            from_numpy = torch_module().from_numpy
            return tuple(from_numpy(x) for x in done)
        return tuple(done)

    def _read(self, x: Any, shape: tuple) -> Any:
        """``x`` as the kernels read it: C-contiguous ``(n or 1, 1, 1, width)``."""
        broadcast, flat = shape
        if broadcast is not None:
            x = self._numpy.broadcast_to(x, broadcast)
        return self._numpy.ascontiguousarray(x.reshape(flat))

    def _decay(self, x: Any) -> Any:
        """The decay factors as the kernels read them: ``exp(min(g, 0))`` of a log decay
        (``compiled.decay_factors``: one compiled pass in float32)."""
        x = self._read(x, self._decay_shape)  # type: ignore[arg-type]
        return compiled.decay_factors(x) if self._log else x


def _empty(numpy: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``numpy.empty``, called as ``compiled.aligned_empty``."""
    return numpy.empty(shape, dtype=dtype)
