"""The fused PyTorch decoding steps (``_backend.fused.fused_*_step``): the recurrences' values and
gradients, with and without autograd recording, and the caller's arrays never written."""

from __future__ import annotations

import numpy as np
import pytest

import polylin

torch = pytest.importorskip("torch")

LEAD, D_K, D_V = (2, 3), 4, 5


def draws(seed, gate):
    """Float64 tensors of one token, one state per row (the fused steps' case)."""
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((*LEAD, D_K)),
        "k": rng.standard_normal((*LEAD, D_K)) / 2,
        "v": rng.standard_normal((*LEAD, D_V)),
        "beta": rng.uniform(0.1, 0.9, (*LEAD, 1)),
        "a": rng.standard_normal((*LEAD, D_K)) / 2,
        "b": rng.standard_normal((*LEAD, D_K)) / 2,
        "S": rng.standard_normal((*LEAD, D_K, D_V)),
        "z": rng.uniform(0.5, 1.0, (*LEAD, D_K)),
    }
    if gate is not None:
        x["g"] = -rng.uniform(0.0, 1.0, (*LEAD, 1 if gate == "scalar" else D_K))
    return {name: torch.tensor(a, requires_grad=True) for name, a in x.items()}


def by_formula(rule, x):
    """The recurrence written plainly: ``(o_t, S_t)`` (and ``z_t`` for linear attention)."""
    S = x["S"]
    decay = torch.exp(x["g"])[..., :, None] if "g" in x else None
    if rule == "delta":
        S = S if decay is None else decay * S
        error = x["beta"] * (x["v"] - torch.einsum("...i,...ij->...j", x["k"], S))
        S = S + x["k"][..., :, None] * error[..., None, :]
        return 0.5 * torch.einsum("...i,...ij->...j", x["q"], S), S
    if rule == "dplr":
        read = torch.einsum("...i,...ij->...j", x["a"], S)
        S = S if decay is None else decay * S
        S = S + x["b"][..., :, None] * read[..., None, :]
        S = S + x["k"][..., :, None] * x["v"][..., None, :]
        return 0.5 * torch.einsum("...i,...ij->...j", x["q"], S), S
    z = x["z"] if decay is None else decay[..., 0] * x["z"]
    S = (S if decay is None else decay * S) + x["k"][..., :, None] * x["v"][..., None, :]
    return torch.einsum("...i,...ij->...j", x["q"], S), S, z + x["k"]


def by_polylin(rule, x):
    g = x.get("g")
    if rule == "delta":
        return polylin.delta_rule_step(x["q"], x["k"], x["v"], x["beta"], x["S"], log_decay=g,
                                       scale=0.5)  # fmt: skip
    if rule == "dplr":
        return polylin.dplr_delta_rule_step(x["q"], x["k"], x["v"], x["a"], x["b"], x["S"],
                                            log_decay=g, scale=0.5)  # fmt: skip
    state = polylin.LinearAttentionState(x["S"], x["z"])
    o, new = polylin.step(x["q"], x["k"], x["v"], state, polylin.feature_maps.identity,
                          log_decay=g, normalize=False)  # fmt: skip
    return o, new.S, new.z


@pytest.mark.parametrize("rule", ["delta", "dplr", "linear"])
@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_values_and_gradients(rule, gate):
    x = draws(0, gate)
    got, want = by_polylin(rule, x), by_formula(rule, x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    weights = [torch.randn(a.shape, dtype=a.dtype, generator=torch.Generator().manual_seed(i))
               for i, a in enumerate(want)]  # fmt: skip
    inputs = list(x.values())
    grads_got = torch.autograd.grad(sum((w * a).sum() for w, a in zip(weights, got)), inputs,
                                    allow_unused=True)  # fmt: skip
    grads_want = torch.autograd.grad(sum((w * a).sum() for w, a in zip(weights, want)), inputs,
                                     allow_unused=True)  # fmt: skip
    for name, a, b in zip(x, grads_got, grads_want, strict=True):
        if b is None:
            assert a is None or not torch.any(a), name
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("rule", ["delta", "dplr", "linear"])
@pytest.mark.parametrize("grad", [False, True])
def test_the_callers_state_is_never_written(rule, grad):
    """The decayed state is updated in place only where it is the step's own new tensor."""
    x = draws(1, "channel")
    with torch.set_grad_enabled(grad):
        before = {name: a.detach().clone() for name, a in x.items()}
        if not grad:
            x = {name: a.detach() for name, a in x.items()}
        for _ in range(2):
            out = by_polylin(rule, x)
        for name, a in x.items():
            torch.testing.assert_close(a.detach(), before[name], rtol=0, atol=0, msg=name)
        assert out[1] is not x["S"] and out[1].data_ptr() != x["S"].data_ptr()


def test_the_fused_forms_apply_to_these_inputs_only():
    """One state per token row: fused; a key shared by grouped heads: fused outside autograd
    (expanded), the array-API form under it; NumPy arrays: the array-API form."""
    from polylin._backend import fused as loops

    x = {name: a.detach() for name, a in draws(2, "channel").items()}
    decay = torch.exp(x["g"])
    assert loops.fused_delta_step(x["q"], x["k"], x["v"], x["beta"], decay, x["S"]) is not None
    assert loops.fused_dplr_step(x["q"], x["k"], x["v"], x["a"], x["b"], decay, x["S"]) is not None
    assert loops.fused_linear_step(x["q"], x["k"], x["v"], decay, x["S"], x["z"]) is not None
    shared = x["k"][:, :1]
    fused = loops.fused_linear_step(x["q"], shared, x["v"], None, x["S"], x["z"])
    assert fused is not None
    torch.testing.assert_close(fused[1], x["S"] + shared[..., :, None] * x["v"][..., None, :],
                               rtol=0, atol=1e-15)  # fmt: skip
    recorded = shared.clone().requires_grad_()
    assert loops.fused_delta_step(x["q"], recorded, x["v"], x["beta"], decay, x["S"]) is None
    assert loops.fused_dplr_step(*(a.numpy() for a in (x["q"], x["k"], x["v"], x["a"], x["b"])),
                                None, x["S"].numpy()) is None  # fmt: skip


def test_grouped_keys_outside_autograd_match_the_formula():
    """Keys and queries shared by the heads of a group (Mamba-2's B and C): the expanded fused
    form gives the recurrence's values."""
    x = {name: a.detach() for name, a in draws(3, "scalar").items()}
    x["q"], x["k"] = x["q"][:, :1], x["k"][:, :1]
    for rule in ("delta", "dplr", "linear"):
        for a, b in zip(by_polylin(rule, x), by_formula(rule, x), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", ["delta", "dplr", "linear"])
def test_a_plan_finds_grouped_keys_once(rule):
    """A prepared step's plan finds once that the keys and queries of a group broadcast
    against the heads (``StepRows.broadcast``): each token then only expands them, outside
    autograd to the recurrence's values; under autograd the array-API form runs, with the
    recurrence's values and gradients."""
    from polylin._backend.fused import StepRows

    prepared = {"delta": polylin.prepare_delta_rule_step(scale=0.5),
                "dplr": polylin.prepare_dplr_step(scale=0.5),
                "linear": polylin.prepare_step(polylin.feature_maps.identity, normalize=False)}
    step = prepared[rule]

    def run(x):
        if rule == "delta":
            return step(x["q"], x["k"], x["v"], x["beta"], x["S"], log_decay=x["g"])
        if rule == "dplr":
            return step(x["q"], x["k"], x["v"], x["a"], x["b"], x["S"], log_decay=x["g"])
        o, new = step(x["q"], x["k"], x["v"], polylin.LinearAttentionState(x["S"], x["z"]),
                      log_decay=x["g"])  # fmt: skip
        return o, new.S, new.z

    for recorded in (False, True):
        x = {name: a.detach().requires_grad_(recorded) for name, a in draws(4, "scalar").items()}
        x["q"], x["k"] = (a[:, :1].detach().requires_grad_(recorded) for a in (x["q"], x["k"]))
        got, want = run(x), by_formula(rule, x)
        assert step._plan.fused_rows == StepRows(6, True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        if recorded:
            leaves = [x[name] for name in ("q", "k", "v", "S", "g")]
            grads = [torch.autograd.grad(sum(y.sum() for y in out), leaves)
                     for out in (run(x), by_formula(rule, x))]  # fmt: skip
            for a, b in zip(*grads, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
