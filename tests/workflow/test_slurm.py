"""The workflow on a real one-node SLURM cluster (scripts/slurm/start.sh: Debian's slurm-wlm and
munge, installed when missing): the smoke workflow with `--workflow-profile workflow/profiles/slurm`
gives byte-identical results to a local run, every rule goes out as its own sbatch job carrying
the resources Snakemake declared for it, and the GPU rules' requests (`--gpus=N`) reach sbatch,
which this GPU-less node refuses, so they are checked at submission and never run. Multi-node
training's launch (one srun of torchrun per node, c10d rendezvous on the first node) runs for real
on the one node with 2 gloo ranks, and must train what one process does.

Skipped only when SLURM cannot be had here (no apt-get, not root). Several minutes on 2 cores.
"""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from conftest import clone
from eaglet.base.tensors import load_tensors
from eaglet.planner.gpu_slots import train_launch
from train_common import PARAMS, hidden_data, train_cmd

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "slurm"
RUN = "results/smoke"
# Run time budget of one snakemake call; `timeout -k` because a plain TERM leaves the SLURM
# executor waiting on its jobs.
SMK_TIMEOUT_S = 1500

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory):
    """A real shard of the tiny target's hidden states and a vocab map (as test_train's)."""
    return hidden_data(tiny_target, tmp_path_factory.mktemp("hidden"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A one-node cluster for this module; stopped (by PID) and its state removed at the end."""
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("SLURM cannot be had here: no slurmctld and no apt-get to install slurm-wlm")
    # Not pytest's tmp_path: its 0700 parents keep out the slurm user slurmctld runs as.
    state = Path(tempfile.mkdtemp(prefix="eaglet-slurm-"))
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    p = subprocess.run([SCRIPTS / "start.sh", state], env=env, capture_output=True, text=True,
                       timeout=600)
    if p.returncode == 2:  # start.sh: SLURM cannot be installed here
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(f"SLURM cannot be had here: {p.stderr.strip().splitlines()[-1]}")
    try:
        assert p.returncode == 0, f"start.sh failed:\n{p.stdout}\n{p.stderr}"
        yield {"SLURM_CONF": str(state / "slurm.conf"), "state": state}
    finally:
        subprocess.run([SCRIPTS / "stop.sh", state], capture_output=True, timeout=120)
        pids = [f.read_text() for f in state.glob("*.pid")]
        shutil.rmtree(state, ignore_errors=True)
    assert not pids, f"stop.sh left PID files: {pids}"


def smk_cmd(targets: list[str], *args, configfile="config/smoke.yaml") -> list[str]:
    # targets first: several options take any number of values and would swallow them
    return ["timeout", "-k", "15", str(SMK_TIMEOUT_S), sys.executable, "-m", "snakemake", *targets,
            "--configfile", configfile, *args]


def smk_env(extra=None) -> dict:
    return {**os.environ, **(extra or {}),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


# The SLURM run's declared resources: distinct per rule, so a mix-up shows. The node has 2 CPUs
# and ~24 GB; the profile's defaults (8 GB, GPU-sized set-resources) are for real clusters and
# are replaced wholesale by these command-line values.
SLURM_ARGS = ["--workflow-profile", "workflow/profiles/slurm", "--cores", "2",
              "--slurm-status-command", "squeue",  # no slurmdbd: sacct fails, the plugin would wait forever
              "--seconds-between-status-checks", "1", "--slurm-init-seconds-before-status-checks", "1",
              "--slurm-keep-successful-logs", "--slurm-no-account",
              "--default-resources", "mem_mb=1000", "runtime=10",
              "--set-resources", "target_model:mem_mb=3000", "tokenize:mem_mb=1500", "token_freq:runtime=7",
              "--set-threads", "token_freq=2"]


def workflow_rules(cwd: Path) -> set[str]:
    p = subprocess.run([sys.executable, "-m", "snakemake", "--list-rules", "--configfile",
                        "config/smoke.yaml"], cwd=cwd, env=smk_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return {line.strip() for line in p.stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def runs(cluster, finished_run, tmp_path_factory):
    """The smoke workflow's first stages run on SLURM; the local reference is the session's finished
    smoke run (conftest.finished_run, the same configuration run locally from scratch)."""
    root = tmp_path_factory.mktemp("slurm_runs")
    local, remote = finished_run[0], clone(root / "slurm")
    rules = workflow_rules(remote)
    # vocab_map's output, plus the extraction shards when the workflow has them (they feed the
    # training job whose GPU request is checked below). Not the whole DAG: export's vLLM check
    # and evaluation would make this run far longer than the point it proves.
    smoke = yaml.safe_load((REPO / "config/smoke.yaml").read_text())
    assert "extract_hidden_states" in rules, "rule extract_hidden_states is missing from the workflow"
    targets = [f"{RUN}/vocab_map/vocab.json"]
    targets += [f"{RUN}/extract/shard_{i}" for i in range(smoke.get("extract", {}).get("shards", 1))]
    slurm_p = subprocess.run(smk_cmd(targets, *SLURM_ARGS), cwd=remote,
                             env=smk_env({"SLURM_CONF": cluster["SLURM_CONF"]}),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert slurm_p.returncode == 0, f"SLURM run failed (rc {slurm_p.returncode}):\n{slurm_p.stdout[-8000:]}"
    jobs = scontrol_jobs(cluster["SLURM_CONF"])
    return {"local": local, "slurm": remote, "out": slurm_p.stdout, "jobs": jobs, "rules": rules,
            "targets": targets}


def scontrol_jobs(slurm_conf: str) -> dict[str, dict]:
    """Every job the controller still knows (MinJobAge=3600 keeps finished ones), by job id."""
    p = subprocess.run(["scontrol", "show", "job", "-o"], env=smk_env({"SLURM_CONF": slurm_conf}),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    jobs = {}
    for line in p.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in fields:
            jobs[fields["JobId"]] = fields
    return jobs


def declared_jobs(out: str) -> dict[str, dict]:
    """Snakemake's own job blocks from a run's output: by Snakemake job id, the rule, wildcards,
    threads and resources it declared."""
    blocks = {}
    for m in re.finditer(r"^(local)?rule (\w+):\n((?:    .*\n)+)", out, re.M):
        body = dict(re.findall(r"^    (\w+): (.*)$", m.group(3), re.M))
        res = dict(kv.split("=", 1) for kv in body.get("resources", "").split(", ") if "=" in kv)
        blocks[body["jobid"]] = {"rule": m.group(2), "local": bool(m.group(1)),
                                 "wildcards": body.get("wildcards", ""),
                                 "output": [o for o in body.get("output", "").split(", ") if o],
                                 "threads": int(body.get("threads", 1)), "resources": res}
    return blocks


def test_each_rule_is_its_own_slurm_job_with_its_declared_resources(runs):
    declared = declared_jobs(runs["out"])
    submitted = dict(re.findall(r"^Job (\d+) has been submitted with SLURM jobid (\d+)", runs["out"], re.M))
    remote = {jid: d for jid, d in declared.items() if not d["local"] and d["rule"] != "all"}
    assert {"target_model", "prompts", "tokenize", "token_freq", "vocab_map"} <= {d["rule"] for d in remote.values()}
    # one sbatch per Snakemake job, and never one SLURM job for two of them
    assert set(submitted) == set(remote), (sorted(submitted), sorted(remote))
    assert len(set(submitted.values())) == len(submitted)
    for jid, d in remote.items():
        sj = runs["jobs"][submitted[jid]]
        # the plugin names jobs and log folders by the wildcard values joined with "_"
        wc = "_".join(kv.split("=", 1)[1] for kv in d["wildcards"].split(", ")) if d["wildcards"] else ""
        want_comment = f"rule_{d['rule']}" + (f"_wildcards_{wc}" if wc else "")
        assert sj["Comment"] == want_comment, (d, sj["Comment"])
        assert sj["JobState"] == "COMPLETED" and sj["ExitCode"] == "0:0", (d["rule"], sj["JobState"])
        assert sj["MinMemoryNode"] == f"{d['resources']['mem_mb']}M", (d["rule"], sj["MinMemoryNode"])
        assert sj["TimeLimit"] == f"00:{int(d['resources']['runtime']):02d}:00", (d["rule"], sj["TimeLimit"])
        assert int(sj["NumCPUs"]) == d["threads"], (d["rule"], sj["NumCPUs"], d["threads"])
        # the plugin's per-job log, where the job's own Snakemake ran the rule
        log = runs["slurm"] / f".snakemake/slurm_logs/rule_{d['rule']}"
        log = log / wc if wc else log
        assert (log / f"{submitted[jid]}.log").exists(), log
    # the overrides really differ, so the comparison above can tell rules apart
    by_rule = {d["rule"]: d for d in remote.values()}
    assert by_rule["tokenize"]["resources"]["mem_mb"] == "1500"
    assert by_rule["token_freq"]["threads"] == 2 and by_rule["token_freq"]["resources"]["runtime"] == "7"


def _json_without_clock(path: Path):
    """A JSON artifact minus wall-clock fields (timings, dates): everything else must match."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()
                    if not re.search(r"(^|_)(time|seconds|elapsed|wall|date|timestamp|host)(_|$)|_s$", k)}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip(json.loads(path.read_text()))


def output_files(root: Path, outputs: list[str]) -> list[Path]:
    """The files of the rules' declared outputs (directory outputs: every file inside). Work
    folders (generate's Parquet parts, written on a timer) are not results."""
    files = []
    for o in outputs:
        p = root / o
        files += [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    return sorted(f.relative_to(root) for f in files if f.name != ".snakemake_timestamp")


def test_slurm_results_identical_to_a_local_run(runs):
    local, remote = runs["local"], runs["slurm"]
    outputs = [o for d in declared_jobs(runs["out"]).values() if d["rule"] != "all" for o in d["output"]]
    files = output_files(local, outputs)
    assert Path(f"{RUN}/vocab_map/vocab.json") in files and Path(f"{RUN}/tokenize/tokens.parquet") in files
    assert files == output_files(remote, outputs)
    differing = []
    for f in files:
        a, b = local / f, remote / f
        if a.read_bytes() == b.read_bytes():
            continue
        if f.suffix == ".json" and _json_without_clock(a) == _json_without_clock(b):
            continue
        differing.append(str(f))
    assert not differing, f"SLURM and local results differ: {differing}"


def _gpu_submission(runs, cluster, name, conf_edit, target):
    """Ask SLURM for a GPU rule's job with the slurm profile's own resources: the node has no
    GPUs, so sbatch refuses it, and the refused sbatch line is what the plugin requested.
    The target must not exist yet: a forced rerun would delete finished outputs first."""
    wd = runs["slurm"]
    conf = yaml.safe_load((wd / "config/smoke.yaml").read_text())
    for section, values in conf_edit.items():
        conf.setdefault(section, {}).update(values)
    (wd / f"config/{name}.yaml").write_text(yaml.safe_dump(conf))
    args = ["--workflow-profile", "workflow/profiles/slurm", "--slurm-status-command", "squeue",
            "--slurm-no-account", "--slurm-init-seconds-before-status-checks", "1"]
    cmd = smk_cmd([target], *args, configfile=f"config/{name}.yaml")
    p = subprocess.run(cmd, cwd=wd, env=smk_env({"SLURM_CONF": cluster["SLURM_CONF"]}),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.returncode != 0, "a GPU job was accepted by a node without GPUs?"
    calls = re.findall(r"^\s*(sbatch --parsable .*)$", p.stdout, re.M)
    # GPUs this node lacks; or, asked for two nodes, nodes it lacks
    assert re.search(r"Invalid generic resource|Node count specification invalid|Requested node configuration",
                     p.stdout), p.stdout[-4000:]
    return calls


def test_extraction_shard_requests_its_gpus_from_slurm(runs, cluster):
    assert "extract_hidden_states" in runs["rules"], "rule extract_hidden_states is missing from the workflow"
    # a second shard: a job that has not run yet, so nothing finished is touched
    calls = _gpu_submission(runs, cluster, "gpu_extract", {"extract": {"shards": 2, "gpus_per_shard": 1}},
                            f"{RUN}/extract/shard_1")
    assert len(calls) == 1, calls
    call = calls[0]
    assert "--comment rule_extract_hidden_states_wildcards_1" in call
    assert "--gpus=1" in call
    # the profile's per-rule sizes
    assert "--cpus-per-gpu=8" in call and "--mem 256000" in call and "-t 720" in call


def test_training_requests_all_its_gpus_as_one_job(runs, cluster):
    assert {"train", "extract_hidden_states"} <= runs["rules"], f"rules missing from the workflow: {runs['rules']}"
    calls = _gpu_submission(runs, cluster, "gpu_train", {"train": {"gpus": 2}},
                            f"{RUN}/train/train_summary.json")
    # train's upstream (vocab_map, extraction) finished in the SLURM run: only train is asked for
    assert len(calls) == 1, calls
    assert "--comment rule_train" in calls[0] and "--gpus=2" in calls[0]
    assert "--cpus-per-gpu=8" in calls[0]


def test_two_node_training_asks_slurm_for_both_nodes_one_task_each(runs, cluster):
    """train.nodes = 2, train.gpus = 8: one sbatch for 2 nodes, 16 GPUs and 2 tasks (one per
    node, started by the rule's own srun), with no --ntasks-per-gpu (tasks_per_gpu=0)."""
    calls = _gpu_submission(runs, cluster, "gpu_train_2nodes", {"train": {"gpus": 8, "nodes": 2}},
                            f"{RUN}/train/train_summary.json")
    assert len(calls) == 1, calls
    call = calls[0]
    assert "--comment rule_train" in call and "--nodes=2" in call and "--ntasks=2" in call, call
    assert "--gpus=16" in call and "--ntasks-per-gpu" not in call, call


def test_srun_torchrun_launch_trains_two_gloo_ranks_like_one_process(cluster, tiny_target, data, tmp_path):
    """Issue 14: the launch the train rule builds for train.nodes > 1 (eaglet.planner.gpu_slots.train_launch),
    on this one node: a batch job whose script runs `srun ... torchrun --nnodes 1 --nproc-per-node 2
    --rdzv-backend c10d --rdzv-endpoint <first node>:<port>` with the job's SLURM_* variables
    stripped as snakemake's SLURM job step strips them (SLURM_JOB_ID kept), so the rendezvous host
    comes from squeue. Two CPU ranks (gloo) must record world_size 2 and give the weights and loss
    trace of one process taking both micro-batches (as test_train's DDP test asserts)."""
    params = {**PARAMS, "max_steps": 4, "val_every": 4, "oov_rule": "label", "noise_std": 0.05}
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    subprocess.run(train_cmd(data, tiny_target, single, {**params, "grad_accum": 2}), check=True, capture_output=True)
    train_args = train_cmd(data, tiny_target, ddp, params)[3:]  # after `python -m eaglet.train.train`
    launch = train_launch(2, nodes=1, port=free_port(), srun=True)
    assert launch.startswith("srun --nodes 1 --ntasks-per-node 1 ") and "--rdzv-backend c10d" in launch
    script = tmp_path / "train.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash",
        "set -euo pipefail",
        # what snakemake-executor-plugin-slurm-jobstep leaves of SLURM_* in the rule's shell
        "for v in $(compgen -e | grep '^SLURM_' | grep -vx 'SLURM_JOB_ID'); do unset \"$v\"; done",
        f"{launch} -m eaglet.train.train {' '.join(shlex.quote(a) for a in train_args)}",
        "",
    ]))
    log = tmp_path / "job.log"
    env = smk_env({"SLURM_CONF": cluster["SLURM_CONF"], "PYTHONPATH": str(REPO / "src")})
    p = subprocess.run(["sbatch", "--parsable", "--wait", "--nodes", "1", "--ntasks", "1", "-c", "2",
                        "--mem", "6000", "-t", "15", "--output", str(log), str(script)],
                       env=env, capture_output=True, text=True, timeout=1200)
    out = log.read_text() if log.exists() else ""
    assert p.returncode == 0, f"sbatch rc {p.returncode}: {p.stderr}\n{out[-4000:]}"
    job = scontrol_jobs(cluster["SLURM_CONF"])[p.stdout.strip().split(";")[0]]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
    # torchrun's c10d rendezvous met on this node, as SLURM names it
    assert job["NodeList"] == job["BatchHost"]

    s = json.loads((ddp / "train_summary.json").read_text())
    assert s["world_size"] == 2 and s["micro_batches_per_step"] == 2, s
    a, b = pd.read_parquet(single / "metrics.parquet"), pd.read_parquet(ddp / "metrics.parquet")
    a, b = a[a.split == "train"], b[b.split == "train"]
    assert len(a) == len(b) == 4 and b.loss.notna().all()
    assert (a.loss - b.loss).abs().max() < 1e-4 and (a.tokens == b.tokens).all()
    ta, tb = load_tensors(single / "drafter.safetensors"), load_tensors(ddp / "drafter.safetensors")
    assert max(float((ta[k] - tb[k]).abs().max()) for k in ta if ta[k].is_floating_point()) < 5e-5
    assert all(torch.equal(ta[k], tb[k]) for k in ta if not ta[k].is_floating_point())
