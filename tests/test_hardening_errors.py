"""Errors that name the real problem (issue 40, Hardening III, items 7-9).

- A cache from another ``polylin.torch`` layer (another class, or other sizes) is a
  ``ValueError`` naming the layer that made it and this layer, not a shape error from the
  short convolution; a cache still unpacks, compares, prints and pickles as before.
- A channels-first input to the short convolution, ``(batch, channels, T)`` as
  ``nn.Conv1d`` takes it, says so and how to pass it, instead of blaming the weight; a
  channels-first state (the causal-conv1d package's layout) likewise.
- A traced flag under ``jax.jit`` says how to keep it static (``static_argnames``,
  ``functools.partial``), as a traced ``chunk_size`` does, from every entry point's flags.
"""

from __future__ import annotations

import functools
import itertools
import pickle

import numpy as np
import pytest

import polylin
from polylin.compat import fla

# --- item 9: a traced flag under jax.jit --------------------------------------------------------


def _traced_flag_error(jax, function, flag):
    """The TypeError of ``function(flag)`` under ``jax.jit`` with ``flag`` traced."""
    with pytest.raises(TypeError) as info:
        jax.jit(function)(jax.numpy.asarray(flag))
    return str(info.value)


@pytest.mark.eager
@pytest.mark.parametrize(
    ("entry", "flag"),
    [
        ("delta_rule_attention", "qk_l2norm"),
        ("delta_rule_attention", "return_state"),
        ("delta_rule_step", "qk_l2norm"),
        ("prepare_delta_rule_step", "qk_l2norm"),
        ("causal_linear_attention", "normalize"),
        ("causal_linear_attention", "return_state"),
        ("causal_conv1d", "return_state"),
        ("fla.chunk_gated_delta_rule", "use_qk_l2norm_in_kernel"),
        ("fla.chunk_gated_delta_rule", "output_final_state"),
        ("fla.chunk_linear_attn", "normalize"),
        ("fla.fused_recurrent_gla", "output_final_state"),
        ("fla.chunk_dplr_delta_rule", "output_final_state"),
        ("favor_plus", "orthogonal"),
    ],
)
def test_a_traced_flag_says_how_to_keep_it_static(entry, flag, rng) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q = jnp.asarray(rng.standard_normal((1, 2, 6, 4)))
    beta = jnp.full((1, 2, 6, 1), 0.5)
    token = (q[..., 0, :], q[..., 0, :], q[..., 0, :], beta[..., 0, :])
    fq = jnp.asarray(rng.standard_normal((1, 6, 2, 4)))  # fla's (B, T, H, d)
    g = -jnp.ones((1, 6, 2))
    gk = -jnp.ones((1, 6, 2, 4))
    calls = {
        "delta_rule_attention": lambda f: polylin.delta_rule_attention(q, q, q, beta, **f),
        "delta_rule_step": lambda f: polylin.delta_rule_step(*token, None, **f),
        "prepare_delta_rule_step": lambda f: polylin.prepare_delta_rule_step(**f)(*token, None),
        "causal_linear_attention": lambda f: polylin.causal_linear_attention(q, q, q, **f),
        "causal_conv1d": lambda f: polylin.causal_conv1d(q, jnp.ones((4, 3)), **f),
        "fla.chunk_gated_delta_rule": lambda f: fla.chunk_gated_delta_rule(
            fq, fq, fq, g, jnp.full((1, 6, 2), 0.5), **f
        ),
        "fla.chunk_linear_attn": lambda f: fla.chunk_linear_attn(fq, fq, fq, **f),
        "fla.fused_recurrent_gla": lambda f: fla.fused_recurrent_gla(fq, fq, fq, gk, **f),
        "fla.chunk_dplr_delta_rule": lambda f: fla.chunk_dplr_delta_rule(
            fq, fq, fq, fq, fq, gk, **f
        ),
        "favor_plus": lambda f: polylin.feature_maps.favor_plus(4, **f)(q),
    }
    message = _traced_flag_error(jax, lambda value: calls[entry]({flag: value}), True)
    assert message.startswith(f"{flag} must be static under jax.jit, got a traced value")
    assert f"static_argnames=({flag!r},)" in message
    assert "functools.partial" in message
    # and the hint works: the flag static, the call runs
    jitted = jax.jit(lambda value, static: calls[entry]({flag: static}), static_argnums=1)
    jitted(0.0, True)
    jax.jit(functools.partial(lambda value, static: calls[entry]({flag: static}), static=True))(0.0)


def test_a_flag_that_is_not_a_bool_keeps_its_message() -> None:
    q = np.zeros((1, 4, 3))
    with pytest.raises(TypeError, match=r"^qk_l2norm must be True or False, got int$"):
        polylin.delta_rule_attention(q, q, q, 0.5, qk_l2norm=1)
    with pytest.raises(TypeError, match=r"^normalize must be True or False, got str$"):
        polylin.causal_linear_attention(q, q, q, normalize="yes")


# --- item 8: a channels-first input to the short convolution ----------------------------------


def test_a_channels_first_input_says_so(backend, rng) -> None:
    """``(batch, channels, T)`` against a ``(channels, width)`` weight: the message blames the
    input's layout, in the caller's terms, and the fix it names works."""
    x = rng.standard_normal((2, 8, 20))  # channels first: 8 channels, T = 20
    w = backend.from_numpy(rng.standard_normal((8, 4)))
    with pytest.raises(ValueError) as info:
        polylin.causal_conv1d(backend.from_numpy(x), w)
    message = str(info.value)
    assert message.startswith("x looks channels-first: it has shape (2, 8, 20), whose axis -2")
    assert "the 8 channels of weight (8, 4)" in message
    assert "(..., T, channels): pass x.mT" in message
    assert "output's .mT back" in message
    assert message.endswith(
        "(if x is (..., T, channels) already, the weight is wrong: it must have shape "
        "(channels, width) = (20, width))"
    )
    want = polylin.causal_conv1d(backend.from_numpy(np.swapaxes(x, -1, -2)), w)
    assert want.shape == (2, 20, 8)


def test_a_channels_first_token_or_state_says_so(backend, rng) -> None:
    w = backend.from_numpy(rng.standard_normal((8, 4)))
    token = backend.from_numpy(rng.standard_normal((2, 8, 1)))  # (batch, channels, 1)
    with pytest.raises(ValueError, match=r"^x_t looks channels-first: it has shape \(2, 8, 1\)"):
        polylin.causal_conv1d_step(token, w)
    with pytest.raises(ValueError, match=r"causal_conv1d_step takes .*: pass x_t\[\.\.\., 0\] "):
        polylin.causal_conv1d_step(token, w)
    with pytest.raises(ValueError, match=r"^x_t looks channels-first: .*pass x_t\.mT"):
        polylin.causal_conv1d_step(backend.from_numpy(rng.standard_normal((8, 2))), w)
    state = backend.from_numpy(np.zeros((2, 8, 3)))  # causal-conv1d's (batch, channels, w - 1)
    x = backend.from_numpy(rng.standard_normal((2, 5, 8)))
    pattern = (
        r"^state looks channels-first: it has shape \(2, 8, 3\), and the state is "
        r"\(\.\.\., width - 1, channels\) = \(2, 3, 8\) .*pass state\.mT$"
    )
    with pytest.raises(ValueError, match=pattern):
        polylin.causal_conv1d(x, w, state=state)
    with pytest.raises(ValueError, match=pattern):
        polylin.causal_conv1d_step(x[:, 0, ...], w, state=state)


def test_a_wrong_weight_keeps_its_message(backend, rng) -> None:
    """A weight whose channels match no axis of the input (or an input whose channels are
    already last) is still the weight's error."""
    x = backend.from_numpy(rng.standard_normal((2, 20, 8)))
    for weight, channels in [((7, 4), 8), ((8, 4, 1), 8), ((4,), 8)]:
        pattern = rf"^weight must have shape \(channels, width\) = \({channels}, width\), got"
        with pytest.raises(ValueError, match=pattern):
            polylin.causal_conv1d(x, backend.from_numpy(np.ones(weight)))
    with pytest.raises(ValueError, match=r"^weight must have shape .* = \(8, width\)"):
        polylin.causal_conv1d_step(x[:, 0, ...], backend.from_numpy(np.ones((5, 4))))
    with pytest.raises(ValueError, match=r"^state must have shape \(\.\.\., width - 1, channels\)"):
        polylin.causal_conv1d(x, backend.from_numpy(np.ones((8, 4))), state=x[:, :2, ...])


# --- item 7: a cache from another layer ---------------------------------------------------------

HIDDEN = 32
LAYER_NAMES = (
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "GatedLinearAttention",
    "Mamba2",
    "LinearAttention",
)


def _layers():
    """One of each polylin.torch layer, by class name (imported here: torch is optional)."""
    torch_layers = pytest.importorskip("polylin.torch")
    return {
        "GatedDeltaNet": lambda **o: torch_layers.GatedDeltaNet(
            hidden_size=HIDDEN, num_heads=2, head_dim=o.get("head_dim", 8)
        ),
        "KimiDeltaAttention": lambda **o: torch_layers.KimiDeltaAttention(
            hidden_size=HIDDEN, num_heads=2, head_dim=o.get("head_dim", 8)
        ),
        "GatedLinearAttention": lambda **o: torch_layers.GatedLinearAttention(
            hidden_size=HIDDEN, num_heads=o.get("num_heads", 2), use_short_conv=True
        ),
        "Mamba2": lambda **o: torch_layers.Mamba2(
            hidden_size=HIDDEN, head_dim=8, state_size=o.get("state_size", 4)
        ),
        "LinearAttention": lambda **o: torch_layers.LinearAttention(HIDDEN, o.get("num_heads", 2)),
    }


def _cache(layer, x):
    """What ``layer`` hands back to continue ``x``: a LayerCache, or LinearAttention's state."""
    if type(layer).__name__ == "LinearAttention":
        return layer(x, return_state=True)[1]
    return layer(x, return_cache=True)[1]


def _continue(layer, x, cache):
    """``layer`` continuing from ``cache``: forward over ``x``, then one step."""
    if type(layer).__name__ == "LinearAttention":
        layer(x, state=cache)
        return layer.step(x[:, 0], cache)
    layer(x, cache=cache)
    return layer.step(x[:, 0], cache)


@pytest.mark.parametrize(("made", "given"), list(itertools.permutations(LAYER_NAMES, 2)))
def test_a_cache_from_another_layer_type_names_both(made, given) -> None:
    torch = pytest.importorskip("torch")
    layers = _layers()
    x = torch.randn(2, 3, HIDDEN)
    foreign = _cache(layers[made](), x)
    layer = layers[given]()
    argument = "state" if given == "LinearAttention" else "cache"
    for call in (lambda: layer(x, **{argument: foreign}), lambda: layer.step(x[:, 0], foreign)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"{argument} is another layer's cache: ")
        assert f"{made}" in message, message  # the layer that made it
        assert f"this layer is {given}(" in message, message  # and this one, with its sizes
        assert "pass the " in message and "returned" in message
    _continue(layer, x, _cache(layer, x))  # its own cache still works


def test_the_issue_example_a_kda_cache_into_gated_deltanet() -> None:
    """The issue's report: KDA's cache (conv states of 64 channels for v) in a Gated DeltaNet
    (32 channels) was a shape error from polylin/convolution.py."""
    torch = pytest.importorskip("torch")
    from polylin.torch import GatedDeltaNet, KimiDeltaAttention

    x = torch.randn(2, 3, HIDDEN)
    kda = KimiDeltaAttention(hidden_size=HIDDEN, num_heads=2, head_dim=16)
    gdn = GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=8)
    _, cache = kda(x, return_cache=True)
    pattern = (
        r"^cache is another layer's cache: it was made by KimiDeltaAttention\(num_heads=2, "
        r"num_v_heads=2, head_dim=16, head_v_dim=16, use_short_conv=True, conv_size=4\), and "
        r"this layer is GatedDeltaNet\(num_heads=2, num_v_heads=2, head_dim=8, head_v_dim=16, "
        r"use_short_conv=True, conv_size=4\); pass the cache that this layer's "
        r"forward\(\.\.\., return_cache=True\) or step returned$"
    )
    with pytest.raises(ValueError, match=pattern):
        gdn.step(x[:, 0], cache)
    with pytest.raises(ValueError, match=pattern):
        gdn(x, cache=cache)


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("GatedDeltaNet", {"head_dim": 4}),
        ("KimiDeltaAttention", {"head_dim": 4}),
        ("GatedLinearAttention", {"num_heads": 4}),
        ("Mamba2", {"state_size": 8}),
    ],
)
def test_a_cache_from_a_layer_of_other_sizes_names_both(name, other) -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, HIDDEN)
    layers = _layers()
    _, cache = layers[name](**other)(x, return_cache=True)
    layer = layers[name]()
    with pytest.raises(ValueError) as info:
        layer.step(x[:, 0], cache)
    message = str(info.value)
    made_by, this = message.split("it was made by ")[1].split(", and this layer is ")
    assert made_by.startswith(f"{name}(") and this.startswith(f"{name}(")
    key, value = next(iter(other.items()))
    assert f"{key}={value}" in made_by and f"{key}={value}" not in this


def test_a_cache_built_by_hand_with_other_channels_names_the_convolution() -> None:
    """A LayerCache built by hand says nothing of its maker: its conv states' shapes are
    checked against this layer's convolutions, before polylin.causal_conv1d sees them."""
    torch = pytest.importorskip("torch")
    from polylin.torch import GatedDeltaNet, LayerCache

    layer = GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=8)
    x = torch.randn(2, 3, HIDDEN)
    _, cache = layer(x, return_cache=True)
    wrong = (cache.conv_state[0], cache.conv_state[1], torch.zeros(2, 3, 64))
    pattern = (
        r"^cache\.conv_state\[2\] must have shape \(batch, width - 1, channels\) = "
        r"\(2, 3, 32\) for GatedDeltaNet\(num_heads=2, .*\), got \(2, 3, 64\) "
        r"\(is it another layer's cache\?\)$"
    )
    with pytest.raises(ValueError, match=pattern):
        layer.step(x[:, 0], LayerCache(wrong, cache.recurrent_state))
    # built by hand with the right shapes, it continues the sequence
    y, _ = layer.step(x[:, 0], LayerCache(cache.conv_state, cache.recurrent_state))
    want, _ = layer.step(x[:, 0], cache)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_a_cache_keeps_its_tuple_behaviour_and_its_maker() -> None:
    torch = pytest.importorskip("torch")
    from polylin.torch import GatedDeltaNet, LayerCache

    layer = GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=8)
    x = torch.randn(2, 3, HIDDEN)
    _, cache = layer(x, return_cache=True)
    conv_state, recurrent_state = cache  # two fields, as before
    assert len(cache) == 2 and LayerCache._fields == ("conv_state", "recurrent_state")
    assert cache == (conv_state, recurrent_state) and isinstance(cache, tuple)
    assert repr(cache).startswith("LayerCache(conv_state=(tensor(")
    assert cache.made_by.startswith("GatedDeltaNet(num_heads=2, num_v_heads=2, head_dim=8,")
    _, stepped = layer.step(x[:, 0], cache)
    assert stepped.made_by == cache.made_by
    restored = pickle.loads(pickle.dumps(cache))
    assert type(restored) is LayerCache and restored.made_by == cache.made_by
    assert LayerCache(conv_state, recurrent_state).made_by is None
