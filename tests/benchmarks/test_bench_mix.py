"""benchmarks/bench_mix.py without its runs: the row of `make bench` says "skipped" naming what is
missing; and its validation prompts are the 80 MT-Bench first turns, each one a conversation the
prompts stage keeps. Cheap: no training."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.run_all import BENCHES, parse_row, status  # noqa: E402

from eaglet.data.prompts import build_prompts  # noqa: E402


def test_mix_row_skips_without_its_runs(tmp_path):
    arm = tmp_path / "no-such-run"
    p = subprocess.run([sys.executable, "benchmarks/bench_mix.py", "--arm", f"regenerated={arm}",
                        "--val", str(tmp_path / "no-val")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (row,) = BENCHES["mix"][1]
    ratio, note = parse_row(row, p.stdout)
    assert ratio == "skipped" and status(row, ratio, True) == "skipped"
    assert str(arm) in note and "no-val" in note and "benchmarks/mix" in note


def test_validation_prompts_are_the_mtbench_first_turns(tmp_path):
    out = tmp_path / "mtbench.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_mix.py", "--write-val-prompts", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 80 and len({r["id"] for r in rows}) == 80
    res = build_prompts("file", str(out), n=80, heldout=0, seed=0, max_turns=2)
    assert len(res["train"]) == 80 and res["summary"]["skipped"] == 0
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in res["train"])


def test_a_validation_store_of_answers_not_the_targets_own_is_refused(tmp_path):
    """A --val run made with data.mix < 1 holds the prompts file's placeholder answers (or the
    dataset's), not the target's: scoring on it is refused, naming the fix; a regenerated one passes."""
    from benchmarks.bench_mix import val_stores

    run = tmp_path / "mix-mtval"
    (run / "generate").mkdir(parents=True)
    (run / "extract/shard_0").mkdir(parents=True)
    (run / "extract/shard_0/index.json").write_text("{}")
    summary = run / "generate/generate_summary.json"
    summary.write_text(json.dumps({"regenerated": 0, "original": 80}))
    try:
        val_stores(str(run))
    except SystemExit as e:
        assert "80 answers were not regenerated" in str(e) and "data.mix: 1.0" in str(e), e
    else:
        raise AssertionError("a store of placeholder answers was accepted")
    summary.write_text(json.dumps({"regenerated": 80, "original": 0}))
    assert val_stores(str(run)) == [str(run / "extract/shard_0/index.json")]
