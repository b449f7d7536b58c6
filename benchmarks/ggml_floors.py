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
- **Prefill: the arithmetic.** The multiply-adds of those products (counted from their shapes
  in one profiled call, two flops each; a triangular solve ``n^2`` per right-hand column) over
  the recurrence's own arithmetic, what ggml's loop computes per token (counted from its
  semantics: :func:`recurrence_flops`). At these head sizes the chunked forms do not save
  arithmetic: their products hold 1.0-1.5x the loop's, so a core whose compiled loop runs near
  the rate of its matrix products bounds the chunked forms' ratio from below.
- **Decoding: the state passes.** The fewest state-sized operations an eager library makes for
  one token, called bare on PyTorch (no argument checks, no plan, every per-token factor made
  beforehand): the decay, the rank-1 update added in place, the read-out, and for the delta rule
  the prediction $k^\\top S$ before the update. ggml's loop makes one pass over a state in all.
  Each bare call's output is checked against the float64 loop like polylin's.
"""

from __future__ import annotations

import math
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


#: The products :func:`product_flops` counts, each with the index of its first operand.
_PRODUCTS = {
    "aten::mm": 0, "aten::bmm": 0, "aten::mv": 0, "aten::dot": 0, "aten::baddbmm": 1,
    "aten::baddbmm_": 1, "aten::addmm": 1, "aten::addmm_": 1, "aten::addbmm": 1,
    "aten::addbmm_": 1, "aten::addmv": 1, "aten::addmv_": 1,
}  # fmt: skip
_SOLVES = ("aten::linalg_solve_triangular",)


def product_flops(fn: Callable[[], Any]) -> float:
    """The flops of the products (:data:`GEMM_OPS`) in one call of ``fn``, from the shapes
    ``torch.profiler`` records: ``2 m k n`` per batched product (``m k`` the first matrix's
    elements over the batch), ``n^2`` per right-hand column of a triangular solve
    (``linalg.solve_triangular``); a product inside another (``mv``'s ``addmv``) counts once."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.timing import _quiet_stderr

    fn()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    total = 0.0
    counted = (*_PRODUCTS, *_SOLVES)
    for event in prof.events():
        parent = event.cpu_parent
        if parent is not None and parent.name in counted:
            continue
        shapes = [list(shape) for shape in event.input_shapes]
        if event.name in _SOLVES:  # (A, B): n^2 per right-hand column
            matrix, rhs = shapes[:2]
            total += math.prod(rhs) * matrix[-1]
        elif event.name in _PRODUCTS:  # the product's operands after any added term
            first, second = shapes[_PRODUCTS[event.name] : _PRODUCTS[event.name] + 2]
            total += 2.0 * math.prod(first) * (second[-1] if len(second) > 1 else 1)
    return total


#: Flops per token, head and state element of ggml's loop (a multiply-add counts two): the
#: decay (1), each rank-1 term (2) and each read of the state against a vector (2).
PASSES = {
    "gdn": 1 + 2 + 2 + 2,  # decay, S^T k, k (beta (v - S^T k))^T, S^T q
    "kda": 1 + 2 + 2 + 2,
    "ssm": 1 + 2 + 2,  # decay, B (x dt)^T, S^T C
    "wkv7": 1 + 2 + 2 + 2 + 2,  # decay, a^T S, b (a^T S)^T, k v^T, S^T r
    "gla": 1 + 2 + 2,  # decay, k v^T, S^T q
}


def recurrence_flops(family: str, sizes: dict[str, int]) -> float:
    """The arithmetic of the recurrence's token loop over a whole prefill (ggml's kernels do
    it): :data:`PASSES` per state element, per head and token; the convolution two per tap."""
    if family == "conv":
        return 2.0 * 4 * sizes["C"] * sizes["T"]
    state = sizes["N"] * sizes["d"] if family == "ssm" else sizes["d"] ** 2
    return float(PASSES[family] * state * sizes["H"] * sizes["T"])


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
