"""polylin.flax: the Flax NNX layers against the PyTorch modules of the same state dict.

Each layer, loaded from a torch module's state dict, computes the module's function (float64,
relative 1e-10): a whole sequence with a left-padded row, prefill then steps, its caches, and
the gradients of a loss by parameter name; ``nnx.jit`` of the call and of the step gives the
eager numbers; a cache crosses between the frameworks both ways; loading checks names, shapes
and sizes; ``import polylin`` does not import Flax. The JAX character-LM example trains a Gated
DeltaNet model through ``polylin.flax`` and NumPy serves its weights with the same greedy text.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax", reason="polylin.flax needs Flax: pip install 'polylin[flax]'")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import polylin.flax as pf  # noqa: E402
import polylin.torch as pt  # noqa: E402
from polylin.blocks import BlockCache, gated_deltanet, init_gated_deltanet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, HEADS, HEAD_DIM = 16, 2, 4

DELTA = {"hidden_size": HIDDEN, "num_heads": HEADS, "head_dim": HEAD_DIM}
#: name -> (torch module, Flax module, the modules' options)
LAYERS = {
    "gdn": (pt.GatedDeltaNet, pf.GatedDeltaNet, {**DELTA, "num_v_heads": 4, "expand_v": 1.5}),
    "gdn-plain": (pt.GatedDeltaNet, pf.GatedDeltaNet,
                  {**DELTA, "use_gate": False, "allow_neg_eigval": True, "conv_bias": True}),
    "kda": (pt.KimiDeltaAttention, pf.KimiDeltaAttention, {**DELTA, "num_v_heads": 4}),
    "kda-bounded": (pt.KimiDeltaAttention, pf.KimiDeltaAttention,
                    {**DELTA, "lower_bound": -5.0, "safe_gate": True}),
    "gla": (pt.GatedLinearAttention, pf.GatedLinearAttention,
            {"hidden_size": HIDDEN, "num_heads": HEADS, "num_kv_heads": 1,
             "use_short_conv": True, "gate_low_rank_dim": 4}),
    "mamba2": (pt.Mamba2, pf.Mamba2,
               {"hidden_size": HIDDEN, "head_dim": 8, "state_size": 4, "n_groups": 2}),
    "rwkv7": (pt.RWKV7Attention, pf.RWKV7Attention,
              {"hidden_size": HIDDEN, "head_dim": HEAD_DIM, "layer_idx": 0}),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def x64():
    """float64 JAX arrays for this module (the suite turns x64 on only with the JAX backend),
    and XLA's optimizations off as the suite has them (compiling dominates on tiny arrays)."""
    settings = {"jax_enable_x64": True, "jax_disable_most_optimizations": True}
    before = {name: jax.config.read(name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    yield
    for name, value in before.items():
        jax.config.update(name, value)


# Compiled once per layer configuration: eagerly, JAX compiles each of the block's few hundred
# operations on its first use (seconds on a busy machine); the eager path is checked once below.
prefill = nnx.jit(lambda layer, x, mask, cache: layer(x, mask, cache, return_cache=True))
step = nnx.jit(lambda layer, x_t, cache: layer.step(x_t, cache))


def make(name: str, **extra):
    """The float64 torch module, its options, and the Flax layer loaded from its state dict."""
    module_type, layer_type, options = LAYERS[name]
    options = {**options, **extra}
    torch.manual_seed(0)
    module = module_type(chunk_size=4, dtype=torch.float64, **options)
    with torch.no_grad():  # norm weights away from ones, so that a wrong one shows
        for n, p in module.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    layer = layer_type.from_torch_state_dict(module.state_dict(), chunk_size=4, **options)
    return module, options, layer


def inputs(rng, batch=2, T=11):
    return rng.standard_normal((batch, T, HIDDEN))


def assert_close(got, want, rtol=1e-10):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=rtol * scale)


def assert_caches_close(got, want):
    assert isinstance(got, BlockCache)
    assert len(got.conv_state) == len(want.conv_state)
    for mine, theirs in zip(got.conv_state, want.conv_state):
        assert_close(mine, theirs)
    # a matrix state, or a LinearAttentionState (GLA, Mamba-2)
    mine, theirs = jax.tree.leaves(got.recurrent_state), jax.tree.leaves(want.recurrent_state)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert_close(np.broadcast_to(np.asarray(a), tuple(b.shape)), b)


def to_jax(cache):
    return BlockCache(
        tuple(jnp.asarray(s.numpy()) for s in cache.conv_state),
        jnp.asarray(cache.recurrent_state.numpy()),
    )


def to_torch(cache):
    return pt.LayerCache(
        tuple(torch.from_numpy(np.array(s)) for s in cache.conv_state),
        torch.from_numpy(np.array(cache.recurrent_state)),
    )


# -- the same numbers as the torch module ----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_is_the_torch_module(name, rng):
    """A left-padded batch (NaN in the padding), its cache, then steps, against the module."""
    module, _, layer = make(name)
    x = inputs(rng)
    x[0, :3] = np.nan
    mask = np.ones(x.shape[:2], dtype=bool)
    mask[0, :3] = False
    with torch.no_grad():
        want, want_cache = module(torch.from_numpy(x), torch.from_numpy(mask), return_cache=True)
    assert layer.dtype == jnp.float64
    got, cache = prefill(layer, jnp.asarray(x), jnp.asarray(mask), None)
    assert_close(got, want)
    assert_caches_close(cache, want_cache)
    x_t = rng.standard_normal((2, HIDDEN))
    with torch.no_grad():
        want_t, want_cache = module.step(torch.from_numpy(x_t), want_cache)
    y_t, cache = step(layer, jnp.asarray(x_t), cache)
    assert_close(y_t, want_t)
    assert_caches_close(cache, want_cache)


@pytest.mark.parametrize("name", ["gdn", "kda", "gla", "mamba2"])
def test_gradients_are_torchs_by_name(name, rng):
    """``nnx.grad`` under ``nnx.jit``: the gradient of each parameter is torch's of the same
    name."""
    module, _, layer = make(name)
    x = inputs(rng, T=7)
    (module(torch.from_numpy(x)) ** 2).sum().backward()

    @nnx.jit
    def grads(layer, x):
        return nnx.grad(lambda layer: (layer(x) ** 2).sum())(layer)

    got = grads(layer, jnp.asarray(x))["params"]
    assert set(got) == {n for n, _ in module.named_parameters()}
    for n, p in module.named_parameters():
        assert_close(got[n][...], p.grad, rtol=1e-9)


def test_rwkv7_later_layer_takes_v_first_as_torchs(rng):
    """A later RWKV-7 layer (with ``v_lora``) given the first layer's values: the sequence,
    its cache, a step and the gradients (of the parameters and of ``v_first``) are torch's."""
    module, _, layer = make("rwkv7", layer_idx=1)
    x, v_first = inputs(rng, T=8), rng.standard_normal((2, 8, HIDDEN))
    with torch.no_grad():
        want, want_cache = module(
            torch.from_numpy(x[:, :7]), v_first=torch.from_numpy(v_first[:, :7]),
            return_cache=True,
        )  # fmt: skip
        want_t, _ = module.step(
            torch.from_numpy(x[:, 7]), want_cache, v_first=torch.from_numpy(v_first[:, 7])
        )
    run = nnx.jit(lambda layer, x, v: layer(x, v_first=v, return_cache=True))
    got, cache = run(layer, jnp.asarray(x[:, :7]), jnp.asarray(v_first[:, :7]))
    assert_close(got, want)
    assert_caches_close(cache, want_cache)
    one = nnx.jit(lambda layer, x_t, cache, v: layer.step(x_t, cache, v_first=v))
    y_t, _ = one(layer, jnp.asarray(x[:, 7]), cache, jnp.asarray(v_first[:, 7]))
    assert_close(y_t, want_t)
    v = torch.from_numpy(v_first).requires_grad_()
    (module(torch.from_numpy(x), v_first=v) ** 2).sum().backward()

    @nnx.jit
    def grads(layer, x, v):
        return nnx.grad(lambda layer, v: (layer(x, v_first=v) ** 2).sum(), argnums=(0, 1))(layer, v)

    g_layer, g_v = grads(layer, jnp.asarray(x), jnp.asarray(v_first))
    assert_close(g_v, v.grad, rtol=1e-9)
    for n, p in module.named_parameters():
        assert_close(g_layer["params"][n][...], p.grad, rtol=1e-9)
    with pytest.raises(TypeError, match="pass v_first"):
        layer(jnp.asarray(x))


def test_jit_of_call_and_step_are_the_whole_sequence(rng):
    """The compiled prefill and the compiled step, reused token by token, give the torch
    module's outputs of the whole sequence; the eager step gives the compiled step's (the
    docstring examples run the eager call)."""
    module, _, layer = make("gdn")
    x = inputs(rng, T=9)
    with torch.no_grad():
        whole = module(torch.from_numpy(x))
    x = jnp.asarray(x)
    y, cache = prefill(layer, x[:, :6], None, None)
    assert_close(y, whole[:, :6])
    for t in range(6, 9):
        y_t, after = step(layer, x[:, t], cache)
        assert_close(y_t, whole[:, t])
        if t == 8:
            eager_t, eager_cache = layer.step(x[:, t], cache)
            assert_close(eager_t, y_t, rtol=1e-13)
            assert_caches_close(eager_cache, after)
        cache = after


# -- caches ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_caches_cross_between_torch_and_flax(name, rng):
    """A torch prefill continued by the Flax step, and a Flax prefill continued by torch."""
    module, _, layer = make(name)
    x = inputs(rng, T=8)
    with torch.no_grad():
        whole = module(torch.from_numpy(x))
        _, torch_cache = module(torch.from_numpy(x[:, :6]), return_cache=True)
    y_t, _ = step(layer, jnp.asarray(x[:, 6]), to_jax(torch_cache))
    assert_close(y_t, whole[:, 6])
    _, flax_cache = prefill(layer, jnp.asarray(x[:, :6]), None, None)
    with torch.no_grad():
        y_t, _ = module.step(torch.from_numpy(x[:, 6]), to_torch(flax_cache))
    assert_close(y_t, whole[:, 6])
    # and a cache continues a sequence through the whole-sequence call as well
    y, _ = prefill(layer, jnp.asarray(x[:, 6:]), None, flax_cache)
    assert_close(y, whole[:, 6:])


# -- parameters ------------------------------------------------------------------------------------
def test_drawn_parameters_are_the_blocks_initializer():
    """Names and shapes of the torch module's state dict, the values of
    ``init_gated_deltanet`` for the seed; ``rngs`` draws a seed."""
    layer = pf.GatedDeltaNet(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, seed=3)
    want = init_gated_deltanet(np, hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, seed=3)
    module = pt.GatedDeltaNet(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM)
    got = layer.state_dict()
    assert {n: p.shape for n, p in got.items()} == {
        n: tuple(p.shape) for n, p in module.state_dict().items()
    }
    for n, p in got.items():
        assert p.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(p), want[n])
    a, b = (pf.GatedDeltaNet(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM,
                             rngs=nnx.Rngs(seed)) for seed in (0, 0))  # fmt: skip
    c = pf.GatedDeltaNet(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, rngs=nnx.Rngs(1))
    q = [np.asarray(m.state_dict()["q_proj.weight"]) for m in (a, b, c)]
    assert np.array_equal(q[0], q[1]) and not np.array_equal(q[0], q[2])
    f64 = pf.GatedDeltaNet(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM,
                           dtype=jnp.float64)  # fmt: skip
    assert f64.dtype == jnp.float64


@pytest.mark.parametrize("name", sorted({"gdn", "kda", "gla", "mamba2", "rwkv7"}))
def test_signature_is_the_torch_modules_plus_flax_keywords(name):
    """``inspect.signature`` (help(), the docs) shows the layer's keywords, not Flax's
    metaclass's ``*args, **kwargs``: the torch module's, then params, dtype, device, seed,
    rngs."""
    import inspect

    module_type, layer_type, _ = LAYERS[name]
    theirs = inspect.signature(module_type).parameters
    mine = inspect.signature(layer_type).parameters
    assert set(mine) - {"params", "seed", "rngs"} == set(theirs)
    for n, p in theirs.items():  # the same default, positional or keyword-only
        assert (mine[n].kind, mine[n].default) == (p.kind, p.default), n


def test_load_state_dict_and_numpy_serves_the_state_dict(rng):
    module, options, loaded = make("gdn")
    layer = pf.GatedDeltaNet(dtype=jnp.float64, chunk_size=4, **options)
    x = inputs(rng, T=5)
    layer.load_state_dict(module.state_dict())
    assert_close(prefill(layer, jnp.asarray(x), None, None)[0],
                 prefill(loaded, jnp.asarray(x), None, None)[0], rtol=0)  # fmt: skip
    weights = {n: np.asarray(p) for n, p in layer.state_dict().items()}
    served = gated_deltanet(weights, x, num_heads=HEADS)
    assert type(served) is np.ndarray
    assert_close(served, module(torch.from_numpy(x)))


def test_loading_checks_names_shapes_and_sizes():
    module, options, layer = make("gdn")
    state = {n: p.numpy() for n, p in module.state_dict().items()}
    with pytest.raises(KeyError, match=r"missing \['A_log'\], unexpected \['extra'\]"):
        layer.load_state_dict({**{n: p for n, p in state.items() if n != "A_log"}, "extra": 0})
    with pytest.raises(ValueError, match="'A_log' has shape \\(3,\\), this layer's is \\(4,\\)"):
        layer.load_state_dict({**state, "A_log": np.zeros(3)})
    with pytest.raises(ValueError, match="hidden_size=2048 does not match the parameters"):
        pf.GatedDeltaNet.from_torch_state_dict(state, num_heads=HEADS, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match=r"the parameters \['k_conv1d.extra'\] are not"):
        pf.GatedDeltaNet.from_torch_state_dict({**state, "k_conv1d.extra": np.zeros(2)}, **options)
    with pytest.raises(KeyError, match=r"params has no 'o_norm\.weight'"):
        pf.GatedDeltaNet.from_torch_state_dict(
            {n: p for n, p in state.items() if n != "o_norm.weight"}, **options
        )
    with pytest.raises(ValueError, match="use_gate=False does not match"):
        pf.GatedDeltaNet.from_torch_state_dict(state, use_gate=False, **options)
    with pytest.raises(TypeError, match="state_dict\\['A_log'\\] must be an array"):
        pf.GatedDeltaNet.from_torch_state_dict({**state, "A_log": [1.0] * 4}, **options)
    with pytest.raises(ValueError, match="safe_gate needs lower_bound"):
        pf.KimiDeltaAttention(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM,
                              safe_gate=True)  # fmt: skip


def test_inputs_are_checked_in_the_layers_terms(rng):
    _, _, layer = make("gdn")
    with pytest.raises(TypeError, match=r"x has dtype float32 but the layer's parameters"):
        layer(jnp.ones((1, 3, HIDDEN), jnp.float32))
    with pytest.raises(ValueError, match="x must have shape \\(batch, T, hidden_size\\)"):
        layer(jnp.ones((1, 3, HIDDEN + 1)))
    with pytest.raises(TypeError, match="attention_mask must be boolean"):
        layer(jnp.ones((1, 3, HIDDEN)), jnp.ones((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="cache holds 0 convolution states"):
        layer.step(jnp.ones((1, HIDDEN)), BlockCache((), jnp.zeros((1, 4, 4, 6))))


# -- the outer ring --------------------------------------------------------------------------------
def test_import_polylin_does_not_import_flax():
    code = "import sys, polylin, polylin.blocks; print('flax' in sys.modules, 'jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_without_flax_the_import_error_says_how_to_install(tmp_path):
    blocker = tmp_path / "block_flax"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class BlockFlax:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'flax' or name.startswith('flax.'):\n"
        "            raise ImportError('flax is blocked for this test')\n"
        "sys.meta_path.insert(0, BlockFlax())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", "import polylin.flax"], capture_output=True, text=True, env=env
    )
    assert done.returncode != 0
    assert "polylin.flax needs Flax: pip install 'polylin[flax]'" in done.stderr


# -- the example -----------------------------------------------------------------------------------
TINY = ["--batch", "4", "--context", "24", "--d-model", "16", "--heads", "2", "--layers", "1"]
TINY += ["--threads", "1", "--lr", "1e-2", "--seed", "0"]


def _example(name: str):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_jax_examples_flax_model_is_charlms_model(rng):
    """The Flax model of ``char_lm_jax.py`` is ``charlm``'s Gated DeltaNet model: the same
    logits (float64), whole sequences and token by token, and the same weights back."""
    charlm, char_lm_jax = _example("charlm"), _example("char_lm_jax")
    init = charlm.init_params(11, d_model=16, n_heads=2, n_layers=2, seed=1, layer="gated-deltanet")
    weights = {n: (w + 0.3 * rng.standard_normal(w.shape)) for n, w in init.items()}
    model = char_lm_jax.flax_model(weights, n_heads=2)
    tokens = rng.integers(0, 11, size=(2, 9))
    want = charlm.forward(weights, tokens, n_heads=2)
    logits, caches = nnx.jit(lambda model, t: model(t))(model, jnp.asarray(tokens[:, :6]))
    assert_close(logits, want[:, :6])
    step = nnx.jit(lambda model, token, caches: model(token, caches))
    for t in range(6, 9):
        logits, caches = step(model, jnp.asarray(tokens[:, t]), caches)
        assert_close(logits, want[:, t])
    assert {n: np.asarray(w).tolist() for n, w in model.weights().items()} == {
        n: w.tolist() for n, w in weights.items()
    }


def test_jax_example_trains_gated_deltanet_through_flax_and_numpy_serves_it(tmp_path):
    """``char_lm_jax.py --layer gated-deltanet`` trains (the loss falls) and exports the
    weights under ``charlm``'s names; its ``sample.txt`` (JAX, the Flax modules) is what
    ``generate_numpy.py`` prints from the weights in a Python where JAX, Flax and PyTorch
    cannot be imported."""
    charlm = _example("charlm")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, str(ROOT / "examples" / "char_lm_jax.py")]
    args = ["--steps", "12", "--out", str(out), "--layer", "gated-deltanet", *TINY]
    done = subprocess.run([*script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    weights, n_heads = charlm.load_weights(out / "weights.npz")
    vocab = charlm.Vocab.load(out / "vocab.json")
    init = charlm.init_params(
        len(vocab), d_model=16, n_heads=2, n_layers=1, seed=0, layer="gated-deltanet"
    )
    assert set(weights) == set(init) and n_heads == 2
    assert all(w.dtype == np.float32 for w in weights.values())
    losses = charlm.read_losses(out / "losses.csv")
    assert losses[-1] < losses[0] - 0.3  # it learns

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'torch'):\n"
        "            raise ImportError(name + ' is blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(ROOT)])
    served = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate_numpy.py"), str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    assert served.stdout == (out / "sample.txt").read_text(encoding="utf-8")
    assert len(served.stdout) == len(charlm.PROMPT) + charlm.SAMPLE_TOKENS + 1
