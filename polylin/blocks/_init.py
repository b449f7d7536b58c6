"""Random initial parameters for the blocks, on any array library, without one to draw them.

The core imports no array library, so the draws come from Python's ``random`` (a Mersenne
Twister seeded once per call) and become arrays of the caller's namespace. The distributions
are the torch modules' (``torch.nn.Linear``'s and ``torch.nn.Conv1d``'s defaults, Mamba's
``A_log`` and ``dt_bias``, ``torch.nn.init.orthogonal_``); the values differ from torch's draws.
"""

from __future__ import annotations

import array
import math
import random
from typing import Any

from ..interop import array_namespace

__all__ = ["Draws"]


class Draws:
    """Arrays of one namespace, dtype and device, drawn from one seeded generator."""

    def __init__(self, xp: Any, *, seed: int, dtype: Any, device: Any) -> None:
        # The library's module as a caller names it (``torch``, ``numpy``, ``jax.numpy``):
        # its array-API namespace is that of an array it makes.
        self.xp = array_namespace(xp.zeros((1,), device=device))
        self.rng = random.Random(seed)
        self.dtype = self.xp.float32 if dtype is None else dtype
        self.device = device

    def _array(self, values: list[float], shape: tuple[int, ...]) -> Any:
        x = self.xp.asarray(values, dtype=self.dtype, device=self.device)
        return self.xp.reshape(x, shape)

    def uniform(self, shape: tuple[int, ...], low: float, high: float) -> Any:
        """Uniform in ``[low, high)``."""
        uniform = self.rng.uniform
        return self._array([uniform(low, high) for _ in range(math.prod(shape))], shape)

    def linear(self, out_features: int, in_features: int) -> Any:
        """A ``torch.nn.Linear`` weight ``(out, in)``: uniform within ``1 / sqrt(in)``."""
        bound = 1 / math.sqrt(in_features)
        return self.uniform((out_features, in_features), -bound, bound)

    def conv(self, channels: int, width: int) -> Any:
        """A depthwise ``torch.nn.Conv1d`` weight ``(channels, 1, width)``."""
        bound = 1 / math.sqrt(width)
        return self.uniform((channels, 1, width), -bound, bound)

    def bias(self, size: int, fan_in: int) -> Any:
        """A ``torch.nn.Linear`` or ``Conv1d`` bias: uniform within ``1 / sqrt(fan_in)``."""
        bound = 1 / math.sqrt(fan_in)
        return self.uniform((size,), -bound, bound)

    def ones(self, size: int) -> Any:
        """``(size,)`` ones (a norm's weight)."""
        return self.xp.ones((size,), dtype=self.dtype, device=self.device)

    def zeros(self, size: int) -> Any:
        """``(size,)`` zeros."""
        return self.xp.zeros((size,), dtype=self.dtype, device=self.device)

    def log_uniform(self, size: int, low: float, high: float) -> Any:
        """``log`` of a uniform draw in ``[low, high)`` (Mamba's ``A_log``; a draw of exactly
        0 is taken as the smallest positive float)."""
        uniform = self.rng.uniform
        draws = [max(uniform(low, high), 5e-324) for _ in range(size)]
        return self._array([math.log(u) for u in draws], (size,))

    def dt_bias(
        self, size: int, *, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4
    ) -> Any:
        """``softplus^-1(dt)`` for ``dt`` log-uniform in ``[dt_min, dt_max]``, floored."""
        values = []
        for _ in range(size):
            dt = max(math.exp(self.rng.uniform(math.log(dt_min), math.log(dt_max))), floor)
            values.append(dt + math.log(-math.expm1(-dt)))
        return self._array(values, (size,))

    def uniform_bulk(self, shape: tuple[int, ...], low: float, high: float) -> Any:
        """Uniform in ``[low, high)`` with 24 random bits each, made by the namespace from the
        generator's bytes (read as native int32: the same values on every little-endian
        machine); no Python number per draw, unlike :meth:`uniform`, and other values."""
        words = array.array("i", self.rng.randbytes(4 * math.prod(shape)))
        if words.itemsize != 4:  # pragma: no cover - 'i' is 4 bytes on every platform we know
            raise RuntimeError("uniform_bulk needs 4-byte C ints")
        ints = self.xp.asarray(memoryview(words), dtype=self.xp.int32, device=self.device)
        ints = self.xp.bitwise_right_shift(ints, 8) + 2**23  # in [0, 2**24): exact in float32
        work = self.dtype if self.dtype == self.xp.float64 else self.xp.float32
        u = self.xp.astype(ints, work) * 2.0**-24
        return self.xp.reshape(self.xp.astype(low + (high - low) * u, self.dtype), shape)

    def normal_bulk(self, shape: tuple[int, ...]) -> Any:
        """Standard normal draws (Box-Muller on two :meth:`uniform_bulk` draws)."""
        u1 = 1.0 - self.uniform_bulk(shape, 0.0, 1.0)  # in (0, 1]
        u2 = self.uniform_bulk(shape, 0.0, 1.0)
        return self.xp.sqrt(-2.0 * self.xp.log(u1)) * self.xp.cos((2 * math.pi) * u2)

    def orthogonal(self, rows: int, cols: int, *, gain: float = 1.0) -> Any:
        """A ``(rows, cols)`` weight with orthonormal rows or columns, times ``gain``
        (``torch.nn.init.orthogonal_``: the Q of a Gaussian matrix's QR, signs fixed by R's
        diagonal; the namespace's ``linalg.qr``)."""
        x = self.normal_bulk((max(rows, cols), min(rows, cols)))
        q, r = self.xp.linalg.qr(x)
        diagonal = self.xp.linalg.diagonal(r) if hasattr(self.xp.linalg, "diagonal") else None
        if diagonal is None:  # pragma: no cover - every namespace polylin supports has it
            diagonal = self.xp.sum(r * self.xp.eye(r.shape[0], dtype=r.dtype), axis=0)
        q = self.xp.where(diagonal < 0, -q, q)
        if rows < cols:
            q = self.xp.matrix_transpose(q)
        return q * gain
