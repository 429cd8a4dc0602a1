"""benchmarks/profile_head.py on a real shard of the tiny target: it plans the trainer's padded
micro-batches, times the three head calls and prints their medians and paired ratios, reading the
other rows at fewer positions than it has tokens (prompt positions left out)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from train_common import hidden_data

ROOT = Path(__file__).resolve().parents[2]


def test_profile_head_times_the_trainers_micro_batches(tiny_target, tmp_path):
    run = tmp_path / "results" / "tiny"
    hidden_data(tiny_target, run / "extract")
    (run / "vocab_map").mkdir()
    shutil.move(run / "extract" / "vocab.safetensors", run / "vocab_map" / "vocab.safetensors")
    p = subprocess.run([sys.executable, "benchmarks/profile_head.py", "--run", str(run), "--identity",
                        str(Path(tiny_target["path"]).parent / "identity.json"), "--tokens", "256",
                        "--batches", "3", "--repeats", "4", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for key in ("draft rows", "draft + other rows", "draft + other rows where read"):
        assert re.search(rf"^{re.escape(key)}: median \d+\.\d+ s .* over 3 repeats$", out, re.M), out
    m = re.search(r"3 micro-batches: (\d+) slots, (\d+) tokens, (\d+) read", out)
    assert m, out
    slots, tokens, read = map(int, m.groups())
    assert 0 < read < tokens <= slots <= 3 * 256, out  # each sample's prompt positions are not read
    assert len(re.findall(r" / .*: \d+\.\d+x \(\d+% interval \d+\.\d+-\d+\.\d+, 3 triples\)", out)) == 3, out
