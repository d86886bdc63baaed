# Two commands do everything on a fresh machine with Python 3.11 and make:
#   make demo   create .venv, install chunkvmap, run the main job
#   make test   create .venv if needed, install the test extras, run the whole suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[tests,bench,demo,equinox,flax,progress,notebooks,docs]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m chunkvmap.demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest

# NetKet's vmap_chunked is one of the comparators; the benchmarks skip it (and say
# so in their output) when it cannot be installed.
bench: $(VENV)/.installed
	mkdir -p benchmarks/results
	$(BIN)/python -m pip install --quiet netket || echo "NetKet not installed: skipped"
	$(BIN)/python benchmarks/bench_core.py --out benchmarks/results/core.md --plots benchmarks/results
	$(BIN)/python benchmarks/bench_memory.py --out benchmarks/results/memory.md --plots benchmarks/results
	$(BIN)/python benchmarks/bench_sharding.py --out benchmarks/results/sharding.md
	$(BIN)/python benchmarks/bench_clipping.py --out benchmarks/results/clipping.md

# The documentation site (mkdocs-material + mkdocstrings), built strictly: any warning
# (a broken link, a docstring mkdocstrings cannot parse) fails the build.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
