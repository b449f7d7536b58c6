"""A per-head scalar gate on queries and keys shared by the heads (Mamba-2's scan): the chunked
form with the heads as columns and the decay factored out of the scores
(``polylin/_forms/linear/grouped.py``, ``polylin/_forms/common/scalar_gate.py``).

Against the float64 loop :func:`tests.reference.decayed_loop` in Mamba-2's layout (time on axis
1, groups of heads, a partial last chunk, a state in and out, masks), on every backend; that the
form runs where it applies (eager CPU backends) and nowhere else (a gate beyond the span, too
few chunks, per-head queries, a gate shared by the group); the same values and gradients as the
per-head form; and the span's test itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import polylin._forms.common.prefix as prefix
import polylin._forms.linear.chunked as chunked
import polylin._forms.linear.grouped as grouped
from polylin import LinearAttentionState, causal_linear_attention
from polylin._forms.common.intra_chunk import FACTORED_SPAN
from polylin._forms.common.scalar_gate import within_span
from polylin.feature_maps import identity
from polylin.testing import Backend

from .reference import decayed_loop

#: Where the form runs: where the gate's values are read (eager CPU backends).
COLUMNS = (Backend.NUMPY, Backend.ARRAY_API_STRICT, Backend.TORCH)
B, T, GROUPS, HEADS, N, D_V = 2, 45, 2, 3, 6, 4  # chunks of 8: five, the last partial


@pytest.fixture
def blocks(monkeypatch):
    """The number of blocks the grouped form ran."""
    count = [0]
    original = grouped._block

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(grouped, "_block", counted)
    return count


def mamba2_inputs(rng, scale=0.5, dtype=np.float64):
    """C, B ``(B, T, groups, 1, N)``, x dt ``(B, T, groups, heads, d_v)``, log decays
    ``(B, T, groups, heads, 1)`` in ``[-scale, 0]``, a state ``(B, groups, heads, N, d_v)``."""
    C = rng.standard_normal((B, T, GROUPS, 1, N))
    K = rng.standard_normal((B, T, GROUPS, 1, N)) / np.sqrt(N)
    x = rng.standard_normal((B, T, GROUPS, HEADS, D_V))
    g = -rng.uniform(0, scale, (B, T, GROUPS, HEADS, 1))
    S0 = rng.standard_normal((B, GROUPS, HEADS, N, D_V))
    z0 = np.abs(rng.standard_normal((B, GROUPS, HEADS, N)))
    return [a.astype(dtype) for a in (C, K, x, g, S0, z0)]


def to_heads_first(x):
    """``(B, T, ..., c)`` -> ``(B, ..., T, c)``: the reference's layout."""
    return np.moveaxis(x, 1, -2)


@pytest.mark.parametrize("normalize", [False, True], ids=["unnormalized", "normalized"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_matches_the_float64_loop(backend, normalize, masked, blocks, rng):
    C, K, x, g, S0, z0 = mamba2_inputs(rng)
    if normalize:  # positive features: a normalizer away from zero
        C, K = np.abs(C), np.abs(K)
    keep = np.ones((B, T), dtype=bool)
    keep[0, :5] = False  # left padding
    keep[1, 20:23] = False
    mask = keep if masked else None
    reference_mask = None if mask is None else mask[:, None, None, :]
    want, S, z = decayed_loop(
        *(to_heads_first(a) for a in (C, K, x, g)), normalize=normalize, mask=reference_mask,
        S0=S0, z0=z0,
    )  # fmt: skip
    out, state = causal_linear_attention(
        *(backend.from_numpy(a) for a in (C, K, x)), identity, chunk_size=8,
        log_decay=backend.from_numpy(g), normalize=normalize, return_state=True, seq_axis=1,
        initial_state=LinearAttentionState(backend.from_numpy(S0), backend.from_numpy(z0)),
        attention_mask=None if mask is None else backend.from_numpy(mask),
    )  # fmt: skip
    tol = {"rtol": 1e-10, "atol": 1e-10}
    np.testing.assert_allclose(backend.to_numpy(out), np.moveaxis(want, -2, 1), **tol)
    np.testing.assert_allclose(backend.to_numpy(state.S), S, **tol)
    np.testing.assert_allclose(backend.to_numpy(state.z), z, **tol)
    assert (blocks[0] > 0) == (backend in COLUMNS)


def per_head(monkeypatch):
    """Make the chunked form run its per-head construction."""
    monkeypatch.setattr(
        chunked, "grouped_chunked", lambda *args, otherwise, **kwargs: otherwise()
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.TORCH], ids=str)
def test_same_values_as_the_per_head_form(backend, dtype, monkeypatch, rng):
    """Float32 too, at a strong but admitted gate: the factors reach exp(+-16), the first
    half's rows' u / c up to exp(48)."""
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    C, K, x, g, _, _ = mamba2_inputs(rng, dtype=dtype)
    g = g / np.max(-g) * (FACTORED_SPAN / 2)  # a quarter of two tokens: up to 16
    g = g.astype(dtype)
    assert within_span(np, to_heads_first(g), 8)
    call = dict(chunk_size=8, normalize=False, seq_axis=1, return_state=True)
    args = [backend.from_numpy(a) for a in (C, K, x)]
    out, state = causal_linear_attention(*args, identity, log_decay=backend.from_numpy(g), **call)
    per_head(monkeypatch)
    want, want_state = causal_linear_attention(
        *args, identity, log_decay=backend.from_numpy(g), **call
    )
    # Relative to each array's scale: both forms within 1 eps of the float64 loop at these
    # inputs (0.81 and 0.74 in float32), so within 8 of each other.
    eps = np.finfo(dtype).eps
    for a, b in ((out, want), (state.S, want_state.S)):
        a, b = backend.to_numpy(a), backend.to_numpy(b)
        assert np.max(np.abs(a - b)) <= 8 * eps * np.max(np.abs(b))
    exact, _, _ = decayed_loop(
        *(to_heads_first(a.astype(np.float64)) for a in (C, K, x, g)), normalize=False
    )
    exact = np.moveaxis(exact, -2, 1)
    assert np.max(np.abs(backend.to_numpy(out) - exact)) <= 4 * eps * np.max(np.abs(exact))


def test_same_gradients_as_the_per_head_form(monkeypatch, rng):
    torch = pytest.importorskip("torch")
    arrays = mamba2_inputs(rng)

    def gradients():
        leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
        C, K, x, g, S0, z0 = leaves
        out, state = causal_linear_attention(
            C.abs(), K.abs(), x, identity, chunk_size=8, log_decay=g, seq_axis=1,
            initial_state=LinearAttentionState(S0, z0), return_state=True,
        )  # fmt: skip
        (out.square().sum() + state.S.sum() + state.z.sum()).backward()
        return [leaf.grad.numpy() for leaf in leaves]

    got = gradients()
    per_head(monkeypatch)
    for a, b in zip(got, gradients(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_runs_only_where_it_applies(blocks, rng):
    """Taken for the inputs above; not for a gate beyond the span, fewer than four chunks,
    queries per head, or a gate shared by the group, each still equal to the reference."""
    C, K, x, g, _, _ = mamba2_inputs(rng)

    def run(C, K, x, g, chunk_size=8):
        before = blocks[0]
        out = causal_linear_attention(
            C, K, x, identity, chunk_size=chunk_size, log_decay=g, normalize=False, seq_axis=1
        )
        want, _, _ = decayed_loop(*(to_heads_first(a) for a in (C, K, x, g)), normalize=False)
        np.testing.assert_allclose(out, np.moveaxis(want, -2, 1), rtol=1e-10, atol=1e-10)
        return blocks[0] > before

    assert run(C, K, x, g)
    strong = g.copy()
    strong[1, 30:32, 0, 2] = -FACTORED_SPAN / 2 - 0.5  # one quarter of one head beyond
    assert not run(C, K, x, strong)
    assert not run(C, K, x, g, chunk_size=16)  # 45 tokens: three chunks of 16
    heads = (B, T, GROUPS, HEADS, N)
    assert not run(np.broadcast_to(C, heads).copy(), np.broadcast_to(K, heads).copy(), x, g)
    assert not run(C, K, x, g[..., :1, :])  # one gate per group


@pytest.mark.parametrize(
    ("gate", "admitted"),
    [
        (np.full(16, -4.0), True),  # quarters of 4 tokens sum to exactly -16
        (np.full(16, -4.01), False),
        (np.r_[np.full(4, -0.1), -15.5, np.full(11, -0.1)], True),  # the largest decay alone
        (np.r_[np.full(4, -0.1), -15.8, np.full(11, -0.1)], False),  # is not enough: its quarter
        (np.r_[np.full(15, -0.1), np.nan], False),
        (np.r_[np.full(15, -0.1), -np.inf], False),
    ],
)
def test_the_span(gate, admitted):
    G = gate[None, :, None]  # (1, T, 1), chunks of 16
    assert within_span(np, G, 16) is admitted
    assert within_span(np, G.astype(np.float32), 16) is admitted
    assert not within_span(np, G, 6)  # not a multiple of four
    assert not within_span(np, G.astype(np.float16), 16)


def test_torch_func_transforms(blocks, rng):
    """Inside ``torch.func.vmap`` and ``grad`` the gate's values cannot be read: the per-head
    form runs, with the same results as the calls outside (where the columns run)."""
    torch = pytest.importorskip("torch")
    C, K, x, g, _, _ = (torch.tensor(a) for a in mamba2_inputs(rng))

    def call(C, K, x, g):  # one row of the batch: time on axis 0
        return causal_linear_attention(
            C, K, x, identity, chunk_size=8, log_decay=g, normalize=False, seq_axis=0
        )

    mapped = torch.func.vmap(call)(C, K, x, g)
    assert blocks[0] == 0
    rows = torch.stack([call(*(a[i] for a in (C, K, x, g))) for i in range(B)])
    assert blocks[0] == B
    torch.testing.assert_close(mapped, rows, rtol=1e-12, atol=1e-12)
    C, K, x, g = (a[0] for a in (C, K, x, g))
    gradient = torch.func.grad(lambda x: call(C, K, x, g).square().sum())(x)
    assert blocks[0] == B
    x = x.clone().requires_grad_(True)
    call(C, K, x, g).square().sum().backward()
    assert blocks[0] == B + 1
    torch.testing.assert_close(gradient, x.grad, rtol=1e-12, atol=1e-12)


def test_torch_writes_each_chunks_reads_as_the_chain_runs(monkeypatch, rng):
    """On PyTorch without a gradient to record, the chain of states writes each chunk's read-out
    into its slot (``_backend.fused.fused_chain_reads``; batch and groups make the slots strided):
    the same outputs and state as the stacked states' batched product. With a gradient to
    record the array-API chain runs."""
    torch = pytest.importorskip("torch")
    original, taken = prefix.fused_chain_reads, []

    def spy(*args):
        result = original(*args)
        taken.append(result is not None)
        return result

    C, K, x, g, S0, z0 = (torch.tensor(a) for a in mamba2_inputs(rng))

    def run(fused, grad=False):
        monkeypatch.setattr(prefix, "fused_chain_reads", spy if fused else lambda *a: None)
        out, state = causal_linear_attention(
            C, K, x.clone().requires_grad_(grad), identity, chunk_size=8, log_decay=g,
            normalize=False, return_state=True, seq_axis=1,
            initial_state=LinearAttentionState(S0, z0),
        )  # fmt: skip
        return [out.detach(), state.S.detach(), state.z.detach()]

    fast, chain = run(True), run(False)
    assert taken and all(taken)
    for a, b in zip(fast, chain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    taken.clear()
    run(True, grad=True)
    assert taken and not any(taken)
