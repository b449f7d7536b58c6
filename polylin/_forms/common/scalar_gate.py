"""A scalar gate's intra-chunk products, factored through the middle of each half chunk.

For a scalar gate per token and head, the intra-chunk product of a chunk's scores with an
array ``X`` (the values, or ones for the normalizer) is::

    Y_t = sum_{s <= t} (r_t . k_s) exp(sum_{s<r<=t} g_r) x_s

:func:`~polylin._forms.common.intra_chunk.scalar_gate_scores` builds the decayed scores
``(..., C, C)`` from segment sums, one matrix per head. Where the rows and keys are shared by
the heads of a group and the gate is not (Mamba-2's ``C`` and ``B``), those are the only
per-head ``C x C`` arrays of the chunk. Factored, the decay leaves the scores::

    Y_t = u_t sum_{s <= t} P_ts (w_s x_s),   P = lower(R K^T),   u_t w_s = exp(e_t - e_s)

with ``e_t`` the gate's running sum from a middle token ``m`` to ``t`` (negated before
``m``), each a sum of its own terms, ``u = exp(e)`` and ``w = exp(-e)``: ``P`` is one matrix
for the whole group, and its product with ``w x`` one matrix product whose columns are every
head's values.

``exp(-e_s)`` grows with the distance from ``m``, so each half chunk has its own middle token
(``m_1`` and ``m_2``, a quarter of the chunk from either end of the half), and the second
half's rows meet the first half's keys through both: ``exp(e_t - e_s) = u_t c w_s`` with
``c = exp(sum_{m_1<r<=m_2} g_r) <= 1``, one number per chunk and head::

    Y_1 = u_1 (P_11 (w_1 x_1)),   Y_2 = u_2 (P_21 (c w_1 x_1) + P_22 (w_2 x_2))

This applies where every ``|e_t|`` is at most
:data:`~polylin._forms.common.intra_chunk.FACTORED_SPAN` (16; :func:`within_span`): every
factor is within ``exp(+-16)`` (no overflow), the scores are masked before they meet ``w`` (no
entry above the diagonal is ever scaled), and a decay's exponent is rounded as two sums of at
most 16 each, a relative error of at most about 32 eps (a segment sum's is that of its one
stretch: less near the diagonal, as much across it). Measured, the largest error of a chunk's
decays against float64 was 0.9-3.7e-6 factored and 1.0-3.9e-6 from segment sums (float32,
spans of 9-36), and Mamba-2's outputs are within 0.81 eps of their scale either way (0.74 eps
per head: ``tests/test_grouped_columns.py``).

Every array here keeps the heads last, as columns: ``G`` is ``(..., C, W)`` for ``W`` heads,
``X`` ``(..., C, W, w)``. :func:`half_products` returns ``Y``; :func:`half_products_into` adds it
to the rows' products with the state, ``u_t (exp(b_m) base_t + ...)``, one batched product of
the whole ``P`` written into the scaled ``base`` (PyTorch without a gradient to record:
0.87-0.93x the forward time of ``base * exp(b) + Y``, but 1.06-1.14x the time to
differentiate, and no faster on NumPy, whose sum is a new array anyway).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..._backend.execution import reads_values
from ..._backend.ops import (
    add_matmul,
    concat_leading,
    cumulative_sum,
    matmul,
    pad_rows,
    unstack,
)
from .intra_chunk import FACTORED_SPAN

__all__ = [
    "HalfFactors",
    "half_factors",
    "half_products",
    "half_products_into",
    "sum_after",
    "within_span",
]


class HalfFactors(NamedTuple):
    """The factors of :func:`half_products`, per chunk and head ``(..., n, ., W)``."""

    grows: Any  # (..., n, 2, C / 2, W): u, per half
    shrinks: Any  # (..., n, 2, C / 2, W): w, per half
    across: Any  # (..., n, 1, W): c
    starts: Any  # (..., n, 2, 1, W): exp(b_m), the decay from the chunk's start to each middle


def _outward(xp: Any, G: Any) -> tuple[Any, Any]:
    """The running sums of ``G`` ``(..., n, C, W)`` outward from each half chunk's middle token
    ``m``: ``first`` ``(..., n, 2, C / 4, W)``, ``sum_{t<=r<=m} g_r`` for the tokens up to
    ``m`` (so ``-first[t + 1]`` is ``e_t`` and ``-first[0]`` the half's decay up to ``m``), and
    ``second``, ``e_t = sum_{m<r<=t} g_r`` for those after it."""
    chunk, width = G.shape[-2:]
    halves = xp.reshape(G, (*G.shape[:-2], 2, chunk // 2, width))
    middle = chunk // 4
    first = xp.flip(cumulative_sum(xp, xp.flip(halves[..., :middle, :], axis=-2), axis=-2), axis=-2)
    return first, cumulative_sum(xp, halves[..., middle:, :], axis=-2)


def within_span(xp: Any, G: Any, chunk: int) -> bool:
    """Whether :func:`half_factors` applies to the gate ``G`` ``(..., T, w)`` in chunks of
    ``chunk`` tokens (zero log decays pad the last chunk): a multiple of 4, float32 or
    float64, and no ``|e_t|`` above ``FACTORED_SPAN`` (a ``nan``: False). Reads the gate's
    values: False where that cannot be done
    (:func:`~polylin._backend.execution.reads_values`: traced, lazy and accelerator arrays,
    ``torch.func`` transforms).

    ``|e_t|`` is largest at a quarter chunk's far end, where it is that quarter's whole log
    decay; every quarter sums ``C / 4`` log decays, so the largest decay alone admits most
    gates, and the quarters' sums are computed only where it does not.
    """
    if (chunk % 4 or G.dtype not in (xp.float32, xp.float64) or 0 in G.shape
            or not reads_values(xp, G)):  # fmt: skip
        return False
    if bool(xp.max(-G) * (chunk // 4) <= FACTORED_SPAN):  # a nan: False
        return True
    length, quarter = G.shape[-2], chunk // 4
    n = -(-length // quarter)
    padded = pad_rows(xp, G, n * quarter - length)
    quarters = xp.sum(xp.reshape(padded, (*G.shape[:-2], n, quarter, G.shape[-1])), axis=-2)
    return bool(xp.max(-quarters) <= FACTORED_SPAN)


def half_factors(xp: Any, G: Any) -> HalfFactors:
    """The factors of the module docstring for a gate ``G`` ``(..., n, C, W)`` that
    :func:`within_span` admits."""
    first, second = _outward(xp, G)
    e = concat_leading(xp, [-first[..., 1:, :], xp.zeros_like(first[..., :1, :]), second], axis=-2)
    first_end, _ = unstack(xp, second[..., -1:, :], axis=-3)  # from m_1 (exclusive) to the end
    first_start, second_start = unstack(xp, first[..., :1, :], axis=-3)  # from each start to m
    across = first_end + second_start
    starts = xp.exp(xp.stack([first_start, first_start + across], axis=-3))
    return HalfFactors(xp.exp(e), xp.exp(-e), xp.exp(across), starts)


def _one_copy(xp: Any, factors: HalfFactors, X: Any) -> tuple[Any, Any, Any]:
    """``(w' x, u', s')``: ``X`` ``(..., C, W, w)`` scaled once by every key's factor as the
    second half's rows meet it (``c w_1`` in the first half, ``w_2`` in the second), so that
    one product of the whole masked ``P`` serves both halves of the rows (``P`` is zero above
    its diagonal: the first half's rows see only the first half's keys); the first half's rows
    take the ``c`` back out of their own factors, ``u' = (u_1 / c, u_2)`` ``(..., C, W)`` and
    the middle tokens' ``s' = (c exp(b_m1), exp(b_m2))`` ``(..., 2, 1, W)``. ``c >=
    exp(-32)`` where :func:`within_span` admits the gate: no factor overflows or underflows in
    float32."""
    shrinks_1, shrinks_2 = unstack(xp, factors.shrinks, axis=-3)
    grows_1, grows_2 = unstack(xp, factors.grows, axis=-3)
    keys = concat_leading(xp, [shrinks_1 * factors.across, shrinks_2], axis=-2)
    grows = concat_leading(xp, [grows_1 / factors.across, grows_2], axis=-2)
    starts = factors.starts * xp.stack([factors.across, xp.ones_like(factors.across)], axis=-3)
    return X * keys[..., None], grows, starts


def half_products_into(xp: Any, factors: HalfFactors, P: Any, X: Any, base: Any) -> Any:
    """``exp(b_t) base_t + Y_t``: ``base`` ``(..., n, C, W, w)`` (the rows' products with the
    state, which nothing else reads) and ``Y`` of the module docstring, as
    ``u'_t (s'_t base_t + sum_s P_ts (w'_s x_s))`` (:func:`_one_copy`) with one batched product
    of the whole ``P`` added into the scaled ``base``. For PyTorch where no gradient is
    recorded (``_backend.execution.adds_in_place``): ``base`` is scaled, added into and
    scaled again in place (two passes that write no new array: Mamba-2's scan at 48 heads x
    64, state 128, T = 512 in 0.89-0.91x the time of new products, one and two threads)."""
    *lead, chunk, width, columns = X.shape
    met, grows, starts = _one_copy(xp, factors, X)
    acc = xp.reshape(base, (*lead, 2, chunk // 2, width, columns))
    acc *= starts[..., None]

    def flat(x: Any) -> Any:  # the heads as columns, rows (..., C, W x w)
        return xp.reshape(x, (*lead, chunk, width * columns))

    acc = xp.reshape(add_matmul(xp, flat(acc), P, flat(met), fresh=True), X.shape)
    acc *= grows[..., None]
    return acc


def half_products(xp: Any, factors: HalfFactors, P: Any, X: Any) -> Any:
    """``Y`` of the module docstring: ``P`` ``(..., n, C, C)`` the masked scores shared by the
    heads, ``X`` ``(..., n, C, W, w)``; returns ``(..., n, C, W, w)``: ``u'_t sum_s P_ts
    (w'_s x_s)`` (:func:`_one_copy`), one batched product."""
    *lead, chunk, width, columns = X.shape
    met, grows, _ = _one_copy(xp, factors, X)
    Y = matmul(xp, P, xp.reshape(met, (*lead, chunk, width * columns)))
    return xp.reshape(Y, (*lead, chunk, width, columns)) * grows[..., None]


def sum_after(xp: Any, G: Any) -> Any:
    """``sum_{r > s} g_r`` within each chunk (axis -2): a reversed exclusive cumulative sum, each
    entry a sum of its own terms."""
    flipped = cumulative_sum(xp, xp.flip(G, axis=-2), axis=-2, include_initial=True)
    return xp.flip(flipped[..., :-1, :], axis=-2)
