"""The fused loops over chunks on PyTorch (``polylin._backend.fused``) keep one state of their
own: without a gradient to record, the first chunk's update makes a fresh state from the
caller's (which is never written) and every later chunk rewrites it in place, so a call
allocates one state-sized tensor in the loop, not one per chunk."""

import math

import numpy as np
import pytest

import polylin
from polylin import LinearAttentionState, causal_linear_attention, dplr_delta_rule
from polylin._backend import fused as loops
from polylin.feature_maps import identity
from polylin.testing import Backend

from .test_delta_rule import make_inputs, needs, unit

#: The fused loops, by the name of the ``_backend.fused`` function: the positions of the state
#: among its arguments and of an operand ``(..., N, rows, cols)`` whose axis -3 counts the chunks.
LOOPS = {"fused_delta_chunks": (0, 1), "fused_chain_reads": (3, 0), "fused_dplr_chunks": (0, 1)}


def fresh_states(torch, monkeypatch, name):
    """Wrap ``loops.<name>`` so that each call appends ``(chunks, made)``: its number of chunks and
    the PyTorch operations inside it that returned a new tensor of the flattened state's shape
    (not in place, not into ``out=``, not a view)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []
    fused = getattr(loops, name)

    state, chunked = LOOPS[name]

    def watched(*args):
        S = args[state]
        shape = (math.prod(S.shape[:-2]), *S.shape[-2:])
        made = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                schema = func._schema
                writes = schema.is_mutable or any(r.alias_info for r in schema.returns)
                if not writes and isinstance(out, torch.Tensor) and tuple(out.shape) == shape:
                    made.append(func.__name__)
                return out

        with Watch():
            result = fused(*args)
        if result is not None:
            calls.append((args[chunked].shape[-3], made))
        return result

    monkeypatch.setattr(loops, name, watched)
    for module in (polylin._forms.delta.chunked, polylin._forms.common.prefix,
                   polylin._forms.dplr.chunked):  # fmt: skip
        if hasattr(module, name):
            monkeypatch.setattr(module, name, watched)
    return calls


def _delta(torch, rng, grad):
    q, k, v, beta, log_decay = make_inputs(rng, lead=(2, 3), length=40, d_k=16, d_v=6)
    S0 = torch.tensor(rng.standard_normal((2, 3, 16, 6)))
    xs = [torch.tensor(a, requires_grad=grad) for a in (q, k, v, beta, log_decay)]
    out, S = polylin.delta_rule_attention(
        *xs[:4], log_decay=xs[4], initial_state=S0, chunk_size=8, return_state=True
    )
    return (xs if grad else S0), out, S


def _chain(torch, rng, grad):
    # one query and key per group of three heads (Mamba-2's B and C): the heads as columns
    q, k = (torch.tensor(rng.standard_normal((2, 1, 40, 16))) for _ in range(2))
    v = torch.tensor(rng.standard_normal((2, 3, 40, 6)))
    log_decay = torch.tensor(-rng.uniform(0.0, 0.7, (2, 3, 40, 1)))
    S0 = torch.tensor(rng.standard_normal((2, 3, 16, 6)))
    out, state = causal_linear_attention(
        q, k, v, identity, log_decay=log_decay, normalize=False, chunk_size=8,
        initial_state=LinearAttentionState(S0, torch.zeros(2, 3, 16, dtype=S0.dtype)),
        return_state=True,
    )  # fmt: skip
    return S0, out, state.S


def _dplr(torch, rng, grad):
    q, k = (torch.tensor(rng.standard_normal((2, 3, 40, 16))) for _ in range(2))
    v = torch.tensor(rng.standard_normal((2, 3, 40, 6)))
    kk = unit(rng.standard_normal((2, 3, 40, 16)))
    a, b = torch.tensor(-kk), torch.tensor(kk * rng.uniform(0, 1, (2, 3, 40, 16)))
    log_decay = torch.tensor(-rng.uniform(0.0, 0.7, (2, 3, 40, 16)))
    S0 = torch.tensor(rng.standard_normal((2, 3, 16, 6)))
    out, S = dplr_delta_rule(
        q, k, v, a, b, log_decay=log_decay, initial_state=S0, chunk_size=8, return_state=True
    )
    return S0, out, S


CALLS = {"fused_delta_chunks": _delta, "fused_chain_reads": _chain, "fused_dplr_chunks": _dplr}


def _never_owned(*args):
    """``_backend.fused._owned_states`` as it would be with a gradient: no chunk owns its state."""
    return iter(lambda: False, True)


@pytest.mark.parametrize("name", list(LOOPS))
def test_fused_loop_makes_one_state_and_leaves_the_callers(monkeypatch, name):
    """Without a gradient each fused loop makes one state-sized tensor however many chunks it
    runs, with the same outputs and final state as the loop that makes one per chunk, and the
    caller's initial state is not written."""
    torch = needs(Backend.TORCH)
    calls = fresh_states(torch, monkeypatch, name)
    results = []
    with torch.no_grad():
        for owned in (True, False):
            if not owned:
                monkeypatch.setattr(loops, "_owned_states", _never_owned)
            calls.clear()
            S0, out, S = CALLS[name](torch, np.random.default_rng(7), grad=False)
            kept = S0.clone()
            want = 1 if owned else None  # one state in all, or one per chunk
            assert calls and all(
                chunks >= 4 and len(made) == (want or chunks) for chunks, made in calls
            ), calls
            torch.testing.assert_close(S0, kept, rtol=0, atol=0)
            results.append((out, S))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_delta_loop_with_a_gradient_makes_a_state_per_chunk(monkeypatch):
    """With a gradient to record (one thread: the read-out inside the loop), the delta rule's
    fused loop writes no state that autograd keeps: a fresh decayed state per chunk, and the
    same gradients as the loop whose states are never owned."""
    torch = needs(Backend.TORCH)
    calls = fresh_states(torch, monkeypatch, "fused_delta_chunks")
    before = torch.get_num_threads()
    grads = []
    try:
        torch.set_num_threads(1)
        for owned in (True, False):
            if not owned:
                monkeypatch.setattr(loops, "_owned_states", _never_owned)
            calls.clear()
            inputs, out, S = _delta(torch, np.random.default_rng(7), grad=True)
            assert calls and all(made == ["mul.Tensor"] * chunks for chunks, made in calls), calls
            grads.append(torch.autograd.grad((out.sum() + S.square().sum()), inputs))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

