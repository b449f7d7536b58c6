"""polylin.blocks' Mamba-1 and mLSTM blocks against transformers' modules, on every backend.

The peers are transformers' ``MambaMixer``, ``FalconMambaMixer`` and ``xLSTMLayer`` (their
pure-PyTorch paths: no ``mamba_ssm``, ``causal_conv1d`` or ``xlstm`` here) in float64. Their
code casts some parameters and activations to float32 on the way (``.float()``: ``A_log``,
``D``, the time-step bias, ``B``, ``x``, FalconMamba's norms; the xLSTM norm's
``norm_reduction_force_float32``), a kernel's habit: for the float64 comparison
``Tensor.float`` keeps float64 tensors as they are (``float64_kept``) and the xLSTM config says
float64 for its kernels, so that the formulas are compared at float64 round-off (relative
1e-10); ``test_float32_is_transformers_unpatched`` compares the float32 modules as they are.
Each block must compute the module's function: a whole sequence, prefill then steps, steps
from no cache, a left-padded batch with NaN in the padding, a finished row in a step; its
inputs are never modified; JAX (``jit``, ``grad``) and torch autograd give the module's
gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from polylin import MLSTMState  # noqa: E402
from polylin.blocks import (  # noqa: E402
    BlockCache,
    init_mamba,
    init_mlstm,
    mamba,
    mamba_step,
    mlstm,
    mlstm_step,
)
from polylin.testing import Backend  # noqa: E402

HIDDEN = 16

pytestmark = pytest.mark.skip_backend(
    Backend.DASK, reason="a block is a few hundred small operations: Dask adds nothing here"
)


@contextlib.contextmanager
def float64_kept() -> Iterator[None]:
    """``Tensor.float()`` leaves float64 tensors as they are (see the module docstring)."""
    original = torch.Tensor.float

    def kept(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = kept
    try:
        yield
    finally:
        torch.Tensor.float = original


def mamba_module(falcon: bool = False, dtype=torch.float64, **config):
    if falcon:
        from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer

        cfg = transformers.FalconMambaConfig(
            hidden_size=HIDDEN, state_size=4, num_hidden_layers=1, **config
        )
        mixer = FalconMambaMixer(cfg, 0, initialize_mixer_weights=False)
    else:
        from transformers.models.mamba.modeling_mamba import MambaMixer

        cfg = transformers.MambaConfig(
            hidden_size=HIDDEN, state_size=4, num_hidden_layers=1, **config
        )
        mixer = MambaMixer(cfg, 0, initialize_mixer_weights=False)
    mixer = mixer.to(dtype)
    with torch.no_grad():  # A, D and the time steps in ranges where each matters
        mixer.A_log.uniform_(-1.0, 2.0)
        mixer.D.uniform_(0.5, 1.5)
        mixer.dt_proj.bias.uniform_(-4.0, -1.0)
    return mixer


def xlstm_module(dtype=torch.float64, **config):
    from transformers.models.xlstm.modeling_xlstm import xLSTMLayer

    cfg = transformers.xLSTMConfig(
        hidden_size=HIDDEN, num_heads=2, chunk_size=4, norm_reduction_force_float32=False,
        **config,
    )  # fmt: skip
    if dtype == torch.float64:  # the config allows 16- and 32-bit kernels only
        object.__setattr__(cfg, "autocast_kernel_dtype", "float64")
        object.__setattr__(cfg, "inference_state_dtype", "float64")
    layer = xLSTMLayer(cfg).to(dtype)
    with torch.no_grad():  # gates and norms away from their defaults, so that a wrong one shows
        for n, p in layer.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.uniform_(-0.5, 0.5)
            elif "gate" in n and n.endswith("bias"):
                p.uniform_(-3.0, 3.0)
    return layer


#: name -> (make the module, block, step, the block call's options)
BLOCKS = {
    "mamba": (lambda **k: mamba_module(**k), mamba, mamba_step, {}),
    "mamba-biases-rank3": (
        lambda **k: mamba_module(use_bias=True, use_conv_bias=False, time_step_rank=3,
                                 conv_kernel=3, **k),
        mamba, mamba_step, {"time_step_rank": 3},
    ),
    "falcon-mamba": (
        lambda **k: mamba_module(falcon=True, **k), mamba, mamba_step, {"bcdt_rms_eps": 1e-6}
    ),
    "mlstm": (lambda **k: xlstm_module(gate_soft_cap=2.0, **k), mlstm, mlstm_step,
              {"gate_soft_cap": 2.0}),
    "mlstm-fused-bias": (
        lambda **k: xlstm_module(weight_mode="fused", use_bias=True, qk_dim_factor=1.0, **k),
        mlstm, mlstm_step, {"weight_mode": "fused"},
    ),
}  # fmt: skip


def make(name: str, dtype=torch.float64):
    """The torch module, the block call's options, and its state dict as NumPy."""
    torch.manual_seed(0)
    build, _, _, call = BLOCKS[name]
    module = build(dtype=dtype)
    call = {**call, "chunk_size": 4}
    params = {n: p.detach().numpy().copy() for n, p in module.state_dict().items()}
    return module, call, params


def run(module, x: np.ndarray):
    """The module's output (float64 kept) for NumPy ``x``, as a tensor."""
    with float64_kept():
        out = module(torch.from_numpy(x))
    return out[0] if isinstance(out, tuple) else out


def on(backend, params):
    return {n: backend.from_numpy(p) for n, p in params.items()}


def inputs(rng, batch=2, T=11):
    return rng.standard_normal((batch, T, HIDDEN))


def assert_close(got, want, rtol=1e-10):
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=rtol * scale)


# JAX compiles each operation of an eager block for each new shape: one case in ``make test``.
@pytest.mark.slow_grid(prefer={"name": "mamba-biases-rank3"})
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_is_transformers_module(backend, name, rng):
    """A sequence, then prefill and steps, against the module's whole sequence (and xLSTM's
    final state against the layer's)."""
    if "float64" not in backend.float_dtypes():
        pytest.skip(f"[{backend.value}] has no float64")
    module, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    x = inputs(rng)
    with torch.no_grad():
        want = run(module, x).numpy()
    p, bx = on(backend, params), backend.from_numpy(x)
    got, cache = block(p, bx, return_cache=True, **call)
    assert isinstance(cache, BlockCache)
    assert_close(backend.to_numpy(got), want)
    if name.startswith("mlstm"):
        with torch.no_grad(), float64_kept():
            _, state = module(torch.from_numpy(x))
        assert isinstance(cache.recurrent_state, MLSTMState)
        for mine, theirs in zip(cache.recurrent_state, state, strict=True):
            assert_close(backend.to_numpy(mine), theirs.numpy())
    _, cache = block(p, backend.from_numpy(x[:, :7]), return_cache=True, **call)
    for t in range(7, x.shape[1]):
        y_t, cache = step(p, backend.from_numpy(x[:, t]), cache, **call)
        assert_close(backend.to_numpy(y_t), want[:, t])


@pytest.mark.parametrize("name", ["mamba-biases-rank3", "falcon-mamba"])
def test_mamba_cache_is_transformers_cache(name, rng):
    """After a prefill, the block's cache holds transformers' states (its ``DynamicCache``):
    the scan's state as it is, the convolution's last ``conv_kernel - 1`` inputs (transformers
    keeps ``conv_kernel``, channels first); one more token continues both alike."""
    from transformers.cache_utils import DynamicCache

    module, call, params = make(name)
    x = inputs(rng, T=9)
    theirs = DynamicCache(config=module.config)
    with torch.no_grad(), float64_kept():
        module(torch.from_numpy(x[:, :8]), cache_params=theirs)
        want_t = module(torch.from_numpy(x[:, 8:]), cache_params=theirs)[:, 0].numpy()
    _, cache = mamba(params, x[:, :8], return_cache=True, **call)
    y_t, after = mamba_step(params, x[:, 8], cache, **call)
    assert_close(y_t, want_t)
    assert_close(after.recurrent_state, theirs.get_recurrent_state(0, state_idx=0).numpy())
    conv = theirs.get_conv_state(0, state_idx=0).numpy()
    assert_close(after.conv_state[0], np.swapaxes(conv[..., 1:], 1, 2))


@pytest.mark.parametrize("method", ["recurrent", "quadratic"])
@pytest.mark.parametrize("name", ["mamba-biases-rank3", "mlstm"])
def test_every_method_is_the_module(name, method, rng):
    module, call, params = make(name)
    x = inputs(rng, T=9)
    with torch.no_grad():
        want = run(module, x).numpy()
    assert_close(BLOCKS[name][1](params, x, method=method, **call), want)


@pytest.mark.parametrize("name", ["mamba-biases-rank3", "falcon-mamba", "mlstm-fused-bias"])
def test_float32_is_transformers_unpatched(name, rng):
    """The float32 module exactly as transformers runs it (its own float32 casts)."""
    module, call, params = make(name, dtype=torch.float32)
    x = inputs(rng).astype(np.float32)
    with torch.no_grad():
        out = module(torch.from_numpy(x))
    want = (out[0] if isinstance(out, tuple) else out).numpy()
    got = BLOCKS[name][1](params, x, **call)
    assert got.dtype == np.float32
    assert_close(got, want, rtol=2e-6)


@pytest.mark.parametrize("name", ["mamba-biases-rank3", "mlstm-fused-bias"])
def test_steps_from_no_cache_are_the_forward_pass(name, rng):
    module, call, params = make(name)
    x = inputs(rng, T=6)
    with torch.no_grad():
        want = run(module, x).numpy()
    cache = None
    for t in range(x.shape[1]):
        y_t, cache = BLOCKS[name][2](params, x[:, t], cache, **call)
        assert_close(y_t, want[:, t])
    assert isinstance(cache, BlockCache)


@pytest.mark.parametrize("name", ["mamba", "mamba-biases-rank3", "mlstm-fused-bias"])
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


@pytest.mark.parametrize("name", ["mamba", "mlstm"])
@pytest.mark.parametrize("from_cache", [True, False])
def test_a_finished_row_keeps_its_cache(name, from_cache, rng):
    _, call, params = make(name)
    block, step = BLOCKS[name][1], BLOCKS[name][2]
    cache = None
    if from_cache:
        _, cache = block(params, inputs(rng, T=5), return_cache=True, **call)
    x_t = rng.standard_normal((2, HIDDEN))
    x_t[1] = np.nan
    y_t, after = step(params, x_t, cache, attention_mask=np.array([True, False]), **call)
    assert np.all(y_t[1] == 0) and np.all(np.isfinite(y_t))
    _, alone = step(params, x_t[:1], None if cache is None else _row(cache, 0), **call)
    for mine, kept, first in zip(_leaves(after), _leaves(cache), _leaves(alone), strict=False):
        assert_close(mine[:1], first)
        if kept is None:
            np.testing.assert_array_equal(mine[1], 0.0)
        else:
            np.testing.assert_array_equal(mine[1], kept[1])


def _leaves(cache):
    if cache is None:
        return (None,) * 4
    state = cache.recurrent_state
    return (*cache.conv_state, *(state if isinstance(state, tuple) else (state,)))


def _row(cache, i):
    state = cache.recurrent_state
    state = type(state)(*(s[i : i + 1] for s in state)) if isinstance(state, tuple) else (
        state[i : i + 1]
    )  # fmt: skip
    return BlockCache(tuple(c[i : i + 1] for c in cache.conv_state), state)


def module_grads(module, x):
    with float64_kept():
        out = module(torch.from_numpy(x))
        ((out[0] if isinstance(out, tuple) else out) ** 2).sum().backward()
    return {n: p.grad.numpy() for n, p in module.named_parameters()}


@pytest.mark.only_backend(Backend.JAX)
@pytest.mark.parametrize("name", ["mamba-biases-rank3", "mlstm-fused-bias"])
def test_jax_jit_and_grad_are_torchs(backend, name, rng):
    """``jax.jit`` of the block with the parameters as a pytree; ``jax.grad`` of a loss equals
    the gradients of the transformers module's parameters."""
    import jax

    module, call, params = make(name)
    block = BLOCKS[name][1]
    x = inputs(rng, T=7)
    want = module_grads(module, x)

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
    with torch.no_grad():
        assert_close(np.asarray(y), run(module, x).numpy())


@pytest.mark.parametrize("name", ["mamba-biases-rank3", "falcon-mamba", "mlstm"])
def test_torch_autograd_through_the_block_is_the_modules(name, rng):
    """The block on torch leaves (the state dict, ``requires_grad``) gives the module's
    gradients."""
    module, call, params = make(name)
    x = inputs(rng, T=7)
    want = module_grads(module, x)
    leaves = {n: torch.from_numpy(p).requires_grad_(True) for n, p in params.items()}
    (BLOCKS[name][1](leaves, torch.from_numpy(x), **call) ** 2).sum().backward()
    for n, g in want.items():
        assert_close(leaves[n].grad.numpy(), g, rtol=1e-9)


@pytest.mark.parametrize(
    "name, options",
    [("mamba", {}), ("mamba-biases-rank3",
                     {"use_bias": True, "use_conv_bias": False, "time_step_rank": 3,
                      "conv_kernel": 3}),
     ("mlstm", {"num_heads": 2}), ("mlstm-fused-bias",
                                   {"num_heads": 2, "weight_mode": "fused", "use_bias": True,
                                    "qk_dim_factor": 1.0})],
)  # fmt: skip
def test_initializer_gives_the_modules_names_shapes_and_seeded_values(name, options):
    module, call, _ = make(name)
    init = init_mamba if name.startswith("mamba") else init_mlstm
    sizes = {"state_size": 4} if name.startswith("mamba") else {}
    params = init(np, hidden_size=HIDDEN, seed=3, **sizes, **options)
    shapes = {n: tuple(p.shape) for n, p in module.state_dict().items()}
    assert {n: tuple(p.shape) for n, p in params.items()} == shapes
    assert all(p.dtype == np.float32 for p in params.values())
    again = init(torch, hidden_size=HIDDEN, seed=3, dtype=torch.float64, **sizes, **options)
    for n, p in params.items():  # float32 round-off of the draws (the normal's in float32)
        np.testing.assert_allclose(again[n].numpy(), p, rtol=1e-6, atol=1e-6)
    first = "in_proj.weight" if name.startswith("mamba") else next(iter(params))
    other = init(np, hidden_size=HIDDEN, seed=4, **sizes, **options)
    assert not np.array_equal(other[first], params[first])
    if name.startswith("mamba"):
        np.testing.assert_array_equal(params["D"], 1.0)
        np.testing.assert_allclose(np.exp(params["A_log"]), np.tile(np.arange(1.0, 5.0), (32, 1)),
                                   rtol=1e-6)  # fmt: skip
        dt = np.log1p(np.exp(params["dt_proj.bias"].astype(np.float64)))  # softplus: dt
        assert np.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5)))
        assert np.all(np.abs(params["in_proj.weight"]) <= 1 / np.sqrt(HIDDEN))
    else:
        i_bias, f_bias = (
            (params["igate_preact.bias"], params["fgate_preact.bias"]) if "igate_preact.bias"
            in params else np.split(params["ifgate_preact.bias"], 2)
        )  # fmt: skip
        np.testing.assert_array_equal(i_bias, -10.0)
        np.testing.assert_allclose(f_bias, [3.0, 6.0])
        np.testing.assert_array_equal(params["multihead_norm.weight"], 1.0)
    y = BLOCKS[name][1](params, np.ones((1, 3, HIDDEN), np.float32), **call)
    assert y.shape == (1, 3, HIDDEN) and y.dtype == np.float32 and np.all(np.isfinite(y))


def test_mamba_bad_options_and_inputs_say_what_is_wrong(rng):
    _, call, params = make("mamba-biases-rank3")
    x = inputs(rng, T=3)
    with pytest.raises(ValueError, match=r"hidden_size=32 does not match the parameters"):
        mamba(params, x, hidden_size=32)
    with pytest.raises(ValueError, match=r"time_step_rank='auto' does not match .*=3"):
        mamba(params, x, time_step_rank="auto")
    with pytest.raises(ValueError, match=r"use_conv_bias=True does not match"):
        mamba(params, x, use_conv_bias=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        mamba(params, x, heads=2)
    with pytest.raises(ValueError, match="method must be one of"):
        mamba(params, x, method="fast")
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        mamba(params, x, hidden_act="gelu")
    with pytest.raises(ValueError, match="bcdt_rms_eps must be None or a number > 0"):
        mamba(params, x, bcdt_rms_eps=-1.0)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, T, hidden_size\)"):
        mamba(params, x[..., :8])
    with pytest.raises(TypeError, match=r"attention_mask must be boolean"):
        mamba(params, x, attention_mask=np.zeros((2, 3)))
    with pytest.raises(KeyError, match=r"no 'x_proj\.weight'"):
        mamba({n: p for n, p in params.items() if n != "x_proj.weight"}, x)
    with pytest.raises(ValueError, match="are not one Mamba mixer's"):
        mamba({**params, "D": params["D"][:5]}, x)
    _, cache = mamba(params, x, return_cache=True)
    with pytest.raises(ValueError, match="batch of 2, the input's is 1"):
        mamba_step(params, x[:1, 0], cache)
    _, other = mlstm(make("mlstm")[2], x, return_cache=True)
    with pytest.raises(ValueError, match="made by another block"):
        mamba_step(params, x[:, 0], other)
    # the initialization's options are accepted and change nothing
    same = mamba(params, x, time_step_min=0.01, time_step_init_scheme="constant", **call)
    assert_close(same, mamba(params, x, **call))


def test_mlstm_bad_options_and_inputs_say_what_is_wrong(rng):
    _, call, params = make("mlstm")
    x = inputs(rng, T=3)
    with pytest.raises(ValueError, match=r"num_heads=4 does not match .* num_heads=2"):
        mlstm(params, x, num_heads=4)
    with pytest.raises(ValueError, match=r"weight_mode='fused' does not match"):
        mlstm(params, x, weight_mode="fused")
    with pytest.raises(ValueError, match=r"qk_dim_factor=1.0 does not match .*=0.5"):
        mlstm(params, x, qk_dim_factor=1.0)
    with pytest.raises(ValueError, match="gate_soft_cap must be a number > 0"):
        mlstm(params, x, gate_soft_cap=0.0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        mlstm(params, x, chunk_size=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        mlstm(params, x, heads=2)
    with pytest.raises(KeyError, match=r"no 'k\.weight'"):
        mlstm({n: p for n, p in params.items() if n != "k.weight"}, x)
    with pytest.raises(ValueError, match="are not one mLSTM layer's"):
        mlstm({**params, "multihead_norm.weight": params["multihead_norm.weight"][:5]}, x)
    _, cache = mlstm(params, x, return_cache=True)
    with pytest.raises(ValueError, match="batch of 2, the input's is 1"):
        mlstm_step(params, x[:1, 0], cache)
    _, other = mamba(make("mamba")[2], x, return_cache=True)
    with pytest.raises(ValueError, match="made by another block"):
        mlstm_step(params, x[:, 0], other)
    # the kernel choices are accepted and change nothing; gate_soft_cap=None is no cap
    same = mlstm(params, x, mode="train", autocast_kernel_dtype="bfloat16", **call)
    assert_close(same, mlstm(params, x, **call))
    assert not np.allclose(mlstm(params, x, gate_soft_cap=None), mlstm(params, x, **call))
