"""polylin.torch.LinearAttention: training and decoding against the functions and a NumPy oracle."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import polylin
from polylin.testing import Backend

from .reference import masked_kernel

reason = Backend.TORCH.unavailable_reason()
if reason is not None:
    pytest.skip(f"[torch] {reason}", allow_module_level=True)

torch = Backend.TORCH.module()
from polylin.torch import LinearAttention  # noqa: E402

E, H = 12, 3  # embed_dim, num_heads (head_dim 4)


def _layer(**options) -> LinearAttention:
    torch.manual_seed(0)
    return LinearAttention(E, H, dtype=torch.float64, **options)


def _x(batch: int = 2, T: int = 11, seed: int = 1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.asarray(rng.standard_normal((batch, T, E)))


def _reference(layer: LinearAttention, x: torch.Tensor, mask=None, *, causal=True) -> np.ndarray:
    """The layer computed in float64 NumPy from its weights: projections, heads, masked kernel."""

    def linear(proj, a):
        w = proj.weight.detach().numpy()
        b = 0.0 if proj.bias is None else proj.bias.detach().numpy()
        return a @ w.T + b

    a = x.detach().numpy()
    batch, T, _ = a.shape
    q, k, v = (
        linear(p, a).reshape(batch, T, H, -1).transpose(0, 2, 1, 3)
        for p in (layer.q_proj, layer.k_proj, layer.v_proj)
    )
    m = None if mask is None else np.broadcast_to(np.asarray(mask, bool)[:, None, :], (batch, H, T))
    out = masked_kernel(q, k, v, causal=causal, mask=m)
    return linear(layer.out_proj, out.transpose(0, 2, 1, 3).reshape(batch, T, -1))


def test_forward_matches_the_numpy_reference() -> None:
    layer = _layer()
    x = _x()
    np.testing.assert_allclose(layer(x).detach().numpy(), _reference(layer, x), atol=1e-10)


def test_non_causal_forward_matches_the_numpy_reference() -> None:
    layer = _layer(causal=False)
    x = _x()
    mask = np.ones((2, 11), bool)
    mask[1, 8:] = False
    got = layer(x, torch.asarray(mask)).detach().numpy()
    np.testing.assert_allclose(got, _reference(layer, x, mask, causal=False), atol=1e-10)


@pytest.mark.parametrize("method", polylin.METHODS)
def test_every_method_gives_the_same_layer(method: str) -> None:
    x = _x(T=21)
    np.testing.assert_allclose(
        _layer(method=method, chunk_size=4)(x).detach().numpy(),
        _reference(_layer(), x),
        atol=1e-10,
    )


def test_gradients_match_the_functional_computation() -> None:
    """Backward through the layer equals backward through the functions it calls."""
    layer = _layer()
    x = _x().requires_grad_(True)
    loss = layer(x).square().sum()
    grads = torch.autograd.grad(loss, [x, *layer.parameters()])

    def by_hand(x):
        q, k, v = (
            p(x).view(2, 11, H, 4).transpose(1, 2)
            for p in (layer.q_proj, layer.k_proj, layer.v_proj)
        )
        out = polylin.causal_linear_attention(q, k, v)
        return layer.out_proj(out.transpose(1, 2).reshape(2, 11, E))

    expected = torch.autograd.grad(by_hand(x).square().sum(), [x, *layer.parameters()])
    assert len(grads) == 1 + 8  # x, and weight + bias of four projections
    for got, want in zip(grads, expected):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradcheck() -> None:
    """Finite differences agree with autograd (float64, small sizes)."""
    layer = _layer()
    x = _x(batch=1, T=5).requires_grad_(True)
    mask = torch.tensor([[False, True, True, True, True]])
    assert torch.autograd.gradcheck(lambda x: layer(x, mask), (x,))


def test_a_training_step_lowers_the_loss() -> None:
    layer = _layer()
    x, target = _x(seed=2), _x(seed=3)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (layer(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_prefill_then_step_equals_one_forward() -> None:
    """Decoding token by token from a chunked prefill's state gives the full forward pass."""
    layer = _layer(chunk_size=4)
    x = _x(T=13)
    full = layer(x)
    prompt, state = layer(x[:, :6], return_state=True)
    steps = []
    for t in range(6, 13):
        y_t, state = layer.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(prompt, full[:, :6], rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], rtol=0, atol=1e-12)
    assert state.S.shape == (2, H, 4, 4) and state.z.shape == (2, H, 4)


def test_step_from_nothing_equals_forward() -> None:
    layer = _layer()
    x = _x(T=4)
    state, steps = None, []
    for t in range(4):
        y_t, state = layer.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, dim=1), layer(x), rtol=0, atol=1e-12)


def test_forward_continues_from_a_state() -> None:
    layer = _layer(chunk_size=4)
    x = _x(T=15)
    _, state = layer(x[:, :9], return_state=True)
    rest, final = layer(x[:, 9:], state=state, return_state=True)
    full, full_state = layer(x, return_state=True)
    torch.testing.assert_close(rest, full[:, 9:], rtol=0, atol=1e-12)
    torch.testing.assert_close(final.S, full_state.S, rtol=0, atol=1e-12)


def test_left_padding_gives_each_sequence_its_own_result() -> None:
    """A left-padded batch: real tokens get what the unpadded sequence gets, decoding too."""
    layer = _layer()
    x = _x(T=9)
    mask = torch.ones(2, 9, dtype=torch.int64)  # a tokenizer's 0/1 mask
    mask[0, :3] = 0
    padded, state = layer(x, mask, return_state=True)
    alone, alone_state = layer(x[:1, 3:], return_state=True)
    torch.testing.assert_close(padded[:1, 3:], alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(padded[1:], layer(x[1:]), rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        padded.detach().numpy(), _reference(layer, x, mask.numpy()), atol=1e-10
    )
    # the padded positions take no part: their output is out_proj of zeros
    torch.testing.assert_close(padded[0, :3], layer.out_proj.bias.expand(3, E), rtol=0, atol=0)
    # decoding continues each row from its own prefix
    x_t = _x(T=1, seed=5)[:, 0]
    y_t, _ = layer.step(x_t, state)
    y_alone, _ = layer.step(x_t[:1], alone_state)
    torch.testing.assert_close(y_t[:1], y_alone, rtol=0, atol=1e-12)


def test_bool_and_integer_masks_agree() -> None:
    layer = _layer()
    x = _x()
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 7:] = False
    torch.testing.assert_close(layer(x, mask), layer(x, mask.to(torch.int64)), rtol=0, atol=0)


def test_favor_plus_feature_map_and_its_state_size() -> None:
    phi = polylin.feature_maps.favor_plus(4, num_features=16, seed=0)
    layer = _layer(feature_map=phi)
    x = _x(T=6)
    out, state = layer(x, return_state=True)
    assert state.S.shape == (2, H, 16, 4)
    q, k, v = (
        p(x).view(2, 6, H, 4).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj)
    )
    expected = polylin.causal_linear_attention(q, k, v, phi)
    torch.testing.assert_close(out, layer.out_proj(expected.transpose(1, 2).reshape(2, 6, E)))


def test_a_feature_map_module_is_trained_with_the_layer() -> None:
    class Learned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x):
            return polylin.feature_maps.elu_plus_one(x * self.scale)

    layer = _layer(feature_map=Learned())
    assert "feature_map.scale" in dict(layer.named_parameters())
    layer(_x()).sum().backward()
    assert layer.feature_map.scale.grad.abs().sum() > 0


def test_head_dim_and_no_bias() -> None:
    layer = LinearAttention(10, 4, head_dim=3, bias=False)
    assert layer.q_proj.weight.shape == (12, 10) and layer.q_proj.bias is None
    assert layer(torch.randn(2, 5, 10)).shape == (2, 5, 10)


def test_float32_half_and_bfloat16_layers_run() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layer = LinearAttention(E, H, dtype=dtype)
        out = layer(torch.randn(2, 7, E, dtype=dtype))
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_the_input_is_not_modified() -> None:
    layer = _layer()
    x = _x()
    mask = torch.ones(2, 11, dtype=torch.bool)
    before, mask_before = x.clone(), mask.clone()
    layer(x, mask)
    assert torch.equal(x, before) and torch.equal(mask, mask_before)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda layer: layer(torch.randn(2, 5, 7)),
            ValueError,
            r"x must have shape .*got \(2, 5, 7\)",
        ),
        (
            lambda layer: layer(torch.randn(5, E)),
            ValueError,
            r"x must have shape \(batch, T, embed",
        ),
        (lambda layer: layer(np.zeros((2, 5, E))), TypeError, "x must be a torch.Tensor"),
        (
            lambda layer: layer(torch.randn(2, 5, E), torch.ones(2, 1, 5, dtype=torch.bool)),
            ValueError,
            r"attention_mask must have shape \(batch, T\) = \(2, 5\)",
        ),
        (lambda layer: layer.step(torch.randn(2, 1, E)), ValueError, r"x_t must have shape"),
    ],
    ids=["embed-size", "no-batch", "numpy", "mask-shape", "step-with-T-axis"],
)
def test_errors_name_the_argument(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call(LinearAttention(E, H))


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="embed_dim=10 is not a multiple of num_heads=4"):
        LinearAttention(10, 4)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        LinearAttention(8, 0)
    with pytest.raises(ValueError, match="method must be one of"):
        LinearAttention(8, 2, method="fast")
    with pytest.raises(TypeError, match="feature_map must be a callable"):
        LinearAttention(8, 2, feature_map="elu")
    with pytest.raises(TypeError, match=r"^feature_map=favor_plus is the factory .* call it, "
                       r"e\.g\. feature_map=favor_plus\(4\)$"):  # fmt: skip
        LinearAttention(8, 2, feature_map=polylin.feature_maps.favor_plus)


def test_non_causal_layer_has_no_state() -> None:
    layer = LinearAttention(E, H, causal=False)
    with pytest.raises(ValueError, match="need a causal layer"):
        layer(torch.randn(1, 3, E), return_state=True)
    with pytest.raises(ValueError, match="step needs a causal layer"):
        layer.step(torch.randn(1, E))


def test_replaces_softmax_attention_in_a_block() -> None:
    """The one-line change: a pre-norm block built around softmax attention, then linear."""

    class Block(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.norm = torch.nn.LayerNorm(E, dtype=torch.float64)
            self.attention = attention

        def forward(self, x, mask=None):
            return x + self.attention(self.norm(x), mask)

    block = Block(_layer())
    x = _x()
    assert block(x).shape == x.shape
    block(x).sum().backward()
    assert block.attention.q_proj.weight.grad is not None


def test_a_decay_on_a_non_causal_layer_is_refused() -> None:
    """The ``log_decay`` hook decays a state: a non-causal layer has none."""

    class Decayed(LinearAttention):
        def log_decay(self, x):
            return torch.full((H, 1, 1), -0.1, dtype=x.dtype)

    layer = Decayed(E, H, causal=False)
    with pytest.raises(ValueError, match="log_decay needs a causal layer"):
        layer(torch.randn(1, 3, E))


HAS_DECAY = all(
    "log_decay" in inspect.signature(fn).parameters
    for fn in (polylin.causal_linear_attention, polylin.step)
)


@pytest.mark.skipif(not HAS_DECAY, reason="this polylin's functions take no log_decay")
def test_a_decayed_layer_matches_the_functions_and_decodes() -> None:
    """A subclass's per-head decay reaches the functions; prefill + step == forward."""

    class Decayed(LinearAttention):
        def log_decay(self, x):
            return torch.tensor([-0.1, -0.5, -2.0], dtype=x.dtype)  # one decay per head

    torch.manual_seed(0)
    layer = Decayed(E, H, dtype=torch.float64, chunk_size=4)
    x = _x(T=13)
    full = layer(x)
    q, k, v = (
        p(x).view(2, 13, H, 4).transpose(1, 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj)
    )
    gates = torch.tensor([-0.1, -0.5, -2.0], dtype=torch.float64)[None, :, None, None]
    out = polylin.causal_linear_attention(q, k, v, log_decay=gates.expand(2, H, 13, 1))
    torch.testing.assert_close(full, layer.out_proj(out.transpose(1, 2).reshape(2, 13, E)))
    assert not torch.allclose(full, _layer()(x))
    prompt, state = layer(x[:, :6], return_state=True)
    torch.testing.assert_close(prompt, full[:, :6], rtol=0, atol=1e-12)
    steps = []
    for t in range(6, 13):
        y_t, state = layer.step(x[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], rtol=0, atol=1e-12)


def test_finished_rows_keep_their_state_in_step() -> None:
    """``step(..., attention_mask=m)``: rows where m is False keep their state, output the bias."""
    layer = _layer()
    x = _x(T=6)
    _, state = layer(x[:, :5], return_state=True)
    done = torch.tensor([1, 0])  # row 1 has finished
    y_t, new = layer.step(x[:, 5], state, attention_mask=done)
    y_all, all_new = layer.step(x[:, 5], state)
    torch.testing.assert_close(y_t[0], y_all[0], rtol=0, atol=0)
    torch.testing.assert_close(new.S[0], all_new.S[0], rtol=0, atol=0)
    torch.testing.assert_close(new.S[1], state.S[1], rtol=0, atol=0)
    torch.testing.assert_close(new.z[1], state.z[1], rtol=0, atol=0)
    torch.testing.assert_close(y_t[1], layer.out_proj.bias, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch,\) = \(2,\)"):
        layer.step(x[:, 5], state, attention_mask=torch.ones(2, 1, dtype=torch.bool))
