"""Serve the trained character model with NumPy alone: no PyTorch needed.

    python examples/generate_numpy.py runs/torch --prompt "The " --tokens 200

Loads ``DIR/weights.npz`` and ``DIR/vocab.json`` (written by ``char_lm_torch.py``), prefills the
prompt with ``polylin.causal_linear_attention`` (the chunked form, ``return_state=True``) and
decodes greedily with ``polylin.step``, printing the prompt and its continuation (a model trained
with ``--layer gated-deltanet`` runs its Gated DeltaNet blocks with
``polylin.blocks.gated_deltanet`` and ``gated_deltanet_step``: the weights say which). The
model code is the one PyTorch trained (``examples/charlm.py``), here running on NumPy arrays, in
float64 like the sample: for the sample's prompt and 200 tokens this prints exactly
``DIR/sample.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import charlm
import numpy as np


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, charlm.Vocab]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="directory written by char_lm_torch.py --out")
    parser.add_argument(
        "--prompt", default=charlm.PROMPT, help="text to continue (default %(default)r)"
    )
    parser.add_argument(
        "--tokens",
        type=charlm.positive_int,
        default=charlm.SAMPLE_TOKENS,
        help="characters to generate",
    )
    args = parser.parse_args(argv)
    for name in ("weights.npz", "vocab.json"):
        if not (args.dir / name).is_file():
            parser.error(f"DIR {args.dir} has no {name} (train first: char_lm_torch.py --out DIR)")
    vocab = charlm.Vocab.load(args.dir / "vocab.json")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    unknown = vocab.unknown(args.prompt)
    if unknown:
        parser.error(
            f"--prompt has characters outside the model's vocabulary: {''.join(unknown)!r} "
            f"(the vocabulary is in {args.dir / 'vocab.json'})"
        )
    return args, vocab


def main(argv: list[str] | None = None) -> int:
    args, vocab = parse_args(argv)
    weights, n_heads = charlm.load_weights(args.dir / "weights.npz")
    params = {name: w.astype(np.float64) for name, w in weights.items()}
    tokens, _ = charlm.generate(params, vocab.encode(args.prompt), args.tokens, n_heads=n_heads)
    print(args.prompt + vocab.decode(tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
