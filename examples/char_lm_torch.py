"""Train a small character language model in PyTorch with polylin's linear attention.

    python examples/char_lm_torch.py --steps 1000 --out runs/torch
    python examples/char_lm_torch.py --steps 1000 --layer gated-deltanet --out runs/gdn

The model (``examples/charlm.py``: embedding, pre-norm blocks of multi-head causal linear
attention and an MLP, RMSNorm, tied output head) trains on this project's README and docs pages,
with a progress bar showing the loss. Every attention layer calls
``polylin.causal_linear_attention`` (the chunked form) on ``(batch, heads, T, d_head)`` tensors;
with ``--layer gated-deltanet`` every block's attention is a Gated DeltaNet block instead (the
parameters of ``polylin.torch.GatedDeltaNet``, under its names), on
``polylin.delta_rule_attention``.

It writes to ``--out``:

- ``weights.npz``: the parameters as plain NumPy arrays (and ``n_heads``);
- ``vocab.json``: the characters;
- ``sample.txt``: the prompt ``"The "`` and its greedy continuation of 200 characters, produced
  by prefilling the prompt with the chunked form and decoding with ``polylin.step``, in float64
  (``generate_numpy.py`` prints the same text from the weights with NumPy alone);
- ``losses.csv`` and ``loss.png`` (with matplotlib): the training loss per step.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import charlm
import numpy as np
import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    charlm.add_training_arguments(parser)
    args = parser.parse_args(argv)
    charlm.check_training_arguments(parser, args)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab, train_data, val_data, init = charlm.prepare_run(args, f"torch {torch.__version__}")
    params = {name: torch.tensor(w, requires_grad=True) for name, w in init.items()}
    print(f"parameters: {sum(w.size for w in init.values()):,}")
    optimizer = torch.optim.Adam(params.values(), lr=args.lr)

    losses: list[float] = []
    progress = charlm.Progress(args.steps)
    start = time.perf_counter()
    data = charlm.batches(train_data, batch=args.batch, context=args.context, seed=args.seed)
    for i, (inputs, targets) in zip(range(args.steps), data):
        for group in optimizer.param_groups:
            group["lr"] = charlm.learning_rate(i, args.steps, args.lr)
        value = charlm.loss(
            params, torch.from_numpy(inputs), torch.from_numpy(targets), n_heads=args.heads
        )
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        losses.append(value.item())
        progress.update(i + 1, losses[-1])
    seconds = time.perf_counter() - start

    with torch.no_grad():
        val = charlm.batches(val_data, batch=args.batch, context=args.context, seed=args.seed + 1)
        val_losses = [
            charlm.loss(params, torch.from_numpy(x), torch.from_numpy(y), n_heads=args.heads)
            for _, (x, y) in zip(range(8), val)
        ]
    val_loss = float(torch.stack(val_losses).mean())
    first, last = losses[0], float(np.mean(losses[-20:]))
    print(
        f"trained in {seconds:.0f} s ({seconds / args.steps * 1e3:.0f} ms/step): loss "
        f"{first:.3f} -> {last:.3f} (train, mean of the last 20), {val_loss:.3f} (validation); "
        f"{last / math.log(2):.2f} bits/char"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    weights = {name: w.detach().numpy() for name, w in params.items()}
    charlm.save_weights(args.out / "weights.npz", weights, n_heads=args.heads)
    vocab.save(args.out / "vocab.json")
    charlm.write_losses(args.out / "losses.csv", losses)
    charlm.plot_losses(args.out / "loss.png", {"PyTorch": losses})

    # Generation in float64, so that NumPy (or any library) reproduces the argmax exactly.
    params64 = {name: torch.from_numpy(w.astype(np.float64)) for name, w in weights.items()}
    prompt = torch.from_numpy(vocab.encode(charlm.PROMPT))
    with torch.no_grad():
        tokens, margin = charlm.generate(params64, prompt, charlm.SAMPLE_TOKENS, n_heads=args.heads)
    sample = charlm.PROMPT + vocab.decode(tokens)
    (args.out / "sample.txt").write_text(sample + "\n", encoding="utf-8")
    print(f"sample (greedy, float64; smallest top-2 logit gap {margin:.1e}):")
    print(sample)
    print(f"wrote {args.out}/weights.npz, vocab.json, sample.txt, losses.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
