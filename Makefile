# polylin: the two README commands (`make demo`, `make test`) and their friends.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
CONSTRAINTS = -c backends/torch-cpu-constraints.txt

.PHONY: help venv browser demo test test-slow test-fast lint docs bench gpu-wheels clean

help:
	@echo "make demo   set up .venv (NumPy + CPU PyTorch) and run the demo table"
	@echo "make test   set up .venv with every CPU backend and run lint, types, the docs build and tests"
	@echo "make docs   build the Sphinx site into docs/_build/html (warnings are errors)"
	@echo "make bench  run the CPU benchmark (benchmarks/run.py cpu); writes bench-results/ (JSON + PNG)"
	@echo "make gpu-wheels  fetch the wheels the GPU machine lacks into .whl/ (docs/gpu.md)"

# pip runs with -qq: errors still show, the build backend's notices about editable installs do not.
$(VENV)/bin/python:
	@echo "creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -qq --upgrade pip

# Stamp files: each extra set is installed once, re-installed when pyproject changes.
$(VENV)/.demo-stamp: pyproject.toml backends/torch-cpu-constraints.txt | $(VENV)/bin/python
	@echo "installing polylin with NumPy and CPU PyTorch into $(VENV) (a minute or so the first time)"
	$(PIP) install -qq $(CONSTRAINTS) -e ".[numpy,torch]"
	touch $@

$(VENV)/.test-stamp: pyproject.toml backends/torch-cpu-constraints.txt | $(VENV)/bin/python
	@echo "installing polylin with every CPU backend, test and docs tools into $(VENV) (a few minutes the first time)"
	$(PIP) install -qq $(CONSTRAINTS) -e ".[numpy,torch,strict,jax,flax,dask,cupy,compiled,test,docs,bench,hf]"
	touch $@

venv: $(VENV)/.test-stamp

# Headless Chromium for the docs' browser check (tests/test_docs_site.py skips it without one).
# Debian's package, about 25 s with apt-get update; best effort, bounded in time: where the
# browser is absent and apt-get cannot install it (not root, not Debian, no mirror), a note,
# never a failure.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  echo "installing Debian's chromium for the docs' browser check" && \
	  timeout 300 apt-get update -qq >/dev/null 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq chromium >/dev/null 2>&1; } || \
	echo "chromium is not installed: tests/test_docs_site.py skips its browser check"

demo: $(VENV)/.demo-stamp
	$(PY) -m polylin demo

# The docs are built before pytest: tests/test_docs_site.py reads that site (POLYLIN_DOCS_HTML).
test: $(VENV)/.test-stamp browser
	$(PY) -m ruff check polylin tests benchmarks examples
	$(PY) -m mypy
	POLYLIN_DOCS_OFFLINE=1 $(MAKE) docs
	POLYLIN_DOCS_HTML=$(CURDIR)/docs/_build/html $(PY) -m pytest -n auto -m "not slow"

# The tests marked slow (the full grids of slow_grid tests on JAX, Dask and the GPUs, and a
# few long cases): a separate CI step (.ci/run), in parallel like make test.
test-slow: $(VENV)/.test-stamp
	$(PY) -m pytest -n auto -m slow

test-fast: $(VENV)/.test-stamp
	POLYLIN_BACKENDS=numpy,torch $(PY) -m pytest -x -q -m "not slow"

# -E: a fresh environment every time, so a warning in an unchanged page is never hidden by the
# cache. POLYLIN_DOCS_OFFLINE=1 (set by `make test`) keeps intersphinx off the network; see
# docs/conf.py. The examples on the pages and in docstrings run in `make test` (tests/test_docs.py).
docs: $(VENV)/.test-stamp
	$(PY) -m sphinx -E -W --keep-going -b html docs docs/_build/html

# The benchmarks are not installed with polylin: they run from this folder (benchmarks/README.md).
bench: $(VENV)/.test-stamp
	$(PY) benchmarks/run.py cpu --out bench-results

# What the GPU machine lacks (Python 3.12 there), for backends/gpu-check.sh; see docs/gpu.md.
GPU_WHEELS = array-api-compat==1.16.0 array-api-strict==2.6.1 array-api-extra==0.11.5 fla-core==0.6.0 \
	pytest-xdist==3.8.0 execnet==2.1.2 transformers==5.23.0
gpu-wheels: $(VENV)/bin/python
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) docs/_build docs/api/generated bench-results .pytest_cache .hypothesis .mypy_cache
