"""Train the same character language model in JAX: ``jit``, ``grad`` and a few-line Adam.

    python examples/char_lm_jax.py --steps 1000

The model is the one ``char_lm_torch.py`` trains (``examples/charlm.py``, written against the
array API), here on JAX arrays, with polylin's chunked ``causal_linear_attention`` traced inside
``jax.jit`` and differentiated by ``jax.grad``. The defaults are those of the PyTorch script: the
same seed gives the same initial weights and the same batches, so the two loss curves can be laid
on top of each other (``--compare DIR`` plots the PyTorch run's ``losses.csv`` beside this one).

With ``--out DIR`` it writes ``losses.csv`` and ``loss.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

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

    _, train_data, val_data, init = charlm.prepare_run(args, f"jax {jax.__version__}")
    params = {name: jnp.asarray(w) for name, w in init.items()}
    opt_init, opt_update = adam(args.lr)
    opt_state = opt_init(params)

    def loss(params, inputs, targets):
        return charlm.loss(params, inputs, targets, n_heads=args.heads)

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
        args.out.mkdir(parents=True, exist_ok=True)
        charlm.write_losses(args.out / "losses.csv", losses)
        curves = {"JAX": losses}
        if args.compare is not None:
            curves = {"PyTorch": charlm.read_losses(args.compare / "losses.csv"), **curves}
        charlm.plot_losses(args.out / "loss.png", curves)
        print(f"wrote {args.out}/losses.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
