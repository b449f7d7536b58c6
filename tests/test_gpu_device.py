"""Device correctness on a GPU: outputs stay on the device, no host synchronization, TF32.

These run wherever ``torch:cuda`` or ``cupy`` can run (``backends/gpu-check.sh`` runs them on
the GPU machine) and skip elsewhere with the reason.

- **Placement**: every entry point returns arrays of the input's library on the input's device.
- **No host round trips**: PyTorch runs each call under ``torch.cuda.set_sync_debug_mode("error")``,
  which raises on any synchronizing CUDA call (``.item()``, a device-to-host copy, a blocking
  host-to-device copy); CuPy runs each call under ``cupyx.allow_synchronize(False)``, where
  any operation that waits for the device is an error (CUDA stream capture cannot serve: CuPy
  refuses cuBLAS calls during capture). Each detector is shown to fire on a deliberate
  synchronization, so a pass means something.
- **TF32**: polylin never changes ``torch``'s float32 matmul precision; the test session pins it
  to ``"highest"`` (``tests/conftest.py``), and one test shows what TF32 does to the results.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest

import polylin
from polylin import (
    LinearAttentionState,
    causal_linear_attention,
    linear_attention,
    masked_kernel_attention,
    step,
)
from polylin.testing import Backend

from .reference import ATOL, masked_kernel

GPU = (Backend.TORCH_CUDA, Backend.CUPY)


@pytest.fixture
def gpu(backend) -> Backend:
    """``torch:cuda`` or ``cupy`` (see the markers); each skips with the reason elsewhere."""
    return backend


torch_cuda = cupy_gpu = gpu


def _qkv(rng, lead=(2, 3), T=70, d_k=8, d_v=5):
    return (rng.standard_normal((*lead, T, d_k)), rng.standard_normal((*lead, T, d_k)),
            rng.standard_normal((*lead, T, d_v)))


def _library_and_device(b: Backend, x):
    import array_api_compat

    return array_api_compat.array_namespace(x), array_api_compat.device(x)


# The calls whose placement and synchronization are checked: (name, function of the
# backend's (q, k, v) and a mask) -> output array or tuple of arrays.
def _calls(b: Backend, xs, mask):
    q, k, v = xs
    S0 = b.from_numpy(np.zeros((*q.shape[:-2], q.shape[-1], v.shape[-1])), "float32")
    z0 = b.from_numpy(np.zeros((*q.shape[:-2], q.shape[-1])), "float32")
    T = q.shape[-2]
    return {
        "chunked": lambda: causal_linear_attention(q, k, v, chunk_size=16),
        "recurrent": lambda: causal_linear_attention(q[..., :9, :], k[..., :9, :],
                                                     v[..., :9, :], method="recurrent"),
        "quadratic": lambda: causal_linear_attention(q, k, v, method="quadratic"),
        "mask": lambda: causal_linear_attention(q, k, v, attention_mask=mask),
        "state": lambda: causal_linear_attention(
            q, k, v, initial_state=LinearAttentionState(S0, z0), return_state=True),
        "cu_seqlens": lambda: causal_linear_attention(q, k, v, cu_seqlens=[0, 20, 21, T]),
        "linear_attention": lambda: linear_attention(q, k, v),
        "masked_kernel": lambda: masked_kernel_attention(q, k, v),
        "step": lambda: step(q[..., 0, :], k[..., 0, :], v[..., 0, :]),
    }


CALLS = ("chunked", "recurrent", "quadratic", "mask", "state", "cu_seqlens", "linear_attention",
         "masked_kernel", "step")


def _arrays(result):
    """Every array in a call's result (an array, or nested tuples of arrays)."""
    if isinstance(result, tuple):
        return [a for part in result for a in _arrays(part)]
    return [result]


def _inputs(b: Backend, rng, dtype="float32"):
    arrays = _qkv(rng)
    xs = [b.from_numpy(a, dtype) for a in arrays]
    mask_np = np.ones(arrays[0].shape[:-1], dtype=bool)
    mask_np[..., :5] = False  # left padding
    mask = b.from_numpy(mask_np)
    return arrays, xs, mask


@pytest.mark.only_backend(*GPU)
@pytest.mark.parametrize("call", CALLS)
def test_outputs_stay_on_the_input_device(gpu, call, rng):
    _, xs, mask = _inputs(gpu, rng)
    xp, device = _library_and_device(gpu, xs[0])
    result = _calls(gpu, xs, mask)[call]()
    for out in _arrays(result):
        out_xp, out_device = _library_and_device(gpu, out)
        assert out_xp is xp, f"{call}: got a {type(out).__module__} array"
        assert out_device == device, f"{call}: output on {out_device}, inputs on {device}"


@pytest.mark.only_backend(*GPU)
def test_gpu_results_match_the_float64_reference(gpu, rng):
    arrays, xs, _ = _inputs(gpu, rng)
    for method in polylin.METHODS:
        out = causal_linear_attention(*xs, method=method, chunk_size=16)
        np.testing.assert_allclose(gpu.to_numpy(out), masked_kernel(*arrays), rtol=0,
                                   atol=ATOL["float32"], err_msg=method)


# --- no host synchronization: PyTorch ---------------------------------------------------------


@contextlib.contextmanager
def _torch_sync_is_an_error(torch):
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@pytest.mark.only_backend(Backend.TORCH_CUDA)
def test_torch_sync_detector_fires(torch_cuda):
    torch = torch_cuda.module()
    x = torch.ones(8, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), _torch_sync_is_an_error(torch):
        float(x.sum())


@pytest.mark.only_backend(Backend.TORCH_CUDA)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("call", CALLS)
def test_torch_cuda_call_never_synchronizes(torch_cuda, call, dtype, rng):
    torch = torch_cuda.module()
    _, xs, mask = _inputs(torch_cuda, rng, dtype)
    fn = _calls(torch_cuda, xs, mask)[call]
    expected = fn()  # warm-up (library handles, caches) outside the check
    with _torch_sync_is_an_error(torch):
        result = fn()
    torch.cuda.synchronize()
    for got, want in zip(_arrays(result), _arrays(expected)):
        np.testing.assert_allclose(torch_cuda.to_numpy(got), torch_cuda.to_numpy(want), rtol=0,
                                   atol=ATOL[dtype], err_msg=call)


@pytest.mark.only_backend(Backend.TORCH_CUDA)
def test_torch_cuda_backward_never_synchronizes(torch_cuda, rng):
    torch = torch_cuda.module()
    _, xs, _ = _inputs(torch_cuda, rng)
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    causal_linear_attention(*leaves, chunk_size=16).sum().backward()  # warm-up
    for x in leaves:
        x.grad = None
    with _torch_sync_is_an_error(torch):
        causal_linear_attention(*leaves, chunk_size=16).sum().backward()
    assert all(x.grad is not None and x.grad.device == xs[0].device for x in leaves)


# --- no host synchronization: CuPy ------------------------------------------------------------


def _unsynchronized(cp, fn):
    """Run ``fn`` with CuPy's synchronization guard on; return ``(out, error)``.

    Under ``cupyx.allow_synchronize(False)`` every operation that waits for the device (a
    device-host copy, ``float`` or ``bool`` of an array, a stream synchronization) raises, so an
    error here is a host round trip inside ``fn``. (CUDA stream capture would also catch them,
    but CuPy refuses cuBLAS calls during capture, so it cannot check a call with a matmul.)
    """
    import cupyx

    fn()  # warm-up: compiled kernels, memory pool blocks, cuBLAS handle
    cp.cuda.Device().synchronize()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "cupyx.allow_synchronize", UserWarning)
            with cupyx.allow_synchronize(False):
                out = fn()
    except Exception as exc:
        return None, exc
    return out, None


@pytest.mark.only_backend(Backend.CUPY)
def test_cupy_sync_detector_fires(cupy_gpu):
    cp = cupy_gpu.module()
    x = cp.ones(8, dtype=cp.float32)
    _, error = _unsynchronized(cp, lambda: float(x.sum()))
    assert error is not None


@pytest.mark.only_backend(Backend.CUPY)
@pytest.mark.parametrize("call", CALLS)
def test_cupy_call_never_synchronizes(cupy_gpu, call, rng):
    cp = cupy_gpu.module()
    _, xs, mask = _inputs(cupy_gpu, rng)
    fn = _calls(cupy_gpu, xs, mask)[call]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result, error = _unsynchronized(cp, fn)
    assert error is None, f"{call} synchronized with the host: {error!r}"
    expected = fn()
    for got, want in zip(_arrays(result), _arrays(expected)):
        np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=0,
                                   atol=ATOL["float32"], err_msg=call)


# --- TF32 -------------------------------------------------------------------------------------

#: TF32 keeps 10 mantissa bits: each matmul operand is off by at most u = 2**-10 relative
#: (truncation; 2**-11 when rounded). Every weight phi(q).phi(k) and value enters the output
#: through two matmul levels (features, then states/scores), so numerator and normalizer each
#: carry at most ~4u relative error of sum_s w_s |v_s| and sum_s w_s; their ratio is then off by
#: at most ~8u max|v|. (An emulation with truncated operands stayed below 0.5u max|v|.)
TF32_REL = 8 * 2.0**-10


@pytest.mark.only_backend(Backend.TORCH_CUDA)
@pytest.mark.parametrize("method", ["chunked", "quadratic"])
def test_tf32_changes_float32_results_within_its_error(torch_cuda, method, rng):
    torch = torch_cuda.module()
    arrays = _qkv(rng, lead=(4,), T=256, d_k=64, d_v=64)
    xs = [torch_cuda.from_numpy(a, "float32") for a in arrays]
    reference = masked_kernel(*arrays)
    bound = TF32_REL * np.max(np.abs(arrays[2]))
    assert torch.get_float32_matmul_precision() == "highest"  # tests/conftest.py pins it
    full = torch_cuda.to_numpy(causal_linear_attention(*xs, method=method))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls
    try:
        tf32 = torch_cuda.to_numpy(causal_linear_attention(*xs, method=method))
        assert torch.get_float32_matmul_precision() == "high"  # polylin left it alone
    finally:
        torch.set_float32_matmul_precision(before)
    full_error = np.max(np.abs(full - reference))
    tf32_error = np.max(np.abs(tf32 - reference))
    assert full_error <= ATOL["float32"]
    assert tf32_error <= bound, f"TF32 error {tf32_error:.2e} above its bound {bound:.2e}"
    # TF32 really was in use: it moves results past the float32 tolerance, which is why the
    # float32 cross-checks run at "highest".
    assert tf32_error > ATOL["float32"], f"TF32 error only {tf32_error:.2e}: was TF32 used?"


@pytest.mark.only_backend(Backend.TORCH, Backend.TORCH_CUDA)
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_polylin_leaves_torch_precision_settings_alone(backend, precision, rng):
    b = backend
    torch = b.module()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        xs = [b.from_numpy(a, "float32") for a in _qkv(rng)]
        tf32_flag = torch.backends.cuda.matmul.allow_tf32
        for method in polylin.METHODS:
            causal_linear_attention(*xs, method=method)
        assert torch.get_float32_matmul_precision() == precision
        assert torch.backends.cuda.matmul.allow_tf32 == tf32_flag
    finally:
        torch.set_float32_matmul_precision(before)
