"""Run polylin's benchmarks from a clone: ``python benchmarks/run.py {cpu,gpu,dask,feature-maps}``.

- ``cpu``: implementations x backends x sequence lengths on the CPU (JSON + PNG; ``make bench``);
- ``gpu``: the GPU run against fla, SDPA and the seed loop (JSON + PNG; backends/gpu-check.sh);
- ``dask``: the scale-out run on local Dask clusters of 1 and 2 workers (JSON);
- ``feature-maps``: feature-map approximation errors and backward memory (tables).

Each subcommand has ``--help``. The benchmarks are not part of the installed package: they
import polylin from the environment (an editable install of this clone, or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cpu, dask_scaleout, gpu
from benchmarks.timing import apply_allocator_regime


def parser() -> argparse.ArgumentParser:
    """The command line of ``benchmarks/run.py``."""
    top = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = top.add_subparsers(dest="command", metavar="{cpu,gpu,dask,feature-maps}")
    cpu.add_arguments(sub.add_parser("cpu", help="CPU sweep (JSON + PNG)"))
    gpu.add_arguments(sub.add_parser("gpu", help="GPU run vs fla, SDPA, seed loop (JSON + PNG)"))
    dask_scaleout.add_arguments(sub.add_parser("dask", help="Dask scale-out run (JSON)"))
    sub.add_parser(
        "feature-maps", help="feature-map approximation and backward memory", add_help=False
    )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the chosen benchmark."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["feature-maps"]:  # its own sub-commands and flags
        from benchmarks import feature_maps

        return feature_maps.main(argv[1:])
    args = parser().parse_args(argv)
    apply_allocator_regime()  # a worker of benchmarks/threads.py in the glibc regime
    if args.command is None:
        parser().print_help()
        return 0
    args.argv = argv[1:]
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
