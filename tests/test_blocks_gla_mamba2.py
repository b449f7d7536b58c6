"""polylin.blocks' GLA and Mamba-2 blocks against the PyTorch modules, on every backend.

The torch modules are checked against float64 loops of their formulas (and Mamba-2 against
transformers' ``Mamba2Mixer``) in ``test_layers.py``; here each block, given the module's state
dict as arrays of another library, must compute the module's function (float64, relative
1e-10): a whole sequence and its cache, prefill then steps, steps from no cache, a left-padded
batch with NaN in the padding, a finished row in a step; its inputs are never modified; JAX
differentiates it under ``jit`` to torch's gradients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polylin import LinearAttentionState, causal_linear_attention  # noqa: E402
from polylin.activations import silu  # noqa: E402
from polylin.blocks import (  # noqa: E402
    BlockCache,
    gated_linear_attention,
    gated_linear_attention_step,
    init_gated_linear_attention,
    init_mamba2,
    mamba2,
    mamba2_step,
)
from polylin.testing import Backend  # noqa: E402
from polylin.torch import GatedLinearAttention, Mamba2  # noqa: E402

HIDDEN = 16

GLA = (GatedLinearAttention, gated_linear_attention, gated_linear_attention_step)
MAMBA2 = (Mamba2, mamba2, mamba2_step)
#: name -> (torch module, block, step, the module's options, the block call's options)
BLOCKS = {
    "gla": (*GLA, {"num_heads": 2}, {}),
    "gla-conv-mqa-sigmoid": (
        *GLA,
        {"num_heads": 2, "num_kv_heads": 1, "expand_k": 1.0, "use_short_conv": True,
         "conv_bias": True, "gate_fn": "sigmoid", "clamp_min": -0.05},
        {"gate_fn": "sigmoid", "clamp_min": -0.05},
    ),
    "gla-unfused-no-affine": (
        *GLA,
        {"num_heads": 4, "expand_k": 1.0, "elementwise_affine": False, "fuse_norm": False,
         "feature_map": silu, "gate_logit_normalizer": 4},
        {"num_heads": 4, "fuse_norm": False, "feature_map": silu, "gate_logit_normalizer": 4},
    ),
    "mamba2": (*MAMBA2, {"head_dim": 8, "state_size": 4}, {"n_groups": 1}),
    "mamba2-groups-plain": (
        *MAMBA2,
        {"head_dim": 4, "state_size": 4, "n_groups": 2, "rmsnorm": False, "D_has_hdim": True,
         "use_bias": True, "use_conv_bias": False, "conv_kernel": 3, "dt_limit": (0.01, 0.08)},
        {"state_size": 4, "dt_limit": (0.01, 0.08)},
    ),
    "mamba2-norm-before-gate": (
        *MAMBA2, {"head_dim": 4, "state_size": 4, "n_groups": 2, "norm_before_gate": True},
        {"n_groups": 2, "norm_before_gate": True},
    ),
}  # fmt: skip

pytestmark = pytest.mark.skip_backend(
    Backend.DASK, reason="a block is a few hundred small operations: Dask adds nothing here"
)


def make(name: str):
    """The float64 torch module, the block call's options, and its state dict as NumPy."""
    module_type, _, _, options, call = BLOCKS[name]
    torch.manual_seed(0)
    module = module_type(hidden_size=HIDDEN, chunk_size=4, dtype=torch.float64, **options)
    with torch.no_grad():  # norm weights and D away from ones, so that a wrong one shows
        for n, p in module.named_parameters():
            if n.endswith("norm.weight") or n.endswith("norm_swish_gate.weight") or n == "D":
                p.uniform_(0.5, 1.5)
    params = {n: p.detach().numpy().copy() for n, p in module.state_dict().items()}
    return module, {**call, "chunk_size": 4}, params


def on(backend, params):
    return {n: backend.from_numpy(p) for n, p in params.items()}


def inputs(rng, batch=2, T=11):
    return rng.standard_normal((batch, T, HIDDEN))


def assert_close(got, want, rtol=1e-10):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


def assert_cache(to_numpy, cache, want) -> None:
    """A block cache equals a module's: convolution states and ``(S, z)``."""
    assert isinstance(cache, BlockCache) and isinstance(cache.recurrent_state, LinearAttentionState)
    for mine, theirs in zip(cache.recurrent_state, want.recurrent_state, strict=True):
        assert_close(to_numpy(mine), theirs.detach().numpy())
    for mine, theirs in zip(cache.conv_state, want.conv_state, strict=True):
        assert_close(to_numpy(mine), theirs.detach().numpy())


# JAX compiles each operation of an eager block for each new shape (about 15 s of CPU a case
# here): one case in ``make test``, the others in ``make test-slow``; test_jax_jit_and_grad_are_
# torchs runs both blocks under jit.
@pytest.mark.slow_grid(prefer={"name": "gla-conv-mqa-sigmoid"})
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_is_the_torch_module(backend, name, rng):
    """A sequence and its cache, then prefill and steps, against the module's."""
    if "float64" not in backend.float_dtypes():
        pytest.skip(f"[{backend.value}] has no float64")
    module, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    x = inputs(rng)
    with torch.no_grad():
        want, want_cache = module(torch.from_numpy(x), return_cache=True)
    p, bx = on(backend, params), backend.from_numpy(x)
    got, cache = block(p, bx, return_cache=True, **call)
    assert_close(backend.to_numpy(got), want.numpy())
    assert_cache(backend.to_numpy, cache, want_cache)
    _, cache = block(p, backend.from_numpy(x[:, :7]), return_cache=True, **call)
    for t in range(7, x.shape[1]):
        y_t, cache = step(p, backend.from_numpy(x[:, t]), cache, **call)
        assert_close(backend.to_numpy(y_t), want[:, t].numpy())
    with torch.no_grad():
        _, want_cache = module(torch.from_numpy(x[:, :7]), return_cache=True)
        for t in range(7, x.shape[1]):
            _, want_cache = module.step(torch.from_numpy(x[:, t]), want_cache)
    assert_cache(backend.to_numpy, cache, want_cache)


@pytest.mark.parametrize("name", ["gla-conv-mqa-sigmoid", "mamba2-groups-plain"])
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


@pytest.mark.parametrize("name", ["gla-conv-mqa-sigmoid", "mamba2", "mamba2-groups-plain"])
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
    assert np.all(y[0, :3] == 0) and np.all(np.isfinite(y))
    assert_close(y[0, 3:], alone[0])
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(mask, mask_before)
    for n, p in params.items():
        np.testing.assert_array_equal(p, params_before[n])
    x_t = rng.standard_normal((2, HIDDEN))
    y_t, _ = step(params, x_t, cache, **call)
    alone_t, _ = step(params, x_t[:1], alone_cache, **call)
    assert_close(y_t[:1], alone_t)


@pytest.mark.parametrize("name", ["gla-conv-mqa-sigmoid", "mamba2"])
def test_a_finished_row_keeps_its_cache(name, rng):
    _, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    _, cache = block(params, inputs(rng, T=5), return_cache=True, **call)
    x_t = rng.standard_normal((2, HIDDEN))
    x_t[1] = np.nan
    y_t, after = step(params, x_t, cache, attention_mask=np.array([True, False]), **call)
    assert np.all(y_t[1] == 0) and np.all(np.isfinite(y_t))
    for mine, before in zip(after.recurrent_state, cache.recurrent_state):
        np.testing.assert_array_equal(mine[1], before[1])
    for mine, before in zip(after.conv_state, cache.conv_state):
        np.testing.assert_array_equal(mine[1], before[1])


@pytest.mark.only_backend(Backend.JAX)
@pytest.mark.parametrize("name", ["gla-conv-mqa-sigmoid", "mamba2-norm-before-gate"])
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


@pytest.mark.parametrize("name", ["gla-conv-mqa-sigmoid", "mamba2-groups-plain"])
def test_torch_autograd_through_the_block_is_the_modules(name, rng):
    """The block on torch leaves (the state dict, ``requires_grad``) gives the module's
    gradients."""
    module, call, params = make(name)
    x = torch.from_numpy(inputs(rng, T=7))
    (module(x) ** 2).sum().backward()
    leaves = {n: torch.from_numpy(p).requires_grad_(True) for n, p in params.items()}
    (BLOCKS[name][1](leaves, x, **call) ** 2).sum().backward()
    for n, p in module.named_parameters():
        assert_close(leaves[n].grad.numpy(), p.grad.numpy(), rtol=1e-9)


@pytest.mark.parametrize("name", ["gla-conv-mqa-sigmoid", "mamba2-groups-plain"])
def test_grouped_heads_reach_the_recurrence_uncopied(name, rng, monkeypatch):
    """GLA's shared key/value heads and Mamba-2's shared B and C reach
    :func:`polylin.causal_linear_attention` with a size-1 group axis (broadcast, no copy per
    head), and the torch module's forward keeps less for the backward than with those copied
    per head, by at least the copies' bytes."""
    import polylin.blocks._linear as shared_steps

    module, _, _ = make(name)
    x = torch.tensor(inputs(rng, T=32), requires_grad=True)
    shared = []

    def watched(q, k, v, *args, log_decay, **options):
        shared.extend(t for t in (q, k, v, log_decay) if t.shape[-2] == 1)
        return causal_linear_attention(q, k, v, *args, log_decay=log_decay, **options)

    def expanded(q, k, v, *args, log_decay, **options):
        lead = torch.broadcast_shapes(*(t.shape[:-1] for t in (q, k, v, log_decay)))
        q, k, v, log_decay = (
            t.expand(*lead, t.shape[-1]).contiguous() for t in (q, k, v, log_decay)
        )
        return causal_linear_attention(q, k, v, *args, log_decay=log_decay, **options)

    def saved_bytes(fn):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return fn(), sum(storages.values())

    monkeypatch.setattr(shared_steps, "causal_linear_attention", watched)
    out, grouped = saved_bytes(lambda: module(x))
    gla = name.startswith("gla")
    copies = module.num_heads // (module.num_kv_heads if gla else module.n_groups)
    assert copies > 1 and len(shared) == (3 if gla else 2)  # k, v, g or B, C
    monkeypatch.setattr(shared_steps, "causal_linear_attention", expanded)
    want, repeated = saved_bytes(lambda: module(x))
    torch.testing.assert_close(out, want)
    copy_bytes = (copies - 1) * sum(t.numel() * t.element_size() for t in shared)
    assert grouped <= repeated - copy_bytes


@pytest.mark.parametrize("name", ["gla", "gla-conv-mqa-sigmoid", "mamba2-groups-plain"])
def test_initializer_gives_the_modules_names_shapes_and_seeded_values(name):
    module, _, _ = make(name)
    init = init_gated_linear_attention if name.startswith("gla") else init_mamba2
    options = {k: v for k, v in BLOCKS[name][3].items()
               if k not in ("clamp_min", "dt_limit", "feature_map")}  # fmt: skip
    params = init(np, hidden_size=HIDDEN, seed=3, **options)
    shapes = {n: tuple(p.shape) for n, p in module.state_dict().items()}
    assert {n: tuple(p.shape) for n, p in params.items()} == shapes
    assert all(p.dtype == np.float32 for p in params.values())
    again = init(torch, hidden_size=HIDDEN, seed=3, dtype=torch.float64, **options)
    for n, p in params.items():
        np.testing.assert_allclose(again[n].numpy(), p, rtol=1e-6)
    other = init(np, hidden_size=HIDDEN, seed=4, **options)
    first = "q_proj.weight" if name.startswith("gla") else "in_proj.weight"
    assert not np.array_equal(other[first], params[first])
    assert np.all(np.abs(params[first]) <= 1 / np.sqrt(HIDDEN))
    if name.startswith("mamba2"):
        np.testing.assert_array_equal(params["D"], 1.0)
        assert np.all((np.exp(params["A_log"]) >= 1 - 1e-5) & (np.exp(params["A_log"]) <= 16))
        dt = np.log1p(np.exp(params["dt_bias"].astype(np.float64)))  # softplus: dt
        assert np.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5)))
    # the initialized block runs and its sizes are the module's
    call = BLOCKS[name][4]
    y = BLOCKS[name][1](params, np.ones((1, 3, HIDDEN), np.float32), **call)
    assert y.shape == (1, 3, HIDDEN) and y.dtype == np.float32


def test_gla_bad_options_and_inputs_say_what_is_wrong(rng):
    _, call, params = make("gla-conv-mqa-sigmoid")
    x = inputs(rng, T=3)
    block = gated_linear_attention
    with pytest.raises(ValueError, match=r"hidden_size=32 does not match the parameters"):
        block(params, x, hidden_size=32, **call)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 does not match .* num_kv_heads=1"):
        block(params, x, num_kv_heads=2, **call)
    with pytest.raises(ValueError, match=r"expand_k=0.5 does not match .* expand_k=1.0"):
        block(params, x, expand_k=0.5, **call)
    with pytest.raises(ValueError, match=r"num_heads=4 does not match .* num_heads=2"):
        block(params, x, num_heads=4, **call)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        block(params, x, heads=2, **call)
    with pytest.raises(ValueError, match="gate_fn must be one of"):
        block(params, x, gate_fn="relu")
    with pytest.raises(ValueError, match="method must be one of"):
        block(params, x, method="fast", **call)
    with pytest.raises(TypeError, match="feature_map must be a callable"):
        block(params, x, feature_map="elu", **call)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, T, hidden_size\)"):
        block(params, x[..., :8], **call)
    with pytest.raises(TypeError, match=r"attention_mask must be boolean.*mask == 0"):
        block(params, x, attention_mask=np.zeros((2, 3)), **call)
    with pytest.raises(KeyError, match=r"no 'gk_proj\.0\.weight'"):
        block({n: p for n, p in params.items() if n != "gk_proj.0.weight"}, x, **call)
    _, cache = block(params, x, return_cache=True, **call)
    with pytest.raises(ValueError, match="batch of 2, the input's is 1"):
        gated_linear_attention_step(params, x[:1, 0], cache, **call)
    with pytest.raises(ValueError, match=r"g_norm_swish_gate.*gate_fn='sigmoid'"):
        block(make("gla")[2], x, gate_fn="sigmoid")
    with pytest.raises(TypeError, match="pass num_heads"):
        block(make("gla-unfused-no-affine")[2], x)


def test_mamba2_bad_options_and_inputs_say_what_is_wrong(rng):
    _, call, params = make("mamba2-groups-plain")
    x = inputs(rng, T=3)
    with pytest.raises(TypeError, match=r"pass n_groups \(or state_size\)"):
        mamba2(params, x)
    with pytest.raises(ValueError, match=r"n_groups=3 and state_size=None do not fit"):
        mamba2(params, x, n_groups=3)
    with pytest.raises(ValueError, match=r"head_dim=8 does not match .* head_dim=4"):
        mamba2(params, x, head_dim=8, **call)
    with pytest.raises(ValueError, match=r"rmsnorm=True does not match"):
        mamba2(params, x, rmsnorm=True, **call)
    with pytest.raises(ValueError, match=r"dt_limit must be \(low, high\) with low <= high"):
        mamba2(params, x, state_size=4, dt_limit=(0.1, 0.01))
    with pytest.raises(TypeError, match="unexpected keyword argument 'groups'"):
        mamba2(params, x, groups=2, **call)
    # the initialization's options are accepted and change nothing
    same = mamba2(params, x, A_init_range=(2, 4), dt_min=0.01, **call)
    assert_close(same, mamba2(params, x, **call))
    _, gla_cache = gated_linear_attention(make("gla")[2], x, return_cache=True)
    with pytest.raises(ValueError, match="made by another block"):
        mamba2_step(params, x[:, 0], gla_cache, **call)
    assert math.isfinite(float(np.sum(mamba2_step(params, x[:, 0], None, **call)[0])))
