"""``rms_norm`` (with and without its gate) and the activations against float64 formulas.

Every backend: the two gate orders, both gate activations, no weight, grouped weights
(Mamba-2), half precision; the activations at extreme inputs (finite values and gradients);
PyTorch's own ``silu``, ``sigmoid`` and ``softplus`` and their gradients; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest

from polylin import rms_norm
from polylin.activations import sigmoid, silu, softplus
from polylin.testing import Backend


def np_sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def reference(x, weight=None, gate=None, eps=1e-5, activation="silu", norm_before_gate=True):
    x = np.asarray(x, np.float64)
    act = (lambda g: np_sigmoid(g)) if activation == "sigmoid" else (lambda g: g * np_sigmoid(g))
    if gate is not None and not norm_before_gate:
        x = x * act(gate)
    y = np.empty_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        row = x[index]
        y[index] = row / np.sqrt(np.mean(row**2) + eps)
    if weight is not None:
        y = y * weight
    if gate is not None and norm_before_gate:
        y = y * act(gate)
    return y


@pytest.mark.slow_grid
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm(backend, rng, activation: str, norm_before_gate: bool) -> None:
    x, gate = rng.standard_normal((2, 3, 8)), 3 * rng.standard_normal((2, 3, 8))
    weight = rng.standard_normal(8)
    out = rms_norm(
        backend.from_numpy(x), backend.from_numpy(weight), gate=backend.from_numpy(gate),
        eps=1e-6, activation=activation, norm_before_gate=norm_before_gate,
    )  # fmt: skip
    want = reference(x, weight, gate, 1e-6, activation, norm_before_gate)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-12, atol=1e-14)


def test_plain_and_grouped(backend, rng) -> None:
    x = rng.standard_normal((4, 12))
    np.testing.assert_allclose(
        backend.to_numpy(rms_norm(backend.from_numpy(x))), reference(x), rtol=1e-12
    )
    # Mamba-2's n_groups: (..., groups, d // groups) with a (groups, d // groups) weight
    weight = rng.standard_normal(12)
    out = rms_norm(backend.from_numpy(x.reshape(4, 3, 4)), backend.from_numpy(weight.reshape(3, 4)))
    want = np.concatenate([reference(x[:, 4 * g : 4 * g + 4], weight[4 * g : 4 * g + 4])
                           for g in range(3)], axis=1)  # fmt: skip
    np.testing.assert_allclose(backend.to_numpy(out).reshape(4, 12), want, rtol=1e-12)


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_half_precision_normalizes_in_float32(backend, rng, dtype: str) -> None:
    x = backend.from_numpy(300 * rng.standard_normal((3, 64)), dtype)  # x^2 overflows float16
    w = backend.from_numpy(rng.standard_normal(64), dtype)
    out = rms_norm(x, w, gate=x)
    assert out.dtype == x.dtype
    want = reference(backend.to_numpy(x), backend.to_numpy(w), backend.to_numpy(x))
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(backend.to_numpy(out).astype(np.float64), want, rtol=tol, atol=tol)


def test_activations(backend) -> None:
    x = np.array([-1e4, -800.0, -30.0, -1.0, 0.0, 0.5, 30.0, 800.0, 1e4])
    xs = backend.from_numpy(x)
    with np.errstate(over="ignore"):
        want_sigmoid = np_sigmoid(x)
        want_softplus = np.logaddexp(0.0, x)
    np.testing.assert_allclose(backend.to_numpy(sigmoid(xs)), want_sigmoid, rtol=1e-14)
    np.testing.assert_allclose(backend.to_numpy(silu(xs)), x * want_sigmoid, rtol=1e-14)
    np.testing.assert_allclose(backend.to_numpy(softplus(xs)), want_softplus, rtol=1e-14)


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_activations_never_overflow(backend, dtype: str) -> None:
    xs = backend.from_numpy(np.array([-6e4, -100.0, 0.0, 100.0, 6e4]), dtype)
    for f in (sigmoid, silu, softplus):
        assert np.isfinite(backend.to_numpy(f(xs)).astype(np.float64)).all(), f.__name__


@pytest.mark.only_backend(Backend.TORCH, reason="PyTorch's own functions and autograd")
def test_equal_pytorch_with_finite_gradients(backend, rng) -> None:
    torch = backend.module()
    x = torch.tensor([-1e4, -800.0, -20.0, -1.0, 0.0, 1.0, 20.0, 800.0, 1e4], dtype=torch.float64)
    for ours, theirs in ((sigmoid, torch.sigmoid), (silu, torch.nn.functional.silu),
                         (softplus, torch.nn.functional.softplus)):  # fmt: skip
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ga,) = torch.autograd.grad(ours(a).sum(), a)
        (gb,) = torch.autograd.grad(theirs(b).sum(), b)
        torch.testing.assert_close(ours(a), theirs(b), rtol=1e-13, atol=0)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-15)
    y = torch.tensor(rng.standard_normal((2, 8)), requires_grad=True)
    g = torch.tensor(rng.standard_normal((2, 8)), requires_grad=True)
    w = torch.tensor(rng.standard_normal(8), requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, w, g: rms_norm(y, w, gate=g), (y, w, g))


def test_bad_input(backend, rng) -> None:
    x = backend.from_numpy(rng.standard_normal((2, 4)))
    with pytest.raises(ValueError, match="gate must have the shape"):
        rms_norm(x, gate=backend.from_numpy(np.ones((2, 3))))
    with pytest.raises(ValueError, match="activation"):
        rms_norm(x, gate=x, activation="relu")
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, eps=0.0)
    with pytest.raises(TypeError, match="weight has dtype"):
        rms_norm(x, backend.from_numpy(np.ones(4), "float32"))


def test_bad_weight_eps_and_flag_name_the_argument(backend, rng) -> None:
    """A weight that does not broadcast to x (or would enlarge it), an eps that is not a
    finite number > 0 and a norm_before_gate that is not a bool are errors naming them."""
    x = backend.from_numpy(rng.standard_normal((3, 4)))
    for shape in [(2, 4), (5,), (1, 3, 4)]:
        with pytest.raises(ValueError, match=rf"^weight must broadcast to the shape of x, "
                           rf"\(3, 4\), usually \(d,\) = \(4,\); got \({shape[0]}"):  # fmt: skip
            rms_norm(x, backend.from_numpy(np.ones(shape)))
    assert rms_norm(x, backend.from_numpy(np.ones((1, 4)))).shape == (3, 4)  # size 1 broadcasts
    for eps in [float("inf"), float("nan"), -1e-5]:
        with pytest.raises(ValueError, match=r"^eps must be > 0"):
            rms_norm(x, eps=eps)
    with pytest.raises(TypeError, match=r"^eps must be a positive real number, got str"):
        rms_norm(x, eps="1e-5")
    for flag in ["no", None, np.True_]:
        with pytest.raises(TypeError, match=r"^norm_before_gate must be True or False"):
            rms_norm(x, gate=x, norm_before_gate=flag)
