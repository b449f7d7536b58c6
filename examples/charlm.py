"""The character language model of the examples, written once against the Python array API.

Like polylin itself, the model is one set of functions that runs on whatever arrays its parameters
are: PyTorch tensors (``char_lm_torch.py`` trains it with autograd), JAX arrays
(``char_lm_jax.py`` trains it with ``jax.grad``) and NumPy arrays (``generate_numpy.py`` serves
it). Every attention layer goes through polylin's public API: the chunked form of
:func:`polylin.causal_linear_attention` for training and prefill, :func:`polylin.step` with the
returned :class:`polylin.LinearAttentionState` for decoding.

The model: a character embedding (tied with the output head), ``n_layers`` pre-norm blocks, each
multi-head causal linear attention followed by an MLP, RMSNorm, no biases. The attention input of
each token is its normalized hidden vector concatenated with the previous token's ("token shift"):
linear attention with a positive feature map has no notion of position, and this one-token look
back gives the model local order at the cost of one vector per layer in the decoding state.

With ``layer="gated-deltanet"`` each block's attention is a Gated DeltaNet block instead
(:func:`polylin.blocks.gated_deltanet`, :class:`polylin.torch.GatedDeltaNet`'s computation on
its parameters under the same names and shapes, on any arrays): short causal convolutions on q,
k, v (they give the model local order, so there is no token shift), the gated delta rule, the
gated RMSNorm; :func:`polylin.blocks.gated_deltanet_step` for decoding.

This module imports NumPy (for data and initialization) and polylin, never PyTorch or JAX.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from array_api_compat import array_namespace
from array_api_compat import device as device_of

from polylin import causal_linear_attention, step
from polylin.blocks import BlockCache, gated_deltanet, gated_deltanet_step

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The "
SAMPLE_TOKENS = 200
NORM_EPS = 1e-5
#: The attention of each block: linear attention with a token shift, or a Gated DeltaNet block.
LAYERS = ("linear", "gated-deltanet")
CONV_SIZE = 4  # the Gated DeltaNet block's short convolutions

Params = dict[str, Any]


# -- data --------------------------------------------------------------------------------------
#: Pages left out of the training text: the tutorial quotes the examples' own output.
NOT_TRAINED_ON = {"tutorial.md"}


def training_text(root: Path = ROOT) -> str:
    """The text the examples train on: this project's README and documentation pages."""
    pages = sorted(p for p in (root / "docs").glob("*.md") if p.name not in NOT_TRAINED_ON)
    files = [root / "README.md", *pages]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


@dataclass(frozen=True)
class Vocab:
    """The characters of the training text; a token is an index into ``chars``."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        return cls("".join(sorted(set(text))))

    @classmethod
    def load(cls, path: Path) -> Vocab:
        return cls(json.loads(path.read_text(encoding="utf-8"))["chars"])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"chars": self.chars}, ensure_ascii=False) + "\n", "utf-8")

    def __len__(self) -> int:
        return len(self.chars)

    def unknown(self, text: str) -> list[str]:
        """The characters of ``text`` that are not in the vocabulary, in order of appearance."""
        return sorted(set(text) - set(self.chars), key=text.index)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], dtype=np.int64)

    def decode(self, tokens: Any) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


def batches(
    data: np.ndarray, *, batch: int, context: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless random windows of ``data``: inputs ``(batch, context)`` and next-token targets.

    The same seed gives the same batches in every framework, so their loss curves compare.
    """
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, data.size - context - 1, size=batch)
        windows = np.stack([data[s : s + context + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def split(data: np.ndarray, fraction: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """The first ``fraction`` of the text for training, the rest for validation."""
    cut = int(data.size * fraction)
    return data[:cut], data[cut:]


# -- parameters --------------------------------------------------------------------------------
def gdn_init(
    rng: np.random.Generator, d_model: int, n_heads: int, out_std: float
) -> dict[str, np.ndarray]:
    """A Gated DeltaNet block's parameters, named and shaped as in
    ``polylin.torch.GatedDeltaNet(hidden_size=d_model, num_heads=n_heads,
    head_dim=d_model // n_heads, expand_v=1, conv_size=4)``'s state dict (``Linear`` weights are
    ``(out, in)``); Mamba's initialization of ``A_log`` and ``dt_bias``."""

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    std = 1 / math.sqrt(d_model)
    bound = 1 / math.sqrt(CONV_SIZE)  # nn.Conv1d's default for a depthwise kernel
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(0.1), n_heads)).clip(min=1e-4)
    params = {f"{n}_proj.weight": normal((d_model, d_model), std) for n in "qkvg"}
    params |= {f"{n}_proj.weight": normal((n_heads, d_model), std) for n in "ab"}
    params |= {
        f"{n}_conv1d.weight": rng.uniform(-bound, bound, (d_model, 1, CONV_SIZE)).astype(np.float32)
        for n in "qkv"
    }
    params["A_log"] = np.log(rng.uniform(1, 16, n_heads)).astype(np.float32)
    params["dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus^-1
    params["o_norm.weight"] = np.ones(d_model // n_heads, np.float32)
    params["o_proj.weight"] = normal((d_model, d_model), out_std)
    return params


def init_params(
    vocab_size: int,
    *,
    d_model: int,
    n_heads: int,
    n_layers: int,
    seed: int,
    layer: str = "linear",
) -> dict[str, np.ndarray]:
    """Float32 NumPy parameters: the same seed gives the same model in every framework."""
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    residual_std = 1 / math.sqrt(2 * n_layers)  # keeps the residual stream's growth in check
    params = {"embed": normal((vocab_size, d_model), 0.02)}
    for i in range(n_layers):
        params[f"block{i}.attn_norm"] = np.ones(d_model, np.float32)
        if layer == "gated-deltanet":
            attn = gdn_init(rng, d_model, n_heads, residual_std / math.sqrt(d_model))
            params |= {f"block{i}.attn.{name}": w for name, w in attn.items()}
        else:
            params |= {
                f"block{i}.qkv": normal((2 * d_model, 3 * d_model), 1 / math.sqrt(2 * d_model)),
                f"block{i}.out": normal((d_model, d_model), residual_std / math.sqrt(d_model)),
            }
        params |= {
            f"block{i}.mlp_norm": np.ones(d_model, np.float32),
            f"block{i}.fc1": normal((d_model, 4 * d_model), 1 / math.sqrt(d_model)),
            f"block{i}.fc2": normal((4 * d_model, d_model), residual_std / math.sqrt(4 * d_model)),
        }
    params["final_norm"] = np.ones(d_model, np.float32)
    return params


def n_layers_of(params: Params) -> int:
    return sum(1 for name in params if name.endswith(".attn_norm"))


def is_gdn(params: Params, i: int) -> bool:
    """Whether block ``i`` is a Gated DeltaNet block (else linear attention)."""
    return f"block{i}.attn.q_proj.weight" in params


def gdn_attention(
    params: Params, i: int, h: Any, *, n_heads: int, cache: Any = None
) -> tuple[Any, BlockCache]:
    """Block ``i``'s Gated DeltaNet over ``h`` ``(batch, T, d)`` (``(batch, d)``: one token, then
    ``cache`` is needed): :func:`polylin.blocks.gated_deltanet` on the block's parameters;
    returns the output and the block's cache."""
    p = f"block{i}.attn."
    block = {name[len(p) :]: value for name, value in params.items() if name.startswith(p)}
    if h.ndim == 2:
        return gated_deltanet_step(block, h, cache, num_heads=n_heads, norm_eps=NORM_EPS)
    return gated_deltanet(block, h, num_heads=n_heads, norm_eps=NORM_EPS, return_cache=True)


def save_weights(path: Path, params: dict[str, np.ndarray], *, n_heads: int) -> None:
    """Plain NumPy arrays in one ``.npz``; ``n_heads`` is the one setting shapes do not tell."""
    np.savez(path, n_heads=np.array(n_heads), **params)


def load_weights(path: Path) -> tuple[dict[str, np.ndarray], int]:
    """The parameters and ``n_heads`` written by :func:`save_weights`."""
    with np.load(path) as f:
        params = {name: f[name] for name in f.files if name != "n_heads"}
        return params, int(f["n_heads"])


# -- the model ---------------------------------------------------------------------------------
def rms_norm(x: Any, gain: Any) -> Any:
    xp = array_namespace(x)
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * gain


def relu(x: Any) -> Any:
    xp = array_namespace(x)
    return xp.where(x > 0, x, xp.zeros_like(x))


def mlp(params: Params, i: int, x: Any) -> Any:
    h = rms_norm(x, params[f"block{i}.mlp_norm"])
    return relu(h @ params[f"block{i}.fc1"]) @ params[f"block{i}.fc2"]


def embed(params: Params, tokens: Any) -> Any:
    """``(...,)`` integer tokens to ``(..., d_model)`` vectors."""
    xp = array_namespace(params["embed"])
    flat = xp.take(params["embed"], xp.reshape(tokens, (-1,)), axis=0)
    return xp.reshape(flat, (*tokens.shape, params["embed"].shape[1]))


def head_logits(params: Params, x: Any) -> Any:
    xp = array_namespace(x)
    return rms_norm(x, params["final_norm"]) @ xp.matrix_transpose(params["embed"])


@dataclass
class Cache:
    """What decoding carries per layer: polylin's state and the last token's normalized input
    (for a Gated DeltaNet block: its convolution states and delta-rule state, and ``None``).

    Its size does not depend on how many tokens it summarizes.
    """

    states: list[Any]
    last: list[Any]


def forward(params: Params, tokens: Any, *, n_heads: int, return_cache: bool = False) -> Any:
    """Logits ``(batch, T, vocab)`` for tokens ``(batch, T)``; the whole sequence at once.

    Attention runs through :func:`polylin.causal_linear_attention` (the chunked form). With
    ``return_cache`` the per-layer states come back too, ready for :func:`decode`.
    """
    xp = array_namespace(params["embed"])
    batch, T = tokens.shape
    x = embed(params, tokens)
    d_model = x.shape[-1]
    states, last = [], []
    for i in range(n_layers_of(params)):
        h = rms_norm(x, params[f"block{i}.attn_norm"])
        if is_gdn(params, i):
            o, block_cache = gdn_attention(params, i, h, n_heads=n_heads)
            states.append(block_cache)
            last.append(None)
            x = x + o
            x = x + mlp(params, i, x)
            continue
        previous = xp.concat([xp.zeros_like(h[:, :1, :]), h[:, :-1, :]], axis=1)
        qkv = xp.concat([h, previous], axis=-1) @ params[f"block{i}.qkv"]
        # (batch, T, 3, heads, d_head) -> three (batch, heads, T, d_head)
        qkv = xp.permute_dims(xp.reshape(qkv, (batch, T, 3, n_heads, -1)), (2, 0, 3, 1, 4))
        q, k, v = qkv[0, ...], qkv[1, ...], qkv[2, ...]
        if return_cache:
            o, state = causal_linear_attention(q, k, v, return_state=True)
            states.append(state)
            last.append(h[:, -1, :])
        else:
            o = causal_linear_attention(q, k, v)
        o = xp.reshape(xp.permute_dims(o, (0, 2, 1, 3)), (batch, T, d_model))
        x = x + o @ params[f"block{i}.out"]
        x = x + mlp(params, i, x)
    logits = head_logits(params, x)
    return (logits, Cache(states, last)) if return_cache else logits


def decode(params: Params, token: Any, cache: Cache, *, n_heads: int) -> tuple[Any, Cache]:
    """Logits ``(batch, vocab)`` for one new token ``(batch,)`` and the updated cache.

    Attention runs through :func:`polylin.step`: O(1) work and memory per token whatever the
    position.
    """
    xp = array_namespace(params["embed"])
    x = embed(params, token)
    batch, d_model = x.shape
    states, last = [], []
    for i in range(n_layers_of(params)):
        h = rms_norm(x, params[f"block{i}.attn_norm"])
        if is_gdn(params, i):
            o, block_cache = gdn_attention(params, i, h, n_heads=n_heads, cache=cache.states[i])
            states.append(block_cache)
            last.append(None)
            x = x + o
            x = x + mlp(params, i, x)
            continue
        qkv = xp.concat([h, cache.last[i]], axis=-1) @ params[f"block{i}.qkv"]
        qkv = xp.permute_dims(xp.reshape(qkv, (batch, 3, n_heads, -1)), (1, 0, 2, 3))
        o, state = step(qkv[0, ...], qkv[1, ...], qkv[2, ...], cache.states[i])
        states.append(state)
        last.append(h)
        x = x + xp.reshape(o, (batch, d_model)) @ params[f"block{i}.out"]
        x = x + mlp(params, i, x)
    return head_logits(params, x), Cache(states, last)


def cross_entropy(logits: Any, targets: Any) -> Any:
    """Mean negative log-likelihood of integer ``targets`` under ``logits`` (last axis)."""
    xp = array_namespace(logits)
    shifted = logits - xp.max(logits, axis=-1, keepdims=True)  # exp() of numbers <= 0 only
    log_probs = shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))
    classes = xp.arange(logits.shape[-1], dtype=targets.dtype, device=device_of(targets))
    picked = xp.where(targets[..., None] == classes, log_probs, xp.zeros_like(log_probs))
    return -xp.mean(xp.sum(picked, axis=-1))


def loss(params: Params, inputs: Any, targets: Any, *, n_heads: int) -> Any:
    """The training objective: next-character cross-entropy."""
    return cross_entropy(forward(params, inputs, n_heads=n_heads), targets)


def generate(
    params: Params, prompt: Any, n_tokens: int, *, n_heads: int
) -> tuple[list[int], float]:
    """Greedy continuation of ``prompt`` (1-D tokens): prefill with the chunked form, then step.

    Returns the ``n_tokens`` new tokens and the smallest gap between the best and second-best
    logit met on the way: argmax is only as reproducible across libraries as this gap is large
    compared with rounding (float64 rounding is ~1e-13 here).
    """
    xp = array_namespace(params["embed"])
    logits, cache = forward(params, prompt[None, :], n_heads=n_heads, return_cache=True)
    logits = logits[:, -1, :]
    tokens: list[int] = []
    margin = math.inf
    for _ in range(n_tokens):
        top2 = xp.sort(logits[0, :])[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        token = xp.argmax(logits, axis=-1)
        tokens.append(int(token[0]))
        logits, cache = decode(params, token, cache, n_heads=n_heads)
    return tokens, margin


# -- training helpers --------------------------------------------------------------------------
def learning_rate(step_index: int, steps: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = min(warmup, max(steps // 10, 1))
    if step_index < warmup:
        return peak * (step_index + 1) / warmup
    progress = (step_index - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Progress:
    """A progress bar with the loss on stderr (one line per tenth when stderr is not a terminal)."""

    def __init__(self, total: int, label: str = "train") -> None:
        self.total, self.label = total, label
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.every = max(total // 10, 1)

    def update(self, done: int, loss_value: float) -> None:
        if not self.tty and done % self.every and done != self.total:
            return
        width = 30
        filled = width * done // self.total
        elapsed = time.perf_counter() - self.start
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
            f"loss {loss_value:.3f} {elapsed:.0f}s"
        )
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def write_losses(path: Path, losses: list[float]) -> None:
    path.write_text("step,loss\n" + "".join(f"{i},{x:.6f}\n" for i, x in enumerate(losses)))


def read_losses(path: Path) -> list[float]:
    lines = path.read_text().splitlines()[1:]
    return [float(line.split(",")[1]) for line in lines]


def smooth(values: list[float], window: int = 20) -> np.ndarray:
    """Running mean over the last ``window`` values (shorter at the start)."""
    cumulative = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def plot_losses(path: Path, curves: dict[str, list[float]]) -> bool:
    """A PNG of the (smoothed) loss curves; False, with a message, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for (label, losses), style in zip(curves.items(), ["-", "--", ":", "-."]):
        ax.plot(smooth(losses), style, label=label, linewidth=1.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (nats/char, running mean of 20)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# -- command line ------------------------------------------------------------------------------
def _positive(convert: Any, noun: str) -> Any:
    """An argparse type: a number > 0 of the given kind (the message names the value)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {noun}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {noun}, got {value}")
        return value

    return parse


positive_int = _positive(int, "integer")
positive_float = _positive(float, "number")


def prepare_run(args: argparse.Namespace, framework: str) -> tuple[Any, Any, Any, dict]:
    """What both training scripts start from: the vocabulary, the training and validation
    tokens and the initial weights (NumPy, from ``args.seed``), after a line that says so."""
    text = training_text()
    vocab = Vocab.from_text(text)
    train_data, val_data = split(vocab.encode(text))
    print(
        f"text: {len(text):,} characters, vocabulary {len(vocab)}; model: {args.layers} "
        f"{args.layer} layers, "
        f"d_model {args.d_model}, {args.heads} heads; {args.steps} steps of "
        f"{args.batch} x {args.context} characters; {framework}"
    )
    init = init_params(
        len(vocab), d_model=args.d_model, n_heads=args.heads, n_layers=args.layers,
        seed=args.seed, layer=args.layer,
    )  # fmt: skip
    return vocab, train_data, val_data, init


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both training scripts share (same defaults: same model, same batches)."""
    parser.add_argument("--steps", type=positive_int, default=1000, help="training steps")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--context", type=positive_int, default=128, help="characters per sequence")
    parser.add_argument("--d-model", type=positive_int, default=128, help="model width")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--layers", type=positive_int, default=2, help="blocks")
    parser.add_argument(
        "--layer", choices=LAYERS, default="linear",
        help="each block's attention: linear attention, or a Gated DeltaNet block",
    )  # fmt: skip
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initialization and batch order")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for the framework (default: its own choice; 1 is fastest on a busy "
        "machine)",
    )


def check_training_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.d_model % args.heads:
        parser.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
