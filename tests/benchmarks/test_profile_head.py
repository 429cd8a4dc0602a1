"""benchmarks/profile_head.py on a real shard of the tiny target: it plans the trainer's padded
micro-batches, times the trainer's labels from the stored statistics against the other rows'
computation, prints both medians and their paired ratio, and the two masses agree."""

import re
import subprocess
import sys
from pathlib import Path

from train_common import tiny_run

ROOT = Path(__file__).resolve().parents[2]


def test_profile_head_times_the_trainers_micro_batches(tiny_target, tmp_path):
    run = tiny_run(tiny_target, tmp_path / "results")
    p = subprocess.run([sys.executable, "benchmarks/profile_head.py", "--run", str(run), "--identity",
                        str(Path(tiny_target["path"]).parent / "identity.json"), "--tokens", "256",
                        "--batches", "3", "--repeats", "4", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for key in ("stored statistics (now)", "other rows (before)"):
        assert re.search(rf"^{re.escape(key)}: median \d+\.\d+ s .* over 3 repeats$", out, re.M), out
    m = re.search(r"3 micro-batches: (\d+) slots, (\d+) tokens; .* largest mass difference (\S+)", out)
    assert m, out
    slots, tokens, gap = int(m[1]), int(m[2]), float(m[3])
    assert 0 < tokens <= slots <= 3 * 256 and gap < 1e-5, out
    assert re.search(r"other rows \(before\) / stored statistics \(now\): \d+\.\d+x \(\d+% interval "
                     r"\d+\.\d+-\d+\.\d+, 3 pairs\)", out), out
