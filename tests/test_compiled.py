"""The compiled CPU kernels (``polylin._backend.compiled``, Numba): the same numbers as the
array-API forms they replace, on NumPy and PyTorch CPU, for steps and whole sequences, and
the array-API forms wherever the kernels do not apply."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import polylin
from polylin._backend import compiled

pytest.importorskip("numba")
torch = pytest.importorskip("torch")

B, T, H, D = 2, 19, 3, 8


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the kernels run, one per run."""
    seen: list[str] = []
    real = compiled.kernel

    def counted(name: str) -> Any:
        run = real(name)

        def ran(*args: Any) -> None:
            seen.append(name)
            run(*args)

        return None if run is None else ran

    monkeypatch.setattr(compiled, "kernel", counted)
    yield seen


def _without_kernels(f: Callable[[], Any]) -> Any:
    real = compiled.kernel
    compiled.kernel = lambda name: None  # type: ignore[assignment]
    try:
        return f()
    finally:
        compiled.kernel = real  # type: ignore[assignment]


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in _leaves(item)]
    return [x]


def _numpy(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _inputs(library: str, dtype: str, gate: str, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    shapes = {"q": (B, T, H, D), "k": (B, T, H, D), "v": (B, T, H, D + 2),
              "a": (B, T, H, D), "b": (B, T, H, D), "beta": (B, T, H, 1)}  # fmt: skip
    x = {n: rng.standard_normal(s) / (2 if n in ("k", "a", "b") else 1) for n, s in shapes.items()}
    x["beta"] = rng.random(shapes["beta"])
    if gate != "none":
        x["g"] = -rng.random((B, T, H, 1 if gate == "scalar" else D)) * 0.3
    x["S"] = rng.standard_normal((B, H, D, D + 2))
    x = {n: a.astype(dtype) for n, a in x.items()}
    return {n: torch.from_numpy(a) for n, a in x.items()} if library == "torch" else x


#: Each kernel's per-token arrays, in its order.
TOKENS = {"delta": ("q", "k", "v", "beta"), "linear": ("q", "k", "v"),
          "dplr": ("q", "k", "v", "a", "b")}  # fmt: skip


def _token_major(name: str) -> tuple[dict[str, Any], list[np.ndarray], np.ndarray | None]:
    """Float32 inputs of kernel ``name``: ``x``, its per-token arrays as token-major views
    ``(B, H, T, w)`` and the decay factors last, and linear attention's ``z`` (else ``None``)."""
    x = _inputs("numpy", "float32", "channel")
    tokens = [x[n].transpose(0, 2, 1, 3) for n in (*TOKENS[name], "g")]
    tokens[-1] = np.exp(tokens[-1])
    return x, tokens, x["S"][..., 0] if name == "linear" else None


FAMILIES = {
    "delta": lambda x, method, **options: polylin.delta_rule_attention(
        x["q"], x["k"], x["v"], x["beta"], log_decay=x.get("g"), initial_state=x["S"],
        method=method, seq_axis=1, return_state=True, **options),
    "dplr": lambda x, method, **options: polylin.dplr_delta_rule(
        x["q"], x["k"], x["v"], x["a"], x["b"], log_decay=x.get("g"), initial_state=x["S"],
        method=method, seq_axis=1, return_state=True, **options),
    "linear": lambda x, method, **options: polylin.causal_linear_attention(
        x["q"], x["k"], x["v"], None, log_decay=x.get("g"), normalize=False, method=method,
        seq_axis=1, return_state=True, **options),
    "normalized": lambda x, method, **options: polylin.causal_linear_attention(
        abs(x["q"]), abs(x["k"]), x["v"], None, log_decay=x.get("g"), method=method,
        seq_axis=1, return_state=True, **options),
}  # fmt: skip
KERNEL = {"delta": "delta", "dplr": "dplr", "linear": "linear", "normalized": "linear"}
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}
#: Every library, dtype, gate and family: the grid of the form and step comparisons.
GRID = {"library": ["numpy", "torch"], "dtype": ["float32", "float64"],
        "gate": ["none", "scalar", "channel"], "family": sorted(FAMILIES)}  # fmt: skip


def every_case(test: Callable[..., None]) -> Callable[..., None]:
    """``test`` parametrized over :data:`GRID`."""
    for name, values in GRID.items():
        test = pytest.mark.parametrize(name, values)(test)
    return test


def _close(got: Any, want: Any, dtype: str) -> None:
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        g, w = _numpy(g), _numpy(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE[dtype] * scale)


@every_case
def test_recurrent_form_matches_the_array_api_form(
    calls: list[str], library: str, dtype: str, gate: str, family: str
) -> None:
    x = _inputs(library, dtype, gate)
    before = {n: _numpy(a).copy() for n, a in x.items()}
    got = FAMILIES[family](x, "recurrent")
    assert calls == [KERNEL[family]]
    want = _without_kernels(lambda: FAMILIES[family](x, "recurrent"))
    _close(got, want, dtype)
    _close(got, FAMILIES[family](x, "chunked"), dtype)
    assert all(type(y) is type(x["q"]) for y in _leaves(got))
    for n, a in x.items():  # the caller's arrays, the state included, are never written
        np.testing.assert_array_equal(_numpy(a), before[n])


def _step(family: str, x: dict[str, Any], t: int) -> Any:
    tok = {n: a[:, t] for n, a in x.items() if n != "S"}
    if family == "delta":
        return polylin.delta_rule_step(tok["q"], tok["k"], tok["v"], tok["beta"], x["S"],
                                       log_decay=tok.get("g"))  # fmt: skip
    if family == "dplr":
        return polylin.dplr_delta_rule_step(tok["q"], tok["k"], tok["v"], tok["a"], tok["b"],
                                            x["S"], log_decay=tok.get("g"))  # fmt: skip
    state = polylin.LinearAttentionState(x["S"], abs(x["k"][:, 0]) * 0 + 1)
    normalize = family == "normalized"
    q, k = (abs(tok[n]) for n in "qk") if normalize else (tok["q"], tok["k"])
    return polylin.step(q, k, tok["v"], state, normalize=normalize, log_decay=tok.get("g"))


@every_case
def test_steps_match_the_array_api_steps(
    calls: list[str], library: str, dtype: str, gate: str, family: str
) -> None:
    x = _inputs(library, dtype, gate, seed=1)
    got = _step(family, x, 3)
    assert calls and set(calls) == {KERNEL[family]}
    _close(got, _without_kernels(lambda: _step(family, x, 3)), dtype)


def test_prepared_step_runs_the_kernel_and_equals_the_plain_step(calls: list[str]) -> None:
    x = _inputs("torch", "float32", "channel")
    prepared = polylin.prepare_delta_rule_step(scale=0.5)
    tok = {n: a[:, 0] for n, a in x.items() if n != "S"}
    args = (tok["q"], tok["k"], tok["v"], tok["beta"], x["S"])
    for o, plain in zip(prepared(*args, log_decay=tok["g"]),
                        polylin.delta_rule_step(*args, log_decay=tok["g"], scale=0.5)):  # fmt: skip
        assert torch.equal(o, plain)
    assert calls == ["delta", "delta"]


def test_a_gradient_to_record_runs_the_array_api_form(calls: list[str]) -> None:
    x = _inputs("torch", "float64", "scalar")
    x["q"].requires_grad_(True)
    out, _ = FAMILIES["delta"](x, "recurrent")
    out.sum().backward()
    assert calls == [] and x["q"].grad is not None and bool(torch.isfinite(x["q"].grad).all())
    with torch.no_grad():  # no gradient recorded: the kernel runs, on the detached values
        FAMILIES["delta"](x, "recurrent")
    assert calls == ["delta"]


def test_other_dtypes_and_libraries_decline() -> None:
    x = _inputs("torch", "float32", "scalar")
    half = [a[:, 0].to(torch.float16) for a in (x["q"], x["k"], x["v"], x["beta"])]
    assert compiled.compiled_tokens("delta", half, None, x["S"].half(), step=True) is None
    mixed = [x["q"][:, 0].numpy(), x["k"][:, 0], x["v"][:, 0], x["beta"][:, 0]]
    assert compiled.compiled_tokens("delta", mixed, None, x["S"], step=True) is None
    wrong = [a[:, 0] for a in (x["q"], x["k"], x["v"], x["beta"])]
    assert compiled.compiled_tokens("delta", wrong, None, x["S"][:, :2], step=True) is None


def test_shared_keys_broadcast_to_the_states() -> None:
    x = _inputs("numpy", "float64", "channel")
    q, k, v, beta, g = (x[n][:, 0] for n in ("q", "k", "v", "beta", "g"))
    shared = k[:, :1]  # one key for every head (grouped heads)
    got = compiled.compiled_tokens("delta", [q, shared, v, beta], np.exp(g), x["S"], step=True)
    want = compiled.compiled_tokens(
        "delta", [q, np.broadcast_to(shared, k.shape), v, beta], np.exp(g), x["S"], step=True)
    assert got is not None and want is not None
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_an_empty_batch() -> None:
    x = _inputs("numpy", "float32", "scalar")
    empty = [x[n][:0, 0] for n in ("q", "k", "v", "beta")]
    out, S = compiled.compiled_tokens("delta", empty, None, x["S"][:0], step=True)
    assert out.shape == (0, H, D + 2) and S.shape == (0, H, D, D + 2)


def test_the_environment_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.ENVIRONMENT, "0")
    compiled.numba_module.cache_clear()
    compiled.kernel.cache_clear()
    try:
        assert not compiled.compiled_available() and compiled.kernel("delta") is None
    finally:
        monkeypatch.delenv(compiled.ENVIRONMENT)
        compiled.numba_module.cache_clear()
        compiled.kernel.cache_clear()
    assert compiled.compiled_available() and compiled.kernel("delta") is not None


def _layouts(x: np.ndarray) -> dict[str, np.ndarray]:
    """The same ``(B, H, T, w)`` values laid out four ways, each seen as ``(B, H, T, w)``."""
    return {
        "head-major": np.ascontiguousarray(x),
        "token-major": np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3),
        "tokens first": np.ascontiguousarray(x.transpose(2, 0, 1, 3)).transpose(1, 2, 0, 3),
        "strided": np.repeat(x, 2, axis=2)[:, :, ::2],
    }


@pytest.mark.parametrize("name", ["delta", "linear", "dplr"])
def test_every_layout_of_the_tokens_gives_the_same_bits(name: str) -> None:
    x = _inputs("numpy", "float64", "channel")
    names = TOKENS[name]
    tokens = [x[n].transpose(0, 2, 1, 3) for n in (*names, "g")]  # (B, H, T, w) values
    tokens[-1] = np.exp(tokens[-1])
    z = x["S"][..., 0] if name == "linear" else None
    results = {}
    for layout in _layouts(tokens[0]):
        *laid, decay = (_layouts(t)[layout] for t in tokens)
        results[layout] = compiled.compiled_tokens(name, laid, decay, x["S"], z, step=False)
    want = results.pop("head-major")
    for got in results.values():
        for a, b in zip(got, want, strict=True):
            if b is None:  # linear attention's normalizers: computed for eps alone
                assert a is None
                continue
            assert a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    # token-major tokens give a token-major output, as the caller laid them out
    assert np.moveaxis(results["token-major"][0], 2, 1).flags.c_contiguous


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("name", ["delta", "linear", "dplr"])
def test_a_sequence_gives_the_bits_of_its_steps(name: str, gate: str, dtype: str) -> None:
    """A loop over T tokens (the delta rules: each token's read of the state summed in the
    previous token's pass) gives the bits of T one-token calls, each reading its state anew."""
    x = _inputs("numpy", dtype, gate)
    names = TOKENS[name]
    tokens = [x[n].transpose(0, 2, 1, 3) for n in names]  # (B, H, T, w)
    decay = np.exp(x["g"].transpose(0, 2, 1, 3)) if gate != "none" else None
    S, z = x["S"], (x["S"][..., 0] if name == "linear" else None)
    whole = compiled.compiled_tokens(name, tokens, decay, S, z, step=False)
    outputs = []
    for t in range(T):
        at = None if decay is None else decay[:, :, t]
        done = compiled.compiled_tokens(name, [a[:, :, t] for a in tokens], at, S, z, step=True)
        S, z = done[1], (done[2] if name == "linear" else None)
        outputs.append(done[0])
    np.testing.assert_array_equal(whole[0], np.stack(outputs, axis=-2))
    np.testing.assert_array_equal(whole[1], S)
    if name == "linear":
        np.testing.assert_array_equal(whole[2], z)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_states_split_between_threads_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    x = _inputs(library, "float32", "channel")
    one = FAMILIES["dplr"](x, "recurrent")
    monkeypatch.setattr(compiled, "PART_SIZE", 1)
    monkeypatch.setattr(compiled, "kernel_threads", lambda tensors: 4)
    parts: list[int] = []
    real = compiled.in_parts
    monkeypatch.setattr(compiled, "in_parts", lambda *a: (parts.append(a[-1]), real(*a)))
    for got, want in zip(_leaves(FAMILIES["dplr"](x, "recurrent")), _leaves(one), strict=True):
        np.testing.assert_array_equal(_numpy(got), _numpy(want))
    assert parts == [4]  # B x H = 6 states in four parts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_kernels_run_as_plain_python_give_the_compiled_numbers(
    monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The kernels' Python (their reference) runs as it reads, shared pieces included."""
    x = _inputs("numpy", "float64", "channel")
    want = FAMILIES[family](x, "recurrent")
    monkeypatch.setattr(compiled, "kernel", lambda name: compiled._KERNELS[name])
    _close(FAMILIES[family](x, "recurrent"), want, "float64")


def _gates(dtype: str, n: int = 4096) -> np.ndarray:
    """Log decays over float32's whole range, with its edges: NaN, the infinities, values
    above 0, -0, and values around log of the least normal number (-87.34)."""
    rng = np.random.default_rng(3)
    g = np.concatenate([
        [np.nan, np.inf, -np.inf, 3.0, -0.0, 1e-30, -1e-30, -87.3, -87.34, -90.0, -200.0],
        -rng.uniform(0, 1, n // 2), -rng.uniform(0, 100, n // 2),
    ]).astype(dtype)  # fmt: skip
    g.flags.writeable = False  # never written
    return g[: len(g) // 3 * 3].reshape(-1, 1, 3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decay_factors_are_the_clamped_exponential(dtype: str) -> None:
    """``exp(min(g, 0))``: float32 from the compiled pass, within 1.5 x 2^-24 of the exact
    value (NumPy's float32 ``exp``: 3.4 x 2^-24) down to float32's least normal number and 0
    below it; float64 NumPy's own."""
    g = _gates(dtype)
    got = compiled.decay_factors(g)
    assert got.dtype == g.dtype and got.shape == g.shape and got is not g
    exact = np.exp(np.minimum(g.astype(np.longdouble), 0))
    if dtype == "float64":
        np.testing.assert_array_equal(got, np.exp(np.minimum(g, 0.0)))
        return
    normal = np.isfinite(exact) & (g > -87.33)
    error = np.abs(got[normal] - exact[normal]) / exact[normal]
    assert error.max() <= 1.5 * 2.0**-24
    assert np.isnan(got[np.isnan(g)]).all()
    assert (got[g >= 0] == 1).all() and (got[g <= -87.34] == 0).all()


def test_decay_factors_of_a_few_gates_are_numpys() -> None:
    """Fewer than ``EXP_BLOCK`` gates (a scalar gate per head): NumPy's ``exp``, the same bits
    as the array-API step's."""
    g = _gates("float32")[:20]
    np.testing.assert_array_equal(compiled.decay_factors(g), np.exp(np.minimum(g, 0.0)))


def test_the_gates_exponential_runs_as_plain_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`compiled.exp_gates` is its own reference: run as Python, the compiled numbers
    within a rounding (the compiled multiply-adds are fused)."""
    g = _gates("float32", 600).reshape(-1)
    want = compiled.decay_factors(g)
    monkeypatch.setattr(compiled, "_NUMPY", np)
    got = np.empty_like(g)
    with np.errstate(invalid="ignore", over="ignore"):
        compiled.exp_gates(g, got, compiled._exp_constants(np))
    np.testing.assert_allclose(got, want, rtol=3 * 2.0**-24, atol=0)


def _scaled_gates_above_zero(library: str, gate: str) -> tuple[dict, dict]:
    """float32 inputs whose gates are above 0 at a third of their entries, as given and with
    those entries at 0 (the policy of every entry point: ``polylin._inputs.gates``)."""
    x = _inputs("numpy", "float32", gate, seed=5)
    above = x["g"].copy()
    above[..., ::3] = np.abs(above[..., ::3]) + 0.5
    clamped = dict(x, g=np.minimum(above, 0))
    x["g"] = above
    if library == "torch":
        return ({n: torch.from_numpy(a) for n, a in x.items()},
                {n: torch.from_numpy(a) for n, a in clamped.items()})  # fmt: skip
    return x, clamped


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_loop_takes_the_scale_and_the_gates_as_given(
    calls: list[str], library: str, gate: str, family: str
) -> None:
    """The recurrent form scales the queries (the delta rule its output) and takes gates above
    0 as 0 on the loop's own arrays: the numbers of the array-API loop and of the chunked
    form, the caller's arrays unchanged. Float32 per-channel gates are enough entries for the
    compiled exponential (``compiled.EXP_BLOCK``), one gate per token are NumPy's."""
    x, clamped = _scaled_gates_above_zero(library, gate)
    before = {n: _numpy(a).copy() for n, a in x.items()}
    got = FAMILIES[family](x, "recurrent", scale=0.75)
    assert calls == [KERNEL[family]]
    _close(got, _without_kernels(lambda: FAMILIES[family](x, "recurrent", scale=0.75)),
           "float32")  # fmt: skip
    _close(got, FAMILIES[family](clamped, "chunked", scale=0.75), "float32")
    if family != "normalized":  # there the scale cancels but for eps
        unscaled = FAMILIES[family](clamped, "recurrent")
        assert not np.allclose(_numpy(got[0]), _numpy(unscaled[0]), rtol=0, atol=1e-3)
    for n, a in x.items():
        np.testing.assert_array_equal(_numpy(a), before[n])


#: PyTorch's operations that make views, not new entries.
VIEWS = {"alias", "as_strided", "detach", "expand", "lift_fresh", "permute", "select",
         "slice", "squeeze", "t", "transpose", "unsqueeze", "view", "_reshape_alias"}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_pytorch_operation_on_the_sequence_around_the_loop(family: str) -> None:
    """On PyTorch the recurrent form's whole call, the gates' clamp, the scale and the
    normalization included, runs on the tensors' NumPy views: PyTorch computes nothing of
    the sequence's size (an operation on a large tensor wakes its OpenMP threads, which then
    spin for milliseconds on the cores that the loop's threads need)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, _ = _scaled_gates_above_zero("torch", "channel")
    if family == "normalized":
        x = dict(x, q=abs(x["q"]), k=abs(x["k"]))
    computed: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            if func.overloadpacket.__name__ not in VIEWS and max(sizes, default=0) >= B * T:
                computed.append(str(func))
            return func(*args, **(kwargs or {}))

    run = FAMILIES[family]
    if family in ("linear", "normalized"):  # GLA's and Mamba-2's map: PyTorch maps no entry
        def run(x: dict, method: str, **options: Any) -> Any:
            return polylin.causal_linear_attention(
                x["q"], x["k"], x["v"], polylin.feature_maps.identity, log_decay=x["g"],
                normalize=family == "normalized", method=method, seq_axis=1,
                return_state=True, **options)  # fmt: skip

    with Seen():
        run(x, "recurrent", scale=0.5)
    assert computed == [], computed
    with Seen():  # and the chunked form is PyTorch's own
        run(x, "chunked", scale=0.5)
    assert computed


@pytest.mark.parametrize("offset", [0, 1])  # values at a multiple of 64 bytes, then 4 past one
@pytest.mark.parametrize("name", ["delta", "linear", "dplr"])
def test_results_start_at_cache_lines_and_misaligned_values_give_the_same_bits(
    name: str, offset: int
) -> None:
    """The sequence's output, state and normalizer start at multiples of 64 bytes, the output
    half a page from the values in the addresses' last 12 bits; values that start elsewhere
    (read from a copy at such an address) give the same bits; the caller's arrays are not
    written."""
    x = _inputs("numpy", "float32", "channel")
    names = TOKENS[name]
    tokens = [np.ascontiguousarray(x[n].transpose(0, 2, 1, 3)) for n in names]
    v = tokens[2]
    buffer = np.zeros(v.size + 32, dtype=v.dtype)
    start = (-buffer.ctypes.data % 64) // v.itemsize + offset
    tokens[2] = buffer[start : start + v.size].reshape(v.shape)
    tokens[2][...] = v
    assert (tokens[2].ctypes.data % 64 == 0) == (offset == 0)
    decay = np.exp(x["g"].transpose(0, 2, 1, 3))
    S, z = x["S"], (x["S"][..., 0].copy() if name == "linear" else None)
    before = [a.copy() for a in (*tokens, decay, S)]
    got = compiled.compiled_tokens(name, tokens, decay, S, z, step=False)
    for a in got[:3]:
        assert a.ctypes.data % compiled.ALIGNMENT == 0
    if offset == 0:  # read where they are (else a copy is)
        assert (got[0].ctypes.data - tokens[2].ctypes.data) % 4096 == 2048
    tokens[2] = v  # the same values at NumPy's own address
    want = compiled.compiled_tokens(name, tokens, decay, S, z, step=False)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip((*tokens[:2], v, *tokens[3:], decay, S), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_aligned_arrays_start_at_cache_lines_and_half_a_page_apart() -> None:
    for dtype in ("float32", "float64"):
        assert compiled.aligned_empty(np, (0, 4), np.dtype(dtype)).shape == (0, 4)
        for shape in [(3,), (2, 5, 7)]:
            a = compiled.aligned_empty(np, shape, np.dtype(dtype))
            assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
            assert a.ctypes.data % 64 == 0
            b = compiled.aligned_empty(np, shape, np.dtype(dtype), apart=a)
            assert (b.ctypes.data - a.ctypes.data) % 4096 == 2048
            assert b.flags.writeable and b.shape == shape


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_the_normalizers_are_computed_where_they_divide(gate: str) -> None:
    """A sequence without ``eps`` returns no normalizers, and the keys' sum ``z`` (a loop of
    its own then) has the bits of the one summed with the normalizers (``eps`` given)."""
    x = _inputs("numpy", "float32", gate)
    tokens = [np.abs(x[n].transpose(0, 2, 1, 3)) for n in ("q", "k")]
    tokens.append(x["v"].transpose(0, 2, 1, 3))
    decay = np.exp(x["g"].transpose(0, 2, 1, 3)) if gate != "none" else None
    S, z = x["S"], np.abs(x["S"][..., 0])
    plain = compiled.compiled_tokens("linear", tokens, decay, S, z, step=False)
    divided = compiled.compiled_tokens("linear", tokens, decay, S, z, step=False, eps=1e-6)
    assert plain[3] is None and divided[3].shape == (B, H, T, 1)
    np.testing.assert_array_equal(plain[1], divided[1])
    np.testing.assert_array_equal(plain[2], divided[2])
    np.testing.assert_array_equal(plain[0] / (divided[3] + np.float32(1e-6)), divided[0])


@pytest.mark.parametrize("name", ["delta", "linear", "dplr"])
def test_large_token_major_arrays_are_read_from_head_major_copies(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Above ``HEAD_MAJOR_BYTES`` token-major tokens are copied head-major (the output too
    comes head-major) where the kernel updates the states one at a time (each larger than
    ``ACROSS_BYTES``), with the same bits as read where they are; states that run together
    read them where they are."""
    x, tokens, z = _token_major(name)
    read = compiled.compiled_tokens(name, tokens[:-1], tokens[-1], x["S"], z, step=False)
    monkeypatch.setattr(compiled, "HEAD_MAJOR_BYTES", tokens[0].nbytes - 1)
    together = compiled.compiled_tokens(name, tokens[:-1], tokens[-1], x["S"], z, step=False)
    monkeypatch.setattr(compiled, "ACROSS_BYTES", 1)
    copied = compiled.compiled_tokens(name, tokens[:-1], tokens[-1], x["S"], z, step=False)
    for token_major in (read[0], together[0]):
        assert np.moveaxis(token_major, 2, 1).flags.c_contiguous
    assert copied[0].flags.c_contiguous  # head-major
    for a, b, c in zip(copied, read, together, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)


@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("name", ["delta", "linear", "dplr"])
def test_states_updated_together_give_the_bits_of_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch, name: str, parts: int
) -> None:
    """The states of a token row that the kernel updates token by token together (as many as
    ``ACROSS_BYTES`` holds: blocks of 1, 2 and all 3 heads, within each thread's part of the
    states) give the bits of each state's tokens run on their own."""
    x, tokens, z = _token_major(name)
    widths: list[int] = []
    real = compiled.kernel

    def spied(kernel_name: str) -> Any:
        run = real(kernel_name)
        return lambda *args: (widths.append(args[-3]), run(*args))

    monkeypatch.setattr(compiled, "kernel", spied)
    monkeypatch.setattr(compiled, "PART_SIZE", 1 if parts > 1 else compiled.PART_SIZE)
    monkeypatch.setattr(compiled, "kernel_threads", lambda tensors: parts)
    size = x["S"][0, 0].nbytes
    results = []
    for width in (1, 2, 3):
        monkeypatch.setattr(compiled, "ACROSS_BYTES", width * size + size // 2)
        results.append(compiled.compiled_tokens(name, tokens[:-1], tokens[-1], x["S"], z,
                                                step=False))  # fmt: skip
    assert sorted(set(widths)) == [1, 2, 3]
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            if b is not None:
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("name", ["delta", "linear", "dplr"])
def test_shared_token_rows_are_read_for_every_state_not_copied(
    monkeypatch: pytest.MonkeyPatch, name: str, layout: str
) -> None:
    """Keys and queries shared by every state (Mamba-2's ``B`` and ``C`` of one group) reach
    the kernel as one state's, not copied to each, and give the bits of the copies."""
    x = _inputs("numpy", "float32", "channel")
    names = TOKENS[name]
    tokens = [x[n].transpose(0, 2, 1, 3) for n in names]  # (B, H, T, w) token-major views
    if layout == "head-major":
        tokens = [np.ascontiguousarray(t) for t in tokens]
    decay = np.exp(x["g"].transpose(0, 2, 1, 3))
    shared = [t[:1, :1] for t in tokens[:2]]  # one state's q and k for all
    copies = [np.ascontiguousarray(np.broadcast_to(t, tokens[0].shape)) for t in shared]
    z = x["S"][..., 0] if name == "linear" else None
    want = compiled.compiled_tokens(name, [*copies, *tokens[2:]], decay, x["S"], z, step=False)
    seen: list[tuple[int, ...]] = []
    real = compiled.kernel

    def spied(kernel_name: str) -> Any:
        run = real(kernel_name)
        return lambda *args: (seen.extend(a.shape for a in args[:2]), run(*args))

    monkeypatch.setattr(compiled, "kernel", spied)
    got = compiled.compiled_tokens(name, [*shared, *tokens[2:]], decay, x["S"], z, step=False)
    for a, b in zip(got, want, strict=True):
        if b is not None:
            np.testing.assert_array_equal(a, b)
    assert seen == [(1, T, 1, D)] * 2  # (P, T, Q, width), not (B x H, T, 1, D) or (B, T, H, D)


@pytest.mark.parametrize("m", [7, 8])
def test_rwkv7_loop_for_odd_and_even_key_channels(m: int) -> None:
    """RWKV-7's loop over 7 or 8 key channels: the sequence has its steps' bits and the
    array-API loop's numbers."""
    rng = np.random.default_rng(5)
    q, k, a, b = (rng.standard_normal((2, 3, T, m)).astype(np.float32) / 2 for _ in range(4))
    v = rng.standard_normal((2, 3, T, 5)).astype(np.float32)
    decay = np.exp(-rng.random((2, 3, T, m))).astype(np.float32)
    S = rng.standard_normal((2, 3, m, 5)).astype(np.float32)
    out, state = compiled.compiled_tokens("dplr", [q, k, v, a, b], decay, S, step=False)
    outputs, at = [], S
    for t in range(T):
        o, at = compiled.compiled_tokens(
            "dplr", [x[:, :, t] for x in (q, k, v, a, b)], decay[:, :, t], at, step=True)
        outputs.append(o)
    np.testing.assert_array_equal(out, np.stack(outputs, axis=-2))
    np.testing.assert_array_equal(state, at)
    want = _without_kernels(lambda: polylin.dplr_delta_rule(
        q, k, v, a, b, log_decay=np.log(decay), initial_state=S, return_state=True,
        method="recurrent"))  # fmt: skip
    scale = float(np.abs(want[0]).max())
    np.testing.assert_allclose(out, want[0], rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(state, want[1], rtol=0, atol=2e-5 * float(np.abs(want[1]).max()))
