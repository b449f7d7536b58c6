"""Prepared decoding steps on the compiled kernels (``polylin._backend.compiled_step``): the
plan of a signature holds the step, which gives the array-API step's numbers for every option
(scales, normalizations, gates given as numbers, grouped heads, gates above 0), writes none of
the caller's arrays, and steps aside where it cannot run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import polylin

from .test_compiled import _without_kernels  # the array-API step

pytest.importorskip("numba")
torch = pytest.importorskip("torch")

B, H, D = 2, 3, 8
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}


def _tokens(library: str, dtype: str, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    x = {n: rng.standard_normal((B, H, D)) / 2 for n in ("q", "k", "a", "b")}
    x["v"] = rng.standard_normal((B, H, D + 2))
    x["beta"] = rng.random((B, H, 1))
    x["g"] = -rng.random((B, H, D)) * 0.3
    x["g1"] = -rng.random((B, H, 1)) * 0.3
    x["S"] = rng.standard_normal((B, H, D, D + 2))
    x["z"] = rng.random((B, H, D)) + 1
    x = {n: a.astype(dtype) for n, a in x.items()}
    return {n: torch.from_numpy(a) for n, a in x.items()} if library == "torch" else x


Step = tuple[Any, Callable[[dict[str, Any]], Any]]  # the prepared step, and its call on x


def _delta(options: dict[str, Any]) -> Step:
    step = polylin.prepare_delta_rule_step(**options.pop("prepare", {}))
    return step, lambda x: step(
        x["q"], options.get("k", x["k"]), x["v"], options.get("beta", x["beta"]), x["S"],
        log_decay=options.get("g", x["g"]))  # fmt: skip


def _dplr(options: dict[str, Any]) -> Step:
    step = polylin.prepare_dplr_step(**options.pop("prepare", {}))
    return step, lambda x: step(x["q"], x["k"], x["v"], x["a"], x["b"], x["S"],
                          log_decay=options.get("g", x["g"]))  # fmt: skip


def _linear(options: dict[str, Any]) -> Step:
    prepare = {"normalize": False, **options.pop("prepare", {})}
    step = polylin.prepare_step(polylin.feature_maps.identity, **prepare)
    positive = prepare["normalize"]
    state = lambda x: polylin.LinearAttentionState(x["S"], x["z"])  # noqa: E731
    return step, lambda x: step(
        abs(x["q"]) if positive else x["q"], abs(x["k"]) if positive else x["k"], x["v"],
        state(x), log_decay=options.get("g", x["g"]))  # fmt: skip


STEPS = {"delta": _delta, "dplr": _dplr, "linear": _linear}
#: Per family, the options of its steps that the compiled step computes itself.
OPTIONS = {
    "delta": {
        "plain": {},
        "scale": {"prepare": {"scale": 0.3}},
        "qk_l2norm": {"prepare": {"qk_l2norm": True, "scale": 0.5}},
        "scalar gate": {"g": "g1"},
        "number gate": {"g": -0.2},
        "number beta": {"beta": 0.7},
        "gate above 0": {"g": "positive"},
        "shared keys": {"k": "shared"},
    },
    "dplr": {"plain": {}, "scale": {"prepare": {"scale": 0.3}}, "scalar gate": {"g": "g1"},
             "number gate": {"g": -0.2}, "gate above 0": {"g": "positive"}},
    "linear": {"plain": {}, "scale": {"prepare": {"scale": 0.3}}, "scalar gate": {"g": "g1"},
               "number gate": {"g": -0.2}, "gate above 0": {"g": "positive"},
               "normalized": {"prepare": {"normalize": True, "scale": 0.5, "eps": 1e-3}}},
}  # fmt: skip
CASES = [(family, option) for family, options in OPTIONS.items() for option in options]


def _options(family: str, option: str, x: dict[str, Any]) -> dict[str, Any]:
    named = {
        "g1": x["g1"],
        "positive": x["g"] - x["g1"],  # some above 0: taken as 0
        "shared": x["k"][:, :1],  # one key for every head (grouped heads)
    }
    return {
        n: dict(v) if isinstance(v, dict) else named.get(v, v) if isinstance(v, str) else v
        for n, v in OPTIONS[family][option].items()
    }


def _plain(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, tuple):
        return [y for item in x for y in _leaves(item)]
    return [x]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize(("family", "option"), CASES)
def test_the_compiled_step_gives_the_array_api_steps_numbers(
    family: str, option: str, library: str, dtype: str
) -> None:
    x = _tokens(library, dtype)
    options = _options(family, option, x)
    before = {n: _plain(a).copy() for n, a in x.items()}
    step, call = STEPS[family](dict(options))
    got = call(x)
    got_again = call(x)  # the plan's second call
    assert step._plan.compiled is not None
    want = _without_kernels(lambda: STEPS[family](dict(options))[1](x))
    for g, again, w in zip(_leaves(got), _leaves(got_again), _leaves(want), strict=True):
        assert type(g) is type(w) and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(_plain(g), _plain(again))
        scale = max(1.0, float(np.abs(_plain(w)).max()))
        np.testing.assert_allclose(_plain(g), _plain(w), rtol=0, atol=TOLERANCE[dtype] * scale)
    for n, a in x.items():  # the caller's arrays, the state included, are never written
        np.testing.assert_array_equal(_plain(a), before[n])


def test_a_tensor_recording_a_gradient_takes_the_general_path() -> None:
    x = _tokens("torch", "float64")
    step = polylin.prepare_delta_rule_step()
    args = lambda: (x["q"], x["k"], x["v"], x["beta"], x["S"])  # noqa: E731
    free, _ = step(*args(), log_decay=x["g"])
    x["q"].requires_grad_(True)
    out, _ = step(*args(), log_decay=x["g"])  # same signature: the plan's compiled step declines
    out.sum().backward()
    assert out.grad_fn is not None and x["q"].grad is not None
    np.testing.assert_allclose(out.detach().numpy(), free.numpy(), rtol=0, atol=1e-12)
    with torch.no_grad():  # a tensor that requires a gradient, none recorded
        held, _ = step(*args(), log_decay=x["g"])
    np.testing.assert_allclose(held.numpy(), free.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("case", ["no state", "shared state", "a mask", "half precision"])
def test_steps_the_kernels_do_not_take_have_no_compiled_step(library: str, case: str) -> None:
    x = _tokens(library, "float32")
    q, k, v, beta, S = (x[n] for n in ("q", "k", "v", "beta", "S"))
    if case == "a mask":
        step = polylin.prepare_step(polylin.feature_maps.identity, normalize=False)
        step(q, k, v, polylin.LinearAttentionState(S, x["z"]), attention_mask=beta[..., 0] > 0)
    else:
        step = polylin.prepare_delta_rule_step()
        if case == "half precision":  # computed in float32: the arrays are not used as given
            q, k, v, beta = (a.astype("float16") if library == "numpy" else a.half()
                             for a in (q, k, v, beta))  # fmt: skip
        step(q, k, v, beta, {"no state": None, "shared state": S[:1]}.get(case, S))
    assert step._plan.compiled is None


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_steps_over_large_states_write_at_cache_lines(
    monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    """From ``ALIGNED_STEP_BYTES`` of states on, the new state and the output start at
    multiples of 64 bytes (below, where NumPy puts them); the numbers are the same either way."""
    from polylin._backend import compiled_step

    x = _tokens(library, "float32")
    step = polylin.prepare_delta_rule_step()
    call = lambda: step(x["q"], x["k"], x["v"], x["beta"], x["S"], log_decay=x["g1"])  # noqa: E731
    small = call()
    # this step's states are 2 x 3 x 8 x 10 float32: 1920 bytes
    monkeypatch.setattr(compiled_step, "ALIGNED_STEP_BYTES", 1920)
    step = polylin.prepare_delta_rule_step()  # a new plan, built under the new threshold
    large = call()
    for got, want in zip(large, small, strict=True):
        got = got.numpy() if library == "torch" else got
        assert got.ctypes.data % 64 == 0
        np.testing.assert_array_equal(got, want.numpy() if library == "torch" else want)
