"""benchmarks/bench_prompts_stream.py at a tiny size: it prints the two rows `make bench` reads
(peak memory ratio and its note with rows/s, per format), each read in a fresh process."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.run_all import BENCHES, parse_row  # noqa: E402


def test_prompts_bench_prints_its_rows(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/bench_prompts_stream.py", "--small", "300", "--large", "3000",
                        "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    for row in BENCHES["prompts"][1]:
        ratio, note = parse_row(row, p.stdout)
        assert isinstance(ratio, float) and 0.5 < ratio < 3, (row.key, p.stdout)
        assert "rows/s" in note and "3,000" in note
    assert not list(tmp_path.iterdir())  # the generated files are gone
