"""benchmarks/bench_contract_runs.py without a vLLM environment: a clear message naming the install
command, before any target is built. Cheap: no engine."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_vllm_it_names_the_install_command(tmp_path):
    missing = tmp_path / "no-env" / "bin" / "python"
    p = subprocess.run([sys.executable, "benchmarks/bench_contract_runs.py", "--vllm-python", str(missing)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "no vLLM environment" in p.stderr and "make vllm-env" in p.stderr and "Traceback" not in p.stderr
