"""The intra-chunk block with several key sets, and the shorter chunks of per-channel gates.

``intra_chunk`` with a list of key sets (the generalized rule's ``k`` and ``b``) must give what
one call per key set gives, and both must match a float64 sum of decayed products written out
term by term (a ``-inf`` gate an exact zero), whether a per-channel gate is built level by
level or, bounded, factored over the chunk; the factored form must be taken exactly where it
applies. The per-channel gates' chunk caps on eager CPU backends (``channel_chunk``) must keep
the chunked forms equal to the per-token loop at a chunk size above the cap, at strong gates
and through a reset.
"""

from __future__ import annotations

import numpy as np
import pytest

from polylin import causal_linear_attention, delta_rule_attention, dplr_delta_rule
from polylin._forms.common import intra_chunk as intra_chunk_module
from polylin._forms.common.intra_chunk import (
    FACTORED_SPAN,
    READ_SCORES,
    READ_SOLVE,
    SCORES,
    SOLVE,
    intra_chunk,
)
from polylin._forms.dplr.chunked import channel_chunk as dplr_channel_chunk
from polylin._forms.linear.chunked import channel_chunk as linear_channel_chunk
from polylin.feature_maps import identity
from polylin.testing import Backend

from .test_delta_rule import needs
from .test_dplr import reference

CHUNK, D = 8, 5


def _decayed(r, k, g, *, read):
    """``sum_c r_tc k_sc exp(sum_{s<u<=t} g_uc)`` for s <= t (``read``: s < t, the sum to t
    exclusive), term by term in float64; 0 elsewhere."""
    C = k.shape[-2]
    M = np.zeros((*np.broadcast_shapes(r.shape[:-2], k.shape[:-2]), C, C))
    for t in range(C):
        for s in range(t if read else t + 1):
            stop = t if read else t + 1
            span = np.sum(g[..., s + 1 : stop, :], axis=-2)  # empty for s + 1 >= stop: 0
            with np.errstate(invalid="ignore"):
                M[..., t, s] = np.sum(r[..., t, :] * k[..., s, :] * np.exp(span), axis=-1)
    return M


def _inputs(rng, gate):
    Q, A, K, B = (rng.standard_normal((2, CHUNK, D)) / 2 for _ in range(4))
    if gate == "none":
        return Q, A, K, B, None
    width = 1 if gate == "scalar" else D
    if gate == "bounded":  # a chunk log decay of at most 8 * 1.5 = 12 <= FACTORED_SPAN
        return Q, A, K, B, -rng.uniform(0.0, 1.5, (2, CHUNK, width))
    G = -rng.uniform(0.0, 3.0, (2, CHUNK, width))
    G[0, 3, 0] = -np.inf  # an exact reset of the first channel (or the token) at t = 3
    return Q, A, K, B, G


@pytest.mark.parametrize("gate", ["none", "scalar", "channel", "bounded"])
def test_several_key_sets_equal_one_call_per_set_and_the_sums(rng, gate):
    xp = needs(Backend.NUMPY)
    Q, A, K, B, G = _inputs(rng, gate)
    rows = [(Q, (SCORES, SCORES)), (A, (READ_SCORES, READ_SOLVE))]
    both = intra_chunk(xp, [K, B], G, rows)
    with_k = intra_chunk(xp, K, G, [(Q, SCORES), (A, READ_SCORES)])
    with_b = intra_chunk(xp, B, G, [(Q, SCORES), (A, READ_SOLVE)])
    (qk, qb), (ak, inverse) = both.matrices
    for got, want in [(qk, with_k.matrices[0]), (ak, with_k.matrices[1]),
                      (qb, with_b.matrices[0]), (inverse, with_b.matrices[1])]:  # fmt: skip
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(both.keys[0], with_k.keys)
    np.testing.assert_array_equal(both.keys[1], with_b.keys)
    for got, want in zip(both.rows, with_k.rows):
        np.testing.assert_array_equal(got, want)
    g = np.zeros((2, CHUNK, 1)) if G is None else G
    np.testing.assert_allclose(qk, _decayed(Q, K, g, read=False), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(qb, _decayed(Q, B, g, read=False), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ak, _decayed(A, K, g, read=True), rtol=1e-12, atol=1e-14)
    N = _decayed(A, B, g, read=True)
    eye = np.broadcast_to(np.eye(CHUNK), N.shape)
    np.testing.assert_allclose(inverse @ (eye - N), eye, atol=1e-12)


def _factored(xp, K, G, Q):
    """What the factored form gives for :func:`intra_chunk`'s rows ``[(Q, SCORES)]``, or None."""
    return intra_chunk_module._factored(xp, [K], G, [(Q, SCORES)], [[SCORES]], [False])


def test_a_bounded_channel_gate_factors_and_equals_the_levels(rng, monkeypatch):
    xp = needs(Backend.NUMPY)
    Q, A, K, B, G = _inputs(rng, "bounded")
    assert _factored(xp, K, G, Q) is not None
    rows = [(Q, (SCORES, SCORES)), (A, (READ_SCORES, READ_SOLVE))]
    factored = intra_chunk(xp, [K, B], G, rows)
    monkeypatch.setattr(intra_chunk_module, "FACTORED_SPAN", -1.0)  # the levels
    assert _factored(xp, K, G, Q) is None
    levels = intra_chunk(xp, [K, B], G, rows)
    pairs = [*zip(factored.keys, levels.keys), *zip(factored.rows, levels.rows),
             (factored.whole, levels.whole)]  # fmt: skip
    pairs += [*zip(factored.matrices[0], levels.matrices[0])]
    pairs += [*zip(factored.matrices[1], levels.matrices[1])]
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_the_factored_scores_keep_float32_precision(rng, monkeypatch):
    """At a chunk log decay just below the bound (every factor up to exp(+-8)), float32's
    factored scores are as close to the float64 sums as the levels' (their rounding 1-2 ulps
    of the largest entry), on a chunk of 64."""
    xp = needs(Backend.NUMPY)
    Q, K = (rng.standard_normal((4, 64, 16)) for _ in range(2))
    G = -rng.uniform(0.0, 1.0, (4, 64, 16))
    G[..., 1::2] /= 3.0
    G *= 0.99 * FACTORED_SPAN / np.max(-np.sum(G, axis=-2))
    want = _decayed(Q, K, G, read=False)
    f32 = [x.astype(np.float32) for x in (Q, K, G)]
    assert _factored(xp, f32[1], f32[2], f32[0]) is not None
    factored = intra_chunk(xp, f32[1], f32[2], [(f32[0], SCORES)]).matrices[0]
    monkeypatch.setattr(intra_chunk_module, "FACTORED_SPAN", -1.0)
    levels = intra_chunk(xp, f32[1], f32[2], [(f32[0], SCORES)]).matrices[0]
    scale = np.max(np.abs(want))
    error = np.max(np.abs(factored - want)) / scale
    assert error <= 2 * max(np.max(np.abs(levels - want)) / scale, 2 ** -23)


@pytest.mark.parametrize("gate", ["beyond", "-inf", "nan", "float16"])
def test_the_levels_take_what_does_not_factor(rng, gate):
    xp = needs(Backend.NUMPY)
    Q, _, K, _, G = _inputs(rng, "bounded")
    if gate == "beyond":  # one channel of one chunk decays by more than the bound
        G[1, :, 2] = -(FACTORED_SPAN + 0.1) / CHUNK
    elif gate in ("-inf", "nan"):
        G[0, 5, 1] = -np.inf if gate == "-inf" else np.nan
    else:
        Q, K, G = (x.astype(np.float16) for x in (Q, K, G))
    assert _factored(xp, K, G, Q) is None


def test_only_eager_cpu_backends_read_the_gate(rng):
    """Dask would compute its graph to read a value: it keeps the levels, and its scores equal
    NumPy's factored ones."""
    needs(Backend.DASK)
    dask = Backend.DASK.namespace()
    xp = needs(Backend.NUMPY)
    Q, _, K, _, G = _inputs(rng, "bounded")
    lazy = [Backend.DASK.from_numpy(x) for x in (K, G, Q)]
    assert _factored(dask, *lazy) is None
    got = intra_chunk(dask, lazy[0], lazy[1], [(lazy[2], SCORES)]).matrices[0]
    want = intra_chunk(xp, K, G, [(Q, SCORES)]).matrices[0]
    np.testing.assert_allclose(Backend.DASK.to_numpy(got), want, rtol=1e-12, atol=1e-14)


def test_one_key_set_keeps_its_shape_of_result(rng):
    xp = needs(Backend.NUMPY)
    Q, _, K, _, G = _inputs(rng, "channel")
    single = intra_chunk(xp, K, G, [(Q, SCORES), (-Q, SOLVE)])
    assert len(single.matrices) == 2 and single.matrices[0].shape == (2, CHUNK, CHUNK)
    assert single.keys.shape == K.shape  # an array, not a list


def test_channel_chunks_shrink_with_the_head_size():
    assert [linear_channel_chunk(d) for d in (16, 64, 128, 256)] == [32, 32, 64, 128]
    assert [dplr_channel_chunk(d) for d in (16, 64, 128, 256)] == [16, 16, 32, 64]


def _strong_gates(rng, shape):
    g = -rng.uniform(0.0, 4.0, shape)  # up to e^-4 per token: long chunks' sums pass -100
    g[..., 37, :3] = -np.inf  # reset three channels mid-chunk
    return g


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.TORCH], ids=str)
def test_capped_chunks_match_the_loop(rng, backend):
    """d = 64: chunk_size=64 runs chunks of 16 (the generalized rule) and 32 (linear
    attention); both still equal the float64 per-token loop."""
    needs(backend)
    length, d = 70, 64
    q, k, v, a = (rng.standard_normal((2, length, d)) / 4 for _ in range(4))
    b = -a * rng.uniform(0, 1, (2, length, 1))
    g = _strong_gates(rng, (2, length, d))
    x = [backend.from_numpy(np.asarray(y, np.float64)) for y in (q, k, v, a, b, g)]
    out = dplr_delta_rule(*x[:5], log_decay=x[5], method="chunked", chunk_size=64)
    want, _ = reference(q, k, v, a, b, g)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-9, atol=1e-11)
    out = causal_linear_attention(x[0], x[1], x[2], identity, log_decay=x[5], normalize=False,
                                  method="chunked", chunk_size=64)  # fmt: skip
    want, _ = reference(q, k, v, np.zeros_like(a), np.zeros_like(b), g)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("op", ["gla", "kda", "rwkv7"])
@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.TORCH], ids=str)
def test_public_calls_factor_a_bounded_gate(rng, monkeypatch, backend, op):
    """GLA, KDA and RWKV-7 with a gate inside the bound take the factored form on the eager CPU
    libraries, and still equal the float64 per-token loops (through a chunk boundary and a
    padded last chunk)."""
    needs(backend)
    taken = []

    def counted(*args, **kwargs):
        result = factored(*args, **kwargs)
        taken.append(result is not None)
        return result

    factored = intra_chunk_module._factored
    monkeypatch.setattr(intra_chunk_module, "_factored", counted)
    length, d = 45, 16
    q, k, v = (rng.standard_normal((2, length, d)) / 2 for _ in range(3))
    g = -rng.uniform(0.0, 0.5, (2, length, d))  # at most 8 per chunk of 16
    x = [backend.from_numpy(y) for y in (q, k, v, g)]
    if op == "gla":
        out = causal_linear_attention(*x[:3], identity, log_decay=x[3], normalize=False,
                                      method="chunked", chunk_size=16)  # fmt: skip
        want, _ = reference(q, k, v, np.zeros_like(q), np.zeros_like(q), g)
    elif op == "kda":
        unit = [y / np.linalg.norm(y, axis=-1, keepdims=True) for y in (q, k)]
        beta = rng.uniform(0, 1, (2, length, 1))
        x = [backend.from_numpy(y) for y in (*unit, v, beta, g)]
        out = delta_rule_attention(*x[:4], log_decay=x[4], method="chunked", chunk_size=16)
        want = delta_rule_attention(*unit, v, beta, log_decay=g, method="recurrent")
    else:
        kk = rng.standard_normal((2, length, d))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        a, b = -kk, kk * rng.uniform(0, 1, (2, length, 1))
        out = dplr_delta_rule(*x[:3], backend.from_numpy(a), backend.from_numpy(b),
                              log_decay=x[3], method="chunked", chunk_size=16)  # fmt: skip
        want, _ = reference(q, k, v, a, b, g)
    assert taken and all(taken)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-9, atol=1e-11)


def _channel_call(op, q, k, v, g, beta, unit):
    """GLA, KDA (keys ``unit``) or RWKV-7 (``a, b`` from ``unit``) chunked, chunks of 16, with
    the per-channel gate ``g``."""
    if op == "gla":
        return causal_linear_attention(q, k, v, identity, log_decay=g, normalize=False,
                                       method="chunked", chunk_size=16)  # fmt: skip
    if op == "kda":
        return delta_rule_attention(q, unit, v, beta, log_decay=g, method="chunked",
                                    chunk_size=16)  # fmt: skip
    return dplr_delta_rule(q, k, v, -unit, unit * beta, log_decay=g, method="chunked",
                           chunk_size=16)  # fmt: skip


@pytest.mark.parametrize("op", ["gla", "kda", "rwkv7"])
def test_torch_vmap_reads_no_values(rng, op):
    """Under ``torch.func.vmap`` (which refuses data-dependent control flow and has no batching
    rule for in-place products) the chunked calls take the levels and the out-of-place
    products, warn of nothing, and equal the calls row by row."""
    import warnings

    torch = needs(Backend.TORCH)
    length, d = 40, 8
    q, k, v = (torch.tensor(rng.standard_normal((3, length, d))) for _ in range(3))
    g = torch.tensor(-rng.uniform(0.0, 0.2, (3, length, d)))  # inside the bound
    beta = torch.tensor(rng.uniform(0, 1, (3, length, 1)))
    unit = torch.nn.functional.normalize(k, dim=-1)

    def call(q, k, v, g, beta, unit):
        return _channel_call(op, q, k, v, g, beta, unit)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched = torch.func.vmap(call)(q, k, v, g, beta, unit)
    for row in range(3):
        want = call(*(x[row] for x in (q, k, v, g, beta, unit)))
        torch.testing.assert_close(batched[row], want, rtol=1e-10, atol=1e-12)


def _jax_call(op):
    """``op`` on JAX arrays ``(q, k, v, g, beta)`` (:func:`_channel_call`, ``unit`` the
    normalized ``k``)."""
    import jax.numpy as jnp

    def call(q, k, v, g, beta):
        unit = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        return _channel_call(op, q, k, v, g, beta, unit)

    return call


def _jax_inputs(rng, gate, batch=2, length=45, d=8):
    q, k, v = (rng.standard_normal((batch, length, d)) / 2 for _ in range(3))
    g = -rng.uniform(0.0, 0.5, (batch, length, d))  # at most 8 per chunk of 16: factored
    if gate == "strong":  # beyond the bound in every chunk, and a reset: the levels
        g = _strong_gates(rng, (batch, length, d))
    beta = rng.uniform(0, 1, (batch, length, 1))
    return q, k, v, g, beta


@pytest.mark.parametrize("gate", ["bounded", "strong"])
@pytest.mark.parametrize("op", ["gla", "kda", "rwkv7"])
def test_jax_jit_chooses_inside_the_program(rng, monkeypatch, op, gate):
    """Under ``jax.jit`` on the CPU a per-channel gate's factoring is chosen by a ``cond`` of the
    compiled program: the value (RWKV-7's and KDA's forward; GLA's forward is a token scan) and
    the gradient equal the levels' alone to rounding, for gates inside the bound and beyond
    it."""
    jax = needs(Backend.JAX) and __import__("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("the choice inside the program is made for the CPU only")
    call = _jax_call(op)
    x = [jax.numpy.asarray(y) for y in _jax_inputs(rng, gate)]

    def loss(*arrays):
        return jax.numpy.sum(call(*arrays) ** 2)

    program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*x)
    assert "cond" in str(program)
    got = jax.jit(call)(*x), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*x)
    monkeypatch.setattr(intra_chunk_module, "branches_in_program", lambda xp, x: False)
    jax.clear_caches()  # JAX reuses the scan bodies it traced before
    assert "cond" not in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*x))
    want = jax.jit(call)(*x), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("op", ["gla", "kda", "rwkv7"])
def test_jax_vmap_gradients_stay_finite(rng, op):
    """Under ``jax.vmap`` the ``cond`` becomes a selection that computes both constructions:
    the factored one's exponents are clipped to the bound, so a batch whose gates exceed it
    (next to one inside it) still has finite gradients, equal to those of each row alone."""
    jax = needs(Backend.JAX) and __import__("jax")
    call = _jax_call(op)
    bounded = _jax_inputs(rng, "bounded", batch=1)
    strong = _jax_inputs(rng, "strong", batch=1)
    x = [jax.numpy.asarray(np.concatenate(pair)) for pair in zip(bounded, strong)]

    def loss(*arrays):
        return jax.numpy.sum(call(*(y[None] for y in arrays)) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(*x)
    for row in range(2):
        alone = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(y[row] for y in x))
        for a, b in zip(grads, alone):
            assert np.all(np.isfinite(np.asarray(a[row])))
            np.testing.assert_allclose(np.asarray(a[row]), np.asarray(b), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("gate", ["bounded", "channel"])
def test_relative_factors_carry_the_same_state(rng, gate):
    """``relative``: where a bounded gate is factored, rows, keys and the chunk decays count from
    each chunk's middle token and ``entry`` is the decay to the first one; a state carried as
    ``diag(entry) S`` into the first chunk and by ``diag(whole)`` from chunk to chunk reads and
    ends exactly as the state of the chunk-start factors does (the gate beyond the bound takes
    the levels: ``entry`` None, the same factors)."""
    xp = needs(Backend.NUMPY)
    n = 3
    Q, A, K, _, G = (np.stack([a] * n, axis=-3) for a in _inputs(rng, gate))  # (2, n, C, d)
    G = G * rng.uniform(0.5, 1.0, (1, n, 1, 1))  # each chunk its own gate
    rows = [(Q, SCORES), (A, SOLVE)]
    plain, relative = (intra_chunk(xp, K, G, rows, relative=r) for r in (False, True))
    assert (relative.entry is None) == (gate == "channel")
    for a, b in zip(plain.matrices, relative.matrices):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    V = rng.standard_normal((2, n, CHUNK, 3))
    S = S_hat = rng.standard_normal((2, D, 3))
    if relative.entry is not None:
        S_hat = np.swapaxes(relative.entry, -1, -2)[..., 0, :, :] * S
    for i in range(n):
        for a, b in zip(plain.rows, relative.rows):
            np.testing.assert_allclose(b[:, i] @ S_hat, a[:, i] @ S, rtol=1e-11, atol=1e-12)
        S, S_hat = (np.swapaxes(f.whole[:, i], -1, -2) * state
                    + np.swapaxes(f.keys[:, i], -1, -2) @ V[:, i]
                    for f, state in ((plain, S), (relative, S_hat)))  # fmt: skip
    np.testing.assert_allclose(S_hat, S, rtol=1e-11, atol=1e-12)


def test_factors_of_a_strided_gate_are_row_major_on_torch(rng):
    """A block of a (B, T, H, d) sequence read as (B, H, chunks, C, d) is strided; the factored
    construction still gives its factors and matrices row-major in their own batch order (a
    token-major chunk's scores MKL multiplies 2.4x slower), equal to NumPy's."""
    torch = needs(Backend.TORCH)
    xp = needs(Backend.NUMPY)
    T, H = 4 * CHUNK, 3
    K, Q = (rng.standard_normal((1, T, H, D)) / 2 for _ in range(2))
    G = -rng.uniform(0.0, 1.5, (1, T, H, D))  # a chunk log decay of at most 12

    def blocks(x):  # (1, T, H, d) -> (1, H, 4, C, d): a strided view
        return x.swapaxes(1, 2).reshape(1, H, 4, CHUNK, D)

    K_t, G_t, Q_t = (blocks(torch.from_numpy(x)) for x in (K, G, Q))
    assert not G_t.is_contiguous()
    got = intra_chunk(Backend.TORCH.namespace(), K_t, G_t, [(Q_t, SCORES)])
    want = intra_chunk(xp, blocks(K), blocks(G), [(blocks(Q), SCORES)])
    pairs = [(got.matrices[0], want.matrices[0]), (got.rows[0], want.rows[0]),
             (got.keys, want.keys)]  # fmt: skip
    for got_array, want_array in pairs:
        assert got_array.is_contiguous()
        np.testing.assert_allclose(got_array.numpy(), want_array, rtol=1e-12, atol=1e-14)
