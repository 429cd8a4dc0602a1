"""Running Snakemake on a clone of the repository and reading its dry-run output, for the
workflow tests."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


def smk(cwd: Path, cache: Path, *args, check=True, configfile="config/smoke.yaml"):
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # args (targets, flags) first: after `--cache` a target would be read as a rule name to cache
    # (its nargs is "*"), and the whole DAG would run
    cmd = [sys.executable, "-m", "snakemake", *args, "--cores", "2", "--configfile", configfile, "--cache"]
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
    uncached stages inline: workflow/rules/common.smk, settings)."""
    words = shlex.split(shell)
    return json.loads(words[words.index(flag) + 1])
