"""polylin.compat.fla: fla's signatures and layouts against float64 loops and fla's naive forms.

The reference below is the per-token recurrence written out in fla's layout ``(B, T, H, d)``
with grouped value heads (query/key head ``j // G`` serves value head ``j``), run per sequence
for ``cu_seqlens``: an independent float64 statement of what each op computes. With ``a, b``
it is the generalized (DPLR) rule, ``S_t = diag(exp(gk_t)) S_{t-1} + b_t (a_t^T S_{t-1}) +
k_t v_t^T``.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from typing import Any

import array_api_compat
import numpy as np
import pytest

from polylin.compat import fla
from polylin.testing import Backend

# --------------------------------------------------------------------------------------------
# The reference: the recurrence, one token at a time, float64, fla's layout
# --------------------------------------------------------------------------------------------


def reference(
    q: Any,
    k: Any,
    v: Any,
    *,
    beta: Any = None,
    g: Any = None,
    a: Any = None,
    b: Any = None,
    scale: float | None = None,
    S0: Any = None,
    z0: Any = None,
    delta: bool = False,
    normalize: bool = False,
    l2norm: bool = False,
) -> tuple[Any, Any, Any]:
    """``(o, S, z)`` of one sequence batch; NumPy or PyTorch arrays (gradients flow)."""
    xp = array_api_compat.array_namespace(q)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K**-0.5 if scale is None else scale
    q = xp.stack([q[:, :, j // G] for j in range(HV)], axis=2)
    k = xp.stack([k[:, :, j // G] for j in range(HV)], axis=2)
    if l2norm:  # fla's l2norm: x / sqrt(sum x^2 + 1e-6)
        q = q / xp.sqrt(xp.sum(q * q, axis=-1, keepdims=True) + 1e-6)
        k = k / xp.sqrt(xp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    S = xp.zeros((B, HV, K, V), dtype=q.dtype) if S0 is None else S0
    z = xp.zeros((B, HV, K), dtype=q.dtype) if z0 is None else z0
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
        if a is not None:  # the DPLR term reads the state before the token's decay
            read = xp.sum(S * a[:, t][..., None], axis=-2)
        if g is not None:
            decay = xp.exp(g[:, t])
            S = S * (decay[..., None] if decay.ndim == 3 else decay[..., None, None])
        if a is not None:
            S = S + b[:, t][..., None] * read[..., None, :]
        if delta:
            b_t = 1.0 if beta is None else beta[:, t][..., None]
            u = b_t * (v_t - xp.sum(S * k_t[..., None], axis=-2))
            S = S + k_t[..., None] * u[..., None, :]
        else:
            S = S + k_t[..., None] * v_t[..., None, :]
            z = z + k_t
        o = scale * xp.sum(q_t[..., None] * S, axis=-2)
        if normalize:
            o = o / (scale * xp.sum(q_t * z, axis=-1)[..., None] + 1e-10)
        outs.append(o)
    o = xp.stack(outs, axis=1) if outs else xp.zeros((B, 0, HV, V), dtype=q.dtype)
    return o, S, z


def reference_varlen(offsets: list[int], q: Any, k: Any, v: Any, **kw: Any) -> tuple[Any, Any]:
    """Packed sequences ``(1, T, ...)``, each from its own state ``kw['S0'][n]``."""
    xp = array_api_compat.array_namespace(q)
    S0 = kw.pop("S0", None)
    per_token = {n: kw.pop(n) for n in ("beta", "g", "a", "b") if kw.get(n) is not None}
    outs, states = [], []
    for n, (a, b) in enumerate(itertools.pairwise(offsets)):
        cut = {name: x[:, a:b] for name, x in per_token.items()}
        o, S, _ = reference(
            q[:, a:b], k[:, a:b], v[:, a:b], S0=None if S0 is None else S0[n : n + 1], **cut, **kw
        )
        outs.append(o)
        states.append(S)
    return xp.concat(outs, axis=1), xp.concat(states, axis=0)


# --------------------------------------------------------------------------------------------
# The ops: how each is called, and what its reference is
# --------------------------------------------------------------------------------------------

LINEAR = ["linear_attn", "simple_gla", "simple_gla_gamma", "gla", "retention"]
DELTA = ["delta_rule", "gated_delta_rule", "kda"]
DPLR = ["dplr_delta_rule", "rwkv7"]


#: fla's ``chunk_size`` keyword where the op takes one (T = 37 is not a multiple of any).
CHUNK_SIZES = {"simple_gla": 16, "simple_gla_gamma": 8, "retention": 16, "delta_rule": 16,
               "gated_delta_rule": 16, "kda": 32, "dplr_delta_rule": 16,
               "rwkv7": 16}  # fmt: skip

#: The default ``scale`` where it is not ``K ** -0.5`` (fla's chunk_rwkv7: 1).
DEFAULT_SCALES = {("rwkv7", "chunk"): 1.0}


def retention_gates(H: int) -> np.ndarray:
    return np.log(1.0 - 2.0 ** (-5.0 - np.arange(H, dtype=np.float32))).astype(np.float64)


def make_inputs(
    family: str, rng: np.random.Generator, B: int, T: int, H: int, G: int, K: int, V: int
) -> dict[str, np.ndarray]:
    """fla-layout NumPy inputs for ``family`` (unit keys for the delta rule)."""
    HV = H * G
    x = {
        "q": rng.standard_normal((B, T, H, K)),
        "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, HV, V)),
    }
    if family in DELTA:
        x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
        x["beta"] = rng.uniform(0.1, 1.0, (B, T, HV))
    if family == "linear_attn":  # positive keys and queries keep the normalizer away from 0
        x["q"], x["k"] = np.abs(x["q"]) + 0.1, np.abs(x["k"]) + 0.1
    if family in ("simple_gla", "gated_delta_rule"):
        x["g"] = -rng.uniform(0.01, 0.5, (B, T, HV))
    if family == "simple_gla_gamma":
        x["g_gamma"] = -rng.uniform(0.01, 0.5, (H,))
    if family in ("gla", "kda"):
        x["g"] = -rng.uniform(0.01, 0.5, (B, T, HV, K))
    if family in DPLR:  # RWKV-7's transition: a = -kk, b = kk * a_lr, per key head
        kk = rng.standard_normal((B, T, H, K))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        x["a"], x["b"] = -kk, kk * rng.uniform(0.1, 0.9, (B, T, H, K))
        x["g"] = -rng.uniform(0.01, 0.5, (B, T, H, K))
    return x


def call(family: str, form: str, x: dict[str, Any], **options: Any) -> tuple[Any, Any]:
    """The compat op ``{form}_{family}`` on inputs ``x`` (fla's argument names)."""
    q, k, v = x["q"], x["k"], x["v"]
    name = {"simple_gla_gamma": "simple_gla"}.get(family, family)
    fn = getattr(fla, f"{form}_{name}")
    if family == "linear_attn":
        options.setdefault("normalize", False)
        return fn(q, k, v, **options)
    if family == "simple_gla":
        return fn(q, k, v, g=x["g"], **options)
    if family == "simple_gla_gamma":
        return fn(q, k, v, g_gamma=x["g_gamma"], **options)
    if family == "gla":
        return fn(q, k, v, **({"g": x["g"]} if form == "chunk" else {"gk": x["g"]}), **options)
    if family == "retention":
        return fn(q, k, v, **options)
    if family == "delta_rule":
        return fn(q, k, v, x["beta"], **options)
    if family == "dplr_delta_rule":
        return fn(q, k, v, x["a"], x["b"], x["g"], **options)
    if family == "rwkv7":  # r, w, k, v, a, b; fused_recurrent_rwkv7 returns the state by default
        options.setdefault("output_final_state", False)
        return fn(q, x["g"], k, v, x["a"], x["b"], **options)
    return fn(q, k, v, g=x["g"], beta=x["beta"], **options)


def reference_gates(family: str, x: dict[str, Any]) -> dict[str, Any]:
    """The reference's ``beta``/``g``/``delta`` for ``family`` (NumPy inputs)."""
    B, T, H, _ = x["q"].shape
    if family == "retention":
        return {"g": np.broadcast_to(retention_gates(H), (B, T, H))}
    if family == "simple_gla_gamma":
        return {"g": np.broadcast_to(x["g_gamma"], (B, T, H))}
    if family in DPLR:  # per key head: each serves its HV // H value heads
        G = x["v"].shape[2] // H
        xp = array_api_compat.array_namespace(x["q"])
        return {n: xp.stack([x[n][:, :, j // G] for j in range(H * G)], axis=2) for n in "gab"}
    return {"g": x.get("g"), "beta": x.get("beta"), "delta": family in DELTA}


def tolerance(dtype: Any) -> dict[str, float]:
    return {"rtol": 1e-9, "atol": 1e-9}


# --------------------------------------------------------------------------------------------
# Every op against the reference
# --------------------------------------------------------------------------------------------


#: What fla itself does not define: grouped values for the linear family, and one twin.
NO_GROUPED_LINEAR = pytest.mark.not_generated(
    "fla's linear family has one value head per query head", family=LINEAR, G=2
)
NO_RETENTION_TWIN = pytest.mark.not_generated(
    "fla 0.6.0's retention twin is not part of polylin.compat.fla",
    family="retention",
    form="fused_recurrent",
)


@NO_GROUPED_LINEAR
@NO_RETENTION_TWIN
@pytest.mark.slow_grid(cover=("family",))
@pytest.mark.parametrize("form", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("family", LINEAR + DELTA + DPLR)
@pytest.mark.parametrize("G", [1, 2])
def test_op_matches_reference_with_states_and_scale(backend, family, form, G):
    """Initial and final state, an explicit scale, T not a multiple of the chunk, HV = G * H."""
    rng = np.random.default_rng(hash((family, form, G)) % 2**32)
    B, T, H, K, V = 2, 37, 2, 4, 3
    x = make_inputs(family, rng, B, T, H, G, K, V)
    S0 = rng.standard_normal((B, H * G, K, V)) * 0.3
    xb = {n: backend.from_numpy(a) for n, a in x.items()}
    chunking = (
        {"chunk_size": CHUNK_SIZES[family]} if form == "chunk" and family in CHUNK_SIZES else {}
    )
    o, S = call(
        family, form, xb, scale=0.7, initial_state=backend.from_numpy(S0),
        output_final_state=True, **chunking,
    )  # fmt: skip
    ref_o, ref_S, _ = reference(
        x["q"], x["k"], x["v"], scale=0.7, S0=S0, **reference_gates(family, x)
    )
    assert type(o) is type(xb["q"]) and o.dtype == xb["q"].dtype
    np.testing.assert_allclose(backend.to_numpy(o), ref_o, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(backend.to_numpy(S), ref_S, rtol=1e-8, atol=1e-9)
    # without output_final_state there is no state; the default scale is K ** -0.5
    o, S = call(family, form, xb)
    ref_o, _, _ = reference(
        x["q"], x["k"], x["v"], scale=DEFAULT_SCALES.get((family, form)),
        **reference_gates(family, x),
    )  # fmt: skip
    assert S is None
    np.testing.assert_allclose(backend.to_numpy(o), ref_o, rtol=1e-8, atol=1e-9)


@NO_RETENTION_TWIN
@pytest.mark.slow_grid
@pytest.mark.parametrize("form", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("family", LINEAR + DELTA + DPLR)
def test_varlen_each_sequence_from_its_own_state(backend, family, form):
    """``cu_seqlens`` (an integer array, B == 1): sequences never see each other."""
    rng = np.random.default_rng(7)
    offsets = [0, 5, 5, 17, 30]
    H, G, K, V = 2, 1 if family in LINEAR else 2, 4, 3
    x = make_inputs(family, rng, 1, offsets[-1], H, G, K, V)
    S0 = rng.standard_normal((len(offsets) - 1, H * G, K, V)) * 0.3
    xp = backend.namespace()
    cu = xp.asarray(np.asarray(offsets, dtype=np.int64), device=backend.device)
    xb = {n: backend.from_numpy(a) for n, a in x.items()}
    o, S = call(
        family, form, xb, cu_seqlens=cu, initial_state=backend.from_numpy(S0),
        output_final_state=True,
    )  # fmt: skip
    gates = reference_gates(family, x)
    ref_o, ref_S = reference_varlen(
        offsets, x["q"], x["k"], x["v"], S0=S0, scale=DEFAULT_SCALES.get((family, form)), **gates
    )
    np.testing.assert_allclose(backend.to_numpy(o), ref_o, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(backend.to_numpy(S), ref_S, rtol=1e-8, atol=1e-9)


@pytest.mark.slow_grid
@pytest.mark.parametrize("form", ["chunk", "fused_recurrent"])
def test_normalized_linear_attention_and_its_key_sum(backend, form):
    """``normalize=True``: fla's ``(kv_state, z_state)`` tuple in and out, z ``(N, 1, H, K)``."""
    rng = np.random.default_rng(3)
    B, T, H, K, V = 2, 19, 2, 4, 3
    x = make_inputs("linear_attn", rng, B, T, H, 1, K, V)
    S0 = np.abs(rng.standard_normal((B, H, K, V)))
    z0 = np.abs(rng.standard_normal((B, 1, H, K)))
    fn = getattr(fla, f"{form}_linear_attn")
    q, k, v = (backend.from_numpy(x[n]) for n in "qkv")
    o, (S, z) = fn(
        q, k, v, initial_state=(backend.from_numpy(S0), backend.from_numpy(z0)),
        output_final_state=True, normalize=True,
    )  # fmt: skip
    ref_o, ref_S, ref_z = reference(x["q"], x["k"], x["v"], S0=S0, z0=z0[:, 0], normalize=True)
    np.testing.assert_allclose(backend.to_numpy(o), ref_o, rtol=1e-8)
    np.testing.assert_allclose(backend.to_numpy(S), ref_S, rtol=1e-8)
    np.testing.assert_allclose(backend.to_numpy(z), ref_z[:, None], rtol=1e-8)
    o, (S, z) = fn(q, k, v, normalize=True)  # fla returns the key sum even without the state
    assert S is None and tuple(z.shape) == (B, 1, H, K)


@pytest.mark.slow_grid
@pytest.mark.parametrize("family", ["gla", "gated_delta_rule"])
def test_state_v_first_transposes_states(backend, family):
    rng = np.random.default_rng(5)
    x = make_inputs(family, rng, 1, 9, 2, 1, 4, 3)
    S0 = rng.standard_normal((1, 2, 4, 3))
    xb = {n: backend.from_numpy(a) for n, a in x.items()}
    o, S = call(family, "chunk", xb, initial_state=backend.from_numpy(S0), output_final_state=True)
    o_t, S_t = call(
        family, "chunk", xb, initial_state=backend.from_numpy(np.swapaxes(S0, -1, -2)),
        output_final_state=True, state_v_first=True,
    )  # fmt: skip
    np.testing.assert_allclose(backend.to_numpy(o_t), backend.to_numpy(o), rtol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(S_t), np.swapaxes(backend.to_numpy(S), -1, -2))


@pytest.mark.parametrize("family", LINEAR + DELTA + DPLR)
def test_chunk_and_fused_recurrent_twins_agree(family):
    rng = np.random.default_rng(11)
    G = 1 if family in LINEAR else 2
    x = make_inputs(family, rng, 2, 70, 2, G, 8, 5)
    if family == "retention":
        pytest.skip("fla 0.6.0's retention twin is not part of polylin.compat.fla")
    scale = {"scale": 0.5} if family == "rwkv7" else {}  # its twins' defaults differ
    o_c, S_c = call(family, "chunk", x, output_final_state=True, **scale)
    o_r, S_r = call(family, "fused_recurrent", x, output_final_state=True, **scale)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S_c, S_r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", DELTA)
def test_l2_norm_in_kernel(family):
    rng = np.random.default_rng(13)
    x = make_inputs(family, rng, 1, 12, 2, 2, 4, 3)
    x["k"] = x["k"] * 3.0  # not unit keys: the option must normalize them
    for form in ("chunk", "fused_recurrent"):
        o, S = call(family, form, x, use_qk_l2norm_in_kernel=True, output_final_state=True)
        ref_o, ref_S, _ = reference(
            x["q"], x["k"], x["v"], l2norm=True, **reference_gates(family, x)
        )
        np.testing.assert_allclose(o, ref_o, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(S, ref_S, rtol=1e-8, atol=1e-10)


@pytest.mark.slow_grid
@pytest.mark.parametrize(
    ("family", "v_first"),  # fla 0.6.0's fused_recurrent_delta_rule has no state_v_first
    [
        (family, v_first)
        for family in DELTA
        for v_first in (False, True)
        if not (v_first and family == "delta_rule")
    ],
)
@pytest.mark.parametrize("G", [1, 2])
def test_one_token_calls_decode_as_the_sequence(backend, family, G, v_first):
    """A decoding loop: ``fused_recurrent_*`` once per token (T = 1), each from the state the
    one before returned, gives the float64 reference's outputs and state (the calls after the
    first run the kept step plan)."""
    rng = np.random.default_rng(hash((family, G, v_first)) % 2**32)
    B, T, H, K, V = 2, 7, 2, 4, 3
    x = make_inputs(family, rng, B, T, H, G, K, V)
    x["k"] = x["k"] * 2.0  # the in-kernel L2 norm must normalize them
    S0 = rng.standard_normal((B, H * G, K, V)) * 0.3
    ref_o, ref_S, _ = reference(
        x["q"], x["k"], x["v"], scale=0.7, S0=S0, l2norm=True, **reference_gates(family, x)
    )
    S = backend.from_numpy(np.swapaxes(S0, -1, -2) if v_first else S0)
    outputs = []
    for t in range(T):
        token = {n: backend.from_numpy(a[:, t : t + 1]) for n, a in x.items()}
        o, S = call(
            family, "fused_recurrent", token, scale=0.7, initial_state=S, output_final_state=True,
            use_qk_l2norm_in_kernel=True, **({"state_v_first": True} if v_first else {}),
        )  # fmt: skip
        assert tuple(o.shape) == (B, 1, H * G, V) and o.dtype == token["q"].dtype
        outputs.append(backend.to_numpy(o))
    S = backend.to_numpy(S)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), ref_o, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(np.swapaxes(S, -1, -2) if v_first else S, ref_S, rtol=1e-8)


def test_one_token_calls_are_checked_once_per_signature(monkeypatch):
    """The first call of a signature runs the checked op; the same signature again does not;
    any other signature is checked again, with fla's errors."""
    from polylin.compat.fla import _families

    x = make_inputs("gated_delta_rule", np.random.default_rng(3), 1, 3, 2, 2, 4, 3)
    token = {n: a[:, :1] for n, a in x.items()}
    checked = []
    full = _families.delta_rule_attention
    monkeypatch.setattr(
        _families, "delta_rule_attention", lambda *a, **kw: checked.append(1) or full(*a, **kw)
    )
    first = call("gated_delta_rule", "fused_recurrent", token, scale=0.9)
    again = call("gated_delta_rule", "fused_recurrent", token, scale=0.9)
    assert len(checked) == 1
    np.testing.assert_allclose(again[0], first[0], rtol=1e-14)
    call("gated_delta_rule", "fused_recurrent", token, scale=0.5)  # another option: checked
    assert len(checked) == 2
    with pytest.raises(ValueError, match="evenly divisible"):
        call("gated_delta_rule", "fused_recurrent", {**token, "v": np.zeros((1, 1, 3, 3))})
    with pytest.raises(ValueError, match="g must have shape"):
        call("gated_delta_rule", "fused_recurrent", {**token, "g": np.zeros((1, 1, 3))})
    S = np.ones((1, 4, 4, 3))
    call("gated_delta_rule", "fused_recurrent", token, initial_state=S, output_final_state=True)
    call("gated_delta_rule", "fused_recurrent", token, initial_state=S, output_final_state=True)
    np.testing.assert_array_equal(S, 1.0)  # the kept plan does not update a state in place


# --------------------------------------------------------------------------------------------
# PyTorch: bfloat16 inputs, gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", LINEAR + DELTA + DPLR)
def test_bfloat16_inputs_give_bfloat16_outputs(family):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(17)
    G = 1 if family in LINEAR else 2
    x = make_inputs(family, rng, 1, 40, 2, G, 8, 4)
    xb = {n: torch.asarray(a, dtype=torch.bfloat16) for n, a in x.items()}
    # the reference runs on the bfloat16-rounded inputs, in float64
    x64 = {n: a.to(torch.float64).numpy() for n, a in xb.items()}
    o, S = call(family, "chunk", xb, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    ref_o, ref_S, _ = reference(
        x64["q"], x64["k"], x64["v"], scale=DEFAULT_SCALES.get((family, "chunk")),
        **reference_gates(family, x64),
    )  # fmt: skip
    scale = np.abs(ref_o).max()
    np.testing.assert_allclose(o.to(torch.float64).numpy(), ref_o, atol=2e-2 * scale)
    np.testing.assert_allclose(
        S.double().numpy(), ref_S, rtol=1e-4, atol=1e-4 * np.abs(ref_S).max()
    )


@pytest.mark.parametrize("form", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("family", LINEAR + DELTA + DPLR)
def test_gradients_match_the_reference(family, form):
    """d/d(inputs, gates, initial state) of a loss on the output and the final state."""
    torch = pytest.importorskip("torch")
    if family == "retention" and form == "fused_recurrent":
        pytest.skip("fla 0.6.0's retention twin is not part of polylin.compat.fla")
    rng = np.random.default_rng(19)
    G = 1 if family in LINEAR else 2
    B, T, H, K, V = 1, 13, 2, 4, 3
    x = make_inputs(family, rng, B, T, H, G, K, V)
    S0 = rng.standard_normal((B, H * G, K, V)) * 0.3
    w_o = torch.asarray(rng.standard_normal((B, T, H * G, V)))
    w_S = torch.asarray(rng.standard_normal(S0.shape))

    def grads(run):
        xt = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
        S0t = torch.tensor(S0, requires_grad=True)
        o, S = run(xt, S0t)
        ((o * w_o).sum() + (S * w_S).sum()).backward()
        return {n: t.grad.numpy() for n, t in [*xt.items(), ("S0", S0t)]}

    got = grads(lambda xt, S0t: call(family, form, xt, initial_state=S0t, output_final_state=True))

    def ref(xt, S0t):
        if family == "retention":
            gates = {"g": torch.asarray(retention_gates(H)).expand(B, T, H)}
        elif family == "simple_gla_gamma":
            gates = {"g": xt["g_gamma"].expand(B, T, H)}
        else:
            gates = reference_gates(family, xt)
        scale = DEFAULT_SCALES.get((family, form))
        o, S, _ = reference(xt["q"], xt["k"], xt["v"], S0=S0t, scale=scale, **gates)
        return o, S

    want = grads(ref)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-7, atol=1e-9, err_msg=name)


# --------------------------------------------------------------------------------------------
# fla's own naive forms (float64 inputs; they compute in float32)
# --------------------------------------------------------------------------------------------


def fla_naive(family: str) -> Any:
    """``fla/ops/<family>/naive.py``, loaded by path (fla's package imports Triton kernels)."""
    pytest.importorskip("torch")
    pytest.importorskip("einops")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (the bench extra pins fla-core==0.6.0)")
    from benchmarks.baselines import fla_naive as load

    return load(family)


F32 = {"rtol": 2e-5, "atol": 2e-5}


def test_equals_fla_naive_linear_attn():
    torch = pytest.importorskip("torch")
    naive = fla_naive("linear_attn")
    rng = np.random.default_rng(23)
    x = {
        n: torch.asarray(a) for n, a in make_inputs("linear_attn", rng, 2, 128, 2, 1, 8, 4).items()
    }
    q, k, v = x["q"], x["k"], x["v"]
    for normalize in (False, True):
        want = naive.naive_chunk_linear_attn(q, k, v, normalize=normalize)
        got, _ = fla.chunk_linear_attn(q, k, v, normalize=normalize)
        np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)
        want, _ = naive.naive_recurrent_linear_attn(q, k, v, normalize=normalize)
        got, _ = fla.fused_recurrent_linear_attn(q, k, v, normalize=normalize)
        np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)


def test_equals_fla_naive_simple_gla_gla_retention():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(29)
    x = {n: torch.asarray(a) for n, a in make_inputs("simple_gla", rng, 2, 50, 2, 1, 8, 4).items()}
    naive = fla_naive("simple_gla")
    want, want_S = naive.naive_chunk_simple_gla(
        x["q"], x["k"], x["v"], x["g"], output_final_state=True
    )
    got, got_S = fla.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], output_final_state=True)
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)
    want, _ = naive.naive_recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"])
    got, _ = fla.fused_recurrent_simple_gla(x["q"], x["k"], x["v"], x["g"])
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)

    x = {n: torch.asarray(a) for n, a in make_inputs("gla", rng, 2, 50, 2, 1, 8, 4).items()}
    want, want_S = fla_naive("gla").naive_recurrent_gla(
        x["q"], x["k"], x["v"], x["g"], output_final_state=True
    )
    got, got_S = fla.chunk_gla(x["q"], x["k"], x["v"], x["g"], output_final_state=True)
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)

    want = fla_naive("retention").naive_retention(*(x[n].transpose(1, 2) for n in "qkv"))
    got, _ = fla.chunk_retention(x["q"], x["k"], x["v"])
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)


def test_equals_fla_naive_delta_rules():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    x = {n: torch.asarray(a) for n, a in make_inputs("delta_rule", rng, 2, 64, 2, 1, 8, 4).items()}
    naive = fla_naive("delta_rule")
    head_first = [x[n].transpose(1, 2) for n in "qkv"] + [x["beta"].transpose(1, 2)]
    want, want_S = naive.delta_rule_recurrence(*head_first)
    got, got_S = fla.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], output_final_state=True)
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)
    want, _ = naive.delta_rule_chunkwise(*(t.float() for t in head_first))
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)

    x = {
        n: torch.asarray(a)
        for n, a in make_inputs("gated_delta_rule", rng, 2, 50, 2, 1, 8, 4).items()
    }
    naive = fla_naive("gated_delta_rule")
    args = (x["q"], x["k"], x["v"])
    want, want_S = naive.naive_recurrent_gated_delta_rule(
        *args, x["beta"], x["g"], output_final_state=True
    )
    got, got_S = fla.fused_recurrent_gated_delta_rule(
        *args, g=x["g"], beta=x["beta"], output_final_state=True
    )
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)
    want, _ = naive.naive_chunk_gated_delta_rule(*args, x["g"], x["beta"])
    got, _ = fla.chunk_gated_delta_rule(*args, x["g"], x["beta"])
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)


def test_equals_fla_naive_kda():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(37)
    x = {n: torch.asarray(a) for n, a in make_inputs("kda", rng, 2, 64, 2, 2, 8, 4).items()}
    naive = fla_naive("kda")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    want, want_S = naive.naive_recurrent_kda(*args, output_final_state=True)
    got, got_S = fla.chunk_kda(*args, output_final_state=True)
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)
    want, _ = naive.naive_chunk_kda(*args)
    got, _ = fla.fused_recurrent_kda(*args)
    np.testing.assert_allclose(got.numpy(), want.double().numpy(), **F32)


# --------------------------------------------------------------------------------------------
# fla's argument rules
# --------------------------------------------------------------------------------------------


def small(family: str = "gated_delta_rule", B: int = 1) -> dict[str, np.ndarray]:
    return make_inputs(family, np.random.default_rng(0), B, 6, 2, 1, 4, 3)


def test_head_first_raises_flas_own_error():
    x = small()
    with pytest.raises(DeprecationWarning, match="head_first has been removed"):
        fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], head_first=True)
    x = small("simple_gla")
    with pytest.raises(DeprecationWarning, match="head_first has been removed"):
        fla.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], head_first=False)


@pytest.mark.parametrize(
    ("fn", "options", "names"),
    [
        (fla.chunk_gated_delta_rule, {"cp_context": object()}, "`cp_context`"),
        (
            fla.chunk_gated_delta_rule,
            {"use_gate_in_kernel": True, "A_log": 1},
            "`use_gate_in_kernel`, `A_log`",
        ),
        (
            fla.chunk_gated_delta_rule,
            {"use_beta_sigmoid_in_kernel": True},
            "`use_beta_sigmoid_in_kernel`",
        ),
        (fla.fused_recurrent_gated_delta_rule, {"gv": np.zeros(1)}, "`gv`"),
        (fla.chunk_kda, {"return_intermediate_states": True}, "`return_intermediate_states`"),
        (fla.chunk_gated_delta_rule, {"some_new_option": 1}, "`some_new_option`"),
    ],
)
def test_unsupported_arguments_raise_naming_them(fn, options, names):
    family = "kda" if fn is fla.chunk_kda else "gated_delta_rule"
    x = small(family)
    with pytest.raises(NotImplementedError, match=names):
        fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], **options)


def test_unsupported_linear_options_raise_naming_them():
    x = small("gla")
    with pytest.raises(NotImplementedError, match="`gv`, `reverse`"):
        fla.fused_recurrent_gla(x["q"], x["k"], x["v"], x["g"], gv=x["g"], reverse=True)
    with pytest.raises(NotImplementedError, match="`reverse`"):
        fla.fused_recurrent_linear_attn(x["q"], x["k"], x["v"], reverse=True)


def test_flas_shape_and_varlen_rules():
    x = small(B=2)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=[0, 6])
    x = small()
    with pytest.raises(ValueError, match="number of initial states"):
        fla.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=np.array([0, 2, 6]),
            initial_state=np.zeros((3, 2, 4, 3)),
        )  # fmt: skip
    v3 = np.zeros((1, 6, 3, 3))
    with pytest.raises(ValueError, match="evenly divisible"):
        fla.chunk_gated_delta_rule(x["q"], x["k"], v3, x["g"], x["beta"])
    with pytest.raises(ValueError, match="chunk_size"):
        fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=128)
    with pytest.raises(TypeError, match="integer array"):
        fla.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=np.array([0.0, 6.0])
        )
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        fla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], allow_neg_eigval=True)


def test_inputs_are_not_modified():
    x = small()
    copies = {n: a.copy() for n, a in x.items()}
    S0 = np.ones((1, 2, 4, 3))
    fla.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=S0, output_final_state=True
    )
    for n in x:
        np.testing.assert_array_equal(x[n], copies[n])
    np.testing.assert_array_equal(S0, 1.0)


def test_float32_gates_beside_bfloat16_inputs():
    """transformers passes ``g`` in float32 beside bfloat16 ``q, k, v``; fla accepts it."""
    torch = pytest.importorskip("torch")
    x = small()
    xb = {n: torch.asarray(a, dtype=torch.bfloat16) for n, a in x.items()}
    xb["g"] = torch.asarray(x["g"], dtype=torch.float32)
    o, S = fla.chunk_gated_delta_rule(
        xb["q"], xb["k"], xb["v"], xb["g"], xb["beta"], output_final_state=True
    )
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert math.isfinite(float(o.float().abs().sum()))


def test_backend_library_and_device_kept(backend):
    x = small()
    xb = {n: backend.from_numpy(a) for n, a in x.items()}
    o, S = fla.chunk_gated_delta_rule(
        xb["q"], xb["k"], xb["v"], xb["g"], xb["beta"], output_final_state=True
    )
    assert array_api_compat.array_namespace(o) is array_api_compat.array_namespace(xb["q"])
    assert array_api_compat.device(o) == array_api_compat.device(xb["q"])
    assert array_api_compat.device(S) == array_api_compat.device(xb["q"])
    if backend in (Backend.NUMPY,):
        assert isinstance(o, np.ndarray)


# --------------------------------------------------------------------------------------------
# The generalized delta rule and RWKV-7: fla's naive forms, defaults, the (kk, a) form, options
# --------------------------------------------------------------------------------------------


def test_equals_fla_naive_dplr():
    """fla's ``dplr_recurrence`` and ``dplr_chunkwise`` (head-first, scale ``K ** -0.5``)."""
    torch = pytest.importorskip("torch")
    naive = fla_naive("generalized_delta_rule/dplr")
    rng = np.random.default_rng(41)
    B, T, H, K, V = 2, 64, 2, 8, 4
    x = {n: torch.asarray(a) for n, a in make_inputs("rwkv7", rng, B, T, H, 1, K, V).items()}
    S0 = torch.asarray(rng.standard_normal((B, H, K, V)) * 0.3)
    # float32 in: fla's naive recurrence casts all but `alpha` to float32 and fails on float64
    head_first = [x[n].transpose(1, 2).float() for n in ("q", "k", "v", "a", "b", "g")]
    want, want_S = naive.dplr_recurrence(*head_first, initial_state=S0.float())
    args = (x["q"], x["k"], x["v"], x["a"], x["b"], x["g"])
    got, got_S = fla.chunk_dplr_delta_rule(*args, initial_state=S0, output_final_state=True)
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)
    # fla's chunk_rwkv7 is chunk_dplr_delta_rule with q = r, gk = w (and scale 1 by default)
    got, got_S = fla.chunk_rwkv7(
        x["q"], x["g"], x["k"], x["v"], x["a"], x["b"], scale=K**-0.5, initial_state=S0,
        output_final_state=True,
    )  # fmt: skip
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)

    want, want_S = naive.dplr_chunkwise(*head_first, chunk_size=32)
    got, got_S = fla.fused_recurrent_dplr_delta_rule(*args, output_final_state=True)
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)
    np.testing.assert_allclose(got_S.numpy(), want_S.double().numpy(), **F32)
    got, _ = fla.fused_recurrent_rwkv7(x["q"], x["g"], x["k"], x["v"], x["a"], x["b"])
    np.testing.assert_allclose(got.numpy(), want.transpose(1, 2).double().numpy(), **F32)


def rwkv7_inputs(rng: np.random.Generator, B: int, T: int, H: int, K: int, V: int) -> dict:
    """RWKV-7's own variables in fla's layout: ``r, w, k, v, kk, a`` (``a`` the learning rate)."""
    kk = rng.standard_normal((B, T, H, K))
    return {
        "r": rng.standard_normal((B, T, H, K)),
        "w": -np.exp(rng.uniform(-2.0, 0.5, (B, T, H, K))),
        "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, H, V)),
        "kk": kk / np.linalg.norm(kk, axis=-1, keepdims=True),
        "a": rng.uniform(0.0, 1.0, (B, T, H, K)),
    }


def test_rwkv7_defaults_follow_fla():
    """chunk_rwkv7 and fused_mul_recurrent_rwkv7: scale 1, no state; fused_recurrent_rwkv7:
    scale ``K ** -0.5`` and the final state by default (fla 0.6.0's own defaults)."""
    x = rwkv7_inputs(np.random.default_rng(43), 1, 9, 2, 4, 3)
    r, w, k, v, kk, lr = (x[n] for n in ("r", "w", "k", "v", "kk", "a"))
    gates = {"g": w, "a": -kk, "b": kk * lr}
    ref_1, ref_S, _ = reference(r, k, v, scale=1.0, **gates)
    ref_default, _, _ = reference(r, k, v, **gates)
    o, S = fla.chunk_rwkv7(r, w, k, v, -kk, kk * lr)
    assert S is None
    np.testing.assert_allclose(o, ref_1, rtol=1e-9, atol=1e-12)
    o, S = fla.fused_recurrent_rwkv7(r, w, k, v, -kk, kk * lr)
    np.testing.assert_allclose(o, ref_default, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(S, ref_S, rtol=1e-9, atol=1e-12)
    o, S = fla.fused_mul_recurrent_rwkv7(r, w, k, v, kk, lr)
    assert S is None
    np.testing.assert_allclose(o, ref_1, rtol=1e-9, atol=1e-12)


def test_fused_mul_recurrent_rwkv7_matches_reference(backend):
    """``a = -kk``, ``b = kk * a`` formed inside; states, scale and ``cu_seqlens``."""
    rng = np.random.default_rng(47)
    offsets = [0, 4, 4, 15, 23]
    x = rwkv7_inputs(rng, 1, offsets[-1], 2, 4, 3)
    S0 = rng.standard_normal((len(offsets) - 1, 2, 4, 3)) * 0.3
    xb = {n: backend.from_numpy(a) for n, a in x.items()}
    xp = backend.namespace()
    cu = xp.asarray(np.asarray(offsets, dtype=np.int64), device=backend.device)
    o, S = fla.fused_mul_recurrent_rwkv7(
        *(xb[n] for n in ("r", "w", "k", "v", "kk", "a")), scale=0.7,
        initial_state=backend.from_numpy(S0), output_final_state=True, cu_seqlens=cu,
    )  # fmt: skip
    ref_o, ref_S = reference_varlen(
        offsets, x["r"], x["k"], x["v"], S0=S0, scale=0.7, g=x["w"], a=-x["kk"],
        b=x["kk"] * x["a"],
    )  # fmt: skip
    assert type(o) is type(xb["r"]) and o.dtype == xb["r"].dtype
    np.testing.assert_allclose(backend.to_numpy(o), ref_o, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(backend.to_numpy(S), ref_S, rtol=1e-8, atol=1e-9)


def test_fused_mul_recurrent_rwkv7_bfloat16_and_gradients():
    torch = pytest.importorskip("torch")
    x = rwkv7_inputs(np.random.default_rng(53), 1, 20, 2, 8, 4)
    names = ("r", "w", "k", "v", "kk", "a")
    xb = {n: torch.asarray(x[n], dtype=torch.bfloat16) for n in names}
    o, S = fla.fused_mul_recurrent_rwkv7(*(xb[n] for n in names), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    x64 = {n: t.double().numpy() for n, t in xb.items()}
    ref_o, ref_S, _ = reference(
        x64["r"], x64["k"], x64["v"], scale=1.0, g=x64["w"], a=-x64["kk"],
        b=x64["kk"] * x64["a"],
    )  # fmt: skip
    np.testing.assert_allclose(o.double().numpy(), ref_o, atol=2e-2 * np.abs(ref_o).max())
    np.testing.assert_allclose(
        S.double().numpy(), ref_S, rtol=1e-4, atol=1e-4 * np.abs(ref_S).max()
    )

    def grads(run):
        xt = {n: torch.tensor(x[n], requires_grad=True) for n in names}
        o, S = run(xt)
        (o.sin().sum() + S.cos().sum()).backward()
        return {n: t.grad.numpy() for n, t in xt.items()}

    got = grads(lambda xt: fla.fused_mul_recurrent_rwkv7(
        *(xt[n] for n in names), output_final_state=True
    ))  # fmt: skip
    want = grads(lambda xt: reference(
        xt["r"], xt["k"], xt["v"], scale=1.0, g=xt["w"], a=-xt["kk"], b=xt["kk"] * xt["a"]
    )[:2])  # fmt: skip
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-7, atol=1e-9, err_msg=name)


def test_dplr_speed_hints_change_nothing():
    """``safe_gate``, ``disable_recompute``, a negative ``lower_bound``, ``chunk_size``."""
    x = make_inputs("dplr_delta_rule", np.random.default_rng(59), 1, 30, 2, 1, 4, 3)
    args = (x["q"], x["k"], x["v"], x["a"], x["b"], x["g"])
    want, _ = fla.chunk_dplr_delta_rule(*args)
    hinted, _ = fla.chunk_dplr_delta_rule(
        *args, safe_gate=True, disable_recompute=True, lower_bound=-5.0, chunk_size=8
    )
    np.testing.assert_allclose(hinted, want, rtol=1e-10, atol=1e-12)
    rwkv, _ = fla.chunk_rwkv7(
        x["q"], x["g"], x["k"], x["v"], x["a"], x["b"], scale=0.5, safe_gate=True,
        lower_bound=-1.0, chunk_size=16,
    )  # fmt: skip
    np.testing.assert_allclose(rwkv, fla.chunk_dplr_delta_rule(*args, scale=0.5)[0], rtol=1e-10)


def test_dplr_argument_rules():
    x = make_inputs("dplr_delta_rule", np.random.default_rng(61), 1, 6, 2, 1, 4, 3)
    q, k, v, a, b, gk = (x[n] for n in ("q", "k", "v", "a", "b", "g"))
    with pytest.raises(NotImplementedError, match="`cp_context`, `some_new_option`"):
        fla.chunk_dplr_delta_rule(q, k, v, a, b, gk, cp_context=object(), some_new_option=1)
    with pytest.raises(NotImplementedError, match="`cp_context`"):
        fla.chunk_rwkv7(q, gk, k, v, a, b, cp_context=object())
    with pytest.raises(NotImplementedError, match="`reverse`"):
        fla.fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, reverse=True)
    with pytest.raises(NotImplementedError, match="`reverse`"):
        fla.fused_mul_recurrent_rwkv7(q, gk, k, v, -a, b, reverse=True)
    with pytest.raises(DeprecationWarning, match="head_first has been removed"):
        fla.chunk_dplr_delta_rule(q, k, v, a, b, gk, head_first=False)

    def rwkv7(q, k, v, a, b, gk, **options):
        return fla.chunk_rwkv7(q, gk, k, v, a, b, **options)

    for fn in (fla.chunk_dplr_delta_rule, rwkv7):
        with pytest.raises(ValueError, match="`lower_bound` must be negative"):
            fn(q, k, v, a, b, gk, lower_bound=0.0)
        with pytest.raises(ValueError, match="power of 2"):
            fn(q, k, v, a, b, gk, chunk_size=12)
    with pytest.raises(ValueError, match=r"^a must have shape \[B, T, H, K\]"):
        fla.chunk_dplr_delta_rule(q, k, v, a[:, :, :1], b, gk)
    with pytest.raises(ValueError, match=r"^w must have shape \[B, T, H, K\]"):
        fla.fused_recurrent_rwkv7(q, gk[..., 0], k, v, a, b)
    with pytest.raises(ValueError, match=r"^kk must have shape \[B, T, H, K\]"):
        fla.fused_mul_recurrent_rwkv7(q, gk, k, v, a[..., 0], b)
    with pytest.raises(ValueError, match="number of initial states"):
        fla.chunk_dplr_delta_rule(
            q, k, v, a, b, gk, cu_seqlens=np.array([0, 2, 6]), initial_state=np.zeros((3, 2, 4, 3))
        )
    copies = {n: c.copy() for n, c in x.items()}
    fla.chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=np.ones((1, 2, 4, 3)))
    fla.fused_mul_recurrent_rwkv7(q, gk, k, v, -a, b)
    for n in x:
        np.testing.assert_array_equal(x[n], copies[n])


def _fla_errors_inputs():
    """H = 2 key heads, HV = 4 value heads, K = 4, V = 5, T = 10 (fla's layout)."""
    q = k = np.zeros((1, 10, 2, 4))
    v = np.zeros((1, 10, 4, 5))
    return q, k, v, -np.ones((1, 10, 4)), 0.5 * np.ones((1, 10, 4))


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda q, k, v, g, b: fla.chunk_gated_delta_rule(
                q, k, v, g, b, initial_state=np.zeros((4, 4, 5))
            ),
            r"^initial_state must have shape \[N, HV, K, V\] = \(1, 4, 4, 5\), got \(4, 4, 5\)$",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_gated_delta_rule(
                q, k, v, g, b, initial_state=np.zeros((1, 3, 4, 5))
            ),
            r"^initial_state must have shape \[N, HV, K, V\] = \(1, 4, 4, 5\), got \(1, 3, 4, 5\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_gated_delta_rule(
                q, k, v, g, b, initial_state=np.zeros((1, 4, 5, 4))
            ),
            r"^initial_state must have shape \[N, HV, K, V\] = \(1, 4, 4, 5\), got \(1, 4, 5, 4\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_gated_delta_rule(
                q, k, v, g, b, initial_state=np.zeros((1, 4, 4, 5)), state_v_first=True
            ),
            r"^initial_state must have shape \[N, HV, V, K\] \(state_v_first\) = \(1, 4, 5, 4\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_gated_delta_rule(
                q[:, :6], k[:, :6], v[:, :6], g[:, :6], b[:, :6],
                cu_seqlens=np.array([0, 2, 6]), initial_state=np.zeros((2, 4, 5, 4)),
            ),
            r"^initial_state must have shape \[N, HV, K, V\] = \(2, 4, 4, 5\), got \(2, 4, 5, 4\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_kda(q, k, v, -np.ones((1, 10, 4, 3)), b),
            r"^g must have shape \[B, T, HV\] or \[B, T, HV, K\] with HV = 4 value heads, K = 4,"
            r" got \(1, 10, 4, 3\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_gated_delta_rule(q, k, v, g, b[..., :3]),
            r"^beta must have shape \[B, T, HV\] with HV = 4 value heads, got \(1, 10, 3\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_gla(
                q, k, v[..., :4], g[..., None] * np.ones(4), initial_state=np.zeros((1, 2, 5, 4))
            ),
            r"^initial_state must have shape \[N, HV, K, V\] = \(1, 4, 4, 4\), got \(1, 2, 5, 4\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_linear_attn(
                q, k, v, initial_state=(np.zeros((1, 4, 4, 5)), np.zeros((1, 2, 4)))
            ),
            r"^the key sum of initial_state .* \[N, 1, H, K\] = \(1, 1, 2, 4\), got \(1, 2, 4\)",
        ),
        (
            lambda q, k, v, g, b: fla.chunk_rwkv7(
                q, -np.ones((1, 10, 2, 3)), k, v, -np.ones((1, 10, 2, 4)), np.ones((1, 10, 2, 4))
            ),
            r"^w must have shape \[B, T, H, K\] with H = 2 key heads and K = 4 key channels, got "
            r"\(1, 10, 2, 3\)",
        ),
    ],
)
def test_shape_errors_speak_fla_terms(call, match):
    """A bad state or gate is named as fla names it, with fla's layout and the caller's shape."""
    with pytest.raises(ValueError, match=match):
        call(*_fla_errors_inputs())
