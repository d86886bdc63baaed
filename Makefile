# Two commands do everything on a fresh machine with Python 3.11 and make:
#   make demo   create .venv, install chunkvmap and the demo's extra, run the main job
#   make test   create .venv if needed, install the test extras, run the whole suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-device bench bench-device docs diagrams clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The demo needs only its own extra; the suite installs everything (the demo's too).
$(VENV)/.demo: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[tests,bench,demo,equinox,flax,progress,notebooks,docs]"
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(BIN)/python -m chunkvmap.demo

# Two workers (pytest-xdist), the tests dealt to whichever is free: the suite is
# compile-bound and single-threaded per test, so two cores run it in about half the
# time (dealt a file each, the longest files can leave one worker idle at the end).
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --dist load

# NetKet's vmap_chunked is one of the comparators; the benchmarks skip it (and say
# so in their output) when it cannot be installed.
bench: $(VENV)/.installed
	mkdir -p benchmarks/results
	$(BIN)/python -m pip install --quiet netket || echo "NetKet not installed: skipped"
	$(BIN)/python benchmarks/bench_core.py --out benchmarks/results/core.md --plots benchmarks/results
	$(BIN)/python benchmarks/bench_memory.py --out benchmarks/results/memory.md --plots benchmarks/results
	$(BIN)/python benchmarks/bench_sharding.py --out benchmarks/results/sharding.md
	$(BIN)/python benchmarks/bench_compile.py --out benchmarks/results/compile.md
	$(BIN)/python benchmarks/bench_clipping.py --out benchmarks/results/clipping.md
	$(BIN)/python benchmarks/bench_padding.py --out benchmarks/results/padding.md
	$(BIN)/python benchmarks/bench_attribution.py --out benchmarks/results/attribution.md
	$(BIN)/python benchmarks/bench_lds.py --out benchmarks/results/lds.md
	$(BIN)/python benchmarks/bench_attribution_scale.py --n 256 --batch 16 --repeats 2 --peak --out benchmarks/results/attribution_scale.md
	$(BIN)/python benchmarks/bench_curvature.py --out benchmarks/results/curvature.md
	$(BIN)/python benchmarks/bench_statistics.py --out benchmarks/results/statistics.md
	$(BIN)/python benchmarks/bench_families.py --out benchmarks/results/families.md

# On a machine with an accelerator: the headline workloads until jax.vmap runs out of
# memory, within 10 minutes, to benchmarks/results/<platform>.md (tpu.md on a TPU);
# `python benchmarks/device.py --quick` is the CPU smoke test.
bench-device: $(VENV)/.installed
	mkdir -p benchmarks/results
	$(BIN)/python benchmarks/device.py

# The documentation site (mkdocs-material + mkdocstrings), built strictly: any warning
# (a broken link, a docstring mkdocstrings cannot parse) fails the build. Then every
# built page is opened in headless Chromium or Chrome (docs/check_site.py: no console
# error, no broken image, every diagram an SVG): $CHROMIUM, or chromium,
# chromium-browser, google-chrome on the PATH, driven by playwright (the docs extra),
# which downloads no browser. Nothing is installed: without a browser the check is
# skipped with a message saying how to get one (Debian/Ubuntu: apt-get install chromium).
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python docs/check_site.py --skip-without-browser site

# Re-render the diagrams of docs/diagrams/*.mmd to the committed SVGs (needs node/npx
# and Chromium; see CONTRIBUTING.md).
diagrams:
	cd docs/diagrams && for f in *.mmd; do \
	  PUPPETEER_SKIP_DOWNLOAD=1 npx -y @mermaid-js/mermaid-cli@11.17.0 -p puppeteer-config.json \
	    -c mermaid-config.json -b white -i $$f -o $${f%.mmd}.svg || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
