"""Hardening III (issue 40): masks of other conventions, imports without a library, and the
FAVOR+ projection without BLAS threads.

- A mask that is not boolean is refused by every function of the core, by its dtype alone,
  with the conversion it needs (an additive 0/-inf mask is ``mask == 0``, a 0/1 mask
  ``mask != 0``); the layers of ``polylin.torch``, which take a tokenizer's 0/1 mask, refuse
  any other values (an additive mask read by ``!= 0`` was inverted: relative error 1).
- ``import polylin`` and NumPy calls work where torch, jax, cupy or dask is blocked
  (``sys.modules[name] = None``), and so does ``examples/generate_numpy.py`` without torch.
- ``favor_plus``'s projection on NumPy is built without ``linalg.qr`` or any matrix product
  (OpenBLAS threads on busy cores took 25-40 s for ``favor_plus(128, 4096)``), and it is the
  same matrix as before, to round-off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from polylin import (
    causal_conv1d,
    causal_conv1d_step,
    causal_linear_attention,
    delta_rule_attention,
    dplr_delta_rule,
    linear_attention,
    prepare_step,
    step,
)
from polylin import feature_maps as feature_maps_module
from polylin.feature_maps import favor_plus
from polylin.testing import Backend

from .test_feature_maps import ref_favor_projection

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Item 2: masks that are not boolean
# ---------------------------------------------------------------------------------------------

KEEP = np.array([[False, True, True, True, True], [True, True, True, False, True]])  # (2, 5)
HINT = "polylin's masks are boolean, True = real token"


def _sequence_call(name: str, backend, rng):
    """``call(mask)`` of one masked whole-sequence entry point, and the mask's shape."""
    f = lambda *shape: backend.from_numpy(rng.standard_normal(shape))  # noqa: E731
    q, k, v = f(2, 5, 4), f(2, 5, 4), f(2, 5, 3)
    unit = rng.standard_normal((2, 5, 4))
    unit = backend.from_numpy(unit / np.linalg.norm(unit, axis=-1, keepdims=True))
    if name == "causal_linear_attention":
        return lambda m: causal_linear_attention(q, k, v, attention_mask=m)
    if name == "linear_attention":
        return lambda m: linear_attention(q, k, v, attention_mask=m)
    if name == "delta_rule_attention":
        beta = backend.from_numpy(np.full((2, 5, 1), 0.5))
        return lambda m: delta_rule_attention(q, unit, v, beta, attention_mask=m)
    if name == "dplr_delta_rule":
        b = backend.from_numpy(0.5 * backend.to_numpy(unit))
        return lambda m: dplr_delta_rule(q, unit, v, -unit, b, attention_mask=m)
    if name == "causal_conv1d":
        x, weight = f(2, 5, 3), f(3, 4)
        return lambda m: causal_conv1d(x, weight, attention_mask=m)
    raise AssertionError(name)


def _token_call(name: str, backend, rng):
    """``call(mask)`` of one masked decoding step (a ``(batch,)`` mask)."""
    f = lambda *shape: backend.from_numpy(rng.standard_normal(shape))  # noqa: E731
    q, k, v = f(2, 4), f(2, 4), f(2, 3)
    if name == "step":
        return lambda m: step(q, k, v, attention_mask=m)[0]
    if name == "prepare_step":
        decode = prepare_step()
        return lambda m: decode(q, k, v, attention_mask=m)[0]
    if name == "causal_conv1d_step":
        x_t, weight = f(2, 3), f(3, 4)
        return lambda m: causal_conv1d_step(x_t, weight, attention_mask=m)[0]
    raise AssertionError(name)


SEQUENCE_CALLS = [
    "causal_linear_attention",
    "linear_attention",
    "delta_rule_attention",
    "dplr_delta_rule",
    "causal_conv1d",
]
TOKEN_CALLS = ["step", "prepare_step", "causal_conv1d_step"]


def _masks(backend, keep: np.ndarray) -> dict:
    """``keep`` in the conventions callers bring: boolean, 0/1 integers, 0/1 floats, additive
    (0 for real tokens, -inf for padding), and an integer mask of 2s."""
    return {
        "bool": backend.from_numpy(keep),
        "int 0/1": backend.from_numpy(keep.astype(np.int64)),
        "float 0/1": backend.from_numpy(keep.astype(np.float64)),
        "additive": backend.from_numpy(np.where(keep, 0.0, -np.inf)),
        "2s": backend.from_numpy(np.full(keep.shape, 2, dtype=np.int64)),
    }


def _check_core_masks(backend, call, keep: np.ndarray) -> None:
    masks = _masks(backend, keep)
    expected = backend.to_numpy(call(masks["bool"]))
    for kind in ("int 0/1", "float 0/1", "additive", "2s"):
        with pytest.raises(TypeError, match="attention_mask must be boolean") as info:
            call(masks[kind])
        message = str(info.value)
        assert HINT in message, kind
        assert "attention_mask=(mask == 0)" in message and "attention_mask=(mask != 0)" in message
    # The conversions the message gives restore the boolean mask's result exactly.
    xp = backend.namespace()
    np.testing.assert_array_equal(backend.to_numpy(call(masks["additive"] == 0)), expected)
    np.testing.assert_array_equal(backend.to_numpy(call(masks["int 0/1"] != 0)), expected)
    assert xp.isdtype((masks["additive"] == 0).dtype, "bool")


@pytest.mark.parametrize("name", SEQUENCE_CALLS)
def test_core_refuses_a_non_boolean_mask_with_its_conversion(backend, name, rng):
    """Whole sequences: a 0/-inf, 0/1 or 2s mask is a TypeError that says how to convert it,
    and the conversion it names gives the boolean mask's result."""
    _check_core_masks(backend, _sequence_call(name, backend, rng), KEEP)


@pytest.mark.parametrize("name", TOKEN_CALLS)
def test_core_decoding_steps_refuse_a_non_boolean_mask_with_its_conversion(backend, name, rng):
    """The same rule for the ``(batch,)`` mask of a decoding step."""
    _check_core_masks(backend, _token_call(name, backend, rng), np.array([True, False]))


def _torch():
    reason = Backend.TORCH.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[torch] {reason}")
    return Backend.TORCH.module()


LAYERS = {
    "LinearAttention": ("LinearAttention", dict(embed_dim=16, num_heads=2)),
    "GatedDeltaNet": ("GatedDeltaNet", dict(hidden_size=16, num_heads=2, head_dim=4)),
    "KimiDeltaAttention": ("KimiDeltaAttention", dict(hidden_size=16, num_heads=2, head_dim=4)),
    "GatedLinearAttention": ("GatedLinearAttention", dict(hidden_size=16, num_heads=2)),
    "Mamba2": ("Mamba2", dict(hidden_size=16, head_dim=8, state_size=4)),
}


def _layer(name: str):
    torch = _torch()
    import polylin.torch as layers

    cls, options = LAYERS[name]
    torch.manual_seed(0)
    return torch, getattr(layers, cls)(**options)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_refuse_an_additive_mask_and_keep_zero_one_masks(name):
    """A layer takes bool and 0/1 masks (integer or float) alike; an additive 0/-inf mask,
    which ``!= 0`` inverted (relative error 1), and a mask of 2s are a ValueError."""
    torch, layer = _layer(name)
    x = torch.randn(2, 5, 16)
    keep = torch.from_numpy(KEEP)
    expected = layer(x, keep)
    for other in (keep.to(torch.int64), keep.to(torch.float32), keep.to(torch.uint8)):
        torch.testing.assert_close(layer(x, other), expected, rtol=0, atol=0)
    for bad in (torch.where(keep, 0.0, float("-inf")), torch.full((2, 5), 2), keep * 0.5):
        with pytest.raises(ValueError, match="attention_mask must be boolean or hold 0 and 1"):
            layer(x, bad)
    with pytest.raises(ValueError, match=r"attention_mask=\(mask == 0\)"):
        layer(x, torch.where(keep, 0.0, float("-inf")))
    torch.testing.assert_close(layer(x, torch.where(keep, 0.0, float("-inf")) == 0), expected)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_steps_refuse_an_additive_mask(name):
    """``step``'s ``(batch,)`` mask follows the same rule."""
    torch, layer = _layer(name)
    x_t = torch.randn(2, 16)
    keep = torch.tensor([True, False])
    expected = layer.step(x_t, attention_mask=keep)[0]
    got = layer.step(x_t, attention_mask=keep.to(torch.int64))[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for bad in (torch.where(keep, 0.0, float("-inf")), torch.full((2,), 2)):
        with pytest.raises(ValueError, match="hold 0 and 1"):
            layer.step(x_t, attention_mask=bad)


def test_compiled_layer_checks_a_float_mask_and_takes_an_integer_one():
    """Under ``torch.compile`` a float mask is still checked (outside the graph) and an integer
    0/1 mask gives the eager result."""
    torch, layer = _layer("LinearAttention")
    if not hasattr(torch, "compile"):
        pytest.skip(f"[torch] torch {torch.__version__} has no torch.compile")
    x = torch.randn(2, 5, 16)
    keep = torch.from_numpy(KEEP)
    compiled = torch.compile(layer, backend="eager", dynamic=False)
    torch.testing.assert_close(compiled(x, keep.to(torch.int64)), layer(x, keep))
    with pytest.raises(ValueError, match="hold 0 and 1"):
        compiled(x, torch.where(keep, 0.0, float("-inf")))


# ---------------------------------------------------------------------------------------------
# Item 5: polylin without an array library
# ---------------------------------------------------------------------------------------------

BLOCKED_SCRIPT = """
import sys
sys.modules[{name!r}] = None  # how a program proves it runs without {name}
import numpy as np
import polylin
import polylin.testing
from polylin.__main__ import main

assert polylin.__file__.startswith({root!r}), polylin.__file__
rng = np.random.default_rng(0)
q, k, v = rng.standard_normal((3, 2, 5, 4))
out = polylin.causal_linear_attention(q, k, v)
assert np.allclose(out[:, 0], v[:, 0])
unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
polylin.delta_rule_attention(q, unit, v, np.full((2, 5, 1), 0.5))
if {name!r} == "torch":  # the listing probes every library: once is enough here
    assert main(["backends"]) == 0
print("OK")
"""


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *env.values(), *inherited])}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=environ,
        timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["torch", "jax", "cupy", "dask"])
def test_import_and_numpy_calls_with_a_library_blocked(name):
    """``sys.modules[name] = None`` before ``import polylin``: polylin imports, runs on NumPy
    and ``polylin.testing`` imports; with torch blocked, ``python -m polylin backends`` lists
    the backends, torch unavailable."""
    done = _run(BLOCKED_SCRIPT.format(name=name, root=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OK" in done.stdout
    if name == "torch":
        (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("torch ")]
        assert "unavailable" in line


def test_numpy_generation_example_with_torch_blocked(tmp_path):
    """``examples/generate_numpy.py`` serves a model trained by ``char_lm_torch.py`` (tiny) in
    a Python where ``sys.modules["torch"] = None``: it prints exactly the sample."""
    _torch()
    examples = ROOT / "examples"
    tiny = ["--batch", "4", "--context", "24", "--d-model", "16", "--heads", "2"]
    tiny += ["--layers", "1", "--threads", "1", "--lr", "1e-2", "--steps", "2"]
    train = subprocess.run(
        [sys.executable, str(examples / "char_lm_torch.py"), "--out", str(tmp_path), *tiny],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    script = textwrap.dedent(f"""
        import runpy, sys
        sys.modules["torch"] = None
        sys.path.insert(0, {str(examples)!r})
        sys.argv = ["generate_numpy.py", {str(tmp_path)!r}]
        runpy.run_path({str(examples / "generate_numpy.py")!r}, run_name="__main__")
    """)
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (tmp_path / "sample.txt").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Item 10: the FAVOR+ projection without BLAS threads
# ---------------------------------------------------------------------------------------------


def test_favor_plus_128_4096_is_the_matrix_built_before():
    """``favor_plus(128, 4096)``'s projection, now from elementwise Gram-Schmidt, is the one
    the sign-fixed ``linalg.qr`` built (figures recorded from that code, float64 NumPy)."""
    matrix = np.asarray(favor_plus(128, 4096).projection(np.zeros((1, 128))))
    assert matrix.shape == (128, 4096) and matrix.dtype == np.float64
    recorded = {
        "sum": -305.8429429414098,
        "abs sum": 418320.12331478833,
        "row 0": [1.259124904444492, -1.0657492031012301, -0.6124944742769713],
        "row -1": [-1.1560171437530617, -0.8826076708717709, -0.7200530580766432],
    }
    np.testing.assert_allclose(matrix.sum(), recorded["sum"], rtol=1e-12)
    np.testing.assert_allclose(np.abs(matrix).sum(), recorded["abs sum"], rtol=1e-13)
    np.testing.assert_allclose(matrix[0, :3], recorded["row 0"], rtol=1e-12)
    np.testing.assert_allclose(matrix[-1, -3:], recorded["row -1"], rtol=1e-12)
    blocks = matrix.reshape(128, 32, 128).transpose(1, 0, 2)  # (block, dim, rows of a block)
    norms = np.linalg.norm(blocks, axis=1, keepdims=True)
    directions = blocks / norms
    gram = np.einsum("bik,bil->bkl", directions, directions)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(128), gram.shape), atol=1e-13)


@pytest.mark.parametrize("dim, m, seed", [(32, 100, 5), (8, 8, 0), (64, 64, -3)])
def test_favor_plus_projection_matches_the_qr_recipe(dim, m, seed):
    """The same matrix as the documented recipe with ``np.linalg.qr``, to round-off."""
    matrix = np.asarray(favor_plus(dim, m, seed=seed).projection(np.zeros((1, dim))))
    np.testing.assert_allclose(matrix, ref_favor_projection(dim, m, seed, True), atol=1e-13)


@pytest.mark.parametrize("library", ["numpy", "array_api_strict"])
def test_numpy_projection_calls_no_qr_and_no_matrix_product(library, monkeypatch):
    """On NumPy (and array-api-strict, which wraps it) no BLAS call builds the projection:
    ``linalg.qr`` and the matrix products of the namespace are not called."""
    backend = Backend(library)
    if backend.unavailable_reason() is not None:
        pytest.skip(backend.unavailable_reason())
    xp = backend.namespace()
    x = backend.from_numpy(np.zeros((1, 16)))

    def refuse(*args, **kwargs):
        raise AssertionError("a BLAS call built the projection")

    monkeypatch.setattr(feature_maps_module, "_projection_cache", OrderedDict())
    for name in ("matmul", "tensordot", "vecdot"):
        if hasattr(xp, name):
            monkeypatch.setattr(xp, name, refuse)
    monkeypatch.setattr(xp.linalg, "qr", refuse)
    matrix = favor_plus(16, 72, seed=21).projection(x)
    monkeypatch.undo()
    np.testing.assert_allclose(
        backend.to_numpy(matrix), ref_favor_projection(16, 72, 21, True), atol=1e-13
    )
