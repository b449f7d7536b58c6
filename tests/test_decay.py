"""Decay and gating (``log_decay``, ``normalize``) in every form, against a float64 loop.

The reference (:func:`tests.reference.decayed_loop`) is an independent per-token loop: for each
token the state decays by ``exp(g_t)`` and then the token is added. Every backend x method x
decay kind (a float, a constant per head, a scalar gate per token, a gate per channel) x
``normalize`` is compared with it, outputs and final state; then split/resume, ``step`` after a
chunked prefill, left and right padding, packed sequences, ``jax.jit``, strong decay in float32
and bfloat16 at T = 4096, and the Mamba-2 SSD identity with a naive selective scan.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

import polylin
from polylin import LinearAttentionState, causal_linear_attention, masked_kernel_attention, step
from polylin.feature_maps import identity
from polylin.testing import Backend

from .reference import decayed_loop, elu_plus_one, rounded

B, H, D_K, D_V = 2, 2, 4, 3
KINDS = ("float", "head", "token", "channel")


def decay_of(kind: str, rng: np.random.Generator, T: int, d_phi: int = D_K):
    """A log decay of the given kind for ``(B, H, T, d)`` inputs (a float or a NumPy array)."""
    if kind == "float":
        return -0.3
    if kind == "head":  # RetNet: gamma_h = 1 - 2^(-5-h), one fixed decay per head
        return np.log(1 - 2.0 ** (-5 - np.arange(H, dtype=np.float64)))[:, None, None]
    if kind == "token":  # Mamba-2 / simple GLA: a scalar gate per token
        return -rng.uniform(0, 2, (B, H, T, 1))
    return -rng.uniform(0, 2, (B, H, T, d_phi))  # GLA: one gate per channel


def to_backend(backend, x, dtype="float64"):
    return x if isinstance(x, float) else backend.from_numpy(np.asarray(x), dtype)


def call(backend, function, *arrays, **options):
    """``function(*arrays, **options)``, under ``jax.jit`` on JAX (eager JAX dispatches each
    small operation separately: slow); options are static. The recurrent form stays eager (a
    traced per-token loop takes longer to compile than to run)."""
    if backend not in (Backend.JAX, Backend.JAX_CUDA) or options.get("method") == "recurrent":
        return function(*arrays, **options)
    import jax

    return jax.jit(lambda *xs: function(*xs, **options))(*arrays)


def inputs(rng, T, lead=(B, H)):
    return [rng.standard_normal((*lead, T, d)) for d in (D_K, D_K, D_V)]


# (T, chunk_size): several chunks with a partial last one (per channel: rounded up to 32).
SHAPES = {"float": (29, 8), "head": (29, 8), "token": (29, 8), "channel": (45, 24)}


@pytest.mark.slow_grid(cover=("method", "kind"))
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "unnormalized"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", polylin.METHODS)
def test_methods_match_reference(backend, method, kind, normalize, rng):
    T, chunk = SHAPES[kind]
    if method == "recurrent":  # a Python loop over T: a short sequence is enough
        T = 11
    q, k, v = inputs(rng, T)
    g = decay_of(kind, rng, T)
    expected, S, z = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=normalize)
    arrays = [backend.from_numpy(x) for x in (q, k, v)]
    if not isinstance(g, float):
        arrays.append(backend.from_numpy(g))

    def attend(q, k, v, g=g, **options):
        return causal_linear_attention(q, k, v, log_decay=g, return_state=True, **options)

    out, state = call(
        backend, attend, *arrays, method=method, chunk_size=chunk, normalize=normalize
    )
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(state.S), S, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(state.z), z, rtol=1e-9, atol=1e-10)


def test_masked_kernel_attention_with_decay(backend, rng):
    q, k, v = inputs(rng, 11)
    g = decay_of("channel", rng, 11)
    for normalize in (True, False):
        expected, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=normalize)
        out = masked_kernel_attention(
            *(backend.from_numpy(x) for x in (q, k, v)),
            log_decay=backend.from_numpy(g), normalize=normalize,
        )  # fmt: skip
        np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-9, atol=1e-10)


def test_linear_attention_unnormalized(backend, rng):
    q, k, v = (rng.standard_normal((2, T, d)) for T, d in ((5, 4), (7, 4), (7, 3)))
    out = polylin.linear_attention(*(backend.from_numpy(x) for x in (q, k, v)), normalize=False)
    expected = elu_plus_one(q) @ (np.swapaxes(elu_plus_one(k), -1, -2) @ v)
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-12, atol=1e-12)


def test_log_decay_zero_is_no_decay(rng):
    q, k, v = inputs(rng, 20)
    np.testing.assert_array_equal(
        causal_linear_attention(q, k, v, log_decay=0.0), causal_linear_attention(q, k, v)
    )


@pytest.mark.slow_grid
@pytest.mark.parametrize("kind", ["head", "channel"])
def test_split_resume_across_methods(backend, kind, rng):
    """A state from one method continues in every other; initial_state decays like any state."""
    T, split = 30, 19
    q, k, v = inputs(rng, T)
    g = decay_of(kind, rng, T)
    whole, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g)
    xs = [backend.from_numpy(x) for x in (q, k, v)]
    gx = backend.from_numpy(g)
    g_first, g_second = (gx, gx) if kind == "head" else (gx[..., :split, :], gx[..., split:, :])
    first, state = causal_linear_attention(
        *(x[..., :split, :] for x in xs), chunk_size=16, log_decay=g_first, return_state=True
    )
    np.testing.assert_allclose(backend.to_numpy(first), whole[..., :split, :], atol=1e-10)
    for method in polylin.METHODS:
        second = causal_linear_attention(
            *(x[..., split:, :] for x in xs), method=method, chunk_size=8,
            log_decay=g_second, initial_state=state,
        )  # fmt: skip
        np.testing.assert_allclose(backend.to_numpy(second), whole[..., split:, :], atol=1e-10)


def test_step_continues_chunked_prefill(backend, rng):
    T, prefill = 20, 17
    q, k, v = inputs(rng, T)
    g = decay_of("channel", rng, T)
    for normalize in (True, False):
        whole, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=normalize)
        xs = [backend.from_numpy(x) for x in (q, k, v)]
        gx = backend.from_numpy(g)
        _, state = causal_linear_attention(
            *(x[..., :prefill, :] for x in xs), log_decay=gx[..., :prefill, :],
            normalize=normalize, chunk_size=8, return_state=True,
        )  # fmt: skip
        for t in range(prefill, T):
            o_t, state = step(
                *(x[..., t, :] for x in xs), state, log_decay=gx[..., t, :], normalize=normalize
            )
            np.testing.assert_allclose(backend.to_numpy(o_t), whole[..., t, :], atol=1e-10)
    # A float decay, a scalar gate and a per-channel gate broadcast against (..., d_phi) alike.
    S0, z0 = rng.standard_normal((B, H, D_K, D_V)), rng.random((B, H, D_K))
    expected, _, _ = decayed_loop(
        *(elu_plus_one(x[..., :1, :]) for x in (q, k)), v[..., :1, :], -0.5, S0=S0, z0=z0
    )
    state = LinearAttentionState(backend.from_numpy(S0), backend.from_numpy(z0))
    token = [backend.from_numpy(x[..., 0, :]) for x in (q, k, v)]
    for g_t in (-0.5, np.full((B, H, 1), -0.5), np.full((D_K,), -0.5)):
        o_t, _ = step(*token, state, log_decay=to_backend(backend, g_t))
        np.testing.assert_allclose(backend.to_numpy(o_t), expected[..., 0, :], atol=1e-12)


@pytest.mark.slow_grid
@pytest.mark.parametrize("kind", ["token", "channel"])
@pytest.mark.parametrize("method", polylin.METHODS)
def test_padding_passes_the_state_through(backend, method, kind, rng):
    """A masked token neither adds to the state nor decays it, and its output is 0."""
    T = 20
    q, k, v = inputs(rng, T)
    g = decay_of(kind, rng, T)
    mask = np.ones((B, T), dtype=bool)
    mask[0, :9] = False  # left padding
    mask[1, -5:] = False  # right padding
    mask[1, 10] = False  # a hole
    expected, S, z = decayed_loop(
        elu_plus_one(q), elu_plus_one(k), v, g, mask=mask[:, None, :], normalize=False
    )
    out, state = causal_linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)),
        method=method, chunk_size=8, log_decay=backend.from_numpy(g),
        attention_mask=backend.from_numpy(mask[:, None, :]), normalize=False, return_state=True,
    )  # fmt: skip
    out = backend.to_numpy(out)
    np.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-10)
    np.testing.assert_array_equal(out[0, :, :9], 0.0)
    np.testing.assert_allclose(backend.to_numpy(state.S), S, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(state.z), z, rtol=1e-9, atol=1e-10)


@pytest.mark.slow_grid
@pytest.mark.parametrize("kind", ["float", "head", "token", "channel"])
def test_cu_seqlens_each_sequence_from_its_own_state(backend, kind, rng):
    lengths = [5, 13, 1, 9]
    offsets = list(np.cumsum([0, *lengths]).tolist())
    T = offsets[-1]
    q, k, v = inputs(rng, T, lead=(H,))
    g = decay_of(kind, rng, T)
    if not isinstance(g, float):
        g = g[0]  # (H, T or 1, 1 or d)
    out, state = causal_linear_attention(
        *(backend.from_numpy(x) for x in (q, k, v)),
        cu_seqlens=offsets, log_decay=to_backend(backend, g), chunk_size=4, return_state=True,
    )  # fmt: skip
    out = backend.to_numpy(out)
    for n, (a, b) in enumerate(pairwise(offsets)):
        g_n = g if isinstance(g, float) or g.shape[-2] == 1 else g[..., a:b, :]
        expected, S, _ = decayed_loop(
            elu_plus_one(q[..., a:b, :]), elu_plus_one(k[..., a:b, :]), v[..., a:b, :], g_n
        )
        np.testing.assert_allclose(out[..., a:b, :], expected, atol=1e-10)
        np.testing.assert_allclose(backend.to_numpy(state.S)[..., n, :, :], S, atol=1e-10)


@pytest.mark.parametrize("kind", ["head", "token", "channel"])
@pytest.mark.only_backend(Backend.JAX)
@pytest.mark.eager  # jitted here, explicitly
def test_jax_jit(backend, kind, rng):
    import jax

    T = 45
    q, k, v = inputs(rng, T)
    g = decay_of(kind, rng, T)
    expected, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=False)
    f = jax.jit(lambda q, k, v, g: causal_linear_attention(q, k, v, log_decay=g, chunk_size=24,
                                                          normalize=False))  # fmt: skip
    out = f(*(Backend.JAX.from_numpy(x) for x in (q, k, v, g)))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.slow_grid
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["token", "channel"])
@pytest.mark.only_backend(Backend.NUMPY, Backend.TORCH, Backend.JAX)
def test_strong_decay_long_sequence(backend, dtype, kind):
    """T = 4096, log decays down to -30 per token, with long stretches of no decay in between
    (where cumulative sums would cancel): every exponent stays <= 0 and the accuracy is that of
    the dtype. The reference sees the same dtype-rounded inputs."""
    rng = np.random.default_rng(30)
    T, d = 4096, 8
    q, k, v = (rounded(rng.standard_normal((2, T, d)), dtype) for _ in range(3))
    width = 1 if kind == "token" else d
    g = -30.0 * rng.uniform(0, 1, (2, T, width)) ** 4  # mostly weak, some down to -30
    g[:, 1000:1500] = 0.0  # a long stretch of no decay after strong ones
    g[:, 2000:2100] = -30.0
    g = rounded(g, dtype)
    expected, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g)
    out = call(
        backend,
        lambda q, k, v, g: causal_linear_attention(q, k, v, log_decay=g),
        *(backend.from_numpy(x, dtype) for x in (q, k, v, g)),
    )
    got = backend.to_numpy(out).astype(np.float64)
    assert np.isfinite(got).all()
    atol = {"float32": 2e-5, "bfloat16": 1.6e-2}[dtype] * np.abs(v).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def channel_gate_reference(q, k, g):
    """Float64, entry by entry: ``A_ts = sum_c q_tc k_sc exp(sum_{s<r<=t} g_rc)`` (s <= t),
    ``q * exp(b)``, ``k * exp(B - b)`` and ``exp(B)`` over one chunk (axis -2)."""
    C = q.shape[-2]
    A = np.zeros((*np.broadcast_shapes(q.shape[:-2], g.shape[:-2]), C, C))
    for t in range(C):
        for s in range(t + 1):
            span = np.exp(np.sum(g[..., s + 1 : t + 1, :], axis=-2))
            A[..., t, s] = np.sum(q[..., t, :] * k[..., s, :] * span, axis=-1)
    before = np.stack([np.sum(g[..., : t + 1, :], axis=-2) for t in range(C)], axis=-2)
    after = np.stack([np.sum(g[..., s + 1 :, :], axis=-2) for s in range(C)], axis=-2)
    whole = np.exp(np.sum(g, axis=-2, keepdims=True))
    return A, q * np.exp(before), k * np.exp(after), whole


@pytest.mark.slow_grid
@pytest.mark.parametrize("chunk", [1, 2, 8, 32])
@pytest.mark.parametrize("decay_lead", [(2, 3), (3,)], ids=["full", "broadcast"])
def test_channel_gate_blocks(backend, chunk, decay_lead, rng):
    """The per-channel intra-chunk scores, built level by level from blocks of 2, 4, ... tokens,
    and the factors they leave (queries decayed from the chunk start, keys to the chunk end,
    the whole chunk's decay) against the entry-by-entry float64 sums."""
    from polylin._backend.namespace import array_namespace
    from polylin._forms.linear.chunked import _channel_gate

    q, k = rng.standard_normal((2, 2, 3, chunk, 4))
    g = -rng.uniform(0, 3, (*decay_lead, chunk, 4))
    x = [backend.from_numpy(a) for a in (q, k, g)]
    got = call(backend, lambda *xs: _channel_gate(array_namespace(xs[0]), *xs), *x)
    for name, a, b in zip(
        ("scores", "queries", "keys", "decay"), got, channel_gate_reference(q, k, g)
    ):
        np.testing.assert_allclose(backend.to_numpy(a), b, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.only_backend(Backend.NUMPY, Backend.TORCH, Backend.JAX)
def test_channel_gate_blocks_strong_decay_float32(backend, rng):
    """Float32, log decays from 0 down to -30 per token and -1e4 (every factor underflows):
    each score keeps float32's relative accuracy, nothing overflows, an underflow is a 0."""
    from polylin._backend.namespace import array_namespace
    from polylin._forms.linear.chunked import _channel_gate

    q, k = (rounded(rng.standard_normal((2, 64, 8)), "float32") for _ in range(2))
    g = -30.0 * rng.uniform(0, 1, (2, 64, 8)) ** 4
    g[:, 20:40] = 0.0
    g[:, 50:54] = -30.0
    g[:, 60] = -1e4
    g = rounded(g, "float32")
    x = [backend.from_numpy(a, "float32") for a in (q, k, g)]
    got = call(backend, lambda *xs: _channel_gate(array_namespace(xs[0]), *xs), *x)
    for name, a, b in zip(
        ("scores", "queries", "keys", "decay"), got, channel_gate_reference(q, k, g)
    ):
        a = backend.to_numpy(a).astype(np.float64)
        assert np.isfinite(a).all(), name
        # per entry: a few float32 roundings of sums of |q_c k_c| times factors <= 1
        scale = (
            channel_gate_reference(np.abs(q), np.abs(k), g)[0] if name == "scores" else np.abs(b)
        )
        assert np.all(np.abs(a - b) <= 2e-6 * scale + 1e-30), name


@pytest.mark.slow_grid
@pytest.mark.parametrize("chunk_size", [1, 5, 100])
def test_channel_gate_any_chunk_size(backend, chunk_size, rng):
    """The chunk is rounded up to a power of two for a per-channel gate: any chunk_size gives
    the same result."""
    q, k, v = inputs(rng, 45)
    g = decay_of("channel", rng, 45)
    expected, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g, normalize=False)
    out = call(
        backend,
        lambda q, k, v, g: causal_linear_attention(
            q, k, v, log_decay=g, chunk_size=chunk_size, normalize=False
        ),
        *(backend.from_numpy(x) for x in (q, k, v, g)),
    )
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-9, atol=1e-10)


def naive_selective_scan(C, B_, x, dt, A):
    """Mamba-2's SSD with a scalar A per head, token by token: h_t = exp(A dt_t) h_{t-1} +
    dt_t B_t x_t^T, y_t = C_t h_t. Shapes: C, B_ (heads, T, n); x (heads, T, p); dt (heads, T)."""
    heads, T, n = C.shape
    h = np.zeros((heads, n, x.shape[-1]))
    ys = []
    for t in range(T):
        h = np.exp(A * dt[:, t])[:, None, None] * h + dt[:, t, None, None] * (
            B_[:, t, :, None] * x[:, t, None, :]
        )
        ys.append(np.einsum("hn,hnp->hp", C[:, t], h))
    return np.stack(ys, axis=1)


def test_mamba2_ssd_equals_naive_selective_scan(backend, rng):
    heads, T, n, p = 3, 40, 5, 4
    C, B_ = rng.standard_normal((2, heads, T, n))
    x = rng.standard_normal((heads, T, p))
    dt = np.log1p(np.exp(rng.standard_normal((heads, T))))  # softplus
    A = -np.exp(rng.standard_normal(heads))  # negative, one per head
    expected = naive_selective_scan(C, B_, x, dt, A)
    y = causal_linear_attention(
        backend.from_numpy(C), backend.from_numpy(B_), backend.from_numpy(x * dt[..., None]),
        identity, log_decay=backend.from_numpy((A[:, None] * dt)[..., None]), normalize=False,
        chunk_size=16,
    )  # fmt: skip
    np.testing.assert_allclose(backend.to_numpy(y), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    ("log_decay", "error", "match"),
    [
        (0.5, ValueError, "log_decay must be a finite number <= 0"),
        (float("nan"), ValueError, "log_decay must be a finite number <= 0"),
        (True, TypeError, "log_decay must be None"),
        ("fast", TypeError, "log_decay must be None"),
        (np.zeros((B, H, 7, 1)), ValueError, "broadcast against the mapped keys"),
        (np.zeros((B, H, 10, 3)), ValueError, "broadcast against the mapped keys"),
        (np.zeros((1, 1, B, H, 10, 1)), ValueError, "broadcast against the mapped keys"),
        (np.zeros((B, H, 10, 1), dtype=np.int64), TypeError, "real floating"),
    ],
)
def test_bad_log_decay(log_decay, error, match, rng):
    q, k, v = inputs(rng, 10)
    with pytest.raises(error, match=match):
        causal_linear_attention(q, k, v, log_decay=log_decay)


def test_a_number_minus_inf_says_a_reset_is_an_array_value(rng):
    """A number log_decay must be finite (docs/numerics.md): -inf would reset the state at every
    token; the error says that a reset is a -inf array value, at every entry point."""
    q, k, v = inputs(rng, 10)
    beta = np.full((B, H, 10, 1), 0.5)
    calls = [
        *(lambda g, m=m: causal_linear_attention(q, k, v, method=m, log_decay=g)
          for m in polylin.METHODS),
        lambda g: masked_kernel_attention(q, k, v, log_decay=g),
        lambda g: step(q[..., 0, :], k[..., 0, :], v[..., 0, :], log_decay=g),
        *(lambda g, m=m: polylin.delta_rule_attention(q, k, v, beta, method=m, log_decay=g)
          for m in polylin.DELTA_METHODS),
        lambda g: polylin.delta_rule_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], 0.5,
                                          log_decay=g),
    ]  # fmt: skip
    for call in calls:
        for g in (-np.inf, np.float32(-np.inf)):
            with pytest.raises(ValueError, match=r"^log_decay must be a finite number <= 0, "
                               r"got -inf: .* pass a log_decay array with -inf there"):  # fmt: skip
                call(g)
        call(np.full((1, 1), -np.inf))  # the array is the documented reset


def test_bad_log_decay_library_and_options(rng):
    torch = pytest.importorskip("torch")
    q, k, v = inputs(rng, 10)
    with pytest.raises(TypeError, match="log_decay must be an array of the same library"):
        causal_linear_attention(q, k, v, log_decay=torch.zeros(10, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="causal=True"):
        masked_kernel_attention(q, k, v, causal=False, log_decay=-0.1)
    with pytest.raises(TypeError, match="normalize must be True or False"):
        causal_linear_attention(q, k, v, normalize=np.bool_(True))
    with pytest.raises(ValueError, match="broadcast against the mapped keys"):
        step(q[..., 0, :], k[..., 0, :], v[..., 0, :], log_decay=np.zeros((B, H, 3)))


def test_inputs_are_not_modified(rng):
    q, k, v = inputs(rng, 20)
    g = decay_of("channel", rng, 20)
    copies = [x.copy() for x in (q, k, v, g)]
    state = LinearAttentionState(rng.standard_normal((B, H, D_K, D_V)), rng.random((B, H, D_K)))
    state_copy = [x.copy() for x in state]
    for method in polylin.METHODS:
        causal_linear_attention(q, k, v, method=method, log_decay=g, initial_state=state)
    for x, c in zip((q, k, v, g, *state), (*copies, *state_copy)):
        np.testing.assert_array_equal(x, c)


def test_log_decay_follows_seq_axis(backend, rng):
    """With seq_axis=1, (batch, T, heads, d) inputs take a log decay in the same layout."""
    q, k, v = inputs(rng, 21)
    g = decay_of("channel", rng, 21)
    expected, _, _ = decayed_loop(elu_plus_one(q), elu_plus_one(k), v, g)
    moved = [backend.from_numpy(np.swapaxes(x, 1, 2)) for x in (q, k, v, g)]
    out = causal_linear_attention(*moved[:3], seq_axis=1, log_decay=moved[3], chunk_size=8)
    np.testing.assert_allclose(
        backend.to_numpy(out), np.swapaxes(expected, 1, 2), rtol=1e-9, atol=1e-10
    )


def test_log_decay_with_seq_axis_needs_full_rank(rng):
    q, k, v = (np.swapaxes(x, 1, 2) for x in inputs(rng, 10))
    with pytest.raises(ValueError, match="log_decay has 3 dimensions"):
        causal_linear_attention(q, k, v, seq_axis=1, log_decay=np.zeros((10, H, 1)))
