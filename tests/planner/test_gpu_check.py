"""scripts/gpu-check.sh, the GPU check that cannot run on these CPU machines: it parses, is
shellcheck-clean, and its dry run prints every command it would run (the GPU vLLM build, the
Snakemake run on one GPU, the extraction benchmark, the summary and the figures table). Its config
overlay dry-runs to GPU jobs (bf16 extraction and training through torchrun on gpu=1, generation
with the GPU vLLM build), and the table helper fails when a figure is missing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check.sh"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_table  # noqa: E402


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck missing: `make test-deps` installs it")
        pytest.skip("shellcheck not installed (make test-deps)")
    p = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_dry_run_prints_every_command_and_runs_none(tmp_path):
    # PATH without nvidia-smi and with a `make` that would fail: a dry run needs neither
    (tmp_path / "make").write_text("#!/bin/sh\necho make was run >&2\nexit 9\n")
    (tmp_path / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "make was run" not in p.stderr, p.stderr
    cmds = [line[2:] for line in p.stdout.splitlines() if line.startswith("+ ")]
    assert cmds[0] == "nvidia-smi -L"
    assert "make venv" in cmds and "make vllm-env VLLM_PACKAGE=vllm" in cmds
    smk = [c for c in cmds if "/snakemake " in c]
    assert len(smk) == 1, cmds
    assert "--resources gpu=1" in smk[0] and "--configfile config/config.yaml config/gpu-check.yaml" in smk[0]
    assert "timeout -k 30 600 " in smk[0] and "--cache" not in smk[0]
    assert any("benchmarks/bench_extract.py" in c and "--tokens results/gpu-check/tokenize/tokens.parquet" in c
               and "--device cuda" in c for c in cmds)
    assert ".venv/bin/python -m eaglet.workflow.summary results/gpu-check" in cmds
    assert any(c.startswith(".venv/bin/python scripts/gpu_check_table.py results/gpu-check ") for c in cmds)
    # in that order: environments, the DAG, the benchmark on its tokens, then the tables
    order = [next(i for i, c in enumerate(cmds) if key in c)
             for key in ("vllm-env", "/snakemake ", "bench_extract", "eaglet.workflow.summary", "gpu_check_table")]
    assert order == sorted(order)
    assert not (tmp_path / "results").exists()


def test_overlay_config_plans_the_gpu_jobs(tmp_path):
    wd = tmp_path / "repo"
    wd.mkdir()
    for name in ["Snakefile", "workflow", "config", "src", "envs", "pyproject.toml"]:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, wd / name, ignore=shutil.ignore_patterns("__pycache__", ".venv"))
        else:
            shutil.copy2(src, wd / name)
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(tmp_path / "cache"),
           "EAGLET_PREVIEW_SETTINGS": str(tmp_path / "preview"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "8", "--resources", "gpu=1",
                        "--configfile", "config/config.yaml", "config/gpu-check.yaml"],
                       cwd=wd, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    from workflow_common import planned

    jobs = {j["rule"]: j for j in planned(out)}
    assert {"generate", "extract_hidden_states", "train", "export", "evaluate_vllm"} <= set(jobs)
    for rule in ("generate", "extract_hidden_states", "train"):
        assert jobs[rule]["resources"].get("gpu") == "1", rule
        assert jobs[rule]["shell"].startswith("python -m eaglet.planner.gpu_slots --gpus 1 -- "), rule
    launch = "python -m torch.distributed.run --standalone --nproc_per_node 1 -m eaglet.train.train"
    assert launch in jobs["train"]["shell"]
    # generate's settings reach it in a file the run writes when it starts (--config @FILE); a
    # preview writes it only where EAGLET_PREVIEW_SETTINGS asks
    assert "--config @logs/gpu-check/config/generate.json" in jobs["generate"]["shell"]
    assert not (wd / "logs/gpu-check/config").exists()
    gen = json.loads((tmp_path / "preview/logs/gpu-check/config/generate.json").read_text())
    assert gen["vllm"]["package"] == "vllm" and gen["vllm"]["dtype"] == "bfloat16"
    assert "results/gpu-check/" in jobs["train"]["shell"]


def test_table_reports_the_figures_and_fails_on_a_missing_one(tmp_path, capsys):
    run = tmp_path / "run"
    for rel, obj in {"train/train_summary.json": {"tok_s": 51234.5, "device": "cuda", "world_size": 1, "steps": 90},
                     "drafter/contract.json": {"ok": True},
                     "eval/summary.json": {"headline": {"vllm_k": 3, "tau_vllm": {"mtbench": 2.41},
                                                        "speedup_vllm": {"mtbench": 1.73}, "lossless_vllm": True}}
                     }.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(json.dumps(obj))
    bench = tmp_path / "bench.txt"
    bench.write_text("bare forward:       90000 tok/s\nextraction:         81000 tok/s  (dtype bfloat16)\n"
                     "ratio:              0.900  (goal >= 0.95)\n")
    assert gpu_check_table.main([str(run), str(bench), "--wall-s", "540"]) == 0
    out = capsys.readouterr().out
    for want in ("81000 ÷ 90000 = 0.900", "51234", "mtbench 2.41", "mtbench ×1.73", "9.0 min", "passed"):
        assert want in out, (want, out)
    bench.write_text("")
    (run / "drafter/contract.json").write_text(json.dumps({"ok": False, "failed": ["vllm.load_run"]}))
    assert gpu_check_table.main([str(run), str(bench)]) == 1
    err = capsys.readouterr().err
    assert "extraction benchmark" in err and "export contract" in err
