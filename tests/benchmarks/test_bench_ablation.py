"""benchmarks/bench_ablation.py --losses on the tiny in-process target (--quick): the one command of
issue 32's ablation prints its tables (T = 0; T = 1 expected, and measured by the HF loop) with every
objective and seed, and the verdict, from real training runs (a few seconds each)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_losses_ablation_prints_both_temperatures_and_a_verdict(tmp_path):
    out = tmp_path / "ablation.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_ablation.py", "--quick", "--losses", "--seeds", "0", "1",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    t0, t1 = p.stdout.split("\nT = 0:", 1)[1].split("\nT = 1:", 1)
    for table in (t0, t1):
        rows = {line.split()[0] for line in table.splitlines()[3:] if line.startswith(("baseline", "loss="))}
        assert rows == {"baseline", "loss=kl", "loss=lk_lambda", "loss=lk_alpha"}, table
    assert "\nwinner: " in p.stdout
    res = json.loads(out.read_text())
    runs = res["runs"]
    # each run was scored at both temperatures; lk_alpha trains another drafter than soft CE
    assert all(0 < r["exp_tau"] and r["chain_tau"] >= 1 for by_seed in runs.values() for r in by_seed.values())
    assert runs["loss=lk_alpha"]["0"]["exp_tau"] != runs["baseline"]["0"]["exp_tau"]
    assert runs["loss=kl"]["0"]["exp_tau"] == runs["baseline"]["0"]["exp_tau"]  # the same gradient
    assert res["table_t1"]["loss=lk_alpha"]["spread"] >= 0
    # and measured by the HF loop's real speculative sampling at T = 1 (the tiny target's rounds)
    assert "\nT = 1 measured: the HF loop" in p.stdout
    assert all(r["hf_tau"] >= 1 and r["hf_rounds"] > 0 and len(r["hf_per_prompt"]) == 2
               for by_seed in runs.values() for r in by_seed.values())
    assert set(res["table_hf"]) == set(runs)
    # and the offline expected τ at T = 1 under each rule vLLM serves, one table each (issue 43)
    for rule in ("greedy", "probabilistic"):
        assert f"\nT = 1 offline, vLLM draft_sample_method {rule}: expected tau" in p.stdout
        assert all(1 <= r[f"exp_tau_{rule}"] <= 1 + 3 for by_seed in runs.values() for r in by_seed.values())
        assert set(res[f"table_{rule}"]) == set(runs)


def test_the_learning_curve_fits_a_gain_per_doubling_at_both_temperatures(tmp_path):
    """--curve trains the base params on a nested fraction and on all the data and fits τ on log2
    tokens per temperature; the fit is recomputed here from the JSON it wrote."""
    import math

    out = tmp_path / "curve.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_ablation.py", "--quick", "--curve", "0.5", "--seeds", "0",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    half, full = runs["data_fraction=0.5"]["0"], runs["baseline"]["0"]
    assert 0 < half["train_tokens"] < full["train_tokens"]
    for key, what in (("chain_tau", "T = 0"), ("exp_tau", "T = 1")):
        block = p.stdout.split(f"learning curve, {what}", 1)[1]
        gain = (full[key] - half[key]) / (math.log2(full["train_tokens"]) - math.log2(half["train_tokens"]))
        assert f"gain per doubling {gain:+.4f}" in block, block
