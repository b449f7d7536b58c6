"""The layers of the hybrid models, once, in the array API: ``params`` + ``x`` -> ``y``, cache.

Each block is a function of a mapping of parameters (the torch module's state-dict names, as
arrays of any one library) and the input, with its decoding step and an initializer:

- :func:`gated_deltanet`, :func:`gated_deltanet_step`, :func:`init_gated_deltanet`: Gated
  DeltaNet (Qwen3-Next, Qwen3.5), :class:`polylin.torch.GatedDeltaNet`'s computation;
- :func:`kimi_delta_attention`, :func:`kimi_delta_attention_step`,
  :func:`init_kimi_delta_attention`: Kimi Delta Attention (Kimi Linear),
  :class:`polylin.torch.KimiDeltaAttention`'s computation;
- :func:`gated_linear_attention`, :func:`gated_linear_attention_step`,
  :func:`init_gated_linear_attention`: gated linear attention (GLA),
  :class:`polylin.torch.GatedLinearAttention`'s computation;
- :func:`mamba2`, :func:`mamba2_step`, :func:`init_mamba2`: Mamba-2's block (its SSD scan),
  :class:`polylin.torch.Mamba2`'s computation;
- :func:`rwkv7`, :func:`rwkv7_step`, :func:`init_rwkv7`: RWKV-7's time mixing,
  :class:`polylin.torch.RWKV7Attention`'s computation (with the value residual ``v_first``);
- :func:`mamba`, :func:`mamba_step`, :func:`init_mamba`: the Mamba-1 mixer (its selective
  scan), transformers' ``MambaMixer``'s computation (and FalconMamba's, ``bcdt_rms_eps``);
- :func:`mlstm`, :func:`mlstm_step`, :func:`init_mlstm`: xLSTM's mLSTM layer, transformers'
  ``xLSTMLayer``'s computation.

A cache is a :class:`BlockCache` of plain arrays (a pytree under ``jax.jit``). The results are
of the input's library, device and dtype: NumPy serves a model trained in PyTorch, JAX trains
one under ``jax.jit`` and ``jax.grad``.
"""

from ._params import BlockCache
from .gated_deltanet import gated_deltanet, gated_deltanet_step, init_gated_deltanet
from .gla import (
    gated_linear_attention,
    gated_linear_attention_step,
    init_gated_linear_attention,
)
from .kda import init_kimi_delta_attention, kimi_delta_attention, kimi_delta_attention_step
from .mamba import init_mamba, mamba, mamba_step
from .mamba2 import init_mamba2, mamba2, mamba2_step
from .mlstm import init_mlstm, mlstm, mlstm_step
from .rwkv7 import init_rwkv7, rwkv7, rwkv7_step

__all__ = [
    "BlockCache",
    "gated_deltanet",
    "gated_deltanet_step",
    "gated_linear_attention",
    "gated_linear_attention_step",
    "init_gated_deltanet",
    "init_gated_linear_attention",
    "init_kimi_delta_attention",
    "init_mamba",
    "init_mamba2",
    "init_mlstm",
    "init_rwkv7",
    "kimi_delta_attention",
    "kimi_delta_attention_step",
    "mamba",
    "mamba2",
    "mamba2_step",
    "mamba_step",
    "mlstm",
    "mlstm_step",
    "rwkv7",
    "rwkv7_step",
]
