"""The taps of a depthwise causal convolution: the array-API form, and PyTorch's own kernel.

:func:`causal_taps` sums ``width`` shifted views of one padded array, each times its tap. The
array-API form is a product and ``width - 1`` multiply-adds over the whole sequence (PyTorch's
``addcmul``: one pass each). On PyTorch's CPU in float32 the same sum is one call of PyTorch's
depthwise convolution (:func:`kernel_taps`), which reads the channels-last layout of the
sequence as it is (oneDNN's kernel: one pass over the input), and where a gradient is recorded
its backward is a convolution too (the outputs' gradient with the taps reversed) and one
product and sum per tap for the taps' gradient. SSM_CONV's shape, 3328 channels, T = 512,
width 4: 0.06 / 0.08 of ggml's time on one / two threads against 0.42 / 0.68 as products
(``benchmarks/ggml_ops.py``), equal to the last bit without a bias; from 32768 outputs up
0.19-0.62x the products' forward time and, from 131072 up, 0.35-0.87x their forward and
backward time (one thread, ``benchmarks/short_conv.py``; ``conv2d``'s own backward took
1.0-2.8x). Below :data:`NATIVE_MIN_VALUES` outputs (:data:`GRADIENT_MIN_VALUES` with a
gradient) the kernel's fixed cost is more than the products take, and in float64, which oneDNN
does not cover, it is 2.8-89x slower: the products run there, as on every other library and
device, under ``torch.compile`` (whose compiler fuses them) and inside ``torch.func``
transforms.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from .execution import compiling, records_gradient, torch_transforming
from .namespace import torch_module, torch_namespace_of
from .ops import add_scaled

__all__ = ["GRADIENT_MIN_VALUES", "NATIVE_MIN_VALUES", "causal_taps", "kernel_taps"]

#: The fewest output values (batch x T x channels) from which PyTorch's convolution runs the
#: taps: its call costs about 30 us whatever the size, the array-API form's four operations
#: 15 us and 1.7 ns per value (one thread, width 4: 3328 values 25 against 41 us with the
#: state's concatenation, 16384 42 against 32 us without, 32768 78 against 46 us with it).
NATIVE_MIN_VALUES = 16384

#: The same where a gradient is recorded: there ``autograd.Function``'s own cost comes on top
#: (width 4, one thread, two runs: at 32768 values 1.02-1.06x the products' forward and
#: backward time, at 131072 0.69-0.72x).
GRADIENT_MIN_VALUES = 65536


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
    """:func:`causal_taps` by :func:`kernel_taps` on PyTorch's CPU (float32, eager, outside
    ``torch.func`` transforms, at least :data:`NATIVE_MIN_VALUES` outputs or, with a gradient to
    record, :data:`GRADIENT_MIN_VALUES`, oneDNN enabled), else ``None``."""
    if torch_namespace_of(ext) is None:
        return None
    torch = torch_module()
    *lead, _, channels = ext.shape
    given = [ext, weight] + ([] if bias is None else [bias])
    least = GRADIENT_MIN_VALUES if records_gradient(*given) else NATIVE_MIN_VALUES
    if (weight.shape[1] < 2 or math.prod(lead) * length * channels < least
            or ext.device.type != "cpu" or any(x.dtype != torch.float32 for x in given)
            or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
            or compiling(ext) or torch_transforming(ext)):  # fmt: skip
        return None
    return kernel_taps(ext, weight, bias)


def kernel_taps(ext: Any, weight: Any, bias: Any | None) -> Any:
    """:func:`causal_taps` by PyTorch's depthwise convolution, whatever the dtype or device
    (:func:`causal_taps` calls it where it is the faster; ``benchmarks/short_conv.py`` times it
    everywhere). Where a gradient is recorded, through :func:`_taps_function`: the gradient of
    the inputs is the same convolution of the outputs' gradient with the taps reversed, the
    taps' gradient one product and sum per tap (``conv2d``'s own backward took 1.0-2.8x the
    products' time for both)."""
    torch = torch_module()
    given = [ext, weight] + ([] if bias is None else [bias])
    if torch.is_grad_enabled() and any(x.requires_grad for x in given):
        return _taps_function(torch).apply(ext, weight, bias)
    return _convolved(torch, ext, weight, bias)


def _convolved(torch: Any, ext: Any, weight: Any, bias: Any | None, padding: int = 0) -> Any:
    """The depthwise correlation of ``ext`` ``(..., rows, channels)`` with ``weight``
    ``(channels, width)`` (``padding`` zeros before and after the rows), plus ``bias``:
    ``(..., rows + 2 padding - width + 1, channels)``, one ``conv2d`` call."""
    *lead, rows, channels = ext.shape
    width = weight.shape[1]
    # (batch, channels, 1, rows) with the channels varying fastest: the channels-last layout of
    # a 2-d convolution, which the kernel reads without a copy; its output is laid out alike.
    image = ext.reshape(-1, rows, channels).transpose(1, 2)[:, :, None, :]
    taps = weight.reshape(channels, 1, 1, width)
    out = torch.nn.functional.conv2d(image, taps, bias, groups=channels, padding=(0, padding))
    return out[:, :, 0, :].transpose(1, 2).reshape(*lead, out.shape[-1], channels)


@cache
def _taps_function(torch: Any) -> Any:
    """The ``torch.autograd.Function`` of :func:`kernel_taps` with a gradient (one per torch
    module, built at the first call). Its backward and forward-mode rule are convolutions,
    products and sums, so that they differentiate again."""

    class DepthwiseTaps(torch.autograd.Function):
        @staticmethod
        def forward(ext: Any, weight: Any, bias: Any | None) -> Any:
            return _convolved(torch, ext, weight, bias)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, Any, Any], output: Any) -> None:
            ext, weight, _ = inputs
            ctx.save_for_backward(ext, weight)
            ctx.save_for_forward(ext, weight)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, Any, Any]:
            ext, weight = ctx.saved_tensors
            width, (length, channels) = weight.shape[1], grad.shape[-2:]
            grad_ext = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:  # sum_i grad[t - i] w_i: the taps reversed, zero-padded
                grad_ext = _convolved(torch, grad, weight.flip(1), None, width - 1)
            if ctx.needs_input_grad[1]:
                rows = ext.reshape(-1, ext.shape[-2], channels)
                flat = grad.reshape(-1, length, channels)
                grad_weight = torch.stack(
                    [(rows[:, i : i + length] * flat).sum((0, 1)) for i in range(width)], dim=1
                )
            if ctx.needs_input_grad[2]:
                grad_bias = grad.reshape(-1, channels).sum(0)
            return grad_ext, grad_weight, grad_bias

        @staticmethod
        def jvp(ctx: Any, ext_t: Any, weight_t: Any, bias_t: Any) -> Any:
            ext, weight = ctx.saved_tensors
            terms = [] if bias_t is None else [bias_t]
            if ext_t is not None:
                terms.append(_convolved(torch, ext_t, weight, None))
            if weight_t is not None:
                terms.append(_convolved(torch, ext, weight_t, None))
            return sum(terms[1:], terms[0])

    return DepthwiseTaps
