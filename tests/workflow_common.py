"""Running Snakemake on a clone of the repository and reading its dry-run output, for the
workflow tests."""

import json
import math
import os
import re
import shlex
import subprocess
from pathlib import Path

from conftest import job_path, snakemake_cmd


def smk(cwd: Path, cache: Path, *args, check=True, configfile="config/smoke.yaml"):
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": job_path()}
    # args (targets, flags) first: after `--cache` a target would be read as a rule name to cache
    # (its nargs is "*"), and the whole DAG would run
    cmd = [*snakemake_cmd(), *args, "--cores", "2", "--configfile", configfile, "--cache"]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    if check and p.returncode:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{out[-6000:]}")
    return p.returncode, out


def planned_jobs(out: str) -> set[str]:
    return {line.split()[1].rstrip(":") for line in out.splitlines()
            if line.startswith(("rule ", "localrule "))} - {"all"}


def planned(out: str) -> list[dict]:
    """Snakemake's job blocks from a dry run: rule, wildcards, resources, shell command."""
    jobs = []
    for m in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)+)(?:Shell command: (.*)\n)?", out, re.M):
        body = dict(re.findall(r"^    (\w+): (.*)$", m.group(2), re.M))
        res = dict(kv.split("=", 1) for kv in body.get("resources", "").split(", ") if "=" in kv)
        jobs.append({"rule": m.group(1), "wildcards": body.get("wildcards", ""), "resources": res,
                     "shell": m.group(3) or ""})
    return jobs


def flag_json(shell: str, flag: str):
    """The JSON a planned job's command line hands its stage after ``flag`` (settings reach the
    uncached stages inline: eaglet.workflow.params.settings)."""
    words = shlex.split(shell)
    return json.loads(words[words.index(flag) + 1])


def assert_dag_proved(run: Path, target_config: Path, norm_class: str | None = None) -> None:
    """What a finished DAG run of a target family proves (the families' test and the smoke run's):
    the trainer's label proof (the target's own norm/head/soft-cap against its top-1), the export's
    contract with parity of the drafter against an independent reference forward, the exported RoPE
    derived from the target's own config, and an offline evaluation with a finite chain τ in
    [1, k + 1] for every set it was sent and every k."""
    from eaglet.drafter import rope

    lc = json.loads((run / "train" / "train_summary.json").read_text())["label_check"]
    assert lc["ok"] is True and lc["agreement"] >= 0.99 and lc["judged"] >= 8, lc
    if norm_class:
        assert lc["norm_class"] == norm_class, lc
    contract = json.loads((run / "drafter" / "contract.json").read_text())
    checks = {c["name"]: c for c in contract["checks"]}
    assert contract["ok"] is True, contract.get("failed")
    assert checks["parity.step0"]["ok"] is True, checks["parity.step0"]
    exported = json.loads((run / "drafter" / "config.json").read_text())
    assert exported["rope_parameters"] == rope.drafter_rope(json.loads(target_config.read_text()))
    offline = json.loads((run / "eval" / "offline.json").read_text())
    sets = offline["sets"]
    assert any("heldout" in name for name in sets) and offline["prompts"] == sum(s["prompts"] for s in sets.values())
    for name, s in sets.items():
        assert s["prompts"] >= 1 and sorted(map(int, s["tau_chain"])) == list(range(1, offline["K"] + 1)), name
        for k, tau in s["tau_chain"].items():
            assert math.isfinite(tau) and 1.0 <= tau <= int(k) + 1, (name, k, tau)
