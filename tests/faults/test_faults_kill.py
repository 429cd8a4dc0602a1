"""R7 (+R4): a SIGKILL of a running Snakemake leaves nothing complete-looking; the rerun resumes.

Part of the fault-injection suite (marker `faults`; docs/guarantees.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from canned_server import Canned
from conftest import REPO, clone
from eaglet.base.conversations import read_conversations
from eaglet.base.files import read_json
from faults_common import _smk, corrupt_parquet

pytestmark = pytest.mark.faults


# =========================================================================== R7 (+R4): kill Snakemake


def _pids_in(root: Path) -> list[int]:
    """Processes whose working directory is ``root`` (the jobs of a Snakemake run in that clone)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if Path(os.readlink(d / "cwd")) == root.resolve():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def _slow_generate_workflow(tmp_path: Path, canned: str, tiny_target: dict) -> Path:
    """A workflow clone whose `generate` job is slow (the canned server's SLOW prompts), 24 prompts
    in chunks of 2: long enough to be killed mid-job."""
    wf = clone(tmp_path / "wf")
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "conversations": [
        {"from": "human", "value": f"SLOW question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}) + "\n"
        for i in range(26)))
    conf = {"run": "faults", "target": {"name": "tiny-llama", "tiny": {}},
            "prompts": {"source": "file", "path": str(src), "n": 24, "heldout": 2},
            # Every answer regenerated: config.yaml's default (data.mix 0.0) would send nothing.
            "data": {"mix": 1.0},
            "generate": {"backend": "openai", "base_urls": [canned], "model": "canned", "concurrency": 1,
                         "chunk_size": 2, "flush_s": 3600, "max_tokens": 8}}
    (wf / "config" / "faults.yaml").write_text(yaml.safe_dump(conf))
    # The target is not what this test is about: the session's tiny target stands in for the
    # target_model rule's outputs (copied, so they are newer than that rule's inputs).
    shutil.copytree(Path(tiny_target["path"]).parent, wf / "resources" / "targets" / "tiny-llama")
    return wf


def _run_until_two_parts(wf: Path, gen: Path, target: str, log: Path):
    """Start Snakemake on the slow generate workflow; return its process once two parts exist. The
    canned server answers four SLOW requests (two parts of two) and holds the fifth until
    `_release` (tests/canned_server.py): the job is mid-flight when it is killed, however fast the
    machine."""
    Canned.slow_budget, Canned.slow_answered = 4, 0
    Canned.slow_gate.clear()
    proc = _smk(wf, target, configfile="config/faults.yaml", log=log)
    deadline = time.monotonic() + 300
    while len(list((gen / "parts").glob("part_*.parquet"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"generate never ran long enough to be killed:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    return proc


def _release():
    """Let the canned server answer every request again (the rerun's)."""
    Canned.slow_budget = None
    Canned.slow_gate.set()


def test_kill_snakemake_mid_job_leaves_nothing_complete_and_reruns(canned, tiny_target, tmp_path):
    """SIGKILL a Snakemake run (its whole process group: scheduler and job) while `generate` is
    writing parts. No output of the killed job exists; a leftover output file is flagged as
    incomplete by Snakemake, not trusted; the rerun resumes from the parts and completes. Then one
    complete output is corrupted in place: the consuming rule fails naming it, and nothing
    downstream is made from it."""
    wf = _slow_generate_workflow(tmp_path, canned, tiny_target)
    gen = wf / "results" / "faults" / "generate"
    outputs = [gen / "conversations.parquet", gen / "errors.parquet", gen / "generate_summary.json"]
    target = "results/faults/generate/generate_summary.json"

    proc = _run_until_two_parts(wf, gen, target, tmp_path / "killed_run.log")
    assert [p for p in _pids_in(wf) if p != proc.pid], "no job process to kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _release()
    time.sleep(0.5)
    for pid in _pids_in(wf):  # a job outside the process group would survive the kill: none may
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"process {pid} of the killed run survived")
    parts_before = sorted(p.name for p in (gen / "parts").glob("part_*.parquet"))
    assert len(parts_before) == 2, parts_before  # what was answered before the hold, no more
    # Nothing that looks complete: no output, no leftover temporary file beside them.
    assert not [o for o in outputs if o.exists()]
    assert not [p.name for p in gen.iterdir() if p.is_file()]

    # The killed scheduler's lock survives it (Snakemake would refuse to start): the user unlocks.
    assert _smk(wf, target, "--unlock", configfile="config/faults.yaml")[0] == 0
    # A non-atomic writer would have left a complete-looking file: Snakemake itself refuses it,
    # because the job never finished (its incomplete marker survived the kill).
    outputs[0].write_bytes(b"PAR1 half a file")
    code, out = _smk(wf, target, configfile="config/faults.yaml")
    assert code != 0 and "IncompleteFilesException" in out and "conversations.parquet" in out, out[-3000:]

    code, out = _smk(wf, target, "--rerun-incomplete", configfile="config/faults.yaml")
    assert code == 0, out[-4000:]
    assert re.search(r"rule generate:.*?reason: Forced execution", out, re.S), out[-4000:]  # = incomplete
    assert not re.search(r"rule (prompts|target_model):", out)  # only the killed job reruns
    s = read_json(outputs[2])
    t = s["this_run"]
    assert t["skipped"] >= 2 * len(parts_before) and t["success"] + t["error"] + t["skipped"] == 24
    assert s["samples"] == 24 and read_conversations(outputs[0])[0]["messages"][-1]["content"].startswith("echo")

    # R4 through the DAG: generate's output corrupted in place; tokenize refuses it naming the file.
    corrupt_parquet(outputs[0], "data_page_byte")
    tok = wf / "results" / "faults" / "tokenize"
    code, out = _smk(wf, "results/faults/token_freq/freq.safetensors", configfile="config/faults.yaml")
    assert code != 0 and "results/faults/generate/conversations.parquet" in out, out[-3000:]
    assert re.search(r"Error in rule tokenize", out), out[-3000:]
    assert not (tok / "tokens.parquet").exists() and not (tok / "metadata.json").exists()
    assert not (wf / "results" / "faults" / "token_freq").exists()


def test_make_run_notices_a_stale_lock_unlocks_and_resumes(canned, tiny_target, tmp_path):
    """scripts/snakemake_resume.py (what `make run` calls): while a Snakemake run is live it leaves
    its lock alone; after that run is SIGKILLed (plain Snakemake then stops at "cannot be locked")
    it says the lock is stale, unlocks and resumes with --rerun-incomplete, and the run completes
    from the killed job's parts."""
    wf = _slow_generate_workflow(tmp_path, canned, tiny_target)
    gen = wf / "results" / "faults" / "generate"
    target = "results/faults/generate/generate_summary.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SNAKEMAKE_OUTPUT_CACHE", None)
    smk = [sys.executable, "-m", "snakemake", target, "--cores", "2", "--configfile", "config/faults.yaml"]

    def resume():
        return subprocess.run([sys.executable, str(REPO / "scripts" / "snakemake_resume.py"), *smk], cwd=wf,
                              env=env, capture_output=True, text=True, timeout=600)

    proc = _run_until_two_parts(wf, gen, target, tmp_path / "killed_run.log")
    locks = wf / ".snakemake" / "locks"
    try:
        live = resume()
        assert live.returncode == 1 and "still running" in live.stderr and f"pid {proc.pid}" in live.stderr, live
        assert proc.poll() is None and list(locks.glob("*"))  # the live run and its lock untouched
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _release()
    time.sleep(0.5)
    assert not _pids_in(wf), "a process of the killed run survived"
    assert list(locks.glob("*"))
    code, out = _smk(wf, target, configfile="config/faults.yaml")
    assert code != 0 and "cannot be locked" in out, out[-3000:]  # what `make run` used to stop at

    r = resume()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "stale lock" in r.stderr and "--rerun-incomplete" in r.stderr, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "Unlocked working directory" in out and re.search(r"rule generate:", out), out[-3000:]
    assert not re.search(r"rule (prompts|target_model):", out)  # only the killed job reruns
    assert not list(locks.glob("*"))
    s = read_json(gen / "generate_summary.json")
    assert s["samples"] == 24 and s["this_run"]["skipped"] >= 4  # resumed from the killed job's parts
    # nothing left to recover: the next call just runs Snakemake (nothing to do)
    again = resume()
    assert again.returncode == 0 and "snakemake_resume:" not in again.stderr
    assert "Nothing to be done" in again.stdout + again.stderr
