#!/usr/bin/env bash
# The GPU check: the whole DAG of config/config.yaml (SmolLM2-135M) on one GPU in about 10 minutes,
# then one table of measured figures. The first thing to run on a GPU machine.
#
#   scripts/gpu-check.sh              # run it; exit status non-zero on any failure
#   scripts/gpu-check.sh --dry-run    # print every command it would run, run none
#
# Steps: the workflow venv (make venv), the GPU vLLM build (make vllm-env VLLM_PACKAGE=vllm) and
# SGLang's loader for the export contract (make sglang-env),
# which the 10 minutes do not count; then, from scratch, Snakemake on config/config.yaml +
# config/gpu-check.yaml with --resources gpu=1 (bf16 extraction, training through torchrun, vLLM
# serving generation, the export contract's real vLLM load of the drafter, evaluation with vLLM);
# then benchmarks/bench_extract.py on the run's own tokens (extraction ÷ bare forward, same
# batches); then `python -m eaglet.workflow.summary` and scripts/gpu_check_table.py (extraction tok/s ÷
# bare forward, training tok/s, vLLM τ and speedup).
# Environment: GPU_CHECK_MINUTES (10): the DAG's time limit; CORES (8): snakemake --cores.
set -euo pipefail

DRY=0
case "${1:-}" in
    --dry-run|-n) DRY=1 ;;
    "") ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$1' (--dry-run, --help)" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RUN=gpu-check
MINUTES=${GPU_CHECK_MINUTES:-10}
CORES=${CORES:-8}
BIN=.venv/bin
CONFIGS=(config/config.yaml config/gpu-check.yaml)
IDENTITY=resources/targets/smollm2-135m-instruct/identity.json
BENCH_OUT=results/$RUN/bench_extract.txt

# Print a command (copy-pastable, "+ " first), then run it unless --dry-run.
run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    if [ "$DRY" = 0 ]; then "$@"; fi
}

# As run(), stdout also to a file (the benchmark's output, read back for the table).
run_tee() {
    local out=$1; shift
    printf '+'
    printf ' %q' "$@"
    printf ' | tee %q\n' "$out"
    if [ "$DRY" = 0 ]; then "$@" | tee "$out"; fi
}

fail() { echo "gpu-check.sh: FAILED: $*" >&2; exit 1; }

if [ "$DRY" = 0 ]; then
    command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this is not a GPU machine"
fi
run nvidia-smi -L

# The environments (not timed): the workflow's venv and the GPU vLLM build in envs/vllm/.venv.
# No --cache below: a cache hit would skip the work being measured.
run make venv
run make vllm-env VLLM_PACKAGE=vllm
run make sglang-env

# From scratch: a previous check's outputs would make Snakemake skip the work being measured.
run rm -rf "results/$RUN" "logs/$RUN"
start=$(date +%s)
run env HF_HUB_OFFLINE=1 timeout -k 30 "$((MINUTES * 60))" "$BIN/snakemake" --cores "$CORES" \
    --resources gpu=1 --configfile "${CONFIGS[@]}" --printshellcmds \
    || fail "the DAG failed or ran past $MINUTES minutes (logs/$RUN/)"
wall=$(( $(date +%s) - start ))

# Extraction ÷ bare forward of the same model on the run's own tokens (bf16 on the GPU).
run_tee "$BENCH_OUT" "$BIN/python" benchmarks/bench_extract.py --identity "$IDENTITY" \
    --tokens "results/$RUN/tokenize/tokens.parquet" --dtype bfloat16 --device cuda

run "$BIN/python" -m eaglet.workflow.summary "results/$RUN"
run "$BIN/python" scripts/gpu_check_table.py "results/$RUN" "$BENCH_OUT" --wall-s "$wall" \
    || fail "a measured figure is missing or failed (above)"
if [ "$DRY" = 0 ]; then echo "gpu-check.sh: passed"; fi
