"""The chunked parallel form: batched matmuls within chunks, a prefix sum of states across them.

For chunk n (rows of phi(Q), phi(K), V), with M the lower-triangular ones matrix::

    U_n = K_n^T V_n                     per-chunk state increment
    S_n = S_0 + sum_{m<n} U_m           exclusive prefix sum over the chunk axis
    O_n = Q_n S_n + ((Q_n K_n^T) * M) V_n

The normalizer is not a separate computation: a column of ones is appended to V, so its last
output column *is* ``phi(q_t) . z_t``, computed from exactly the same running sums as the
numerator (the bug class where the two drift apart cannot happen). No T x T matrix is formed.

On eager CPU backends (NumPy, PyTorch CPU, array-api-strict) the sequence is processed in
blocks of about :data:`BLOCK_BYTES` of features and values: the feature map, the ones
column, the per-chunk states and the scores of one block stay in cache, no intermediate is
allocated at the size of the whole sequence (those large allocations cost page faults on every
call), and the state is carried from block to block. Inside a block the exclusive prefix sum is
a short chain of additions, cheaper there than ``cumulative_sum`` over a middle axis. Lazy and
accelerator backends (Dask, JAX, CuPy, PyTorch CUDA) get one block and one ``cumulative_sum``:
they prefer few large operations, and a Dask chunk is already a unit of work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from array_api_compat import device

from ._ops import causal_mask, pad_rows
from ._policy import eager_cpu

__all__ = ["BLOCK_BYTES", "block_tokens", "causal_chunked"]

#: Bytes per block on eager CPU backends, counted as batch x tokens x (d_phi + d_v) x itemsize;
#: chosen by measurement (``docs/performance.md``): 2 MiB is 4096 rows (batch x tokens) at
#: d = 64 and 2048 at d = 128 in float32. With the libraries' default threads it was as fast or
#: faster than 1, 4 and 8 MiB (larger blocks spill the cache, smaller ones pay more
#: per-operation overhead); on one thread 1 MiB is up to 10% faster.
BLOCK_BYTES = 2 * 2**20

#: ``features(start, stop)`` returns ``(phi(q), phi(k))`` of tokens ``start:stop`` in the work
#: dtype, masked keys already zeroed.
Features = Callable[[int, int], tuple[Any, Any]]


def block_tokens(eager: bool, length: int, chunk: int, token_bytes: int) -> int:
    """Tokens per block: a multiple of ``chunk``, or ``length`` where blocks do not pay.

    ``token_bytes`` is ``batch x (d_phi + d_v) x itemsize``: one token's features and values
    over the whole batch.
    """
    if not eager:
        return max(length, 1)
    return chunk * max(1, BLOCK_BYTES // (chunk * max(token_bytes, 1)))


def causal_chunked(
    xp: Any, features: Features, v: Any, S: Any, z: Any, *, chunk_size: int, eps: float
) -> tuple[Any, Any, Any]:
    """Causal linear attention in chunks of ``chunk_size`` tokens, from the state ``(S, z)``.

    ``features(start, stop)`` maps one block of queries and keys; a feature map acts on each
    token alone (as :func:`polylin.step` also requires), so mapping block by block is exact.
    """
    *batch, T, d_v = v.shape
    if T == 0:
        return v, S, z
    dev = device(v)
    # The ones column turns the normalizer into one more output column (see module docstring).
    state = xp.concat([S, z[..., None]], axis=-1)  # (..., d_phi, d_v + 1)
    chunk = min(chunk_size, T)
    eager = eager_cpu(xp, dev)
    itemsize = xp.finfo(v.dtype).bits // 8
    token_bytes = math.prod(batch) * (S.shape[-2] + d_v) * itemsize
    block = block_tokens(eager, T, chunk, token_bytes)
    mask = causal_mask(xp, chunk, chunk, None, dev)  # boolean: scores are selected
    outputs = []
    for start in range(0, T, block):
        stop = min(start + block, T)
        fq, fk = features(start, stop)
        out, state = _block(xp, fq, fk, v[..., start:stop, :], state, mask, eps=eps, chained=eager)
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
    return out, state[..., :d_v], state[..., d_v]


def _block(
    xp: Any, fq: Any, fk: Any, v: Any, state: Any, mask: Any, *, eps: float, chained: bool
) -> tuple[Any, Any]:
    """Outputs of one block of tokens and the state after it (``state`` has the ones column)."""
    *batch, length, d_v = v.shape
    d_phi = fq.shape[-1]
    chunk = mask.shape[-1]
    n_chunks = -(-length // chunk)
    padded = n_chunks * chunk
    if padded != length:  # zero keys add nothing to the state; padded outputs are dropped
        fq, fk, v = (pad_rows(xp, x, padded - length) for x in (fq, fk, v))
    ones = xp.ones((*batch, padded, 1), dtype=v.dtype, device=device(v))
    v1 = xp.concat([v, ones], axis=-1)
    Q = xp.reshape(fq, (*batch, n_chunks, chunk, d_phi))
    K = xp.reshape(fk, (*batch, n_chunks, chunk, d_phi))
    V = xp.reshape(v1, (*batch, n_chunks, chunk, d_v + 1))
    Kt = xp.matrix_transpose(K)
    increments = xp.matmul(Kt, V)  # U_n
    if chained:  # a short chain of additions: a block holds few chunks
        running = [state]
        for n in range(n_chunks):
            running.append(running[-1] + increments[..., n, :, :])
        new_state = running.pop()
        states = xp.stack(running, axis=-3)
    else:
        prefix = xp.cumulative_sum(increments, axis=-3, include_initial=True)
        states = prefix[..., :-1, :, :] + state[..., None, :, :]
        new_state = state + prefix[..., -1, :, :]
    # Selected, not multiplied: a masked score may be inf or NaN (0 * inf is NaN).
    scores = xp.where(mask, xp.matmul(Q, Kt), 0.0)
    out = xp.matmul(Q, states) + xp.matmul(scores, V)
    out = xp.reshape(out, (*batch, padded, d_v + 1))
    if padded != length:
        out = out[..., :length, :]
    return out[..., :d_v] / (out[..., d_v:] + eps), new_state
