"""``add_matmul``: ``c + a @ b``, and on PyTorch with ``fresh`` the product added into ``c``
itself (no copy of the temporary), with the same values and gradients as the plain sum;
``keep_lower`` with ``fresh``: the upper triangle zeroed in place, the same values and
gradients, an argument that is not fresh never written."""

from __future__ import annotations

import numpy as np
import pytest

from polylin._backend.ops import add_matmul, causal_mask, keep_lower
from polylin.testing import Backend

from .test_delta_rule import needs


def _operands(rng):
    return (rng.standard_normal(shape) for shape in [(2, 3, 4, 5), (2, 3, 4, 6), (2, 3, 6, 5)])


def test_a_fresh_contiguous_sum_is_written_in_place(rng):
    torch = needs(Backend.TORCH)
    c, a, b = (torch.tensor(x) for x in _operands(rng))
    want = c + a @ b
    temporary = c.clone()
    got = add_matmul(torch, temporary, a, b, fresh=True)
    assert got.data_ptr() == temporary.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    strided = c.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided: left alone
    assert not strided.is_contiguous()
    got = add_matmul(torch, strided, a, b, fresh=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(strided, c, rtol=0, atol=0)


def test_a_fresh_sum_has_the_plain_gradients(rng):
    torch = needs(Backend.TORCH)
    S, a, b = (torch.tensor(x, requires_grad=True) for x in _operands(rng))
    decay = torch.tensor(rng.uniform(0, 1, (2, 3, 4, 1)), requires_grad=True)
    grads = []
    for fresh in (False, True):
        out = add_matmul(torch, S * decay, a, b, fresh=fresh)
        grads.append(torch.autograd.grad(out.square().sum(), (S, decay, a, b)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fresh", [False, True])
def test_other_libraries_add_the_product(rng, fresh):
    xp = needs(Backend.NUMPY)
    c, a, b = _operands(rng)
    kept = c.copy()
    np.testing.assert_allclose(add_matmul(xp, c, a, b, fresh=fresh), kept + a @ b, rtol=1e-12)
    np.testing.assert_array_equal(c, kept)


@pytest.mark.parametrize("strict", [False, True])
def test_a_fresh_matrix_keeps_its_lower_triangle_in_place(rng, strict):
    torch = needs(Backend.TORCH)
    x = torch.tensor(rng.standard_normal((2, 3, 6, 6)))
    x[0, 0, 1, 4] = float("inf")  # above the diagonal: an exact zero whatever it holds
    want = torch.tril(x, diagonal=-1 if strict else 0)  # a selection: no inf kept above
    mask = causal_mask(torch, 6, 6, x.device, strict=strict)
    kept = x.clone()
    got = keep_lower(torch, x, mask, strict=strict)  # not fresh: x is left alone
    assert got.data_ptr() != x.data_ptr()
    torch.testing.assert_close(x, kept, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(want).all()
    temporary = x.clone()
    got = keep_lower(torch, temporary, mask, strict=strict, fresh=True)
    assert got.data_ptr() == temporary.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    view = x.transpose(-1, -2)  # a strided view: its contiguous copy is fresh, x untouched
    torch.testing.assert_close(
        keep_lower(torch, view, mask, strict=strict),
        torch.tril(view, diagonal=-1 if strict else 0),
        rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(x, kept, rtol=0, atol=0, equal_nan=True)


def test_a_fresh_matrix_has_the_plain_gradients(rng):
    torch = needs(Backend.TORCH)
    a, b = (torch.tensor(rng.standard_normal((2, 5, 4)), requires_grad=True) for _ in range(2))
    mask = causal_mask(torch, 5, 5, a.device)
    grads = []
    for fresh in (False, True):
        out = keep_lower(torch, a @ b.transpose(-1, -2), mask, fresh=fresh)
        grads.append(torch.autograd.grad(out.square().sum(), (a, b)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
