"""polylin: linear (kernelized, softmax-free) attention on any array-API library.

One implementation, written against the Python array API standard, runs unchanged on NumPy,
PyTorch, CuPy, JAX, Dask and array-api-strict, and returns arrays of the caller's library, device
and dtype.
"""

from . import activations, feature_maps
from ._inputs.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_DPLR_CHUNK_SIZE, DEFAULT_EPS
from ._inputs.state import LinearAttentionState
from ._inputs.steps import PreparedStep
from .attention import METHODS, causal_linear_attention, linear_attention, masked_kernel_attention
from .convolution import causal_conv1d, causal_conv1d_step
from .decoding import prepare_step, step
from .delta_rule import (
    DELTA_METHODS,
    delta_rule_attention,
    delta_rule_step,
    prepare_delta_rule_step,
)
from .dplr import DPLR_METHODS, dplr_delta_rule, dplr_delta_rule_step, prepare_dplr_step
from .linear_scan import linear_scan, linear_scan_step, rg_lru, rg_lru_step
from .mlstm import MLSTMState, mlstm, mlstm_step, prepare_mlstm_step
from .normalization import group_norm, rms_norm
from .selective_scan import prepare_selective_scan_step, selective_scan, selective_scan_step

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_DPLR_CHUNK_SIZE",
    "DEFAULT_EPS",
    "DELTA_METHODS",
    "DPLR_METHODS",
    "METHODS",
    "LinearAttentionState",
    "MLSTMState",
    "PreparedStep",
    "__version__",
    "activations",
    "causal_conv1d",
    "causal_conv1d_step",
    "causal_linear_attention",
    "delta_rule_attention",
    "delta_rule_step",
    "dplr_delta_rule",
    "dplr_delta_rule_step",
    "feature_maps",
    "group_norm",
    "linear_attention",
    "linear_scan",
    "linear_scan_step",
    "masked_kernel_attention",
    "mlstm",
    "mlstm_step",
    "prepare_delta_rule_step",
    "prepare_dplr_step",
    "prepare_mlstm_step",
    "prepare_selective_scan_step",
    "prepare_step",
    "rg_lru",
    "rg_lru_step",
    "rms_norm",
    "selective_scan",
    "selective_scan_step",
    "step",
]
