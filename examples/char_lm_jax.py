"""Train the same character language model in JAX: ``jit``, ``grad`` and a few-line Adam.

    python examples/char_lm_jax.py --steps 1000 --out runs/jax
    python examples/char_lm_jax.py --steps 1000 --layer gated-deltanet --out runs/jax-gdn
    python examples/generate_numpy.py runs/jax-gdn      # NumPy serves it: the same text

The model is the one ``char_lm_torch.py`` trains (``examples/charlm.py``, written against the
array API), here on JAX arrays, with polylin's chunked ``causal_linear_attention`` traced inside
``jax.jit`` and differentiated by ``jax.grad``. With ``--layer gated-deltanet`` each block's
attention is a Flax NNX module, ``polylin.flax.GatedDeltaNet``, built from the same initial
weights (``polylin.torch.GatedDeltaNet``'s state dict, by name) and trained through ``nnx.split``
and ``jax.grad``. The defaults are those of the PyTorch script: the same seed gives the same
initial weights and the same batches, so the two loss curves can be laid on top of each other
(``--compare DIR`` plots the PyTorch run's ``losses.csv`` beside this one).

With ``--out DIR`` it writes ``weights.npz`` (plain NumPy arrays under ``charlm``'s names, which
``generate_numpy.py DIR`` serves), ``vocab.json``, ``losses.csv`` and ``loss.png`` (with
matplotlib); for a Gated DeltaNet model also ``sample.txt``: the prompt ``"The "`` and its greedy
continuation of 200 characters in float64 by the Flax modules' prefill and ``step``, the text
``generate_numpy.py DIR`` prints with NumPy alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import charlm
import numpy as np


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output directory (optional)")
    parser.add_argument(
        "--compare", type=Path, default=None, help="a char_lm_torch.py output directory to plot"
    )
    charlm.add_training_arguments(parser)
    args = parser.parse_args(argv)
    charlm.check_training_arguments(parser, args)
    if args.compare is not None and not (args.compare / "losses.csv").is_file():
        parser.error(f"--compare {args.compare} has no losses.csv (from char_lm_torch.py --out)")
    if args.compare is not None and args.out is None:
        parser.error("--compare needs --out (where the plot goes)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    return args


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8):
    """Adam as ``torch.optim.Adam`` computes it, on a pytree of parameters."""
    import jax
    import jax.numpy as jnp

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}

    def update(params, grads, state, lr):
        t = state["t"] + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        c1, c2 = 1 - b1**t, 1 - b2**t
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v
        )
        return params, {"m": m, "v": v, "t": t}

    return init, update


def flax_model(weights: dict[str, Any], *, n_heads: int) -> Any:
    """``charlm``'s Gated DeltaNet model as a Flax NNX module from its weights (any arrays):
    each block's attention a :class:`polylin.flax.GatedDeltaNet` loaded by its state-dict
    names, the rest (embedding, norms, MLPs) ``nnx.Param``s under ``charlm``'s names."""
    import jax.numpy as jnp
    from flax import nnx

    from polylin.flax import GatedDeltaNet

    class CharLM(nnx.Module):
        def __init__(self) -> None:
            d_model = weights["embed"].shape[1]
            self.attn = nnx.List(
                GatedDeltaNet.from_torch_state_dict(
                    {n.removeprefix(f"block{i}.attn."): w for n, w in weights.items()
                     if n.startswith(f"block{i}.attn.")},
                    hidden_size=d_model, num_heads=n_heads, head_dim=d_model // n_heads,
                    expand_v=1, conv_size=charlm.CONV_SIZE, norm_eps=charlm.NORM_EPS,
                )
                for i in range(charlm.n_layers_of(weights))
            )  # fmt: skip
            self.rest = nnx.Dict(
                {n: nnx.Param(jnp.asarray(w)) for n, w in weights.items() if ".attn." not in n}
            )

        def weights(self) -> dict[str, Any]:
            """Every parameter under ``charlm``'s names (``block0.attn.q_proj.weight``)."""
            out = {n: p[...] for n, p in self.rest.items()}
            for i, layer in enumerate(self.attn):
                out |= {f"block{i}.attn.{n}": w for n, w in layer.state_dict().items()}
            return out

        def __call__(self, tokens: Any, caches: list | None = None) -> tuple[Any, list]:
            """Logits for ``tokens`` ``(batch, T)``, or for one token ``(batch,)`` after
            ``caches``; and the blocks' caches after them."""
            params = {n: p[...] for n, p in self.rest.items()}
            x = charlm.embed(params, tokens)
            new_caches = []
            for i, layer in enumerate(self.attn):
                h = charlm.rms_norm(x, params[f"block{i}.attn_norm"])
                if tokens.ndim == 1:
                    o, cache = layer.step(h, None if caches is None else caches[i])
                else:
                    o, cache = layer(h, return_cache=True)
                new_caches.append(cache)
                x = x + o
                x = x + charlm.mlp(params, i, x)
            return charlm.head_logits(params, x), new_caches

    return CharLM()


def flax_generate(weights: dict[str, Any], prompt: Any, *, n_heads: int) -> tuple[list[int], float]:
    """:func:`charlm.generate` through the Flax model: its prefill of the prompt, then its
    ``step`` per token, each compiled once (``nnx.jit``)."""
    import jax.numpy as jnp
    from flax import nnx

    model = flax_model(weights, n_heads=n_heads)
    logits, caches = nnx.jit(lambda model, tokens: model(tokens))(model, prompt[None, :])
    logits = logits[:, -1, :]
    decode = nnx.jit(lambda model, token, caches: model(token, caches))
    tokens: list[int] = []
    margin = math.inf
    for _ in range(charlm.SAMPLE_TOKENS):
        top2 = jnp.sort(logits[0, :])[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        token = jnp.argmax(logits, axis=-1)
        tokens.append(int(token[0]))
        logits, caches = decode(model, token, caches)
    return tokens, margin


def write_outputs(args, vocab, weights: dict[str, np.ndarray], losses: list[float]) -> None:
    """``weights.npz``, ``vocab.json``, the losses and their plot; for a Gated DeltaNet model,
    ``sample.txt`` (the Flax model's, in float64)."""
    import jax
    import jax.numpy as jnp

    args.out.mkdir(parents=True, exist_ok=True)
    charlm.save_weights(args.out / "weights.npz", weights, n_heads=args.heads)
    vocab.save(args.out / "vocab.json")
    charlm.write_losses(args.out / "losses.csv", losses)
    curves = {"JAX": losses}
    if args.compare is not None:
        curves = {"PyTorch": charlm.read_losses(args.compare / "losses.csv"), **curves}
    charlm.plot_losses(args.out / "loss.png", curves)
    if args.layer == "gated-deltanet":
        # Generation in float64, so that NumPy (or any library) reproduces the argmax exactly.
        jax.config.update("jax_enable_x64", True)
        weights64 = {name: jnp.asarray(w, jnp.float64) for name, w in weights.items()}
        prompt = jnp.asarray(vocab.encode(charlm.PROMPT))
        tokens, margin = flax_generate(weights64, prompt, n_heads=args.heads)
        sample = charlm.PROMPT + vocab.decode(tokens)
        (args.out / "sample.txt").write_text(sample + "\n", encoding="utf-8")
        print(f"sample (greedy, float64, polylin.flax; smallest top-2 logit gap {margin:.1e}):")
        print(sample)
    print(
        f"wrote {args.out}/weights.npz, vocab.json, losses.csv"
        + (", sample.txt" if args.layer == "gated-deltanet" else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        # XLA reads its flags when jax starts: set them before the import below.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_cpu_multi_thread_eigen={'true' if args.threads > 1 else 'false'}"
            + f" intra_op_parallelism_threads={args.threads}"
        ).strip()
    import jax
    import jax.numpy as jnp

    vocab, train_data, val_data, init = charlm.prepare_run(args, f"jax {jax.__version__}")
    if args.layer == "gated-deltanet":
        from flax import nnx

        # The trainable state of the Flax model is a pytree like any other: split it off,
        # differentiate the loss of the model merged back with it.
        graphdef, params = nnx.split(flax_model(init, n_heads=args.heads), nnx.Param)

        def loss(params, inputs, targets):
            logits, _ = nnx.merge(graphdef, params)(inputs)
            return charlm.cross_entropy(logits, targets)

    else:
        params = {name: jnp.asarray(w) for name, w in init.items()}

        def loss(params, inputs, targets):
            return charlm.loss(params, inputs, targets, n_heads=args.heads)

    opt_init, opt_update = adam(args.lr)
    opt_state = opt_init(params)

    @jax.jit
    def train_step(params, opt_state, inputs, targets, lr):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        params, opt_state = opt_update(params, grads, opt_state, lr)
        return params, opt_state, value

    losses: list[float] = []
    progress = charlm.Progress(args.steps)
    start = time.perf_counter()
    data = charlm.batches(train_data, batch=args.batch, context=args.context, seed=args.seed)
    for i, (inputs, targets) in zip(range(args.steps), data):
        lr = jnp.asarray(charlm.learning_rate(i, args.steps, args.lr), jnp.float32)
        params, opt_state, value = train_step(
            params, opt_state, jnp.asarray(inputs), jnp.asarray(targets), lr
        )
        losses.append(float(value))
        progress.update(i + 1, losses[-1])
    seconds = time.perf_counter() - start

    evaluate = jax.jit(loss)
    val = charlm.batches(val_data, batch=args.batch, context=args.context, seed=args.seed + 1)
    val_loss = float(np.mean([float(evaluate(params, x, y)) for _, (x, y) in zip(range(8), val)]))
    first, last = losses[0], float(np.mean(losses[-20:]))
    print(
        f"trained in {seconds:.0f} s ({seconds / args.steps * 1e3:.0f} ms/step, compilation "
        f"included): loss {first:.3f} -> {last:.3f} (train, mean of the last 20), "
        f"{val_loss:.3f} (validation); {last / math.log(2):.2f} bits/char"
    )
    if args.out is not None:
        if args.layer == "gated-deltanet":
            trained = nnx.merge(graphdef, params).weights()
        else:
            trained = params
        weights = {name: np.asarray(w) for name, w in trained.items()}
        write_outputs(args, vocab, weights, losses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
