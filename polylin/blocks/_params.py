"""Parameters, masks and caches of the blocks: what every block checks and reads the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from .._inputs.validation import MASK_CONVERSION
from ..interop import array_namespace, is_array

__all__ = ["BlockCache", "check_cache", "linear", "padding_mask", "param"]


class BlockCache(NamedTuple):
    """A block's decoding cache: plain arrays, so it passes through ``jax.jit`` as a pytree.

    Parameters
    ----------
    conv_state : tuple of arrays
        The short convolutions' states, ``(batch, conv_size - 1, channels)`` each, in the
        order ``q``, ``k``, ``v`` (empty without short convolutions); RWKV-7's token shift:
        one state ``(batch, 1, hidden_size)``, the last real token.
    recurrent_state : array or polylin.LinearAttentionState
        The recurrent state, ``(batch, num_v_heads, head_dim, head_v_dim)`` (RWKV-7:
        ``(batch, num_heads, head_dim, head_v_dim)``); for GLA and Mamba-2, the
        :class:`polylin.LinearAttentionState` ``(S, z)`` of their linear attention, ``S``
        ``(batch, num_heads, d_k, d_v)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin.blocks import BlockCache, gated_deltanet, init_gated_deltanet
    >>> params = init_gated_deltanet(np, hidden_size=16, num_heads=2, head_dim=4)
    >>> x = np.ones((1, 5, 16), np.float32)
    >>> y, cache = gated_deltanet(params, x, num_heads=2, return_cache=True)
    >>> isinstance(cache, BlockCache), [s.shape for s in cache.conv_state]
    (True, [(1, 3, 8), (1, 3, 8), (1, 3, 16)])
    """

    conv_state: tuple[Any, ...]
    recurrent_state: Any


def param(block: str, params: Mapping[str, Any], name: str, *, ndim: int) -> Any:
    """``params[name]``, an array of ``ndim`` dimensions (a ``KeyError`` or ``ValueError``
    naming it and the block otherwise)."""
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{block}: params must be a mapping from the torch module's state-dict names to "
            f"arrays, got {type(params).__name__}"
        )
    if name not in params:
        raise KeyError(f"{block}: params has no {name!r} (the torch module's state-dict names)")
    x = params[name]
    if not is_array(x) or x.ndim != ndim:
        shape = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{block}: params[{name!r}] must be a {ndim}-D array, got {shape}")
    return x


def linear(params: Mapping[str, Any], x: Any, name: str) -> Any:
    """``torch.nn.Linear`` named ``name``: ``x @ weight.T`` (``+ bias`` where there is one)."""
    xp = array_namespace(x)
    y = x @ xp.matrix_transpose(params[f"{name}.weight"])
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias


def padding_mask(
    block: str, xp: Any, attention_mask: Any, x: Any, name: str, hidden_size: int, *, rank: int
) -> Any:
    """Check ``x`` (``rank`` dimensions, last ``hidden_size``) and return its boolean mask of
    real tokens (``x.shape[:-1]``), or ``None``."""
    if not is_array(x) or x.ndim != rank or x.shape[-1] != hidden_size:
        shape = getattr(x, "shape", type(x).__name__)
        lead = "(batch, T, hidden_size)" if rank == 3 else "(batch, hidden_size)"
        raise ValueError(
            f"{block}: {name} must have shape {lead} with hidden_size={hidden_size}, got {shape}"
        )
    if attention_mask is None:
        return None
    what = "attention_mask"
    if not is_array(attention_mask) or array_namespace(attention_mask) is not xp:
        raise TypeError(f"{block}: {what} must be an array of the same library as {name}")
    if not xp.isdtype(attention_mask.dtype, "bool"):
        raise TypeError(
            f"{block}: {what} must be boolean (True for real tokens), got "
            f"{attention_mask.dtype}: {MASK_CONVERSION.format(name=what)}"
        )
    if tuple(attention_mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{block}: {what} must have shape {tuple(x.shape[:-1])} ({name}'s without "
            f"hidden_size), got {tuple(attention_mask.shape)}"
        )
    return attention_mask


def check_cache(block: str, cache: Any, x: Any, has_convs: bool) -> None:
    """``cache`` is ``None`` or a :class:`BlockCache` of this block's kind."""
    if cache is None:
        return
    if not isinstance(cache, tuple) or len(cache) != 2:
        raise TypeError(
            f"{block}: cache must be a BlockCache (conv_state, recurrent_state) from this "
            f"block, got {type(cache).__name__}"
        )
    conv_state, S = cache
    if len(conv_state) != (3 if has_convs else 0):
        raise ValueError(
            f"{block}: the cache holds {len(conv_state)} convolution states, this block has "
            f"{3 if has_convs else 0}: it was made by another block"
        )
    if not is_array(S) or S.shape[0] != x.shape[0]:
        raise ValueError(
            f"{block}: the cache's recurrent state is for a batch of "
            f"{getattr(S, 'shape', (None,))[0]}, the input's is {x.shape[0]}"
        )
