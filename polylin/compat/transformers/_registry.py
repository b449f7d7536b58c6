"""What :func:`~polylin.compat.transformers.use_polylin` converts: one entry per layer class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: ``forward_for(cls)`` -> the function to bind as a layer's ``forward``.
ForwardFor = Callable[[Any], Callable[..., Any]]


@dataclass(frozen=True)
class Conversion:
    """How one transformers layer class runs on polylin.

    Parameters
    ----------
    family : str
        The recurrence family, as the docs' table names it (``"Gated DeltaNet"``, ``"Mamba-2"``).
    models : tuple of str
        The model families (transformers' ``models/<name>``) whose layers are this class.
    polylin : callable
        ``polylin(cls)`` -> the ``forward`` that computes the layer on polylin.
    fallback : callable
        ``fallback(cls)`` -> the ``forward`` on transformers' own pure-PyTorch code (the
        reference for tests and benchmarks, even where a faster kernel would be picked).
    kernels : dict
        For layers converted by rebinding module-level kernel names: those names and
        polylin's functions for them (empty for layers given a forward of their own).
    """

    family: str
    models: tuple[str, ...]
    polylin: ForwardFor
    fallback: ForwardFor
    kernels: dict[str, Callable[..., Any]] = field(default_factory=dict)
