"""PyTorch layers on top of polylin's functions (this subpackage imports torch; the core does not).

- :class:`LinearAttention`: multi-head linear attention, a drop-in for softmax self-attention.
- :class:`GatedDeltaNet`, :class:`KimiDeltaAttention`, :class:`GatedLinearAttention`,
  :class:`Mamba2`: the blocks of those models (projections, short convolutions, gates, the
  output norm), with the options and parameter names of ``fla.layers``;
  :class:`RWKV7Attention`: RWKV-7's time mixing, likewise.

Every layer trains with ``forward`` and decodes one token at a time with ``step``; the blocks
keep a :class:`LayerCache` (convolution states and the recurrent state) between calls. Every
number comes from polylin's functions, so NumPy can serve the same weights.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("polylin.torch needs PyTorch: pip install 'polylin[torch]'") from exc

from .. import activations
from ._blocks import LayerCache, RMSNorm, ShortConvolution
from .gated_deltanet import GatedDeltaNet
from .gla import GatedLinearAttention
from .kda import KimiDeltaAttention
from .linear_attention import LinearAttention
from .mamba2 import Mamba2
from .rwkv7 import RWKV7Attention

# polylin may have been imported before torch: its first call with a tensor resolves torch's
# array-API namespace. Made here, eagerly, so that no call traced by torch.compile is the first
# (the trace would see the core's module globals change and compile the function twice).
activations.silu(torch.zeros(()))

__all__ = [
    "GatedDeltaNet",
    "GatedLinearAttention",
    "KimiDeltaAttention",
    "LayerCache",
    "LinearAttention",
    "Mamba2",
    "RMSNorm",
    "RWKV7Attention",
    "ShortConvolution",
]
