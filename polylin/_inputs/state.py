"""The recurrent state of causal linear attention."""

from __future__ import annotations

from typing import NamedTuple

from .._typing import Array

__all__ = ["LinearAttentionState"]


class LinearAttentionState(NamedTuple):
    """The fixed-size state of causal linear attention after some prefix of a sequence.

    ``S = sum_s phi(k_s) v_s^T`` and ``z = sum_s phi(k_s)`` over the tokens seen so far. Its size
    does not depend on how many tokens it summarizes: this is what replaces a softmax KV cache.
    For half-precision inputs both are kept in float32.

    Parameters
    ----------
    S : array
        Shape ``(..., d_phi, d_v)``, where ``d_phi`` is the feature size of ``phi(k)`` (``d_k``
        for the default feature map).
    z : array
        Shape ``(..., d_phi)``: the normalizer's running sum.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import LinearAttentionState, causal_linear_attention
    >>> q = k = np.zeros((2, 5, 3)); v = np.ones((2, 5, 4))
    >>> out, state = causal_linear_attention(q, k, v, return_state=True)
    >>> state.S.shape, state.z.shape
    ((2, 3, 4), (2, 3))
    >>> isinstance(state, LinearAttentionState)
    True
    """

    S: Array
    z: Array
