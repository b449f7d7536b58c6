"""Flax NNX layers on :mod:`polylin.blocks` (this subpackage imports JAX and Flax; the core
does not).

- :class:`GatedDeltaNet`, :class:`KimiDeltaAttention`, :class:`GatedLinearAttention`,
  :class:`Mamba2`, :class:`RWKV7Attention`: the blocks of those models, with the keywords,
  call and parameter names of :mod:`polylin.torch`'s (and ``fla.layers``');
- :class:`Mamba`, :class:`MLSTM`: the Mamba-1 mixer and xLSTM's mLSTM layer, with the
  keywords of transformers' configs and the parameter names of its ``MambaMixer`` and
  ``xLSTMLayer``.

Each holds its parameters as ``nnx.Param``s keyed by the torch module's state-dict names and
computes with the block's functions of :mod:`polylin.blocks`: a torch state dict loads by name
(``from_torch_state_dict``, ``load_state_dict``) and gives the torch module's numbers;
``state_dict()`` gives the weights back for NumPy or PyTorch to serve. ``layer(x,
attention_mask=None, cache=None, return_cache=False)`` trains and prefills under ``nnx.jit``
and ``nnx.grad``; ``layer.step(x_t, cache)`` decodes one token, with a
:class:`polylin.blocks.BlockCache`.
"""

from __future__ import annotations

try:
    import flax.nnx  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without flax
    raise ImportError("polylin.flax needs Flax: pip install 'polylin[flax]'") from exc

from .gated_deltanet import GatedDeltaNet
from .gla import GatedLinearAttention
from .kda import KimiDeltaAttention
from .mamba import Mamba
from .mamba2 import Mamba2
from .mlstm import MLSTM
from .rwkv7 import RWKV7Attention

__all__ = [
    "MLSTM",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "KimiDeltaAttention",
    "Mamba",
    "Mamba2",
    "RWKV7Attention",
]
