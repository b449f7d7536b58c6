"""PyTorch autograd registration of :func:`polylin.feature_maps.elu_plus_one`.

The array-API form ``exp(min(x, 0)) + max(x, 0)`` is exact on every backend, but PyTorch's
autograd keeps the output of ``exp`` for the backward: an extra array the size of the queries
and of the keys for the whole forward+backward, 32 MiB of the 113 MiB a chunked training step
at T = 65536 (one head, d = 64, float32) saved before this function existed
(``docs/performance.md``, "Training"). This function keeps only its input, which the caller
holds anyway, and recomputes the exponential in the backward. Same values to the bit (the same
``exp`` of the same ``min(x, 0)``), the same derivative (``exp(min(x, 0))``, 1 at ``x = 0``),
differentiable twice, with forward-mode and ``vmap`` rules, traceable by ``torch.compile``.

The core reaches it only through :func:`polylin._backend.ops.native_elu_plus_one`, for
tensors of an already imported torch. This module imports no array library (rule 1 of
``ARCHITECTURE.md``): the autograd class is built once, at the first call, from the torch that
made the tensor (:func:`polylin._backend.namespace.torch_module`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from .namespace import torch_module

__all__ = ["elu_plus_one"]


def _forward(torch: Any, x: Any) -> Any:
    """``exp(min(x, 0)) + max(x, 0)``: the array-API form's values, to the bit."""
    return torch.exp(torch.clamp(x, max=0.0)) + torch.clamp(x, min=0.0)


@cache
def _function(torch: Any) -> Any:
    """The ``torch.autograd.Function`` of ``elu(x) + 1`` that saves only ``x`` (one per torch
    module, built at the first call with a gradient)."""

    class EluPlusOne(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x: Any) -> Any:
            return _forward(torch, x)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any], output: Any) -> None:
            (x,) = inputs
            ctx.save_for_backward(x)
            ctx.save_for_forward(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (x,) = ctx.saved_tensors
            return grad * torch.exp(torch.clamp(x, max=0.0))

        @staticmethod
        def jvp(ctx: Any, tangent: Any) -> Any:
            (x,) = ctx.saved_tensors
            return tangent * torch.exp(torch.clamp(x, max=0.0))

    return EluPlusOne


def elu_plus_one(x: Any) -> Any:
    """``elu(x) + 1`` of a tensor; the backward keeps ``x`` only.

    Without a backward to save for (no gradient required, as in decoding), the forward's plain
    operations run directly: the same values, without ``autograd.Function``'s dispatch (about
    100 us a call on the CPU, more than a decoding step's arithmetic).
    """
    torch = torch_module()
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _forward(torch, x)
    return _function(torch).apply(x)
