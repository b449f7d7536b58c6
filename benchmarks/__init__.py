"""polylin's benchmarks: timing, baselines, reports and plots (not installed with polylin).

Run them from a clone: ``python benchmarks/run.py --help`` (or ``make bench``). See
``benchmarks/README.md``.
"""
