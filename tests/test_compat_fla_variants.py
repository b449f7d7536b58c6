"""polylin.compat.fla's newer variants (RWKV-6, ...) against float64 loops and fla's naive forms."""

from __future__ import annotations

import importlib.util
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polylin.compat.fla import (
    chunk_comba,
    chunk_gated_delta_product,
    chunk_gdn2,
    chunk_rwkv6,
    fused_recurrent_comba,
    fused_recurrent_gdn2,
    fused_recurrent_rwkv6,
)

RWKV6 = (chunk_rwkv6, fused_recurrent_rwkv6)
F64 = {"rtol": 1e-10, "atol": 1e-10}
F32 = {"rtol": 2e-5, "atol": 2e-5}


def fla_reference(path: str) -> Any:
    """A pure-PyTorch reference file of fla (``fla/ops/<path>``), loaded by path: fla's package
    imports its Triton kernels, which have no CPU build."""
    pytest.importorskip("torch")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (the bench extra pins fla-core==0.6.0)")
    file = Path(spec.submodule_search_locations[0]) / "ops" / path
    module_spec = importlib.util.spec_from_file_location("fla_ref_" + path.replace("/", "_"), file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# RWKV-6
# --------------------------------------------------------------------------------------------


def rwkv6_loop(r, k, v, w, u, scale, S0):
    """RWKV-6 token by token in float64.

    ``o_t = scale r_t (S_{t-1} + diag(u) k_t v_t^T)``, ``S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T``;
    inputs ``(B, T, H, d)``, ``S0`` ``(B, H, K, V)``.
    """
    B, T, H, K = r.shape
    V = v.shape[-1]
    S = np.zeros((B, H, K, V)) if S0 is None else np.array(S0, dtype=np.float64)
    o = np.zeros((B, T, H, V))
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", r[:, t], S + u[None, :, :, None] * kv)
        S = np.exp(w[:, t])[..., None] * S + kv
    return o, S


def rwkv6_inputs(seed=0, B=2, T=11, H=3, K=4, V=5):
    rng = np.random.default_rng(seed)
    return {
        "r": rng.standard_normal((B, T, H, K)),
        "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, H, V)),
        "w": -rng.uniform(0.01, 1.0, (B, T, H, K)),
        "u": rng.standard_normal((H, K)),
        "S0": rng.standard_normal((B, H, K, V)),
    }


@pytest.mark.parametrize("op", RWKV6)
@pytest.mark.parametrize("scale", [None, 0.7])
def test_rwkv6_equals_float64_loop(op, scale):
    x = rwkv6_inputs()
    want_o, want_S = rwkv6_loop(
        x["r"], x["k"], x["v"], x["w"], x["u"], 4**-0.5 if scale is None else scale, x["S0"]
    )
    copies = {n: a.copy() for n, a in x.items()}
    o, S = op(
        x["r"], x["k"], x["v"], x["w"], x["u"], scale=scale, initial_state=x["S0"],
        output_final_state=True,
    )  # fmt: skip
    np.testing.assert_allclose(o, want_o, **F64)
    np.testing.assert_allclose(S, want_S, **F64)
    for n, a in x.items():
        np.testing.assert_array_equal(a, copies[n])  # inputs untouched
    o2, none = op(x["r"], x["k"], x["v"], x["w"], x["u"], scale=scale)
    assert none is None
    want_o2, _ = rwkv6_loop(
        x["r"], x["k"], x["v"], x["w"], x["u"], 4**-0.5 if scale is None else scale, None
    )
    np.testing.assert_allclose(o2, want_o2, **F64)


@pytest.mark.parametrize("op", RWKV6)
def test_rwkv6_packed_sequences_equal_separate_calls(op):
    x = rwkv6_inputs(seed=1, B=1, T=12)
    offsets = [0, 5, 5, 6, 12]  # an empty sequence and a one-token one
    rng = np.random.default_rng(2)
    S0 = rng.standard_normal((4, 3, 4, 5))
    o, S = op(
        x["r"], x["k"], x["v"], x["w"], x["u"], initial_state=S0, output_final_state=True,
        cu_seqlens=np.asarray(offsets),
    )  # fmt: skip
    for n, (b, e) in enumerate(pairwise(offsets)):
        part = {name: x[name][:, b:e] for name in "rkvw"}
        want_o, want_S = rwkv6_loop(**part, u=x["u"], scale=0.5, S0=S0[n : n + 1])
        np.testing.assert_allclose(o[:, b:e], want_o, **F64)
        np.testing.assert_allclose(S[n : n + 1], want_S, **F64)


def test_rwkv6_torch_values_and_gradients():
    torch = pytest.importorskip("torch")
    x = rwkv6_inputs(seed=3, T=9)
    names = ("r", "k", "v", "w", "u", "S0")
    for op in RWKV6:
        ours = {n: torch.tensor(x[n], requires_grad=True) for n in names}
        ref = {n: torch.tensor(x[n], requires_grad=True) for n in names}
        o, S = op(
            ours["r"], ours["k"], ours["v"], ours["w"], ours["u"], initial_state=ours["S0"],
            output_final_state=True,
        )  # fmt: skip
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
        # the loop in torch, for autograd
        Sr = ref["S0"]
        outs = []
        for t in range(9):
            kv = ref["k"][:, t, :, :, None] * ref["v"][:, t, :, None, :]
            outs.append(0.5 * torch.einsum("bhk,bhkv->bhv", ref["r"][:, t],
                                           Sr + ref["u"][None, :, :, None] * kv))  # fmt: skip
            Sr = torch.exp(ref["w"][:, t])[..., None] * Sr + kv
        o_ref = torch.stack(outs, dim=1)
        np.testing.assert_allclose(o.detach().numpy(), o_ref.detach().numpy(), **F64)
        np.testing.assert_allclose(S.detach().numpy(), Sr.detach().numpy(), **F64)
        go = np.random.default_rng(4).standard_normal(tuple(o.shape))
        gS = np.random.default_rng(5).standard_normal(tuple(S.shape))
        ((o * torch.tensor(go)).sum() + (S * torch.tensor(gS)).sum()).backward()
        ((o_ref * torch.tensor(go)).sum() + (Sr * torch.tensor(gS)).sum()).backward()
        for n in names:
            np.testing.assert_allclose(ours[n].grad.numpy(), ref[n].grad.numpy(), **F64)


def test_rwkv6_equals_fla_naive():
    torch = pytest.importorskip("torch")
    naive = fla_reference("rwkv6/recurrent_naive.py")
    x = rwkv6_inputs(seed=6)
    head_first = [torch.tensor(x[n]).transpose(1, 2) for n in "rkvw"]
    want_o, want_S = naive.naive_recurrent_rwkv6(
        *head_first, torch.tensor(x["u"]), scale=0.3, initial_state=torch.tensor(x["S0"]),
        output_final_state=True,
    )  # fmt: skip
    for op in RWKV6:
        o, S = op(
            *(torch.tensor(x[n]) for n in "rkvwu"), scale=0.3,
            initial_state=torch.tensor(x["S0"]), output_final_state=True,
        )  # fmt: skip
        np.testing.assert_allclose(o.numpy(), want_o.transpose(1, 2).numpy(), **F32)
        np.testing.assert_allclose(S.numpy(), want_S.numpy(), **F32)


def test_rwkv6_rejects_what_it_does_not_compute():
    x = rwkv6_inputs(T=4)
    args = tuple(x[n] for n in "rkvwu")
    with pytest.raises(NotImplementedError, match="reverse"):
        fused_recurrent_rwkv6(*args, reverse=True)
    with pytest.raises(NotImplementedError, match="foo"):
        chunk_rwkv6(*args, foo=1)
    with pytest.raises(ValueError, match="`u` must have shape"):
        chunk_rwkv6(*args[:4], x["u"][:, :2])
    with pytest.raises(ValueError, match="`w` must have the shape of `k`"):
        chunk_rwkv6(*args[:3], x["w"][..., :2], x["u"])
    with pytest.raises(TypeError, match="u"):
        chunk_rwkv6(*args[:4], np.ones((3, 4), dtype=np.int64))


# --------------------------------------------------------------------------------------------
# Gated DeltaProduct
# --------------------------------------------------------------------------------------------


def gdp_loop(xp, q, k, v, g, beta, n, scale, S0):
    """Gated DeltaProduct token by token (``xp``: numpy or torch, float64).

    Decay once per token, then ``n`` delta-rule steps, then read; ``S0`` ``(B, H, K, V)``.
    """
    S = S0
    outs = []
    for t in range(q.shape[1]):
        if g is not None:
            S = S * xp.exp(g[:, t])[..., None, None]
        for j in range(n):
            kj, vj, bj = k[:, t * n + j], v[:, t * n + j], beta[:, t * n + j]
            read = (S * kj[..., None]).sum(-2)
            S = S + bj[..., None, None] * kj[..., None] * (vj - read)[..., None, :]
        outs.append(scale * (S * q[:, t][..., None]).sum(-2))
    return (xp.stack(outs, 1) if outs else v[:, :0] * 0), S


def gdp_inputs(seed=0, B=2, T=7, H=3, K=4, V=5, n=3):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T * n, H, K))
    return {
        "q": rng.standard_normal((B, T, H, K)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.standard_normal((B, T * n, H, V)),
        "g": -rng.uniform(0.01, 1.0, (B, T, H)),
        "beta": rng.uniform(0.05, 1.0, (B, T * n, H)),
        "S0": rng.standard_normal((B, H, K, V)),
    }


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_delta_product_equals_float64_loop(n, gated):
    x = gdp_inputs(n=n)
    g = x["g"] if gated else None
    want_o, want_S = gdp_loop(np, x["q"], x["k"], x["v"], g, x["beta"], n, 0.5, x["S0"])
    copies = {name: a.copy() for name, a in x.items()}
    o, S = chunk_gated_delta_product(
        x["q"], x["k"], x["v"], g, x["beta"], n, initial_state=x["S0"], output_final_state=True
    )
    np.testing.assert_allclose(o, want_o, **F64)
    np.testing.assert_allclose(S, want_S, **F64)
    for name, a in x.items():
        np.testing.assert_array_equal(a, copies[name])
    o2, none = chunk_gated_delta_product(x["q"], x["k"], x["v"], g, x["beta"], n, scale=0.3)
    assert none is None
    zero = np.zeros_like(x["S0"])
    np.testing.assert_allclose(
        o2, gdp_loop(np, x["q"], x["k"], x["v"], g, x["beta"], n, 0.3, zero)[0], **F64
    )


def test_gated_delta_product_qk_l2norm_and_packed_sequences():
    n = 2
    x = gdp_inputs(seed=1, B=1, T=9, n=n)
    offsets = [0, 4, 4, 9]
    S0 = np.random.default_rng(2).standard_normal((3, 3, 4, 5))
    raw_k = x["k"] * 3.0
    o, S = chunk_gated_delta_product(
        x["q"], raw_k, x["v"], x["g"], x["beta"], n, initial_state=S0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=np.asarray(offsets),
    )  # fmt: skip
    q_unit = x["q"] / np.sqrt((x["q"] ** 2).sum(-1, keepdims=True) + 1e-6)
    k_unit = raw_k / np.sqrt((raw_k**2).sum(-1, keepdims=True) + 1e-6)
    for i, (b, e) in enumerate(pairwise(offsets)):
        want_o, want_S = gdp_loop(
            np, q_unit[:, b:e], k_unit[:, b * n : e * n], x["v"][:, b * n : e * n],
            x["g"][:, b:e], x["beta"][:, b * n : e * n], n, 0.5, S0[i : i + 1],
        )  # fmt: skip
        np.testing.assert_allclose(o[:, b:e], want_o, **F64)
        np.testing.assert_allclose(S[i : i + 1], want_S, **F64)


def test_gated_delta_product_torch_gradients():
    torch = pytest.importorskip("torch")
    n = 2
    x = gdp_inputs(seed=3, T=6, n=n)
    names = ("q", "k", "v", "g", "beta", "S0")
    ours = {name: torch.tensor(x[name], requires_grad=True) for name in names}
    ref = {name: torch.tensor(x[name], requires_grad=True) for name in names}
    o, S = chunk_gated_delta_product(
        *(ours[name] for name in names[:5]), n, initial_state=ours["S0"], output_final_state=True
    )
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
    o_ref, S_ref = gdp_loop(torch, *(ref[name] for name in names[:5]), n, 0.5, ref["S0"])
    np.testing.assert_allclose(o.detach().numpy(), o_ref.detach().numpy(), **F64)
    np.testing.assert_allclose(S.detach().numpy(), S_ref.detach().numpy(), **F64)
    rng = np.random.default_rng(4)
    go, gS = (torch.tensor(rng.standard_normal(tuple(a.shape))) for a in (o, S))
    ((o * go).sum() + (S * gS).sum()).backward()
    ((o_ref * go).sum() + (S_ref * gS).sum()).backward()
    for name in names:
        np.testing.assert_allclose(ours[name].grad.numpy(), ref[name].grad.numpy(), **F64)


def test_gated_delta_product_equals_fla_naive():
    torch = pytest.importorskip("torch")
    naive = fla_reference("gated_delta_product/naive.py")
    n = 3
    x = gdp_inputs(seed=5, n=n)
    args = [torch.tensor(x[name]) for name in ("q", "k", "v", "g", "beta")]
    want_o, want_S = naive.naive_recurrent_gated_delta_product(
        *args, 0.5, initial_state=torch.tensor(x["S0"]), output_final_state=True,
        num_householder=n,
    )  # fmt: skip
    o, S = chunk_gated_delta_product(
        *args, n, initial_state=torch.tensor(x["S0"]), output_final_state=True
    )
    np.testing.assert_allclose(o.numpy(), want_o.numpy(), **F32)
    np.testing.assert_allclose(S.numpy(), want_S.numpy(), **F32)


def test_gated_delta_product_rejects_bad_shapes_and_options():
    x = gdp_inputs(T=4, n=2)
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="`k` must have shape"):
        chunk_gated_delta_product(*args, 3)
    with pytest.raises(ValueError, match="`g` must have shape"):
        chunk_gated_delta_product(args[0], args[1], args[2], args[4], args[4], 2)
    with pytest.raises(ValueError, match="num_householder"):
        chunk_gated_delta_product(*args, 0)
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_gated_delta_product(*args, 2, cp_context=object())


# --------------------------------------------------------------------------------------------
# Comba
# --------------------------------------------------------------------------------------------


def comba_loop(xp, q, k, v, p, g, beta, scale, S0):
    """Comba token by token (``xp``: numpy or torch, float64), as fla's kernels compute it.

    ``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T``, ``o_t = scale S_t^T q_t``;
    ``q, k, p`` ``(B, T, H, K)`` serve ``HV // H`` consecutive value heads each.
    """
    G = v.shape[2] // q.shape[2]
    q, k, p = (xp.repeat_interleave(x, G, 2) if xp is not np else np.repeat(x, G, 2)
               for x in (q, k, p))  # fmt: skip
    S = S0
    outs = []
    for t in range(q.shape[1]):
        read = (S * p[:, t][..., None]).sum(-2)
        S = (
            S * xp.exp(g[:, t])[..., None, None]
            + k[:, t][..., None] * (beta[:, t][..., None] * (v[:, t] - read))[..., None, :]
        )
        outs.append(scale * (S * q[:, t][..., None]).sum(-2))
    return (xp.stack(outs, 1) if outs else v[:, :0] * 0), S


def comba_inputs(seed=0, B=2, T=10, H=2, HV=4, K=4, V=5):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return {
        "q": rng.standard_normal((B, T, H, K)),
        "k": k,
        "v": rng.standard_normal((B, T, HV, V)),
        "p": k * rng.uniform(0.2, 1.0, (B, T, H, 1)),
        "g": -rng.uniform(0.01, 1.0, (B, T, HV)),
        "beta": rng.uniform(0.05, 1.0, (B, T, HV)),
        "S0": rng.standard_normal((B, HV, K, V)),
    }


def call_comba(op, q, k, v, p, g, beta, **options):
    """Each op in fla's own order: ``chunk_comba(q, k, v, p)``, the recurrent ``(q, k, p, v)``."""
    if op is chunk_comba:
        return op(q, k, v, p, g, beta, **options)
    return op(q, k, p, v, g, beta, **options)


@pytest.mark.parametrize("op", [chunk_comba, fused_recurrent_comba])
@pytest.mark.parametrize("HV", [2, 4])
def test_comba_equals_float64_loop(op, HV):
    x = comba_inputs(HV=HV)
    copies = {name: a.copy() for name, a in x.items()}
    names = ("q", "k", "v", "p", "g", "beta")
    want_o, want_S = comba_loop(np, *(x[name] for name in names), 0.5, x["S0"])
    o, S = call_comba(op, *(x[name] for name in names), initial_state=x["S0"],
                      output_final_state=True)  # fmt: skip
    np.testing.assert_allclose(o, want_o, **F64)
    np.testing.assert_allclose(S, want_S, **F64)
    for name, a in x.items():
        np.testing.assert_array_equal(a, copies[name])
    # p=None is k, beta=None is 1; scale; no initial state
    zero = np.zeros_like(x["S0"])
    ones = np.ones_like(x["beta"])
    o2, none = call_comba(op, x["q"], x["k"], x["v"], None, x["g"], None, scale=0.3)
    assert none is None
    want2, _ = comba_loop(np, x["q"], x["k"], x["v"], x["k"], x["g"], ones, 0.3, zero)
    np.testing.assert_allclose(o2, want2, **F64)


def test_comba_qk_l2norm_and_packed_sequences():
    x = comba_inputs(seed=1, B=1, T=9)
    offsets = [0, 3, 3, 9]
    S0 = np.random.default_rng(2).standard_normal((3, 4, 4, 5))
    raw = {name: x[name] * 2.5 for name in ("q", "k", "p")}
    o, S = chunk_comba(
        raw["q"], raw["k"], x["v"], raw["p"], x["g"], x["beta"], initial_state=S0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=np.asarray(offsets),
    )  # fmt: skip
    unit = {n: a / np.sqrt((a**2).sum(-1, keepdims=True) + 1e-6) for n, a in raw.items()}
    for i, (b, e) in enumerate(pairwise(offsets)):
        want_o, want_S = comba_loop(
            np, unit["q"][:, b:e], unit["k"][:, b:e], x["v"][:, b:e], unit["p"][:, b:e],
            x["g"][:, b:e], x["beta"][:, b:e], 0.5, S0[i : i + 1],
        )  # fmt: skip
        np.testing.assert_allclose(o[:, b:e], want_o, **F64)
        np.testing.assert_allclose(S[i : i + 1], want_S, **F64)


def test_comba_torch_gradients():
    torch = pytest.importorskip("torch")
    x = comba_inputs(seed=3, T=7)
    names = ("q", "k", "v", "p", "g", "beta", "S0")
    for op in (chunk_comba, fused_recurrent_comba):
        ours = {name: torch.tensor(x[name], requires_grad=True) for name in names}
        ref = {name: torch.tensor(x[name], requires_grad=True) for name in names}
        o, S = call_comba(op, *(ours[name] for name in names[:6]), initial_state=ours["S0"],
                          output_final_state=True)  # fmt: skip
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
        o_ref, S_ref = comba_loop(torch, *(ref[name] for name in names[:6]), 0.5, ref["S0"])
        np.testing.assert_allclose(o.detach().numpy(), o_ref.detach().numpy(), **F64)
        np.testing.assert_allclose(S.detach().numpy(), S_ref.detach().numpy(), **F64)
        rng = np.random.default_rng(4)
        go, gS = (torch.tensor(rng.standard_normal(tuple(a.shape))) for a in (o, S))
        ((o * go).sum() + (S * gS).sum()).backward()
        ((o_ref * go).sum() + (S_ref * gS).sum()).backward()
        for name in names:
            np.testing.assert_allclose(ours[name].grad.numpy(), ref[name].grad.numpy(), **F64)


def test_comba_equals_fla_naive_chunk():
    """fla's ``naive_chunk_comba`` (the form of its kernels); its ``naive_recurrent_comba``
    reads the decayed state, another recurrence, which the twins do not follow."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("einops")
    naive = fla_reference("comba/naive.py")
    x = comba_inputs(seed=5, HV=2, T=20)
    t = {name: torch.tensor(a) for name, a in x.items()}
    want_o, want_S = naive.naive_chunk_comba(
        t["q"], t["k"], t["v"], t["p"], t["g"], t["beta"], chunk_size=8,
        initial_state=t["S0"], output_final_state=True,
    )  # fmt: skip
    for op in (chunk_comba, fused_recurrent_comba):
        o, S = call_comba(op, t["q"], t["k"], t["v"], t["p"], t["g"], t["beta"],
                          initial_state=t["S0"], output_final_state=True)  # fmt: skip
        np.testing.assert_allclose(o.numpy(), want_o.numpy(), **F32)
        np.testing.assert_allclose(S.numpy(), want_S.numpy(), **F32)
    other, _ = naive.naive_recurrent_comba(
        t["q"], t["k"], t["v"], t["p"], t["beta"], t["g"], initial_state=t["S0"]
    )
    assert not np.allclose(other.numpy(), want_o.numpy(), atol=1e-3)


def test_comba_rejects_bad_heads():
    x = comba_inputs(T=4)
    with pytest.raises(ValueError, match="same number of heads"):
        chunk_comba(x["q"], x["k"], x["v"], x["p"][:, :, :1], x["g"], x["beta"])
    with pytest.raises(ValueError, match="multiple of the heads"):
        chunk_comba(x["q"], x["k"], x["v"][:, :, :3], x["p"], x["g"][..., :3], x["beta"][..., :3])
    with pytest.raises(TypeError, match="unexpected keyword"):
        chunk_comba(x["q"], x["k"], x["v"], x["p"], x["g"], x["beta"], chunk_size=64)


# --------------------------------------------------------------------------------------------
# GDN-2 (Gated DeltaNet 2)
# --------------------------------------------------------------------------------------------


def gdn2_loop(xp, q, k, v, g, b, w, scale, S0):
    """GDN-2 token by token (``xp``: numpy or torch, float64).

    ``S_t = (I - k_t (b_t * k_t)^T) Diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T``,
    ``o_t = scale S_t^T q_t``.
    """
    S = S0
    outs = []
    for t in range(q.shape[1]):
        S = S * xp.exp(g[:, t])[..., None]
        erase = ((b[:, t] * k[:, t])[..., None] * S).sum(-2)
        S = S + k[:, t][..., None] * (w[:, t] * v[:, t] - erase)[..., None, :]
        outs.append(scale * (S * q[:, t][..., None]).sum(-2))
    return (xp.stack(outs, 1) if outs else v[:, :0] * 0), S


def gdn2_inputs(seed=0, B=2, T=10, H=3, K=4, V=5):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, H, K))
    return {
        "q": rng.standard_normal((B, T, H, K)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.standard_normal((B, T, H, V)),
        "g": -rng.uniform(0.01, 1.0, (B, T, H, K)),
        "b": rng.uniform(0.0, 1.5, (B, T, H, K)),
        "w": rng.uniform(0.0, 1.0, (B, T, H, V)),
        "S0": rng.standard_normal((B, H, K, V)),
    }


GDN2 = (chunk_gdn2, fused_recurrent_gdn2)
GDN2_ARGS = ("q", "k", "v", "g", "b", "w")


@pytest.mark.parametrize("op", GDN2)
def test_gdn2_equals_float64_loop(op):
    x = gdn2_inputs()
    copies = {name: a.copy() for name, a in x.items()}
    want_o, want_S = gdn2_loop(np, *(x[n] for n in GDN2_ARGS), 0.5, x["S0"])
    o, S = op(*(x[n] for n in GDN2_ARGS), initial_state=x["S0"], output_final_state=True)
    np.testing.assert_allclose(o, want_o, **F64)
    np.testing.assert_allclose(S, want_S, **F64)
    for name, a in x.items():
        np.testing.assert_array_equal(a, copies[name])
    o2, none = op(*(x[n] for n in GDN2_ARGS), scale=0.3)
    assert none is None
    zero = np.zeros_like(x["S0"])
    np.testing.assert_allclose(o2, gdn2_loop(np, *(x[n] for n in GDN2_ARGS), 0.3, zero)[0], **F64)


def test_gdn2_with_b_equal_w_equal_beta_is_kda():
    from polylin.compat.fla import chunk_kda

    x = gdn2_inputs(seed=7)
    beta = np.random.default_rng(8).uniform(0.05, 1.0, x["q"].shape[:3])
    b = np.broadcast_to(beta[..., None], x["k"].shape)
    w = np.broadcast_to(beta[..., None], x["v"].shape)
    o, S = chunk_gdn2(x["q"], x["k"], x["v"], x["g"], b, w, initial_state=x["S0"],
                      output_final_state=True)  # fmt: skip
    o_kda, S_kda = chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, initial_state=x["S0"],
                             output_final_state=True)  # fmt: skip
    np.testing.assert_allclose(o, o_kda, **F64)
    np.testing.assert_allclose(S, S_kda, **F64)


def test_gdn2_qk_l2norm_and_packed_sequences():
    x = gdn2_inputs(seed=1, B=1, T=9)
    offsets = [0, 4, 4, 9]
    S0 = np.random.default_rng(2).standard_normal((3, 3, 4, 5))
    raw = {n: x[n] * 2.5 for n in ("q", "k")}
    o, S = chunk_gdn2(
        raw["q"], raw["k"], x["v"], x["g"], x["b"], x["w"], initial_state=S0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=np.asarray(offsets),
    )  # fmt: skip
    unit = {n: a / np.sqrt((a**2).sum(-1, keepdims=True) + 1e-6) for n, a in raw.items()}
    for i, (s, e) in enumerate(pairwise(offsets)):
        want_o, want_S = gdn2_loop(
            np, unit["q"][:, s:e], unit["k"][:, s:e],
            *(x[n][:, s:e] for n in ("v", "g", "b", "w")), 0.5, S0[i : i + 1],
        )  # fmt: skip
        np.testing.assert_allclose(o[:, s:e], want_o, **F64)
        np.testing.assert_allclose(S[i : i + 1], want_S, **F64)


def test_gdn2_torch_gradients():
    torch = pytest.importorskip("torch")
    x = gdn2_inputs(seed=3, T=7)
    names = (*GDN2_ARGS, "S0")
    for op in GDN2:
        ours = {n: torch.tensor(x[n], requires_grad=True) for n in names}
        ref = {n: torch.tensor(x[n], requires_grad=True) for n in names}
        o, S = op(*(ours[n] for n in GDN2_ARGS), initial_state=ours["S0"],
                  output_final_state=True)  # fmt: skip
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
        o_ref, S_ref = gdn2_loop(torch, *(ref[n] for n in GDN2_ARGS), 0.5, ref["S0"])
        np.testing.assert_allclose(o.detach().numpy(), o_ref.detach().numpy(), **F64)
        np.testing.assert_allclose(S.detach().numpy(), S_ref.detach().numpy(), **F64)
        rng = np.random.default_rng(4)
        go, gS = (torch.tensor(rng.standard_normal(tuple(a.shape))) for a in (o, S))
        ((o * go).sum() + (S * gS).sum()).backward()
        ((o_ref * go).sum() + (S_ref * gS).sum()).backward()
        for n in names:
            np.testing.assert_allclose(ours[n].grad.numpy(), ref[n].grad.numpy(), **F64)


def test_gdn2_equals_fla_naive():
    torch = pytest.importorskip("torch")
    naive = fla_reference("gdn2/naive.py")
    x = gdn2_inputs(seed=5, T=20)
    t = {n: torch.tensor(a) for n, a in x.items()}
    args = [t[n] for n in GDN2_ARGS]
    want_o, want_S = naive.naive_recurrent_gdn2(
        *args, initial_state=t["S0"], output_final_state=True
    )
    chunk_o, chunk_S = naive.naive_chunk_gdn2(
        *args, initial_state=t["S0"], output_final_state=True, chunk_size=8
    )
    np.testing.assert_allclose(chunk_o.numpy(), want_o.numpy(), **F32)
    np.testing.assert_allclose(chunk_S.numpy(), want_S.numpy(), **F32)
    for op in GDN2:
        o, S = op(*args, initial_state=t["S0"], output_final_state=True)
        np.testing.assert_allclose(o.numpy(), want_o.numpy(), **F32)
        np.testing.assert_allclose(S.numpy(), want_S.numpy(), **F32)


def test_gdn2_rejects_what_it_does_not_compute():
    x = gdn2_inputs(T=4)
    args = [x[n] for n in GDN2_ARGS]
    with pytest.raises(NotImplementedError, match="use_gate_in_kernel"):
        chunk_gdn2(*args, use_gate_in_kernel=True)
    with pytest.raises(NotImplementedError, match="A_log"):
        fused_recurrent_gdn2(*args, A_log=np.zeros(3))
    with pytest.raises(NotImplementedError, match="state_v_first"):
        chunk_gdn2(*args, state_v_first=True)
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        chunk_gdn2(*args, return_intermediate_states=True)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gdn2(*args, chunk_size=32)
    with pytest.raises(ValueError, match="`w` must have shape"):
        chunk_gdn2(*args[:5], x["w"][..., :2])
    with pytest.raises(DeprecationWarning, match="head_first"):
        chunk_gdn2(*args, head_first=True)


# --------------------------------------------------------------------------------------------
# Every variant on the other array libraries, packed sequences included
# --------------------------------------------------------------------------------------------


def _variant_cases():
    rng = np.random.default_rng(9)
    B, T, H, K, V = 1, 6, 2, 4, 3
    q, k = rng.standard_normal((2, B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    return {
        chunk_rwkv6: (q, k, v, -rng.uniform(0, 1, (B, T, H, K)), rng.standard_normal((H, K))),
        chunk_gated_delta_product: (
            q, np.repeat(k, 2, 1) / 3, np.repeat(v, 2, 1), -rng.uniform(0, 1, (B, T, H)),
            rng.uniform(0, 1, (B, 2 * T, H)), 2,
        ),
        chunk_comba: (q, k / 3, v, k / 4, -rng.uniform(0, 1, (B, T, H)),
                      rng.uniform(0, 1, (B, T, H))),
        chunk_gdn2: (q, k / 3, v, -rng.uniform(0, 1, (B, T, H, K)),
                     rng.uniform(0, 1, (B, T, H, K)), rng.uniform(0, 1, (B, T, H, V))),
    }  # fmt: skip


@pytest.mark.parametrize(
    "library", [pytest.param("jax.numpy", marks=pytest.mark.slow), "array_api_strict"]
)
def test_variants_on_other_array_libraries(library):
    xp = pytest.importorskip(library)
    offsets = np.asarray([0, 2, 6])
    for op, args in _variant_cases().items():
        want_o, want_S = op(*args, output_final_state=True, cu_seqlens=offsets)
        converted = [xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        o, S = op(*converted, output_final_state=True, cu_seqlens=offsets)
        assert type(o) is type(converted[0]), op.__name__
        np.testing.assert_allclose(np.asarray(o), want_o, **F64)
        np.testing.assert_allclose(np.asarray(S), want_S, **F64)


FLA_FILES = {
    "chunk_rwkv6": "rwkv6/chunk.py",
    "fused_recurrent_rwkv6": "rwkv6/fused_recurrent.py",
    "chunk_gated_delta_product": "gated_delta_product/chunk.py",
    "chunk_comba": "comba/chunk.py",
    "fused_recurrent_comba": "comba/fused_recurrent.py",
    "chunk_gdn2": "gdn2/chunk.py",
    "fused_recurrent_gdn2": "gdn2/fused_recurrent.py",
}


@pytest.mark.parametrize("name", sorted(FLA_FILES))
def test_variant_signatures_are_fla_s(name):
    """Names, order and defaults of the parameters, read from fla 0.6.0's source (parsed: its
    modules import Triton)."""
    import ast
    import inspect

    from polylin.compat import fla

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (the bench extra pins fla-core==0.6.0)")
    source = Path(spec.submodule_search_locations[0]) / "ops" / FLA_FILES[name]
    tree = ast.parse(source.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    names = [a.arg for a in fn.args.args]
    defaults = [ast.unparse(d) for d in fn.args.defaults]
    theirs = list(zip(names, [None] * (len(names) - len(defaults)) + defaults, strict=True))
    if fn.args.kwarg is not None:
        theirs.append(("**" + fn.args.kwarg.arg, None))
    ours = [
        (("**" if p.kind is p.VAR_KEYWORD else "") + p.name,
         None if p.default is p.empty else repr(p.default))
        for p in inspect.signature(getattr(fla, name)).parameters.values()
    ]  # fmt: skip
    assert ours == theirs
