"""Gradients through every method: PyTorch autograd (gradcheck) and JAX (jax.grad)."""

from __future__ import annotations

import numpy as np
import pytest

import polylin
from polylin import LinearAttentionState, causal_linear_attention
from polylin.feature_maps import dpfp, favor_plus, taylor_exp
from polylin.testing import Backend

# T = 7 with chunk_size = 3: three chunks, the last one partial.
T, D_K, D_V, CHUNK = 7, 3, 2, 3


@pytest.fixture
def torch(backend):
    """The torch module, for the PyTorch autograd tests (generated for ``torch`` alone)."""
    return backend.module()


def small_inputs(torch, seed: int = 0, lead=(2,)):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn((*lead, T, d), generator=g, dtype=torch.float64, requires_grad=True)
        for d in (D_K, D_K, D_V)
    )


@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.only_backend(Backend.TORCH)
def test_gradcheck(torch, method):
    q, k, v = small_inputs(torch)

    def f(q, k, v):
        return causal_linear_attention(q, k, v, method=method, chunk_size=CHUNK)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.only_backend(Backend.TORCH)
def test_gradcheck_with_state_passing(torch, method):
    """Gradients flow into the initial state and out through the returned state."""
    q, k, v = small_inputs(torch, 1)
    g = torch.Generator().manual_seed(2)
    S0 = torch.rand((2, D_K, D_V), generator=g, dtype=torch.float64, requires_grad=True)
    z0 = torch.rand((2, D_K), generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, S0, z0):
        out, state = causal_linear_attention(
            q, k, v, method=method, chunk_size=CHUNK,
            initial_state=LinearAttentionState(S0, z0), return_state=True,
        )  # fmt: skip
        return out, state.S, state.z

    assert torch.autograd.gradcheck(f, (q, k, v, S0, z0))


@pytest.mark.parametrize(
    "feature_map",
    [favor_plus(D_K, 8, seed=0), taylor_exp, dpfp(nu=2)],
    ids=["favor_plus", "taylor_exp", "dpfp"],
)
@pytest.mark.only_backend(Backend.TORCH)
def test_gradcheck_feature_maps(torch, feature_map):
    q, k, v = small_inputs(torch, 3)

    def f(q, k, v):
        return causal_linear_attention(q, k, v, feature_map, chunk_size=CHUNK)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.only_backend(Backend.TORCH)
def test_torch_gradients_equal_quadratic(torch, method):
    """Gradients of a random projection of the output: linear forms vs the quadratic one."""
    g = torch.Generator().manual_seed(4)
    shapes = [(2, 3, 37, 8), (2, 3, 37, 8), (2, 3, 37, 5)]
    base = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    weight = torch.randn((2, 3, 37, 5), generator=g, dtype=torch.float64)

    def grads(m):
        xs = [x.clone().requires_grad_(True) for x in base]
        out = causal_linear_attention(*xs, method=m, chunk_size=8)
        (out * weight).sum().backward()
        return [x.grad for x in xs]

    for got, expected in zip(grads(method), grads("quadratic")):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


@pytest.mark.only_backend(Backend.TORCH)
def test_torch_float32_gradients_close_to_float64(torch):
    g = torch.Generator().manual_seed(5)
    base = [torch.randn((2, 100, 16), generator=g, dtype=torch.float64) for _ in range(3)]

    def grads(dtype):
        xs = [x.to(dtype).requires_grad_(True) for x in base]
        causal_linear_attention(*xs, chunk_size=16).square().sum().backward()
        return [x.grad.double() for x in xs]

    for got, expected in zip(grads(torch.float32), grads(torch.float64)):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.only_backend(Backend.JAX)
def test_jax_grad_through_favor_plus(backend):
    """jax.grad under jit with FAVOR+ (its projection is made inside the trace): chunked equals
    quadratic. The plain chunked/recurrent vs quadratic gradients are in tests/test_jax.py."""
    import jax

    rng = np.random.default_rng(6)
    q, k, v = (Backend.JAX.from_numpy(rng.standard_normal((2, 17, 6))) for _ in range(3))
    phi = favor_plus(6, 16, seed=0)

    def favor_loss(method):
        def f(q, k, v):
            return (causal_linear_attention(q, k, v, phi, method=method, chunk_size=8) ** 2).sum()

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    for a, b in zip(favor_loss("chunked")(q, k, v), favor_loss("quadratic")(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-10)


@pytest.mark.only_backend(Backend.JAX)
def test_jax_grad_matches_torch(backend):
    """The same loss on the same inputs: JAX and PyTorch agree on the gradients."""
    import jax

    reason = Backend.TORCH.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[torch] {reason}")
    torch = Backend.TORCH.module()
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((3, 20, 4)) for _ in range(3)]

    def f(q, k, v):
        return (causal_linear_attention(q, k, v, chunk_size=6) ** 2).sum()

    jax_grads = jax.grad(f, argnums=(0, 1, 2))(*(Backend.JAX.from_numpy(a) for a in arrays))
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    f(*xs).backward()
    for a, x in zip(jax_grads, xs):
        np.testing.assert_allclose(np.asarray(a), x.grad.numpy(), rtol=0, atol=1e-10)
