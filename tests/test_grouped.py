"""Grouped heads: the leading dimensions of q, k, v (and of the gate, the mask and the state)
broadcast, and nothing is copied per group.

Grouped value attention is ``q, k`` of shape ``(B, H, 1, T, d_k)`` against ``v`` of shape
``(B, H, G, T, d_v)``; Mamba-2's groups of B and C shared by several heads are the same
broadcast with the identity feature map, ``normalize=False`` and a gate per head. Every backend
x method x gate kind x ``normalize`` x G in (2, 4) is compared with the same call on q and k
repeated per group (a copy made here) and with the independent float64 loop
:func:`tests.reference.decayed_loop`; then masks, packed sequences, ``seq_axis=1``, state
passing into ``step``, the non-causal entry points, gradients (PyTorch, JAX), and on PyTorch a
watch over every operation of a grouped forward+backward for an array the size of a per-group
copy of the queries or keys.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

import polylin
from polylin import (
    LinearAttentionState,
    causal_linear_attention,
    linear_attention,
    masked_kernel_attention,
    step,
)
from polylin.feature_maps import identity
from polylin.testing import Backend

from .reference import decayed_loop, elu_plus_one, masked_kernel

B, H, D_K, D_V = 2, 3, 4, 3
TOL = {"rtol": 1e-9, "atol": 1e-10}
#: log decays: None, a float, a scalar per token and group (Mamba-2's per-head gate), a scalar
#: per token shared by the group, one per channel and group (inherently per group), one per
#: channel shared by the group.
KINDS = ("none", "float", "token", "token-shared", "channel", "channel-shared")
# (T, chunk_size): several chunks and a partial last one (per channel: rounded up to 32); the
# chunked form's five run a per-group gate with the heads as columns (_forms/linear/grouped).
SHAPES = {"chunked": (37, 8), "quadratic": (29, 8), "recurrent": (9, 8)}


def grouped_inputs(rng, G, T, lead=(B, H)):
    """q, k ``(*lead, 1, T, d_k)`` and v ``(*lead, G, T, d_v)`` (float64 NumPy)."""
    q, k = (rng.standard_normal((*lead, 1, T, D_K)) for _ in range(2))
    return q, k, rng.standard_normal((*lead, G, T, D_V))


def gate(kind, rng, G, T, lead=(B, H)):
    if kind == "none":
        return None
    if kind == "float":
        return -0.3
    groups = 1 if kind.endswith("shared") else G
    width = D_K if kind.startswith("channel") else 1
    return -rng.uniform(0, 2, (*lead, groups, T, width))


def repeated(x, G):
    """``x`` with its group axis (-3) repeated G times: a copy, as users write it today."""
    return np.broadcast_to(x, (*x.shape[:-3], G, *x.shape[-2:])).copy()


def on(backend, x):
    return x if x is None or isinstance(x, float) else backend.from_numpy(np.asarray(x))


def check(backend, got, want):
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL)


@pytest.mark.slow_grid(cover=("method", "kind"))
@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "unnormalized"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", polylin.METHODS)
def test_grouped_matches_repeated_and_reference(backend, method, kind, normalize, G, rng):
    T, chunk = SHAPES[method]
    q, k, v = grouped_inputs(rng, G, T)
    g = gate(kind, rng, G, T)
    expected, S, z = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=normalize)
    options = dict(method=method, chunk_size=chunk, normalize=normalize, return_state=True)
    out, state = causal_linear_attention(
        *(on(backend, x) for x in (q, k, v)), log_decay=on(backend, g), **options
    )
    assert tuple(out.shape) == (B, H, G, T, D_V)
    assert tuple(state.S.shape) == (B, H, G, D_K, D_V) and tuple(state.z.shape) == (B, H, G, D_K)
    check(backend, out, expected)
    check(backend, state.S, S)
    check(backend, state.z, z)
    flat, flat_state = causal_linear_attention(
        *(on(backend, x) for x in (repeated(q, G), repeated(k, G), v)),
        log_decay=on(backend, g),
        **options,
    )
    np.testing.assert_allclose(
        backend.to_numpy(out), backend.to_numpy(flat), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        backend.to_numpy(state.S), backend.to_numpy(flat_state.S), rtol=1e-12, atol=1e-12
    )


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_shared_values_per_query_group(backend, method, rng):
    """The other way round (several query heads reading one key/value head, as in multi-query
    attention): q ``(B, H, G, T, d)`` against k, v ``(B, H, 1, T, d)``; also ranks that differ
    (v without the group axis) broadcast from the right."""
    T, chunk = SHAPES[method]
    G = 3
    q = rng.standard_normal((B, H, G, T, D_K))
    k = rng.standard_normal((B, H, 1, T, D_K))
    v = rng.standard_normal((H, 1, T, D_V))  # no batch axis: shared by the batch
    g = -rng.uniform(0, 1, (B, 1, 1, T, 1))
    expected, S, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g)
    out, state = causal_linear_attention(
        *(on(backend, x) for x in (q, k, v)), method=method, chunk_size=chunk,
        log_decay=on(backend, g), return_state=True,
    )  # fmt: skip
    check(backend, out, expected)
    check(backend, state.S, S)


MASKS = ("2-D", "full rank, shared by the group", "full rank, per group")


@pytest.mark.slow_grid
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("method", polylin.METHODS)
def test_masks(backend, method, mask_kind, rng):
    """Left padding in a (batch, T) mask, and full-rank masks with and without the group axis;
    the masked positions hold NaN, which must reach no real output."""
    G = 4
    T, chunk = SHAPES[method]
    q, k, v = grouped_inputs(rng, G, T)
    g = gate("token", rng, G, T)
    keep = np.ones((B, T), dtype=bool)
    keep[1, :3] = False  # left padding
    if mask_kind == "2-D":
        mask, ref_mask = keep, keep[:, None, None, :]
    else:
        groups = 1 if "shared" in mask_kind else G
        mask = rng.random((B, H, groups, T)) > 0.3
        mask[..., 0] = True
        ref_mask = mask
    expected, S, z = decayed_loop(
        elu_plus_one(q), elu_plus_one(k), v, g, mask=np.broadcast_to(ref_mask, (B, H, G, T))
    )
    full = np.broadcast_to(ref_mask, (B, H, G, T))
    spoiled = [x.copy() for x in (q, k, v)]
    unused = ~full.any(axis=2, keepdims=True)  # (B, H, 1, T): no group reads q_t and k_t
    spoiled[0][unused] = spoiled[1][unused] = np.nan
    spoiled[2][~full] = np.nan
    out, state = causal_linear_attention(
        *(on(backend, x) for x in spoiled), method=method, chunk_size=chunk,
        log_decay=on(backend, g), attention_mask=on(backend, mask), return_state=True,
    )  # fmt: skip
    check(backend, out, expected)
    check(backend, state.S, S)
    check(backend, state.z, z)


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_cu_seqlens(backend, method, rng):
    G, offsets = 2, [0, 5, 6, 17]
    T = offsets[-1]
    q, k, v = grouped_inputs(rng, G, T)
    g = gate("token", rng, G, T)
    S0 = rng.standard_normal((B, H, G, len(offsets) - 1, D_K, D_V))
    z0 = rng.uniform(0, 1, (B, H, G, len(offsets) - 1, D_K))
    out, state = causal_linear_attention(
        *(on(backend, x) for x in (q, k, v)), method=method, chunk_size=4,
        log_decay=on(backend, g), cu_seqlens=offsets, return_state=True,
        initial_state=LinearAttentionState(on(backend, S0), on(backend, z0)),
    )  # fmt: skip
    for i, (a, b) in enumerate(pairwise(offsets)):
        part = (slice(None),) * 3 + (slice(a, b),)
        expected, S, z = decayed_loop(
            elu_plus_one(q[part]), elu_plus_one(k[part]), v[part], g[part],
            S0=S0[..., i, :, :], z0=z0[..., i, :],
        )  # fmt: skip
        check(backend, out[..., a:b, :], expected)
        check(backend, state.S[..., i, :, :], S)
        check(backend, state.z[..., i, :], z)


def naive_grouped_scan(C, B_, x, dt, A, heads_per_group):
    """Mamba-2's SSD in its own layout, token by token, head h reading group h // heads_per_group:
    ``h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t h_t``. Shapes: C, B_
    ``(b, L, groups, n)``; x ``(b, L, heads, p)``; dt ``(b, L, heads)``; A ``(heads,)``."""
    batch, L, heads, p = x.shape
    y = np.zeros_like(x)
    for b in range(batch):
        for head in range(heads):
            group = head // heads_per_group
            state = np.zeros((C.shape[-1], p))
            for t in range(L):
                dt_t = dt[b, t, head]
                state = np.exp(A[head] * dt_t) * state + dt_t * np.outer(
                    B_[b, t, group], x[b, t, head]
                )
                y[b, t, head] = C[b, t, group] @ state
    return y


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", polylin.METHODS)
def test_mamba2_groups_seq_axis_1(backend, method, rng):
    """Mamba-2 with ``ngroups`` groups of B and C, each shared by ``heads // ngroups`` heads, in
    the ``(b, L, heads, d)`` layout: ``seq_axis=1``, a group axis of 1 for B and C."""
    batch, L, groups, per_group, n, p = 2, SHAPES[method][0], 2, 3, 5, 4
    heads = groups * per_group
    C, B_ = rng.standard_normal((2, batch, L, groups, n))
    x = rng.standard_normal((batch, L, heads, p))
    dt = np.log1p(np.exp(rng.standard_normal((batch, L, heads))))  # softplus
    A = -np.exp(rng.standard_normal(heads))
    expected = naive_grouped_scan(C, B_, x, dt, A, per_group)
    y = causal_linear_attention(
        on(backend, C[:, :, :, None, :]),  # (b, L, groups, 1, n)
        on(backend, B_[:, :, :, None, :]),
        on(backend, (x * dt[..., None]).reshape(batch, L, groups, per_group, p)),
        identity, method=method, chunk_size=8, seq_axis=1, normalize=False,
        log_decay=on(backend, (A * dt).reshape(batch, L, groups, per_group, 1)),
    )  # fmt: skip
    assert tuple(y.shape) == (batch, L, groups, per_group, p)
    check(backend, y, expected.reshape(batch, L, groups, per_group, p))


@pytest.mark.slow_grid
@pytest.mark.parametrize("kind", ["token", "channel-shared"])
def test_prefill_then_step(backend, kind, rng):
    """A grouped chunked prefill, then grouped decoding steps (q_t, k_t ``(B, H, 1, d_k)``,
    v_t and the gate ``(B, H, G, ...)``), from an initial state shared by the batch; the state
    also continues in the other methods."""
    G, T, prefill = 4, 13, 9
    q, k, v = grouped_inputs(rng, G, T)
    g = gate(kind, rng, G, T)
    S0 = rng.standard_normal((1, H, G, D_K, D_V))  # broadcasts over the batch
    z0 = rng.uniform(0, 1, (1, H, G, D_K))
    expected, S, z = decayed_loop(
        elu_plus_one(q), elu_plus_one(k), v, g, S0=np.broadcast_to(S0, (B, H, G, D_K, D_V)),
        z0=np.broadcast_to(z0, (B, H, G, D_K)),
    )  # fmt: skip
    xs = [on(backend, x) for x in (q, k, v, g)]
    head = [x[..., :prefill, :] for x in xs]
    out, state = causal_linear_attention(
        *head[:3], log_decay=head[3], chunk_size=4, return_state=True,
        initial_state=LinearAttentionState(on(backend, S0), on(backend, z0)),
    )  # fmt: skip
    check(backend, out, expected[..., :prefill, :])
    for method in polylin.METHODS:
        rest = causal_linear_attention(
            *(x[..., prefill:, :] for x in xs[:3]), log_decay=xs[3][..., prefill:, :],
            method=method, chunk_size=2, initial_state=state,
        )  # fmt: skip
        check(backend, rest, expected[..., prefill:, :])
    for t in range(prefill, T):
        o_t, state = step(*(x[..., t, :] for x in xs[:3]), state, log_decay=xs[3][..., t, :])
        assert tuple(o_t.shape) == (B, H, G, D_V)
        check(backend, o_t, expected[..., t, :])
    check(backend, state.S, S)
    check(backend, state.z, z)


def test_step_mask(backend, rng):
    """A decoding step's (batch,) mask: rows that do not take the token keep their state."""
    G = 2
    q, k, v = (x[..., 0, :] for x in grouped_inputs(rng, G, 1))
    S0, z0 = rng.standard_normal((B, H, G, D_K, D_V)), rng.uniform(0, 1, (B, H, G, D_K))
    mask = np.array([True, False])
    state = LinearAttentionState(on(backend, S0), on(backend, z0))
    o, state = step(*(on(backend, x) for x in (q, k, v)), state, attention_mask=on(backend, mask))
    expected, S, _ = decayed_loop(
        elu_plus_one(q[..., None, :]), elu_plus_one(k[..., None, :]), v[..., None, :], S0=S0, z0=z0
    )
    check(backend, o[0, ...], expected[0, ..., 0, :])
    check(backend, o[1, ...], np.zeros((H, G, D_V)))
    check(backend, state.S[0, ...], S[0])
    check(backend, state.S[1, ...], S0[1])


def test_non_causal_entry_points(backend, rng):
    G = 4
    q = rng.standard_normal((B, H, 1, 5, D_K))
    k = rng.standard_normal((B, H, 1, 7, D_K))
    v = rng.standard_normal((B, H, G, 7, D_V))
    xs = [on(backend, x) for x in (q, k, v)]
    check(backend, linear_attention(*xs), masked_kernel(q, k, v, causal=False))
    unnormalized = elu_plus_one(q) @ (np.swapaxes(elu_plus_one(k), -1, -2) @ v)
    check(backend, linear_attention(*xs, normalize=False), unnormalized)
    mask = rng.random((B, 7)) > 0.3
    check(
        backend,
        linear_attention(*xs, attention_mask=on(backend, mask)),
        masked_kernel(q, k, v, causal=False, mask=mask[:, None, None, :]),
    )
    check(backend, masked_kernel_attention(*xs, causal=False), masked_kernel(q, k, v, causal=False))
    q, k, v = grouped_inputs(rng, G, 11)
    g = gate("token", rng, G, 11)
    xs = [on(backend, x) for x in (q, k, v)]
    check(backend, masked_kernel_attention(*xs), masked_kernel(q, k, v))
    expected, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=False)
    check(
        backend, masked_kernel_attention(*xs, log_decay=on(backend, g), normalize=False), expected
    )


def test_shapes_that_do_not_broadcast():
    q = k = np.zeros((2, 3, 1, 5, 4))
    with pytest.raises(
        ValueError,
        match=r"^the leading dimensions of q \(2, 3, 1\), k \(2, 3, 1\), v \(2, 2, 4\) do not "
        r"broadcast \(axis -2 has sizes \[2, 3\]",
    ):
        causal_linear_attention(q, k, np.zeros((2, 2, 4, 5, 3)))
    v = np.zeros((2, 3, 4, 5, 3))
    with pytest.raises(ValueError, match=r"log_decay"):
        causal_linear_attention(q, k, v, log_decay=np.zeros((2, 3, 5, 5, 1)))
    with pytest.raises(ValueError, match=r"initial_state\.S must have shape \(2, 3, 4, 4, 3\)"):
        causal_linear_attention(
            q, k, v, initial_state=LinearAttentionState(np.zeros((2, 3, 2, 4, 3)), np.zeros(4))
        )
    with pytest.raises(ValueError, match=r"attention_mask"):
        causal_linear_attention(q, k, v, attention_mask=np.ones((2, 3, 3, 5), dtype=bool))


# Gradients: PyTorch and JAX, w.r.t. q, k, v, the gate and the initial state, against the same
# function with q and k repeated inside it (autograd sums the copies' gradients), and gradcheck.
T_GRAD, G_GRAD = 7, 3


def grad_inputs(rng, kind):
    q, k, v = grouped_inputs(rng, G_GRAD, T_GRAD, lead=(2,))
    g = gate(kind, rng, G_GRAD, T_GRAD, lead=(2,))
    S0 = rng.standard_normal((2, G_GRAD, D_K, D_V))
    z0 = rng.uniform(0, 1, (2, G_GRAD, D_K))
    return [q, k, v, g, S0, z0]


def loss(xp, method, normalize, repeat):
    weights = np.random.default_rng(1).standard_normal((2, G_GRAD, T_GRAD, D_V))

    def f(q, k, v, g, S0, z0):
        if repeat:
            q, k = (xp.broadcast_to(x, (2, G_GRAD, T_GRAD, D_K)) for x in (q, k))
        out, state = causal_linear_attention(
            q, k, v, method=method, chunk_size=3, log_decay=g, normalize=normalize,
            initial_state=LinearAttentionState(S0, z0), return_state=True,
        )  # fmt: skip
        return xp.sum(out * xp.asarray(weights)) + xp.sum(state.S * state.S) + xp.sum(state.z)

    return f


@pytest.mark.parametrize("kind", ["token", "channel-shared"])
@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.only_backend(Backend.TORCH)
def test_torch_gradients(backend, method, kind, rng):
    torch = backend.module()
    arrays = [torch.tensor(x, requires_grad=True) for x in grad_inputs(rng, kind)]
    xp = backend.namespace()
    grouped = loss(xp, method, False, repeat=False)
    grads = torch.autograd.grad(grouped(*arrays), arrays)
    flat = torch.autograd.grad(loss(xp, method, False, repeat=True)(*arrays), arrays)
    for a, b in zip(grads, flat):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(loss(xp, method, True, repeat=False), arrays)


@pytest.mark.parametrize("kind", ["token", "channel-shared"])
@pytest.mark.parametrize("method", ["chunked", "quadratic"])
@pytest.mark.only_backend(Backend.JAX)
def test_jax_gradients(backend, method, kind, rng):
    import jax

    arrays = [backend.from_numpy(x) for x in grad_inputs(rng, kind)]
    xp = backend.namespace()
    argnums = tuple(range(6))
    grads = jax.jit(jax.grad(loss(xp, method, True, repeat=False), argnums))(*arrays)
    flat = jax.jit(jax.grad(loss(xp, method, True, repeat=True), argnums))(*arrays)
    for a, b in zip(grads, flat):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-10)
    # and against PyTorch's autograd of the same grouped call
    torch = pytest.importorskip("torch")
    leaves = [torch.tensor(np.asarray(x), requires_grad=True) for x in arrays]
    import array_api_compat.torch as torch_xp

    reference = torch.autograd.grad(loss(torch_xp, method, True, repeat=False)(*leaves), leaves)
    for a, b in zip(grads, reference):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=1e-10, atol=1e-10)


# No copy per group. PyTorch's own matmul expands a broadcast operand and copies it (one copy
# of the queries per group, kept for the backward); a reshape of a broadcast view copies too.
# A dispatch mode sees every operation of the forward and the backward: none may produce an
# array with the group axis and the feature axis of q or k that is as large as q.

G_WATCH, D_WATCH, T_WATCH = 5, 24, 64  # sizes that appear nowhere else in the shapes


@pytest.mark.parametrize(
    "kind", ["none", "float", "token", "token-shared", "channel-shared", "mask", "state"]
)
@pytest.mark.parametrize("method", polylin.METHODS)
@pytest.mark.only_backend(Backend.TORCH)
def test_no_copy_per_group(backend, method, kind):
    torch = backend.module()
    from torch.utils._python_dispatch import TorchDispatchMode

    G, d, T = G_WATCH, D_WATCH, T_WATCH
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 1, T, d, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, G, T, 8, requires_grad=True)
    options: dict = {"method": method, "chunk_size": 16}
    if kind == "mask":
        options["attention_mask"] = torch.rand(2, T) > 0.3
    elif kind == "state":
        S0 = torch.randn(2, 3, G, d, 8, requires_grad=True)
        z0 = torch.rand(2, 3, G, d, requires_grad=True)
        options.update(initial_state=LinearAttentionState(S0, z0), return_state=True)
    elif kind != "none":
        shapes = {
            "token": (2, 3, G, T, 1),
            "token-shared": (2, 3, 1, T, 1),
            "channel-shared": (2, 3, 1, T, d),
        }
        options["log_decay"] = -0.1 if kind == "float" else -torch.rand(shapes[kind])
        options["normalize"] = False
    copies = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else [out]:
                if (
                    isinstance(x, torch.Tensor)
                    and x.ndim >= 2
                    and x.shape[-1] == d
                    and G in x.shape[:-1]
                    and x.numel() >= q.numel()
                ):
                    copies.append((str(func), tuple(x.shape)))
            return out

    with Watch():
        result = causal_linear_attention(q, k, v, **options)
        out = result[0] if isinstance(result, tuple) else result
        out.sum().backward()
    assert tuple(out.shape) == (2, 3, G, T, 8)
    assert copies == []
    # The watch can fail: the same call on a query expanded to the groups (a broadcast view,
    # which PyTorch's matmul and the chunked form's reshapes copy) is caught.
    with Watch():
        causal_linear_attention(q.expand(2, 3, G, T, d), k, v, **options)
    assert copies


@pytest.mark.only_backend(Backend.TORCH)
def test_grouped_saves_less_than_repeated(backend):
    """What autograd keeps for the backward: a grouped call keeps less than the same call with
    q and k repeated (G = 4, T = 512), by at least the repeated call's extra copies of q and k."""
    torch = backend.module()
    G, T, d = 4, 512, 32
    torch.manual_seed(0)
    q, k = (torch.randn(2, 2, 1, T, d, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, G, T, d, requires_grad=True)

    def saved_bytes(*arrays):
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            causal_linear_attention(*arrays, chunk_size=64)
        return sum(storages.values())

    grouped = saved_bytes(q, k, v)
    flat = saved_bytes(*(x.expand(2, 2, G, T, d).contiguous() for x in (q, k)), v)
    assert grouped < flat - 2 * (G - 1) * q.numel() * q.element_size()


def test_benchmark_runs(capsys):
    pytest.importorskip("torch")
    from benchmarks import grouped

    rows = grouped.main(["--T", "64", "--groups", "2", "--repeats", "1", "--heads", "2"])
    assert {row["pass"] for row in rows} == {"forward", "forward+backward"}
    assert all(row["grouped_peak_bytes"] > 0 and row["repeated_s"] > 0 for row in rows)
    assert "grouped / repeated" in capsys.readouterr().out
