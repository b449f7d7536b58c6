"""Per-token decoding of a Gated DeltaNet model against a softmax KV-cache model, and the layer's
own overhead over its polylin calls.

    python benchmarks/layer_decode.py [--layers 4] [--hidden 512] [--contexts 1024 16384 65536]

CPU, float32, batch 1, PyTorch's default threads unless ``--threads``, under
``torch.inference_mode``. Two models of ``--layers`` blocks (attention with a residual; no MLPs,
which would cost both the same):

- **Gated DeltaNet**: :class:`polylin.torch.GatedDeltaNet` blocks (``num_heads * head_dim =
  0.75 hidden``, ``expand_v = 2``: fla's parameter allocation, ``6 hidden^2`` per block), each
  token one ``step`` per block from its :class:`~polylin.torch.LayerCache`. The cache has the
  same size at every context, so the cost of a token does not depend on the context; it is
  timed from a cache of the right shape (a prefill of 64k tokens would only fill it).
- **softmax + KV cache**: blocks of the same hidden size (``hidden / 64`` heads of 64; q, k, v
  and output projections), each token written into a preallocated cache of ``context`` keys and
  values per block and attended with ``scaled_dot_product_attention`` over all of them.

Then, at batch 1: one GatedDeltaNet ``step`` against the same computation written as bare calls
(the projections, ``causal_conv1d_step`` three times, ``delta_rule_step``, ``rms_norm``) on
tensors prepared beforehand: the difference is what the layer adds (argument checks, reshapes,
the cache tuple), in microseconds.

Calls are interleaved; each median and minimum is over ``--repeats`` tokens. Read the ratios
(absolute times depend on the machine and its load; on a loaded machine prefer ``--threads 1``:
OpenMP threads waiting for a busy core can make a token many times slower). ``--json PATH``
writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.timing import interleaved_times  # noqa: E402
from polylin import causal_conv1d_step, delta_rule_step, rms_norm  # noqa: E402
from polylin.activations import sigmoid, softplus  # noqa: E402
from polylin.torch import GatedDeltaNet, LayerCache  # noqa: E402


def gdn_blocks(layers: int, hidden: int) -> list[GatedDeltaNet]:
    torch.manual_seed(0)
    head_dim = 128 if hidden >= 256 else max(hidden // 4, 4)
    heads = max(round(0.75 * hidden / head_dim), 1)
    return [
        GatedDeltaNet(hidden_size=hidden, num_heads=heads, head_dim=head_dim, expand_v=2).eval()
        for _ in range(layers)
    ]


def gdn_cache(block: GatedDeltaNet, batch: int) -> LayerCache:
    """A cache of the shapes a prefill returns (its values do not change the cost)."""
    width = block.conv_size - 1
    conv = tuple(
        torch.randn(batch, width, n) for n in (block.key_dim, block.key_dim, block.value_dim)
    )
    S = torch.randn(batch, block.num_v_heads, block.head_k_dim, block.head_v_dim) * 0.1
    return LayerCache(conv, S)


class SoftmaxBlock(torch.nn.Module):
    """Softmax attention with a KV cache: q, k, v, o projections, ``hidden // 64`` heads."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads, self.d = max(hidden // 64, 1), 64 if hidden >= 64 else hidden
        inner = self.heads * self.d
        self.qkv = torch.nn.Linear(hidden, 3 * inner, bias=False)
        self.out = torch.nn.Linear(inner, hidden, bias=False)

    def new_cache(self, context: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.randn(1, self.heads, context + extra, self.d)
        return keys, torch.randn(1, self.heads, context + extra, self.d)

    def step(self, x_t: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], length: int):
        q, k, v = self.qkv(x_t).view(1, 3, self.heads, 1, self.d).unbind(1)
        keys, values = cache
        keys[:, :, length : length + 1] = k  # in place: a preallocated cache
        values[:, :, length : length + 1] = v
        o = F.scaled_dot_product_attention(q, keys[:, :, : length + 1], values[:, :, : length + 1])
        return self.out(o.reshape(1, -1))


def bare_step(block: GatedDeltaNet, x_t: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """GatedDeltaNet.step's computation as bare calls, without the layer's checks or reshapes
    beyond what the functions need."""
    H, dk, dv = block.num_heads, block.head_k_dim, block.head_v_dim
    G = block.num_v_heads // H
    b = x_t.shape[0]
    outs = []
    for proj, conv, state in zip(
        (block.q_proj, block.k_proj, block.v_proj),
        (block.q_conv1d, block.k_conv1d, block.v_conv1d),
        cache.conv_state,
    ):
        y, _ = causal_conv1d_step(proj(x_t), conv.weight[:, 0], state=state, activation="silu")
        outs.append(y)
    q, k, v = outs[0].view(b, H, 1, dk), outs[1].view(b, H, 1, dk), outs[2].view(b, H, G, dv)
    beta = sigmoid(block.b_proj(x_t)).view(b, H, G, 1)
    g = (-torch.exp(block.A_log) * softplus(block.a_proj(x_t) + block.dt_bias)).view(b, H, G, 1)
    o, _ = delta_rule_step(
        q, k, v, beta, cache.recurrent_state.view(b, H, G, dk, dv), log_decay=g,
        scale=dk**-0.5, qk_l2norm=True,
    )  # fmt: skip
    gate = block.g_proj(x_t).view(b, H * G, dv)
    o = rms_norm(o.reshape(b, H * G, dv), block.o_norm.weight[...], gate=gate, eps=block.norm_eps)
    return block.o_proj(o.reshape(b, -1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "settings": vars(args) | {"json": None, "torch_threads": torch.get_num_threads()},
        "rows": [],
    }
    with torch.inference_mode():
        gdn = gdn_blocks(args.layers, args.hidden)
        softmax = [SoftmaxBlock(args.hidden).eval() for _ in range(args.layers)]
        x = torch.randn(1, args.hidden)
        state_bytes = (
            sum(
                sum(t.numel() for t in c.conv_state) + c.recurrent_state.numel()
                for c in (gdn_cache(b, 1) for b in gdn)
            )
            * 4
        )
        for context in args.contexts:
            caches = [gdn_cache(b, 1) for b in gdn]
            kv = [blk.new_cache(context, args.repeats + 2) for blk in softmax]

            def run_gdn(_: int, caches: list = caches) -> None:
                h = x
                for j, block in enumerate(gdn):
                    y, caches[j] = block.step(h, caches[j])
                    h = h + y

            def run_softmax(i: int, kv: list = kv, context: int = context) -> None:
                h = x
                for block, cache in zip(softmax, kv):
                    h = h + block.step(h, cache, context + i)

            (t_gdn, m_gdn), (t_softmax, m_softmax) = interleaved_times(
                [run_gdn, run_softmax], args.repeats
            )
            kv_bytes = (
                sum(k.numel() + v.numel() for k, v in kv)
                * 4
                * context
                // (context + args.repeats + 2)
            )
            row = {
                "context": context, "gdn_ms": t_gdn * 1e3, "softmax_ms": t_softmax * 1e3,
                "softmax_over_gdn": t_softmax / t_gdn, "gdn_min_ms": m_gdn * 1e3,
                "softmax_min_ms": m_softmax * 1e3, "gdn_cache_bytes": state_bytes,
                "kv_cache_bytes": kv_bytes,
            }  # fmt: skip
            result["rows"].append(row)
        block, cache = gdn[0], gdn_cache(gdn[0], 1)
        (t_layer, m_layer), (t_bare, m_bare) = interleaved_times(
            [lambda _: block.step(x, cache), lambda _: bare_step(block, x, cache)],
            args.repeats * 4,
        )
        torch.testing.assert_close(block.step(x, cache)[0], bare_step(block, x, cache))
        result["overhead"] = {
            "step_us": t_layer * 1e6, "bare_us": t_bare * 1e6,
            "overhead_us": (t_layer - t_bare) * 1e6, "step_min_us": m_layer * 1e6,
            "bare_min_us": m_bare * 1e6, "overhead_min_us": (m_layer - m_bare) * 1e6,
        }  # fmt: skip
    print(
        f"{args.layers} blocks, hidden {args.hidden}, batch 1, float32, "
        f"{torch.get_num_threads()} threads; median of {args.repeats} tokens"
    )
    print("ms per token, median (minimum)")
    print(f"{'context':>8} {'Gated DeltaNet':>18} {'softmax + KV cache':>20} {'ratio':>6}")
    for row in result["rows"]:
        gdn = f"{row['gdn_ms']:.2f} ({row['gdn_min_ms']:.2f})"
        soft = f"{row['softmax_ms']:.2f} ({row['softmax_min_ms']:.2f})"
        print(f"{row['context']:>8} {gdn:>18} {soft:>20} {row['softmax_over_gdn']:>6.2f}")
    print(
        f"GDN cache {result['rows'][0]['gdn_cache_bytes'] / 2**20:.2f} MiB at every context; "
        f"KV cache {result['rows'][-1]['kv_cache_bytes'] / 2**20:.0f} MiB at "
        f"{result['rows'][-1]['context']}"
    )
    o = result["overhead"]
    print(
        f"one GatedDeltaNet.step: {o['step_us']:.0f} us ({o['step_min_us']:.0f}); the same calls "
        f"bare: {o['bare_us']:.0f} us ({o['bare_min_us']:.0f}); the layer adds "
        f"{o['overhead_us']:.0f} us ({o['overhead_min_us']:.0f})"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
