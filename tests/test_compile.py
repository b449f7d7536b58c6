"""polylin under ``torch.compile``: one graph, no graph breaks, no warnings, the eager results.

The graph-break and warning checks run in a fresh interpreter: Dynamo prints each warning once
per process (an earlier test would hide it), and a user's first compiled call may be the first
time polylin meets a tensor at all.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import polylin
from polylin.testing import Backend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def torch():
    reason = Backend.TORCH.unavailable_reason()
    if reason is not None:
        pytest.skip(f"[torch] {reason}")
    torch = Backend.TORCH.module()
    if not hasattr(torch, "compile"):
        pytest.skip(f"[torch] torch {torch.__version__} has no torch.compile")
    return torch


# Each case: a name, then the code that defines ``fn`` and ``args`` (tensors q, k, v exist).
EXPLAIN_CASES = {
    "causal default": "fn, args, kwargs = polylin.causal_linear_attention, (q, k, v), {}",
    "mask, initial state, return_state": """
        mask = torch.ones(2, 4, 37, dtype=torch.bool)
        mask[0, :, :5] = False
        state = polylin.LinearAttentionState(torch.ones(2, 4, 8, 8), torch.ones(2, 4, 8))
        fn, args = polylin.causal_linear_attention, (q, k, v)
        kwargs = dict(attention_mask=mask, initial_state=state, return_state=True)
    """,
    "recurrent": """
        fn, args, kwargs = polylin.causal_linear_attention, (q, k, v), dict(method="recurrent")
    """,
    "favor_plus": """
        phi = polylin.feature_maps.favor_plus(8, num_features=16, seed=0)
        polylin.causal_linear_attention(q, k, v, phi)  # builds the projection, eagerly
        fn, args, kwargs = polylin.causal_linear_attention, (q, k, v, phi), {}
    """,
    "linear_attention": "fn, args, kwargs = polylin.linear_attention, (q, k, v), {}",
    "step": "fn, args, kwargs = polylin.step, (q[..., 0, :], k[..., 0, :], v[..., 0, :]), {}",
    "LinearAttention layer": """
        from polylin.torch import LinearAttention
        x, mask = torch.randn(2, 37, 32), torch.ones(2, 37, dtype=torch.int64)
        fn, args, kwargs = LinearAttention(32, 4), (x, mask), {}
    """,
    "LinearAttention.step": """
        from polylin.torch import LinearAttention
        fn, args, kwargs = LinearAttention(32, 4).step, (torch.randn(2, 32),), {}
    """,
    "seq_axis=1, (batch, T) mask": """
        mask = torch.ones(2, 37, dtype=torch.bool)
        mask[1, 30:] = False
        fn, args = polylin.causal_linear_attention, (q, k, v)
        kwargs = dict(seq_axis=1, attention_mask=mask[:, :4])  # (batch, T) with T = 4 here
    """,
    "step with finished rows": """
        fn, args = polylin.step, (q[..., 0, :], k[..., 0, :], v[..., 0, :])
        kwargs = dict(attention_mask=torch.tensor([True, False]))
    """,
}

EXPLAIN_SCRIPT = """
import json, warnings
import torch
import polylin

results = {}
for name, setup in json.loads(CASES).items():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 8) for _ in range(3))
    namespace = dict(polylin=polylin, torch=torch, q=q, k=k, v=v)
    exec(setup, namespace)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = torch._dynamo.explain(namespace["fn"])(*namespace["args"], **namespace["kwargs"])
    results[name] = dict(
        graphs=report.graph_count,
        breaks=report.graph_break_count,
        reasons=[str(b.reason).splitlines()[0] for b in report.break_reasons],
        warnings=[f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught],
    )
print("RESULTS", json.dumps(results))
"""


if "log_decay" in inspect.signature(polylin.causal_linear_attention).parameters:
    EXPLAIN_CASES["log_decay per token, not normalized"] = """
        fn, args = polylin.causal_linear_attention, (q, k, v)
        kwargs = dict(log_decay=-0.1 * torch.rand(2, 4, 37, 1), normalize=False)
    """


if hasattr(polylin, "delta_rule_attention"):
    EXPLAIN_CASES["delta_rule_attention"] = """
        beta = torch.rand(2, 4, 37, 1)
        qn, kn = (t / t.norm(dim=-1, keepdim=True) for t in (q, k))
        fn, args, kwargs = polylin.delta_rule_attention, (qn, kn, v, beta), {}
    """
    EXPLAIN_CASES["delta_rule_attention KDA, grouped, scale, qk_l2norm"] = """
        beta = torch.rand(2, 4, 2, 37, 1)
        g = -torch.rand(2, 4, 2, 37, 8)
        v2 = torch.randn(2, 4, 2, 37, 8)
        fn, args = polylin.delta_rule_attention, (q[:, :, None], k[:, :, None], v2, beta)
        kwargs = dict(log_decay=g, scale=0.5, qk_l2norm=True)
    """


for _layer, _options in (
    ("GatedDeltaNet", "num_heads=2, head_dim=8, num_v_heads=4"),
    ("KimiDeltaAttention", "num_heads=2, head_dim=8"),
    ("GatedLinearAttention", "num_heads=2, use_short_conv=True"),
    ("Mamba2", "head_dim=8, state_size=4"),
):
    EXPLAIN_CASES[f"{_layer} layer"] = f"""
        from polylin.torch import {_layer}
        x, mask = torch.randn(2, 37, 32), torch.ones(2, 37, dtype=torch.int64)
        fn, args, kwargs = {_layer}(hidden_size=32, {_options}), (x, mask), {{}}
    """
    EXPLAIN_CASES[f"{_layer}.step"] = f"""
        from polylin.torch import {_layer}
        fn, args, kwargs = {_layer}(hidden_size=32, {_options}).step, (torch.randn(2, 32),), {{}}
    """


if hasattr(polylin, "dplr_delta_rule"):
    EXPLAIN_CASES["dplr_delta_rule, per-channel decay"] = """
        kk = k / k.norm(dim=-1, keepdim=True)
        log_w = -torch.exp(torch.rand(2, 4, 37, 8) - 2)
        fn, args = polylin.dplr_delta_rule, (q, k, v, -kk, kk * torch.rand(2, 4, 37, 8))
        kwargs = dict(log_decay=log_w, chunk_size=16)
    """


#: The model layers' cases run in ``make test-slow``: in ``make test``, tests/test_layers.py
#: compiles each of them, forward and step, with ``fullgraph=True`` (a graph break raises).
SLOW_CASES = {
    f"{layer}{call}"
    for layer in ("GatedDeltaNet", "KimiDeltaAttention", "GatedLinearAttention", "Mamba2")
    for call in (" layer", ".step")
}


@pytest.fixture(scope="module")
def explained(torch, request, run_once) -> dict:
    """``torch._dynamo.explain`` of every case this run selected, run in one fresh interpreter
    (once per test run, shared by pytest-xdist's workers)."""
    selected = sorted(
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_one_graph_no_breaks_no_warnings"
        and item.module is request.module
    )
    cases = {name: textwrap.dedent(EXPLAIN_CASES[name]) for name in selected}
    script = f"CASES = {json.dumps(json.dumps(cases))}\n" + EXPLAIN_SCRIPT
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }

    def explain(folder: Path) -> None:
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")]
        (folder / "results.json").write_text(line.removeprefix("RESULTS "))

    return json.loads((run_once("dynamo-explain", explain) / "results.json").read_text())


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in EXPLAIN_CASES],
)
def test_one_graph_no_breaks_no_warnings(explained: dict, case: str) -> None:
    """Dynamo captures the whole call in one graph and warns about nothing."""
    result = explained[case]
    assert result["breaks"] == 0, result["reasons"]
    assert result["graphs"] == 1
    assert result["warnings"] == []


RECOMPILE_SCRIPT = """
import torch
{first_import}
torch._dynamo.config.error_on_recompile = True  # a second compilation raises
q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
compiled = torch.compile(polylin.{function}, backend="eager", dynamic=False)
for _ in range(3):
    compiled(q, k, v, {arguments})
print("OK")
"""


@pytest.mark.slow_grid(cover=("first_import", "function"))
@pytest.mark.parametrize(
    ("first_import", "function", "arguments"),
    [
        ("import polylin", "causal_linear_attention", ""),
        ("import polylin", "delta_rule_attention", "0.5"),
        ("import polylin.torch; import polylin", "causal_linear_attention", ""),
    ],
)
def test_the_first_compiled_call_of_a_process_compiles_once(
    torch, first_import: str, function: str, arguments: str
) -> None:
    """In a fresh interpreter (torch, then polylin, imported; or polylin.torch), the first call
    traced by ``torch.compile`` leaves nothing that a later call's guards see changed."""
    script = RECOMPILE_SCRIPT.format(
        first_import=first_import, function=function, arguments=arguments
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def _inputs(torch, T: int = 37):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, T, 8, generator=gen, requires_grad=True) for _ in range(3)]


@pytest.mark.slow_grid
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_compiled_forward_and_gradients_match_eager(torch, method: str) -> None:
    """``fullgraph=True`` compiles (it raises on any graph break); values and gradients agree.

    T = 37 with chunk_size 16: a partial last chunk, and (under compile) the one-block prefix-sum
    path of the chunked form rather than the eager CPU one.
    """
    compiled = torch.compile(
        polylin.causal_linear_attention, fullgraph=True, backend="aot_eager", dynamic=False
    )
    q, k, v = _inputs(torch)
    out = compiled(q, k, v, method=method, chunk_size=16)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = polylin.causal_linear_attention(q, k, v, method=method, chunk_size=16)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gate", ["token", "channel"])
def test_compiled_delta_rule_matches_eager(torch, gate: str) -> None:
    """The gated delta rule with grouped heads, scale and qk_l2norm under ``fullgraph=True``:
    values and gradients wrt every input agree with eager."""
    compiled = torch.compile(
        polylin.delta_rule_attention, fullgraph=True, backend="aot_eager", dynamic=False
    )
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 1, 37, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, 3, 2, 37, 8, generator=gen)
    beta = torch.rand(2, 3, 2, 37, 1, generator=gen)
    g = -torch.rand(2, 3, 2, 37, 8 if gate == "channel" else 1, generator=gen)
    xs = [x.requires_grad_(True) for x in (q, k, v, beta, g)]
    options = dict(scale=0.5, qk_l2norm=True, chunk_size=16)
    out = compiled(*xs[:4], log_decay=xs[4], **options)
    grads = torch.autograd.grad(out.square().sum(), xs)
    ref = polylin.delta_rule_attention(*xs[:4], log_decay=xs[4], **options)
    ref_grads = torch.autograd.grad(ref.square().sum(), xs)
    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    for g_, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g_.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", [1, 8])
def test_compiled_decay_chains_its_chunks(torch, width: int) -> None:
    """Compiled for the CPU, a decayed chunked call carries its state from chunk to chunk by
    one multiply-add per chunk (``chains_decay``), not by the log-depth scan whose levels
    Inductor computed again for every reader (2.2-3.8x the eager time); the values and
    gradients are eager's."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    compiled = torch.compile(
        polylin.causal_linear_attention, fullgraph=True, backend=record, dynamic=False
    )
    q, k, v = _inputs(torch, T=64)
    g = -torch.rand(2, 3, 64, width, generator=torch.Generator().manual_seed(1))
    g.requires_grad_(True)
    out = compiled(q, k, v, log_decay=g, chunk_size=16)
    (graph,) = graphs
    links = [n for n in graph.nodes if n.target is torch.addcmul]
    assert len(links) == 2 * 4  # the state and the normalizer, 4 chunks of 16
    ref = polylin.causal_linear_attention(q, k, v, log_decay=g, chunk_size=16)
    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, g))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, g))
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def test_compiled_mlstm_chains_its_chunks(torch) -> None:
    """The mLSTM's matrix memory and normalizer cross chunks by the same chain when compiled
    for the CPU (Inductor, the default backend): one multiply-add per chunk each, and the eager
    output."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.graph)
        return torch._inductor.compile(gm, example_inputs)

    compiled = torch.compile(polylin.mlstm, fullgraph=True, backend=record, dynamic=False)
    q, k, v = (x.detach() for x in _inputs(torch, T=64))
    gen = torch.Generator().manual_seed(2)
    i_gate, f_gate = (torch.randn(2, 3, 64, 1, generator=gen) for _ in range(2))
    out = compiled(q, k, v, i_gate, f_gate, chunk_size=16)
    (graph,) = graphs
    assert sum(n.target is torch.addcmul for n in graph.nodes) == 2 * 4
    ref = polylin.mlstm(q, k, v, i_gate, f_gate, chunk_size=16)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_inductor_compiles_and_matches_eager(torch) -> None:
    """The default backend (Inductor, generated C++ on the CPU) gives the eager output."""
    compiled = torch.compile(polylin.causal_linear_attention, fullgraph=True)
    q, k, v = (x.detach() for x in _inputs(torch, T=20))
    out = compiled(q, k, v, chunk_size=8)
    ref = polylin.causal_linear_attention(q, k, v, chunk_size=8)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow_grid
@pytest.mark.parametrize("include_initial", [False, True])
def test_traceable_cumulative_sum_is_the_standard_one(backend, include_initial: bool) -> None:
    """``_backend.ops.cumulative_sum`` (torch.cumsum on PyTorch) equals ``xp.cumulative_sum``."""
    from polylin._backend.ops import cumulative_sum

    x = backend.from_numpy(np.arange(24.0).reshape(2, 3, 4))
    xp = backend.namespace()
    for axis in (0, 1, -1):
        got = backend.to_numpy(cumulative_sum(xp, x, axis=axis, include_initial=include_initial))
        want = np.cumsum(np.arange(24.0).reshape(2, 3, 4), axis=axis)
        if include_initial:
            pad = [(0, 0)] * 3
            pad[axis] = (1, 0)
            want = np.pad(want, pad)
        np.testing.assert_array_equal(got, want)


def test_favor_plus_projection_built_while_compiling(torch) -> None:
    """Without an eager call first, the projection is built outside the graph, then reused."""
    phi = polylin.feature_maps.favor_plus(8, num_features=24, seed=7)  # not built anywhere yet
    compiled = torch.compile(polylin.causal_linear_attention, backend="aot_eager")
    q, k, v = (x.detach() for x in _inputs(torch))
    for _ in range(2):
        out = compiled(q, k, v, phi)
        ref = polylin.causal_linear_attention(q, k, v, phi)
        np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    report = torch._dynamo.explain(polylin.causal_linear_attention)(q, k, v, phi)
    assert report.graph_break_count == 0  # the projection is cached: one graph from now on


def test_compiling_any_is_true_only_while_a_tensor_argument_is_traced(torch) -> None:
    """The plain steps' plan lookup asks torch once whether it traces, then looks for a tensor
    among the arguments: a traced call with another library's arrays alone keeps its plans."""
    from polylin._backend.execution import compiling_any

    seen = []

    def f(x):
        seen.append((compiling_any((None, 1.0, x)), compiling_any((None, 1.0))))
        return x + 1

    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == [(True, False)]
    assert not compiling_any((None, torch.ones(2)))
