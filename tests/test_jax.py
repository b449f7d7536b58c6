"""JAX transformations: every entry point under ``jax.jit`` and ``jax.vmap``, and ``jax.grad``.

The same polylin functions run unchanged inside traced JAX code: no in-place updates, no Python
control flow on array values, and the chunk size, method and other options are static (plain
Python values closed over with ``functools.partial`` or named in ``static_argnames``). Arrays,
attention masks and initial states may be traced arguments. Runs on ``jax`` (CPU, x64 on), on
``jax:x32`` (x64 off, float32 inputs) where a test takes a ``dtype``, and on ``jax:cuda`` where
JAX sees a GPU. Elsewhere the suite calls the entry points under an automatic jit; here they are
called as written (``eager``), inside the transformations each test applies, or eagerly.
"""

from __future__ import annotations

import functools
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
from polylin.testing import Backend

from .reference import ATOL, masked_kernel, rounded

pytestmark = [pytest.mark.only_backend(Backend.JAX, Backend.JAX_CUDA), pytest.mark.eager]

# T = 21 is not a multiple of the chunk size 8 (a padded last chunk). The recurrent form unrolls
# one step per token into the traced program: it gets T = 12, so that compiling it stays fast.
LEAD, T, D_K, D_V, CHUNK = (2, 3), 21, 6, 5, 8


def _length(method: str) -> int:
    return 12 if method == "recurrent" else T


@pytest.fixture
def jb(backend) -> Backend:
    """The JAX driver of this test (``jax``, ``jax:x32``, ``jax:cuda``)."""
    return backend


@pytest.fixture
def jax(backend):
    import jax

    return jax


def _qkv(rng, lead=LEAD, t=T, d_k=D_K, d_v=D_V):
    return (
        rng.standard_normal((*lead, t, d_k)),
        rng.standard_normal((*lead, t, d_k)),
        rng.standard_normal((*lead, t, d_v)),
    )


def _check_jax_output(jb, out, like):
    """``out`` is a concrete JAX array on ``like``'s device with ``like``'s dtype."""
    import jax

    assert isinstance(out, jax.Array)
    assert out.devices() == like.devices()
    assert out.dtype == like.dtype


@pytest.mark.parametrize("method", polylin.METHODS)
def test_jit_partial_matches_reference(jb, jax, method, rng):
    arrays = _qkv(rng, t=_length(method))
    xs = [jb.from_numpy(a) for a in arrays]
    traces = []

    def attend(q, k, v):
        traces.append(type(q).__name__)  # runs only while JAX traces, with tracers
        return causal_linear_attention(q, k, v, method=method, chunk_size=CHUNK)

    fn = jax.jit(attend)
    out = fn(*xs)
    _check_jax_output(jb, out, xs[0])
    np.testing.assert_allclose(jb.to_numpy(out), masked_kernel(*arrays), rtol=0, atol=1e-10)
    # A second call with new values of the same shape reuses the compiled program.
    arrays2 = _qkv(rng, t=_length(method))
    out2 = fn(*(jb.from_numpy(a) for a in arrays2))
    np.testing.assert_allclose(jb.to_numpy(out2), masked_kernel(*arrays2), rtol=0, atol=1e-10)
    assert len(traces) == 1 and "Tracer" in traces[0]
    # The same through functools.partial, the form the docs show.
    fn = jax.jit(functools.partial(causal_linear_attention, method=method, chunk_size=CHUNK))
    np.testing.assert_allclose(jb.to_numpy(fn(*xs)), masked_kernel(*arrays), rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", polylin.METHODS)
def test_jit_static_argnames_with_state(jb, jax, method, rng):
    """Options as static keyword arguments; the state comes back as a traced pytree."""
    arrays = _qkv(rng, t=_length(method))
    xs = [jb.from_numpy(a) for a in arrays]
    fn = jax.jit(
        causal_linear_attention, static_argnames=("method", "chunk_size", "eps", "return_state")
    )
    out, state = fn(*xs, method=method, chunk_size=CHUNK, eps=1e-6, return_state=True)
    assert isinstance(state, LinearAttentionState)
    _check_jax_output(jb, out, xs[0])
    _check_jax_output(jb, state.S, xs[0])
    np.testing.assert_allclose(jb.to_numpy(out), masked_kernel(*arrays), rtol=0, atol=1e-10)
    _, expected = causal_linear_attention(*arrays, return_state=True)  # NumPy, eager
    np.testing.assert_allclose(jb.to_numpy(state.S), expected.S, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(jb.to_numpy(state.z), expected.z, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("method", polylin.METHODS)
def test_jit_traced_mask_and_initial_state(jb, jax, method, rng):
    """A traced attention mask and a traced initial state (continuing a prefix) under jit."""
    t = _length(method)
    arrays = _qkv(rng, t=t)
    mask = rng.random((*LEAD, t)) > 0.3
    mask[..., 0] = True
    fn = jax.jit(functools.partial(causal_linear_attention, method=method, chunk_size=CHUNK))
    xs = [jb.from_numpy(a) for a in arrays]
    out = fn(*xs, attention_mask=jb.from_numpy(mask))
    np.testing.assert_allclose(
        jb.to_numpy(out), masked_kernel(*arrays, mask=mask), rtol=0, atol=1e-10
    )

    cut = 9
    with_state = jax.jit(
        lambda q, k, v, state: causal_linear_attention(
            q, k, v, method=method, chunk_size=CHUNK, initial_state=state
        )
    )
    _, prefix = causal_linear_attention(*(x[..., :cut, :] for x in xs), return_state=True)
    tail = with_state(*(x[..., cut:, :] for x in xs), prefix)
    np.testing.assert_allclose(
        jb.to_numpy(tail), masked_kernel(*arrays)[..., cut:, :], rtol=0, atol=1e-10
    )


def test_jit_cu_seqlens(jb, jax, rng):
    """Packed sequences: the offsets are static Python ints, the arrays traced."""
    offsets = [0, 5, 5, 13, T]
    arrays = _qkv(rng, lead=(2,))
    fn = jax.jit(functools.partial(causal_linear_attention, chunk_size=4, cu_seqlens=offsets))
    out = jb.to_numpy(fn(*(jb.from_numpy(a) for a in arrays)))
    for a, b in pairwise(offsets):
        piece = [x[..., a:b, :] for x in arrays]
        np.testing.assert_allclose(out[..., a:b, :], masked_kernel(*piece), rtol=0, atol=1e-10)


@pytest.mark.parametrize("t_q", [1, T, 30])
def test_jit_linear_attention(jb, jax, t_q, rng):
    q = rng.standard_normal((*LEAD, t_q, D_K))
    _, k, v = _qkv(rng)
    mask = rng.random((*LEAD, T)) > 0.5
    mask[..., 0] = True
    fn = jax.jit(linear_attention)
    xs = [jb.from_numpy(a) for a in (q, k, v)]
    out = fn(*xs)
    _check_jax_output(jb, out, xs[0])
    np.testing.assert_allclose(
        jb.to_numpy(out), masked_kernel(q, k, v, causal=False), rtol=0, atol=1e-10
    )
    masked = fn(*xs, attention_mask=jb.from_numpy(mask))
    np.testing.assert_allclose(
        jb.to_numpy(masked), masked_kernel(q, k, v, causal=False, mask=mask), rtol=0, atol=1e-10
    )


def test_jit_masked_kernel_and_step(jb, jax, rng):
    arrays = _qkv(rng)
    xs = [jb.from_numpy(a) for a in arrays]
    out = jax.jit(functools.partial(masked_kernel_attention, causal=True))(*xs)
    np.testing.assert_allclose(jb.to_numpy(out), masked_kernel(*arrays), rtol=0, atol=1e-10)

    # Decoding: one jitted step, reused for every token, carrying the state as a pytree.
    jitted_step = jax.jit(step)
    state = None
    outputs = []
    for t in range(T):
        o_t, state = jitted_step(*(x[..., t, :] for x in xs), state)
        outputs.append(jb.to_numpy(o_t))
    np.testing.assert_allclose(
        np.stack(outputs, axis=-2), masked_kernel(*arrays), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("method", polylin.METHODS)
def test_vmap_over_batch_axis(jb, jax, method, rng):
    """``vmap`` over a leading axis, alone and inside ``jit``; also over a non-leading axis."""
    t = _length(method)
    arrays = _qkv(rng, lead=(4,), t=t)
    xs = [jb.from_numpy(a) for a in arrays]
    single = functools.partial(causal_linear_attention, method=method, chunk_size=CHUNK)
    expected = masked_kernel(*arrays)
    out = jax.vmap(single)(*xs)  # each call sees one (T, d) sequence
    assert tuple(out.shape) == (4, t, D_V)
    np.testing.assert_allclose(jb.to_numpy(out), expected, rtol=0, atol=1e-10)
    out = jax.jit(jax.vmap(single))(*xs)
    np.testing.assert_allclose(jb.to_numpy(out), expected, rtol=0, atol=1e-10)
    # Batch on axis 1 of the inputs, produced on axis 0 of the outputs.
    swapped = [jax.numpy.swapaxes(x, 0, 1) for x in xs]  # (T, 4, d)
    out = jax.vmap(single, in_axes=1)(*swapped)
    np.testing.assert_allclose(jb.to_numpy(out), expected, rtol=0, atol=1e-10)


def test_vmap_with_state_and_mask(jb, jax, rng):
    arrays = _qkv(rng, lead=(3,))
    mask = rng.random((3, T)) > 0.3
    xs = [jb.from_numpy(a) for a in arrays]
    fn = jax.vmap(
        lambda q, k, v, m: causal_linear_attention(
            q, k, v, chunk_size=CHUNK, attention_mask=m, return_state=True
        )
    )
    out, state = fn(*xs, jb.from_numpy(mask))
    np.testing.assert_allclose(
        jb.to_numpy(out), masked_kernel(*arrays, mask=mask), rtol=0, atol=1e-10
    )
    _, expected = causal_linear_attention(*arrays, attention_mask=mask, return_state=True)
    assert tuple(state.S.shape) == (3, D_K, D_V)
    np.testing.assert_allclose(jb.to_numpy(state.S), expected.S, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(jb.to_numpy(state.z), expected.z, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_grad_matches_quadratic(jb, jax, method, rng):
    """The forms are differentiable (no in-place updates) and share their gradients."""
    t = 12  # the recurrent form's gradient program grows with T
    arrays = _qkv(rng, lead=(2,), t=t)
    xs = [jb.from_numpy(a) for a in arrays]
    weights = jb.from_numpy(rng.standard_normal((2, t, D_V)))

    def loss(q, k, v, method):
        out = causal_linear_attention(q, k, v, method=method, chunk_size=CHUNK)
        return jax.numpy.sum(out * weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnames="method")
    got = grads(*xs, method=method)
    want = grads(*xs, method="quadratic")
    for g, w in zip(got, want):
        np.testing.assert_allclose(jb.to_numpy(g), jb.to_numpy(w), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_jit_low_precision(jb, jax, dtype, rng):
    """Half inputs accumulate in float32 under jit too and come back in their own dtype; with
    x64 off (``jax:x32``) float32 inputs give float32 results at float32 accuracy."""
    arrays = [rounded(a, dtype) for a in _qkv(rng)]
    xs = [jb.from_numpy(a, dtype) for a in arrays]
    out = jax.jit(functools.partial(causal_linear_attention, chunk_size=CHUNK))(*xs)
    _check_jax_output(jb, out, xs[0])
    np.testing.assert_allclose(jb.to_numpy(out), masked_kernel(*arrays), rtol=0, atol=ATOL[dtype])


@pytest.mark.not_generated(
    reason="op by op, every operation compiles once per shape (~3 s): run in users' default "
    "mode, x64 off; with x64 on the recurrent form runs op by op in the rest of the suite",
    backend="jax",
)
@pytest.mark.parametrize("dtype", ["float32"])
def test_eager_state_mask_and_step(jb, dtype, rng):
    """Without any transformation (op by op; the suite's other tests jit the default path), in
    JAX's default mode (``jax:x32``, float32): masks, a carried state and a decoding step all
    match the float64 reference."""
    method = "chunked"
    arrays = [rounded(a, dtype) for a in _qkv(rng, lead=(2,))]
    mask = rng.random((2, T)) > 0.3
    mask[:, 0] = True
    xs = [jb.from_numpy(a, dtype) for a in arrays]
    m = jb.from_numpy(mask)
    cut = 9
    head, state = causal_linear_attention(
        *(x[..., :cut, :] for x in xs),
        method=method,
        chunk_size=CHUNK,
        attention_mask=m[:, :cut],
        return_state=True,
    )
    tail = causal_linear_attention(
        *(x[..., cut:, :] for x in xs),
        method=method,
        chunk_size=CHUNK,
        attention_mask=m[:, cut:],
        initial_state=state,
    )
    _check_jax_output(jb, tail, xs[0])
    assert state.S.dtype == (xs[0].dtype if dtype == "float64" else jb.dtype("float32"))
    expected = masked_kernel(*arrays, mask=mask)
    got = np.concatenate([jb.to_numpy(head), jb.to_numpy(tail)], axis=-2)
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL[dtype])
    o_t, _ = step(*(x[..., cut, :] for x in xs), state)  # token `cut`, kept, after the prefix
    kept = mask[:, : cut + 1].copy()
    kept[:, cut] = True
    expected_t = masked_kernel(*(a[..., : cut + 1, :] for a in arrays), mask=kept)[..., cut, :]
    np.testing.assert_allclose(jb.to_numpy(o_t), expected_t, rtol=0, atol=ATOL[dtype])


def test_jitted_chunked_forward_is_a_scan_on_the_cpu(jb, jax, rng):
    """Under ``jit`` on the CPU the chunked form's forward is one scan over the tokens, with the
    chunked form's derivatives (``_backend.execution.scans_tokens``); eager calls keep the
    chunked form."""
    from polylin._backend import execution

    xs = [jb.from_numpy(a) for a in _qkv(rng, lead=(2,))]
    g = jb.from_numpy(-rng.uniform(0.0, 0.5, (2, T, D_K)))
    attend = functools.partial(causal_linear_attention, chunk_size=CHUNK)
    program = str(jax.make_jaxpr(lambda *a: attend(*a[:3], log_decay=a[3]))(*xs, g))
    on_cpu = jax.default_backend() == "cpu"
    assert ("scan" in program and "custom_jvp_call" in program) == on_cpu
    assert not execution.scans_tokens(jax.numpy, xs[0])  # a concrete array: eager
    assert not execution.scans_tokens(np, np.zeros(1))


@pytest.mark.parametrize("block_rows", [4096, 16])
@pytest.mark.parametrize("rule", ["delta", "generalized"])
def test_jitted_delta_rules_scan_their_chunks_on_the_cpu(jb, jax, rule, block_rows, rng,
                                                         monkeypatch):  # fmt: skip
    """Under ``jit`` on the CPU the delta rules' loop over chunks is one scan
    (``_backend.execution.scans_chunks``), and so is their loop over blocks of chunks (16 rows
    a block: a chunk each): the traced program has the same operations at T = 32 as at
    T = 128, and the results equal the eager call's (one block, a Python loop)."""
    import polylin._forms.delta.chunked
    from polylin import delta_rule_attention, dplr_delta_rule
    from polylin._backend import execution

    monkeypatch.setattr(polylin._forms.delta.chunked, "BLOCK_ROWS", block_rows)
    monkeypatch.setattr(polylin._forms.dplr.chunked, "BLOCK_ROWS", block_rows)

    def program(t):
        q, k, v = (jb.from_numpy(a) for a in _qkv(rng, lead=(2,), t=t))
        g = jb.from_numpy(-rng.uniform(0.0, 0.5, (2, t, D_K)))
        if rule == "delta":
            beta = jb.from_numpy(rng.uniform(0.1, 0.9, (2, t, 1)))
            args = (q, k, v, beta, g)
            call = lambda q, k, v, beta, g: delta_rule_attention(  # noqa: E731
                q, k, v, beta, log_decay=g, chunk_size=CHUNK)  # fmt: skip
        else:
            a, b = (jb.from_numpy(rng.standard_normal((2, t, D_K)) * 0.1) for _ in range(2))
            args = (q, k, v, a, b, g)
            call = lambda q, k, v, a, b, g: dplr_delta_rule(  # noqa: E731
                q, k, v, a, b, log_decay=g, chunk_size=CHUNK)  # fmt: skip
        return call, args, jax.make_jaxpr(call)(*args).jaxpr

    on_cpu = jax.default_backend() == "cpu"
    call, args, short = program(32)
    _, _, long = program(128)
    assert (len(short.eqns) == len(long.eqns)) == on_cpu
    scans = [e for e in long.eqns if e.primitive.name == "scan"]
    assert bool(scans) == on_cpu
    nested = any(i.primitive.name == "scan" for e in scans for i in e.params["jaxpr"].jaxpr.eqns)
    assert nested == (on_cpu and block_rows == 16)  # blocks: a scan over scans over chunks
    np.testing.assert_allclose(
        jb.to_numpy(jax.jit(call)(*args)), jb.to_numpy(call(*args)), rtol=0, atol=1e-12
    )
    assert not execution.scans_chunks(jax.numpy, args[0])  # a concrete array: eager


@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_jitted_delta_rule_solves_its_system_on_the_cpu(jb, jax, gate, rng, monkeypatch):
    """Under ``jit`` on the CPU the delta rule's unit lower-triangular system is one XLA
    triangular solve (``_backend.ops.unit_lower_solver``): the program has one, and its values
    and gradient equal those of the levels' inversion (no solver) to rounding."""
    import polylin._forms.delta.chunked as delta_chunked
    from polylin import delta_rule_attention

    q, k, v = (jb.from_numpy(a) for a in _qkv(rng, lead=(2,)))
    k = k / jax.numpy.linalg.norm(k, axis=-1, keepdims=True)
    beta = jb.from_numpy(rng.uniform(0.1, 0.9, (2, T, 1)))
    g = None if gate == "none" else jb.from_numpy(-rng.uniform(0.0, 0.5, (2, T, 1)))

    def loss(q, k, v, beta):
        out = delta_rule_attention(q, k, v, beta, log_decay=g, chunk_size=CHUNK)
        return jax.numpy.sum(out**2), out

    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    on_cpu = jax.default_backend() == "cpu"
    assert ("triangular_solve" in str(jax.make_jaxpr(grad)(q, k, v, beta))) == on_cpu
    got = jax.jit(grad)(q, k, v, beta)
    monkeypatch.setattr(delta_chunked, "unit_lower_solver", lambda xp, x: None)
    jax.clear_caches()  # JAX reuses the scan bodies it traced before
    assert "triangular_solve" not in str(jax.make_jaxpr(grad)(q, k, v, beta))
    want = jax.jit(grad)(q, k, v, beta)
    tol = 1e-5 if jb.to_numpy(q).dtype == np.float32 else 1e-10
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(jb.to_numpy(a), jb.to_numpy(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("width", [1, D_K])
def test_jitted_generalized_rule_caps_per_channel_chunks(jb, jax, width, rng, monkeypatch):
    """Under ``jit`` on the CPU the generalized rule runs a per-channel gate in chunks of at
    most ``SCANNED_CHANNEL_CHUNK`` tokens (a scalar gate keeps the caller's), and equals the
    eager call."""
    import polylin._forms.dplr.chunked as dplr_chunked
    from polylin import dplr_delta_rule

    seen = []

    def spy(xp, K, G, rows):
        seen.append(K[0].shape[-2])
        return intra_chunk(xp, K, G, rows)

    intra_chunk = dplr_chunked.intra_chunk
    monkeypatch.setattr(dplr_chunked, "intra_chunk", spy)
    jax.clear_caches()  # JAX reuses the scan bodies it traced before
    t = 80
    q, k, v = (jb.from_numpy(x) for x in _qkv(rng, lead=(2,), t=t))
    a, b = (jb.from_numpy(rng.standard_normal((2, t, D_K)) * 0.1) for _ in range(2))
    g = jb.from_numpy(-rng.uniform(0.0, 0.5, (2, t, width)))
    call = functools.partial(dplr_delta_rule, chunk_size=64)
    got = jax.jit(lambda *x: call(*x[:5], log_decay=x[5]))(q, k, v, a, b, g)
    on_cpu = jax.default_backend() == "cpu"
    capped = width != 1 and on_cpu
    assert set(seen) == {dplr_chunked.SCANNED_CHANNEL_CHUNK if capped else 64}
    want = call(q, k, v, a, b, log_decay=g)
    tol = 1e-4 if jb.to_numpy(q).dtype == np.float32 else 1e-10
    np.testing.assert_allclose(jb.to_numpy(got), jb.to_numpy(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("width", [1, D_K])
def test_jitted_decayed_prefix_scans_its_chunks_on_the_cpu(jb, jax, width, rng):
    """Under ``jit`` on the CPU a decayed chunked form's states cross the chunks in one scan
    (``chunk_prefix``), not a scan of logarithmic depth whose program grows with the number of
    chunks: the traced gradient has the same operations at T = 32 as at T = 128, and equals
    the eager gradient."""

    def program(t):
        q, k, v = (jb.from_numpy(a) for a in _qkv(rng, lead=(2,), t=t))
        g = jb.from_numpy(-rng.uniform(0.0, 0.5, (2, t, width)))

        def loss(q, k, v, g):
            out = causal_linear_attention(q, k, v, log_decay=g, chunk_size=CHUNK)
            return jax.numpy.sum(out * out)

        grad = jax.grad(loss, argnums=(0, 1, 2, 3))
        return grad, (q, k, v, g), jax.make_jaxpr(grad)(q, k, v, g).jaxpr

    on_cpu = jax.default_backend() == "cpu"
    grad, args, short = program(32)
    _, _, long = program(128)
    assert (len(short.eqns) == len(long.eqns)) == on_cpu
    for got, want in zip(jax.jit(grad)(*args), grad(*args)):
        np.testing.assert_allclose(jb.to_numpy(got), jb.to_numpy(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_scanned_forward_derivatives(jb, jax, gate, rng):
    """The scanned forward's values, reverse-mode gradients (every input and the initial state)
    and forward-mode tangents (``jax.jvp``) equal the quadratic reference's under ``jit``."""
    t = 13
    q, k, v = (jb.from_numpy(a) for a in _qkv(rng, lead=(2,), t=t))
    width = {"none": 0, "scalar": 1, "channel": D_K}[gate]
    g = None if gate == "none" else jb.from_numpy(-rng.uniform(0.0, 0.5, (2, t, width)))
    S0 = jb.from_numpy(rng.standard_normal((2, D_K, D_V)) * 0.3)
    z0 = jb.from_numpy(np.abs(rng.standard_normal((2, D_K))) + 1.0)
    weights = jb.from_numpy(rng.standard_normal((2, t, D_V)))

    def loss(q, k, v, g, S0, z0, method):
        out = causal_linear_attention(
            q, k, v, method=method, chunk_size=CHUNK, log_decay=g,
            initial_state=LinearAttentionState(S0, z0),
        )  # fmt: skip
        return jax.numpy.sum(out * weights)

    args = (q, k, v, g, S0, z0)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    grads = jax.jit(jax.value_and_grad(loss, argnums=argnums), static_argnames="method")
    (value, got), (want_value, want) = grads(*args, "chunked"), grads(*args, "quadratic")
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-10)
    for a, b in zip(got, want):
        np.testing.assert_allclose(jb.to_numpy(a), jb.to_numpy(b), rtol=1e-9, atol=1e-10)
    tangents = [x if x is None else jax.numpy.ones_like(x) for x in args]

    def jvp(method):
        return jax.jit(lambda *a: jax.jvp(lambda *b: loss(*b, method), a, tuple(tangents))[1])(
            *args
        )

    np.testing.assert_allclose(float(jvp("chunked")), float(jvp("quadratic")), rtol=1e-9)
