"""polylin.blocks on NumPy, PyTorch and JAX against the PyTorch modules, on the CPU.

    python benchmarks/array_blocks.py [--lengths 1024] [--hidden 512] [--repeats 5]
                                      [--decode-tokens 50] [--json PATH]

For Gated DeltaNet and Kimi Delta Attention (``num_heads = hidden / 128``, ``head_dim`` 64;
Gated DeltaNet's ``expand_v`` 2), GLA (``hidden / 128`` heads, key heads of 64) and Mamba-2
(heads of 64, ``state_size`` 64, one group): the torch module, the block function on the
module's state dict as torch tensors, as NumPy arrays and as JAX arrays (``jax.jit``, its
compile time recorded), each checked against the module first. For the Mamba-1 mixer
(``state_size`` 16, ``expand`` 2) and xLSTM's mLSTM layer (``hidden / 128`` heads, chunk 64)
the module is transformers' ``MambaMixer`` and ``xLSTMLayer`` (their pure-PyTorch paths,
float32 kernels; decoding through a ``DynamicCache`` and the layer's state), and transformers'
Mamba forward+backward, quadratic in T, is timed up to ``--peer-backward-max`` only (the rows
above it have no ratio). Float32, batch 1, the threads
PyTorch and the BLAS libraries choose; forward (torch under ``no_grad``), forward+backward (the
sum of the output, to every parameter: ``backward`` on torch, ``jax.jit(jax.grad)`` on JAX;
NumPy has none) and one decoding token after a 16-token prefill. The two PyTorch calls are
interleaved; NumPy's and JAX's are timed after them, each on its own (OpenBLAS's and XLA's
threads spin on after a call and slow the next one). The ratio is each time over the torch
module's in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.timing import (  # noqa: E402
    command_line,
    interleaved_times,
    run_metadata,
    write_report,
)
from polylin import blocks  # noqa: E402
from polylin.torch import (  # noqa: E402
    GatedDeltaNet,
    GatedLinearAttention,
    KimiDeltaAttention,
    Mamba2,
    RWKV7Attention,
)

HEAD_DIM = 64


class _Transformers(torch.nn.Module):
    """transformers' ``MambaMixer`` or ``xLSTMLayer`` with the call of polylin.torch's modules:
    ``module(x, return_cache=False)`` and ``module.step(x_t, cache)``."""

    def __init__(self, kind: str, hidden_size: int, **sizes: Any) -> None:
        super().__init__()
        import transformers

        self.kind = kind
        if kind == "mamba":
            from transformers.models.mamba.modeling_mamba import MambaMixer

            self.config = transformers.MambaConfig(
                hidden_size=hidden_size, num_hidden_layers=1, **sizes
            )
            self.layer = MambaMixer(self.config, 0)
        else:
            from transformers.models.xlstm.modeling_xlstm import xLSTMLayer

            self.config = transformers.xLSTMConfig(
                hidden_size=hidden_size, autocast_kernel_dtype="float32", **sizes
            )
            self.layer = xLSTMLayer(self.config)

    def forward(self, x: torch.Tensor, return_cache: bool = False) -> Any:
        if self.kind == "mlstm":
            y, state = self.layer(x)
            return (y, state) if return_cache else y
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.config) if return_cache else None
        y = self.layer(x, cache_params=cache)
        return (y, cache) if return_cache else y

    def step(self, x_t: torch.Tensor, cache: Any) -> Any:
        if self.kind == "mlstm":
            y, state = self.layer(x_t[:, None], cache)
            return y[:, 0], state
        return self.layer(x_t[:, None], cache_params=cache)[:, 0], cache


#: name -> (torch module, block, step, extra constructor options)
BLOCKS = {
    "gated_deltanet": (GatedDeltaNet, blocks.gated_deltanet, blocks.gated_deltanet_step,
                       {"expand_v": 2}),
    "kimi_delta_attention": (KimiDeltaAttention, blocks.kimi_delta_attention,
                             blocks.kimi_delta_attention_step, {}),
    "gated_linear_attention": (GatedLinearAttention, blocks.gated_linear_attention,
                               blocks.gated_linear_attention_step, {}),
    "mamba2": (Mamba2, blocks.mamba2, blocks.mamba2_step, {"state_size": 64}),
    "rwkv7": (RWKV7Attention, blocks.rwkv7, blocks.rwkv7_step, {"layer_idx": 0}),
    "mamba": (partial(_Transformers, "mamba"), blocks.mamba, blocks.mamba_step,
              {"state_size": 16}),
    "mlstm": (partial(_Transformers, "mlstm"), blocks.mlstm, blocks.mlstm_step,
              {"chunk_size": 64}),
}  # fmt: skip
#: name -> the module's size options and the block call's options, given ``heads``
#: (``hidden / 128``); the delta-rule blocks' otherwise. GLA: its default ``expand_k`` 0.5 and
#: ``expand_v`` 1 (key heads of 64); Mamba-2: heads of 64 (``expand`` 2: 4 per 128 of hidden);
#: RWKV-7: heads of 64, the first layer (it makes ``v_first``).
SIZES = {
    "rwkv7": lambda heads: ({"head_dim": HEAD_DIM}, {}),
    "gated_linear_attention": lambda heads: ({"num_heads": heads}, {}),
    "mamba2": lambda heads: ({"head_dim": HEAD_DIM}, {"n_groups": 1}),
    "mamba": lambda heads: ({}, {}),
    "mlstm": lambda heads: ({"num_heads": heads}, {"chunk_size": 64}),
}


def _delta_sizes(heads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"num_heads": heads, "head_dim": HEAD_DIM}, {"num_heads": heads}


def _jax() -> Any | None:
    try:
        import jax
    except ImportError:
        return None
    return jax


def _rows(
    name: str, length: int, hidden: int, repeats: int, tokens: int, peer_backward_max: int
) -> list[dict]:
    module_type, block, step, extra = BLOCKS[name]
    heads = max(1, hidden // 128)
    torch.manual_seed(0)
    sizes, options = SIZES.get(name, _delta_sizes)(heads)
    module = module_type(hidden_size=hidden, **sizes, **extra)
    x = torch.randn(1, length, hidden)
    with torch.no_grad():
        want = module(x).numpy()
    peer = getattr(module, "layer", module)  # transformers' own module
    params = {n: p.detach() for n, p in peer.state_dict().items()}
    as_numpy = {n: p.numpy() for n, p in params.items()}
    impls: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None, Callable[[], Any]]] = {}

    def module_backward() -> None:
        module.zero_grad()
        module(x).sum().backward()

    _, cache = module(x[:, :16], return_cache=True)
    with torch.no_grad():
        slow = name == "mamba" and length > peer_backward_max
        impls["torch module"] = (
            lambda: module(x),
            None if slow else module_backward,
            lambda: module.step(x[:, 16], cache),
        )
    leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}

    def block_backward() -> None:
        block(leaves, x, **options).sum().backward()

    _, t_cache = block(params, x[:, :16], return_cache=True, **options)
    impls["block on torch"] = (
        lambda: block(params, x, **options), block_backward,
        lambda: step(params, x[:, 16], t_cache, **options),
    )  # fmt: skip
    xn = x.numpy()
    _, n_cache = block(as_numpy, xn[:, :16], return_cache=True, **options)
    impls["block on NumPy"] = (
        lambda: block(as_numpy, xn, **options), None,
        lambda: step(as_numpy, xn[:, 16], n_cache, **options),
    )  # fmt: skip
    compile_s = None
    jax = _jax()
    if jax is not None:
        jp = {n: jax.numpy.asarray(p) for n, p in as_numpy.items()}
        jx = jax.numpy.asarray(xn)
        forward = jax.jit(lambda p, x: block(p, x, **options))
        grad = jax.jit(jax.grad(lambda p, x: block(p, x, **options).sum()))
        jstep = jax.jit(lambda p, x, c: step(p, x, c, **options))
        start = time.perf_counter()
        forward(jp, jx).block_until_ready()
        compile_s = time.perf_counter() - start
        _, j_cache = jax.jit(lambda p, x: block(p, x, return_cache=True, **options))(jp, jx[:, :16])
        impls["block on JAX (jit)"] = (
            lambda: forward(jp, jx).block_until_ready(),
            lambda: jax.block_until_ready(grad(jp, jx)),
            lambda: jax.block_until_ready(jstep(jp, jx[:, 16], j_cache)),
        )  # fmt: skip
    rows = []
    for impl, (fwd, _, _) in impls.items():
        got = np.asarray(fwd() if impl != "torch module" else want)
        diff = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)))
        if diff > 1e-3 * max(1.0, float(np.max(np.abs(want)))):
            raise AssertionError(f"{name} {impl}: differs from the torch module by {diff}")
        rows.append({"block": name, "T": length, "hidden": hidden, "impl": impl,
                     "max_diff": diff})  # fmt: skip
    # OpenBLAS's and JAX's CPU threads keep spinning for a while after a call returns, which
    # slows whatever runs next: the PyTorch calls are interleaved, NumPy and JAX each timed
    # after them on their own (their ratios are to the module's time of the same run).
    groups = [[n for n in impls if n in ("torch module", "block on torch")]]
    groups += [[n] for n in impls if n not in groups[0]]
    for pass_name, index, count in (("forward", 0, repeats), ("forward+backward", 1, repeats),
                                    ("decode", 2, tokens)):  # fmt: skip
        base: float | None = None  # the module's time: no ratio where it is not timed
        for names in groups:
            timed = [n for n in names if impls[n][index] is not None]
            fns = [lambda _i, fn=impls[n][index]: fn() for n in timed]
            backward = pass_name == "forward+backward"
            with contextlib.nullcontext() if backward else torch.no_grad():
                results = interleaved_times(fns, count)
            if "torch module" in timed:
                base = results[timed.index("torch module")][0]
            for n, (median, _) in zip(timed, results):
                row = next(r for r in rows if r["impl"] == n)
                ratio = None if base is None else median / base
                row[f"{pass_name}_s"], row[f"{pass_name}_ratio"] = median, ratio
    for row in rows:
        if row["impl"].startswith("block on JAX"):
            row["compile_s"] = compile_s
    return rows


def _ratio(ratio: float | None) -> str:
    return f"{'-':>6s}" if ratio is None else f"{ratio:6.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=50)
    parser.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
    parser.add_argument(
        "--peer-backward-max", type=int, default=1024,
        help="time transformers' Mamba forward+backward up to this T (it is quadratic in T)",
    )  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "meta": run_metadata(command_line("array_blocks.py", argv)),
        "rows": [], "goals": [],
    }  # fmt: skip
    print(f"{'block':22s} {'T':>5s} {'impl':20s} {'fwd ms':>8s} {'ratio':>6s} "
          f"{'f+b ms':>8s} {'ratio':>6s} {'step us':>8s} {'ratio':>6s}")  # fmt: skip
    for length in args.lengths:
        for name in args.blocks:
            for row in _rows(name, length, args.hidden, args.repeats, args.decode_tokens,
                             args.peer_backward_max):  # fmt: skip
                report["rows"].append(row)
                fb = row.get("forward+backward_s")
                print(
                    f"{name:22s} {length:5d} {row['impl']:20s} {row['forward_s'] * 1e3:8.2f} "
                    f"{_ratio(row['forward_ratio'])} "
                    + (f"{fb * 1e3:8.2f} {_ratio(row['forward+backward_ratio'])} " if fb else
                       f"{'-':>8s} {'-':>6s} ")
                    + f"{row['decode_s'] * 1e6:8.0f} {_ratio(row['decode_ratio'])}"
                )  # fmt: skip
    return write_report(report, args.json)


if __name__ == "__main__":
    main()
