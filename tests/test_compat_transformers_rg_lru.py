"""polylin.compat.transformers on RecurrentGemma's RG-LRU (``RecurrentGemmaRglru``).

A tiny random ``RecurrentGemmaForCausalLM`` (hidden size 64, 4 heads, two recurrent blocks and
one local-attention block, built in code, no download), run once on transformers' own
pure-PyTorch code (the ``_rnn_scan`` loop) and once converted: logits (a left-padded batch with
its position ids included), every parameter's gradient and greedy cached generation (every
step's logits) agree, and the converted model runs with ``_rnn_scan`` and the clipped square
root made to raise.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the transformers adapter needs PyTorch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the hf extra pins transformers==5.23.0)"
)

from polylin.compat.transformers import LAYER_CLASSES  # noqa: E402

from .transformers_models import VOCAB, converted_layers, model_pair, outputs, relative, tokens  # noqa: E402

modeling = pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")


def recurrent_gemma() -> Any:
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, lru_width=64, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, intermediate_size=96, num_hidden_layers=3,
        attention_window_size=16, conv1d_width=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return transformers.RecurrentGemmaForCausalLM(config)


def _varied_gates(model: Any) -> None:
    """Gates and decays away from their initialization: some channels with a near 1, some
    that forget within a token."""
    for layer in converted_layers(model):
        layer.recurrent_param.copy_(3.0 * torch.randn(layer.recurrent_param.shape))
        layer.input_gate_bias.copy_(torch.randn(layer.input_gate_bias.shape))
        layer.recurrent_gate_bias.copy_(torch.randn(layer.recurrent_gate_bias.shape))


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    """The same random model twice: on transformers' own code, and on polylin."""
    return model_pair(recurrent_gemma, _varied_gates)


def test_registered():
    conversion = LAYER_CLASSES["RecurrentGemmaRglru"]
    assert conversion.family == "RG-LRU" and conversion.models == ("recurrent_gemma",)


def test_layers_converted(pair):
    reference, model = pair
    assert len(converted_layers(model)) == 2
    for ref_layer, layer in zip(converted_layers(reference), converted_layers(model), strict=True):
        assert layer.forward.__func__ is not ref_layer.forward.__func__
        assert layer.forward.__func__ is not type(layer).forward


@pytest.mark.parametrize("length", [1, 37])
def test_logits_agree(pair, length):
    reference, model = pair
    ids = tokens(2, length)
    with torch.no_grad():
        want, got = outputs(reference, ids), outputs(model, ids)
    assert relative(got, want) <= 1e-5


def test_left_padded_batch(pair):
    """A left-padded batch with the position ids that ``generate`` makes from the mask (the
    RG-LRU resets its state at position 0, the first real token): the real positions agree."""
    reference, model = pair
    ids = tokens(2, 29, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        want = outputs(reference, ids, attention_mask=mask, position_ids=position_ids)
        got = outputs(model, ids, attention_mask=mask, position_ids=position_ids)
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
        m(ids, labels=ids, use_cache=False).loss.backward()
        m.eval()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and len(want) > 5
    largest = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-2 * largest)
        assert float((got[name] - g).abs().max()) <= 1e-4 * scale, name
    assert any("rg_lru.recurrent_param" in n for n in got)


def cached_decode(model: Any, ids: Any, steps: int, **options: Any) -> tuple[Any, Any]:
    """Greedy generation with the model's cache: the tokens and every step's logits."""
    out = model.generate(
        ids, max_new_tokens=steps, do_sample=False, use_cache=True, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True, **options,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, dim=1)


def test_greedy_generation_with_the_cache(pair):
    """The same tokens, and the logits of every decoding step within 1e-5."""
    reference, model = pair
    ids = tokens(2, 11, seed=3)
    with torch.no_grad():
        (want_ids, want), (got_ids, got) = (
            cached_decode(reference, ids, 6),
            cached_decode(model, ids, 6),
        )
    assert want_ids.shape == (2, 17) and want.shape[1] == 6
    assert torch.equal(got_ids, want_ids)
    assert relative(got, want) <= 1e-5


def raises(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("transformers' fallback was called")


def test_runs_with_the_fallbacks_made_to_raise(pair, monkeypatch):
    reference, model = pair
    ids = tokens(2, 21, seed=5)
    with torch.no_grad():
        want = outputs(reference, ids)
        monkeypatch.setattr(modeling.RecurrentGemmaRglru, "_rnn_scan", raises)
        monkeypatch.setattr(modeling.SqrtBoundDerivative, "forward", staticmethod(raises))
        with pytest.raises(AssertionError, match="fallback was called"):
            outputs(reference, ids)  # the patch reaches transformers' own code
        got = outputs(model, ids)
        cached_decode(model, ids, 3)
    assert relative(got, want) <= 1e-5


def test_undo(pair):
    reference, model = pair
    ids = tokens(2, 16, seed=6)
    with torch.no_grad():
        want = outputs(reference, ids)
        for layer in converted_layers(model):
            del layer.forward
        try:
            got = outputs(model, ids)
        finally:
            forward = LAYER_CLASSES["RecurrentGemmaRglru"].polylin
            for layer in converted_layers(model):
                layer.forward = forward(type(layer)).__get__(layer)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bfloat16_model(pair):
    """A bfloat16 model (the state stays float32, as transformers keeps it): the converted
    model's logits are as close to the float32 model's as transformers' own bfloat16 code is
    (within 2x of its error), and cached generation runs."""
    reference, model = pair
    ids = tokens(2, 30, seed=7)
    half_ours = copy.deepcopy(model).to(torch.bfloat16)
    half_theirs = copy.deepcopy(reference).to(torch.bfloat16)
    for layer in converted_layers(half_ours):  # the copy is still converted
        assert layer.forward.__func__ is not type(layer).forward
    with torch.no_grad():
        want = outputs(reference, ids)
        ours = outputs(half_ours, ids).float()
        theirs = outputs(half_theirs, ids).float()
        generated = half_ours.generate(ids[:, :10], max_new_tokens=4, do_sample=False,
                                       pad_token_id=0)  # fmt: skip
    assert torch.isfinite(ours).all() and generated.shape == (2, 14)
    assert relative(ours, want) <= 2 * relative(theirs, want)
