"""The converted transformers models on a CUDA device: every family ``use_polylin`` converts.

The same tiny random models as the CPU tests (``tests/test_compat_transformers*.py``), moved to
the GPU: the converted model's logits against transformers' own code (its PyTorch fallback, on
the same device) and greedy generation with the cache, token for token. Run by
``backends/gpu-check.sh`` with the device tests; skipped without a CUDA device. A family the
installed transformers lacks is skipped with its version.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the transformers adapter needs PyTorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (the converted models on a GPU)", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from .transformers_models import model_pair, relative, tokens  # noqa: E402

#: The test modules whose ``MODELS`` (name -> builder of a tiny model) are run here.
MODULES = (
    "test_compat_transformers",
    "test_compat_transformers_families",
    "test_compat_transformers_mamba1",
    "test_compat_transformers_mamba2",
)


def _builders() -> dict[str, Callable[[], Any]]:
    found: dict[str, Callable[[], Any]] = {}
    for name in MODULES:
        module = importlib.import_module(f"tests.{name}")
        found.update(module.MODELS)
    xlstm = importlib.import_module("tests.test_compat_transformers_xlstm")
    found["xlstm"] = xlstm.model
    rg_lru = importlib.import_module("tests.test_compat_transformers_rg_lru")
    found["recurrent_gemma"] = rg_lru.recurrent_gemma
    return found


BUILDERS = _builders()


def _greedy(model: Any, ids: Any, steps: int) -> tuple[Any, Any]:
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, use_cache=True,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_converted_model_on_cuda(family):
    """Logits within 1e-4 relative of transformers' own code on the GPU, and the same greedy
    tokens (with every step's logits) through the cache."""
    try:
        reference, model = model_pair(BUILDERS[family])
    except (AttributeError, ImportError, TypeError, ValueError) as exc:
        pytest.skip(f"transformers {transformers.__version__} cannot build {family}: {exc}")
    reference, model = reference.cuda(), model.cuda()
    ids = tokens(2, 33).cuda()
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert got.device == ids.device
    assert relative(got, want) <= 1e-4
    with torch.no_grad():
        (want_ids, want_steps), (got_ids, got_steps) = (
            _greedy(reference, ids[:, :11], 5),
            _greedy(model, ids[:, :11], 5),
        )
    assert torch.equal(got_ids, want_ids)
    assert relative(got_steps, want_steps) <= 1e-4
