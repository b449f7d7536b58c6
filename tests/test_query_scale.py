"""``scale`` of linear attention and its steps: the mapped queries times ``scale``.

Every method, gate kind (none, a number, a scalar gate, a per-channel gate that factors and one
that takes the levels) and ``normalize`` must equal a float64 loop run on the scaled mapped
queries, the state unchanged by the scale; ``step`` and ``prepare_step`` continue a scaled
prefill; the factored per-channel gate carries the scale in its factors, with no operation
the size of the queries that the unscaled call does not make; a scale that is not a finite real
number is an error naming ``scale``; ``add_matmul``'s ``alpha`` and ``intra_chunk``'s
``row_scale`` (the two places the scale is folded into) scale what they say and nothing else.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import polylin
from polylin import causal_linear_attention, prepare_step, step
from polylin._backend.ops import add_matmul
from polylin._forms.common.intra_chunk import SCORES, SOLVE, intra_chunk
from polylin.feature_maps import identity
from polylin.testing import Backend

from .reference import decayed_loop, elu_plus_one
from .test_decay import call
from .test_delta_rule import needs

B, H, D_K, D_V = 2, 2, 4, 3
SCALE = 0.37
KINDS = ("none", "float", "token", "bounded", "channel")


def _gate(kind: str, rng: np.random.Generator, T: int):
    if kind == "none":
        return None
    if kind == "float":
        return -0.3
    if kind == "token":
        return -rng.uniform(0, 2, (B, H, T, 1))
    if kind == "bounded":  # at most 0.4 per token: a chunk of 32 factors (FACTORED_SPAN)
        return -rng.uniform(0, 0.4, (B, H, T, D_K))
    return -rng.uniform(0, 2, (B, H, T, D_K))  # beyond the bound: the levels


@pytest.mark.slow_grid(cover=("method", "kind"))
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "unnormalized"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", polylin.METHODS)
def test_scale_multiplies_the_mapped_queries(backend, method, kind, normalize, rng):
    T = 11 if method == "recurrent" else 45
    q, k, v = (rng.standard_normal((B, H, T, d)) for d in (D_K, D_K, D_V))
    g = _gate(kind, rng, T)
    expected, S, z = decayed_loop(
        elu_plus_one(q) * SCALE, elu_plus_one(k), v, g, normalize=normalize
    )
    arrays = [backend.from_numpy(x) for x in (q, k, v)]
    if g is not None and not isinstance(g, float):
        arrays.append(backend.from_numpy(g))

    def attend(q, k, v, g=g, **options):
        return causal_linear_attention(q, k, v, log_decay=g, return_state=True, **options)

    out, state = call(
        backend, attend, *arrays, method=method, chunk_size=16, normalize=normalize,
        scale=SCALE,
    )  # fmt: skip
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(state.S), S, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(state.z), z, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["token", "bounded"])
def test_steps_continue_a_scaled_prefill(rng, kind):
    T, prompt = 12, 8
    q, k, v = (rng.standard_normal((B, H, T, d)) for d in (D_K, D_K, D_V))
    g = _gate(kind, rng, T)
    whole = causal_linear_attention(q, k, v, identity, log_decay=g, normalize=False, scale=SCALE)
    _, state = causal_linear_attention(
        q[..., :prompt, :], k[..., :prompt, :], v[..., :prompt, :], identity,
        log_decay=g[..., :prompt, :], normalize=False, scale=SCALE, return_state=True,
    )  # fmt: skip
    prepared = prepare_step(identity, normalize=False, scale=SCALE)
    plain_state = prepared_state = state
    for t in range(prompt, T):
        token = [x[..., t, :] for x in (q, k, v)]
        o_t, plain_state = step(
            *token, plain_state, identity, log_decay=g[..., t, :], normalize=False, scale=SCALE
        )
        p_t, prepared_state = prepared(*token, prepared_state, log_decay=g[..., t, :])
        np.testing.assert_allclose(o_t, whole[..., t, :], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(p_t, o_t)
    np.testing.assert_array_equal(prepared_state.S, plain_state.S)


def _op_shapes(torch, fn):
    """Counter of ``(operation, output shape)`` over the PyTorch operations of ``fn()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                seen[(str(func), tuple(out.shape))] += 1
            return out

    with Record():
        fn()
    return seen


def test_a_factored_gate_carries_the_scale_without_a_pass_over_the_queries(rng):
    torch = needs(Backend.TORCH)
    T, d = 128, 16
    q, k, v = (torch.tensor(rng.standard_normal((1, 4, T, d)), dtype=torch.float32)
               for _ in range(3))  # fmt: skip
    g = torch.tensor(-rng.uniform(0, 0.4, (1, 4, T, d)), dtype=torch.float32)

    def run(**options):
        return lambda: causal_linear_attention(
            q, k, v, identity, log_decay=g, normalize=False, **options)

    plain, scaled = _op_shapes(torch, run()), _op_shapes(torch, run(scale=SCALE))
    extra = scaled - plain
    assert extra, "the scale is applied somewhere"
    largest = max(math.prod(shape) for _, shape in extra)
    assert largest * 8 <= q.numel(), f"an operation the size of the queries: {extra}"
    torch.testing.assert_close(run(scale=SCALE)(), run()() * SCALE, rtol=1e-5, atol=1e-5)


BAD_SCALES = [
    ("0.5", TypeError), (True, TypeError), (None, TypeError), (math.inf, ValueError),
    (math.nan, ValueError),
]  # fmt: skip


@pytest.mark.parametrize("function", ["attention", "step", "prepared"])
@pytest.mark.parametrize(("scale", "error"), BAD_SCALES)
def test_a_scale_that_is_not_a_finite_number_is_an_error(rng, function, scale, error):
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    kept = [x.copy() for x in (q, k, v)]
    with pytest.raises(error, match="scale"):
        if function == "attention":
            causal_linear_attention(q, k, v, scale=scale)
        elif function == "step":
            step(q[:, 0], k[:, 0], v[:, 0], scale=scale)
        else:
            prepare_step(scale=scale)(q[:, 0], k[:, 0], v[:, 0])
    for x, y in zip((q, k, v), kept):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("backend_", [Backend.NUMPY, Backend.TORCH], ids=str)
@pytest.mark.parametrize("inner", [2, 9], ids=["a-smaller", "product-smaller"])
def test_add_matmul_alpha_scales_the_product_only(rng, backend_, inner):
    xp = needs(backend_)
    c, a, b = (rng.standard_normal(s) for s in [(2, 3, 4, 5), (2, 3, 4, inner), (2, 3, inner, 5)])
    want = c + 0.25 * (a @ b)
    for fresh in (False, True):
        arrays = [backend_.from_numpy(x) for x in (c, a, b)]
        got = add_matmul(xp, *arrays, fresh=fresh, alpha=0.25)
        np.testing.assert_allclose(backend_.to_numpy(got), want, rtol=1e-12, atol=1e-12)
        for x, y in zip(arrays[1:], (a, b)):
            np.testing.assert_array_equal(backend_.to_numpy(x), y)


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("gate", ["none", "scalar", "bounded", "channel"])
def test_a_row_scale_scales_the_decayed_rows_only(rng, gate, relative):
    xp = needs(Backend.NUMPY)
    C, d = 8, 5
    Q, A, K = (rng.standard_normal((2, 3, C, d)) / 2 for _ in range(3))
    G = {"none": None, "scalar": -rng.uniform(0, 3, (2, 3, C, 1)),
         "bounded": -rng.uniform(0, 1.5, (2, 3, C, d)),
         "channel": -rng.uniform(0, 6, (2, 3, C, d))}[gate]  # fmt: skip
    rows = [(Q, SCORES), (A, SOLVE)]
    plain = intra_chunk(xp, K, G, rows, relative=relative)
    scaled = intra_chunk(xp, K, G, rows, relative=relative, row_scale=SCALE)
    for got, want in zip(scaled.rows, plain.rows):
        np.testing.assert_allclose(got, want * SCALE, rtol=1e-13, atol=1e-15)
    pairs = [*zip(scaled.matrices, plain.matrices), (scaled.keys, plain.keys)]
    pairs += [(scaled.whole, plain.whole), (scaled.entry, plain.entry)]
    for got, want in pairs:
        if want is None:
            assert got is None
        else:
            np.testing.assert_array_equal(got, want)
