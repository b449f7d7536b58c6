"""The layers of the hybrid models, once, in the array API: ``params`` + ``x`` -> ``y``, cache.

Each block is a function of a mapping of parameters (the torch module's state-dict names, as
arrays of any one library) and the input, with its decoding step and an initializer:

- :func:`gated_deltanet`, :func:`gated_deltanet_step`, :func:`init_gated_deltanet`: Gated
  DeltaNet (Qwen3-Next, Qwen3.5), :class:`polylin.torch.GatedDeltaNet`'s computation;
- :func:`kimi_delta_attention`, :func:`kimi_delta_attention_step`,
  :func:`init_kimi_delta_attention`: Kimi Delta Attention (Kimi Linear),
  :class:`polylin.torch.KimiDeltaAttention`'s computation.

A cache is a :class:`BlockCache` of plain arrays (a pytree under ``jax.jit``). The results are
of the input's library, device and dtype: NumPy serves a model trained in PyTorch, JAX trains
one under ``jax.jit`` and ``jax.grad``.
"""

from ._params import BlockCache
from .gated_deltanet import gated_deltanet, gated_deltanet_step, init_gated_deltanet
from .kda import init_kimi_delta_attention, kimi_delta_attention, kimi_delta_attention_step

__all__ = [
    "BlockCache",
    "gated_deltanet",
    "gated_deltanet_step",
    "init_gated_deltanet",
    "init_kimi_delta_attention",
    "kimi_delta_attention",
    "kimi_delta_attention_step",
]
