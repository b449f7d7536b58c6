"""Bad input gets a clear TypeError/ValueError that names the argument."""

from __future__ import annotations

import numpy as np
import pytest

from polylin import causal_linear_attention, linear_attention, masked_kernel_attention, step


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
