"""polylin.blocks: the array-API blocks against the PyTorch modules, on every backend.

The torch modules are checked against float64 loops of their formulas in ``test_layers.py``;
here each block, given the module's state dict as arrays of another library, must compute the
module's function (float64, relative 1e-10): a whole sequence, prefill then steps, steps from
no cache, a left-padded batch with NaN in the padding, a finished row in a step; its inputs
are never modified; JAX differentiates it under ``jit`` to torch's gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polylin.blocks import (  # noqa: E402
    BlockCache,
    gated_deltanet,
    gated_deltanet_step,
    init_gated_deltanet,
    init_kimi_delta_attention,
    kimi_delta_attention,
    kimi_delta_attention_step,
)
from polylin.testing import Backend  # noqa: E402
from polylin.torch import GatedDeltaNet, KimiDeltaAttention  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 16, 2, 4

#: name -> (torch module, block, step, initializer, the module's options)
BLOCKS = {
    "gdn": (GatedDeltaNet, gated_deltanet, gated_deltanet_step, init_gated_deltanet,
            {"num_v_heads": 4, "expand_v": 1.5}),
    "gdn-plain": (GatedDeltaNet, gated_deltanet, gated_deltanet_step, init_gated_deltanet,
                  {"use_gate": False, "allow_neg_eigval": True, "conv_bias": True}),
    "kda": (KimiDeltaAttention, kimi_delta_attention, kimi_delta_attention_step,
            init_kimi_delta_attention, {"num_v_heads": 4}),
    "kda-bounded": (KimiDeltaAttention, kimi_delta_attention, kimi_delta_attention_step,
                    init_kimi_delta_attention, {"lower_bound": -5.0, "safe_gate": True}),
}  # fmt: skip

#: The options a block call needs (the rest follow from the parameters' shapes).
CALL_OPTIONS = ("num_heads", "allow_neg_eigval", "lower_bound", "method", "chunk_size")

pytestmark = pytest.mark.skip_backend(
    Backend.DASK, reason="a block is a few hundred small operations: Dask adds nothing here"
)


def make(name: str, **extra):
    """The float64 torch module, its options for a block call, and its state dict as NumPy."""
    module_type, _, _, _, options = BLOCKS[name]
    options = {**options, **extra}
    torch.manual_seed(0)
    module = module_type(
        hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, chunk_size=4,
        dtype=torch.float64, **options,
    )  # fmt: skip
    with torch.no_grad():  # a norm weight away from ones, so that a wrong one shows
        module.o_norm.weight.uniform_(0.5, 1.5)
    call = {"num_heads": HEADS, "chunk_size": 4}
    call |= {k: v for k, v in options.items() if k in CALL_OPTIONS}
    params = {n: p.detach().numpy().copy() for n, p in module.state_dict().items()}
    return module, call, params


def on(backend, params):
    return {n: backend.from_numpy(p) for n, p in params.items()}


def inputs(rng, batch=2, T=11):
    return rng.standard_normal((batch, T, HIDDEN))


def assert_close(got, want, rtol=1e-10):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


@pytest.mark.slow_grid(cover=("name",))
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_is_the_torch_module(backend, name, rng):
    """A sequence, then prefill and steps, against the module on the same weights."""
    if "float64" not in backend.float_dtypes():
        pytest.skip(f"[{backend.value}] has no float64")
    module, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    x = inputs(rng)
    with torch.no_grad():
        want, want_cache = module(torch.from_numpy(x), return_cache=True)
    p, bx = on(backend, params), backend.from_numpy(x)
    got, cache = block(p, bx, return_cache=True, **call)
    assert_close(backend.to_numpy(got), want.detach().numpy())
    assert_close(backend.to_numpy(cache.recurrent_state), want_cache.recurrent_state.numpy())
    for mine, theirs in zip(cache.conv_state, want_cache.conv_state):
        assert_close(backend.to_numpy(mine), theirs.numpy())
    _, cache = block(p, backend.from_numpy(x[:, :7]), return_cache=True, **call)
    for t in range(7, x.shape[1]):
        y_t, cache = step(p, backend.from_numpy(x[:, t]), cache, **call)
        assert_close(backend.to_numpy(y_t), want[:, t].detach().numpy())


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_steps_from_no_cache_are_the_forward_pass(name, rng):
    module, call, params = make(name)
    step = BLOCKS[name][2]
    x = inputs(rng, T=6)
    want = module(torch.from_numpy(x)).detach().numpy()
    cache = None
    for t in range(x.shape[1]):
        y_t, cache = step(params, x[:, t], cache, **call)
        assert_close(y_t, want[:, t])
    assert isinstance(cache, BlockCache)


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_left_padding_with_nan_is_each_prompt_alone(name, rng):
    """Row 0 left-padded by 3 NaN tokens: its outputs are those of the prompt alone (and 0 in
    the padding), and its cache continues like the prompt's; nothing is modified in place."""
    _, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    x = inputs(rng, T=9)
    x[0, :3] = np.nan
    mask = np.ones((2, 9), dtype=bool)
    mask[0, :3] = False
    before, mask_before = x.copy(), mask.copy()
    params_before = {n: p.copy() for n, p in params.items()}
    y, cache = block(params, x, attention_mask=mask, return_cache=True, **call)
    alone, alone_cache = block(params, x[:1, 3:], return_cache=True, **call)
    assert np.all(y[0, :3] == 0)
    assert_close(y[0, 3:], alone[0])
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(mask, mask_before)
    for n, p in params.items():
        np.testing.assert_array_equal(p, params_before[n])
    x_t = rng.standard_normal((2, HIDDEN))
    y_t, _ = step(params, x_t, cache, **call)
    alone_t, _ = step(params, x_t[:1], alone_cache, **call)
    assert_close(y_t[:1], alone_t)


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_a_finished_row_keeps_its_cache(name, rng):
    _, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    _, cache = block(params, inputs(rng, T=5), return_cache=True, **call)
    x_t = rng.standard_normal((2, HIDDEN))
    x_t[1] = np.nan
    y_t, after = step(params, x_t, cache, attention_mask=np.array([True, False]), **call)
    assert np.all(y_t[1] == 0) and np.all(np.isfinite(y_t))
    np.testing.assert_array_equal(after.recurrent_state[1], cache.recurrent_state[1])
    for mine, before in zip(after.conv_state, cache.conv_state):
        np.testing.assert_array_equal(mine[1], before[1])


@pytest.mark.only_backend(Backend.JAX)
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_jax_jit_and_grad_are_torchs(backend, name, rng):
    """``jax.jit`` of the block with the parameters as a pytree; ``jax.grad`` of a loss equals
    torch's gradients of the module's parameters."""
    import jax

    module, call, params = make(name)
    block = BLOCKS[name][1]
    x = inputs(rng, T=7)
    loss = (module(torch.from_numpy(x)) ** 2).sum()
    loss.backward()
    want = {n: p.grad.numpy() for n, p in module.named_parameters()}

    def jax_loss(p, x):
        return (block(p, x, **call) ** 2).sum()

    grads = jax.jit(jax.grad(jax_loss))(on(backend, params), backend.from_numpy(x))
    assert set(grads) == set(want)
    for n, g in grads.items():
        assert_close(np.asarray(g), want[n], rtol=1e-9)
    y, cache = jax.jit(lambda p, x: block(p, x, return_cache=True, **call))(
        on(backend, params), backend.from_numpy(x)
    )
    assert isinstance(cache, BlockCache)
    assert_close(np.asarray(y), module(torch.from_numpy(x)).detach().numpy())


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_initializer_gives_the_modules_names_shapes_and_seeded_values(name):
    module, _, _ = make(name)
    init = BLOCKS[name][3]
    options = {k: v for k, v in BLOCKS[name][4].items() if k not in CALL_OPTIONS}
    options.pop("allow_neg_eigval", None)
    params = init(np, hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, seed=3, **options)
    shapes = {n: tuple(p.shape) for n, p in module.state_dict().items()}
    assert {n: tuple(p.shape) for n, p in params.items()} == shapes
    assert all(p.dtype == np.float32 for p in params.values())
    again = init(torch, hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, seed=3,
                 dtype=torch.float64, **options)  # fmt: skip
    for n, p in params.items():
        np.testing.assert_allclose(again[n].numpy(), p, rtol=1e-6)
    other = init(np, hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, seed=4, **options)
    assert not np.array_equal(other["q_proj.weight"], params["q_proj.weight"])
    bound = 1 / np.sqrt(HIDDEN)
    assert np.all(np.abs(params["q_proj.weight"]) <= bound)
    np.testing.assert_array_equal(params["o_norm.weight"], 1.0)


def test_bad_options_and_inputs_say_what_is_wrong(rng):
    _, call, params = make("gdn")
    x = inputs(rng, T=3)
    with pytest.raises(TypeError, match="pass num_heads"):
        gated_deltanet(params, x)
    with pytest.raises(ValueError, match=r"hidden_size=32 does not match the parameters"):
        gated_deltanet(params, x, hidden_size=32, **call)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        gated_deltanet(params, x, heads=2, **call)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, T, hidden_size\)"):
        gated_deltanet(params, x[..., :8], **call)
    with pytest.raises(TypeError, match=r"attention_mask must be boolean.*mask == 0"):
        gated_deltanet(params, x, attention_mask=np.zeros((2, 3)), **call)
    with pytest.raises(KeyError, match=r"no 'v_proj\.weight'"):
        gated_deltanet({n: p for n, p in params.items() if n != "v_proj.weight"}, x, **call)
    _, cache = gated_deltanet(params, x, return_cache=True, **call)
    with pytest.raises(ValueError, match="batch of 2, the input's is 1"):
        gated_deltanet_step(params, x[:1, 0], cache, **call)
    # head_dim alone says how the keys split into heads
    y = gated_deltanet(params, x, head_dim=HEAD_DIM, chunk_size=4)
    assert_close(y, gated_deltanet(params, x, **call))
