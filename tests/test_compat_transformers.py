"""polylin.compat.transformers on transformers' own model code: tiny random models, no download.

Each model is built from transformers' config class (hidden size 64, four layers, linear- and
full-attention layers mixed as the config mixes them), run once on transformers' pure-PyTorch
fallback kernels and once on polylin: logits, loss gradients and cached greedy generation agree.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the transformers adapter needs PyTorch")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the hf extra pins transformers==5.23.0)"
)

from polylin.compat.transformers import (  # noqa: E402
    LAYER_CLASSES,
    use_polylin,
    use_transformers_fallback,
)

from .transformers_models import VOCAB, relative, tokens  # noqa: E402


def qwen3_next() -> Any:
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,  # grouped value heads
        linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    return transformers.Qwen3NextForCausalLM(config)


def qwen3_5() -> Any:
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8,
    )  # fmt: skip
    return transformers.Qwen3_5ForCausalLM(config)


def kimi_linear() -> Any:
    config = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, linear_head_dim=16, linear_num_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.KimiLinearForCausalLM(config)


MODELS = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "kimi_linear": kimi_linear}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """The same random model twice: on transformers' fallback, and on polylin."""
    torch.manual_seed(0)
    reference = MODELS[request.param]().float().eval()
    polylin_model = copy.deepcopy(reference)
    layer_types = reference.config.layer_types
    assert "full_attention" in layer_types and "linear_attention" in layer_types
    return use_transformers_fallback(reference), use_polylin(polylin_model)


def test_layers_converted(pair):
    _, model = pair
    layers = [m for m in model.modules() if type(m).__name__ in LAYER_CLASSES]
    assert layers and all("forward" in vars(m) for m in layers)
    assert all(
        m.forward.__func__ is not type(m).forward
        for m in model.modules()
        if type(m).__name__ in LAYER_CLASSES
    )


@pytest.mark.slow_grid(cover=("pair",), prefer={"length": 37})
@pytest.mark.parametrize("length", [1, 37, 130])
def test_logits_agree(pair, length):
    reference, model = pair
    ids = tokens(2, length)
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert relative(got, want) <= 1e-5


def test_loss_gradients_agree(pair):
    """Every parameter's gradient, float32 both ways (transformers' fallback computes in float32
    whatever the model dtype): within 1e-4 relative, or 1e-6 of the largest gradient in the
    model for gradients that are round-off themselves (a sum of terms far larger than it)."""
    reference, model = pair
    ids = tokens(2, 70, seed=2)
    grads = []
    for m in (reference, model):
        m.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and len(want) > 10
    largest = max(float(g.abs().max()) for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6 * largest, msg=name)
    # the gate and learning-rate parameters of the linear-attention layers get gradients
    assert any("A_log" in name for name in got)


def test_greedy_generation_with_the_cache(pair):
    reference, model = pair
    ids = tokens(2, 19, seed=3)
    options = {"max_new_tokens": 12, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    with torch.no_grad():
        want = reference.generate(ids, **options)
        got = model.generate(ids, **options)
    assert want.shape == (2, 31)
    assert torch.equal(got, want)


def test_only_the_given_model_changes():
    torch.manual_seed(0)
    model = qwen3_next()
    other = copy.deepcopy(model)
    use_polylin(model)
    layers = [m for m in other.modules() if type(m).__name__ in LAYER_CLASSES]
    assert layers and not any("forward" in vars(m) for m in layers)
    converted = next(m for m in model.modules() if type(m).__name__ in LAYER_CLASSES)
    del converted.forward  # undoes it
    assert "forward" not in vars(converted)


def test_a_model_without_such_layers_is_an_error():
    with pytest.raises(ValueError, match="no layer polylin can run"):
        use_polylin(torch.nn.Linear(2, 2))



def _kernel() -> str:
    return "original"


def _forward() -> str:
    return _kernel()


def test_a_rebound_forward_can_be_rebound_again():
    """Rebinding composes: a forward already rebound to polylin's kernels, rebound again (as the
    benchmarks do with their no-time stand-ins), calls the new kernels, for plain and decorated
    functions alike."""
    from polylin.compat.transformers._rebind import rebind

    def decorator(func):
        def wrapper():
            return func()

        wrapper.__wrapped__ = func
        return wrapper

    for func in (_forward, decorator(_forward)):
        once = rebind(func, {"_kernel": lambda: "once"})
        twice = rebind(once, {"_kernel": lambda: "twice"})
        assert (func(), once(), twice()) == ("original", "once", "twice")
