"""polylin.compat.transformers on transformers' Mamba-2 (SSD) families: tiny random models.

Mamba2, Bamba, GraniteMoeHybrid (Granite 4), FalconH1, NemotronH and Zamba2, each built from its
config class (hidden size 64, 8 SSD heads of 16 in 2 groups, state 16, SSM layers mixed with
attention layers as the config mixes them), run once on transformers' pure-PyTorch fallback
kernels and once on polylin: logits (a left-padded batch included), loss gradients, a prefill
continued from the cache, and cached greedy generation agree; the converted model runs with the
fallback kernels made to raise; padding cannot reach a real output.
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
from polylin.compat.transformers._mamba2 import KERNELS  # noqa: E402

from .transformers_models import VOCAB, relative, tokens  # noqa: E402

#: The SSD sizes every family shares: 8 heads of 16 (expand 2 of hidden 64), 2 groups of B and
#: C of state size 16; transformers' own chunk of 16, so its scan crosses chunks.
SSD = {"heads": 8, "head_dim": 16, "groups": 2, "state": 16, "chunk": 16}


def mamba2() -> Any:
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_heads=SSD["heads"], head_dim=SSD["head_dim"],
        state_size=SSD["state"], n_groups=SSD["groups"], expand=2, num_hidden_layers=2,
        chunk_size=SSD["chunk"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.Mamba2ForCausalLM(config)


def _hybrid_mamba() -> dict[str, Any]:
    """The ``mamba_*`` options of Bamba, GraniteMoeHybrid and FalconH1."""
    return {
        "mamba_n_heads": SSD["heads"], "mamba_d_head": SSD["head_dim"],
        "mamba_n_groups": SSD["groups"], "mamba_d_state": SSD["state"],
        "mamba_chunk_size": SSD["chunk"],
    }  # fmt: skip


def bamba() -> Any:
    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], **_hybrid_mamba(),
    )  # fmt: skip
    return transformers.BambaForCausalLM(config)


def granitemoehybrid() -> Any:
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32, **_hybrid_mamba(),
    )  # fmt: skip
    return transformers.GraniteMoeHybridForCausalLM(config)


def falcon_h1() -> Any:
    """FalconH1 with its muP multipliers away from 1 and the gated norm after the gate's
    product (``mamba_norm_before_gate``), which the other families do not have."""
    config = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_rms_norm=True,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], ssm_in_multiplier=1.3, **_hybrid_mamba(),
    )  # fmt: skip
    return transformers.FalconH1ForCausalLM(config)


def nemotron_h() -> Any:
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        layers_block_type=["mamba", "attention", "mlp", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_num_heads=SSD["heads"],
        mamba_head_dim=SSD["head_dim"], n_groups=SSD["groups"], ssm_state_size=SSD["state"],
        chunk_size=SSD["chunk"],
    )  # fmt: skip
    return transformers.NemotronHForCausalLM(config)


def zamba2() -> Any:
    config = transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=SSD["state"],
        mamba_ngroups=SSD["groups"], n_mamba_heads=SSD["heads"], mamba_headdim=SSD["head_dim"],
        num_attention_heads=4, intermediate_size=96, chunk_size=SSD["chunk"],
    )  # fmt: skip
    return transformers.Zamba2ForCausalLM(config)


MODELS = {
    "mamba2": mamba2, "bamba": bamba, "granitemoehybrid": granitemoehybrid,
    "falcon_h1": falcon_h1, "nemotron_h": nemotron_h, "zamba2": zamba2,
}  # fmt: skip


def mixers(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__ in LAYER_CLASSES]


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """The same random model twice: on transformers' fallback, and on polylin."""
    torch.manual_seed(0)
    reference = MODELS[request.param]().float().eval()
    with torch.no_grad():  # A_log, D and dt_bias away from their initial values
        for layer in mixers(reference):
            for p in (layer.A_log, layer.D, layer.dt_bias):
                p.add_(0.3 * torch.randn_like(p))
    polylin_model = copy.deepcopy(reference)
    return use_transformers_fallback(reference), use_polylin(polylin_model)


def left_padding(ids: Any, pads: tuple[int, ...]) -> Any:
    mask = torch.ones_like(ids)
    for row, count in enumerate(pads):
        mask[row, :count] = 0
    return mask


def test_every_family_is_registered():
    names = {"Mamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer",
             "NemotronHMamba2Mixer", "Zamba2MambaMixer"}  # fmt: skip
    assert names <= set(LAYER_CLASSES)
    assert {LAYER_CLASSES[n].family for n in names} == {"Mamba-2"}
    models = {m for n in names for m in LAYER_CLASSES[n].models}
    assert models == set(MODELS)
    for name in names:  # each class exists in transformers under its model's module
        (model,) = LAYER_CLASSES[name].models
        module = __import__(f"transformers.models.{model}.modeling_{model}", fromlist=["_"])
        assert isinstance(getattr(module, name), type)


def test_layers_converted(pair):
    reference, model = pair
    layers = mixers(model)
    assert len(layers) >= 2 and all("forward" in vars(m) for m in layers)
    assert all(m.forward.__func__ is not type(m).forward for m in layers)
    assert all(
        m.forward.__func__ is not r.forward.__func__ for m, r in zip(layers, mixers(reference))
    )


@pytest.mark.parametrize("length", [1, 37])
def test_logits_agree(pair, length):
    reference, model = pair
    ids = tokens(2, length)
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert relative(got, want) <= 1e-5


def test_padded_batch_logits_agree(pair):
    """A left-padded batch (transformers' padding for generation), every position."""
    reference, model = pair
    ids = tokens(3, 29, seed=4)
    mask = left_padding(ids, (0, 5, 20))
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    assert relative(got, want) <= 1e-5


def test_prefill_continued_from_the_cache(pair):
    """A second multi-token call on the first one's cache: the convolution and SSM states
    read from and written to transformers' cache."""
    reference, model = pair
    ids = tokens(2, 33, seed=5)
    mamba = type(model).__name__.startswith("Mamba2")
    results = []
    # transformers both ways, polylin both ways, and a cache of transformers' continued by polylin
    for first_model, second_model in ((reference, reference), (model, model), (reference, model)):
        with torch.no_grad():
            first = first_model(ids[:, :20], use_cache=True)
            cache = first.cache_params if mamba else first.past_key_values
            given = {"cache_params": cache} if mamba else {"past_key_values": cache}
            results.append(second_model(ids[:, 20:], use_cache=True, **given).logits)
    want, *got = results
    for logits in got:
        assert relative(logits, want) <= 1e-5


def test_loss_gradients_agree(pair):
    """Every parameter's gradient (float32 both ways) within 1e-4 relative, or 1e-6 of the
    largest gradient in the model for gradients that are round-off themselves."""
    reference, model = pair
    ids = tokens(2, 40, seed=2)
    grads = []
    for m in (reference, model):
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys() and len(want) > 10
    largest = max(float(g.abs().max()) for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6 * largest, msg=name)
    for part in ("A_log", "dt_bias", ".D", "conv1d.weight", "norm.weight", "in_proj"):
        assert any(part in name for name in got), part


def test_greedy_generation_with_the_cache(pair):
    """A left-padded batch (row 0 is not padded): prefill, then one token at a time."""
    reference, model = pair
    ids = tokens(2, 19, seed=3)
    options = {
        "max_new_tokens": 8, "do_sample": False, "use_cache": True, "pad_token_id": 0,
        "attention_mask": left_padding(ids, (0, 7)),
    }  # fmt: skip
    with torch.no_grad():
        want = reference.generate(ids, **options)
        got = model.generate(ids, **options)
    assert want.shape == (2, 27)
    assert torch.equal(got, want)


def _raising(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} was called")

    return kernel


@pytest.mark.parametrize("name", sorted(MODELS))
def test_runs_with_the_fallback_kernels_raising(name, monkeypatch):
    """Every kernel transformers' mixer calls raises: an unconverted model fails, the
    converted one computes prefill, training and cached decoding."""
    torch.manual_seed(0)
    plain = MODELS[name]().float().eval()
    model = use_polylin(copy.deepcopy(plain))
    module = __import__(type(mixers(plain)[0]).__module__, fromlist=["_"])
    for kernel in KERNELS:
        monkeypatch.setattr(module, kernel, _raising(kernel))
    ids = tokens(2, 12)
    with pytest.raises(AssertionError, match="was called"), torch.no_grad():
        plain(ids)
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14)


def test_padding_cannot_reach_a_real_output():
    """NaN in the padded positions' hidden states (transformers multiplies them by the mask:
    NaN) leaves the real outputs of a mixer as they are with zeros there."""
    torch.manual_seed(0)
    model = use_polylin(mamba2().float().eval())
    layer = mixers(model)[0]
    hidden = torch.randn(2, 23, 64)
    mask = left_padding(hidden[..., 0], (0, 6))
    poisoned = torch.where(mask[..., None] == 0, torch.nan, hidden)
    cleaned = torch.where(mask[..., None] == 0, 0.0, hidden)
    with torch.no_grad():
        got = layer(poisoned, attention_mask=mask)
        want = layer(cleaned, attention_mask=mask)
    assert torch.isfinite(got).all()
    real = mask.bool()
    assert torch.equal(got[real], want[real])


def test_padding_is_an_empty_prefix_for_mamba2():
    """Mamba2 has no positions: a left-padded row's real logits are the unpadded sequence's
    (the hybrids' attention layers take positions from the caller)."""
    torch.manual_seed(0)
    model = use_polylin(mamba2().float().eval())
    ids = tokens(2, 25, seed=6)
    mask = left_padding(ids, (0, 9))
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits[1, 9:]
        alone = model(ids[1:, 9:]).logits[0]
    assert relative(padded, alone) <= 1e-5


def test_packed_sequences_are_refused():
    torch.manual_seed(0)
    layer = mixers(use_polylin(mamba2().float()))[0]
    with pytest.raises(ValueError, match="seq_idx"):
        layer(torch.randn(1, 4, 64), seq_idx=torch.zeros(1, 4, dtype=torch.int32))


def test_only_the_given_model_changes():
    torch.manual_seed(0)
    model = bamba()
    other = copy.deepcopy(model)
    use_polylin(model)
    assert not any("forward" in vars(m) for m in mixers(other))
    converted = mixers(model)[0]
    assert type(converted).forward is type(mixers(other)[0]).forward  # the class is untouched
    del converted.forward  # undoes it
    assert "forward" not in vars(converted)
    assert converted.forward.__func__ is type(converted).forward


def test_bfloat16_model_is_as_close_as_the_fallback():
    """A bfloat16 model: the scan in float32 (as transformers' fallback runs it), the logits as
    close to the float32 model's as the fallback's are, and the same greedy tokens."""
    torch.manual_seed(0)
    exact = bamba().float().eval()
    reference = use_transformers_fallback(copy.deepcopy(exact).to(torch.bfloat16))
    model = use_polylin(copy.deepcopy(reference))
    ids = tokens(2, 37, seed=7)
    with torch.no_grad():
        want = exact(ids).logits
        errors = [relative(m(ids).logits.float(), want) for m in (reference, model)]
        options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        same = torch.equal(reference.generate(ids, **options), model.generate(ids, **options))
    assert errors[1] <= 2 * errors[0] and errors[1] < 0.05
    assert same
