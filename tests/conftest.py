"""Shared fixtures: one ``backend`` parameter over every driver in polylin.testing."""

from __future__ import annotations

import numpy as np
import pytest

from polylin.testing import Backend, selected_backends

BACKENDS = selected_backends()


def _backend_params(backends):
    return [pytest.param(b, id=str(b)) for b in backends]


@pytest.fixture(params=_backend_params(BACKENDS))
def backend(request) -> Backend:
    """Every selected backend; unusable ones skip with the reason."""
    b: Backend = request.param
    reason = b.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[{b}] {reason}")
    return b


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)
