"""Subnormal numbers flushed to zero while a form runs on PyTorch's CPU: on inside every
method's call, the calling thread's mode restored after it (an error included), a caller's own
flushing kept, no effect on NumPy, and results at a strong decay equal to the float64 loop."""

from __future__ import annotations

import numpy as np
import pytest

from polylin import causal_linear_attention, delta_rule_attention
from polylin._backend import denormals
from polylin.testing import Backend

from .test_delta_rule import needs


def _flushing(torch):
    return denormals._flushing(torch)


@pytest.fixture
def torch():
    torch = needs(Backend.TORCH)
    before = _flushing(torch)
    torch.set_flush_denormal(False)
    yield torch
    torch.set_flush_denormal(before)


def _recorder(torch, seen):
    def feature_map(x):  # checked on its own first, then run inside the form
        seen.append(_flushing(torch))
        return torch.nn.functional.elu(x) + 1

    return feature_map


@pytest.mark.parametrize("method", ["chunked", "recurrent", "quadratic"])
def test_a_call_flushes_and_restores_the_mode(rng, torch, method):
    q, k, v = (torch.tensor(rng.standard_normal((2, 16, 4)), dtype=torch.float32)
               for _ in range(3))  # fmt: skip
    seen = []
    causal_linear_attention(q, k, v, _recorder(torch, seen), method=method)
    assert not seen[0] and seen[-1]  # the check outside, the form inside
    assert not _flushing(torch)


def test_an_error_inside_restores_the_mode(rng, torch):
    q, k, v = (torch.tensor(rng.standard_normal((2, 16, 4))) for _ in range(3))

    def failing(x):  # passes the check outside, fails inside the form
        if _flushing(torch):
            raise RuntimeError("inside")
        return x

    with pytest.raises(RuntimeError, match="inside"):
        causal_linear_attention(q, k, v, failing)
    assert not _flushing(torch)


def test_a_callers_flushing_is_kept(rng, torch):
    q, k, v = (torch.tensor(rng.standard_normal((2, 16, 4))) for _ in range(3))
    torch.set_flush_denormal(True)
    causal_linear_attention(q, k, v)
    assert _flushing(torch)


def test_the_probe_reads_float32_whatever_the_default_dtype(torch):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.set_flush_denormal(True)
        assert _flushing(torch)
        torch.set_flush_denormal(False)
        assert not _flushing(torch)
    finally:
        torch.set_default_dtype(default)


def test_numpy_calls_leave_the_mode_alone(rng, torch, monkeypatch):
    xp = needs(Backend.NUMPY)
    monkeypatch.setattr(torch, "set_flush_denormal", None)  # calling it would fail
    q, k, v = (xp.asarray(rng.standard_normal((2, 16, 4))) for _ in range(3))
    causal_linear_attention(q, k, v)


def test_strong_decay_equals_the_loop(rng, torch):
    """A gate of -6 per token at most: chunks' factors far below float32's normal range, which
    the flushed call computes as zeros; the outputs equal the float64 loop's to float32."""
    T, d = 96, 16
    q, k = (rng.standard_normal((2, T, d)) / 4 for _ in range(2))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((2, T, d))
    beta = rng.uniform(0, 1, (2, T, 1))
    g = -rng.uniform(1e-3, 6.0, (2, T, 1))
    args = [torch.tensor(x) for x in (q, k, v, beta, g)]
    want = delta_rule_attention(*args[:4], log_decay=args[4], method="recurrent")
    got = delta_rule_attention(*(x.float() for x in args[:4]), log_decay=args[4].float())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
