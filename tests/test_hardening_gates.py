"""Gates at the edges (issue 40, Hardening III): a number ``log_decay`` under a mask, and gates
whose shape does not say what they are.

- A number ``log_decay`` is the same value in every token's slot: under a padding mask (right
  padding, left padding with an initial state, holes) and with packed sequences it gives what
  the same value as a full per-token array gives, outputs and final state, in every method of
  every entry point (a masked token neither adds to the state nor decays it), on every
  backend; a masked row of a decoding step keeps its state exactly.
- A ``log_decay`` array with fewer dimensions than the keys whose last axis could be the
  channel axis or the one before it (``(B, H, T)`` for ``(B, H, T, d)`` inputs with
  ``T == d``, a 1-D ``(T,)`` for unbatched ones) is a ``ValueError`` that shows the two
  accepted shapes in the caller's layout, at every entry point; the broadcasting that is
  unambiguous (``(heads, 1, 1)``, ``(T, 1)``, ``(d,)`` where ``T != d``, 0-d) still works.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from polylin import (
    METHODS,
    LinearAttentionState,
    causal_linear_attention,
    delta_rule_attention,
    delta_rule_step,
    dplr_delta_rule,
    dplr_delta_rule_step,
    masked_kernel_attention,
    prepare_delta_rule_step,
    prepare_dplr_step,
    prepare_step,
    step,
)

B, H, T, D_K, D_V, CHUNK = 2, 2, 11, 4, 3, 4
G = -0.5  # the number log_decay
ENTRIES = ("linear", "delta", "dplr")
PADDINGS = ("right", "left", "holes")


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def padded_inputs(rng, padding):
    """``q, k, v`` of ``(B, H, T, d)`` (unit keys: the delta rules stay stable), a ``(B, 1, T)``
    mask of the kind ``padding`` names, and an initial state for left padding (else None)."""
    q = rng.standard_normal((B, H, T, D_K))
    k = unit(rng.standard_normal((B, H, T, D_K)))
    v = rng.standard_normal((B, H, T, D_V))
    mask = np.ones((B, T), dtype=bool)
    if padding == "right":
        mask[1, 6:] = False
    elif padding == "left":
        mask[0, :5] = False
    else:
        mask[0, [1, 2, 7]] = False
        mask[1, [0, 5, 6, 10]] = False
    return q, k, v, mask[:, None, :]


def attend(backend, entry, q, k, v, log_decay, *, state=None, **options):
    """``entry``'s output and final state (a tuple of NumPy arrays: ``S``, or ``S, z``)."""
    arrays = [backend.from_numpy(x) for x in (q, k, v)]
    g = log_decay if isinstance(log_decay, float) else backend.from_numpy(log_decay)
    if entry == "linear":
        if state is not None:
            state = LinearAttentionState(*(backend.from_numpy(x) for x in state))
        out, final = causal_linear_attention(
            *arrays, log_decay=g, normalize=False, initial_state=state, return_state=True,
            **options,
        )  # fmt: skip
        return backend.to_numpy(out), tuple(backend.to_numpy(x) for x in final)
    state = None if state is None else backend.from_numpy(state[0])
    if entry == "delta":
        out, S = delta_rule_attention(
            *arrays, 0.5, log_decay=g, initial_state=state, return_state=True, **options
        )
    else:
        out, S = dplr_delta_rule(
            *arrays, -arrays[1], 0.5 * arrays[1], log_decay=g, initial_state=state,
            return_state=True, **options,
        )  # fmt: skip
    return backend.to_numpy(out), (backend.to_numpy(S),)


def assert_same(got, want):
    (out, state), (out_want, state_want) = got, want
    np.testing.assert_allclose(out, out_want, rtol=1e-12, atol=1e-12)
    for x, y in zip(state, state_want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


# Item 0: a number log_decay is that value at every token, masked tokens included.


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_number_log_decay_under_a_mask_is_that_value_at_every_token(
    backend, rng, entry, method, padding
):
    """Right padding, left padding with an initial state, holes: the number and the same value
    as a full per-token array give the same outputs and final state."""
    q, k, v, mask = padded_inputs(rng, padding)
    state = None
    if padding == "left":  # the initial state must not decay over the padding
        state = (rng.standard_normal((B, H, D_K, D_V)), rng.random((B, H, D_K)))
    options = {
        "method": method, "chunk_size": CHUNK, "attention_mask": backend.from_numpy(mask),
        "state": state,
    }  # fmt: skip
    number = attend(backend, entry, q, k, v, G, **options)
    everywhere = attend(backend, entry, q, k, v, np.full((B, H, T, 1), G), **options)
    assert_same(number, everywhere)


@pytest.mark.parametrize("entry", ENTRIES)
def test_right_padding_with_a_number_log_decay_is_the_shorter_call(backend, rng, entry):
    """The final state of a right-padded row is that of the call on its real tokens alone."""
    q, k, v, mask = padded_inputs(rng, "right")
    _, state = attend(
        backend, entry, q, k, v, G, attention_mask=backend.from_numpy(mask), chunk_size=CHUNK
    )
    short = [x[1:, :, :6] for x in (q, k, v)]
    _, state_short = attend(backend, entry, *short, G, chunk_size=CHUNK)
    for x, y in zip(state, state_short, strict=True):
        np.testing.assert_allclose(x[1:], y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_number_log_decay_with_packed_sequences(backend, rng, entry):
    offsets = [0, 3, 8, 9, 13]
    q, k, v = (x[0] for x in padded_inputs(rng, "right")[:3])  # (H, T, d)
    q, k, v = (np.concatenate([x, x[:, :2]], axis=1) for x in (q, k, v))  # T = 13
    options = {"cu_seqlens": offsets, "chunk_size": CHUNK}
    number = attend(backend, entry, q, k, v, G, **options)
    assert_same(number, attend(backend, entry, q, k, v, np.full((H, 13, 1), G), **options))


def test_a_masked_row_of_a_decoding_step_keeps_its_state(backend, rng):
    """``step`` and a prepared step with a number log_decay: the masked row's state is exactly
    the state before, the other row's is that of the same value as an array."""
    q, k, v = (rng.standard_normal((B, H, d)) for d in (D_K, D_K, D_V))
    S0, z0 = rng.standard_normal((B, H, D_K, D_V)), rng.random((B, H, D_K))
    state = LinearAttentionState(backend.from_numpy(S0), backend.from_numpy(z0))
    token = [backend.from_numpy(x) for x in (q, k, v)]
    mask = backend.from_numpy(np.array([True, False]))
    for run in (functools.partial(step, normalize=False), prepare_step(normalize=False)):
        o_t, (S, z) = run(*token, state, attention_mask=mask, log_decay=G)
        o_ref, (S_ref, z_ref) = run(
            *token, state, attention_mask=mask, log_decay=backend.from_numpy(np.full((B, H, 1), G))
        )
        S, z, o_t = backend.to_numpy(S), backend.to_numpy(z), backend.to_numpy(o_t)
        np.testing.assert_array_equal(S[1], S0[1])
        np.testing.assert_array_equal(z[1], z0[1])
        np.testing.assert_array_equal(o_t[1], 0.0)
        np.testing.assert_allclose(S, backend.to_numpy(S_ref), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(z, backend.to_numpy(z_ref), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o_t, backend.to_numpy(o_ref), rtol=1e-12, atol=1e-12)


def test_a_torch_layer_with_a_number_log_decay_under_a_mask():
    """A layer whose ``log_decay`` hook returns a number: the same as the value per token."""
    torch = pytest.importorskip("torch")
    from polylin.torch import LinearAttention

    class Number(LinearAttention):
        def log_decay(self, x):
            return G

    class PerToken(LinearAttention):
        def log_decay(self, x):
            return torch.full((*x.shape[:-1], self.num_heads), G, dtype=x.dtype)

    torch.manual_seed(0)
    number = Number(8, 2, normalize=False, dtype=torch.float64)
    per_token = PerToken(8, 2, normalize=False, dtype=torch.float64)
    per_token.load_state_dict(number.state_dict())
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 6:] = False
    mask[1, 2] = False
    out, state = number(x, mask, return_state=True)
    out_ref, state_ref = per_token(x, mask, return_state=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(state, state_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# Item 3: a gate whose shape does not say whether it is per token or per channel.


def _sequence_calls(q, k, v):
    return {
        "causal_linear_attention": lambda g: causal_linear_attention(q, k, v, log_decay=g),
        "masked_kernel_attention": lambda g: masked_kernel_attention(q, k, v, log_decay=g),
        "delta_rule_attention": lambda g: delta_rule_attention(q, k, v, 0.5, log_decay=g),
        "dplr_delta_rule": lambda g: dplr_delta_rule(q, k, v, -k, 0.5 * k, log_decay=g),
    }


def _step_calls(q, k, v):
    return {
        "step": lambda g: step(q, k, v, log_decay=g),
        "prepare_step": lambda g: prepare_step()(q, k, v, log_decay=g),
        "delta_rule_step": lambda g: delta_rule_step(q, k, v, 0.5, log_decay=g),
        "prepare_delta_rule_step": lambda g: prepare_delta_rule_step()(q, k, v, 0.5, log_decay=g),
        "dplr_delta_rule_step": lambda g: dplr_delta_rule_step(q, k, v, -k, k, log_decay=g),
        "prepare_dplr_step": lambda g: prepare_dplr_step()(q, k, v, -k, k, log_decay=g),
    }


def _accepted(per_token, per_channel):
    return rf"{re.escape(str(per_token))} for one gate per token, " + re.escape(
        f"{per_channel} for one per channel"
    )


@pytest.mark.parametrize(
    "lead, gate",
    [
        ((1, 1), (1, 1, 4)),  # (B, H, T) with T == d_k: was one gate per channel
        ((), (4,)),  # unbatched (T, d) inputs and a (T,) gate
        ((2, 4), (4, 4)),  # (H, T) with H == T == d_k
    ],
    ids=["B-H-T", "T", "H-T"],
)
def test_a_gate_missing_its_trailing_axis_is_an_error(backend, rng, lead, gate):
    q, k, v = (backend.from_numpy(rng.standard_normal((*lead, 4, d))) for d in (4, 4, D_V))
    g = backend.from_numpy(-rng.uniform(0, 1, gate))
    accepted = _accepted((*lead, 4, 1), (*lead, 4, 4))
    for call in _sequence_calls(q, k, v).values():
        with pytest.raises(ValueError, match=rf"^log_decay of shape .*does not say .*{accepted}"):
            call(g)
        # the accepted shapes: no error
        call(backend.from_numpy(-rng.uniform(0, 1, (*lead, 4, 1))))
        call(backend.from_numpy(-rng.uniform(0, 1, (*lead, 4, 4))))


def test_a_step_gate_missing_its_trailing_axis_is_an_error(backend, rng):
    """One token of ``(1, H, d_k)`` with H == d_k: a ``(1, H)`` gate could be one per row."""
    q, k = (backend.from_numpy(rng.standard_normal((1, 4, 4))) for _ in "qk")
    v = backend.from_numpy(rng.standard_normal((1, 4, D_V)))
    accepted = _accepted((1, 4, 1), (1, 4, 4))
    for call in _step_calls(q, k, v).values():
        with pytest.raises(ValueError, match=rf"^log_decay of shape .*does not say .*{accepted}"):
            call(backend.from_numpy(-rng.uniform(0, 1, (1, 4))))
        call(backend.from_numpy(-rng.uniform(0, 1, (1, 4, 1))))


@pytest.mark.parametrize("seq_axis", [1, -3])
def test_the_message_speaks_in_the_callers_layout(rng, seq_axis):
    """``(B, T, H, d)`` inputs: a ``(B, T, H)`` gate, and one of a wrong width, are named with
    the shapes the caller would pass (the T axis where the caller has it)."""
    q, k = rng.standard_normal((2, 2, 5, 3, 4))
    v = rng.standard_normal((2, 5, 3, D_V))
    calls = {
        "causal_linear_attention": lambda g: causal_linear_attention(
            q, k, v, log_decay=g, seq_axis=seq_axis
        ),
        "masked_kernel_attention": lambda g: masked_kernel_attention(
            q, k, v, log_decay=g, seq_axis=seq_axis
        ),
        "delta_rule_attention": lambda g: delta_rule_attention(
            q, k, v, 0.5, log_decay=g, seq_axis=seq_axis
        ),
        "dplr_delta_rule": lambda g: dplr_delta_rule(
            q, k, v, -k, k, log_decay=g, seq_axis=seq_axis
        ),
    }
    accepted = _accepted((2, 5, 3, 1), (2, 5, 3, 4))
    for call in calls.values():
        with pytest.raises(ValueError, match=rf"^log_decay has 3 dimensions .*{accepted}"):
            call(np.zeros((2, 5, 3)))
        with pytest.raises(ValueError, match=re.escape("(2, 5, 3, 4)") + r".*got shape "
                           + re.escape("(2, 5, 3, 2)")):  # fmt: skip
            call(np.zeros((2, 5, 3, 2)))
        # in the caller's layout the gate is accepted and follows the inputs' T axis
        g = -rng.uniform(0, 1, (2, 5, 3, 1))
        np.testing.assert_allclose(
            call(g), call(np.broadcast_to(g, (2, 5, 3, 4)).copy()), rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("entry", ENTRIES)
def test_unambiguous_broadcasting_still_works(backend, rng, entry):
    """Gates with fewer dimensions that say what they are give what their broadcast gives:
    0-d, ``(1,)``, ``(H, 1, 1)``, ``(T, 1)``, and per channel ``(d_k,)`` or ``(1, 1, d_k)``
    where T differs from d_k (and from H)."""
    q, k, v, _ = padded_inputs(rng, "right")  # T = 11, d_k = 4
    gates = [(), (1,), (H, 1, 1), (T, 1), (D_K,), (1, 1, D_K)]
    for shape in gates:
        g = -rng.uniform(0, 1, shape)
        full = np.broadcast_to(g, (B, H, T, 1 if shape[-1:] in ((), (1,)) else D_K)).copy()
        got = attend(backend, entry, q, k, v, g, chunk_size=CHUNK)
        assert_same(got, attend(backend, entry, q, k, v, full, chunk_size=CHUNK))


def test_a_step_gate_per_channel_with_fewer_dimensions_still_works(backend, rng):
    q, k = (backend.from_numpy(rng.standard_normal((B, H, D_K))) for _ in "qk")
    v = backend.from_numpy(rng.standard_normal((B, H, D_V)))
    for shape in ((D_K,), (H, 1), (1,)):
        g = -rng.uniform(0, 1, shape)
        full = np.broadcast_to(g, (B, H, D_K if shape == (D_K,) else 1)).copy()
        for call in _step_calls(q, k, v).values():
            got, want = call(backend.from_numpy(g)), call(backend.from_numpy(full))
            for x, y in zip(_leaves(got), _leaves(want), strict=True):
                np.testing.assert_allclose(
                    backend.to_numpy(x), backend.to_numpy(y), rtol=1e-12, atol=1e-12
                )


def _leaves(result):
    """The arrays of a step's ``(o_t, state)``, a ``LinearAttentionState`` unpacked."""
    o_t, state = result
    return [o_t, *state] if isinstance(state, LinearAttentionState) else [o_t, state]


def test_a_per_channel_gate_with_packed_sequences_is_checked_once(backend, rng):
    """A ``(d_k,)`` gate with ``cu_seqlens`` whose longest sequence has d_k tokens: the packed
    call must not take it for an ambiguous gate of the packed shape."""
    offsets = [0, 4, 7]  # T = 7, the longest sequence 4 = d_k
    q, k, v = (x[0, :, :7] for x in padded_inputs(rng, "right")[:3])
    g = -rng.uniform(0, 1, (D_K,))
    for entry in ENTRIES:
        options = {"cu_seqlens": offsets, "chunk_size": CHUNK}
        got = attend(backend, entry, q, k, v, g, **options)
        assert_same(got, attend(backend, entry, q, k, v, np.broadcast_to(g, (H, 7, D_K)).copy(),
                                **options))  # fmt: skip
