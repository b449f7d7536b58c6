"""polylin.compat on PyTorch CPU: transformers' models and fla's naive ops, ratios in one run.

    python benchmarks/compat.py [--lengths 2048 8192] [--repeats 3] [--json out.json] [--quick]

Two parts, float32, default threads:

- **models**: Qwen3-Next and Kimi-Linear built from transformers' config classes with random
  weights, hidden size 512, 4 layers (3 linear-attention, 1 full-attention), batch 1. Each is
  timed on transformers' pure-PyTorch fallback kernels (``use_transformers_fallback``) and on
  polylin (``use_polylin``), alternating: prefill (``model(ids)`` under ``no_grad``) at each
  length; greedy decoding per token with the model's cache (after a 16-token prompt,
  ``generate`` of 33 tokens less ``generate`` of 1, divided by 32, the fastest of at least 3
  runs of each: the prompt's prefill is left out); forward + backward of a training step
  (``loss.backward()``) at the first length. The logits are checked to agree (1e-4 relative)
  before timing. ``bound`` (on by default) adds to the prefill and the training step a third
  model in the same alternation, the same one with its chunked kernel replaced by a stand-in
  that takes next to no time (:func:`no_time_kernel`): against transformers' fallback, the most
  any kernel could gain inside these models.
- **ops**: each ``polylin.compat.fla`` chunk function against fla's own pure-PyTorch naive form
  of the same op (``fla/ops/<family>/naive.py``, loaded by path), B = 1, H = 4, d = 64, at the
  first length; outputs checked equal (float32 round-off) first.

Reported: ratios of medians of the same run (transformers / polylin, naive / compat: above 1
means polylin is faster). On a machine shared with other jobs absolute times are noise.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's benchmarks and polylin
    sys.path.insert(0, str(ROOT))

from benchmarks.baselines import fla_naive  # noqa: E402
from benchmarks.timing import command_line  # noqa: E402
from polylin.compat import fla  # noqa: E402
from polylin.compat.transformers import use_polylin, use_transformers_fallback  # noqa: E402

VOCAB = 1024


def models(hidden: int, layers: int) -> dict[str, Callable[[], Any]]:
    """Builders of the two model families at ``hidden`` size (heads of 64, as the configs use)."""
    import transformers

    heads = hidden // 64
    types = ["linear_attention"] * (layers - 1) + ["full_attention"]

    def qwen3_next() -> Any:
        config = transformers.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            head_dim=64, linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
            linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2, layer_types=types,
        )  # fmt: skip
        return transformers.Qwen3NextForCausalLM(config)

    def kimi_linear() -> Any:
        config = transformers.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=64,
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, num_local_experts=4,
            num_experts_per_tok=2, linear_head_dim=64, linear_num_heads=heads, layer_types=types,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        return transformers.KimiLinearForCausalLM(config)

    return {
        "qwen3_next": qwen3_next, "kimi_linear": kimi_linear, **ssd_models(hidden, layers),
        **other_models(hidden, layers),
    }  # fmt: skip


def ssd_models(hidden: int, layers: int) -> dict[str, Callable[[], Any]]:
    """The Mamba-2 (SSD) families at ``hidden`` size: ``expand`` 2, heads of 64, state 128,
    one group of B and C (NemotronH: 8, its config's), each config's own chunk size; the hybrids
    with one attention layer last (FalconH1's layers run attention and SSM side by side)."""
    import transformers

    heads, attention = 2 * hidden // 64, max(1, hidden // 128)
    last = layers - 1
    mamba = {
        "mamba_n_heads": heads, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
    }  # fmt: skip
    hybrid = {"vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_attention_heads": attention, "num_key_value_heads": attention}  # fmt: skip

    def mamba2() -> Any:
        config = transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=hidden, num_heads=heads, head_dim=64, state_size=128,
            n_groups=1, num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        return transformers.Mamba2ForCausalLM(config)

    def bamba() -> Any:
        config = transformers.BambaConfig(
            num_hidden_layers=layers, attn_layer_indices=[last], **hybrid, **mamba
        )
        return transformers.BambaForCausalLM(config)

    def granitemoehybrid() -> Any:
        config = transformers.GraniteMoeHybridConfig(
            num_hidden_layers=layers, layer_types=["mamba"] * last + ["attention"],
            num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=hidden, **hybrid, **mamba,
        )  # fmt: skip
        return transformers.GraniteMoeHybridForCausalLM(config)

    def falcon_h1() -> Any:
        config = transformers.FalconH1Config(
            num_hidden_layers=layers, mamba_d_ssm=2 * hidden, mamba_rms_norm=True,
            **hybrid, **mamba,
        )  # fmt: skip
        return transformers.FalconH1ForCausalLM(config)

    def nemotron_h() -> Any:
        config = transformers.NemotronHConfig(
            layers_block_type=["mamba"] * last + ["attention"], head_dim=64,
            mamba_num_heads=heads, mamba_head_dim=64, n_groups=min(8, heads), ssm_state_size=128,
            **hybrid,
        )  # fmt: skip
        return transformers.NemotronHForCausalLM(config)

    def zamba2() -> Any:
        config = transformers.Zamba2Config(
            vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
            layers_block_type=["mamba"] * last + ["hybrid"], mamba_d_state=128,
            mamba_ngroups=1, n_mamba_heads=heads, mamba_headdim=64,
            num_attention_heads=attention, intermediate_size=2 * hidden,
        )  # fmt: skip
        return transformers.Zamba2ForCausalLM(config)

    return {
        "mamba2": mamba2, "bamba": bamba, "granitemoehybrid": granitemoehybrid,
        "falcon_h1": falcon_h1, "nemotron_h": nemotron_h, "zamba2": zamba2,
    }  # fmt: skip


def other_models(hidden: int, layers: int) -> dict[str, Callable[[], Any]]:
    """The lightning, short-convolution, Gated DeltaNet and KDA families at ``hidden`` size:
    heads of 64, one attention layer third from last (the layers after it: the recurrent kind),
    each config's own convolution width, MoE blocks of 4 experts (2 per token)."""
    import transformers

    heads = hidden // 64
    hybrid = ["linear_attention"] * layers
    hybrid[-2] = "full_attention"
    conv = ["conv" if t == "linear_attention" else t for t in hybrid]
    base = {"vocab_size": VOCAB, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads}  # fmt: skip
    delta = {"linear_num_key_heads": max(1, heads // 2), "linear_num_value_heads": heads,
             "linear_key_head_dim": 64, "linear_value_head_dim": 64}  # fmt: skip
    kda = {"linear_head_dim": 64, "linear_num_heads": heads}
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2}
    small = {"intermediate_size": 2 * hidden, "num_key_value_heads": max(1, heads // 4)}
    sliding = {"num_key_value_heads": min(2, heads), "head_dim": 64,
               "swa_num_attention_heads": heads, "swa_num_key_value_heads": min(2, heads),
               "swa_head_dim": 64, "sliding_window_size": 512, "d_rel": 16,
               "rel_extent": 1024, "n_routed_experts": 4, "pad_token_id": 0,
               "eos_token_id": 2}  # fmt: skip
    glm_vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                  "out_hidden_size": hidden, "projection_intermediate_size": 32}  # fmt: skip
    glm_special = ("image_token_id", "video_token_id", "image_start_token_id",
                   "image_end_token_id", "video_start_token_id", "video_end_token_id")  # fmt: skip
    build = {
        "minimax": lambda: transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
            **base, **small, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
            layer_types=hybrid)),
        "lfm2": lambda: transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            **base, **small, layer_types=conv)),
        "lfm2_moe": lambda: transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(
            **base, **small, **moe, num_dense_layers=1, num_experts=4, layer_types=conv)),
        "lfm3": lambda: transformers.Lfm3ForCausalLM(transformers.Lfm3Config(
            **base, **small, head_dim=64, layer_types=conv, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)),
        "inkling": lambda: transformers.InklingForCausalLM(transformers.InklingTextConfig(
            **base, **moe, **sliding, intermediate_size=2 * hidden, n_shared_experts=1)),
        "inkling2": lambda: transformers.Inkling2ForCausalLM(transformers.Inkling2TextConfig(
            **base, **moe, **sliding, unpadded_vocab_size=VOCAB,
            n_layers_per_attn_res_block=1)),
        "olmo_hybrid": lambda: transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(
            **base, **small, **delta, pad_token_id=0, eos_token_id=2, layer_types=hybrid)),
        "qwen4_exp": lambda: transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(
            **base, **delta, **moe, num_key_value_heads=min(2, heads), head_dim=64, num_experts=4,
            shared_expert_intermediate_size=hidden // 2, hc_count=2, hc_lowrank=32,
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=256,
            indexer_compress_ratio=4, layer_types=hybrid)),
        "bailing_hybrid": lambda: transformers.BailingHybridForCausalLM(
            transformers.BailingHybridConfig(
                **base, **moe, intermediate_size=2 * hidden, num_key_value_heads=heads,
                kv_lora_rank=64, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=32,
                head_dim=64, n_group=1, topk_group=1, num_local_experts=4,
                first_k_dense_replace=1, layer_types=hybrid, pad_token_id=0, eos_token_id=2,
                num_mtp_layers=0)),
        "glm5_next": lambda: transformers.Glm5NextForConditionalGeneration(
            transformers.Glm5NextConfig(
                text_config=transformers.Glm5NextTextConfig(
                    **base, **kda, **moe, intermediate_size=2 * hidden, num_key_value_heads=heads,
                    n_routed_experts=4, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=0,
                    qk_nope_head_dim=64, v_head_dim=64, index_topk=256, index_kpool=16,
                    index_head_dim=64, index_n_heads=2, hc_mult=2, pad_token_id=0,
                    layer_types=hybrid).to_dict(),
                vision_config=glm_vision,
                **{name: VOCAB + i for i, name in enumerate(glm_special)})),
    }  # fmt: skip
    return build


#: The families of :func:`other_models`; the first six have no chunked kernel to stand in for
#: (MiniMax's recurrence is inline, the short convolution is the layer's only kernel): no
#: "no-time kernel" rows.
OTHER_MODELS = ("minimax", "lfm2", "lfm2_moe", "lfm3", "inkling", "inkling2", "olmo_hybrid",
                "qwen4_exp", "bailing_hybrid", "glm5_next")  # fmt: skip


def alternate(
    calls: dict[str, Callable[[], Any]],
    repeats: int,
    stat: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """``stat`` (the median) of each call's seconds, the calls timed in alternation (one
    warm-up each)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: stat(t) for name, t in times.items()}


MEASUREMENTS = ("prefill", "decode", "train", "bound")

#: The Mamba-2 (SSD) families (:func:`ssd_models`).
SSD_MODELS = ("mamba2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2")


def no_time_kernel(query: Any, key: Any, value: Any, g: Any, beta: Any, **options: Any) -> Any:
    """A stand-in for a chunked kernel (transformers' signature) that takes next to no time.

    Its output has the kernel's shape and depends on every input (so the backward still runs
    through all of the layer's projections), and its state is zeros of the state's shape: a
    model timed with it shows what the rest of the model costs.
    """
    touch = (query.sum() + key.sum() + g.sum()) * 0.0
    out = value * beta[..., None] + touch
    state = None
    if options.get("output_final_state"):
        b, _, heads, d_v = value.shape
        state = value.new_zeros((b, heads, query.shape[-1], d_v))
    return out, state


def with_no_time_kernel(model: Any) -> Any:
    """``model`` (converted in place) with its linear-attention layers' chunked kernel
    replaced by :func:`no_time_kernel` (the recurrent one, for decoding, is left as it is)."""
    from polylin.compat.transformers import LAYER_CLASSES
    from polylin.compat.transformers._mamba2 import KERNELS as SSD_KERNELS
    from polylin.compat.transformers._rebind import rebind

    for layer in model.modules():
        conversion = LAYER_CLASSES.get(type(layer).__name__)
        if conversion is not None and conversion.kernels:
            chunked = {name: no_time_kernel for name in conversion.kernels if "chunk" in name}
            layer.forward = types.MethodType(rebind(type(layer).forward, chunked), layer)
        elif conversion is not None and conversion.family == "Mamba-2":
            # transformers' pure-PyTorch kernels, the chunked scan replaced
            module = sys.modules[type(layer).__module__]
            kernels = {name: getattr(module, name).__wrapped__ for name in SSD_KERNELS}
            kernels["mamba2_chunk_scan"] = no_time_scan
            layer.forward = types.MethodType(rebind(type(layer).forward, kernels), layer)
    return model


def no_time_scan(
    hidden_states: Any, dt: Any, A: Any, B: Any, C: Any, *args: Any, **options: Any
) -> Any:
    """:func:`no_time_kernel` for the Mamba-2 mixers' chunked scan (``mamba2_chunk_scan``'s
    signature): ``x dt`` (every input touched), and a zero state."""
    touch = (A.sum() + B.sum() + C.sum()) * 0.0
    out = hidden_states * dt[..., None] + touch
    if not options.get("return_final_states"):
        return out
    b, _, heads, head_dim = hidden_states.shape
    return out, hidden_states.new_zeros((b, heads, head_dim, B.shape[-1]))


def per_token_seconds(
    calls: dict[str, Callable[[], Any]], keys: list[str], new: int, repeats: int
) -> dict[str, float]:
    """Per key, ``(generate(1 + new) - generate(1)) / new`` (``calls``: ``"{key} 1"`` and
    ``"{key} {1 + new}"``): the new tokens' steps without the prompt's prefill.

    The fastest of at least 3 runs of each: a stall in one generate(1) longer than the new
    tokens' steps would make a difference of medians of 1 run negative; on a machine busy with
    other work even the fastest of 3 can be, so while a difference is not positive the calls
    are timed again with twice the runs (three times at most)."""
    for runs in (max(3, repeats) * 2**i for i in range(3)):
        t = alternate(calls, runs, stat=min)
        per_token = {k: (t[f"{k} {1 + new}"] - t[f"{k} 1"]) / new for k in keys}
        if min(per_token.values()) > 0:
            break
    return per_token


def bench_models(
    lengths: list[int],
    hidden: int,
    layers: int,
    repeats: int,
    *,
    names: list[str] | None = None,
    measurements: tuple[str, ...] = MEASUREMENTS,
    train_length: int | None = None,
) -> list[dict]:
    rows = []
    for name, build in models(hidden, layers).items():
        if names is not None and name not in names:
            continue
        torch.manual_seed(0)
        reference = use_transformers_fallback(build().float().eval())
        model = use_polylin(copy.deepcopy(reference))
        pair = {"transformers": reference, "polylin": model}
        timed = dict(pair)  # prefill and training: also the no-time kernel, in alternation
        if "bound" in measurements and name not in OTHER_MODELS[:6]:
            timed["no-time kernel"] = with_no_time_kernel(copy.deepcopy(reference))
        ids = torch.randint(3, VOCAB, (1, lengths[0]), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want, got = reference(ids[:, :256]).logits, model(ids[:, :256]).logits
        error = float((got - want).abs().max() / want.abs().max())
        if error > 1e-4:
            raise AssertionError(
                f"{name}: polylin's logits differ from transformers' by {error:.2e}"
            )
        for length in lengths if "prefill" in measurements else []:
            ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))

            def prefill(m: Any, ids: Any = ids) -> Any:
                with torch.no_grad():
                    return m(ids).logits

            t = alternate({k: functools.partial(prefill, m) for k, m in timed.items()}, repeats)
            rows += against_transformers(name, "prefill", length, t)
        prompt = ids[:, :16]
        new = 32

        def generate(m: Any, tokens: int, prompt: Any = prompt) -> Any:
            with torch.no_grad():
                return m.generate(
                    prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                    use_cache=True, pad_token_id=0,
                )  # fmt: skip

        if "decode" in measurements:
            calls = {
                f"{k} {n}": functools.partial(generate, m, n)
                for k, m in pair.items() for n in (1, 1 + new)
            }  # fmt: skip
            per_token = per_token_seconds(calls, list(pair), new, repeats)
            rows.append(row(name, "decode per token", 16, per_token))
            progress(rows[-1])
        if "train" not in measurements:
            continue
        length = train_length or lengths[0]
        ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(2))

        def train(m: Any, ids: Any = ids) -> None:
            m.zero_grad()
            m(ids, labels=ids).loss.backward()

        for m in timed.values():
            m.train()
        t = alternate({k: functools.partial(train, m) for k, m in timed.items()}, repeats)
        rows += against_transformers(name, "forward+backward", length, t)
    return rows


def against_transformers(model: str, what: str, length: int, t: dict[str, float]) -> list[dict]:
    """The rows of one measurement: polylin and (if timed) the no-time kernel, each against
    transformers' time of the same alternation."""
    rows = []
    for other, label in (("polylin", what), ("no-time kernel", f"{what}, no-time kernel")):
        if other in t:
            rows.append(
                row(model, label, length, {"transformers": t["transformers"], other: t[other]})
            )
            progress(rows[-1])
    return rows


def row(model: str, what: str, length: int, t: dict[str, float]) -> dict:
    """A result: ``t`` holds the seconds of the baseline (transformers or fla's naive form,
    first) and of the other side (polylin, its compat twin or the no-time kernel)."""
    base, ours = t
    return {
        "model": model, "what": what, "T": length, "seconds": t,
        "speedup": t[base] / t[ours],
    }  # fmt: skip


def progress(r: dict) -> None:
    seconds = " ".join(f"{k}={v:.4g}s" for k, v in r["seconds"].items())
    print(
        f"{r['model']:>26} {r['what']:>18} T={r['T']:>5}  x{r['speedup']:.2f}  {seconds}",
        flush=True,
    )


#: The compat chunk functions timed against fla's naive form of the same op.
OPS = (
    "linear_attn",
    "simple_gla",
    "gla",
    "delta_rule",
    "gated_delta_rule",
    "kda",
    "dplr_delta_rule",
)

#: fla's naive function each is timed against (fla ships no chunked naive GLA).
NAIVE = {
    "linear_attn": "naive_chunk_linear_attn",
    "simple_gla": "naive_chunk_simple_gla",
    "gla": "naive_recurrent_gla",
    "delta_rule": "delta_rule_chunkwise",
    "gated_delta_rule": "naive_chunk_gated_delta_rule",
    "kda": "naive_chunk_kda",
    "dplr_delta_rule": "dplr_chunkwise",
}


def bench_ops(length: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 1, length, 4, 64
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    unit = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=g)
    g_head = -torch.rand(B, T, H, generator=g) * 0.1
    g_chan = -torch.rand(B, T, H, D, generator=g) * 0.1
    # RWKV-7's transition for the generalized rule: a = -kk, b = kk * a_lr
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    a, b = -kk, kk * torch.rand(B, T, H, D, generator=g)
    cases = {
        "linear_attn": (
            lambda: fla.chunk_linear_attn(q, k, v, normalize=False)[0],
            lambda: fla_naive("linear_attn").naive_chunk_linear_attn(q, k, v),
        ),
        "simple_gla": (
            lambda: fla.chunk_simple_gla(q, k, v, g_head)[0],
            lambda: fla_naive("simple_gla").naive_chunk_simple_gla(q, k, v, g_head)[0],
        ),
        "gla": (
            lambda: fla.chunk_gla(q, k, v, g_chan)[0],
            lambda: fla_naive("gla").naive_recurrent_gla(q, k, v, g_chan)[0],
        ),
        "delta_rule": (
            lambda: fla.chunk_delta_rule(q, unit, v, beta)[0],
            lambda: (
                fla_naive("delta_rule")
                .delta_rule_chunkwise(*(x.transpose(1, 2) for x in (q, unit, v, beta)))[0]
                .transpose(1, 2)
            ),
        ),
        "gated_delta_rule": (
            lambda: fla.chunk_gated_delta_rule(q, unit, v, g_head, beta)[0],
            lambda: fla_naive("gated_delta_rule").naive_chunk_gated_delta_rule(
                q, unit, v, g_head, beta
            )[0],
        ),
        "kda": (
            lambda: fla.chunk_kda(q, unit, v, g_chan, beta)[0],
            lambda: fla_naive("kda").naive_chunk_kda(q, unit, v, g_chan, beta)[0],
        ),
        "dplr_delta_rule": (  # fla's naive chunk form is head-first, chunk 32 (T % 32 == 0)
            lambda: fla.chunk_dplr_delta_rule(q, k, v, a, b, g_chan)[0],
            lambda: (
                fla_naive("generalized_delta_rule/dplr")
                .dplr_chunkwise(*(x.transpose(1, 2) for x in (q, k, v, a, b, g_chan)))[0]
                .transpose(1, 2)
            ),
        ),
    }
    assert set(cases) == set(OPS)
    rows = []
    for name, (ours, naive) in cases.items():
        with torch.no_grad():
            got, want = ours(), naive()
        error = float((got - want).abs().max() / want.abs().max())
        if error > 1e-3:
            raise AssertionError(f"{name}: compat and fla's naive form differ by {error:.2e}")

        def timed(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                with torch.no_grad():
                    return fn()

            return call

        t = alternate({"naive": timed(naive), "compat": timed(ours)}, repeats)
        rows.append(row(f"fla.chunk_{name}", "forward", length, t) | {"naive": NAIVE[name]})
        progress(rows[-1])
    return rows


def markdown(result: dict) -> dict[str, str]:
    """The docs' tables: ``compat_models.md`` and ``compat_ops.md`` (ratios, then seconds)."""
    models = [
        "| model | measurement | T | transformers (s) | polylin (s) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    ops = [
        "| compat function | fla's naive form | T | naive (s) | compat (s) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "transformers" in r["seconds"]:
            t = r["seconds"]
            other = t.get("polylin", t.get("no-time kernel"))
            models.append(
                f"| {r['model']} | {r['what']} | {r['T']} | {t['transformers']:.4g} | "
                f"{other:.4g} | {r['speedup']:.2f}x |"
            )
        else:
            t = r["seconds"]
            ops.append(
                f"| `{r['model']}` | `{r['naive']}` | {r['T']} | {t['naive']:.4g} | "
                f"{t['compat']:.4g} | {r['speedup']:.2f}x |"
            )
    if any("no-time kernel" in r["seconds"] for r in result["rows"]):
        models.append(
            '\n"no-time kernel": the model with its chunked linear-attention kernel replaced by a'
            " stand-in that takes next to no time (`benchmarks/compat.py`, `no_time_kernel`): the"
            " speed-up no kernel can pass inside these models."
        )
    note = (
        f"\ntorch {result['torch']}, transformers {result['transformers']}, fla "
        f"{result['fla']}, {result['threads']} threads; `{result['command']}`.\n"
    )
    return {"compat_models.md": "\n".join(models) + "\n" + note,
            "compat_ops.md": "\n".join(ops) + "\n" + note}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["models", "ops"], choices=["models", "ops"])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--models", nargs="+", default=None,
        choices=["qwen3_next", "kimi_linear", *SSD_MODELS, *OTHER_MODELS],
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: its)")
    parser.add_argument(
        "--measurements", nargs="+", default=list(MEASUREMENTS), choices=MEASUREMENTS
    )
    parser.add_argument("--train-length", type=int, default=None, help="default: the first length")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the docs' tables into this folder"
    )
    parser.add_argument(
        "--from-json", type=Path, default=None, help="tables from an earlier run's JSON"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.hidden, args.layers, args.repeats = [64], 64, 2, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        write_tables(result, args.markdown)
        return result
    import transformers

    result = {
        "command": command_line("compat.py", argv),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "fla": fla.FLA_VERSION, "threads": torch.get_num_threads(),
        "rows": [],
    }  # fmt: skip
    if "models" in args.parts:
        result["rows"] += bench_models(
            args.lengths, args.hidden, args.layers, args.repeats, names=args.models,
            measurements=tuple(args.measurements), train_length=args.train_length,
        )  # fmt: skip
    if "ops" in args.parts:
        result["rows"] += bench_ops(args.lengths[0], args.repeats)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    write_tables(result, args.markdown)
    return result


def write_tables(result: dict, folder: Path | None) -> None:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in markdown(result).items():
            (folder / name).write_text(text)


if __name__ == "__main__":
    main()
