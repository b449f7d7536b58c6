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


@pytest.fixture(autouse=True, scope="session")
def _float32_matmuls_at_full_precision():
    """GPU float32 cross-checks run without TF32 (see docs/gpu.md): pin torch's float32 matmul
    precision to "highest" for the session, restoring the caller's setting afterwards. polylin
    itself never changes it; tests/test_gpu_device.py shows what TF32 does to the results."""
    if Backend.TORCH_CUDA not in BACKENDS or Backend.TORCH_CUDA.unavailable_reason() is not None:
        yield
        return
    torch = Backend.TORCH_CUDA.module()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)
