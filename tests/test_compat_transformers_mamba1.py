"""polylin.compat.transformers on the Mamba-1 mixers: Mamba, FalconMamba, Jamba, Zamba.

One tiny random model per family (hidden size 64, built in code, no download), run once on
transformers' own pure-PyTorch code and once converted: logits (left-padded batches
included), every parameter's gradient and greedy cached generation (transformers' caches in
their own layouts) agree, and the converted model runs with transformers' fallback functions
made to raise.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the transformers adapter needs PyTorch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the hf extra pins transformers==5.23.0)"
)

from polylin.compat.transformers import (  # noqa: E402
    LAYER_CLASSES,
)

from .transformers_models import VOCAB, converted_layers, model_pair, outputs, relative, tokens  # noqa: E402


def mamba() -> Any:
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=8, pad_token_id=0,
    )  # fmt: skip
    return transformers.MambaForCausalLM(config)


def falcon_mamba() -> Any:
    config = transformers.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=8, pad_token_id=0,
    )  # fmt: skip
    return transformers.FalconMambaForCausalLM(config)


def jamba() -> Any:
    config = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, pad_token_id=0, use_mamba_kernels=False,
    )  # fmt: skip
    return transformers.JambaForCausalLM(config)


def zamba() -> Any:
    config = transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, attention_head_dim=32, n_mamba_heads=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        attn_layer_period=3, attn_layer_offset=2, pad_token_id=0, use_mamba_kernels=False,
    )  # fmt: skip
    return transformers.ZambaForCausalLM(config)


MODELS = {"mamba": mamba, "falcon_mamba": falcon_mamba, "jamba": jamba, "zamba": zamba}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """The same random model twice: on transformers' own code, and on polylin."""
    return model_pair(MODELS[request.param])


def test_every_family_is_registered():
    families = {model for c in LAYER_CLASSES.values() for model in c.models}
    assert set(MODELS) <= families
    assert {LAYER_CLASSES[name].family for name in ("MambaMixer", "ZambaMambaMixer")} == {"Mamba-1"}


def test_layers_converted(pair):
    reference, model = pair
    assert len(converted_layers(model)) >= 2
    for ref_layer, layer in zip(converted_layers(reference), converted_layers(model), strict=True):
        assert layer.forward.__func__ is not ref_layer.forward.__func__
        assert layer.forward.__func__ is not type(layer).forward


@pytest.mark.slow_grid(cover=("pair",), prefer={"length": 37})
@pytest.mark.parametrize("length", [1, 37])
def test_logits_agree(pair, length):
    reference, model = pair
    ids = tokens(2, length)
    with torch.no_grad():
        want, got = outputs(reference, ids), outputs(model, ids)
    assert relative(got, want) <= 1e-5


def test_left_padded_batch(pair):
    """A left-padded batch (the layers get the model's padding mask and apply it as
    transformers does): the real positions agree."""
    reference, model = pair
    ids = tokens(2, 29, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = outputs(reference, ids, attention_mask=mask)
        got = outputs(model, ids, attention_mask=mask)
    real = mask.bool()
    assert torch.isfinite(want[real]).all()
    assert relative(got[real], want[real]) <= 1e-5


def test_loss_gradients_agree(pair):
    """Every parameter's gradient: within 1e-4 relative per parameter (or 1e-6 of the largest
    gradient in the model, for gradients that are round-off themselves)."""
    reference, model = pair
    ids = tokens(2, 45, seed=2)
    grads = []
    for m in (reference, model):
        m.train()
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        m.eval()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and len(want) > 5
    largest = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-2 * largest)
        assert float((got[name] - g).abs().max()) <= 1e-4 * scale, name
    layers = [n for n, m in model.named_modules() if type(m).__name__ in LAYER_CLASSES]
    assert any(n.startswith(f"{layer}.") for layer in layers for n in got)


def cached_decode(model: Any, ids: Any, steps: int) -> tuple[Any, Any]:
    """Greedy generation with the model's cache: the tokens and every step's logits."""
    out = model.generate(
        ids, max_new_tokens=steps, do_sample=False, use_cache=True, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, dim=1)


def test_greedy_generation_with_the_cache(pair):
    """The same tokens, and the logits of every decoding step within 1e-5."""
    reference, model = pair
    ids = tokens(2, 11, seed=3)
    with torch.no_grad():
        (want_ids, want), (got_ids, got) = (
            cached_decode(reference, ids, 5),
            cached_decode(model, ids, 5),
        )
    assert want_ids.shape == (2, 16) and want.shape[1] == 5
    assert torch.equal(got_ids, want_ids)
    assert relative(got, want) <= 1e-5


def raises(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("transformers' fallback was called")


def fallbacks(model: Any) -> list[Any]:
    """The kernels' pure-PyTorch code, which a converted layer must never call."""
    found = []
    for layer in converted_layers(model):
        cls = type(layer)
        module = sys.modules[cls.__module__]
        found += [inspect.unwrap(getattr(module, n)) for n in LAYER_CLASSES[cls.__name__].kernels]
    return list({id(f): f for f in found}.values())


def test_runs_with_the_fallbacks_made_to_raise(pair, monkeypatch):
    reference, model = pair
    ids = tokens(2, 21, seed=5)
    with torch.no_grad():
        want = outputs(reference, ids)
        for function in fallbacks(model):
            monkeypatch.setattr(function, "__code__", raises.__code__)
        with pytest.raises(AssertionError, match="fallback was called"):
            outputs(reference, ids)  # the patch reaches transformers' own code
        got = outputs(model, ids)
        cached_decode(model, ids, 3)
    assert relative(got, want) <= 1e-5
