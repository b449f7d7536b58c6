"""Bad input gets a clear TypeError/ValueError that names the argument."""

from __future__ import annotations

import numpy as np
import pytest

from polylin import (
    causal_linear_attention,
    delta_rule_attention,
    delta_rule_step,
    linear_attention,
    masked_kernel_attention,
    step,
)


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((2, 5, 4)),
        rng.standard_normal((2, 5, 4)),
        rng.standard_normal((2, 5, 3)),
    )


ENTRY_POINTS = [causal_linear_attention, linear_attention, masked_kernel_attention]


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mixed_libraries(fn, qkv):
    torch = pytest.importorskip("torch")
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"^k is a torch array but q is a numpy array"):
        fn(q, torch.asarray(k), v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_not_an_array(fn, qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"^v must be an array, got list"):
        fn(q, k, v.tolist())


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.complex128])
def test_non_floating(fn, qkv, dtype):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"^q must have a real floating dtype"):
        fn(q.astype(dtype), k, v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_mixed_dtypes(fn, qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"^v has dtype float32 but q has dtype float64"):
        fn(q, k, v.astype(np.float32))


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_too_few_dimensions(fn, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"^k must have at least 2 dimensions"):
        fn(q, k[0, 0], v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_feature_size_mismatch(fn, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"^k has feature size d_k=3 but q has d_k=4"):
        fn(q, k[..., :3], v)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_key_value_length_mismatch(fn, qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"^v has sequence length 4 but k has 5"):
        fn(q, k, v[:, :4])


def test_causal_query_length_mismatch(qkv):
    q, k, v = qkv
    for fn in (causal_linear_attention, masked_kernel_attention):
        with pytest.raises(ValueError, match=r"^q has sequence length 3 but k has 5"):
            fn(q[:, :3], k, v)
    assert linear_attention(q[:, :3], k, v).shape == (2, 3, 3)  # cross-attention is fine


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_leading_dimension_mismatch(fn, qkv):
    q, k, v = qkv
    bad = np.concatenate([v, v[:1]])
    with pytest.raises(
        ValueError,
        match=r"^the leading dimensions of q \(2,\), k \(2,\), v \(3,\) do not broadcast "
        r"\(axis -1 has sizes \[2, 3\]",
    ):
        fn(q, k, bad)


def test_unknown_method(qkv):
    with pytest.raises(ValueError, match=r"^method must be one of .* got 'fast'"):
        causal_linear_attention(*qkv, method="fast")


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_too_small(qkv, chunk_size):
    with pytest.raises(ValueError, match=r"^chunk_size must be >= 1"):
        causal_linear_attention(*qkv, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [2.0, "8", True])
def test_chunk_size_not_int(qkv, chunk_size):
    with pytest.raises(TypeError, match=r"^chunk_size must be an int"):
        causal_linear_attention(*qkv, chunk_size=chunk_size)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan")])
def test_eps_not_positive(fn, qkv, eps):
    with pytest.raises(ValueError, match=r"^eps must be > 0"):
        fn(*qkv, eps=eps)


def test_feature_map_not_callable(qkv):
    with pytest.raises(TypeError, match=r"^feature_map must be a callable"):
        causal_linear_attention(*qkv, "elu")


def test_feature_map_bad_output(qkv):
    with pytest.raises(ValueError, match=r"^feature_map must return an array of shape"):
        causal_linear_attention(*qkv, lambda x: x[..., 0])


def test_arguments_are_positional_and_keyword_only(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError):
        causal_linear_attention(q=q, k=k, v=v)
    with pytest.raises(TypeError):
        causal_linear_attention(q, k, v, None, "chunked")


def test_step_errors(qkv):
    q, k, v = (x[:, 0] for x in qkv)
    with pytest.raises(ValueError, match=r"^k_t has feature size d_k=3 but q_t has d_k=4"):
        step(q, k[..., :3], v)
    with pytest.raises(
        ValueError, match=r"^the leading dimensions of q_t \(2,\), k_t \(2,\), v_t \(3,\)"
    ):
        step(q, k, np.concatenate([v, v[:1]]))
    with pytest.raises(TypeError, match=r"^q_t must have a real floating dtype"):
        step(q.astype(np.int32), k, v)


# -- issue 22: errors in the caller's terms ---------------------------------------------------
def test_per_token_shapes_in_the_callers_layout():
    """With seq_axis=1 a wrongly shaped gate or beta is shown as given, and the expected shape
    in the caller's (batch, T, heads, d) layout (not the moved (batch, heads, T, d))."""
    x = np.zeros((2, 5, 3, 4))  # (batch 2, T 5, heads 3, d 4)
    bad = np.zeros((2, 5, 3, 2))
    with pytest.raises(ValueError, match=r"mapped keys \(2, 5, 3, 4\) .*got shape \(2, 5, 3, 2\)$"):
        causal_linear_attention(x, x, x, log_decay=bad, seq_axis=1)
    with pytest.raises(
        ValueError, match=r"^beta must broadcast to \(2, 5, 3, 1\) .*got \(2, 5, 3, 2\)$"
    ):
        delta_rule_attention(x, x, x, bad, seq_axis=1)
    with pytest.raises(
        ValueError,
        match=r"^log_decay must broadcast against the keys \(2, 5, 3, 4\) .*got shape "
        r"\(2, 5, 3, 2\)$",
    ):
        delta_rule_attention(x, x, x, 0.5, log_decay=bad, seq_axis=1)


def test_time_first_two_dimensional_mask():
    """(T, batch, d) inputs: a 2-D mask means (batch, T); the message says so instead of
    offering the refused (T, batch) as valid."""
    x = np.zeros((5, 2, 4))  # (T 5, batch 2, d)
    message = (
        r"^attention_mask must have shape \(batch, T\) = \(2, 5\) .*transpose a \(T, batch\) "
        r"mask\); got \(5, 2\)$"
    )
    with pytest.raises(ValueError, match=message):
        causal_linear_attention(x, x, x, attention_mask=np.ones((5, 2), bool), seq_axis=0)
    out = causal_linear_attention(x, x, x, attention_mask=np.ones((2, 5), bool), seq_axis=0)
    assert out.shape == (5, 2, 4)


@pytest.mark.parametrize("value", ["no", None, 0, np.bool_(False), np.array(True)])
def test_bool_options_must_be_bools(value, qkv):
    q, k, v = qkv
    calls = {
        "return_state": [
            lambda: causal_linear_attention(q, k, v, return_state=value),
            lambda: delta_rule_attention(q, k, q, 0.5, return_state=value),
        ],
        "normalize": [
            lambda: causal_linear_attention(q, k, v, normalize=value),
            lambda: linear_attention(q, k, v, normalize=value),
            lambda: step(q[:, 0], k[:, 0], v[:, 0], normalize=value),
        ],
        "causal": [lambda: masked_kernel_attention(q, k, v, causal=value)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(TypeError, match=rf"^{name} must be True or False, got"):
                fn()


def test_traced_bool_options_must_be_static(qkv):
    jax = pytest.importorskip("jax")
    q, k, v = (jax.numpy.asarray(x) for x in qkv)
    for name in ("return_state", "normalize"):
        with pytest.raises(TypeError, match=rf"^{name} must be static under jax.jit"):
            jax.jit(lambda flag, name=name: causal_linear_attention(q, k, v, **{name: flag}))(True)
    with pytest.raises(TypeError, match=r"^return_state must be static under jax.jit"):
        jax.jit(lambda flag: delta_rule_attention(q, k, q, 0.5, return_state=flag))(False)


def test_unknown_dask_sizes_in_gates_beta_and_states():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(0)
    x = da.from_array(rng.standard_normal((4, 6, 3)), chunks=(2, -1, -1))

    def unknown(a):
        a = da.from_array(a, chunks=(2, *a.shape[1:]))
        return a[a.reshape(a.shape[0], -1)[:, 0] > -np.inf]  # Dask no longer knows the size

    g, beta = unknown(-rng.random((4, 6, 1))), unknown(np.full((4, 6, 1), 0.5))
    S, z = unknown(np.zeros((4, 3, 3))), unknown(np.ones((4, 3)))
    cases = [
        ("log_decay", lambda: causal_linear_attention(x, x, x, log_decay=g)),
        ("log_decay", lambda: delta_rule_attention(x, x, x, 0.5, log_decay=g)),
        ("beta", lambda: delta_rule_attention(x, x, x, beta)),
        ("initial_state.S", lambda: causal_linear_attention(x, x, x, initial_state=(S, z))),
        ("initial_state", lambda: delta_rule_attention(x, x, x, 0.5, initial_state=S)),
    ]
    for name, fn in cases:
        with pytest.raises(ValueError, match=rf"^{name} has unknown dimensions .*compute_chunk"):
            fn()


def test_delta_rule_step_token_with_time_axis():
    token = np.zeros((2, 4, 1, 8))  # (batch, heads, T=1, d): the T axis left in
    state = np.zeros((2, 4, 8, 8))
    with pytest.raises(ValueError, match=r"^q_t must have shape \(..., d\) .*drop the length-1 T"):
        delta_rule_step(token, token, token, 0.5, state)
    o_t, _ = delta_rule_step(token[..., 0, :], token[..., 0, :], token[..., 0, :], 0.5, state)
    assert o_t.shape == (2, 4, 8)


def test_layer_input_dtype_device_and_empty_sequence():
    torch = pytest.importorskip("torch")
    from polylin.torch import LinearAttention

    layer = LinearAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(
        TypeError,
        match=r"^x has dtype torch.float64 but the layer's weights .*torch.float32.*layer.to",
    ):
        layer(x.double())
    with pytest.raises(TypeError, match=r"^x_t has dtype torch.float64"):
        layer.step(x[:, 0].double())
    with pytest.raises(
        ValueError, match=r"^x is on device meta but the layer's weights are on cpu"
    ):
        layer(torch.empty(2, 5, 8, device="meta"))
    with pytest.raises(TypeError, match=r"^return_state must be True or False"):
        layer(x, return_state="no")
    empty, state = layer(x[:, :0], return_state=True)
    assert empty.shape == (2, 0, 8)
    assert torch.equal(state.S, torch.zeros(2, 2, 4, 4)) and torch.equal(
        state.z, torch.zeros(2, 2, 4)
    )
    assert LinearAttention(8, 2, causal=False)(x[:, :0]).shape == (2, 0, 8)
    assert layer.step(x[:0, 0])[0].shape == (0, 8)
