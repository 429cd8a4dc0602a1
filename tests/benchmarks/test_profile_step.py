"""benchmarks/profile_step.py on a real shard of the tiny target: it times the training step with the
drafter's head at every position against at the counted positions only, prints both medians and
their paired ratio, counts fewer positions than slots, and the two losses agree; and (random batches at
the target's shapes) the TTT attention recomputed against saved."""

import re
import subprocess
import sys
from pathlib import Path

from train_common import tiny_run

ROOT = Path(__file__).resolve().parents[2]


def test_profile_step_times_both_heads_on_the_trainers_micro_batches(tiny_target, tmp_path):
    run = tiny_run(tiny_target, tmp_path / "results")
    p = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--run", str(run), "--identity",
                        str(Path(tiny_target["path"]).parent / "identity.json"), "--tokens", "256",
                        "--batches", "2", "--repeats", "3", "--threads", "1", "--autocast", "off"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for key in ("every position (before)", "counted positions (now)"):
        assert re.search(rf"^{re.escape(key)}: median \d+\.\d+ s .* over 2 repeats$", out, re.M), out
    m = re.search(r"2 micro-batches: (\d+) slots, (\d+) tokens, (\d+) counted .* largest loss difference (\S+)", out)
    assert m, out
    slots, tokens, counted, gap = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert 0 < counted < tokens <= slots and gap < 1e-4, out
    assert re.search(r"every position \(before\) / counted positions \(now\): \d+\.\d+x \(\d+% interval "
                     r"\d+\.\d+-\d+\.\d+, 2 pairs\)", out), out


def test_profile_step_times_the_ttt_attention_recomputed_against_saved(tiny_target):
    """Issue 43: ``--compare attention --synthetic BxT`` (no store) times the step with the TTT
    attention's chunks recomputed against their weights saved, over several query chunks, prints both
    medians and their paired ratio, and the two losses are the same."""
    p = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--compare", "attention", "--synthetic", "2x300",
                        "--draft-vocab", "64", "--identity", str(Path(tiny_target["path"]).parent / "identity.json"),
                        "--batches", "2", "--repeats", "3", "--threads", "1", "--autocast", "off"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for key in ("recompute (before)", "saved (now)"):
        assert re.search(rf"^{re.escape(key)}: median \d+\.\d+ s .* over 2 repeats$", out, re.M), out
    m = re.search(r"2 micro-batches: 1200 slots, 1200 tokens, (\d+) counted .* first 2x300 \(synthetic\).* draft "
                  r"vocab 64, fp32.* largest loss difference (\S+)", out)
    assert m and 0 < int(m[1]) < 1200 and float(m[2]) < 1e-5, out
    assert re.search(r"recompute \(before\) / saved \(now\): \d+\.\d+x \(\d+% interval \d+\.\d+-\d+\.\d+, 2 pairs\)",
                     out), out
