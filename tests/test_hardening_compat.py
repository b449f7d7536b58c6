"""polylin.compat.fla, hardening (issue 40): integer inputs, the head-first layout, fla's order.

- Every array argument of every twin (``q``, ``k``, ``v``, the gates, ``beta``,
  ``initial_state``, an array ``scale``) must have a real floating dtype: an integer one is a
  ``TypeError`` naming it (polylin's core message), never a truncated integer output.
- fla's ops take ``(B, T, H, K)``; a head-first ``(B, H, T, K)`` input reads as ``T < H`` and
  warns, with the fix in the message; fla-layout inputs (one-token calls too) do not.
- The twins' signatures are fla 0.6.0's (read from fla's installed source: its package imports
  Triton, absent here), and ``fused_recurrent_gated_delta_rule(q, k, v, g, beta)``, the call of
  fla's own docs, computes what the keyword call does.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polylin.compat import fla

OPS = [name for name in fla.__all__ if name != "FLA_VERSION"]

#: The ops' variants beside the one :func:`arguments` builds by default: ``g_gamma`` for ``g``
#: (simple GLA), ``gk`` for ``g`` (the KDA transition of the gated delta rule's twin).
VARIANTS = {
    "chunk_simple_gla": ["g_gamma"],
    "fused_recurrent_simple_gla": ["g_gamma"],
    "fused_recurrent_gated_delta_rule": ["gk"],
}


def arguments(op: str, variant: str | None = None, T: int = 6, H: int = 2) -> dict[str, Any]:
    """Valid float64 keyword arguments of ``op`` by fla's names: ``(B, T, H, d)`` inputs, a
    state and an array ``scale``."""
    rng = np.random.default_rng(0)
    B, K, V = 1, 4, 3

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape)

    def gate(*shape: int) -> np.ndarray:
        return -rng.uniform(0.05, 0.5, shape)

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    family = op.removeprefix("chunk_").removeprefix("fused_recurrent_")
    family = "rwkv7" if "rwkv7" in op else family
    first = "r" if "rwkv" in op else "q"
    x: dict[str, Any] = {first: normal(B, T, H, K)}
    if "rwkv" in op:
        x["w"] = gate(B, T, H, K)
    x["k"], x["v"] = normal(B, T, H, K), normal(B, T, H, V)
    if family == "rwkv6":
        x["u"] = normal(H, K)
    if family == "gated_delta_product":  # two Householder sub-steps per token
        x["k"], x["v"] = unit(normal(B, 2 * T, H, K)), normal(B, 2 * T, H, V)
        x["g"], x["beta"] = gate(B, T, H), rng.uniform(0.1, 0.9, (B, 2 * T, H))
        x["num_householder"] = 2
    if family == "comba":
        x["k"], x["p"] = unit(x["k"]), unit(normal(B, T, H, K))
        x["g"], x["beta"] = gate(B, T, H), rng.uniform(0.1, 0.9, (B, T, H))
    if family == "gdn2":
        x["k"] = unit(x["k"])
        x["g"], x["b"] = gate(B, T, H, K), rng.uniform(0.1, 0.9, (B, T, H, K))
        x["w"] = rng.uniform(0.1, 0.9, (B, T, H, V))
    if family == "linear_attn":  # positive: the normalizer stays away from 0
        x["q"], x["k"] = np.abs(x["q"]) + 0.1, np.abs(x["k"]) + 0.1
    if family in ("delta_rule", "gated_delta_rule", "kda"):
        x["k"] = unit(x["k"])
    if family == "simple_gla":
        x.update({"g_gamma": gate(H)} if variant == "g_gamma" else {"g": gate(B, T, H)})
    elif family == "gla":
        x["g" if op.startswith("chunk_") else "gk"] = gate(B, T, H, K)
    elif family == "gated_delta_rule":
        x.update({"gk": gate(B, T, H, K)} if variant == "gk" else {"g": gate(B, T, H)})
    elif family == "kda":
        x["g"] = gate(B, T, H, K)
    if family in ("delta_rule", "gated_delta_rule", "kda"):
        x["beta"] = rng.uniform(0.1, 0.9, (B, T, H))
    if family in ("dplr_delta_rule", "rwkv7"):
        kk = unit(normal(B, T, H, K))
        if op == "fused_mul_recurrent_rwkv7":
            x["kk"], x["a"] = kk, rng.uniform(0.1, 0.9, (B, T, H, K))
        else:
            x["a"], x["b"] = -kk, kk * rng.uniform(0.1, 0.9, (B, T, H, K))
    if op == "chunk_dplr_delta_rule" or op == "fused_recurrent_dplr_delta_rule":
        x["gk"] = gate(B, T, H, K)
    x["scale"] = np.asarray(0.5)
    x["initial_state"] = 0.1 * normal(B, H, K, V)
    return x


CASES = [(op, None) for op in OPS] + [(op, v) for op, vs in VARIANTS.items() for v in vs]
CASE_IDS = [op if v is None else f"{op}[{v}]" for op, v in CASES]

INTEGER_CASES = [
    (op, variant, name) for op, variant in CASES for name, value in arguments(op, variant).items()
    if isinstance(value, np.ndarray)
]  # fmt: skip
INTEGER_IDS = [f"{op if v is None else f'{op}[{v}]'}-{name}" for op, v, name in INTEGER_CASES]


# --------------------------------------------------------------------------------------------
# Item 1: integer arrays are a TypeError naming the argument, in every twin
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "variant", "name"), INTEGER_CASES, ids=INTEGER_IDS)
def test_an_integer_argument_is_a_type_error_naming_it(op, variant, name):
    """Each array argument made integer in turn (the others float): polylin's core message,
    ``<name> must have a real floating dtype``, never an integer (truncated) output."""
    x = arguments(op, variant)
    fn = getattr(fla, op)
    o, _ = fn(**x)  # the float call is valid
    assert np.issubdtype(o.dtype, np.floating)
    x[name] = np.asarray(np.round(4 * x[name]), dtype=np.int64)  # 0-d for scale: an array
    with pytest.raises(TypeError, match=rf"^{name} must have a real floating dtype, got int64"):
        fn(**x)


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gla", "chunk_rwkv7"])
def test_an_integer_first_argument_is_a_type_error_on_every_backend(backend, op):
    """The first argument integer, the others float (their common dtype would be floating and
    the output would take the first argument's integer dtype): a ``TypeError`` everywhere."""
    x = {n: backend.from_numpy(a) for n, a in arguments(op).items()}
    first = "r" if "rwkv7" in op else "q"
    x[first] = backend.from_numpy(np.ones((1, 6, 2, 4), dtype=np.int64))
    with pytest.raises(TypeError, match=rf"^{first} must have a real floating dtype"):
        getattr(fla, op)(**x)


def test_an_integer_part_of_the_linear_attention_state_is_named():
    """``chunk_linear_attn``'s normalized state is a tuple ``(kv_state, z_state)``."""
    x = arguments("chunk_linear_attn")
    S0 = x.pop("initial_state")
    z0 = np.ones((1, 1, 2, 4))
    o, _ = fla.chunk_linear_attn(**x, initial_state=(S0, z0))
    assert o.dtype == np.float64
    with pytest.raises(TypeError, match=r"^initial_state\[1\] must have a real floating dtype"):
        fla.chunk_linear_attn(**x, initial_state=(S0, z0.astype(np.int64)))
    with pytest.raises(TypeError, match=r"^initial_state\[0\] must have a real floating dtype"):
        fla.chunk_linear_attn(**x, initial_state=(S0.astype(np.int32), z0))


def test_an_integer_array_is_checked_on_the_one_token_path():
    """A one-token call whose float signature was checked (and planned) before still rejects
    an integer ``beta`` of the same shape (a new signature, never the kept plan)."""
    x = arguments("fused_recurrent_gated_delta_rule", T=1)
    for _ in range(2):
        fla.fused_recurrent_gated_delta_rule(**x)
    x["beta"] = np.ones((1, 1, 2), dtype=np.int64)
    with pytest.raises(TypeError, match=r"^beta must have a real floating dtype"):
        fla.fused_recurrent_gated_delta_rule(**x)


# --------------------------------------------------------------------------------------------
# Item 4: a head-first input warns, fla's layout does not; the first docstring line says so
# --------------------------------------------------------------------------------------------


def head_first(x: dict[str, Any]) -> dict[str, Any]:
    """The per-token arrays ``(B, T, H, ...)`` of ``x`` as head-first ``(B, H, T, ...)``
    (without the state and ``g_gamma``, whose head count no longer fits)."""
    return {
        n: np.swapaxes(a, 1, 2) if np.ndim(a) >= 3 else a
        for n, a in x.items()
        if n not in ("initial_state", "g_gamma")
    }


@pytest.mark.parametrize(("op", "variant"), CASES, ids=CASE_IDS)
def test_head_first_inputs_warn_and_flas_layout_does_not(op, variant):
    """(B, H, T, K) = (1, 2, 6, 4) read as fla's (B, T, H, K): T = 2 < H = 6, a warning that
    gives the fix; (1, 6, 2, 4) and a one-token call (T = 1 < H = 2, decoding) do not warn."""
    fn = getattr(fla, op)
    x = arguments(op, variant)
    first = "r" if "rwkv" in op else "q"
    # DeltaProduct's k, v, beta have num_householder times q's tokens, RWKV-6's u is (H, K):
    # swapped, the shapes no longer fit, and the shape error follows the warning.
    uncomputable = op == "chunk_gated_delta_product" or "rwkv6" in op
    mismatch = pytest.raises(ValueError) if uncomputable else None
    with pytest.warns(UserWarning, match=r"looks like a head-first \(B, H, T, K\)") as record:
        if mismatch is None:
            fn(**head_first(x))
        else:
            with mismatch:
                fn(**head_first(x))
    message = str(record[0].message)
    assert f"polylin.compat.fla.{op}: {first} of shape (1, 2, 6, 4)" in message
    assert "T=2 tokens < H=6 heads" in message
    assert "x.transpose(1, 2)" in message and "(B, T, H, ...)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(**x)
        fn(**arguments(op, variant, T=1))
        fn(**arguments(op, variant, T=2, H=2))  # T == H: not suspect


def test_the_warning_points_at_the_callers_line():
    x = head_first(arguments("chunk_gated_delta_rule"))
    with pytest.warns(UserWarning, match="head-first") as record:
        fla.chunk_gated_delta_rule(**x)
    assert record[0].filename == __file__


def test_transposing_as_the_warning_says_gives_flas_answer():
    """The head-first call is computed as given (a wrong answer); transposed back it is right."""
    x = arguments("chunk_gated_delta_rule")
    x.pop("initial_state")
    right, _ = fla.chunk_gated_delta_rule(**x)
    with pytest.warns(UserWarning, match="head-first"):
        wrong, _ = fla.chunk_gated_delta_rule(**head_first(x))
    assert not np.allclose(np.swapaxes(wrong, 1, 2), right)
    fixed = {n: np.swapaxes(a, 1, 2) if a.ndim >= 3 else a for n, a in head_first(x).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = fla.chunk_gated_delta_rule(**fixed)
    np.testing.assert_array_equal(o, right)


@pytest.mark.parametrize("op", OPS)
def test_first_docstring_line_states_the_layout(op):
    summary = getattr(fla, op).__doc__.splitlines()[0]
    assert summary.startswith(f"Compute fla's ``{op}`` on ``(B, T, H, d)`` inputs")


# --------------------------------------------------------------------------------------------
# Item 6: fla 0.6.0's signatures, and the positional call of fla's docs
# --------------------------------------------------------------------------------------------

#: Where fla 0.6.0 defines each op, under ``fla/ops/``.
FLA_FILES = {
    "chunk_linear_attn": "linear_attn/chunk.py",
    "fused_recurrent_linear_attn": "linear_attn/fused_recurrent.py",
    "chunk_simple_gla": "simple_gla/chunk.py",
    "fused_recurrent_simple_gla": "simple_gla/fused_recurrent.py",
    "chunk_gla": "gla/chunk.py",
    "fused_recurrent_gla": "gla/fused_recurrent.py",
    "chunk_retention": "retention/chunk.py",
    "chunk_delta_rule": "delta_rule/chunk.py",
    "fused_recurrent_delta_rule": "delta_rule/fused_recurrent.py",
    "chunk_gated_delta_rule": "gated_delta_rule/chunk.py",
    "fused_recurrent_gated_delta_rule": "gated_delta_rule/fused_recurrent.py",
    "chunk_kda": "kda/chunk.py",
    "fused_recurrent_kda": "kda/fused_recurrent.py",
    "chunk_dplr_delta_rule": "generalized_delta_rule/dplr/chunk.py",
    "fused_recurrent_dplr_delta_rule": "generalized_delta_rule/dplr/fused_recurrent.py",
    "chunk_rwkv7": "rwkv7/chunk.py",
    "fused_recurrent_rwkv7": "rwkv7/fused_recurrent.py",
    "fused_mul_recurrent_rwkv7": "rwkv7/fused_recurrent.py",
    "chunk_rwkv6": "rwkv6/chunk.py",
    "fused_recurrent_rwkv6": "rwkv6/fused_recurrent.py",
    "chunk_gated_delta_product": "gated_delta_product/chunk.py",
    "chunk_comba": "comba/chunk.py",
    "fused_recurrent_comba": "comba/fused_recurrent.py",
    "chunk_gdn2": "gdn2/chunk.py",
    "fused_recurrent_gdn2": "gdn2/fused_recurrent.py",
}


def test_every_twin_has_its_fla_file():
    assert sorted(FLA_FILES) == sorted(OPS)


def fla_signature(op: str) -> list[tuple[str, str, str]]:
    """``(name, kind, default source)`` of fla's ``op``, parsed from fla's source (importing
    fla needs Triton); skips unless fla-core of :data:`polylin.compat.fla.FLA_VERSION` is here."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    version = importlib.metadata.version("fla-core")
    if version != fla.FLA_VERSION:
        pytest.skip(f"fla-core {version} is installed; the twins follow {fla.FLA_VERSION}")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / FLA_FILES[op]
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == op]
    a = node.args
    params = a.posonlyargs + a.args
    defaults = [None] * (len(params) - len(a.defaults)) + list(a.defaults)
    out = [
        (p.arg, "POSITIONAL_OR_KEYWORD", "" if d is None else ast.unparse(d))
        for p, d in zip(params, defaults)
    ]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", ""))
    out += [
        (p.arg, "KEYWORD_ONLY", "" if d is None else ast.unparse(d))
        for p, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", ""))
    return out


@pytest.mark.parametrize("op", OPS)
def test_signature_is_flas(op):
    """Names, order, kinds and defaults of fla 0.6.0's function of the same name."""
    ours = [
        (p.name, p.kind.name, "" if p.default is inspect.Parameter.empty else repr(p.default))
        for p in inspect.signature(getattr(fla, op)).parameters.values()
    ]
    assert ours == fla_signature(op)


def test_positional_gated_delta_rule_call_equals_the_keyword_call(backend):
    """``(q, k, v, g, beta)``, as fla's docs and transformers call it (fla 0.6's fifth parameter
    is ``gk``: a ``(B, T, HV)`` array there beside ``g`` is ``beta``); a sequence and one
    token, with a state and options by keyword."""
    for T in (6, 1):
        x = {n: backend.from_numpy(a) for n, a in arguments("gated_delta_rule", T=T).items()}
        options = {"initial_state": x["initial_state"], "output_final_state": True}
        q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
        o_kw, S_kw = fla.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **options)
        o_pos, S_pos = fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **options)
        np.testing.assert_array_equal(backend.to_numpy(o_pos), backend.to_numpy(o_kw))
        np.testing.assert_array_equal(backend.to_numpy(S_pos), backend.to_numpy(S_kw))
        o_chunk, _ = fla.chunk_gated_delta_rule(q, k, v, g, beta, **options)
        np.testing.assert_allclose(backend.to_numpy(o_pos), backend.to_numpy(o_chunk), rtol=1e-9)


def test_positional_gk_is_still_flas_fifth_parameter():
    """fla 0.6's own order: ``(q, k, v, None, gk, None, beta)`` positionally, the KDA gate."""
    x = arguments("fused_recurrent_gated_delta_rule", "gk")
    q, k, v, gk, beta = (x[n] for n in ("q", "k", "v", "gk", "beta"))
    o_kw, _ = fla.fused_recurrent_gated_delta_rule(q, k, v, gk=gk, beta=beta)
    o_pos, _ = fla.fused_recurrent_gated_delta_rule(q, k, v, None, gk, None, beta)
    np.testing.assert_array_equal(o_pos, o_kw)
    np.testing.assert_allclose(o_pos, fla.fused_recurrent_kda(q, k, v, gk, beta)[0], rtol=1e-12)


def test_positional_arguments_past_beta_say_where_they_landed():
    """``(q, k, v, g, beta, scale)`` puts ``scale`` in ``gv``: a ``TypeError`` naming where each
    argument landed and the call by keyword (not fla's silent misreading)."""
    x = arguments("gated_delta_rule")
    q, k, v, g, beta, S0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    with pytest.raises(TypeError) as info:
        fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.5)
    message = str(info.value)
    assert "(q, k, v, g, gk, gv, beta, scale, initial_state, ...)" in message
    assert "`gk` got an array of shape (1, 6, 2), `gv` got 0.5" in message
    assert "beta=beta" in message and "by keyword" in message
    with pytest.raises(TypeError, match=r"`gv` got 0.5, `beta` got an array of shape \(1, 2, 4, 3"):
        fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.5, S0)


def test_g_and_a_gate_gk_together_still_raise_with_the_keyword_hint():
    x = arguments("fused_recurrent_gated_delta_rule", "gk")
    q, k, v, gk, beta = (x[n] for n in ("q", "k", "v", "gk", "beta"))
    g = gk[..., 0]
    with pytest.raises(NotImplementedError, match="does not support `g` and `gk` together") as e:
        fla.fused_recurrent_gated_delta_rule(q, k, v, g, gk, beta=beta)
    assert "pass beta=... by keyword" in str(e.value)
