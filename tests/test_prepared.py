"""Prepared decoding steps: checked once per signature, equal to the plain steps to the bit."""

from __future__ import annotations

import numpy as np
import pytest

import polylin
from polylin import (
    LinearAttentionState,
    PreparedStep,
    delta_rule_step,
    dplr_delta_rule_step,
    prepare_delta_rule_step,
    prepare_dplr_step,
    prepare_step,
    step,
)
from polylin.feature_maps import dpfp

from .reference import masked_kernel

# Both sides run as called (no automatic jax.jit of the plain step): bitwise equality holds
# between two eager runs; under jit see test_under_jax_jit.
pytestmark = pytest.mark.eager

T, D_K, D_V = 6, 4, 3


def tokens(rng, lead=(2, 3)):
    """Per-token inputs of every step, as NumPy arrays ``(T, *lead, d)``."""
    q, k = rng.standard_normal((2, T, *lead, D_K))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    return {
        "q": q,
        "k": k,
        "v": rng.standard_normal((T, *lead, D_V)),
        "beta": rng.uniform(0.1, 0.9, (T, *lead, 1)),
        "g": -rng.uniform(0.0, 1.0, (T, *lead, 1)),
        "w": -rng.uniform(0.0, 1.0, (T, *lead, D_K)),
        "b": rng.uniform(0.0, 0.5, (T, *lead, D_K)),
    }


def loop(update, state, *per_token):
    outs = []
    for t in range(T):
        o, state = update(*(x[t] if isinstance(x, list) else x[t, ...] for x in per_token), state)
        outs.append(o)
    return outs, state


def assert_same(backend, got, want):
    """Outputs and states equal to the last bit."""
    (outs_got, state_got), (outs_want, state_want) = got, want
    for a, b in zip(outs_got, outs_want):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    parts_got = state_got if isinstance(state_got, tuple) else (state_got,)
    parts_want = state_want if isinstance(state_want, tuple) else (state_want,)
    for a, b in zip(parts_got, parts_want):
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))


@pytest.mark.slow_grid
@pytest.mark.parametrize("decay", [None, "number", "token", "channel"])
@pytest.mark.parametrize("masked", [False, True])
def test_prepare_step_equals_step(backend, rng, decay, masked):
    x = {name: backend.from_numpy(a) for name, a in tokens(rng).items()}
    mask = backend.from_numpy(np.array([[True, False, True]] * 2)) if masked else None
    g = {None: [None] * T, "number": [-0.3] * T, "token": x["g"], "channel": x["w"]}[decay]
    prepared = prepare_step(eps=1e-5)
    got = loop(
        lambda q, k, v, g, s: prepared(q, k, v, s, attention_mask=mask, log_decay=g),
        None, x["q"], x["k"], x["v"], g,
    )  # fmt: skip
    want = loop(
        lambda q, k, v, g, s: step(q, k, v, s, eps=1e-5, attention_mask=mask, log_decay=g),
        None, x["q"], x["k"], x["v"], g,
    )  # fmt: skip
    assert_same(backend, got, want)


def test_prepare_step_matches_the_reference(backend, rng):
    """A prepared step from a prefill's state continues the sequence (float64 reference)."""
    q, k, v = rng.standard_normal((3, 2, 10, D_K))
    qb, kb, vb = (backend.from_numpy(a) for a in (q, k, v))
    _, state = polylin.causal_linear_attention(
        qb[..., :4, :], kb[..., :4, :], vb[..., :4, :], return_state=True
    )
    prepared, expected = prepare_step(), masked_kernel(q, k, v)
    for t in range(4, 10):
        o_t, state = prepared(qb[..., t, :], kb[..., t, :], vb[..., t, :], state)
        np.testing.assert_allclose(backend.to_numpy(o_t), expected[..., t, :], atol=1e-12)


def test_prepare_step_with_a_feature_map(backend, rng):
    x = {name: backend.from_numpy(a) for name, a in tokens(rng).items()}
    phi = dpfp(2)  # 4 * d_k features
    prepared = prepare_step(phi)
    got = loop(lambda q, k, v, s: prepared(q, k, v, s), None, x["q"], x["k"], x["v"])
    want = loop(lambda q, k, v, s: step(q, k, v, s, phi), None, x["q"], x["k"], x["v"])
    assert tuple(got[1].S.shape) == (2, 3, 4 * D_K, D_V)
    assert_same(backend, got, want)


@pytest.mark.slow_grid
@pytest.mark.parametrize("gate", [None, "number", "token", "channel"])
@pytest.mark.parametrize(("scale", "qk_l2norm"), [(1.0, False), (0.5, True)])
@pytest.mark.parametrize("beta_kind", ["number", "array"])
def test_prepare_delta_rule_step_equals_delta_rule_step(
    backend, rng, gate, scale, qk_l2norm, beta_kind
):
    x = {name: backend.from_numpy(a) for name, a in tokens(rng).items()}
    g = {None: [None] * T, "number": [-0.2] * T, "token": x["g"], "channel": x["w"]}[gate]
    beta = [0.7] * T if beta_kind == "number" else x["beta"]
    prepared = prepare_delta_rule_step(scale=scale, qk_l2norm=qk_l2norm)
    options = {"scale": scale, "qk_l2norm": qk_l2norm}
    got = loop(
        lambda q, k, v, be, g, s: prepared(q, k, v, be, s, log_decay=g),
        None, x["q"], x["k"], x["v"], beta, g,
    )  # fmt: skip
    want = loop(
        lambda q, k, v, be, g, s: delta_rule_step(q, k, v, be, s, log_decay=g, **options),
        None, x["q"], x["k"], x["v"], beta, g,
    )  # fmt: skip
    assert_same(backend, got, want)


@pytest.mark.slow_grid
@pytest.mark.parametrize("gate", [None, "number", "channel"])
def test_prepare_dplr_step_equals_dplr_step(backend, rng, gate):
    x = {name: backend.from_numpy(a) for name, a in tokens(rng).items()}
    g = {None: [None] * T, "number": [-0.2] * T, "channel": x["w"]}[gate]
    a = -x["k"]
    prepared = prepare_dplr_step(scale=0.5)
    got = loop(
        lambda q, k, v, a, b, g, s: prepared(q, k, v, a, b, s, log_decay=g),
        None, x["q"], x["k"], x["v"], a, x["b"], g,
    )  # fmt: skip
    want = loop(
        lambda q, k, v, a, b, g, s: dplr_delta_rule_step(q, k, v, a, b, s, log_decay=g, scale=0.5),
        None, x["q"], x["k"], x["v"], a, x["b"], g,
    )  # fmt: skip
    assert_same(backend, got, want)


def _delta_token(q, k, v, beta, g, S, scale):
    """One token of the gated delta rule in float64, from its formula: ``S' = diag(exp(g)) S``,
    ``S = S' + beta k (v - S'^T k)^T``, ``o = scale S^T q`` (``g`` per token or per channel,
    values above 0 taken as 0)."""
    S = np.exp(np.minimum(np.atleast_1d(g), 0.0))[..., :, None] * S
    S = S + k[..., :, None] * (beta * (v - np.einsum("...k,...kv->...v", k, S)))[..., None, :]
    return scale * np.einsum("...k,...kv->...v", q, S), S


def _dplr_token(q, k, v, a, b, g, S, scale):
    """One token of the generalized rule in float64: ``S = diag(exp(g)) S + b (a^T S) + k v^T``,
    ``o = scale S^T q``."""
    read = np.einsum("...k,...kv->...v", a, S)
    S = np.exp(np.minimum(np.atleast_1d(g), 0.0))[..., :, None] * S
    S = S + b[..., :, None] * read[..., None, :] + k[..., :, None] * v[..., None, :]
    return scale * np.einsum("...k,...kv->...v", q, S), S


#: Per-token coefficients and gates as a model passes them (their full shapes), broadcast from
#: fewer dimensions, and as 0-d arrays: shapes for leading dimensions (2, 3).
FORMS = {
    "as given": {"beta": (2, 3, 1), "g": (2, 3, D_K), "a": (2, 3, D_K), "b": (2, 3, D_K)},
    "broadcast": {"beta": (3, 1), "g": (1,), "a": (3, D_K), "b": (D_K,)},
    "0-d": {"beta": (), "g": (), "a": (2, 3, D_K), "b": (1, D_K)},
    # a gate of the full shape in float32 (a log decay may have its own floating dtype)
    "float32 gate": {"beta": (2, 3, 1), "g": (2, 3, 1), "a": (2, 3, D_K), "b": (2, 3, D_K)},
}


@pytest.mark.slow_grid
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("rule", ["delta", "dplr"])
def test_every_form_of_the_per_token_arrays_matches_the_reference(
    backend, rng, form, dtype, rule
):
    """The prepared steps use arrays of the full shape in the work dtype as given, and convert
    the others at every call; both give a float64 reference's outputs and states."""
    from .reference import rounded

    shapes, scale = FORMS[form], 0.5
    x = tokens(rng)
    q, k, v = (rounded(x[name], dtype) for name in "qkv")
    draws = {
        "beta": rng.uniform(0.1, 0.9, (T, *shapes["beta"])),
        "g": rng.uniform(-1.0, 0.2, (T, *shapes["g"])),  # values above 0 are taken as 0
        "a": -0.5 * rng.uniform(0.0, 1.0, (T, *shapes["a"])),
        "b": 0.5 * rng.uniform(0.0, 1.0, (T, *shapes["b"])),
    }
    names = ("beta", "g") if rule == "delta" else ("a", "b", "g")
    dtypes = [
        "float32" if name == "g" and form == "float32 gate" else dtype for name in names
    ]
    per_token = [rounded(draws[name], t) for name, t in zip(names, dtypes)]
    if rule == "delta":
        prepared, token = prepare_delta_rule_step(scale=scale), _delta_token
    else:
        prepared, token = prepare_dplr_step(scale=scale), _dplr_token
    # float16: one rounding of outputs of size ~1; the state accumulates in float32.
    atol, state_atol = (1e-12, 1e-12) if dtype == "float64" else (4e-3, 1e-5)
    work = "float64" if dtype == "float64" else "float32"
    S, S_want = None, np.zeros((2, 3, D_K, D_V))
    for t in range(T):
        arrays = zip((q, k, v, *per_token), [dtype] * 3 + dtypes)
        *args, g = (backend.from_numpy(a[t], a_dtype) for a, a_dtype in arrays)
        o, S = prepared(*args, S, log_decay=g)
        o_want, S_want = token(q[t], k[t], v[t], *(a[t] for a in per_token), S_want, scale)
        np.testing.assert_allclose(backend.to_numpy(o), o_want, rtol=0, atol=atol)
        np.testing.assert_allclose(backend.to_numpy(S), S_want, rtol=0, atol=state_atol)
        assert o.dtype == args[0].dtype and S.dtype == backend.from_numpy(q[t], work).dtype
    # Both ways of running were taken: the one that uses the arrays as given, and the other.
    assert prepared._plan.as_given is (form == "as given" and dtype == "float64")


def test_grouped_heads(backend, rng):
    """Keys shared by groups of value heads: the state broadcast once, as the plain step does."""
    q, k = (backend.from_numpy(rng.standard_normal((2, 1, D_K))) for _ in range(2))
    v = backend.from_numpy(rng.standard_normal((2, 4, D_V)))
    beta = backend.from_numpy(rng.uniform(0.1, 0.9, (2, 4, 1)))
    prepared = prepare_delta_rule_step()
    got = loop(lambda s: prepared(q, k, v, beta, s), None)
    want = loop(lambda s: delta_rule_step(q, k, v, beta, s), None)
    assert_same(backend, got, want)
    assert tuple(got[1].shape) == (2, 4, D_K, D_V)


def test_a_new_signature_is_checked_again(rng):
    """Every error of the plain step, after the prepared step has run with good arguments."""
    q, k, v = rng.standard_normal((3, 2, D_K))
    prepared = prepare_delta_rule_step()
    _, S = prepared(q, k, v, 0.5)
    for bad, message in [
        ((q, k, v, 3.0, S), "beta_t must be a finite number in"),  # a number's value changed
        ((q, k[:, :2], v, 0.5, S), "k_t has feature size d_k=2"),  # a shape changed
        ((q, k, np.ones((3, D_K)), 0.5, S), "do not broadcast"),
        ((q, k, v, 0.5, S[:, :2]), "state must have shape"),
        ((q, k, v, 0.5, S.astype(np.float32)), "state has dtype float32"),
        ((q.astype(np.float32), k, v, 0.5, S), "k_t has dtype float64 but q_t has dtype float32"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            prepared(*bad)
        with pytest.raises((TypeError, ValueError), match=message):
            delta_rule_step(*bad)
    with pytest.raises(ValueError, match="log_decay must be a finite number <= 0"):
        prepared(q, k, v, 0.5, S, log_decay=0.5)
    out, _ = prepared(q, k, v, 0.5, S)  # good arguments again: computed, not refused
    np.testing.assert_array_equal(out, delta_rule_step(q, k, v, 0.5, S)[0])


def test_options_are_checked_at_the_first_call(rng):
    q, k, v = rng.standard_normal((3, 2, D_K))
    with pytest.raises(ValueError, match="eps must be > 0"):
        prepare_step(eps=-1.0)(q, k, v)
    with pytest.raises(TypeError, match="normalize must be True or False"):
        prepare_step(normalize="yes")(q, k, v)
    with pytest.raises(TypeError, match="qk_l2norm must be True or False"):
        prepare_delta_rule_step(qk_l2norm=1)(q, k, v, 0.5)
    with pytest.raises(ValueError, match="scale must be finite"):
        prepare_dplr_step(scale=float("inf"))(q, k, v, -k, k)


def test_a_batch_change_is_planned_anew(rng):
    """Continuous batching: a step whose batch grows computes as the plain step does."""
    prepared = prepare_step()
    state = None
    for batch in (2, 2, 3, 3, 1):
        q, k, v = rng.standard_normal((3, batch, D_K))
        if state is not None and state.S.shape[0] != batch:
            state = LinearAttentionState(state.S[:1].repeat(batch, 0), state.z[:1].repeat(batch, 0))
        got, new = prepared(q, k, v, state)
        want, _ = step(q, k, v, state)
        np.testing.assert_array_equal(got, want)
        state = new


def test_inputs_unchanged(backend, rng):
    x = tokens(rng)
    arrays = {name: backend.from_numpy(a[0, ...]) for name, a in x.items()}
    S0 = rng.standard_normal((2, 3, D_K, D_V))
    S = backend.from_numpy(S0)
    prepared = prepare_delta_rule_step(qk_l2norm=True)
    for _ in range(3):
        prepared(arrays["q"], arrays["k"], arrays["v"], arrays["beta"], S, log_decay=arrays["w"])
    for name, a in arrays.items():
        np.testing.assert_array_equal(backend.to_numpy(a), x[name][0])
    np.testing.assert_array_equal(backend.to_numpy(S), S0)


def test_under_jax_jit(rng):
    """A prepared step inside a jitted function: traced arrays are checked like the plain step."""
    jax = pytest.importorskip("jax")
    x = {name: jax.numpy.asarray(a) for name, a in tokens(rng).items()}
    prepared = prepare_delta_rule_step()

    @jax.jit
    def decode(q, k, v, beta, g, S):
        return prepared(q, k, v, beta, S, log_decay=g)

    S = None
    _, S = delta_rule_step(x["q"][0], x["k"][0], x["v"][0], x["beta"][0], S, log_decay=x["g"][0])
    S_plain = S
    for t in range(1, T):
        o, S = decode(x["q"][t], x["k"][t], x["v"][t], x["beta"][t], x["g"][t], S)
        o_plain, S_plain = delta_rule_step(
            x["q"][t], x["k"][t], x["v"][t], x["beta"][t], S_plain, log_decay=x["g"][t]
        )
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_plain), rtol=1e-12, atol=1e-12)


def test_call_arguments_as_the_plain_step(rng):
    """The prepared steps take their arguments as the plain steps do; others are TypeErrors."""
    q, k, v = rng.standard_normal((3, 2, D_K))
    decode = prepare_step()
    _, state = decode(q, k, v)
    np.testing.assert_array_equal(decode(q, k, v, state=state)[0], step(q, k, v, state)[0])
    with pytest.raises(TypeError, match=r"step takes 3 to 4 positional arguments .* got 2"):
        decode(q, k)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['beta'\]"):
        decode(q, k, v, beta=0.5)
    with pytest.raises(TypeError, match="both by position and by keyword"):
        decode(q, k, v, state, state=state)
    delta = prepare_delta_rule_step()
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['state'\]"):
        delta(q, k, v, 0.5, state=None)  # positional-only, as in delta_rule_step
    with pytest.raises(TypeError, match="delta_rule_step takes 4 to 5 positional"):
        delta(q, k, v, 0.5, None, None)
    assert "dplr_delta_rule_step(q_t, k_t, v_t, a_t, b_t, state, log_decay)" in repr(
        prepare_dplr_step()
    )


def test_a_signature_hashes_whatever_the_device_type():
    """CuPy's ``Device`` does not hash: a signature (a key of ``polylin.compat.fla``'s decoding
    plans) still does, and tells devices apart by their ``repr``."""

    class Device:
        __hash__ = None  # type: ignore[assignment]

        def __init__(self, n: int) -> None:
            self.n = n

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Device) and other.n == self.n

        def __repr__(self) -> str:
            return f"<Device {self.n}>"

    class Array:
        shape, dtype = (2, 3), "float32"

        def __init__(self, n: int) -> None:
            self.device = Device(n)

    first, again, other = (PreparedStep.signature((Array(n), 0.5)) for n in (0, 0, 1))
    assert hash(first) == hash(again) and first == again and first != other
    assert {first: 1}[again] == 1
