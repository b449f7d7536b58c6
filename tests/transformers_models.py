"""Helpers shared by the tests of :mod:`polylin.compat.transformers` (tiny random models)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from polylin.compat.transformers import LAYER_CLASSES, use_polylin, use_transformers_fallback

#: The vocabulary of every tiny test model.
VOCAB = 97


def model_pair(build: Callable[[], Any], prepare: Callable[[Any], None] | None = None) -> Any:
    """The same random model twice: on transformers' own code, and on polylin.

    ``prepare(model)`` may change the reference's weights (under ``no_grad``) before the copy.
    """
    import torch

    torch.manual_seed(0)
    reference = build().float().eval()
    if prepare is not None:
        with torch.no_grad():
            prepare(reference)
    polylin_model = copy.deepcopy(reference)
    return use_transformers_fallback(reference), use_polylin(polylin_model)


def tokens(batch: int, length: int, seed: int = 1) -> Any:
    """``(batch, length)`` random token ids of the tiny vocabulary (ids 0-2 are special)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def outputs(model: Any, ids: Any, **options: Any) -> Any:
    """The model's logits."""
    return model(ids, **options).logits


def relative(a: Any, b: Any) -> float:
    """The largest difference relative to the largest entry of ``b``."""
    return float((a - b).abs().max() / b.abs().max())


def converted_layers(model: Any) -> list[Any]:
    """The layers of ``model`` whose class :func:`use_polylin` converts."""
    return [m for m in model.modules() if type(m).__name__ in LAYER_CLASSES]
