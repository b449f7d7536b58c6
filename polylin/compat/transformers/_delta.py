"""Gated DeltaNet and KDA layers: transformers' kernel names bound to polylin.compat.fla.

The short causal convolution these layers apply to their projections is rebound too
(``causal_conv1d_fn``, ``causal_conv1d_update``: ``_short_conv.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import fla
from ._rebind import by_rebinding
from ._registry import Conversion
from ._short_conv import CONV_KERNELS


def _kernel(twin: Callable[..., Any], *, chunked: bool) -> Callable[..., Any]:
    """transformers' kernel signature (``torch_chunk_gated_delta_rule`` and its kin) on ``twin``."""

    def kernel(
        query: Any,
        key: Any,
        value: Any,
        g: Any,
        beta: Any,
        chunk_size: int = 64,
        initial_state: Any = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        # Other keywords are the model's own (attention kwargs): transformers drops them too.
        options = {"chunk_size": chunk_size} if chunked else {}
        return twin(
            query, key, value, g=g, beta=beta, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, **options,
        )  # fmt: skip

    kernel.__name__ = kernel.__qualname__ = f"polylin_{twin.__name__}"
    return kernel


_GATED_DELTA: dict[str, Callable[..., Any]] = {
    **CONV_KERNELS,
    "torch_chunk_gated_delta_rule": _kernel(fla.chunk_gated_delta_rule, chunked=True),
    "torch_recurrent_gated_delta_rule": _kernel(
        fla.fused_recurrent_gated_delta_rule, chunked=False
    ),
}
_KDA: dict[str, Callable[..., Any]] = {
    **CONV_KERNELS,
    "chunk_kimi_delta_attention": _kernel(fla.chunk_kda, chunked=True),
    "recurrent_kimi_delta_attention": _kernel(fla.fused_recurrent_kda, chunked=False),
}

CONVERSIONS: dict[str, Conversion] = {
    "Qwen3NextGatedDeltaNet": by_rebinding("Gated DeltaNet", ("qwen3_next",), _GATED_DELTA),
    "Qwen3_5GatedDeltaNet": by_rebinding("Gated DeltaNet", ("qwen3_5",), _GATED_DELTA),
    "Qwen3_5MoeGatedDeltaNet": by_rebinding("Gated DeltaNet", ("qwen3_5_moe",), _GATED_DELTA),
    # beta = 2 sigmoid(.) with linear_allow_neg_eigval: the same kernels (any beta)
    "OlmoHybridGatedDeltaNet": by_rebinding("Gated DeltaNet", ("olmo_hybrid",), _GATED_DELTA),
    "Qwen4ExpTextGatedDeltaNet": by_rebinding("Gated DeltaNet", ("qwen4_exp",), _GATED_DELTA),
    "KimiLinearDeltaAttention": by_rebinding("KDA", ("kimi_linear",), _KDA),
    "BailingHybridDeltaAttention": by_rebinding("KDA", ("bailing_hybrid",), _KDA),
    "Glm5NextTextLinearAttention": by_rebinding("KDA", ("glm5_next",), _KDA),
}
