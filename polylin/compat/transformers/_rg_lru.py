"""RecurrentGemma's RG-LRU: the layer's ``forward`` computes the recurrence on polylin.

``RecurrentGemmaRglru.forward(activations, position_ids)`` computes the gates with two
block-diagonal linear maps (one ``(block_width, block_width)`` matrix per head), then
``sqrt(1 - a^2)`` and a Python loop over the tokens (``_rnn_scan``), one step per token, with
the state dropped where ``position_ids == 0``. The converted ``forward`` keeps the linear maps
(PyTorch matrix products on the layer's own parameters) and computes everything after them
with :func:`polylin.rg_lru` (the chunked scan) or, for one token against a state,
:func:`polylin.rg_lru_step`. The state lives where transformers keeps it, in the layer's
``recurrent_states`` (``(batch, lru_width)``, float32, set up by the model's cache), so the
recurrent block, its convolution state and ``generate`` are transformers' own.
"""

from __future__ import annotations

import functools
from typing import Any

from ... import rg_lru, rg_lru_step
from ...interop import array_namespace, work_dtype_for
from ._registry import Conversion


def _gates(self: Any, activations: Any) -> tuple[Any, Any]:
    """The input and recurrent gates' pre-activations ``(batch, T, lru_width)``: per head,
    ``x_h W_h + b_h``, one batched matrix product per gate over ``(heads, batch T, block)``
    as transformers computes them (``baddbmm``)."""
    import torch

    batch, length, width = activations.shape
    heads = self.num_attention_heads
    blocks = activations.reshape(batch * length, heads, self.block_width).transpose(0, 1)
    out = []
    for weight, bias in (
        (self.input_gate_weight, self.input_gate_bias),
        (self.recurrent_gate_weight, self.recurrent_gate_bias),
    ):
        gate = torch.baddbmm(bias[:, None, :], blocks, weight)  # (heads, batch T, block)
        out.append(gate.transpose(0, 1).reshape(batch, length, width))
    return out[0], out[1]


def _forward(self: Any, activations: Any, position_ids: Any) -> Any:
    """``RecurrentGemmaRglru.forward`` on polylin: every state ``(batch, T, lru_width)`` in the
    input's dtype; the last state is left in ``self.recurrent_states``."""
    input_gate, recurrent_gate = _gates(self, activations)
    reset = (position_ids == 0)[..., None]
    state = self.recurrent_states
    if state is not None:
        work = work_dtype_for(array_namespace(activations), activations.dtype)
        state = state.to(device=activations.device, dtype=work)
    if activations.shape[1] == 1 and state is not None:
        h, last = rg_lru_step(
            activations[:, 0], input_gate[:, 0], recurrent_gate[:, 0], self.recurrent_param,
            state, reset=reset[:, 0],
        )  # fmt: skip
        h = h[:, None]
    else:
        h, last = rg_lru(
            activations, input_gate, recurrent_gate, self.recurrent_param, reset=reset,
            initial_state=state, return_state=True,
        )  # fmt: skip
    self.recurrent_states = last
    return h


@functools.cache
def _polylin(cls: Any) -> Any:
    return _forward


@functools.cache
def _fallback(cls: Any) -> Any:
    return cls.forward  # the class's own code: the gates, then the _rnn_scan loop


CONVERSIONS: dict[str, Conversion] = {
    "RecurrentGemmaRglru": Conversion("RG-LRU", ("recurrent_gemma",), _polylin, _fallback),
}
