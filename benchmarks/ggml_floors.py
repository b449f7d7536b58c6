"""What bounds polylin's PyTorch calls in ``benchmarks/ggml_ops.py``: two measured floors.

- **Prefill: the matrix products.** The time that the BLAS-backed operations (batched matrix
  products, triangular solves) take inside polylin's own chunked call, from ``torch.profiler``'s
  self times over a few calls as a share of the profiled time, times the call's unprofiled
  mean: the call with its elementwise work, Python and dispatch free. The chunked forms' products
  (the chunk's scores, its values, the state's read-out and update; for the delta rules the
  chunk's system; for a gate per channel the scores level by level, about the lower triangle of
  one product in all) are what makes them chunked, and this core does them at the rate it has
  for their sizes. The share of all operations (products or not) is recorded too; the rest of
  the call is Python and dispatch, which a second thread does not shorten.
- **Decoding: the state passes.** The fewest state-sized operations an eager library makes for
  one token, called bare on PyTorch (no argument checks, no plan, every per-token factor made
  beforehand): the decay, the rank-1 update added in place, the read-out, and for the delta rule
  the prediction $k^\\top S$ before the update. ggml's loop makes one pass over a state in all.
  Each bare call's output is checked against the float64 loop like polylin's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: PyTorch operations that run a BLAS or LAPACK kernel: the products of a chunked form, the
#: in-place ones included (the delta rules' loops and the read-outs add into fresh arrays)
GEMM_OPS = frozenset({
    "aten::mm", "aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::addmm", "aten::addmm_",
    "aten::addbmm", "aten::addbmm_", "aten::mv", "aten::addmv", "aten::addmv_", "aten::dot",
    "aten::linalg_solve_triangular", "aten::triangular_solve",
})  # fmt: skip


def profile_shares(fn: Callable[[], Any], calls: int = 3) -> tuple[float, float]:
    """``(products, operations)``: the shares of ``calls`` calls of ``fn`` spent in
    :data:`GEMM_OPS` and in any PyTorch operation, from ``torch.profiler``'s self times."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.timing import _quiet_stderr

    fn()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    products = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    operations = sum(e.self_cpu_time_total for e in events)
    return products * 1e-6 / wall, operations * 1e-6 / wall


def state_passes(family: str, x: dict[str, Any]) -> Callable[[], Any]:
    """The bare state passes of one decoding token of ``family`` on torch tensors ``x`` (the
    benchmark's inputs, time on axis 1, batch 1); the callable returns the output ``(1, 1,
    ...)`` in the layout of ``ggml_ops.reference``."""
    import torch

    token = {n: a[:, 0] for n, a in x.items() if n not in ("A", "S", "weight", "state")}
    if family == "conv":  # the window and its weighted sum
        taps = x["weight"].T[None]  # (1, 4, C)

        def conv() -> Any:
            window = torch.cat((x["state"], token["x"][:, None]), dim=1)
            return (window * taps).sum(dim=1)[:, None]

        return conv
    S = x["S"][0]  # (H, d_k, d_v)
    if family == "ssm":
        dt = torch.nn.functional.softplus(token["dt"][0])  # (H,)
        decay = torch.exp(dt * x["A"])[:, None, None]
        heads = S.shape[0]
        keys = token["B"][0].expand(heads, -1)[:, :, None]  # (H, N, 1), shared by the heads
        rows = (token["x"][0] * dt[:, None])[:, None, :]  # (H, 1, d)
        queries = token["C"][0].expand(heads, -1)[:, None, :]
    else:
        q, k, v = (token[n][0] for n in ("q", "k", "v"))  # (H, d)
        decay = torch.exp(token["g"][0])[:, :, None]  # (H, d_k or 1, 1)
        keys, rows, queries = k[:, :, None], v[:, None, :], q[:, None, :]
    if family in ("gdn", "kda"):
        beta = token["beta"][0][:, :, None]  # (H, 1, 1)
        scale = S.shape[-1] ** -0.5

        def delta() -> Any:
            state = S * decay  # the decay: one pass, a new state
            error = torch.baddbmm(rows, keys.mT, state, alpha=-1.0)  # v - S^T k: a read
            state.baddbmm_(keys, beta * error)  # the rank-1 update in place: a read and write
            return torch.bmm(queries, state)[:, 0][None, None] * scale  # the read-out: a read

        return delta
    if family == "wkv7":
        a, b = token["a"][0][:, None, :], token["b"][0][:, :, None]

        def wkv7() -> Any:
            removed = torch.bmm(a, S)  # a^T S: a read
            state = S * decay
            factors = torch.cat((keys, b), dim=2)  # (H, d, 2): both rank-1 terms, one product
            state.baddbmm_(factors, torch.cat((rows, removed), dim=1))
            return torch.bmm(queries, state)[:, 0][None, None]

        return wkv7
    scale = S.shape[-2] ** -0.5 if family == "gla" else 1.0

    def linear() -> Any:
        state = S * decay
        state.baddbmm_(keys, rows)
        out = torch.bmm(queries, state)[:, 0][None, None]
        return out * scale if family == "gla" else out

    return linear
