"""polylin.compat.transformers on xLSTM (the mLSTM): a tiny random ``xLSTMForCausalLM``.

Built from its config (hidden size 128, 4 heads of ``d_qk`` 16 and ``d_v`` 32, 2 blocks, the
config's chunk of 16 so that its kernels cross chunks and run a remainder), once on
transformers' pure-PyTorch kernels (``mlstm_chunkwise_native_autograd``, the recurrent
sequence and step kernels) and once on polylin: logits at a length that is not a multiple of
the chunk, a prefill continued from the cache, loss gradients in training mode, cached greedy
generation; the converted model runs with every fallback kernel made to raise.
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

modeling = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")
if getattr(modeling, "external_xlstm", False):  # pragma: no cover
    pytest.skip("transformers uses the external xlstm package here", allow_module_level=True)

VOCAB = 97
KERNELS = (
    "mlstm_chunkwise_native_autograd",
    "mlstm_recurrent_sequence_native",
    "mlstm_recurrent_step_native",
    "mlstm_chunkwise_fw",
)


def model(mode: str = "inference") -> Any:
    torch.manual_seed(0)
    config = transformers.xLSTMConfig(
        vocab_size=VOCAB, hidden_size=128, num_heads=4, num_blocks=2, num_hidden_layers=2,
        chunk_size=16, qk_dim_factor=0.5, v_dim_factor=1.0, mode=mode, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    xlstm = transformers.xLSTMForCausalLM(config)
    # Gates away from their initialization (input gates near -10): strong, varied input gates.
    with torch.no_grad():
        for block in xlstm.backbone.blocks:
            layer = block.mlstm_layer
            layer.igate_preact.bias.copy_(4.0 * torch.randn(layer.igate_preact.bias.shape))
            layer.igate_preact.weight.mul_(20.0)
            layer.fgate_preact.bias.copy_(2.0 + torch.randn(layer.fgate_preact.bias.shape))
    return xlstm


def pair(mode: str = "inference") -> tuple[Any, Any]:
    reference = model(mode)
    ours = use_polylin(copy.deepcopy(reference))
    return use_transformers_fallback(reference), ours


def tokens(batch: int = 2, length: int = 40, seed: int = 1) -> Any:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def raising(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a fallback kernel was called")


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every pure-PyTorch mLSTM kernel of transformers raises (module functions and the
    partials each backend keeps), from the call of the returned function on: the reference
    model runs before it."""

    def guard(xlstm: Any) -> Any:
        for name in KERNELS:
            monkeypatch.setattr(modeling, name, raising)
        for layer in xlstm.modules():
            if type(layer).__name__ == "xLSTMBackend":
                for attribute in ("_train_fn", "_inference_fn", "chunkwise_kernel_fn",
                                  "sequence_kernel_fn", "step_kernel_fn"):  # fmt: skip
                    monkeypatch.setattr(layer, attribute, raising)
        return xlstm

    return guard


def test_registered():
    conversion = LAYER_CLASSES["xLSTMBackend"]
    assert conversion.family == "mLSTM" and "xlstm" in conversion.models


def test_logits_and_cache(no_fallback):
    """Logits at T = 40 (two chunks and a remainder) within 1e-5; a prefill continued from
    ``xLSTMCache`` equals the whole call; all of it with the fallback kernels raising."""
    reference, ours = pair()
    ids = tokens()
    with torch.no_grad():
        want = reference(ids).logits
        cache = modeling.xLSTMCache(reference.config, 2, dtype=torch.float32)
        head = reference(ids[:, :23], cache_params=cache, use_cache=True).logits
        tail = reference(ids[:, 23:], cache_params=cache, use_cache=True).logits
        no_fallback(ours)
        got = ours(ids).logits
        cache_ours = modeling.xLSTMCache(ours.config, 2, dtype=torch.float32)
        head_ours = ours(ids[:, :23], cache_params=cache_ours, use_cache=True).logits
        tail_ours = ours(ids[:, 23:], cache_params=cache_ours, use_cache=True).logits
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([head_ours, tail_ours], 1), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([head, tail], 1), want, rtol=1e-4, atol=1e-4)
    for layer in range(2):
        for a, b in zip(cache_ours.rnn_state[layer], cache.rnn_state[layer]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_greedy_generation(no_fallback):
    """Cached greedy decoding (a prefill, then one token at a time through ``mlstm_step``)
    gives the fallback's tokens."""
    reference, ours = pair()
    prompt = tokens(length=12)
    want = reference.generate(prompt, max_new_tokens=8, do_sample=False)
    no_fallback(ours)
    got = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def _recurrent_backend(backend: Any) -> None:
    """The backend's forward on transformers' recurrent sequence kernel (its inference path
    for a remainder shorter than a chunk), whose backward works. The chunkwise kernel's fails
    at transformers 5.23.0 when the model keeps a cache (``use_cache`` defaults to True): it
    saves the initial state for the backward, and the model then writes the new state into
    that same tensor (``copy_``); the recurrent kernel clones it first."""

    def forward(query: Any, key: Any, value: Any, igate: Any, fgate: Any, c_initial: Any = None,
                n_initial: Any = None, m_initial: Any = None, **_: Any) -> Any:  # fmt: skip
        return modeling.mlstm_recurrent_sequence_native(
            query, key, value, igate, fgate, c_initial, n_initial, m_initial,
            return_last_states=True, eps=backend.config.eps, dtype_state=torch.float32,
        )  # fmt: skip

    backend.forward = forward


def test_training_gradients(no_fallback):
    """Training (``model.train()``, the default mode, T = 40): the loss and every parameter's
    gradient within 1e-4 of transformers' recurrent kernel's, relative to the gradient's
    largest element or, for a bias, to float32's resolution of the per-token terms it sums
    (a saturated input gate's bias gradient, 1e-4, is the sum of terms whose magnitudes add
    to 0.2: its rounding is that of the terms, about 1e-8, whichever kernel sums them)."""
    reference, ours = pair()
    ids = tokens()
    with pytest.raises(RuntimeError, match="inplace operation"):  # transformers' own path
        reference.train()(ids, labels=ids).loss.backward()
    reference.zero_grad(set_to_none=True)
    for layer in reference.modules():
        if type(layer).__name__ == "xLSTMBackend":
            _recurrent_backend(layer)
    terms: dict[str, Any] = {}  # a bias's name: the sum over tokens of |d loss / d output|

    def record(name: str) -> Any:
        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            g = grad_output[0].detach().abs()
            terms[f"{name}.bias"] = g.reshape(-1, g.shape[-1]).sum(0).max()

        return hook

    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.register_full_backward_hook(record(name))
    loss = reference(ids, labels=ids).loss
    loss.backward()
    no_fallback(ours)
    loss_ours = ours.train()(ids, labels=ids).loss
    loss_ours.backward()
    torch.testing.assert_close(loss_ours, loss, rtol=1e-5, atol=1e-6)
    theirs = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.any()
            continue
        atol = 1e-4 * q.grad.abs().max()
        if name in terms:
            atol = max(atol, 4 * torch.finfo(torch.float32).eps * terms[name])
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=atol, msg=name)
    assert terms  # the gates' biases were seen


def test_any_length_in_training_mode(no_fallback):
    """``mode="train"``: transformers' kernel refuses a length that is not a multiple of the
    chunk; polylin's chunked form takes it and gives the inference path's logits."""
    reference, ours = pair("train")
    ids = tokens(length=21)
    with pytest.raises(ValueError, match="not divisible"):
        reference(ids)
    reference.config.mode = "inference"
    with torch.no_grad():
        want = reference(ids).logits
        no_fallback(ours)
        got = ours(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_undo():
    reference, ours = pair()
    for layer in ours.modules():
        if type(layer).__name__ == "xLSTMBackend":
            assert "forward" in vars(layer)
            del layer.forward
    ids = tokens(length=16)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=0)
