"""The chunked forms' accelerator paths, forced on the CPU.

PyTorch CUDA and CuPy take code that CPU backends do not (``_backend.execution``'s
``eager_accelerator``: dense inputs, longer chunks for the delta rules, one block). These tests
make the CPU take it, on strided inputs like fla's ``(B, T, H, d)`` read as ``(B, H, T, d)``,
and hold its results to the float64 recurrent form.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import polylin
import polylin._forms.delta.chunked as delta_chunked
import polylin._forms.linear.chunked as linear_chunked

torch = pytest.importorskip("torch")


@pytest.fixture
def accelerator(monkeypatch):
    """The CPU treated as an eager accelerator (and not as an eager CPU backend)."""
    monkeypatch.setattr(delta_chunked, "eager_accelerator", lambda xp, dev: True)
    monkeypatch.setattr(delta_chunked, "eager_cpu", lambda xp, dev: False)
    monkeypatch.setattr(linear_chunked, "eager_accelerator", lambda xp, dev: True)
    monkeypatch.setattr(linear_chunked, "eager_cpu", lambda xp, dev: False)


def _strided(rng, B, T, H, d):
    """A ``(B, H, T, d)`` float32 view of a ``(B, T, H, d)`` tensor, as fla's layout gives."""
    return torch.from_numpy(rng.standard_normal((B, T, H, d)).astype(np.float32)).transpose(1, 2)


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_delta_rule_on_the_accelerator_path(rng, accelerator, monkeypatch, gate):
    """Chunks of at least ACCELERATOR_CHUNK tokens (a chunk_size of 16 asked for), a padded
    last chunk, strided inputs: the float64 recurrent result to float32 round-off."""
    sizes = []
    causal_mask = delta_chunked.causal_mask
    monkeypatch.setattr(
        delta_chunked,
        "causal_mask",
        lambda xp, r, c, dev: sizes.append(r) or causal_mask(xp, r, c, dev),
    )
    B, T, H, d = 2, 300, 3, 8
    q, k, v = (_strided(rng, B, T, H, d) for _ in range(3))
    beta = torch.sigmoid(_strided(rng, B, T, H, 1))
    width = {None: 0, "scalar": 1, "channel": d}[gate]
    g = None if gate is None else torch.nn.functional.logsigmoid(_strided(rng, B, T, H, width)) / 8
    given = [x.clone() for x in (q, k, v, beta)]
    got = polylin.delta_rule_attention(q, k, v, beta, log_decay=g, qk_l2norm=True, chunk_size=16)
    assert sizes == [delta_chunked.ACCELERATOR_CHUNK]
    want = polylin.delta_rule_attention(
        *(x.double() for x in (q, k, v, beta)), log_decay=None if g is None else g.double(),
        qk_l2norm=True, method="recurrent",
    )  # fmt: skip
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=2e-5, rtol=1e-4)
    for x, x0 in zip((q, k, v, beta), given):
        assert torch.equal(x, x0)


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_linear_attention_on_the_accelerator_path(rng, accelerator, gate):
    """Dense blocks made from strided inputs and gates: the float64 recurrent result."""
    B, T, H, d = 2, 100, 3, 8
    q, k, v = (_strided(rng, B, T, H, d) for _ in range(3))
    width = {None: 0, "scalar": 1, "channel": d}[gate]
    g = None if gate is None else torch.nn.functional.logsigmoid(_strided(rng, B, T, H, width)) / 8
    got = polylin.causal_linear_attention(q, k, v, log_decay=g, chunk_size=16, normalize=False)
    want = polylin.causal_linear_attention(
        q.double(), k.double(), v.double(), log_decay=None if g is None else g.double(),
        method="recurrent", normalize=False,
    )  # fmt: skip
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=2e-5, rtol=1e-4)


def test_only_accelerators_are_eager_accelerators():
    """NumPy and PyTorch on the CPU are not; CuPy and PyTorch on another device are."""
    from polylin._backend.execution import eager_accelerator
    from polylin.interop import array_namespace

    x = torch.zeros(2)
    assert not eager_accelerator(array_namespace(x), x.device)
    assert not eager_accelerator(array_namespace(np.zeros(2)), "cpu")
    assert eager_accelerator(array_namespace(x), torch.device("meta"))
    assert eager_accelerator(SimpleNamespace(__name__="array_api_compat.cupy"), "cuda:0")
