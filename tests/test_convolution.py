"""``causal_conv1d`` and ``causal_conv1d_step`` against a float64 loop of the formula.

Every backend: widths 1-4, bias, SiLU, T shorter than the width, leading dimensions,
``seq_axis``, states that continue exactly, masks (NaN at masked positions, left and right
padding, the state after right padding), one-token steps with finished rows, half precision;
gradients on PyTorch (against the loop in float64, and linear in T); bad input.
"""

from __future__ import annotations

import numpy as np
import pytest

from polylin import causal_conv1d, causal_conv1d_step
from polylin.testing import Backend


def reference(x, w, b=None, activation=None, state=None, mask=None):
    """Float64 loop: ``(outputs, last width-1 real inputs)``; masked inputs are zeros."""
    x = np.asarray(x, np.float64)
    *lead, T, C = x.shape
    width = w.shape[1]
    keep = np.ones((*lead, T), bool) if mask is None else np.broadcast_to(mask, (*lead, T))
    prev = np.zeros((*lead, width - 1, C)) if state is None else np.asarray(state, np.float64)
    out = np.zeros(x.shape)
    new_state = np.zeros(prev.shape)
    for index in np.ndindex(*lead):
        seq = [prev[index][j] for j in range(width - 1)]
        real = list(seq)
        for t in range(T):
            xt = x[index][t] if keep[index][t] else np.zeros(C)
            seq.append(xt)
            if keep[index][t]:
                real.append(xt)
            window = seq[len(seq) - width :]
            y = np.array([sum(w[c, i] * window[i][c] for i in range(width)) for c in range(C)])
            if b is not None:
                y = y + b
            if activation == "silu":
                y = y / (1.0 + np.exp(-y))
            out[index][t] = y if keep[index][t] else 0.0
        if width > 1:
            new_state[index] = np.stack(real[len(real) - (width - 1) :])
    return out, new_state


def run(backend, x, w, b=None, **options):
    arrays = [backend.from_numpy(a) for a in (x, w) + (() if b is None else (b,))]
    for key in ("state", "attention_mask"):
        if options.get(key) is not None:
            options[key] = backend.from_numpy(options[key])
    result = causal_conv1d(*arrays, **options)
    if isinstance(result, tuple):
        return tuple(backend.to_numpy(r) for r in result)
    return backend.to_numpy(result)


@pytest.mark.slow_grid
@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3, 11])
def test_matches_the_loop(backend, rng, width: int, T: int) -> None:
    x = rng.standard_normal((2, 3, T, 5))
    w, b = rng.standard_normal((5, width)), rng.standard_normal(5)
    for bias, activation in ((None, None), (b, "silu")):
        out, state = run(backend, x, w, bias, activation=activation, return_state=True)
        want, want_state = reference(x, w, bias, activation)
        np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state, want_state, rtol=0, atol=0)
        assert state.shape == (2, 3, width - 1, 5)


def test_the_last_tap_multiplies_the_current_input(backend) -> None:
    """The causal-conv1d layout: ``weight[:, -1]`` is the current input's tap."""
    x = np.zeros((4, 1))
    x[1] = 1.0
    w = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_array_equal(run(backend, x, w)[:, 0], [0.0, 3.0, 2.0, 1.0])


@pytest.mark.slow_grid
@pytest.mark.parametrize("split", [0, 1, 2, 5, 9])
def test_a_prefix_state_continues_exactly(backend, rng, split: int) -> None:
    x, w, b = rng.standard_normal((2, 9, 4)), rng.standard_normal((4, 4)), rng.standard_normal(4)
    whole = run(backend, x, w, b, activation="silu")
    head, state = run(backend, x[:, :split], w, b, activation="silu", return_state=True)
    tail = run(backend, x[:, split:], w, b, activation="silu", state=state)
    np.testing.assert_allclose(np.concatenate([head, tail], axis=1), whole, rtol=1e-12)


def test_steps_after_a_prefill_equal_one_pass(backend, rng) -> None:
    x, w = rng.standard_normal((3, 8, 4)), rng.standard_normal((4, 4))
    whole = run(backend, x, w, activation="silu")
    _, state = run(backend, x[:, :3], w, activation="silu", return_state=True)
    state = backend.from_numpy(state)
    wb = backend.from_numpy(w)
    for t in range(3, 8):
        y_t, state = causal_conv1d_step(
            backend.from_numpy(x[:, t]), wb, state=state, activation="silu"
        )
        np.testing.assert_allclose(backend.to_numpy(y_t), whole[:, t], rtol=1e-12)
    # from no state at all
    y0, _ = causal_conv1d_step(backend.from_numpy(x[:, 0]), wb, activation="silu")
    np.testing.assert_allclose(backend.to_numpy(y0), whole[:, 0], rtol=1e-12)


def test_step_with_finished_rows_keeps_their_state(backend, rng) -> None:
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 3))
    state = rng.standard_normal((3, 2, 4))
    x[1] = np.nan  # a finished row may hold anything
    mask = np.array([True, False, True])
    y, new = causal_conv1d_step(
        backend.from_numpy(x), backend.from_numpy(w), state=backend.from_numpy(state),
        attention_mask=backend.from_numpy(mask),
    )  # fmt: skip
    y, new = backend.to_numpy(y), backend.to_numpy(new)
    np.testing.assert_array_equal(y[1], 0.0)
    np.testing.assert_array_equal(new[1], state[1])
    for row in (0, 2):
        want, want_state = reference(x[row, None], w, state=state[row])
        np.testing.assert_allclose(y[row], want[0], rtol=1e-12)
        np.testing.assert_array_equal(new[row], want_state)


@pytest.mark.slow_grid
@pytest.mark.parametrize("padding", ["left", "right", "holes"])
def test_masked_inputs_never_reach_a_real_output(backend, rng, padding: str) -> None:
    T = 9
    x = rng.standard_normal((3, T, 4))
    w, b = rng.standard_normal((4, 4)), rng.standard_normal(4)
    mask = np.ones((3, T), bool)
    if padding == "left":
        mask[0, :4], mask[1, :1] = False, False
    elif padding == "right":
        mask[0, 5:], mask[1, 7:] = False, False
    else:
        mask[0, 2:4], mask[2, ::3] = False, False
    x_nan = np.where(mask[..., None], x, np.nan)
    out, state = run(
        backend, x_nan, w, b, activation="silu", attention_mask=mask, return_state=True
    )
    want, want_state = reference(x, w, b, "silu", mask=mask)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(state, want_state)
    assert not np.isnan(out).any()
    if padding == "left":  # a left-padded prompt gives its outputs alone
        for row, pad in ((0, 4), (1, 1)):
            alone = run(backend, x[row, pad:], w, b, activation="silu")
            np.testing.assert_allclose(out[row, pad:], alone, rtol=1e-12)
    if padding == "right":  # and a right-padded one its state alone
        _, alone = run(backend, x[0, :5], w, b, activation="silu", return_state=True)
        np.testing.assert_array_equal(state[0], alone)


def test_right_padding_shorter_than_the_width_keeps_the_earlier_state(backend, rng) -> None:
    x, w = rng.standard_normal((2, 3, 2)), rng.standard_normal((2, 4))
    state = rng.standard_normal((2, 3, 2))
    mask = np.array([[True, False, False], [False, False, False]])
    _, new = run(backend, x, w, state=state, attention_mask=mask, return_state=True)
    np.testing.assert_array_equal(new[0], np.concatenate([state[0, 1:], x[0, :1]]))
    np.testing.assert_array_equal(new[1], state[1])


def test_seq_axis(backend, rng) -> None:
    x = rng.standard_normal((2, 7, 3, 4))  # (batch, T, heads, channels)
    w = rng.standard_normal((4, 3))
    out, state = run(backend, x, w, activation="silu", seq_axis=1, return_state=True)
    want, want_state = reference(np.moveaxis(x, 1, 2), w, activation="silu")
    np.testing.assert_allclose(out, np.moveaxis(want, 2, 1), rtol=1e-12)
    np.testing.assert_array_equal(state, np.moveaxis(want_state, 2, 1))
    tail = run(
        backend,
        x[:, 5:],
        w,
        activation="silu",
        seq_axis=1,
        state=run(backend, x[:, :5], w, activation="silu", seq_axis=1, return_state=True)[1],
    )
    np.testing.assert_allclose(tail, out[:, 5:], rtol=1e-12)


@pytest.mark.slow_grid(cover=("dtype",))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtypes(backend, rng, dtype: str) -> None:
    x, w = rng.standard_normal((2, 6, 4)), rng.standard_normal((4, 4))
    xb, wb = backend.from_numpy(x, dtype), backend.from_numpy(w, dtype)
    out, state = causal_conv1d(xb, wb, activation="silu", return_state=True)
    assert out.dtype == xb.dtype
    assert state.dtype == backend.dtype("float32")
    want, _ = reference(backend.to_numpy(xb), backend.to_numpy(wb), activation="silu")
    tol = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(backend.to_numpy(out).astype(np.float64), want, rtol=tol, atol=tol)


def test_inputs_are_not_modified(backend, rng) -> None:
    x, w, state = rng.standard_normal((2, 5, 3)), rng.standard_normal((3, 4)), np.ones((2, 3, 3))
    xs, ws, ss = (backend.from_numpy(a) for a in (x, w, state))
    causal_conv1d(xs, ws, state=ss, return_state=True)
    for a, b in ((x, xs), (w, ws), (state, ss)):
        np.testing.assert_array_equal(backend.to_numpy(b), a)


def central_differences(loss, arrays, step: float = 1e-6) -> list[np.ndarray]:
    """The gradient of the float ``loss(arrays)`` with respect to each of the float64
    ``arrays``, by central differences, one element at a time."""
    gradients = []
    for i, array in enumerate(arrays):
        numeric = np.zeros(array.shape)
        for index in np.ndindex(*array.shape):
            up = [a.copy() for a in arrays]
            down = [a.copy() for a in arrays]
            up[i][index] += step
            down[i][index] -= step
            numeric[index] = (loss(up) - loss(down)) / (2 * step)
        gradients.append(numeric)
    return gradients


@pytest.mark.only_backend(Backend.TORCH, reason="gradients through autograd")
def test_gradients_match_the_loop(backend, rng) -> None:
    torch = backend.module()
    x, w, b = rng.standard_normal((2, 6, 3)), rng.standard_normal((3, 4)), rng.standard_normal(3)
    state = rng.standard_normal((2, 3, 3))
    mask = np.ones((2, 6), bool)
    mask[0, :2] = False
    ts = [torch.tensor(a, requires_grad=True) for a in (x, w, b, state)]
    out = causal_conv1d(*ts[:3], activation="silu", state=ts[3], attention_mask=torch.tensor(mask))
    cot = rng.standard_normal(out.shape)
    grads = torch.autograd.grad(out, ts, torch.tensor(cot))

    def loss(arrays):
        return float(np.sum(reference(*arrays[:3], "silu", state=arrays[3], mask=mask)[0] * cot))

    for g, numeric in zip(grads, central_differences(loss, [x, w, b, state])):
        np.testing.assert_allclose(g.numpy(), numeric, rtol=1e-5, atol=1e-7)
    assert torch.all(grads[0][0, :2] == 0)  # masked inputs get no gradient


@pytest.mark.only_backend(Backend.TORCH, reason="autograd's saved tensors")
def test_forward_and_backward_are_linear_in_T(backend) -> None:
    """What autograd keeps for the backward grows linearly in T (a quadratic form would keep
    256x for 16x the tokens), and the backward runs: counted, not timed (no timing in the
    test suite)."""
    torch = backend.module()

    def saved_bytes(T: int) -> int:
        x = torch.randn(1, T, 64, requires_grad=True)
        w = torch.randn(64, 4, requires_grad=True)
        saved: dict[int, int] = {}

        def keep(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = causal_conv1d(x, w, activation="silu")
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        return sum(saved.values())

    small, large = saved_bytes(1024), saved_bytes(16384)
    assert 0 < large <= 16 * small * 1.01


def _counting_convolutions(monkeypatch, torch) -> list[int]:
    """Calls of PyTorch's ``conv2d`` from here on, counted (the native taps of
    :mod:`polylin._backend.depthwise`)."""
    calls: list[int] = []
    conv2d = torch.nn.functional.conv2d

    def counted(*args, **kwargs):
        calls.append(1)
        return conv2d(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "conv2d", counted)
    return calls


@pytest.mark.only_backend(Backend.TORCH, reason="PyTorch's own depthwise convolution")
@pytest.mark.parametrize("width", [2, 4])
def test_the_native_kernel_matches_the_loop(backend, rng, monkeypatch, width: int) -> None:
    """Above :data:`~polylin._backend.depthwise.NATIVE_MIN_VALUES` outputs, float32 on the CPU
    with no gradient: PyTorch's convolution sums the taps, with a bias, SiLU, a state, masked
    inputs (NaN there), the state after them and a sequence axis of the caller's."""
    torch = backend.module()
    calls = _counting_convolutions(monkeypatch, torch)
    x = rng.standard_normal((2, 3, 24, 240))  # 34560 outputs
    w, b = rng.standard_normal((240, width)), rng.standard_normal(240)
    state = rng.standard_normal((2, 3, width - 1, 240))
    mask = np.ones((2, 3, 24), bool)
    mask[0, 1, :5], mask[1, 2, 20:] = False, False
    x_nan = np.where(mask[..., None], x, np.nan)
    want, want_state = reference(x, w, b, "silu", state=state, mask=mask)
    as32 = [torch.tensor(a, dtype=torch.float32) for a in (x_nan, w, b, state)]
    out, new = causal_conv1d(*as32[:3], activation="silu", state=as32[3],
                             attention_mask=torch.tensor(mask), return_state=True)  # fmt: skip
    assert calls == [1]
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new.double().numpy(), want_state.astype(np.float32))
    moved = torch.tensor(np.moveaxis(x, 2, 1), dtype=torch.float32)  # (2, T, 3, 240)
    out = causal_conv1d(moved, as32[1], seq_axis=1)
    want, _ = reference(x, w)
    np.testing.assert_allclose(out.double().numpy(), np.moveaxis(want, 2, 1), rtol=1e-5, atol=1e-5)
    assert calls == [1, 1]


@pytest.mark.only_backend(Backend.TORCH, reason="PyTorch's own depthwise convolution")
def test_the_native_kernel_runs_only_where_it_applies(backend, rng, monkeypatch) -> None:
    """Float32 (16-bit inputs work in it), at least 16384 outputs (65536 with a gradient to
    record), width of at least 2; elsewhere the taps as products, with the same outputs."""
    torch = backend.module()
    calls = _counting_convolutions(monkeypatch, torch)
    x, w = rng.standard_normal((1, 256, 256)), rng.standard_normal((256, 4))
    expected = torch.tensor(reference(x, w)[0])

    def as32(a, grad=False):
        return torch.tensor(a, dtype=torch.float32, requires_grad=grad)

    cases = [  # (x, w, convolutions, tolerance)
        (as32(x[:, :64]), as32(w), 1, 1e-5),  # 16384 outputs
        (torch.tensor(x[:, :64], dtype=torch.bfloat16), torch.tensor(w, dtype=torch.bfloat16),
         1, 5e-2),
        (torch.tensor(x[:, :64]), torch.tensor(w), 0, 1e-12),  # float64
        (as32(x[:, :32]), as32(w), 0, 1e-5),  # 8192 outputs
        (as32(x[:, :128], grad=True), as32(w), 0, 1e-5),  # 32768 outputs and a gradient
        (as32(x), as32(w, grad=True), 1, 1e-5),  # 65536 outputs and a gradient
    ]  # fmt: skip
    for xs, ws, convolutions, tol in cases:
        calls.clear()
        out = causal_conv1d(xs, ws)
        assert len(calls) == convolutions, (xs.dtype, xs.shape, xs.requires_grad)
        want = expected[:, : xs.shape[1]].double()
        torch.testing.assert_close(out.detach().double(), want, rtol=tol, atol=tol)
    calls.clear()
    with torch.no_grad():  # a gradient-requiring input, none recorded: the kernel
        causal_conv1d(cases[-2][0], cases[-2][1])
    causal_conv1d(cases[0][0], cases[0][1][:, :1])  # width 1: a product
    assert calls == [1]


def _kernel_everywhere(monkeypatch) -> None:
    """The native taps at every size (float32 on the CPU): small enough for numeric gradients."""
    import polylin._backend.depthwise as depthwise

    monkeypatch.setattr(depthwise, "NATIVE_MIN_VALUES", 0)
    monkeypatch.setattr(depthwise, "GRADIENT_MIN_VALUES", 0)


@pytest.mark.only_backend(Backend.TORCH, reason="the native kernel's autograd")
def test_the_native_kernels_gradients_match_the_loop(backend, rng, monkeypatch) -> None:
    """The kernel's own backward (the taps reversed for the inputs, a product and sum per tap)
    against central differences of the float64 loop: inputs, taps, bias and state, through SiLU
    and a mask; the backward is a convolution too."""
    torch = backend.module()
    _kernel_everywhere(monkeypatch)
    calls = _counting_convolutions(monkeypatch, torch)
    x, w, b = rng.standard_normal((2, 6, 3)), rng.standard_normal((3, 4)), rng.standard_normal(3)
    state = rng.standard_normal((2, 3, 3))
    mask = np.ones((2, 6), bool)
    mask[1, 4:] = False
    ts = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (x, w, b, state)]
    out = causal_conv1d(*ts[:3], activation="silu", state=ts[3], attention_mask=torch.tensor(mask))
    cot = rng.standard_normal(out.shape)
    grads = torch.autograd.grad(out, ts, torch.tensor(cot, dtype=torch.float32))
    assert len(calls) == 2  # the forward's convolution and the inputs' gradient

    def loss(arrays):
        return float(np.sum(reference(*arrays[:3], "silu", state=arrays[3], mask=mask)[0] * cot))

    for g, numeric in zip(grads, central_differences(loss, [x, w, b, state])):
        np.testing.assert_allclose(g.double().numpy(), numeric, rtol=1e-4, atol=1e-5)


@pytest.mark.only_backend(Backend.TORCH, reason="the native kernel's autograd")
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_the_native_kernel_differentiates_twice_and_forward(backend, rng, monkeypatch) -> None:
    """Second derivatives (``create_graph``) and forward-mode derivatives through the kernel
    equal those of the products (the same call with the kernel off)."""
    import polylin._backend.depthwise as depthwise

    torch = backend.module()
    forward_ad = torch.autograd.forward_ad  # its first use scripts a helper (a warning of torch)
    x, w = rng.standard_normal((2, 9, 5)), rng.standard_normal((5, 3))
    b, cot = rng.standard_normal(5), rng.standard_normal((2, 9, 5))
    tangents = [rng.standard_normal(a.shape) for a in (x, w, b)]

    def derivatives(least: int):
        monkeypatch.setattr(depthwise, "NATIVE_MIN_VALUES", least)
        monkeypatch.setattr(depthwise, "GRADIENT_MIN_VALUES", least)
        ts = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (x, w, b)]
        out = causal_conv1d(*ts, activation="silu")
        first = torch.autograd.grad(out, ts, torch.tensor(cot, dtype=torch.float32),
                                    create_graph=True)  # fmt: skip
        second = torch.autograd.grad(sum((g * g).sum() for g in first), ts)
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(t, torch.tensor(d, dtype=torch.float32))
                     for t, d in zip(ts, tangents)]  # fmt: skip
            jvp = forward_ad.unpack_dual(causal_conv1d(*duals, activation="silu")).tangent
        return [g.detach() for g in (*first, *second, jvp)]

    for kernel, products in zip(derivatives(0), derivatives(2**62)):
        torch.testing.assert_close(kernel, products, rtol=1e-4, atol=1e-5)


def test_bad_input(backend, rng) -> None:
    x, w = backend.from_numpy(rng.standard_normal((2, 5, 3))), backend.from_numpy(np.ones((3, 4)))
    with pytest.raises(ValueError, match="weight must have shape"):
        causal_conv1d(x, backend.from_numpy(np.ones((4, 4))))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match="bias must have shape"):
        causal_conv1d(x, w, backend.from_numpy(np.ones(4)))
    with pytest.raises(ValueError, match="state must have shape"):
        causal_conv1d(x, w, state=backend.from_numpy(np.ones((2, 4, 3))))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        causal_conv1d(x, w, attention_mask=backend.from_numpy(np.ones((2, 4), bool)))
    with pytest.raises(TypeError, match="x must be an array"):
        causal_conv1d([1.0], w)
    with pytest.raises(ValueError, match="x must have shape"):
        causal_conv1d(backend.from_numpy(np.ones(3)), w)
    with pytest.raises(ValueError, match="attention_mask of a decoding step must have the batch "
                       "shape of x_t"):  # fmt: skip
        causal_conv1d_step(x[:, 0, :], w, attention_mask=backend.from_numpy(np.ones(3, bool)))
    for flag in [1, "yes", None, np.True_]:
        with pytest.raises(TypeError, match=r"^return_state must be True or False"):
            causal_conv1d(x, w, return_state=flag)


def test_jax_transforms_of_x_with_concrete_weights(rng) -> None:
    """Under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` of ``x`` alone the weights are concrete
    arrays on a device while ``x`` is traced (it has none): not a device mismatch."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x_np, w_np = rng.standard_normal((2, 6, 3)), rng.standard_normal((3, 4))
    x, w = jnp.asarray(x_np), jnp.asarray(w_np)
    want, _ = reference(x_np, w_np)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x: causal_conv1d(x, w))(x)), want,
                               atol=1e-12)  # fmt: skip
    grad = jax.grad(lambda x: jnp.sum(causal_conv1d(x, w, activation="silu") ** 2))(x)
    assert grad.shape == x.shape and bool(jnp.all(jnp.isfinite(grad)))
    per_row = jax.vmap(lambda row: causal_conv1d(row, w))(x)
    np.testing.assert_allclose(np.asarray(per_row), want, atol=1e-12)
    out, _ = jax.jit(lambda x_t: causal_conv1d_step(x_t, w))(x[:, 0])
    np.testing.assert_allclose(np.asarray(out), want[:, 0], atol=1e-12)
