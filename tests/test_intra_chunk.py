"""The intra-chunk block with several key sets, and the shorter chunks of per-channel gates.

``intra_chunk`` with a list of key sets (the generalized rule's ``k`` and ``b``) must give what
one call per key set gives, and both must match a float64 sum of decayed products written out
term by term (a ``-inf`` gate an exact zero). The per-channel gates' chunk caps on eager CPU
backends (``channel_chunk``) must keep the chunked forms equal to the per-token loop at a
chunk size above the cap, at strong gates and through a reset.
"""

from __future__ import annotations

import numpy as np
import pytest

from polylin import causal_linear_attention, dplr_delta_rule
from polylin._forms.common.intra_chunk import (
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
    G = -rng.uniform(0.0, 3.0, (2, CHUNK, width))
    G[0, 3, 0] = -np.inf  # an exact reset of the first channel (or the token) at t = 3
    return Q, A, K, B, G


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
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
