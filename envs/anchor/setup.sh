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
VENV="$HERE/.venv"
STAMP="$VENV/.eaglet-setup-complete"
SPECULATORS="speculators==0.9.0"
PYTHON="${PYTHON:-python3}"
WANT="$SPECULATORS $(sha256sum "$HERE/requirements.txt" | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "envs/anchor: already complete ($WANT) at $VENV; nothing to do"
  exit 0
fi

start=$(date +%s)
if [[ -d "$VENV" ]]; then
  echo "envs/anchor: removing incomplete or different venv at $VENV"
  rm -rf "$VENV"
fi
echo "envs/anchor: creating venv with $($PYTHON --version) at $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch==2.13.0 is the first line of requirements.txt: the CPU wheel on this machine's disk.
echo "envs/anchor: pip install -r requirements.txt (about 1.5 GB, a few minutes)"
"$VENV/bin/pip" install --quiet -r "$HERE/requirements.txt"
echo "envs/anchor: pip install --no-deps $SPECULATORS"
"$VENV/bin/pip" install --quiet --no-deps "$SPECULATORS"

echo "envs/anchor: checking import"
"$VENV/bin/python" -c "import torch, transformers, speculators; \
from speculators.models.eagle3 import Eagle3DraftModel; import speculators.train.cli; \
from importlib.metadata import version; print('speculators', version('speculators'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "$WANT" > "$STAMP"
echo "envs/anchor: done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
