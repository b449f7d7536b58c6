"""polylin.flax's Mamba and MLSTM layers against transformers' modules of the same state dict.

Each layer, loaded from the state dict of transformers' ``MambaMixer``, ``FalconMambaMixer`` or
``xLSTMLayer`` (float64, with ``Tensor.float`` keeping float64 as in
``test_blocks_mamba_mlstm.py``), computes the module's function under ``nnx.jit`` (relative
1e-10): a whole sequence, prefill then a step; ``nnx.grad`` gives the module's gradients by
parameter name; drawn parameters are the block initializer's.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="polylin.flax needs Flax: pip install 'polylin[flax]'")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import polylin.flax as pf  # noqa: E402
from polylin.blocks import BlockCache, init_mamba, init_mlstm  # noqa: E402

from .test_blocks_mamba_mlstm import HIDDEN, assert_close, inputs, make, module_grads, run  # noqa: E402

#: name (of test_blocks_mamba_mlstm's modules) -> (Flax layer, its keywords)
LAYERS = {
    "mamba-biases-rank3": (pf.Mamba, {"hidden_size": HIDDEN, "state_size": 4, "use_bias": True,
                                      "use_conv_bias": False, "time_step_rank": 3,
                                      "conv_kernel": 3}),
    "falcon-mamba": (pf.Mamba, {"hidden_size": HIDDEN, "state_size": 4, "bcdt_rms_eps": 1e-6}),
    "mlstm": (pf.MLSTM, {"hidden_size": HIDDEN, "num_heads": 2, "gate_soft_cap": 2.0}),
    "mlstm-fused-bias": (pf.MLSTM, {"hidden_size": HIDDEN, "num_heads": 2, "use_bias": True,
                                    "weight_mode": "fused", "qk_dim_factor": 1.0}),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def x64():
    """float64 JAX arrays for this module, XLA's optimizations off (as in test_flax.py)."""
    settings = {"jax_enable_x64": True, "jax_disable_most_optimizations": True}
    before = {name: jax.config.read(name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    yield
    for name, value in before.items():
        jax.config.update(name, value)


prefill = nnx.jit(lambda layer, x: layer(x, return_cache=True))
step = nnx.jit(lambda layer, x_t, cache: layer.step(x_t, cache))


def layer_of(name: str):
    module, _, _ = make(name)
    layer_type, options = LAYERS[name]
    return module, layer_type.from_torch_state_dict(module.state_dict(), chunk_size=4, **options)


# JAX compiles each layer configuration (5-15 s on a busy machine): two in ``make test``.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    ["mamba-biases-rank3", "mlstm", pytest.param("falcon-mamba", marks=SLOW),
     pytest.param("mlstm-fused-bias", marks=SLOW)],
)  # fmt: skip
def test_layer_is_the_transformers_module(name, rng):
    module, layer = layer_of(name)
    x = inputs(rng, T=9)
    with torch.no_grad():
        want = run(module, x).numpy()
    assert layer.dtype == jnp.float64
    got, _ = prefill(layer, jnp.asarray(x))
    assert_close(got, want)
    _, cache = prefill(layer, jnp.asarray(x[:, :8]))
    assert isinstance(cache, BlockCache)
    y_t, _ = step(layer, jnp.asarray(x[:, 8]), cache)
    assert_close(y_t, want[:, 8])


@pytest.mark.parametrize("name", [pytest.param("mamba-biases-rank3", marks=SLOW), "mlstm"])
def test_gradients_by_name_are_the_modules(name, rng):
    module, layer = layer_of(name)
    x = inputs(rng, T=7)
    want = module_grads(module, x)

    @nnx.jit
    def grads(layer, x):
        return nnx.grad(lambda layer: (layer(x) ** 2).sum())(layer)

    got = grads(layer, jnp.asarray(x))["params"]
    assert set(got) == set(want)
    for n, g in want.items():
        assert_close(got[n][...], g, rtol=1e-9)


def test_drawn_parameters_are_the_blocks_initializers():
    mamba = pf.Mamba(hidden_size=HIDDEN, state_size=4, seed=3).state_dict()
    for n, p in init_mamba(np, hidden_size=HIDDEN, state_size=4, seed=3).items():
        assert mamba[n].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(mamba[n]), p)  # uniform draws: exact
    mlstm = pf.MLSTM(hidden_size=HIDDEN, num_heads=2, weight_mode="fused", seed=3).state_dict()
    want = init_mlstm(np, hidden_size=HIDDEN, num_heads=2, weight_mode="fused", seed=3)
    assert set(mlstm) == set(want)
    for n, p in want.items():  # normal draws: float32 log and cos of JAX and NumPy
        np.testing.assert_allclose(np.asarray(mlstm[n]), p, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not match the parameters"):
        pf.MLSTM(hidden_size=HIDDEN, num_heads=4, params=want)
