"""xLSTM's mLSTM: the layer's backend module computes the recurrence on polylin.

``xLSTMLayer`` hands its projections to ``xLSTMBackend``, whose ``forward(query, key, value,
igate, fgate, c_initial, n_initial, m_initial, return_last_states, mode)`` calls
transformers' pure-PyTorch kernels (``mlstm_chunkwise_native_autograd`` for training; for
inference the chunkwise kernel on whole chunks, a token loop on the rest, the step kernel for
one token) when the ``xlstm`` package is absent. The converted backend computes all of them with
:func:`polylin.mlstm` (the chunked form, any length, the chunk size of the config) and, for one
token against a state, :func:`polylin.mlstm_step`, with the config's ``eps`` and xLSTM's query
scale ``d_qk ** -0.5``. The state is the ``(c, n, m)`` triple that ``xLSTMCache`` holds, in its
layout ``(B, H, d_qk, d_v)``, ``(B, H, d_qk)``, ``(B, H, 1)``: the layers and the cache are
transformers' own. A 16-bit state is computed in float32, as transformers' inference kernels
keep it (``inference_state_dtype``).
"""

from __future__ import annotations

import functools
from typing import Any

from ... import mlstm, mlstm_step
from ._registry import Conversion


def _state(c: Any, n: Any, m: Any, work: Any) -> tuple[Any, Any, Any] | None:
    """The initial ``(c, n, m)`` in the dtype polylin computes in (``work``), or None."""
    if c is None and n is None and m is None:
        return None
    if c is None or n is None or m is None:
        raise ValueError("c_initial, n_initial and m_initial must be given together")
    # Copies: the model writes the new state into the cache's tensors in place (``copy_``)
    # after the call, and autograd keeps the initial state for the backward.
    return (c.to(work, copy=True), n.to(work, copy=True), m.to(work, copy=True))


def _forward(
    self: Any,
    query: Any,
    key: Any,
    value: Any,
    igate: Any,
    fgate: Any,
    c_initial: Any = None,
    n_initial: Any = None,
    m_initial: Any = None,
    return_last_states: bool | None = None,
    mode: str | None = None,
) -> Any:
    """``xLSTMBackend.forward`` on polylin: ``h`` ``(B, H, T, d_v)``, and the last
    ``(c, n, m)`` where transformers returns them."""
    import torch

    config = self.config
    mode = config.mode if mode is None else mode
    if "train" in mode:
        if return_last_states is None:
            return_last_states = config.return_last_states
        if mode == "train_with_padding" and return_last_states:
            raise ValueError(
                "return_last_states=True is not supported with train_with_padding mode."
            )
    elif "inference" in mode:
        return_last_states = True  # the inference path always returns the states
    else:
        raise ValueError(f"Unknown mode: {config.mode}")
    half = query.dtype in (torch.float16, torch.bfloat16)
    state = _state(c_initial, n_initial, m_initial, torch.float32 if half else query.dtype)
    if query.shape[2] == 1 and state is not None:
        h, last = mlstm_step(
            query[:, :, 0], key[:, :, 0], value[:, :, 0], igate, fgate, state, eps=config.eps
        )
        h = h[:, :, None]
    else:
        h, last = mlstm(
            query, key, value, igate[..., None], fgate[..., None], eps=config.eps,
            chunk_size=config.chunk_size, initial_state=state, return_state=True,
        )  # fmt: skip
    return (h, tuple(last)) if return_last_states else h


@functools.cache
def _polylin(cls: Any) -> Any:
    return _forward


@functools.cache
def _fallback(cls: Any) -> Any:
    # the class's own code: without the xlstm package it calls the pure-PyTorch kernels
    return cls.forward


CONVERSIONS: dict[str, Conversion] = {
    "xLSTMBackend": Conversion("mLSTM", ("xlstm",), _polylin, _fallback),
}
