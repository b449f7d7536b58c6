"""What removing the backward reach of a non-finite value inside a chunk would cost.

The chunked form's intra-chunk term is one matrix product ``where(causal, Q K^T, 0) @ V``; a NaN
in a value row ``v_t`` reaches the earlier rows of its chunk through it (``0 * nan`` is NaN). The
only exact repair selects every weight-value product before summing,
``sum_s where(causal[t, s], A[t, s] * V[s], 0)``: a ``(C, C, d_v)`` array per chunk instead of a
matrix product. This times both on PyTorch CPU, float32, one thread, and prints the ratio.

Usage: ``python benchmarks/nonfinite_values.py [--chunks 64 --chunk-size 64 --dim 64]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, c, d = args.chunks, args.chunk_size, args.dim
    Q, K = torch.randn(n, c, d), torch.randn(n, c, d)
    V = torch.randn(n, c, d + 1)  # values and the ones column of the normalizer
    causal = torch.ones(c, c, dtype=torch.bool).tril()

    def matmul_form():
        return torch.where(causal, Q @ K.transpose(-1, -2), 0.0) @ V

    def selected_form():
        scores = Q @ K.transpose(-1, -2)
        return torch.where(causal[..., None], scores[..., None] * V[:, None], 0.0).sum(-2)

    assert torch.allclose(matmul_form(), selected_form(), rtol=1e-4, atol=1e-3)
    times = {"matmul": [], "selected": []}
    for _ in range(args.repeats):  # interleaved
        for name, fn in (("matmul", matmul_form), ("selected", selected_form)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"{n} chunks of {c} tokens, d = {d}: matrix product {med['matmul']:.2f} ms, "
        f"selected products {med['selected']:.2f} ms, ratio {med['selected'] / med['matmul']:.0f}x"
    )


if __name__ == "__main__":
    main()
