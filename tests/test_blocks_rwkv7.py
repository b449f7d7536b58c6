"""RWKV-7's block (``polylin.blocks.rwkv7``, ``polylin.torch.RWKV7Attention``) and
``polylin.group_norm``.

The reference is ``fla.layers.RWKV7Attention.forward`` written out in float64 PyTorch ops, the
recurrence as a per-token loop in RWKV-7's own form (the state read by ``-kk`` before the
decay, ``state * w + (state . -kk)(kk * a)^T + k v^T``), independent of polylin. The block on
every backend, and the torch module, must compute it to 1e-10 (relative, float64): a whole
sequence, from a cache, prefill then steps, steps from no cache; a left-padded batch with NaN
in the padding (of ``x`` and of ``v_first``) decodes like each prompt alone; inputs are never
modified; JAX differentiates the block under ``jit`` to torch's gradients of the reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from polylin import group_norm  # noqa: E402
from polylin.blocks import (  # noqa: E402
    BlockCache,
    gated_deltanet,
    init_gated_deltanet,
    init_rwkv7,
    rwkv7,
    rwkv7_step,
)
from polylin.testing import Backend  # noqa: E402
from polylin.torch import LayerCache, RWKV7Attention  # noqa: E402

HIDDEN, HEAD_DIM = 16, 4
LORA = {"decay_low_rank_dim": 8, "gate_low_rank_dim": 12, "a_low_rank_dim": 6, "v_low_rank_dim": 5}

#: name -> the module's options (the first layer; later layers, one with fla's fused norms)
CASES = {
    "first": {"layer_idx": 0, "num_hidden_layers": 3},
    "later": {"layer_idx": 1, "value_dim": 24},
    "later-fused": {"layer_idx": 2, "fuse_norm": True, "elementwise_affine": False,
                    "norm_eps": 1e-3},
}  # fmt: skip

pytestmark = pytest.mark.skip_backend(
    Backend.DASK, reason="a block is a few hundred small operations: Dask adds nothing here"
)


def make(name: str, **extra):
    """The float64 module (every parameter redrawn: fla's initialization zeroes ``o_proj``),
    the block's options, and the state dict as NumPy."""
    options = {**CASES[name], **extra}
    torch.manual_seed(0)
    module = RWKV7Attention(
        hidden_size=HIDDEN, head_dim=HEAD_DIM, chunk_size=4, dtype=torch.float64, **LORA,
        **options,
    )  # fmt: skip
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    call = {k: options[k] for k in ("fuse_norm", "norm_eps") if k in options}
    call["chunk_size"] = 4
    params = {n: p.detach().numpy().copy() for n, p in module.state_dict().items()}
    return module, call, params


def reference(sd, x, v_first=None, *, fuse_norm=False, norm_eps=1e-5, chunk_size=None):
    """fla's ``RWKV7Attention.forward`` in float64 torch ops (``sd``: the state dict as
    tensors) from an empty cache: ``(y, v_first, shift state, recurrent state)``
    (``chunk_size``, an option of polylin's, is not used)."""
    B, T, C = x.shape
    H, D = sd["r_k"].shape
    prev = torch.cat([torch.zeros(B, 1, C, dtype=x.dtype), x[:, :-1]], dim=1)
    delta = prev - x  # fla's token_shift
    xr, xw, xk, xv, xa, xg = (torch.addcmul(x, delta, sd[f"x_{n}"]) for n in "rwkvag")

    def linear(t, n):
        return F.linear(t, sd[f"{n}.weight"], sd.get(f"{n}.bias"))

    def lora(t, n, act=lambda h: h):  # fla.layers.rwkv6.LoRA
        return linear(act(linear(t, f"{n}.lora.0")), f"{n}.lora.2")

    r = linear(xr, "r_proj")
    w = -0.6065306597126334 * lora(xw, "w_lora", torch.tanh).sigmoid()
    k, v = linear(xk, "k_proj"), linear(xv, "v_proj")
    if "v_lora.lora.0.weight" not in sd:
        v_first = v
    else:
        v = torch.lerp(v, v_first, lora(xv, "v_lora").sigmoid())
    a = lora(xa, "a_lora").sigmoid()
    g = lora(xg, "g_lora", torch.sigmoid)
    kk = (k * sd["k_k"]).view(B, T, H, D)
    if fuse_norm:  # fla.modules.l2norm.l2_norm
        kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
    else:
        kk = F.normalize(kk, dim=-1, p=2.0)
    k = k.addcmul(k * (a - 1), sd["k_a"])
    r, w, k, a = (t.view(B, T, H, D) for t in (r, w, k, a))
    v = v.view(B, T, H, -1)
    S = torch.zeros(B, H, D, v.shape[-1], dtype=x.dtype)
    outputs = []
    for t in range(T):
        sa = torch.einsum("bhk,bhkv->bhv", -kk[:, t], S)
        S = (S * w[:, t].exp()[..., None] + (kk[:, t] * a[:, t])[..., None] * sa[:, :, None]
             + k[:, t, ..., None] * v[:, t, :, None])  # fmt: skip
        outputs.append(torch.einsum("bhk,bhkv->bhv", r[:, t], S))
    o = torch.stack(outputs, dim=1).reshape(B * T, -1)
    o = F.group_norm(o, H, sd.get("g_norm.weight"), sd.get("g_norm.bias"), eps=D * norm_eps)
    o = o.view(B, T, -1) + ((r * k * sd["r_k"]).sum(-1, keepdim=True) * v).view(B, T, -1)
    return linear(o * g, "o_proj"), v_first, x[:, -1:], S


def ref_numpy(params, x, v_first=None, **kw):
    sd = {n: torch.from_numpy(p) for n, p in params.items()}
    vf = None if v_first is None else torch.from_numpy(v_first)
    return [t.detach().numpy() for t in reference(sd, torch.from_numpy(x), vf, **kw)]


def on(backend, params):
    return {n: backend.from_numpy(p) for n, p in params.items()}


def inputs(rng, params, batch=2, T=11):
    x = rng.standard_normal((batch, T, HIDDEN))
    v_first = rng.standard_normal((batch, T, params["v_proj.weight"].shape[0]))
    return x, (None if "v_lora.lora.0.weight" not in params else v_first)


def assert_close(got, want, rtol=1e-10):
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


def as_users_run(backend, fn):
    """``fn`` under ``jax.jit`` on JAX (op by op, JAX compiles each operation for each new
    shape: slower than one program), as it is otherwise."""
    if backend not in (Backend.JAX, Backend.JAX_CUDA):
        return fn
    import jax

    return jax.jit(fn)


@pytest.mark.slow_grid(prefer={"name": "later"})
@pytest.mark.parametrize("name", sorted(CASES))
def test_block_is_flas_formulas(backend, name, rng):
    """A sequence (output, cache, v_first) against the float64 reference of fla's forward."""
    if "float64" not in backend.float_dtypes():
        pytest.skip(f"[{backend.value}] has no float64")
    _, call, params = make(name)
    x, v_first = inputs(rng, params)
    want, want_first, want_shift, want_S = ref_numpy(params, x, v_first, **call)
    block = as_users_run(
        backend,
        lambda p, x, v: rwkv7(p, x, v_first=v, return_cache=True, return_v_first=True, **call),
    )
    bv = None if v_first is None else backend.from_numpy(v_first)
    got, cache, got_first = block(on(backend, params), backend.from_numpy(x), bv)
    assert_close(backend.to_numpy(got), want)
    assert_close(backend.to_numpy(got_first), want_first)
    assert_close(backend.to_numpy(cache.conv_state[0]), want_shift)
    assert_close(backend.to_numpy(cache.recurrent_state), want_S)


def check_prefill_then_steps(backend, name, rng):
    if "float64" not in backend.float_dtypes():
        pytest.skip(f"[{backend.value}] has no float64")
    _, call, params = make(name)
    x, v_first = inputs(rng, params)
    want, want_first = ref_numpy(params, x, v_first, **call)[:2]
    p = on(backend, params)

    def first(s):
        return None if v_first is None else backend.from_numpy(v_first[s])

    _, cache = rwkv7(p, backend.from_numpy(x[:, :7]), v_first=first(np.s_[:, :7]),
                     return_cache=True, **call)  # fmt: skip
    rest = rwkv7(p, backend.from_numpy(x[:, 7:]), v_first=first(np.s_[:, 7:]), cache=cache,
                 **call)  # fmt: skip
    assert_close(backend.to_numpy(rest), want[:, 7:])
    for t in range(7, x.shape[1]):
        y_t, cache, first_t = rwkv7_step(
            p, backend.from_numpy(x[:, t]), cache, v_first=first(np.s_[:, t]),
            return_v_first=True, **call,
        )  # fmt: skip
        assert_close(backend.to_numpy(y_t), want[:, t])
        assert_close(backend.to_numpy(first_t), want_first[:, t])


@pytest.mark.not_generated(
    reason="JAX compiles each operation again for every new shape (~30 s here): the slow "
    "twin below runs it",
    backend=["jax", "jax:cuda"],
)
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_then_steps_are_one_pass(backend, name, rng):
    """A continuation from a prefill's cache, and steps from it, against the reference."""
    check_prefill_then_steps(backend, name, rng)


@pytest.mark.slow
@pytest.mark.only_backend(Backend.JAX, Backend.JAX_CUDA)
def test_prefill_then_steps_are_one_pass_on_jax(backend, rng):
    check_prefill_then_steps(backend, "later", rng)


@pytest.mark.parametrize("method", ["chunked", "recurrent", "quadratic"])
def test_module_is_flas_formulas_and_trains_like_it(method, rng):
    """The torch module (forward, its cache, step) and its parameters' gradients."""
    module, call, params = make("later", method=method)
    x, v_first = (torch.from_numpy(t) for t in inputs(rng, params, T=9))
    sd = {n: p.detach().clone().requires_grad_() for n, p in module.state_dict().items()}
    want, _, shift, S = reference(sd, x, v_first, **call)
    (want**2).sum().backward()
    got, cache = module(x, v_first=v_first, return_cache=True)
    (got**2).sum().backward()
    assert_close(got.detach().numpy(), want.detach().numpy())
    assert isinstance(cache, LayerCache) and cache.made_by.startswith("RWKV7Attention(")
    assert_close(cache.conv_state[0].numpy(), shift.numpy())
    assert_close(cache.recurrent_state.detach().numpy(), S.detach().numpy())
    for n, p in module.named_parameters():
        assert_close(p.grad.numpy(), sd[n].grad.numpy(), rtol=1e-9)
    with torch.no_grad():
        _, cache = module(x[:, :6], v_first=v_first[:, :6], return_cache=True)
        for t in range(6, 9):
            y_t, cache = module.step(x[:, t], cache, v_first=v_first[:, t])
            assert_close(y_t.numpy(), want[:, t].detach().numpy())


def test_module_loads_flas_state_dict_names():
    """The names, shapes and order of ``fla.layers.RWKV7Attention``'s state dict."""
    module = RWKV7Attention(hidden_size=32, head_dim=8, layer_idx=1, value_dim=48)
    shapes = {n: tuple(p.shape) for n, p in module.state_dict().items()}
    loras = {"w": (32, 32, 32), "v": (32, 48, 32), "a": (32, 32, 32), "g": (32, 48, 32)}
    want = {f"x_{n}": (1, 1, 32) for n in "rwkvag"}
    want |= {
        "k_k": (32,),
        "k_a": (32,),
        "r_k": (4, 8),
        "r_proj.weight": (32, 32),
        "k_proj.weight": (32, 32),
        "v_proj.weight": (48, 32),
        "o_proj.weight": (32, 48),
    }
    for n, (rank, out, inp) in loras.items():
        want[f"{n}_lora.lora.0.weight"] = (rank, inp)
        want[f"{n}_lora.lora.2.weight"] = (out, rank)
        if n != "g":
            want[f"{n}_lora.lora.2.bias"] = (out,)
    want |= {"g_norm.weight": (48,), "g_norm.bias": (48,)}  # fmt: skip
    assert list(shapes) == list(want) and shapes == want
    first = RWKV7Attention(hidden_size=32, num_heads=2, head_dim=None, layer_idx=0)
    assert "v_lora.lora.0.weight" not in first.state_dict() and first.head_dim == 16


@pytest.mark.parametrize("name", ["first", "later"])
def test_steps_from_no_cache_are_the_forward_pass(name, rng):
    _, call, params = make(name)
    x, v_first = inputs(rng, params, T=6)
    want = ref_numpy(params, x, v_first, **call)[0]
    cache = None
    for t in range(x.shape[1]):
        vf = None if v_first is None else v_first[:, t]
        y_t, cache = rwkv7_step(params, x[:, t], cache, v_first=vf, **call)
        assert_close(y_t, want[:, t])
    assert isinstance(cache, BlockCache)


@pytest.mark.parametrize("name", ["first", "later"])
def test_left_padding_with_nan_is_each_prompt_alone(name, rng):
    """Row 0 left-padded by 3 NaN tokens (NaN ``v_first`` too): its outputs are those of the
    prompt alone (0 in the padding), its cache continues like the prompt's; nothing is
    modified in place."""
    _, call, params = make(name)
    x, v_first = inputs(rng, params, T=9)
    x[0, :3] = np.nan
    if v_first is not None:
        v_first[0, :3] = np.nan
    mask = np.ones((2, 9), dtype=bool)
    mask[0, :3] = False
    before = [t.copy() for t in (x, mask) + (() if v_first is None else (v_first,))]
    params_before = {n: p.copy() for n, p in params.items()}
    y, cache, first = rwkv7(params, x, v_first=v_first, attention_mask=mask, return_cache=True,
                            return_v_first=True, **call)  # fmt: skip
    alone, alone_cache = rwkv7(params, x[:1, 3:], v_first=None if v_first is None else
                               v_first[:1, 3:], return_cache=True, **call)  # fmt: skip
    assert np.all(y[0, :3] == 0) and np.all(np.isfinite(y)) and np.all(np.isfinite(first))
    assert_close(y[0, 3:], alone[0])
    if v_first is None:
        assert np.all(first[0, :3] == 0)
    for a, b in zip((x, mask) + (() if v_first is None else (v_first,)), before):
        np.testing.assert_array_equal(a, b)
    for n, p in params.items():
        np.testing.assert_array_equal(p, params_before[n])
    x_t = rng.standard_normal((2, HIDDEN))
    vf_t = None if v_first is None else rng.standard_normal((2, v_first.shape[-1]))
    y_t, _ = rwkv7_step(params, x_t, cache, v_first=vf_t, **call)
    alone_t, _ = rwkv7_step(params, x_t[:1], alone_cache,
                            v_first=None if vf_t is None else vf_t[:1], **call)  # fmt: skip
    assert_close(y_t[:1], alone_t)


def test_a_finished_row_keeps_its_cache(rng):
    _, call, params = make("later")
    x, v_first = inputs(rng, params, T=5)
    _, cache = rwkv7(params, x, v_first=v_first, return_cache=True, **call)
    x_t, vf_t = rng.standard_normal((2, HIDDEN)), rng.standard_normal((2, 24))
    x_t[1], vf_t[1] = np.nan, np.nan
    y_t, after = rwkv7_step(params, x_t, cache, v_first=vf_t,
                            attention_mask=np.array([True, False]), **call)  # fmt: skip
    assert np.all(y_t[1] == 0) and np.all(np.isfinite(y_t))
    np.testing.assert_array_equal(after.recurrent_state[1], cache.recurrent_state[1])
    np.testing.assert_array_equal(after.conv_state[0][1], cache.conv_state[0][1])
    assert not np.array_equal(after.conv_state[0][0], cache.conv_state[0][0])


@pytest.mark.only_backend(Backend.JAX)
def test_jax_jit_and_grad_are_torchs(backend, rng):
    """Two layers (the first, whose values are ``v_first``, and a later one that reads them):
    ``jax.grad`` under ``jax.jit``, the parameters a pytree, equals torch's gradients of the
    reference."""
    import jax

    (_, call0, params0), (_, call1, params1) = make("first"), make("later-fused")
    x = rng.standard_normal((2, 5, HIDDEN))
    sds = [{n: torch.from_numpy(p).requires_grad_() for n, p in ps.items()}
           for ps in (params0, params1)]  # fmt: skip
    h, v_first = reference(sds[0], torch.from_numpy(x), **call0)[:2]
    y = reference(sds[1], torch.from_numpy(x) + h, v_first, **call1)[0]
    (y**2).sum().backward()

    def loss(ps, x):
        h, v_first = rwkv7(ps[0], x, return_v_first=True, **call0)
        return (rwkv7(ps[1], x + h, v_first=v_first, **call1) ** 2).sum()

    grads = jax.jit(jax.grad(loss))([on(backend, params0), on(backend, params1)],
                                    backend.from_numpy(x))  # fmt: skip
    for got, want in zip(grads, sds):
        assert set(got) == set(want)
        for n, g in got.items():
            assert_close(np.asarray(g), want[n].grad.numpy(), rtol=1e-9)


def test_padding_with_nan_reaches_no_gradient(rng):
    """NaN in the padding of ``x`` and of ``v_first``: finite gradients (torch autograd
    through the block), and none for the padded inputs."""
    _, call, params = make("later")
    x, v_first = (torch.from_numpy(t) for t in inputs(rng, params, T=6))
    x[0, :2], v_first[0, :2] = torch.nan, torch.nan
    x.requires_grad_(), v_first.requires_grad_()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    p = {n: torch.from_numpy(a).requires_grad_() for n, a in params.items()}
    y = rwkv7(p, x, v_first=v_first, attention_mask=mask, **call)
    (y**2).sum().backward()
    for t in [*p.values(), x, v_first]:
        assert torch.isfinite(t.grad).all()
    assert (x.grad[0, :2] == 0).all() and (v_first.grad[0, :2] == 0).all()


@pytest.mark.slow  # tracing the block takes Dynamo ~20 s (the layers' compile cases are slow too)
def test_torch_compile_gives_the_eager_outputs(rng):
    module, _, params = make("later")
    x, v_first = (torch.from_numpy(t) for t in inputs(rng, params, T=6))
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        want = module(x, v_first=v_first)
        got = compiled(x, v_first=v_first)
    assert_close(got.numpy(), want.numpy())


def test_initializer_is_flas(rng):
    """Names and shapes of the module's state dict; fla's depth-dependent values; seeded
    draws, the same on every library; fla's default LoRA widths (RWKV-7 0.1B's at 768)."""
    params = init_rwkv7(np, hidden_size=32, head_dim=8, layer_idx=1, num_hidden_layers=4,
                        seed=3, **LORA)  # fmt: skip
    module = RWKV7Attention(hidden_size=32, head_dim=8, layer_idx=1, **LORA)
    assert {n: p.shape for n, p in params.items()} == {
        n: tuple(p.shape) for n, p in module.state_dict().items()
    }
    assert all(p.dtype == np.float32 for p in params.values())
    again = init_rwkv7(torch, hidden_size=32, head_dim=8, layer_idx=1, num_hidden_layers=4,
                       seed=3, dtype=torch.float64, **LORA)  # fmt: skip
    for n, p in params.items():  # float32 against float64 (a float32 QR: ~3e-7 apart)
        np.testing.assert_allclose(again[n].numpy(), p, rtol=1e-6, atol=1e-6)
    n = np.arange(32)
    linear = n / 31 - 0.5
    zigzag = ((n % 8) - 3.5) / 3.5
    zigzag = zigzag * np.abs(zigzag)
    np.testing.assert_allclose(params["x_r"][0, 0], 1 - (n / 32) ** (0.2 * 0.75), rtol=1e-6)
    np.testing.assert_allclose(params["x_w"][0, 0], 1 - (n / 32) ** (0.9 * 0.75), rtol=1e-6)
    np.testing.assert_allclose(params["k_k"], 0.71 - 0.1 * linear, rtol=1e-6)
    www = -6 + 6 * (n / 31) ** (1 + (1 / 3) ** 0.3)
    np.testing.assert_allclose(params["w_lora.lora.2.bias"], www + 0.5 + 2.5 * zigzag,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(params["a_lora.lora.2.bias"], -0.19 + 0.3 * zigzag + 0.4 * linear,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(params["v_lora.lora.2.bias"], 0.73 - 0.4 * linear, rtol=1e-6)
    assert np.all(params["k_a"] == np.float32(1.02)) and np.all(params["r_k"] == np.float32(-0.04))
    np.testing.assert_allclose(params["g_norm.weight"], 0.5**0.7, rtol=1e-6)
    assert np.all(params["g_norm.bias"] == 0) and np.all(params["o_proj.weight"] == 0)
    for name, gain in (("r_proj", 1.0), ("k_proj", 0.1), ("v_proj", 1.0)):
        w = params[f"{name}.weight"].astype(np.float64)
        np.testing.assert_allclose(w @ w.T, gain**2 * np.eye(32), atol=1e-5)
    for name, rank in (("w", 8), ("v", 5), ("a", 6), ("g", 12)):
        assert np.all(params[f"{name}_lora.lora.0.weight"] == 0)
        w = params[f"{name}_lora.lora.2.weight"].astype(np.float64)  # (out, rank), rank < out
        np.testing.assert_allclose(w.T @ w, 0.01 * np.eye(rank), atol=1e-6)
    other = init_rwkv7(np, hidden_size=32, head_dim=8, seed=4, **LORA)
    assert not np.array_equal(other["r_proj.weight"], params["r_proj.weight"])
    assert np.all(np.abs(other["r_proj.weight"]) <= 1 / math.sqrt(32))
    assert np.all(other["x_r"] == 0) and np.all(other["k_a"] == 0)
    assert "v_lora.lora.0.weight" not in init_rwkv7(np, hidden_size=32, head_dim=8, layer_idx=0)
    small = RWKV7Attention(hidden_size=768, head_dim=64, layer_idx=1, device="meta")
    ranks = [small.state_dict()[f"{n}_lora.lora.0.weight"].shape[0] for n in "wavg"]
    assert ranks == [64, 64, 32, 128]


def test_bad_options_and_inputs_say_what_is_wrong(rng):
    _, call, params = make("later")
    x, v_first = inputs(rng, params, T=3)
    with pytest.raises(TypeError, match="pass v_first"):
        rwkv7(params, x, **call)
    with pytest.raises(ValueError, match=r"v_first must have shape \(2, 3, 24\)"):
        rwkv7(params, x, v_first=v_first[..., :16], **call)
    with pytest.raises(ValueError, match=r"head_dim=8 does not match the parameters"):
        rwkv7(params, x, v_first=v_first, head_dim=8, **call)
    with pytest.raises(ValueError, match=r"layer_idx=0 does not match"):
        rwkv7(params, x, v_first=v_first, layer_idx=0, **call)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        rwkv7(params, x, v_first=v_first, heads=2, **call)
    with pytest.raises(ValueError, match="mode must be one of"):
        rwkv7(params, x, v_first=v_first, mode="chunked", **call)
    with pytest.raises(TypeError, match=r"attention_mask must be boolean.*mask == 0"):
        rwkv7(params, x, v_first=v_first, attention_mask=np.ones((2, 3)), **call)
    with pytest.raises(KeyError, match=r"no 'r_k'"):
        rwkv7({n: p for n, p in params.items() if n != "r_k"}, x, v_first=v_first, **call)
    gdn = init_gated_deltanet(np, hidden_size=HIDDEN, num_heads=2, head_dim=4, dtype=np.float64)
    _, other = gated_deltanet(gdn, x, num_heads=2, return_cache=True)
    with pytest.raises(ValueError, match="one token-shift state, got 3"):
        rwkv7_step(params, x[:, 0], other, v_first=v_first[:, 0], **call)
    # the implied options, when right, are accepted; fla's own keywords among them
    y = rwkv7(
        params,
        x,
        v_first=v_first,
        hidden_size=HIDDEN,
        head_dim=HEAD_DIM,
        num_heads=99,
        value_dim=24,
        layer_idx=1,
        num_hidden_layers=5,
        mode="chunk",
        **LORA,
        **call,
    )
    assert_close(y, rwkv7(params, x, v_first=v_first, **call))  # fmt: skip
    module, _, _ = make("later")
    _, cache = make("first")[0](torch.from_numpy(x), return_cache=True)
    with pytest.raises(ValueError, match="another layer's cache"):
        module(torch.from_numpy(x), cache=cache, v_first=torch.from_numpy(v_first))


# --------------------------------------------------------------------------------------------
# polylin.group_norm
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_is_torchs(backend, affine, rng):
    if "float64" not in backend.float_dtypes():
        pytest.skip(f"[{backend.value}] has no float64")
    x = rng.standard_normal((2, 3, 12)) * 3 + 1
    weight, bias = rng.standard_normal(12), rng.standard_normal(12)
    w, b = (torch.from_numpy(weight), torch.from_numpy(bias)) if affine else (None, None)
    want = F.group_norm(torch.from_numpy(x).reshape(6, 12), 4, w, b, eps=1e-3).reshape(x.shape)
    args = (backend.from_numpy(weight), backend.from_numpy(bias)) if affine else ()
    got = group_norm(backend.from_numpy(x), *args, num_groups=4, eps=1e-3)
    assert_close(backend.to_numpy(got), want.numpy())


def test_group_norm_half_precision_and_errors():
    x = torch.randn(3, 8, dtype=torch.float16) * 100
    got = group_norm(x, num_groups=2)
    assert got.dtype == torch.float16
    want = F.group_norm(x.float(), 2).half()
    assert torch.allclose(got.float(), want.float(), atol=2e-3)
    y = np.ones((2, 6))
    with pytest.raises(ValueError, match=r"num_groups must be a positive int dividing x's last"):
        group_norm(y, num_groups=4)
    with pytest.raises(ValueError, match=r"weight must have shape \(C,\) = \(6,\)"):
        group_norm(y, np.ones(3), num_groups=3)
    with pytest.raises(TypeError, match="bias has dtype float32"):
        group_norm(y, None, np.ones(6, np.float32), num_groups=3)
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_norm(y, num_groups=3, eps=0.0)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float16", 5e-3), ("bfloat16", 4e-2)])
def test_half_precision_is_the_float64_block_to_its_precision(dtype, tolerance, rng):
    """fla's plain initialization (``k_k = 0``: every ``kk`` a zero vector, normalized in
    float32) in 16 bits: finite, within the dtype's precision of float64, states in float32."""
    params = init_rwkv7(torch, hidden_size=32, head_dim=8, layer_idx=1, dtype=torch.float64)
    x, v_first = (torch.from_numpy(rng.standard_normal((2, 20, 32))) for _ in range(2))
    want = rwkv7(params, x, v_first=v_first).numpy()
    half = getattr(torch, dtype)
    p = {n: t.to(half) for n, t in params.items()}
    y, cache = rwkv7(p, x.to(half), v_first=v_first.to(half), return_cache=True)
    y_t, cache = rwkv7_step(p, x[:, 0].to(half), cache, v_first=v_first[:, 0].to(half))
    assert y.dtype == y_t.dtype == half and cache.recurrent_state.dtype == torch.float32
    assert torch.isfinite(y_t).all()
    assert_close(y.double().numpy(), want, rtol=tolerance)


RWKV_PACKAGE_CHECK = """
import os, sys
os.environ["RWKV_JIT_ON"], os.environ["RWKV_V7_ON"] = "0", "1"
import numpy as np, torch
import rwkv.model as M
from polylin.blocks import init_rwkv7, rwkv7

C, N = 32, 8
H, T = C // N, 9
rng = np.random.default_rng(0)
for layer in (0, 1):
    p = init_rwkv7(np, hidden_size=C, head_dim=N, layer_idx=layer, dtype=np.float64)
    p = {n: rng.standard_normal(a.shape) * 0.5 for n, a in p.items()}
    x, v_first = rng.standard_normal((T, C)), rng.standard_normal((T, C))
    t = {n: torch.from_numpy(a) for n, a in p.items()}
    zero = torch.zeros(C, dtype=torch.float64)

    def lora(n, i):
        return t[f"{n}_lora.lora.{i}.weight"].T if f"{n}_lora.lora.{i}.weight" in t else zero

    args = [t["x_" + c].view(C) for c in "rwkvag"] + [
        t["w_lora.lora.2.bias"], lora("w", 0), lora("w", 2),
        t["a_lora.lora.2.bias"], lora("a", 0), lora("a", 2),
        t.get("v_lora.lora.2.bias", zero), lora("v", 0), lora("v", 2),
        lora("g", 0), lora("g", 2), t["k_k"], t["k_a"], t["r_k"].reshape(C),
        t["r_proj.weight"].T, t["k_proj.weight"].T, t["v_proj.weight"].T, t["o_proj.weight"].T,
        t["g_norm.weight"], t["g_norm.bias"],
    ]
    state = torch.zeros(H, N, N, dtype=torch.float32)
    want, _, _, want_first = M.RWKV_x070_TMix_seq(
        layer, H, N, torch.from_numpy(x), zero, torch.from_numpy(v_first), state, *args
    )
    # the package's group norm has eps 64e-5 (64 * 1e-5 for its heads of 64)
    y, first = rwkv7(p, x[None], v_first=v_first[None], return_v_first=True, norm_eps=64e-5 / N)
    print(np.abs(y[0] - want.numpy()).max() / np.abs(want.numpy()).max(),
          np.abs(first[0] - want_first.numpy()).max())
"""


def test_rwkv_packages_time_mix_agrees():
    """The ``rwkv`` package's ``RWKV_x070_TMix_seq`` (BlinkDL's RWKV-7, CPU path), where it is
    installed; in a subprocess (importing it sets global torch flags). Its decay constant is
    rounded (0.606531) and its state kept in float32: agreement to 1e-6."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("rwkv") is None:
        pytest.skip("the rwkv package is not installed (pip install rwkv)")
    run = subprocess.run(
        [sys.executable, "-c", RWKV_PACKAGE_CHECK], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    lines = [line.split() for line in run.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == 2
    for output, first in lines:
        assert float(output) < 1e-6 and float(first) < 1e-12
