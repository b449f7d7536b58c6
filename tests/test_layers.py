"""The PyTorch blocks against float64 NumPy loops of their formulas, row by row.

GatedDeltaNet, KimiDeltaAttention, GatedLinearAttention and Mamba2 (and LinearAttention's
``normalize=False``) in several configurations: the forward pass of a padded batch (left and
right padding, NaN at padded positions) against each prompt alone; ``step`` after a prefill
equals one forward pass; a cache continues ``forward``; finished rows keep their cache;
gradients (chunked equals recurrent, padded inputs get none); ``torch.compile(fullgraph=True)``;
parameter counts against the docstrings' formulas; parameter names and shapes of ``fla.layers``
(read from its source at fla-org/flash-linear-attention@bc3b101) and of transformers'
``Mamba2Mixer``, whose output the Mamba2 block matches.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polylin import LinearAttentionState, causal_linear_attention  # noqa: E402
from polylin.feature_maps import identity  # noqa: E402
from polylin.torch import (  # noqa: E402
    GatedDeltaNet,
    GatedLinearAttention,
    KimiDeltaAttention,
    LayerCache,
    LinearAttention,
    Mamba2,
    RMSNorm,
)

HIDDEN = 16


# --- float64 NumPy references: one sequence (T, hidden) at a time ----------------------------


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sig(x)


def softplus(x):
    return np.logaddexp(0.0, x)


def conv(x, weight, bias=None):
    """Depthwise causal conv + SiLU of (T, C) with an nn.Conv1d weight (C, 1, W)."""
    T, C = x.shape
    W = weight.shape[-1]
    padded = np.concatenate([np.zeros((W - 1, C)), x])
    out = np.array([[padded[t : t + W, c] @ weight[c, 0] for c in range(C)] for t in range(T)])
    return silu(out + (0.0 if bias is None else bias)).reshape(T, C)


def rms(x, weight, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weight


def l2(x):
    return x / np.sqrt(np.sum(x**2, axis=-1, keepdims=True) + 1e-6)


def gdn_reference(layer, p, x):
    T = x.shape[0]
    H, HV, dk, dv = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    q, k, v = (x @ p[f"{n}_proj.weight"].T for n in "qkv")
    if layer.use_short_conv:
        q, k, v = (conv(t, p[f"{n}_conv1d.weight"]) for t, n in zip((q, k, v), "qkv"))
    else:
        q, k, v = silu(q), silu(k), silu(v)
    q = l2(q.reshape(T, H, dk)) * dk**-0.5
    k = l2(k.reshape(T, H, dk))
    v = v.reshape(T, HV, dv)
    beta = sig(x @ p["b_proj.weight"].T) * (2.0 if layer.allow_neg_eigval else 1.0)
    g = -np.exp(p["A_log"]) * softplus(x @ p["a_proj.weight"].T + p["dt_bias"])
    o = np.zeros((T, HV, dv))
    for j in range(HV):
        h = j // (HV // H)
        S = np.zeros((dk, dv))
        for t in range(T):
            S = math.exp(g[t, j]) * S
            S = S + beta[t, j] * np.outer(k[t, h], v[t, j] - S.T @ k[t, h])
            o[t, j] = S.T @ q[t, h]
    o = rms(o, p["o_norm.weight"], layer.norm_eps)
    if layer.use_gate:
        o = o * silu((x @ p["g_proj.weight"].T).reshape(T, HV, dv))
    return o.reshape(T, -1) @ p["o_proj.weight"].T


def kda_reference(layer, p, x):
    T = x.shape[0]
    H, HV, dk, dv = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    q, k, v = (conv(x @ p[f"{n}_proj.weight"].T, p[f"{n}_conv1d.weight"]) for n in "qkv")
    q = l2(q.reshape(T, H, dk)) * dk**-0.5
    k = l2(k.reshape(T, H, dk))
    v = v.reshape(T, HV, dv)
    beta = sig(x @ p["b_proj.weight"].T) * (2.0 if layer.allow_neg_eigval else 1.0)
    f = (x @ p["f_proj.0.weight"].T @ p["f_proj.1.weight"].T + p["dt_bias"]).reshape(T, HV, dk)
    A = np.exp(p["A_log"])[:, None]
    if layer.lower_bound is None:
        g = -A * softplus(f)
    else:
        g = layer.lower_bound * sig(A * f)
    o = np.zeros((T, HV, dv))
    for j in range(HV):
        h = j // (HV // H)
        S = np.zeros((dk, dv))
        for t in range(T):
            S = np.exp(g[t, j])[:, None] * S
            S = S + beta[t, j] * np.outer(k[t, h], v[t, j] - S.T @ k[t, h])
            o[t, j] = S.T @ q[t, h]
    gate = x @ p["g_proj.0.weight"].T @ p["g_proj.1.weight"].T + p["g_proj.1.bias"]
    o = rms(o, p["o_norm.weight"], layer.norm_eps) * sig(gate.reshape(T, HV, dv))
    return o.reshape(T, -1) @ p["o_proj.weight"].T


def gla_reference(layer, p, x):
    T = x.shape[0]
    H, G, dk, dv = layer.num_heads, layer.num_kv_groups, layer.head_k_dim, layer.head_v_dim
    q, k, v = (x @ p[f"{n}_proj.weight"].T for n in "qkv")
    if layer.use_short_conv:
        q, k, v = (conv(t, p[f"{n}_conv1d.weight"]) for t, n in zip((q, k, v), "qkv"))
    low = x @ p["gk_proj.0.weight"].T
    gk = -softplus(-(low @ p["gk_proj.1.weight"].T + p["gk_proj.1.bias"]))
    gk = gk / layer.gate_logit_normalizer
    q = q.reshape(T, H, dk) * dk**-0.5
    k, v, gk = k.reshape(T, H // G, dk), v.reshape(T, H // G, dv), gk.reshape(T, H // G, dk)
    o = np.zeros((T, H, dv))
    for h in range(H):
        S = np.zeros((dk, dv))
        for t in range(T):
            S = np.exp(gk[t, h // G])[:, None] * S + np.outer(k[t, h // G], v[t, h // G])
            o[t, h] = S.T @ q[t, h]
    name = "g_norm_swish_gate.weight" if layer.fuse_norm_and_gate else "g_norm.weight"
    o = rms(o, p[name], 1e-5)
    gate = x @ p["g_proj.weight"].T
    act = sig if layer.gate_fn == "sigmoid" else silu
    return (o.reshape(T, -1) * act(gate)) @ p["o_proj.weight"].T


def mamba2_reference(layer, p, x):
    T = x.shape[0]
    inner, H, P, N, G = (
        layer.intermediate_size, layer.num_heads, layer.head_dim, layer.ssm_state_size,
        layer.n_groups,
    )  # fmt: skip
    proj = x @ p["in_proj.weight"].T
    z, xBC, dt = proj[:, :inner], proj[:, inner : inner + layer.conv_dim], proj[:, -H:]
    xBC = conv(xBC, p["conv1d.weight"], p["conv1d.bias"])
    xs = xBC[:, :inner].reshape(T, H, P)
    B = xBC[:, inner : inner + G * N].reshape(T, G, N)
    C = xBC[:, inner + G * N :].reshape(T, G, N)
    dt = softplus(dt + p["dt_bias"])
    A = -np.exp(p["A_log"])
    y = np.zeros((T, H, P))
    for h in range(H):
        g = h // (H // G)
        S = np.zeros((N, P))
        for t in range(T):
            S = math.exp(dt[t, h] * A[h]) * S + np.outer(B[t, g], dt[t, h] * xs[t, h])
            y[t, h] = S.T @ C[t, g] + p["D"][h] * xs[t, h]
    y = (y.reshape(T, inner) * silu(z)).reshape(T, G, inner // G)
    y = rms(y, p["norm.weight"].reshape(G, -1), layer.norm_eps).reshape(T, inner)
    return y @ p["out_proj.weight"].T


CONFIGS = {
    "gdn": (GatedDeltaNet, dict(hidden_size=HIDDEN, num_heads=2, head_dim=4), gdn_reference),
    "gdn-gva-neg-eigval": (
        GatedDeltaNet,
        dict(
            hidden_size=HIDDEN,
            num_heads=2,
            num_v_heads=4,
            head_dim=4,
            expand_v=1.5,
            allow_neg_eigval=True,
        ),
        gdn_reference,
    ),
    "gdn-no-gate-no-conv": (
        GatedDeltaNet,
        dict(hidden_size=HIDDEN, num_heads=2, head_dim=4, use_gate=False, use_short_conv=False),
        gdn_reference,
    ),
    "kda": (KimiDeltaAttention, dict(hidden_size=HIDDEN, num_heads=2, head_dim=4), kda_reference),
    "kda-gva-bounded": (
        KimiDeltaAttention,
        dict(
            hidden_size=HIDDEN,
            num_heads=2,
            num_v_heads=4,
            head_dim=4,
            expand_v=1.5,
            lower_bound=-5.0,
            allow_neg_eigval=True,
        ),
        kda_reference,
    ),
    "gla": (GatedLinearAttention, dict(hidden_size=HIDDEN, num_heads=2), gla_reference),
    "gla-conv-mqa-sigmoid": (
        GatedLinearAttention,
        dict(
            hidden_size=HIDDEN,
            num_heads=4,
            num_kv_heads=2,
            expand_k=1.0,
            use_short_conv=True,
            gate_fn="sigmoid",
        ),
        gla_reference,
    ),
    "mamba2": (Mamba2, dict(hidden_size=HIDDEN, head_dim=8, state_size=4), mamba2_reference),
    "mamba2-groups": (
        Mamba2,
        dict(hidden_size=HIDDEN, head_dim=4, state_size=3, n_groups=2),
        mamba2_reference,
    ),
}


def make(name, **extra):
    cls, options, reference = CONFIGS[name]
    torch.manual_seed(0)
    with pytest.warns(UserWarning) if "no-conv" in name else _nothing():
        layer = cls(**options, **extra, dtype=torch.float64)
    with torch.no_grad():  # make the gates matter: random, not the initialization's values
        for pname, param in layer.named_parameters():
            if pname.endswith(("norm.weight", "norm_swish_gate.weight", "D")):
                param.add_(0.3 * torch.randn_like(param))
            if pname in ("gk_proj.1.bias", "g_proj.1.bias"):
                param.copy_(3 * torch.randn_like(param))
    params = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    return layer, lambda x: reference(layer, params, x)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def padded_batch(rng, T=11):
    """Three rows: left-padded by 4, right-padded by 3, full; NaN at padded positions."""
    x = rng.standard_normal((3, T, HIDDEN))
    mask = np.ones((3, T), bool)
    mask[0, :4] = False
    mask[1, T - 3 :] = False
    return np.where(mask[..., None], x, np.nan), mask


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_batch_equals_each_prompt_alone(name, rng) -> None:
    layer, reference = make(name)
    x, mask = padded_batch(rng)
    out = layer(torch.tensor(x), torch.tensor(mask)).detach().numpy()
    for row in range(3):
        want = reference(x[row][mask[row]])
        np.testing.assert_allclose(out[row][mask[row]], want, rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(out[~mask], 0.0)


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_after_a_padded_prefill_decodes_like_each_prompt_alone(name, method, rng) -> None:
    layer, reference = make(name, method=method, chunk_size=4)
    x, mask = padded_batch(rng)
    rows = [x[r][mask[r]] for r in range(3)]
    new = rng.standard_normal((3, 3, HIDDEN))
    _, cache = layer(torch.tensor(x), torch.tensor(mask), return_cache=True)
    assert isinstance(cache, LayerCache)
    for t in range(3):
        y_t, cache = layer.step(torch.tensor(new[:, t]), cache)
        for r in range(3):
            want = reference(np.concatenate([rows[r], new[r, : t + 1]]))[-1]
            np.testing.assert_allclose(y_t[r].detach().numpy(), want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_cache_continues_forward_and_step_starts_from_nothing(name, rng) -> None:
    layer, _ = make(name)
    x = torch.tensor(rng.standard_normal((2, 9, HIDDEN)))
    whole = layer(x)
    head, cache = layer(x[:, :5], return_cache=True)
    tail = layer(x[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole, rtol=1e-10, atol=1e-12)
    cache = None
    for t in range(3):
        y_t, cache = layer.step(x[:, t], cache)
        torch.testing.assert_close(y_t, whole[:, t], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["gdn", "gla-conv-mqa-sigmoid", "mamba2"])
def test_finished_rows_keep_their_cache(name, rng) -> None:
    layer, _ = make(name)
    x = torch.tensor(rng.standard_normal((2, 6, HIDDEN)))
    _, cache = layer(x[:, :4], return_cache=True)
    token = x[:, 4].clone()
    token[1] = float("nan")
    y_t, kept = layer.step(token, cache, attention_mask=torch.tensor([True, False]))
    assert torch.all(y_t[1] == 0)
    full, _ = layer.step(x[:, 4], cache)
    torch.testing.assert_close(y_t[0], full[0])
    for old, new in zip(cache.conv_state, kept.conv_state):
        torch.testing.assert_close(new[1], old[1], rtol=0, atol=0)
    old_r, new_r = cache.recurrent_state, kept.recurrent_state
    if isinstance(old_r, LinearAttentionState):
        old_r, new_r = old_r.S, new_r.S
    torch.testing.assert_close(new_r[1], old_r[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_chunked_equal_recurrent_and_skip_padding(name, rng) -> None:
    x, mask = padded_batch(rng, T=9)
    x = np.where(mask[..., None], x, 0.0)
    grads = []
    for method in ("chunked", "recurrent"):
        layer, _ = make(name, method=method, chunk_size=4)
        xt = torch.tensor(x, requires_grad=True)
        out = layer(xt, torch.tensor(mask))
        (out * torch.tensor(rng.standard_normal(out.shape))).sum().backward()
        assert torch.all(xt.grad[torch.tensor(~mask)] == 0)
        grads.append([xt.grad] + [p.grad for p in layer.parameters()])
        rng = np.random.default_rng(7)  # the same cotangent for the second method
        padded_batch(rng, T=9)
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def param_count_formula(layer) -> int:
    """The docstrings' formulas."""
    if isinstance(layer, KimiDeltaAttention):
        h, kd, vd, hv = layer.hidden_size, layer.key_dim, layer.value_dim, layer.num_v_heads
        n = h * (2 * kd + vd + hv) + layer.head_v_dim * (2 * h + layer.gate_dim + vd) + vd
        n += hv + layer.gate_dim + (2 * kd + vd) * layer.conv_size + layer.head_v_dim
        return n + vd * h
    if isinstance(layer, GatedDeltaNet):
        h, kd, vd, hv = layer.hidden_size, layer.key_dim, layer.value_dim, layer.num_v_heads
        n = h * (2 * kd + (2 if layer.use_gate else 1) * vd + 2 * hv) + vd * h + 2 * hv
        n += layer.head_v_dim
        if layer.use_short_conv:
            n += (2 * kd + vd) * layer.conv_size * (1 + 1 / layer.conv_size * layer.conv_bias)
        return int(n)
    if isinstance(layer, GatedLinearAttention):
        h, kd, vd, g = layer.hidden_size, layer.key_dim, layer.value_dim, layer.num_kv_groups
        r = layer.gk_proj[0].out_features
        n = h * (kd + (kd + vd) // g) + h * vd + r * (h + kd // g) + kd // g + vd * h
        n += layer.head_v_dim
        if layer.use_short_conv:
            n += (kd + (kd + vd) // g) * layer.conv_size
        return n
    h, inner, heads = layer.hidden_size, layer.intermediate_size, layer.num_heads
    groups = 2 * layer.n_groups * layer.ssm_state_size
    n = h * (2 * inner + groups + heads) + layer.conv_dim * (layer.conv_kernel_size + 1)
    return n + 2 * heads + heads + inner + inner * h


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_match_the_docstrings(name) -> None:
    layer, _ = make(name)
    assert sum(p.numel() for p in layer.parameters()) == param_count_formula(layer)


# Names and shapes of fla.layers' parameters (fla-org/flash-linear-attention@bc3b101,
# fla/layers/{gated_deltanet,kda,gla,mamba2}.py; those layers need Triton to import).
FLA_NAMES = {
    "gdn": {
        "q_proj.weight": (8, 16), "k_proj.weight": (8, 16), "v_proj.weight": (16, 16),
        "a_proj.weight": (2, 16), "b_proj.weight": (2, 16), "A_log": (2,), "dt_bias": (2,),
        "q_conv1d.weight": (8, 1, 4), "k_conv1d.weight": (8, 1, 4),
        "v_conv1d.weight": (16, 1, 4), "g_proj.weight": (16, 16), "o_norm.weight": (8,),
        "o_proj.weight": (16, 16),
    },
    "kda": {
        "q_proj.weight": (8, 16), "k_proj.weight": (8, 16), "v_proj.weight": (8, 16),
        "q_conv1d.weight": (8, 1, 4), "k_conv1d.weight": (8, 1, 4), "v_conv1d.weight": (8, 1, 4),
        "f_proj.0.weight": (4, 16), "f_proj.1.weight": (8, 4), "b_proj.weight": (2, 16),
        "A_log": (2,), "dt_bias": (8,), "g_proj.0.weight": (4, 16), "g_proj.1.weight": (8, 4),
        "g_proj.1.bias": (8,), "o_norm.weight": (4,), "o_proj.weight": (16, 8),
    },
    "gla": {
        "q_proj.weight": (8, 16), "k_proj.weight": (8, 16), "v_proj.weight": (16, 16),
        "g_proj.weight": (16, 16), "gk_proj.0.weight": (16, 16), "gk_proj.1.weight": (8, 16),
        "gk_proj.1.bias": (8,), "o_proj.weight": (16, 16), "g_norm_swish_gate.weight": (8,),
    },
    "mamba2": {
        "dt_bias": (4,), "A_log": (4,), "D": (4,), "in_proj.weight": (76, 16),
        "conv1d.weight": (40, 1, 4), "conv1d.bias": (40,), "norm.weight": (32,),
        "out_proj.weight": (16, 32),
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(FLA_NAMES))
def test_parameter_names_and_shapes_are_fla_s(name) -> None:
    layer, _ = make(name)
    got = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert got == FLA_NAMES[name]


def test_mamba2_equals_transformers_mamba2_mixer(rng) -> None:
    """transformers' own Mamba-2 (its PyTorch fallback): same names, same outputs."""
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from transformers import Mamba2Config

    config = Mamba2Config(
        hidden_size=HIDDEN, num_heads=4, head_dim=8, state_size=4, n_groups=1, expand=2,
        chunk_size=4, num_hidden_layers=1,
    )  # fmt: skip
    theirs = mamba2.Mamba2Mixer(config, layer_idx=0).double()
    ours, _ = make("mamba2")
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.tensor(rng.standard_normal((2, 10, HIDDEN)))
    with torch.no_grad():
        # float32 round-off: transformers' MambaRMSNormGated normalizes in float32
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-6)


def test_linear_attention_normalize_false(rng) -> None:
    torch.manual_seed(0)
    layer = LinearAttention(8, 2, normalize=False, feature_map=identity, dtype=torch.float64)
    x = torch.tensor(rng.standard_normal((2, 6, 8)))
    q, k, v = (t.transpose(1, 2) for t in layer._heads(x))
    o = causal_linear_attention(q, k, v, identity, normalize=False)
    want = layer.out_proj(o.transpose(1, 2).reshape(2, 6, 8))
    torch.testing.assert_close(layer(x), want)
    _, state = layer(x[:, :5], return_state=True)
    y_t, _ = layer.step(x[:, 5], state)
    torch.testing.assert_close(y_t, want[:, 5])
    assert "normalize=False" in repr(layer)


@pytest.mark.parametrize("name", ["gdn", "kda", "gla", "mamba2"])
def test_torch_compile_fullgraph(name, rng) -> None:
    """One graph (``fullgraph=True`` raises on a break) for forward with a mask and for step."""
    layer, _ = make(name)
    x = torch.tensor(rng.standard_normal((2, 7, HIDDEN)))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False
    forward = torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)
    out, cache = forward(x, mask, return_cache=True)
    want, want_cache = layer(x, mask, return_cache=True)
    torch.testing.assert_close(out, want)
    step = torch.compile(layer.step, fullgraph=True, backend="eager", dynamic=False)
    torch.testing.assert_close(step(x[:, 0], cache)[0], layer.step(x[:, 0], want_cache)[0])


def test_torch_compile_fullgraph_after_numpy_steps(rng) -> None:
    """The plain steps keep the plans of their last 8 call signatures; a compiled step traced
    while that cache is full of NumPy calls looks nothing up (Dynamo could not compare a NumPy
    dtype in the keys when the oldest plan goes)."""
    from polylin import causal_conv1d_step, step

    for channels in range(1, 11):
        causal_conv1d_step(np.ones((1, channels)), np.ones((channels, 4)))
        step(np.ones((1, channels)), np.ones((1, channels)), np.ones((1, 2)))
    layer, _ = make("mamba2")
    x = torch.tensor(rng.standard_normal((2, 7, HIDDEN)))
    _, cache = layer(x, return_cache=True)
    compiled = torch.compile(layer.step, fullgraph=True, backend="eager", dynamic=False)
    torch.testing.assert_close(compiled(x[:, 0], cache)[0], layer.step(x[:, 0], cache)[0])


def test_bad_input() -> None:
    layer = GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        layer(torch.randn(2, 3, HIDDEN), torch.ones(2, 4))
    with pytest.raises(TypeError, match="cache must be"):
        layer(torch.randn(2, 3, HIDDEN), cache=(1, 2))
    _, mamba_cache = Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4)(
        torch.randn(1, 3, HIDDEN), return_cache=True
    )
    with pytest.raises(ValueError, match="another layer's cache"):
        layer.step(torch.randn(1, HIDDEN), mamba_cache)
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, num_v_heads=3, head_dim=4)
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=4, expand_v=0.3)
    with pytest.raises(ValueError, match="num_heads"):
        Mamba2(num_heads=3, hidden_size=HIDDEN, head_dim=8)
    with pytest.raises(ValueError, match="gate_fn"):
        GatedLinearAttention(hidden_size=HIDDEN, gate_fn="relu")


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention, GatedLinearAttention, Mamba2])
def test_flags_must_be_bools(cls) -> None:
    """return_cache, and the flags of RMSNorm, are True or False: a string or a number would
    be truthy or falsy by accident."""
    options = {"head_dim": 8, "state_size": 4} if cls is Mamba2 else {"num_heads": 2}
    layer = cls(hidden_size=HIDDEN, **options)
    for flag in ["yes", 1, None, np.True_]:
        with pytest.raises(TypeError, match=r"^return_cache must be True or False, got"):
            layer(torch.randn(1, 3, HIDDEN), return_cache=flag)
    for name in ["norm_before_gate", "elementwise_affine"]:
        with pytest.raises(TypeError, match=rf"^{name} must be True or False, got str"):
            RMSNorm(HIDDEN, **{name: "no"})


def test_mamba2_dt_limit_is_a_range() -> None:
    for dt_limit, error, match in [
        ((0.1, 0.01), ValueError, r"^dt_limit must be \(low, high\) with low <= high, got "
                                  r"\(0.1, 0.01\)"),
        ((float("nan"), 1.0), ValueError, r"^dt_limit must be \(low, high\) with low <= high"),
        ((0.0, float("nan")), ValueError, r"^dt_limit must be \(low, high\) with low <= high"),
        ((0.0, 1.0, 2.0), ValueError, r"^dt_limit must be a pair of numbers \(low, high\)"),
        (("a", "b"), ValueError, r"^dt_limit must be a pair of numbers"),
        (0.1, TypeError, r"^dt_limit must be a pair \(low, high\), got float"),
    ]:  # fmt: skip
        with pytest.raises(error, match=match):
            Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4, dt_limit=dt_limit)
    layer = Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4, dt_limit=[0.01, 0.01])
    assert layer.dt_limit == (0.01, 0.01)


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention, GatedLinearAttention, Mamba2])
def test_bad_input_dtype_and_caches_name_the_argument(cls) -> None:
    """A float64 input to a float32 layer, and caches of another batch, of another layer or
    with a missing part, are errors that name the argument, in the cache's own terms."""
    options = {"head_dim": 8, "state_size": 4} if cls is Mamba2 else {"num_heads": 2}
    layer = cls(hidden_size=HIDDEN, **options)
    other = (Mamba2(hidden_size=HIDDEN, head_dim=8, state_size=4) if cls is not Mamba2
             else GatedDeltaNet(hidden_size=HIDDEN, num_heads=2, head_dim=4))  # fmt: skip
    x = torch.randn(2, 3, HIDDEN)
    with pytest.raises(TypeError, match=r"^x has dtype torch.float64 but the layer's weights"):
        layer(x.double())
    with pytest.raises(TypeError, match=r"^x_t has dtype torch.float64"):
        layer.step(x[:, 0].double())
    _, cache = layer(x, return_cache=True)
    with pytest.raises(ValueError, match=r"^cache\.(conv_state\[0\]|recurrent_state) .*batch=3"):
        layer.step(torch.randn(3, HIDDEN), cache)
    _, foreign = other(x, return_cache=True)
    with pytest.raises((TypeError, ValueError), match="another layer's cache"):
        layer.step(x[:, 0], foreign)
    missing = LayerCache(cache.conv_state, None)
    with pytest.raises(TypeError, match=r"^cache.recurrent_state must be"):
        layer.step(x[:, 0], missing)
    with pytest.raises(ValueError, match=r"^cache.conv_state must be a tuple"):
        layer.step(x[:, 0], LayerCache(None, cache.recurrent_state))
    y, _ = layer.step(x[:, 0], cache)  # the good cache still works
    assert y.shape == (2, HIDDEN)


def test_decode_benchmark_runs_tiny(tmp_path, capsys) -> None:
    """benchmarks/layer_decode.py at a tiny size: its rows, its overhead, its JSON (it also
    checks that its bare calls give the layer's step)."""
    from benchmarks import layer_decode

    out = tmp_path / "decode.json"
    argv = ["--layers", "2", "--hidden", "64", "--contexts", "8", "32", "--repeats", "2"]
    result = layer_decode.main([*argv, "--threads", "1", "--json", str(out)])
    assert [row["context"] for row in result["rows"]] == [8, 32]
    assert json.loads(out.read_text())["overhead"].keys() >= {"step_us", "bare_us"}
    assert all(
        row["gdn_cache_bytes"] == result["rows"][0]["gdn_cache_bytes"] for row in result["rows"]
    )
    assert "the layer adds" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gdn-gva-neg-eigval", "kda", "gla-conv-mqa-sigmoid", "mamba2"])
def test_bfloat16_layers_follow_float32(name, rng) -> None:
    """bfloat16 weights and inputs: bfloat16 outputs near float32's; float32 caches."""
    layer64, _ = make(name)
    cls, options, _ = CONFIGS[name]
    layer32, layer16 = (cls(**options, dtype=d) for d in (torch.float32, torch.bfloat16))
    layer32.load_state_dict(layer64.state_dict())
    layer16.load_state_dict(layer64.state_dict())
    x = torch.tensor(rng.standard_normal((2, 9, HIDDEN)), dtype=torch.float32)
    with torch.no_grad():
        want = layer32(x)
        out, cache = layer16(x.bfloat16(), return_cache=True)
        y_t, cache = layer16.step(x[:, 0].bfloat16(), cache)
    assert out.dtype == y_t.dtype == torch.bfloat16
    assert (out.float() - want).abs().max() < 0.03 * want.abs().max()
    states = [*cache.conv_state, getattr(cache.recurrent_state, "S", cache.recurrent_state)]
    assert all(s.dtype == torch.float32 for s in states)
