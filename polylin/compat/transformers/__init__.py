"""Run transformers' linear-recurrence layers on polylin.

:func:`use_polylin` converts one model's layers, family by family (:data:`LAYER_CLASSES`):
each converted layer gets its own ``forward`` that computes the recurrence with polylin's
functions, reading and writing transformers' own cache objects, so that prefill, training and
cached decoding run on polylin where transformers would call its slow pure-PyTorch fallbacks
(or kernels that need an NVIDIA GPU). Nothing global changes: other models, other layers and
the classes themselves keep their code, and ``del layer.forward`` undoes it.

This package imports torch and transformers only when a function is called.
"""

from __future__ import annotations

from typing import Any

from ._delta import CONVERSIONS as _DELTA
from ._lightning import CONVERSIONS as _LIGHTNING
from ._mamba1 import CONVERSIONS as _MAMBA1
from ._mamba2 import CONVERSIONS as _MAMBA2
from ._registry import Conversion
from ._rg_lru import CONVERSIONS as _RG_LRU
from ._short_conv import CONVERSIONS as _SHORT_CONV
from ._xlstm import CONVERSIONS as _XLSTM

__all__ = ["LAYER_CLASSES", "use_polylin", "use_transformers_fallback"]

#: The layer classes (by name) :func:`use_polylin` converts, each with its family, the models
#: that use it and how it is converted. Checked on transformers 5.23.0
#: (``tests/test_compat_transformers*.py``).
LAYER_CLASSES: dict[str, Conversion] = {
    **_DELTA,
    **_MAMBA1,
    **_MAMBA2,
    **_LIGHTNING,
    **_SHORT_CONV,
    **_XLSTM,
    **_RG_LRU,
}


def _families() -> str:
    families: dict[str, list[str]] = {}
    for conversion in LAYER_CLASSES.values():
        families.setdefault(conversion.family, []).extend(conversion.models)
    return "; ".join(
        f"{family}: {', '.join(sorted(set(models)))}" for family, models in families.items()
    )


def _convert(model: Any, source: str) -> Any:
    converted = 0
    for layer in model.modules():
        cls: Any = type(layer)
        conversion = LAYER_CLASSES.get(cls.__name__)
        if conversion is not None:
            forward_for = conversion.polylin if source == "polylin" else conversion.fallback
            layer.forward = forward_for(cls).__get__(layer)
            converted += 1
    if converted == 0:
        raise ValueError(
            f"{type(model).__name__} has no layer polylin can run. Supported families "
            f"(transformers model names): {_families()}"
        )
    return model


def use_polylin(model: Any) -> Any:
    """Point the model's linear-recurrence layers at polylin.

    Each layer of a class in :data:`LAYER_CLASSES` (Gated DeltaNet: Qwen3-Next, Qwen3.5;
    KDA: Kimi-Linear; and the other families listed there) computes its recurrence with
    polylin's functions where transformers would call fla's Triton kernels or its
    pure-PyTorch fallbacks. Prefill, training (autograd) and cached decoding all go through
    them; every other part of the model is unchanged.

    Parameters
    ----------
    model : transformers.PreTrainedModel or torch.nn.Module
        Any module containing such layers (converted in place).

    Returns
    -------
    model
        The same model.

    Raises
    ------
    ValueError
        The model has no such layer (the message lists the supported families).

    Examples
    --------
    >>> from polylin.compat.transformers import use_polylin
    >>> model = use_polylin(model)  # doctest: +SKIP
    """
    return _convert(model, "polylin")


def use_transformers_fallback(model: Any) -> Any:
    """Point the same layers at transformers' own pure-PyTorch code.

    transformers picks fla's Triton kernels whenever ``fla`` imports, even where they cannot
    run (a CPU): this runs its reference code instead, for comparisons and benchmarks.

    Parameters
    ----------
    model : transformers.PreTrainedModel or torch.nn.Module
        Any module containing such layers (converted in place).

    Returns
    -------
    model
        The same model.

    Raises
    ------
    ValueError
        The model has no such layer.

    Examples
    --------
    >>> from polylin.compat.transformers import use_transformers_fallback
    >>> reference = use_transformers_fallback(model)  # doctest: +SKIP
    """
    return _convert(model, "transformers")
