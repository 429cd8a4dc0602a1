"""benchmarks/bench_anchor.py without its optional environment (envs/anchor/.venv): every row of
`make bench` say "skipped" with the reason, through run_all's own parser. Cheap: no training."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.run_all import BENCHES, parse_row, status  # noqa: E402


def test_anchor_rows_skip_without_the_env(tmp_path):
    missing = tmp_path / "no-env/bin/python"
    p = subprocess.run([sys.executable, "benchmarks/bench_anchor.py", "--anchor-python", str(missing)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = BENCHES["anchor"][1]
    assert [r.name for r in rows] == ["anchor_tau", "anchor_tau_t0", "anchor_speed"]
    for row in rows:
        ratio, note = parse_row(row, p.stdout)
        assert ratio == "skipped" and status(row, ratio, True) == "skipped"
        assert str(missing) in note and "make anchor-env" in note
