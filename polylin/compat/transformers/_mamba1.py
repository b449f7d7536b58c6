"""The Mamba-1 mixers of Mamba, FalconMamba, Jamba and Zamba, by kernel rebinding.

transformers computes these layers with module-level functions that its decorators resolve to
mamba_ssm's CUDA kernels when installed, and to pure-PyTorch fallbacks otherwise:
``mamba_selective_scan`` (a whole sequence, one Python step per token), its decoding step
``mamba_selective_state_update`` (the cached state updated in place), ``mamba_inner_fn`` (the
fused training path; the fallback returns ``None`` and the layer goes step by step) and the
short convolution. Their twins here compute on :func:`polylin.selective_scan` and
:func:`polylin.selective_scan_step` in transformers' layout (channels first, ``(batch, D, T)``
and ``(batch, N, T)``, read through transposed views), keeping the cache's own tensors; the
layers' masks and caches are transformers' own, untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import selective_scan, selective_scan_step
from ...interop import array_namespace, work_dtype_for
from ._rebind import by_rebinding
from ._registry import Conversion
from ._short_conv import CONV_KERNELS


def _to(x: Any, dtype: Any) -> Any:
    return x if x is None or x.dtype == dtype else array_namespace(x).astype(x, dtype)


def polylin_mamba_selective_scan(
    hidden_states: Any,
    dt: Any,
    A: Any,
    B: Any,
    C: Any,
    D: Any = None,
    z: Any = None,
    delta_bias: Any = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> Any:
    """transformers' ``mamba_selective_scan`` on :func:`polylin.selective_scan`.

    ``hidden_states``, ``dt``, ``z`` ``(batch, D, T)``, ``B``, ``C`` ``(batch, N, T)``; returns
    ``y`` ``(batch, D, T)`` in the input's dtype, and with ``return_last_state`` the state
    ``(batch, D, N)``. Other keywords choose among transformers' own fallbacks
    (``use_mambapy``, ``use_associative_scan``) and are ignored.
    """
    dtype = hidden_states.dtype
    y, state = selective_scan(
        hidden_states.mT, _to(dt, dtype).mT, A, _to(B, dtype).mT, _to(C, dtype).mT, D=D,
        z=None if z is None else _to(z, dtype).mT, dt_bias=delta_bias,
        dt_softplus=delta_softplus, return_state=True,
    )  # fmt: skip
    return (y.mT, state) if return_last_state else y.mT


def polylin_mamba_selective_state_update(
    state: Any,
    hidden_states: Any,
    dt: Any,
    A: Any,
    B: Any,
    C: Any,
    D: Any = None,
    dt_bias: Any = None,
    dt_softplus: bool = False,
    z: Any = None,
    **kwargs: Any,
) -> Any:
    """transformers' ``mamba_selective_state_update`` on :func:`polylin.selective_scan_step`:
    ``state`` ``(batch, D, N)`` (the cache's tensor, or a view of it) is updated in place, as
    transformers does, and ``y`` ``(batch, D)`` returned in the input's dtype."""
    dtype = hidden_states.dtype
    work = work_dtype_for(array_namespace(hidden_states), dtype)
    y, new_state = selective_scan_step(
        hidden_states, _to(dt, dtype), A, _to(B, dtype), _to(C, dtype), _to(state, work), D=D,
        z=_to(z, dtype), dt_bias=dt_bias, dt_softplus=dt_softplus,
    )  # fmt: skip
    state.copy_(_to(new_state, state.dtype))
    return y


def polylin_mamba_inner_fn(*args: Any, **kwargs: Any) -> None:
    """transformers' fused ``mamba_inner_fn``: ``None``, so that the layer computes step by
    step (convolution, projections, the scan) on the twins above, as its fallback does."""
    return None


MAMBA1_KERNELS: dict[str, Callable[..., Any]] = {
    **CONV_KERNELS,
    "mamba_selective_scan": polylin_mamba_selective_scan,
    "mamba_selective_state_update": polylin_mamba_selective_state_update,
}
_WITH_INNER = {**MAMBA1_KERNELS, "mamba_inner_fn": polylin_mamba_inner_fn}

CONVERSIONS: dict[str, Conversion] = {
    "MambaMixer": by_rebinding("Mamba-1", ("mamba",), _WITH_INNER),
    "FalconMambaMixer": by_rebinding("Mamba-1", ("falcon_mamba",), _WITH_INNER),
    "JambaMambaMixer": by_rebinding("Mamba-1", ("jamba",), _WITH_INNER),
    "ZambaMambaMixer": by_rebinding("Mamba-1", ("zamba",), MAMBA1_KERNELS),
}
