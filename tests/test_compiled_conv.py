"""The short causal convolution's compiled kernel (``polylin._backend.compiled_conv``, Numba):
on NumPy the same bits as the array-API taps it replaces, for sequences and decoding steps,
the state after them, threads, and the array-API form wherever the kernel does not apply."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from polylin import causal_conv1d, causal_conv1d_step
from polylin._backend import compiled_conv
from polylin._backend.depthwise import causal_taps

pytest.importorskip("numba")


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rows of each kernel run."""
    seen: list[int] = []
    real = compiled_conv._kernel()
    assert real is not None

    def counted(*args: Any) -> None:
        seen.append(args[-1] - args[-2])
        real(*args)

    monkeypatch.setattr(compiled_conv, "_kernel", lambda: counted)
    yield seen


def _array_api(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, S: np.ndarray) -> tuple:
    """The array-API form: the taps over ``[S; x]`` and its last ``width - 1`` rows."""
    ext = np.concatenate([S, x], axis=-2)
    return causal_taps(np, ext, w, b, x.shape[-2]), ext[..., x.shape[-2] :, :]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_the_kernel_gives_the_taps_bits(
    runs: list[int], dtype: str, bias: bool, width: int, T: int
) -> None:
    """Outputs and state to the bit, T shorter and longer than the width, leading dimensions;
    the caller's arrays unchanged."""
    rng = np.random.default_rng(T * 10 + width)
    x = rng.standard_normal((2, 3, T, 40)).astype(dtype)
    w = rng.standard_normal((40, width)).astype(dtype)
    b = rng.standard_normal(40).astype(dtype) if bias else None
    S = rng.standard_normal((2, 3, width - 1, 40)).astype(dtype)
    given = [a.copy() for a in (x, w, S)]
    out, state = causal_conv1d(x, w, b, state=S, return_state=True)
    assert runs == [6 * T]
    want, want_state = _array_api(x, w, b, S)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(state, want_state)
    assert out.dtype == x.dtype and state.dtype == x.dtype
    for a, before in zip((x, w, S), given, strict=True):
        np.testing.assert_array_equal(a, before)


@pytest.mark.parametrize("bias", [False, True])
def test_a_step_gives_the_sequences_bits(runs: list[int], bias: bool) -> None:
    """A decoding step on the kernel: the sequence's output and state for its token, SiLU
    included."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)
    w = rng.standard_normal((24, 4)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32) if bias else None
    S = rng.standard_normal((2, 3, 24)).astype(np.float32)
    want, want_state = causal_conv1d(x, w, b, activation="silu", state=S, return_state=True)
    state = S
    for t in range(5):
        y, state = causal_conv1d_step(x[:, t], w, b, state=state, activation="silu")
        np.testing.assert_array_equal(y, want[:, t])
    np.testing.assert_array_equal(state, want_state)
    assert runs == [10] + [2] * 5


def test_a_sequence_axis_of_the_callers(runs: list[int]) -> None:
    """``(T, B, C)`` with ``seq_axis=0``: read as it is laid out, returned in that layout."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 2, 16))
    w = rng.standard_normal((16, 3))
    out, state = causal_conv1d(x, w, seq_axis=0, return_state=True)
    want, want_state = _array_api(np.moveaxis(x, 0, 1), w, None, np.zeros((2, 2, 16)))
    np.testing.assert_array_equal(out, np.moveaxis(want, 1, 0))
    np.testing.assert_array_equal(state, np.moveaxis(want_state, 1, 0))
    assert runs == [14]


def test_rows_split_between_threads_give_the_same_bits(
    runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long call's rows in parts, one kernel call each: the same bits."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 33, 16)).astype(np.float32)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    one = causal_conv1d(x, w, return_state=True)
    monkeypatch.setattr(compiled_conv, "CONV_PART_SIZE", 64)
    monkeypatch.setattr(compiled_conv, "kernel_threads", lambda tensors: 3)
    split = causal_conv1d(x, w, return_state=True)
    for got, want in zip(split, one, strict=True):
        np.testing.assert_array_equal(got, want)
    assert runs[0] == 66 and sorted(runs[1:]) == [22, 22, 22]


def test_the_array_api_form_runs_where_the_kernel_does_not(runs: list[int]) -> None:
    """A mask, width 1, no tokens: no kernel run (the same outputs as the array-API form's,
    which ``tests/test_convolution.py`` checks)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 6, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    causal_conv1d(x, w, attention_mask=np.ones((1, 6), bool))
    causal_conv1d_step(x[:, 0], w, attention_mask=np.ones(1, bool))
    causal_conv1d(x, w[:, :1])
    causal_conv1d(x[:, :0], w, return_state=True)
    assert runs == []
    causal_conv1d(x, w)
    assert runs == [6]


def test_without_numba_the_array_api_form_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``POLYLIN_COMPILED=0`` (or no Numba): no kernel, the array-API taps."""
    monkeypatch.setattr(compiled_conv, "numba_module", lambda: None)
    compiled_conv._kernel.cache_clear()
    try:
        x = np.ones((1, 3, 2))
        assert compiled_conv.compiled_conv(np.zeros((1, 1, 2)), x, np.ones((2, 2)), None) is None
        np.testing.assert_array_equal(causal_conv1d(x, np.ones((2, 2))), [[[1, 1], [2, 2], [2, 2]]])
    finally:
        compiled_conv._kernel.cache_clear()
