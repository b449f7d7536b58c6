"""The PyTorch registration of elu_plus_one: same values, exact derivatives, a lean backward."""

from __future__ import annotations

import numpy as np
import pytest

import polylin
from polylin.feature_maps import elu_plus_one
from polylin.testing import Backend

reason = Backend.TORCH.unavailable_reason()
if reason is not None:
    pytest.skip(f"[torch] {reason}", allow_module_level=True)

torch = Backend.TORCH.module()


def _inputs(dtype=torch.float64, *, grad: bool = False) -> torch.Tensor:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64) * 20  # deep into both branches; exp(min(x, 0)) underflows too
    x[:3] = (0.0, -0.0, 90.0)  # the kink, and a value whose exp would overflow float32
    return torch.asarray(x, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_same_values_as_the_array_api_form(dtype):
    x = _inputs(getattr(torch, dtype))
    zero = torch.zeros((), dtype=x.dtype)
    expected = torch.exp(torch.minimum(x, zero)) + torch.maximum(x, zero)  # other backends' form
    got = elu_plus_one(x)
    assert got.dtype == x.dtype and torch.equal(got, expected)
    assert bool(torch.all(got > 0))  # strictly positive, even where exp(x) is tiny


def test_first_and_second_derivatives():
    x = _inputs(grad=True)[3:] / 10  # gradcheck's finite differences: away from the kink
    assert torch.autograd.gradcheck(elu_plus_one, (x,))
    assert torch.autograd.gradgradcheck(elu_plus_one, (x,))
    assert torch.autograd.gradcheck(
        elu_plus_one, (x,), check_forward_ad=True, check_backward_ad=False, check_batched_grad=False
    )


def test_derivative_at_the_kink_and_in_the_tails():
    x = torch.tensor([0.0, -0.0, -200.0, 200.0], dtype=torch.float64, requires_grad=True)
    elu_plus_one(x).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, float(np.exp(-200.0)), 1.0]


def test_vmap_and_jacobian():
    x = _inputs()[:5]
    jacobian = torch.func.jacrev(elu_plus_one)(x)
    expected = torch.diag(torch.exp(torch.clamp(x, max=0.0)))
    assert torch.equal(jacobian, expected)
    batched = torch.func.vmap(elu_plus_one)(torch.stack([x, -x]))
    assert torch.equal(batched, torch.stack([elu_plus_one(x), elu_plus_one(-x)]))


def test_backward_keeps_only_the_input():
    """Autograd saves x itself (no new array): the training memory of docs/performance.md."""
    x = _inputs(torch.float32, grad=True)
    y = x * 1.0  # a non-leaf, as the queries are after a projection
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = elu_plus_one(y)
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()
    out.sum().backward()
    assert torch.equal(x.grad, torch.exp(torch.clamp(x.detach(), max=0.0)))


def test_attention_gradients_unchanged_by_the_registration():
    """The chunked form's gradients with the default map equal those with the map written
    out in array-API operations (what autograd differentiated before the registration)."""
    rng = np.random.default_rng(1)
    q, k, v = (torch.asarray(rng.standard_normal((2, 37, 8)), requires_grad=True) for _ in "qkv")

    def written_out(x):
        half, magnitude = x * 0.5, torch.abs(x) * 0.5
        return torch.exp(half - magnitude) + (half + magnitude)

    grads = []
    for feature_map in (None, written_out):
        out = polylin.causal_linear_attention(q, k, v, feature_map, chunk_size=8)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    for default, reference in zip(*grads):
        torch.testing.assert_close(default, reference, rtol=1e-12, atol=1e-12)
