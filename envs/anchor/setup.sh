#!/usr/bin/env bash
# Create envs/anchor/.venv: the speculators library (the EAGLE-3 anchor of
# benchmarks/bench_anchor.py), kept apart from the workflow's venv because its
# declared deps pin another transformers and pull torchaudio/torchvision.
#
# Usage: envs/anchor/setup.sh                  (or: make anchor-env)
#   PYTHON=python3.11 envs/anchor/setup.sh     (interpreter for the venv)
#
# Idempotent: a stamp file records the finished install (requirements.txt's
# digest and the speculators pin); when it matches, the script does nothing. A
# half-finished or outdated venv (no or another stamp) is rebuilt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=envs/venv.sh
source "$HERE/../venv.sh"
VENV="$HERE/.venv"
SPECULATORS="speculators==0.9.0"
PYTHON="${PYTHON:-python3}"
WANT="$SPECULATORS $(sha256sum "$HERE/requirements.txt" | cut -c1-16)"

if venv_complete anchor "$VENV" "$WANT"; then
  exit 0
fi

start=$(date +%s)
venv_fresh anchor "$VENV" "$PYTHON"
# torch==2.13.0 is the first line of requirements.txt: the CPU wheel on this machine's disk.
echo "envs/anchor: pip install -r requirements.txt (about 1.5 GB, a few minutes)"
"$VENV/bin/pip" install --quiet -r "$HERE/requirements.txt"
echo "envs/anchor: pip install --no-deps $SPECULATORS"
"$VENV/bin/pip" install --quiet --no-deps "$SPECULATORS"

echo "envs/anchor: checking import"
"$VENV/bin/python" -c "import torch, transformers, speculators; \
from speculators.models.eagle3 import Eagle3DraftModel; import speculators.train.cli; \
from importlib.metadata import version; print('speculators', version('speculators'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
venv_stamp "$VENV" "$WANT"
echo "envs/anchor: done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
