"""The chunked parallel form: batched matmuls within chunks, a prefix sum of states across them.

For chunk n (rows of phi(Q), phi(K), V), with M the lower-triangular ones matrix::

    U_n = K_n^T V_n                     per-chunk state increment
    S_n = S_0 + sum_{m<n} U_m           exclusive prefix sum over the chunk axis
    O_n = Q_n S_n + ((Q_n K_n^T) * M) V_n

The normalizer is not a separate computation: a column of ones is appended to V, so its last
output column *is* ``phi(q_t) . z_t``, computed from exactly the same running sums as the
numerator (the bug class where the two drift apart cannot happen). No T x T matrix is formed;
chunks are processed in blocks so that intermediates stay cache-sized for long sequences.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import device, is_dask_namespace

from ._ops import causal_mask, pad_rows

__all__ = ["BLOCK_TOKENS", "causal_chunked"]

#: Tokens processed per block of chunks: intermediates of one block stay in cache.
BLOCK_TOKENS = 1024


def causal_chunked(
    xp: Any, fq: Any, fk: Any, v: Any, S: Any, z: Any, *, chunk_size: int, eps: float
) -> tuple[Any, Any, Any]:
    """Causal linear attention in chunks of ``chunk_size`` tokens, from the state ``(S, z)``."""
    *batch, T, d_phi = fq.shape
    d_v = v.shape[-1]
    if T == 0:
        return v, S, z
    dev = device(fq)
    # The ones column turns the normalizer into one more output column (see module docstring).
    v1 = xp.concat([v, xp.ones((*batch, T, 1), dtype=v.dtype, device=dev)], axis=-1)
    state = xp.concat([S, z[..., None]], axis=-1)  # (..., d_phi, d_v + 1)

    chunk = min(chunk_size, T)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    if pad:  # zero keys and values add nothing to the state; padded outputs are dropped
        fq, fk, v1 = (pad_rows(xp, x, pad) for x in (fq, fk, v1))
    Q = xp.reshape(fq, (*batch, n_chunks, chunk, d_phi))
    K = xp.reshape(fk, (*batch, n_chunks, chunk, d_phi))
    V = xp.reshape(v1, (*batch, n_chunks, chunk, d_v + 1))
    mask = causal_mask(xp, chunk, chunk, fq.dtype, dev)

    # Blocks keep eager intermediates in cache. A Dask chunk is already a unit of work: there,
    # blocks would only multiply the tasks (and split Dask chunks), so all chunks form one block.
    per_block = n_chunks if is_dask_namespace(xp) else max(1, BLOCK_TOKENS // chunk)
    outputs = []
    for start in range(0, n_chunks, per_block):
        stop = min(start + per_block, n_chunks)
        Qb, Kb, Vb = Q[..., start:stop, :, :], K[..., start:stop, :, :], V[..., start:stop, :, :]
        Kt = xp.matrix_transpose(Kb)
        increments = xp.matmul(Kt, Vb)
        prefix = xp.cumulative_sum(increments, axis=-3, include_initial=True)
        states = prefix[..., :-1, :, :] + state[..., None, :, :]
        scores = xp.matmul(Qb, Kt) * mask
        outputs.append(xp.matmul(Qb, states) + xp.matmul(scores, Vb))
        state = state + prefix[..., -1, :, :]
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-3)
    out = xp.reshape(out, (*batch, n_chunks * chunk, d_v + 1))[..., :T, :]
    out = out[..., :d_v] / (out[..., d_v:] + eps)
    return out, state[..., :d_v], state[..., d_v]
