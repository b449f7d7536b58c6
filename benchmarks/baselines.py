"""What the benchmarks compare polylin with.

- :func:`seed_loop`: the original per-token PyTorch loop, as written (``elu + 1``, one
  ``einsum`` per token);
- :func:`plain_chunked`: a plain, unblocked chunked form in array-API code (``elu + 1``, a
  ``cumulative_sum`` over the chunk states, a ``tril`` mask, batched matmuls, every
  intermediate materialized for the whole sequence): what a first implementation looks like;
- :func:`sdpa`: PyTorch's ``scaled_dot_product_attention(is_causal=True)``, the softmax
  attention users would otherwise pick (a different function: timed, not compared);
- :func:`fla_chunk`: flash-linear-attention's ``chunk_linear_attn`` (Triton, CUDA only) on
  polylin's inputs and feature map.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from polylin.feature_maps import elu_plus_one

__all__ = [
    "fla_chunk",
    "fla_naive",
    "load_fla",
    "plain_chunked",
    "sdpa",
    "seed_loop",
    "to_fla_layout",
]


def seed_loop(q: Any, k: Any, v: Any, eps: float = 1e-6) -> Any:
    """The original causal linear attention loop, one token at a time (PyTorch, as written).

    Parameters
    ----------
    q, k : torch.Tensor
        ``(batch, T, d_k)``.
    v : torch.Tensor
        ``(batch, T, d_v)``.
    eps : float
        Added to the normalizer.

    Returns
    -------
    torch.Tensor
        ``(batch, T, d_v)``.

    Examples
    --------
    >>> import torch
    >>> from benchmarks.baselines import seed_loop
    >>> q, k, v = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    >>> out = seed_loop(q, k, v)
    >>> out.shape
    torch.Size([2, 5, 4])
    >>> bool(torch.allclose(out[:, 0], v[:, 0]))  # position 0 attends to itself only
    True
    """
    import torch
    import torch.nn.functional as F

    phi_q, phi_k = F.elu(q) + 1.0, F.elu(k) + 1.0
    batch, seq_len, d_k = q.shape
    state = torch.zeros(batch, d_k, v.shape[-1], device=q.device, dtype=q.dtype)
    normalizer = torch.zeros(batch, d_k, device=q.device, dtype=q.dtype)
    outputs = []
    for t in range(seq_len):
        state = state + phi_k[:, t, :].unsqueeze(-1) * v[:, t, :].unsqueeze(1)
        normalizer = normalizer + phi_k[:, t, :]
        numerator = torch.einsum("bd,bdv->bv", phi_q[:, t, :], state)
        denominator = torch.einsum("bd,bd->b", phi_q[:, t, :], normalizer).unsqueeze(-1)
        outputs.append((numerator / (denominator + eps)).unsqueeze(1))
    return torch.cat(outputs, dim=1)


def plain_chunked(q: Any, k: Any, v: Any, /, *, chunk_size: int = 64, eps: float = 1e-6) -> Any:
    """A plain chunked form: the whole sequence at once, no blocking, no tuning.

    ``elu + 1`` on the whole of ``q`` and ``k``, a ones column on ``v`` for the normalizer,
    per-chunk states ``K_n^T V_n``, their exclusive ``cumulative_sum``, ``tril``-masked chunk
    scores and the output ``Q_n S_n + (Q_n K_n^T * M) V_n``; T is zero-padded to a multiple of
    the chunk size. Any array-API library.

    Parameters
    ----------
    q, k : array
        ``(..., T, d_k)``.
    v : array
        ``(..., T, d_v)``.
    chunk_size : int
        Chunk length C.
    eps : float
        Added to the normalizer.

    Returns
    -------
    array
        ``(..., T, d_v)``.

    Examples
    --------
    >>> import numpy as np
    >>> from polylin import causal_linear_attention
    >>> from benchmarks.baselines import plain_chunked
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 50, 8))
    >>> bool(np.allclose(plain_chunked(q, k, v, chunk_size=16), causal_linear_attention(q, k, v)))
    True
    """
    xp = array_api_compat.array_namespace(q, k, v)
    dev = array_api_compat.device(q)
    *batch, T, d_k = q.shape
    d_v = v.shape[-1]
    chunk = min(chunk_size, T)
    n = -(-T // chunk)
    pad = n * chunk - T
    fq, fk = elu_plus_one(q), elu_plus_one(k)
    v1 = xp.concat([v, xp.ones((*batch, T, 1), dtype=v.dtype, device=dev)], axis=-1)
    if pad:
        fq, fk, v1 = (
            xp.concat([x, xp.zeros((*batch, pad, x.shape[-1]), dtype=x.dtype, device=dev)], axis=-2)
            for x in (fq, fk, v1)
        )
    Q = xp.reshape(fq, (*batch, n, chunk, d_k))
    K = xp.reshape(fk, (*batch, n, chunk, d_k))
    V = xp.reshape(v1, (*batch, n, chunk, d_v + 1))
    Kt = xp.matrix_transpose(K)
    U = xp.matmul(Kt, V)
    S = xp.cumulative_sum(U, axis=-3) - U
    rows = xp.arange(chunk, device=dev)
    tril = xp.astype(rows[None, :] <= rows[:, None], q.dtype)
    out = xp.matmul(Q, S) + xp.matmul(xp.matmul(Q, Kt) * tril, V)
    out = xp.reshape(out, (*batch, n * chunk, d_v + 1))[..., :T, :]
    return out[..., :d_v] / (out[..., d_v:] + eps)


def sdpa(q: Any, k: Any, v: Any) -> Any:
    """PyTorch's causal softmax attention on the same tensors (a different function).

    Examples
    --------
    >>> import torch
    >>> from benchmarks.baselines import sdpa
    >>> q = k = v = torch.ones(2, 5, 4)
    >>> sdpa(q, k, v).shape
    torch.Size([2, 5, 4])
    """
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def load_fla(device: str) -> tuple[Any, str]:
    """``fla.ops.linear_attn.chunk_linear_attn`` and fla's version; raises ``ImportError``."""
    if device != "cuda":
        raise ImportError("fla not run: its Triton kernels need a CUDA device")
    try:
        import fla  # optional: only on the GPU machine, carried as a wheel
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as exc:  # ImportError, or a Triton/torch mismatch raising something else
        raise ImportError(f"fla not importable ({type(exc).__name__}: {exc})") from None
    return chunk_linear_attn, str(getattr(fla, "__version__", "unknown"))


def fla_chunk(chunk_linear_attn: Any, q: Any, k: Any, v: Any) -> Any:
    """fla's chunked linear attention on ``(..., H, T, D)`` tensors with polylin's feature map.

    fla wants ``(B, T, H, D)`` and applies no feature map: ``elu(x) + 1`` goes in first.
    ``scale=1.0``: fla's normalizer is ``(scale q) . cumsum(k) + 1e-10``, so the scale only
    moves that epsilon. The caller converts the layout outside its timer with
    :func:`to_fla_layout`; the output comes back in fla's layout.
    """
    import torch.nn.functional as F

    out, _ = chunk_linear_attn(F.elu(q) + 1.0, F.elu(k) + 1.0, v, scale=1.0, normalize=True)
    return out


def to_fla_layout(x: Any) -> Any:
    """``(B, H, T, D)`` to fla's ``(B, T, H, D)`` (and back: the same swap)."""
    return x.transpose(1, 2).contiguous()


def fla_naive(family: str) -> Any:
    """flash-linear-attention's pure-PyTorch reference ``fla/ops/<family>/naive.py`` as a module,
    loaded from its file: importing the package loads its Triton kernels, which have no CPU
    build. ``family`` is a path below ``fla/ops`` (``"kda"``,
    ``"generalized_delta_rule/dplr"``). ``ImportError`` without fla-core (the bench extra pins
    it).
    """
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed (the bench extra pins fla-core==0.6.0)")
    path = Path(spec.submodule_search_locations[0]) / "ops" / family / "naive.py"
    name = "fla_naive_" + family.replace("/", "_")
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
