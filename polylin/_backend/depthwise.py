"""The taps of a depthwise causal convolution: the array-API form, and PyTorch's own kernel.

:func:`causal_taps` sums ``width`` shifted views of one padded array, each times its tap. The
array-API form is a product and ``width - 1`` multiply-adds over the whole sequence (PyTorch's
``addcmul``: one pass each). On PyTorch's CPU, in float32 where no gradient is recorded
(prefill, inference), the same sum is one call of PyTorch's depthwise convolution, which reads
the channels-last layout of the sequence as it is (oneDNN's kernel: one pass over the input).
SSM_CONV's shape, 3328 channels, T = 512, width 4: 0.06 / 0.08 of ggml's time on one / two
threads against 0.42 / 0.68 as products (``benchmarks/ggml_ops.py``), equal to the last bit
without a bias; 0.17-0.59x the products' time from 32768 outputs up (one thread,
``benchmarks/short_conv.py``). With a gradient to record, conv2d's forward and backward took
1.0-2.8x the products' (``--backward``), in float64, where PyTorch has no such kernel, 3.9x and
more, and below about 16384 outputs its fixed cost (about 30 us) is more than the products
take: the products run there, as on every other library and device.
"""

from __future__ import annotations

import math
from typing import Any

from .execution import compiling, records_gradient, torch_transforming
from .namespace import torch_module, torch_namespace_of
from .ops import add_scaled

__all__ = ["NATIVE_MIN_VALUES", "causal_taps", "convolved_taps"]

#: The fewest output values (batch x T x channels) from which PyTorch's convolution runs the
#: taps: its call costs about 30 us whatever the size, the array-API form's four operations
#: 15 us and 1.7 ns per value (one thread, width 4: 3328 values 25 against 41 us with the
#: state's concatenation, 16384 42 against 32 us without, 32768 78 against 46 us with it).
NATIVE_MIN_VALUES = 16384


def causal_taps(xp: Any, ext: Any, weight: Any, bias: Any | None, length: int) -> Any:
    """``sum_i ext[..., i : i + length, :] * weight[:, i]`` (plus ``bias``) for ``ext``
    ``(..., length + width - 1, channels)`` and ``weight`` ``(channels, width)``: the output
    ``(..., length, channels)`` of a depthwise causal convolution whose inputs before the
    sequence lead ``ext``. PyTorch's own convolution where it applies (module docstring)."""
    native = _native_taps(ext, weight, bias, length)
    if native is not None:
        return native
    first = ext[..., 0:length, :]
    # Each tap's product added in one pass (PyTorch's addcmul: SSM_CONV's shape 0.68x / 0.72x
    # the forward time of a product and a sum per tap on one / two threads).
    out = first * weight[:, 0] if bias is None else add_scaled(xp, bias, first, weight[:, 0])
    for i in range(1, weight.shape[1]):
        out = add_scaled(xp, out, ext[..., i : i + length, :], weight[:, i])
    return out


def _native_taps(ext: Any, weight: Any, bias: Any | None, length: int) -> Any | None:
    """:func:`causal_taps` by PyTorch's depthwise convolution on the CPU (float32, eager, no
    gradient to record, at least :data:`NATIVE_MIN_VALUES` outputs, oneDNN enabled), else
    ``None``."""
    if torch_namespace_of(ext) is None:
        return None
    torch = torch_module()
    *lead, _, channels = ext.shape
    width = weight.shape[1]
    given = [ext, weight] + ([] if bias is None else [bias])
    if (width < 2 or math.prod(lead) * length * channels < NATIVE_MIN_VALUES
            or ext.device.type != "cpu" or any(x.dtype != torch.float32 for x in given)
            or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
            or compiling(ext) or torch_transforming(ext)
            or records_gradient(*given)):  # fmt: skip
        return None
    return convolved_taps(ext, weight, bias, length)


def convolved_taps(ext: Any, weight: Any, bias: Any | None, length: int) -> Any:
    """:func:`causal_taps` as one call of PyTorch's depthwise ``conv2d``, whatever the dtype,
    device or gradient (:func:`causal_taps` calls it where it is the faster;
    ``benchmarks/short_conv.py`` times it everywhere)."""
    *lead, rows, channels = ext.shape
    width = weight.shape[1]
    # (batch, channels, 1, rows) with the channels varying fastest: the channels-last layout of
    # a 2-d convolution, which the kernel reads without a copy; its output is laid out alike.
    image = ext.reshape(-1, rows, channels).transpose(1, 2)[:, :, None, :]
    taps = weight.reshape(channels, 1, 1, width)
    out = torch_module().nn.functional.conv2d(image, taps, bias, groups=channels)
    return out[:, :, 0, :].transpose(1, 2).reshape(*lead, length, channels)
