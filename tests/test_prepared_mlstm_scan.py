"""The prepared mLSTM and selective-scan steps: equal to the plain steps to the bit, to a
float64 loop of the recurrence, and checked again (with the plain step's errors) whenever the
signature of a call changes."""

from __future__ import annotations

import numpy as np
import pytest

from polylin import (
    MLSTMState,
    PreparedStep,
    mlstm,
    mlstm_step,
    prepare_mlstm_step,
    prepare_selective_scan_step,
    selective_scan_step,
)

from .test_mlstm import reference as mlstm_reference
from .test_selective_scan import reference as scan_reference

# Both sides run as called (no automatic jax.jit of the plain step): bitwise equality holds
# between two eager runs.
pytestmark = pytest.mark.eager

T, LEAD, D_K, D_V, N = 5, (2, 3), 4, 3, 5


def assert_same(backend, got, want):
    """``(outputs, state)`` pairs equal to the last bit."""
    (outs_got, state_got), (outs_want, state_want) = got, want
    for a, b in zip(outs_got, outs_want, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    parts_got = state_got if isinstance(state_got, tuple) else (state_got,)
    parts_want = state_want if isinstance(state_want, tuple) else (state_want,)
    for a, b in zip(parts_got, parts_want, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))


def run(update, state, *per_token):
    """``update(*token_t, state)`` over the tokens: the outputs and the last state."""
    outs = []
    for t in range(T):
        o, state = update(*(x[t] if isinstance(x, list) else x[t, ...] for x in per_token), state)
        outs.append(o)
    return outs, state


def mlstm_tokens(rng):
    q, k = rng.standard_normal((2, T, *LEAD, D_K))
    v = rng.standard_normal((T, *LEAD, D_V))
    i_gate = 3.0 * rng.standard_normal((T, *LEAD, 1))
    f_gate = rng.standard_normal((T, *LEAD, 1)) + 2.0
    return q, k, v, i_gate, f_gate


# -- the mLSTM ---------------------------------------------------------------------------


@pytest.mark.slow_grid
@pytest.mark.parametrize("gates", ["arrays", "numbers"])
@pytest.mark.parametrize("start", ["zeros", "state", "shared state"])
def test_prepare_mlstm_step_equals_mlstm_step(backend, rng, gates, start):
    q, k, v, i_gate, f_gate = (backend.from_numpy(a) for a in mlstm_tokens(rng))
    if gates == "numbers":
        i_gate, f_gate = [0.5, -1.0, 2.0, 0.0, 1.5], [3.0, 1.0, -0.5, 2.0, 0.2]
    lead = LEAD if start == "state" else (1, 3)
    state = None if start == "zeros" else MLSTMState(
        backend.from_numpy(rng.standard_normal((*lead, D_K, D_V))),
        backend.from_numpy(rng.standard_normal((*lead, D_K))),
        backend.from_numpy(rng.uniform(0.0, 1.0, (*lead, 1))),
    )  # fmt: skip
    prepared = prepare_mlstm_step(scale=0.7, eps=1e-5)
    got = run(lambda *a: prepared(*a), state, q, k, v, i_gate, f_gate)
    want = run(lambda *a: mlstm_step(*a, scale=0.7, eps=1e-5), state, q, k, v, i_gate, f_gate)
    assert_same(backend, got, want)
    assert isinstance(got[1], MLSTMState)
    assert tuple(got[1].C.shape) == (*LEAD, D_K, D_V)


def test_prepare_mlstm_step_continues_a_prefill(backend, rng):
    """From the state of a chunked prefill, the prepared step gives the float64 loop's
    outputs and state (and the chunked form's outputs)."""
    length = 9
    q, k = rng.standard_normal((2, *LEAD, length, D_K))
    v = rng.standard_normal((*LEAD, length, D_V))
    i_gate = 3.0 * rng.standard_normal((*LEAD, length, 1))
    f_gate = rng.standard_normal((*LEAD, length, 1)) + 2.0
    arrays = [backend.from_numpy(a) for a in (q, k, v, i_gate, f_gate)]
    _, state = mlstm(*(a[..., :4, :] for a in arrays), return_state=True, chunk_size=2)
    want, want_state = mlstm_reference(q, k, v, i_gate, f_gate)
    whole = backend.to_numpy(mlstm(*arrays, chunk_size=2))
    prepared = prepare_mlstm_step()
    for t in range(4, length):
        h_t, state = prepared(*(a[..., t, :] for a in arrays), state)
        np.testing.assert_allclose(backend.to_numpy(h_t), want[..., t, :], rtol=0, atol=1e-10)
        np.testing.assert_allclose(backend.to_numpy(h_t), whole[..., t, :], rtol=0, atol=1e-10)
    for got_part, want_part in zip(state, want_state, strict=True):
        # Both are relative to the same stabilizer m, the running maximum of the same values.
        np.testing.assert_allclose(backend.to_numpy(got_part), want_part, rtol=1e-10, atol=1e-12)


def test_prepare_mlstm_step_checks_every_new_signature(rng):
    q, k, v, i_gate, f_gate = (a[0] for a in mlstm_tokens(rng))
    prepared = prepare_mlstm_step()
    assert isinstance(prepared, PreparedStep)
    _, state = prepared(q, k, v, i_gate, f_gate)
    for bad, message in [
        ((q, k[..., :2], v, i_gate, f_gate, state), "k_t has feature size d_k=2"),
        ((q, k, v, i_gate[..., :1, :], f_gate, state), None),  # broadcasts: computed
        ((q, k, v, np.ones((2, 3, 2)), f_gate, state), "i_t must broadcast to"),
        ((q, k, v, i_gate, float("inf"), state), "f_t must be a finite number"),
        ((q, k, v, i_gate, f_gate.astype(np.float32), state), "f_t has dtype float32"),
        ((q, k, v, i_gate, f_gate, state[:2]), "state must be an MLSTMState"),
        ((q, k, v, i_gate, f_gate, state._replace(n=state.n[..., :2])), "state.n must have"),
        ((q, k, v, i_gate, f_gate, state._replace(m=state.m.astype(np.float32))),
         "state.m has dtype float32"),
    ]:  # fmt: skip
        if message is None:
            got = prepared(*bad)[0]
            np.testing.assert_array_equal(got, mlstm_step(*bad)[0])
            continue
        with pytest.raises((TypeError, ValueError), match=message):
            prepared(*bad)
        with pytest.raises((TypeError, ValueError), match=message):
            mlstm_step(*bad)
    with pytest.raises(ValueError, match="eps must be > 0"):
        prepare_mlstm_step(eps=0.0)(q, k, v, i_gate, f_gate)
    with pytest.raises(ValueError, match="scale must be finite"):
        prepare_mlstm_step(scale=float("nan"))(q, k, v, i_gate, f_gate)
    with pytest.raises(TypeError, match="takes 5 to 6 positional arguments"):
        prepared(q, k, v, i_gate)
    out, _ = prepared(q, k, v, i_gate, f_gate, state)  # good arguments again: computed
    np.testing.assert_array_equal(out, mlstm_step(q, k, v, i_gate, f_gate, state)[0])


def test_prepare_mlstm_step_leaves_its_inputs_alone(rng):
    arrays = [a[0] for a in mlstm_tokens(rng)]
    state = MLSTMState(rng.standard_normal((*LEAD, D_K, D_V)), rng.standard_normal((*LEAD, D_K)),
                       rng.uniform(0.0, 1.0, (*LEAD, 1)))  # fmt: skip
    copies = [a.copy() for a in (*arrays, *state)]
    prepared = prepare_mlstm_step()
    for _ in range(3):
        prepared(*arrays, state)
    for a, b in zip((*arrays, *state), copies, strict=True):
        np.testing.assert_array_equal(a, b)


# -- the selective scan ------------------------------------------------------------------


def scan_tokens(rng, lead=LEAD):
    return {
        "x": rng.standard_normal((T, *lead, D_V)),
        "dt": rng.standard_normal((T, *lead, D_V)),
        "B": rng.standard_normal((T, *lead, N)),
        "C": rng.standard_normal((T, *lead, N)),
        "z": rng.standard_normal((T, *lead, D_V)),
    }


@pytest.mark.slow_grid
@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("dt_softplus", [False, True])
def test_prepare_selective_scan_step_equals_selective_scan_step(backend, rng, extras, dt_softplus):
    x = {name: backend.from_numpy(a) for name, a in scan_tokens(rng).items()}
    A = backend.from_numpy(-np.exp(rng.standard_normal((D_V, N))))
    options = {}
    if extras:
        options = {"D": backend.from_numpy(rng.standard_normal(D_V)),
                   "dt_bias": backend.from_numpy(rng.standard_normal(D_V))}  # fmt: skip
    prepared = prepare_selective_scan_step(dt_softplus=dt_softplus)
    zs = x["z"] if extras else [None] * T

    def prepared_token(x_t, dt_t, B_t, C_t, z_t, h):
        return prepared(x_t, dt_t, A, B_t, C_t, h, z=z_t, **options)

    def plain_token(x_t, dt_t, B_t, C_t, z_t, h):
        return selective_scan_step(
            x_t, dt_t, A, B_t, C_t, h, z=z_t, dt_softplus=dt_softplus, **options
        )

    per_token = (x["x"], x["dt"], x["B"], x["C"], zs)
    assert_same(backend, run(prepared_token, None, *per_token), run(plain_token, None, *per_token))


def test_prepare_selective_scan_step_matches_the_reference(backend, rng):
    """Shared B and C (one group), a state shared by the batch: the float64 loop's outputs."""
    x = scan_tokens(rng)
    x["B"], x["C"] = x["B"][:, :1], x["C"][:, :1]
    A = -np.exp(rng.standard_normal((D_V, N)))
    D, bias = rng.standard_normal(D_V), rng.standard_normal(D_V)
    h0 = rng.standard_normal((1, 3, D_V, N))
    sequence = {name: np.moveaxis(a, 0, -2) for name, a in x.items()}  # (..., T, d)
    want, want_h = scan_reference(
        sequence["x"], sequence["dt"], A, sequence["B"], sequence["C"], D=D, z=sequence["z"],
        dt_bias=bias, dt_softplus=True, state=h0,
    )  # fmt: skip
    arrays = {name: backend.from_numpy(a) for name, a in x.items()}
    A_, D_, bias_ = (backend.from_numpy(a) for a in (A, D, bias))
    prepared, h = prepare_selective_scan_step(dt_softplus=True), backend.from_numpy(h0)
    for t in range(T):
        y, h = prepared(arrays["x"][t, ...], arrays["dt"][t, ...], A_, arrays["B"][t, ...],
                        arrays["C"][t, ...], h,
                        D=D_, z=arrays["z"][t, ...], dt_bias=bias_)  # fmt: skip
        np.testing.assert_allclose(backend.to_numpy(y), want[..., t, :], rtol=0, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(h), want_h, rtol=0, atol=1e-10)


def test_prepare_selective_scan_step_reads_a_new_A_at_every_call(rng):
    """``A``, ``D`` and ``dt_bias`` are arguments of every call: new values with the same
    signature are used, not the first call's."""
    x = {name: a[0] for name, a in scan_tokens(rng).items()}
    prepared = prepare_selective_scan_step()
    for _ in range(3):
        A, D, bias = -rng.uniform(0, 2, (D_V, N)), rng.standard_normal(D_V), rng.random(D_V)
        args = (x["x"], x["dt"], A, x["B"], x["C"])
        got = prepared(*args, D=D, dt_bias=bias)
        want = selective_scan_step(*args, D=D, dt_bias=bias)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_prepare_selective_scan_step_checks_every_new_signature(rng):
    x = {name: a[0] for name, a in scan_tokens(rng).items()}
    A = -np.exp(rng.standard_normal((D_V, N)))
    good = (x["x"], x["dt"], A, x["B"], x["C"])
    prepared = prepare_selective_scan_step()
    _, h = prepared(*good)
    for bad, keywords, message in [
        ((*good[:4], x["C"][..., :2], h), {}, "C_t has last axis 2"),
        ((good[0], good[1], A[:, :2], *good[3:], h), {}, r"A must have shape \(..., D, N\)"),
        ((*good, h[..., :2]), {}, "state must have shape"),
        ((*good, h.astype(np.float32)), {}, "state has dtype float32"),
        ((good[0].astype(np.float32), *good[1:], h), {}, "dt_t has dtype float64 but x_t"),
        ((*good, h), {"D": np.ones(2)}, "D has last axis 2"),
        ((*good, h), {"dt_bias": np.ones((4, D_V))}, "do not broadcast|broadcast"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            prepared(*bad, **keywords)
        with pytest.raises((TypeError, ValueError), match=message):
            selective_scan_step(*bad, **keywords)
    with pytest.raises(TypeError, match="dt_softplus must be True or False"):
        prepare_selective_scan_step(dt_softplus=1)(*good)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        prepared(*good, dt_softplus=True)
    out, _ = prepared(*good, h)  # good arguments again: computed
    np.testing.assert_array_equal(out, selective_scan_step(*good, h)[0])
