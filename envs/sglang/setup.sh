#!/usr/bin/env bash
# Create envs/sglang/.venv: SGLang's EAGLE-3 drafter class (LlamaForCausalLMEagle3) and its
# load_weights, run in-process on the CPU by the export contract's loader.sglang check
# (eaglet.export.contract.sglang_check). Kept apart from the workflow's venv: SGLang pins its own
# transformers, and its declared deps are a CUDA serving stack that cannot serve on this CPU anyway.
#
# Usage: envs/sglang/setup.sh                  (or: make sglang-env)
#   PYTHON=python3.11 envs/sglang/setup.sh     (interpreter for the venv)
#
# Idempotent: a stamp file records the finished install (the sglang and torch pins and
# requirements.txt's digest); when it matches, the script does nothing. A half-finished or
# outdated venv (no or another stamp) is rebuilt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=envs/venv.sh
source "$HERE/../venv.sh"
VENV="$HERE/.venv"
SGLANG="sglang==0.5.23"
# the CPU wheel on this machine's disk; unpinned, pip pulls a multi-GB CUDA build
TORCH="torch==2.13.0"
PYTHON="${PYTHON:-python3}"
WANT="$SGLANG $TORCH $(sha256sum "$HERE/requirements.txt" | cut -c1-16)"

if venv_complete sglang "$VENV" "$WANT"; then
  exit 0
fi

start=$(date +%s)
venv_fresh sglang "$VENV" "$PYTHON"
echo "envs/sglang: pip install $TORCH"
"$VENV/bin/pip" install --quiet "$TORCH"
# --no-deps: requirements.txt is the whole closure the drafter class imports (see its header)
echo "envs/sglang: pip install --no-deps -r requirements.txt $SGLANG"
"$VENV/bin/pip" install --quiet --no-deps -r "$HERE/requirements.txt" "$SGLANG"

echo "envs/sglang: checking SGLang's loader on a one-rank CPU process group"
"$VENV/bin/python" "$HERE/../../src/eaglet/engines/sglang_loader_runner.py" --selftest
venv_stamp "$VENV" "$WANT"
echo "envs/sglang: done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
