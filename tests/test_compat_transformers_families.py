"""polylin.compat.transformers on the other families of transformers 5.23: tiny random models.

One model per family (hidden size 64, linear-recurrence layers mixed with attention layers as
the config mixes them), built in code (no download), run once on transformers' own
pure-PyTorch code and once converted: logits (left-padded batches included), every parameter's
gradient and greedy cached generation agree, and the converted model runs with transformers'
fallback functions (its kernels, MiniMax's inline forward) made to raise.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the transformers adapter needs PyTorch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the hf extra pins transformers==5.23.0)"
)

from polylin.compat.transformers import (  # noqa: E402
    LAYER_CLASSES,
    use_polylin,
)

from .transformers_models import VOCAB, converted_layers, model_pair, outputs, relative, tokens  # noqa: E402

HYBRID = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
CONV = ["conv", "conv", "full_attention", "conv"]


def lfm2() -> Any:
    config = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=CONV, conv_bias=True,
    )  # fmt: skip
    return transformers.Lfm2ForCausalLM(config)


def lfm2_moe() -> Any:
    config = transformers.Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1,
        num_experts=4, num_experts_per_tok=2, layer_types=CONV,
    )  # fmt: skip
    return transformers.Lfm2MoeForCausalLM(config)


def lfm3() -> Any:
    config = transformers.Lfm3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        layer_types=CONV, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Lfm3ForCausalLM(config)


def inkling() -> Any:
    config = transformers.InklingTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
        swa_head_dim=16, sliding_window_size=16, d_rel=4, rel_extent=32, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.InklingForCausalLM(config)


def inkling2() -> Any:
    config = transformers.Inkling2TextConfig(
        vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=16, d_rel=4,
        rel_extent=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        pad_token_id=0, eos_token_id=2, n_layers_per_attn_res_block=1,
    )  # fmt: skip
    return transformers.Inkling2ForCausalLM(config)


def minimax() -> Any:
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, block_size=16, layer_types=HYBRID,  # several blocks per prompt
    )  # fmt: skip
    return transformers.MiniMaxForCausalLM(config)


def olmo_hybrid() -> Any:
    config = transformers.OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_allow_neg_eigval=True,  # beta in (0, 2)
        pad_token_id=0, eos_token_id=2, layer_types=HYBRID,
    )  # fmt: skip
    return transformers.OlmoHybridForCausalLM(config)


def qwen4_exp() -> Any:
    config = transformers.Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, hc_count=2,
        hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=8, indexer_compress_ratio=4, layer_types=HYBRID,
    )  # fmt: skip
    return transformers.Qwen4ExpForCausalLM(config)


def bailing_hybrid() -> Any:
    config = transformers.BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, head_dim=16, n_group=1,
        topk_group=1, num_experts_per_tok=2, num_local_experts=4, first_k_dense_replace=1,
        layer_group_size=4, pad_token_id=0, eos_token_id=2, num_mtp_layers=0,
    )  # fmt: skip
    return transformers.BailingHybridForCausalLM(config)


def glm5_next() -> Any:
    """GLM5-next is a vision-language model in transformers: a tiny vision tower beside it, and
    its special tokens outside the vocabulary the tests draw from."""
    text = transformers.Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_kpool=4, index_head_dim=16,
        index_n_heads=2, linear_head_dim=16, linear_num_heads=4, hc_mult=2, pad_token_id=0,
        layer_types=HYBRID,
    )  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
              "out_hidden_size": 64, "projection_intermediate_size": 32}  # fmt: skip
    special = dict(zip(SPECIAL, range(VOCAB, VOCAB + len(SPECIAL)), strict=True))
    config = transformers.Glm5NextConfig(
        text_config=text.to_dict(), vision_config=vision, **special
    )
    return transformers.Glm5NextForConditionalGeneration(config)


SPECIAL = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
           "video_start_token_id", "video_end_token_id")  # fmt: skip


MODELS: dict[str, Callable[[], Any]] = {
    f.__name__: f
    for f in (lfm2, lfm2_moe, lfm3, inkling, inkling2, minimax, olmo_hybrid, qwen4_exp,
              bailing_hybrid, glm5_next)
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """The same random model twice: on transformers' own code, and on polylin."""
    return model_pair(MODELS[request.param])


def test_every_family_is_registered():
    families = {model for c in LAYER_CLASSES.values() for model in c.models}
    assert set(MODELS) <= families


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
    """A left-padded batch (the layers get the model's padding mask): the real positions agree."""
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
    """Every parameter's gradient (float32 both ways; transformers' delta-rule fallbacks
    compute in float32 whatever the model dtype): within 1e-4 relative, as the logits are
    compared (the largest difference over the largest entry, per parameter), or 1e-6 of the
    largest gradient in the model for gradients that are round-off themselves (the first
    layer's gates: 1e-7, sums of far larger terms)."""
    reference, model = pair
    ids = tokens(2, 45, seed=2)
    grads = []
    for m in (reference, model):
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and len(want) > 10
    largest = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-2 * largest)
        assert float((got[name] - g).abs().max()) <= 1e-4 * scale, name
    # the converted layers' own parameters get gradients
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
    """The same tokens, and the logits of every decoding step within 1e-5 (tokens alone would
    let a wrong state through: a tiny random model's argmax rarely moves)."""
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
    """The functions a converted layer must never call: the kernels' pure-PyTorch code, or
    the class's own forward for layers given one of their own."""
    found = []
    for layer in converted_layers(model):
        cls = type(layer)
        conversion = LAYER_CLASSES[cls.__name__]
        module = sys.modules[cls.__module__]
        found += [inspect.unwrap(getattr(module, name)) for name in conversion.kernels]
        if not conversion.kernels:
            found.append(inspect.unwrap(cls.forward))
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


def test_only_the_given_model_changes():
    torch.manual_seed(0)
    model = minimax()
    other = copy.deepcopy(model)
    use_polylin(model)
    assert not any("forward" in vars(m) for m in converted_layers(other))
    converted = converted_layers(model)[0]
    del converted.forward  # undoes it
    assert "forward" not in vars(converted)
    assert converted.forward.__func__ is type(converted).forward
