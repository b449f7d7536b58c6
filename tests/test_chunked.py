"""The blocked chunked path: many small blocks give the same results as the oracle.

On eager CPU backends the chunked form walks the sequence in blocks of about ``BLOCK_BYTES``
(feature map, ones column, states and scores per block, the state carried across blocks). The
default block is large, so most tests see one or two blocks; here the block is shrunk until every
block holds one or two chunks, with ragged ends, masks, initial states and a query-specific
feature map, and the results are checked against the float64 masked-kernel oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import polylin._forms.linear.chunked as chunked
from polylin import LinearAttentionState, causal_linear_attention
from polylin.feature_maps import favor_plus
from polylin.testing import Backend

from .reference import masked_kernel

EAGER = (Backend.NUMPY, Backend.ARRAY_API_STRICT, Backend.TORCH)


@pytest.fixture(params=[1, 1024, 4096], ids=lambda r: f"bytes{r}")
def small_blocks(request, monkeypatch, backend):
    monkeypatch.setattr(chunked, "BLOCK_BYTES", request.param)
    return request.param


# Lazy and accelerator backends run the chunked form in one block: nothing to shrink there.
pytestmark = pytest.mark.only_backend(*EAGER)


@pytest.mark.parametrize(
    ("lead", "T", "chunk"), [((2, 3), 70, 4), ((1,), 33, 8), ((), 17, 5), ((2,), 9, 64)]
)
def test_small_blocks_match_reference(backend, small_blocks, lead, T, chunk, rng):
    q, k, v = (rng.standard_normal((*lead, T, d)) for d in (6, 6, 3))
    xs = [backend.from_numpy(x, "float64") for x in (q, k, v)]
    out, state = causal_linear_attention(*xs, chunk_size=chunk, return_state=True)
    np.testing.assert_allclose(backend.to_numpy(out), masked_kernel(q, k, v), atol=1e-10)
    fk = np.where(k > 0, k + 1, np.exp(np.minimum(k, 0)))
    np.testing.assert_allclose(
        backend.to_numpy(state.S), np.swapaxes(fk, -1, -2) @ v, rtol=1e-12, atol=1e-10
    )
    np.testing.assert_allclose(backend.to_numpy(state.z), fk.sum(-2), rtol=1e-12, atol=1e-10)


def test_small_blocks_with_mask_and_state(backend, small_blocks, rng):
    T, split = 45, 19
    q, k, v = (rng.standard_normal((2, T, d)) for d in (4, 4, 5))
    mask = np.ones((2, T), dtype=bool)
    mask[0, :7] = False  # left padding
    mask[1, -11:] = False  # right padding
    xs = [backend.from_numpy(x, "float64") for x in (q, k, v)]
    m = backend.from_numpy(mask)
    whole = causal_linear_attention(*xs, chunk_size=4, attention_mask=m)
    np.testing.assert_allclose(
        backend.to_numpy(whole), masked_kernel(q, k, v, mask=mask), atol=1e-10
    )
    first, state = causal_linear_attention(
        *(x[:, :split, ...] for x in xs), chunk_size=4, attention_mask=m[:, :split],
        return_state=True,
    )
    assert isinstance(state, LinearAttentionState)
    second = causal_linear_attention(
        *(x[:, split:, ...] for x in xs), chunk_size=4, attention_mask=m[:, split:],
        initial_state=state,
    )
    np.testing.assert_allclose(backend.to_numpy(first), backend.to_numpy(whole)[:, :split],
                               atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(second), backend.to_numpy(whole)[:, split:],
                               atol=1e-10)


def test_small_blocks_query_feature_map(backend, small_blocks, rng):
    # favor_plus maps queries with a per-row shift (map_query): per-block mapping must agree.
    T, d = 30, 4
    phi = favor_plus(d, 16, seed=3)
    q, k, v = (rng.standard_normal((2, T, d)) for _ in range(3))
    xs = [backend.from_numpy(x, "float64") for x in (q, k, v)]
    blocked = causal_linear_attention(*xs, phi, chunk_size=4)
    quadratic = causal_linear_attention(*xs, phi, method="quadratic")
    np.testing.assert_allclose(backend.to_numpy(blocked), backend.to_numpy(quadratic),
                               atol=1e-10)


def test_float32_many_blocks_stays_accurate(rng):
    # The carried state is added block after block: float32 error must stay at float32 level.
    T = 3000
    q, k, v = (rng.standard_normal((2, T, 8)) for _ in range(3))
    out = causal_linear_attention(*(x.astype(np.float32) for x in (q, k, v)), chunk_size=16)
    expected = masked_kernel(*(x.astype(np.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out, expected, atol=2e-5)


@pytest.mark.parametrize("chunk", [1, 48, 64])
@pytest.mark.parametrize("token_bytes", [4, 4096, 10**9])
def test_block_tokens(chunk, token_bytes, monkeypatch):
    """A block is whole chunks, at least one, and as many as fit the byte budget."""
    assert chunked.block_tokens(False, 5000, chunk, token_bytes) == 5000  # lazy: one block
    assert chunked.block_tokens(False, 0, chunk, token_bytes) == 1
    monkeypatch.setattr(chunked, "BLOCK_BYTES", 2**20)
    tokens = chunked.block_tokens(True, 5000, chunk, token_bytes)
    assert tokens % chunk == 0 and tokens >= chunk
    assert tokens * token_bytes <= 2**20 or tokens == chunk  # within budget, or one chunk
    assert (tokens + chunk) * token_bytes > 2**20  # one more chunk would not fit
