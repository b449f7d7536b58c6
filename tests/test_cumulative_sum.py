"""``cumulative_sum``: the core's one running sum. On NumPy an axis other than the last with
many elements per position is summed as a loop of whole-slice additions, which must give
``np.cumsum``'s bits exactly (the same additions in the same order), keep the input intact, and
leave integer sums (which widen) and small arrays to NumPy's own."""

from __future__ import annotations

import numpy as np
import pytest

from polylin._backend import ops
from polylin._backend.ops import NUMPY_SUM_ROWS, cumulative_sum
from polylin.testing import Backend

from .test_delta_rule import needs


@pytest.mark.parametrize("axis", [0, -2, -3])
@pytest.mark.parametrize("include_initial", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_slices_give_cumsums_bits(rng, monkeypatch, axis, include_initial, dtype):
    xp = needs(Backend.NUMPY)
    x = rng.standard_normal((3, 16, 12, 64)).astype(dtype)
    kept = x.copy()
    assert ops._rows_of_numpy_sum(x, axis) >= NUMPY_SUM_ROWS  # the loop runs
    calls = []
    loop = ops._numpy_running_sum
    monkeypatch.setattr(ops, "_numpy_running_sum", lambda *a: calls.append(1) or loop(*a))
    got = cumulative_sum(xp, x, axis=axis, include_initial=include_initial)
    want = np.cumsum(x, axis=axis)
    if include_initial:
        zero = np.zeros_like(np.take(x, [0], axis=axis))
        want = np.concatenate([zero, want], axis=axis)
    assert calls and got.dtype == x.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(x, kept)


@pytest.mark.parametrize("x", [
    np.ones((2, 16, 9, 64), dtype=np.int32),  # an integer sum widens: NumPy's own
    np.ones((4, 64, 1), dtype=np.float32),  # few elements per position
    np.ones((9, 4096), dtype=np.float32),  # the last axis
])  # fmt: skip
def test_numpy_keeps_its_own_sum_elsewhere(monkeypatch, x):
    xp = needs(Backend.NUMPY)
    monkeypatch.setattr(ops, "_numpy_running_sum", None)  # calling it would fail
    axis = -1 if x.shape[-1] == 4096 else -2
    np.testing.assert_array_equal(
        cumulative_sum(xp, x, axis=axis), xp.cumulative_sum(x, axis=axis))
