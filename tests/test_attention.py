"""Every backend x method x dtype against the float64 masked-kernel oracle, and each other."""

from __future__ import annotations

import numpy as np
import pytest

import polylin
from polylin import causal_linear_attention, linear_attention, masked_kernel_attention
from polylin.testing import Backend

from .reference import ATOL, elu_plus_one, masked_kernel, rounded

# (leading dims, T, d_k, d_v, chunk_size): T = 1, T not a multiple of C, C > T, d_k != d_v,
# 4-D inputs, several blocks of chunks.
SHAPES = {
    "T1": ((2,), 1, 4, 3, 8),
    "ragged": ((3,), 37, 8, 5, 8),
    "chunk>T": ((2,), 10, 6, 6, 64),
    "4d": ((2, 3), 33, 8, 4, 16),
    "2d": ((), 20, 5, 7, 4),
    "blocks": ((1,), 2100, 8, 8, 64),
}


def make_qkv(rng, lead, T, d_k, d_v, dtype="float64"):
    q = rng.standard_normal((*lead, T, d_k))
    k = rng.standard_normal((*lead, T, d_k))
    v = rng.standard_normal((*lead, T, d_v))
    return tuple(rounded(x, dtype) for x in (q, k, v))


def run(backend, fn, arrays, dtype, **kwargs):
    xs = [backend.from_numpy(a, dtype) for a in arrays]
    out = fn(*xs, **kwargs)
    return xs, out


#: 'blocks' (several cache blocks of chunks) targets the parallel forms; the per-token loop
#: gains nothing from a long sequence.
CASES = [(c, m) for m in polylin.METHODS for c in SHAPES if (c, m) != ("blocks", "recurrent")]


@pytest.mark.slow_grid(cover=("method", "dtype"), prefer={"case": "ragged"})
@pytest.mark.not_generated(
    reason="JAX runs the per-token loop op by op (jit would unroll it): every new shape and "
    "dtype compiles each step's operations again, ~0.7 s a case. Its 16-bit path is the chunked "
    "and quadratic forms' (tested here on JAX), and the recurrent form's is tested on the others.",
    backend=["jax", "jax:x32", "jax:cuda"],
    method="recurrent",
    dtype=["float16", "bfloat16"],
)
@pytest.mark.not_generated(
    reason="x64 off changes JAX's default dtypes, which float32 inputs exercise; its 16-bit "
    "inputs compute exactly as with x64 on (tests/test_jax.py runs them under jit)",
    backend="jax:x32",
    dtype=["float16", "bfloat16"],
)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("case", "method"), CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_causal_matches_reference(backend, method, dtype, case, rng):
    lead, T, d_k, d_v, chunk = SHAPES[case]
    arrays = make_qkv(rng, lead, T, d_k, d_v, dtype)
    xs, out = run(backend, causal_linear_attention, arrays, dtype, method=method, chunk_size=chunk)
    assert out.dtype == xs[0].dtype
    assert tuple(out.shape) == (*lead, T, d_v)
    expected = masked_kernel(*arrays)
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=ATOL[dtype])


def test_output_library_device_dtype(backend, rng):
    import array_api_compat

    arrays = make_qkv(rng, (2,), 9, 4, 3)
    xs = [backend.from_numpy(a, "float32") for a in arrays]
    for out in (
        causal_linear_attention(*xs),
        linear_attention(*xs),
        masked_kernel_attention(*xs),
    ):
        assert array_api_compat.array_namespace(out) is array_api_compat.array_namespace(xs[0])
        assert array_api_compat.device(out) == array_api_compat.device(xs[0])
        assert out.dtype == xs[0].dtype


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_backends_agree_with_numpy(backend, dtype, rng):
    """Same inputs, same dtype: every backend gives NumPy's answer to round-off."""
    arrays = make_qkv(rng, (2, 2), 45, 8, 8, dtype)
    expected = causal_linear_attention(*(a.astype(dtype) for a in arrays), chunk_size=16)
    _, out = run(backend, causal_linear_attention, arrays, dtype, chunk_size=16)
    tol = {"float64": 1e-12, "float32": 5e-6}[dtype]
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=tol)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_position_zero_equals_v0(backend, method, rng):
    """The design note's check: o_0 = v_0 for any q_0, up to the eps in the normalizer.

    Exactly, o_0 = v_0 a / (a + eps) with a = phi(q_0) . phi(k_0), so the error is bounded by
    |v_0| eps / (a + eps), however large or small q_0 is.
    """
    q, k, v = make_qkv(rng, (4,), 6, 5, 3)
    q[:2, 0] *= 30.0  # any q_0, large or tiny features
    q[2:, 0] *= 1e-3
    _, out = run(backend, causal_linear_attention, (q, k, v), "float64", method=method)
    a = (elu_plus_one(q[:, 0]) * elu_plus_one(k[:, 0])).sum(-1, keepdims=True)
    bound = np.abs(v[:, 0]) * 1e-6 / (a + 1e-6)
    assert np.all(np.abs(backend.to_numpy(out)[:, 0] - v[:, 0]) <= bound * (1 + 1e-9) + 1e-15)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_empty_sequence(backend, method):
    q = np.zeros((2, 0, 4))
    v = np.zeros((2, 0, 3))
    _, out = run(backend, causal_linear_attention, (q, q, v), "float32", method=method)
    assert tuple(out.shape) == (2, 0, 3)


@pytest.mark.slow_grid
@pytest.mark.parametrize("t_q", [1, 7, 30])
def test_linear_attention_cross(backend, t_q, rng):
    q = rng.standard_normal((2, t_q, 6))
    k = rng.standard_normal((2, 11, 6))
    v = rng.standard_normal((2, 11, 4))
    _, out = run(backend, linear_attention, (q, k, v), "float64")
    np.testing.assert_allclose(
        backend.to_numpy(out), masked_kernel(q, k, v, causal=False), rtol=0, atol=1e-10
    )


@pytest.mark.slow_grid
@pytest.mark.parametrize("causal", [True, False])
def test_masked_kernel_attention(backend, causal, rng):
    arrays = make_qkv(rng, (3,), 12, 4, 5)
    _, out = run(backend, masked_kernel_attention, arrays, "float64", causal=causal)
    np.testing.assert_allclose(
        backend.to_numpy(out), masked_kernel(*arrays, causal=causal), rtol=0, atol=1e-12
    )


def test_relu_feature_map(backend, rng):
    from polylin.feature_maps import RELU_EPS, relu

    arrays = make_qkv(rng, (2,), 19, 4, 3)
    _, out = run(backend, causal_linear_attention, arrays, "float64", feature_map=relu)
    expected = masked_kernel(*arrays, feature_map=lambda x: np.maximum(x, 0.0) + RELU_EPS)
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=1e-10)


def test_feature_map_positional_and_custom(rng):
    """The design note's signature: feature_map may be passed positionally."""
    arrays = make_qkv(rng, (2,), 9, 4, 3)
    square = lambda x: x * x + 0.1  # noqa: E731
    out = causal_linear_attention(*arrays, square)
    np.testing.assert_allclose(out, masked_kernel(*arrays, feature_map=square), atol=1e-12)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_inputs_unchanged(backend, method, rng):
    arrays = make_qkv(rng, (2,), 13, 4, 3)
    xs = [backend.from_numpy(a) for a in arrays]
    causal_linear_attention(*xs, method=method, chunk_size=4)
    for a, x in zip(arrays, xs):
        np.testing.assert_array_equal(backend.to_numpy(x), a)


@pytest.mark.only_backend(Backend.TORCH)
def test_seed_doctest_torch(backend):
    """The design note's doctest, verbatim, and its reference loop."""
    torch = backend.module()
    from .reference import seed_loop

    q = torch.randn(1, 4, 3)
    k = torch.randn(1, 4, 3)
    v = torch.randn(1, 4, 2)
    out = causal_linear_attention(q, k, v)
    assert out.shape == torch.Size([1, 4, 2])
    np.testing.assert_allclose(out.numpy(), seed_loop(q.numpy(), k.numpy(), v.numpy()), atol=2e-6)

