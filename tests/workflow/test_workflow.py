"""The DAG on config/smoke.yaml: a full run, then the Snakemake behaviour the project promises —
nothing to do after a run, precise reruns with reasons, the between-workflow cache serving a
second clone, parse-time config errors naming the key, and a clean --lint."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import clone, snakemake_cmd
from workflow_common import assert_dag_proved, planned_jobs, smk

REPO = Path(__file__).resolve().parents[2]



def test_the_smoke_run_proves_its_labels_parity_rope_and_offline_tau(finished_run):
    """The tiny llama target through the whole DAG proves what every family's run proves
    (tests/target/test_target_families.py runs the other families; llama's is this run)."""
    a, _ = finished_run
    assert_dag_proved(a / "results" / "smoke", a / "resources" / "targets" / "tiny-llama" / "model" / "config.json",
                      norm_class="LlamaRMSNorm")


def test_the_run_records_what_the_parse_resolved(finished_run):
    """A run writes logs/<run>/resolved.json when it starts (the Snakefile's onstart), with the
    storage choice and its reason, the layer ids and the autocast and why, and provenance.json holds
    the same record beside the config as written."""
    import json

    from eaglet.base.capability import resolve_autocast

    a, _ = finished_run
    rec = json.loads((a / "logs/smoke/resolved.json").read_text())
    # the first run's parse came before target_model built the target: no size, so as configured
    assert (rec["storage"]["hidden_states"], rec["storage"]["dtype"]) == ("offline", "bfloat16")
    assert rec["storage"]["why"].startswith("storage: no storage.budget_gb: train.hidden_states offline")
    assert rec["layer_ids"] == [2, 4, 5] and rec["layer_ids_why"] == "vLLM's default for the target"
    assert [rec["train_autocast"], rec["train_autocast_why"]] == list(resolve_autocast("auto", on_gpu=False))
    prov = json.loads((a / "results/smoke/provenance.json").read_text())
    assert prov["resolved"] == rec
    assert prov["config"]["train"]["autocast"] == "auto" and prov["config"]["extract"]["target_dtype"] == "auto"


def test_nothing_to_do_after_a_finished_run(finished_run):
    a, cache = finished_run
    _, out = smk(a, cache, "-n")
    assert "Nothing to be done" in out


def _jobs_after_editing(finished_run, module: str) -> tuple[set[str], str]:
    """The jobs `snakemake -n` plans on the finished run once ``module`` is edited (then restored)."""
    a, cache = finished_run
    mod = a / module
    original = mod.read_text()
    try:
        mod.write_text(original + "\n# an edit\n")
        _, out = smk(a, cache, "-n")
        return planned_jobs(out), out
    finally:
        mod.write_text(original)


def test_editing_a_module_reruns_its_stage_and_nothing_upstream(finished_run):
    jobs, out = _jobs_after_editing(finished_run, "src/eaglet/data/vocab.py")
    assert "vocab_map" in jobs
    assert not jobs & {"target_model", "prompts", "tokenize", "token_freq"}
    assert "src/eaglet/data/vocab.py" in out


def test_editing_the_contract_reruns_export_and_what_follows_only(finished_run):
    """The export's contract (its list of check names included) is code of export and of nothing
    before it: not target_model (which hashes the target's weights), prompts, tokenize, extraction
    or training."""
    jobs, out = _jobs_after_editing(finished_run, "src/eaglet/export/contract/record.py")
    assert "export" in jobs and "src/eaglet/export/contract/record.py" in out, out[-3000:]
    assert not jobs & {"target_model", "prompts", "generate", "tokenize", "token_freq", "vocab_map",
                       "extract_hidden_states", "train"}, jobs


def test_second_clone_is_served_from_the_cache(finished_run, tmp_path):
    a, cache = finished_run
    b = clone(tmp_path / "b")
    # The cached stages only (the uncached tail after them would simply run again)
    _, out = smk(b, cache, "results/smoke/vocab_map/vocab.json", "results/smoke/extract/shard_0")
    # Every cached stage was restored from the cache instead of being recomputed: the stage
    # modules log at least one line when they run, and these logs are empty or absent.
    for stage in ("target_model/tiny-llama", "smoke/prompts", "smoke/generate", "smoke/tokenize",
                  "smoke/token_freq", "smoke/vocab_map", "smoke/extract_hidden_states/shard_0"):
        log = b / f"logs/{stage}.log"
        assert not log.exists() or log.stat().st_size == 0, (stage, log.read_text())
        assert (a / f"logs/{stage}.log").stat().st_size > 0, stage  # where it did run, it logged
    vocab = b / "results/smoke/vocab_map/vocab.safetensors"
    assert vocab.is_symlink() and Path(os.readlink(vocab)).parent == cache
    assert (b / "results/smoke/vocab_map/vocab.json").read_text() == \
        (a / "results/smoke/vocab_map/vocab.json").read_text()


@pytest.mark.faults
def test_bad_config_value_fails_at_parse_time_naming_the_key(tmp_path):
    # A fresh clone, not the finished run: the error comes before any DAG, so nothing has to exist.
    a = clone(tmp_path / "a")
    cache = tmp_path / "cache"
    cache.mkdir()
    for section, key, value in [("vocab", "draft_vocab_size", "big"),   # wrong type
                                ("tokenize", "overlong", "cut"),        # not one of the choices
                                ("prompts", "n", -3),                   # out of range
                                ("vocab", "no_such_key", 1),            # unknown key
                                ("train", "ttt_steps", 99),             # above the maximum
                                ("extract", "layer_ids", [2, "four", 6])]:  # wrong item type
        conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
        conf.setdefault(section, {})[key] = value
        (a / "config/bad.yaml").write_text(yaml.safe_dump(conf))
        code, out = smk(a, cache, "-n", check=False, configfile="config/bad.yaml")
        assert code != 0 and "Building DAG" not in out, out[-3000:]
        assert key in out, out[-3000:]


def test_lint_is_clean():
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([*snakemake_cmd(), "--lint", "--configfile", "config/smoke.yaml"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Lints for" not in p.stdout + p.stderr


def test_report_holds_every_plot_and_table_and_renders(finished_run, tmp_path):
    """The HTML report as a reader gets it: every plot and table is in it, and headless Chromium
    renders it without script errors."""
    a, cache = finished_run
    report = a / "results/smoke/report.html"
    smk(a, cache, "--report", str(report))
    html = report.read_text()
    for name in ("coverage.png", "training.png", "tables.html", "provenance.json", "metadata.json",
                 "vocab.json", "summary.json", "tau_per_position.png", "tau_per_k.png", "speedup_vs_k.png",
                 "train_summary.json", "contract.json"):
        assert name in html, name
    prov = __import__("json").loads((a / "results/smoke/provenance.json").read_text())
    assert prov["versions"]["torch"] and prov["hardware"]["cores"] and prov["target"]["digest"]
    assert prov["config"]["run"] == "smoke" and prov["config"]["vocab"]["draft_vocab_size"] == 1024
    assert {r["rule"] for r in prov["stage_wall_times"]} >= {"tokenize", "train", "export"}

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (make test installs it: make test-deps)")
    p = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", f"--user-data-dir={tmp_path / 'chrome'}", "--enable-logging=stderr",
                        "--v=0", "--virtual-time-budget=5000", "--dump-dom", report.as_uri()],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    console_errors = [line for line in p.stderr.splitlines()
                      if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]
    assert not console_errors, console_errors[:5]
    # The report is a script-built page: the rendered DOM must be much more than the bare shell,
    # and show the workflow's own categories.
    assert len(p.stdout) > 10_000 and "Data" in p.stdout


def test_summary_prints_the_measured_table_from_the_artifacts(finished_run):
    """`python -m eaglet.workflow.summary results/<run>` (what `make run` ends with, pasted into docs/measurements.md):
    one row per stage made of that stage's artifact, wall times from provenance.json; a wrong run
    folder is a clear error."""
    import json

    a, _ = finished_run
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    p = subprocess.run([sys.executable, "-m", "eaglet.workflow.summary", "results/smoke"], cwd=a, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {ln.split("|")[1].strip(): ln for ln in p.stdout.splitlines() if ln.startswith("| ")}
    stages = {"target", "generate", "tokenize / vocab", "extract", "train", "export", "evaluate", "**total**"}
    assert stages <= set(rows), rows
    run = a / "results" / "smoke"
    meta = json.loads((run / "tokenize/metadata.json").read_text())
    gen = json.loads((run / "generate/generate_summary.json").read_text())
    contract = json.loads((run / "drafter/contract.json").read_text())
    tokens = f"{meta['total_tokens']:,} tokens"
    assert tokens in rows["tokenize / vocab"] and tokens in rows["extract"]
    assert f"{gen['completion_tokens']:,} completion tokens" in rows["generate"]
    # the smoke config turns the real-vLLM checks off: the row names them as not run, not as passed
    assert "contract passed" in rows["export"] and all(x["name"] in rows["export"] for x in contract["not_run"])
    assert "lossless: HF loop yes" in rows["evaluate"]
    prov = json.loads((run / "provenance.json").read_text())
    train_s = sum(t["seconds"] for t in prov["stage_wall_times"] if t["rule"] == "train")
    assert rows["train"].rstrip(" |").endswith(f"{train_s:.0f} s") or "min" in rows["train"], rows["train"]
    p = subprocess.run([sys.executable, "-m", "eaglet.workflow.summary", "results/nope"], cwd=a, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no such run folder" in p.stderr


def test_learning_curve_adds_its_trainings_and_states_tau_and_costs(finished_run):
    """plan.learning_curve on a finished run: `snakemake -n` plans the two fraction trainings and
    the fit, not the full training again; run, the fit's points, predictions and check are in
    learning_curve.json, eval/summary.json and the summary table. (Last in the module: the run is
    put back to the smoke config at the end.)"""
    import json

    a, cache = finished_run
    conf = yaml.safe_load((a / "config/smoke.yaml").read_text())
    # require_check false: on 3 validation sequences of a random tiny model the check may go either way
    conf["plan"] = {"learning_curve": True, "require_check": False}
    (a / "config/lc.yaml").write_text(yaml.safe_dump(conf))
    try:
        _, out = smk(a, cache, "-n", configfile="config/lc.yaml")
        jobs = planned_jobs(out)
        assert {"train_fraction", "learning_curve", "eval_summary"} <= jobs
        assert not jobs & {"train", "extract_hidden_states", "generate", "tokenize"}
        assert out.count("rule train_fraction:") == 2
        smk(a, cache, configfile="config/lc.yaml")
        r = json.loads((a / "results/smoke/learning_curve/learning_curve.json").read_text())
        full = json.loads((a / "results/smoke/train/train_summary.json").read_text())
        assert [p["fraction"] for p in r["points"]] == [0.25, 0.5, 1.0]
        assert r["points"][-1]["tokens"] == r["tokens_now"] == full["train_tokens"]
        assert r["points"][0]["tokens"] < r["points"][1]["tokens"] < r["tokens_now"]
        assert r["tau_now"] == pytest.approx(full["selected"]["val_chain_tau"])
        assert [p["multiplier"] for p in r["predictions"]] == [2, 10, 100]
        for p in r["predictions"]:
            assert 1.0 <= p["interval"][0] <= p["tau"] <= p["interval"][1] <= 1 + full["params"]["ttt_steps"]
            assert p["cost"]["train_hours"] > 0 and p["cost"]["hidden_gb"] > 0
        assert r["check"]["status"] in ("pass", "fail") and r["check"]["fitted_on"] == [0.25, 0.5]
        summary = json.loads((a / "results/smoke/eval/summary.json").read_text())
        assert summary["learning_curve"]["tau_now"] == r["tau_now"]
        from eaglet.workflow.summary import table

        assert any(line.startswith("| learning curve | validation chain τ now") for line in table(a / "results/smoke"))
    finally:
        smk(a, cache)  # back to the smoke config's outputs for anything after
