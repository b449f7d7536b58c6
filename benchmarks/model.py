"""One cost model for every benchmark: the chunked form's useful flops, the quadratic form's
memory, a GEMM's flops. The CPU and GPU reports both use these, so their "fraction of the
matmul rate" figures can be compared."""

from __future__ import annotations

__all__ = ["ITEMSIZE", "chunked_useful_flops", "gemm_flops", "quadratic_bytes"]

#: Bytes per element of the dtypes the benchmarks use.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def chunked_useful_flops(batch: int, T: int, d_k: int, d_v: int, chunk_size: int) -> int:
    """Flops of the chunked forward pass that contribute to the result.

    Per token: ``2 d_k d_v`` for the state increment ``K^T V``, ``2 d_k d_v`` for the read-out
    ``Q S``, and the causal half of the intra-chunk products, ``C d_k`` for ``Q K^T`` and
    ``C d_v`` for the masked scores times ``V``. The normalizer column and the masked-out upper
    triangles are not counted, so the figure errs low. ``batch`` counts every head.
    """
    chunk = min(chunk_size, T)
    return batch * T * (4 * d_k * d_v + chunk * (d_k + d_v))


def gemm_flops(n: int) -> int:
    """Flops of an ``n x n @ n x n`` matrix multiply."""
    return 2 * n**3


def quadratic_bytes(batch: int, T: int, dtype: str) -> int:
    """Memory the masked quadratic form needs for its T x T matrices (``batch`` counts heads).

    About three T x T matrices per head are alive at once: the scores, the masked scores and
    the mask (or the normalizer pass).
    """
    return 3 * batch * T * T * ITEMSIZE[dtype]
