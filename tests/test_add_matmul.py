"""``add_matmul``: ``c + a @ b``, and on PyTorch with ``fresh`` the product added into ``c``
itself (no copy of the temporary), with the same values and gradients as the plain sum."""

from __future__ import annotations

import numpy as np
import pytest

from polylin._backend.ops import add_matmul
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
