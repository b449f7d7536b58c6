"""The benchmark behind ``python -m polylin bench`` (placeholder until the benchmark lands)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the benchmark's flags on ``parser`` and set its entry point."""
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark."""
    print("benchmark not implemented yet")
    return 1
