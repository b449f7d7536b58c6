"""flash-linear-attention's ops, computed by polylin: ``from polylin.compat import fla``.

Each function has the name, signature, defaults, layout and return value of the fla 0.6.0 op of
the same name (``fla.ops.<family>.chunk`` / ``fused_recurrent``): inputs ``(B, T, H, d)``,
values and gates with ``HV`` heads (a multiple of ``H``: grouped value heads), ``scale=None``
meaning ``d_k ** -0.5`` (``chunk_rwkv7`` defaults to 1, as fla's does), states
``(N, HV, d_k, d_v)``, ``cu_seqlens`` offsets with ``B == 1``, and a return value
``(o, final_state or None)``. They take arrays of any array-API library (NumPy, PyTorch on CPU
or GPU, JAX, CuPy, ...) and return the inputs' library, device and dtype. ``chunk_*`` run
polylin's chunked form, ``fused_recurrent_*`` its per-token recurrence: the same function
either way. An integer array argument is a ``TypeError`` naming it, and a first argument whose
shape reads as ``T < H`` (``1 < q.shape[1] < q.shape[2]``: head-first ``(B, H, T, d)`` inputs,
which compute a wrong answer) warns with a ``UserWarning``.

The ops: ``chunk_linear_attn``, ``chunk_simple_gla``, ``chunk_gla`` and their
``fused_recurrent_*`` twins, ``chunk_retention`` (linear attention and its gated forms);
``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda`` and their twins (the delta
family), ``chunk_gated_delta_product`` (several delta steps per token), ``chunk_comba``
and ``fused_recurrent_comba`` (Comba), ``chunk_gdn2`` and ``fused_recurrent_gdn2`` (GDN-2);
``chunk_dplr_delta_rule``, ``chunk_rwkv7``, their twins and
``fused_mul_recurrent_rwkv7`` (the generalized delta rule, RWKV-7); ``chunk_rwkv6`` and
``fused_recurrent_rwkv6`` (RWKV-6: GLA read before the update, plus a bonus).

They translate arguments only: every number comes from :func:`polylin.causal_linear_attention`,
:func:`polylin.delta_rule_attention` or :func:`polylin.dplr_delta_rule`. An fla option polylin
does not compute (a gate applied inside the kernel, reverse scans, context parallelism) raises
``NotImplementedError`` naming it.
See the documentation page "Coming from flash-linear-attention".
"""

from __future__ import annotations

from .comba import chunk_comba, fused_recurrent_comba
from .delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from .gated_delta_product import chunk_gated_delta_product
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .gdn2 import chunk_gdn2, fused_recurrent_gdn2
from .generalized_delta_rule import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule
from .gla import chunk_gla, fused_recurrent_gla
from .kda import chunk_kda, fused_recurrent_kda
from .linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
from .retention import chunk_retention
from .rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6
from .rwkv7 import chunk_rwkv7, fused_mul_recurrent_rwkv7, fused_recurrent_rwkv7
from .simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

__all__ = [
    "FLA_VERSION",
    "chunk_comba",
    "chunk_delta_rule",
    "chunk_dplr_delta_rule",
    "chunk_gated_delta_product",
    "chunk_gated_delta_rule",
    "chunk_gdn2",
    "chunk_gla",
    "chunk_kda",
    "chunk_linear_attn",
    "chunk_retention",
    "chunk_rwkv6",
    "chunk_rwkv7",
    "chunk_simple_gla",
    "fused_mul_recurrent_rwkv7",
    "fused_recurrent_comba",
    "fused_recurrent_delta_rule",
    "fused_recurrent_dplr_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gdn2",
    "fused_recurrent_gla",
    "fused_recurrent_kda",
    "fused_recurrent_linear_attn",
    "fused_recurrent_rwkv6",
    "fused_recurrent_rwkv7",
    "fused_recurrent_simple_gla",
]


#: The flash-linear-attention release whose signatures these functions follow.
FLA_VERSION = "0.6.0"
