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


# -- decay and gating: gradients wrt q, k, v, log_decay, the initial state, map parameters -----
DECAY_SHAPES = {"head": (2, 1, 1), "token": (2, T, 1), "channel": (2, T, D_K)}


@pytest.mark.parametrize("kind", list(DECAY_SHAPES))
@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.only_backend(Backend.TORCH)
def test_gradcheck_with_decay(torch, method, kind):
    """Every input of a decayed call, the log decay and the initial state included."""
    q, k, v = small_inputs(torch, 8)
    g = torch.Generator().manual_seed(9)
    log_decay = -2 * torch.rand(DECAY_SHAPES[kind], generator=g, dtype=torch.float64)
    log_decay.requires_grad_(True)
    S0 = torch.rand((2, D_K, D_V), generator=g, dtype=torch.float64, requires_grad=True)
    z0 = torch.rand((2, D_K), generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, log_decay, S0, z0):
        out, state = causal_linear_attention(
            q, k, v, method=method, chunk_size=CHUNK, log_decay=log_decay,
            initial_state=LinearAttentionState(S0, z0), return_state=True,
            normalize=kind != "channel",
        )  # fmt: skip
        return out, state.S, state.z

    assert torch.autograd.gradcheck(f, (q, k, v, log_decay, S0, z0))


def _decayed_inputs(torch, seed, T_, kind):
    g = torch.Generator().manual_seed(seed)
    lead, d_k, d_v = (2, 3), 8, 5
    base = [torch.randn((*lead, T_, d), generator=g, dtype=torch.float64) for d in (d_k, d_k, d_v)]
    width = {"head": None, "token": 1, "channel": d_k}[kind]
    if width is None:
        decay = -torch.rand((3, 1, 1), generator=g, dtype=torch.float64)
    else:
        decay = -3 * torch.rand((*lead, T_, width), generator=g, dtype=torch.float64)
    S0 = torch.randn((*lead, d_k, d_v), generator=g, dtype=torch.float64)
    z0 = torch.rand((*lead, d_k), generator=g, dtype=torch.float64)
    W = torch.randn((d_k, d_k), generator=g, dtype=torch.float64) / 3  # feature-map weights
    weight = torch.randn((*lead, T_, d_v), generator=g, dtype=torch.float64)
    return [*base, decay, S0, z0, W], weight


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "unnormalized"])
@pytest.mark.parametrize("kind", ["head", "token", "channel"])
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.only_backend(Backend.TORCH)
def test_torch_decay_gradients_equal_quadratic(torch, method, kind, normalize):
    """q, k, v, log_decay, initial state and a trainable feature map's weights: the linear forms'
    gradients equal the quadratic form's to float64 round-off (several chunks, a partial one)."""
    base, weight = _decayed_inputs(torch, 10, 45, kind)

    def grads(m):
        xs = [x.clone().requires_grad_(True) for x in base]
        q, k, v, decay, S0, z0, W = xs

        def phi(x):
            return torch.nn.functional.elu(x @ W) + 1

        out, state = causal_linear_attention(
            q, k, v, phi, method=m, chunk_size=16, log_decay=decay, normalize=normalize,
            initial_state=LinearAttentionState(S0, z0), return_state=True,
        )  # fmt: skip
        ((out * weight).sum() + state.S.sum() + state.z.sum()).backward()
        return [x.grad for x in xs]

    for got, expected in zip(grads(method), grads("quadratic")):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["token", "channel"])
@pytest.mark.only_backend(Backend.JAX)
def test_jax_decay_gradients_equal_quadratic(backend, kind):
    """jax.grad under jit wrt q, k, v, log_decay and the initial state: chunked == quadratic."""
    import jax

    reason = Backend.TORCH.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[torch] {reason} (makes the inputs)")
    base, weight = _decayed_inputs(Backend.TORCH.module(), 11, 40, kind)
    q, k, v, decay, S0, z0, _ = (Backend.JAX.from_numpy(x.numpy()) for x in base)
    w = Backend.JAX.from_numpy(weight.numpy())

    def loss(method):
        def f(q, k, v, decay, S0, z0):
            out, state = causal_linear_attention(
                q, k, v, method=method, chunk_size=16, log_decay=decay,
                initial_state=LinearAttentionState(S0, z0), return_state=True,
            )  # fmt: skip
            return (out * w).sum() + state.S.sum() + state.z.sum()

        return jax.jit(jax.grad(f, argnums=tuple(range(6))))(q, k, v, decay, S0, z0)

    for a, b in zip(loss("chunked"), loss("quadratic")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-10)


@pytest.mark.only_backend(Backend.TORCH)
def test_backward_has_no_full_size_slices(torch):
    """The chunked backward is linear in T: autograd sees no slice of q, k, v or log_decay per
    block or per chunk (each would allocate and zero a gradient of the whole input). Counted
    in the graph: the slicing nodes whose input has a whole sequence (T rows) are a fixed few,
    whatever the number of blocks and chunks (slices of one block's intermediates are fine)."""
    import polylin._forms.linear.chunked as chunked

    def slice_nodes(T_, block_bytes):
        before = chunked.BLOCK_BYTES
        chunked.BLOCK_BYTES = block_bytes
        try:
            q, k, v = (torch.randn((2, T_, 8), dtype=torch.float64, requires_grad=True)
                       for _ in range(3))  # fmt: skip
            g = -torch.rand((2, T_, 8), dtype=torch.float64, requires_grad=True)
            out = causal_linear_attention(q, k, v, chunk_size=16, log_decay=g)
        finally:
            chunked.BLOCK_BYTES = before
        seen, stack, count = set(), [out.grad_fn], 0
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__.startswith(("SliceBackward", "SelectBackward")):
                count += T_ in tuple(node._saved_self_sym_sizes)
            stack.extend(n for n, _ in node.next_functions)
        return count

    one_block = slice_nodes(50, 2**30)
    some_blocks = slice_nodes(200, 2000)  # one chunk of 16 tokens per block
    many_blocks = slice_nodes(450, 2000)
    assert one_block <= 2
    assert some_blocks == many_blocks <= 2 * 4 + 2  # the whole blocks and the rest of q, k, v, g
