"""Every environment and service a run will need is checked before the first job (issue 46;
eaglet.workflow.environments): SGLang's for the export contract's loader.sglang, vLLM's where
generate, the export or the evaluation serve with it, SLURM's commands with the SLURM executor.
A missing one stops `snakemake -n` (and a run) before any job, naming the key that asks for it and
the install command; a missing SGLang env once surfaced at export, after the whole training path.

The run folders are clones of the workflow (conftest.clone: no envs/*/.venv) whose jobs import the
clone's own eaglet (PYTHONPATH), so the environments the jobs would use are the clone's, absent:
main's environments are neither used nor touched."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import clone
from eaglet.engines import vllm_env
from eaglet.planner import plan
from eaglet.workflow import environments

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
ENV_VARS = (vllm_env.ENV_VAR, "EAGLET_SGLANG_PYTHON")


def _config(path="config/smoke.yaml", **changes) -> dict:
    config = plan.load_config(REPO / path)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        d = config
        for p in parents:
            d = d[p]
        d[leaf] = value
    return config


def test_what_each_config_needs():
    assert [w for w, _, _ in environments.needed(_config())] == ["SGLang"]  # the smoke run: no vLLM
    full = environments.needed(_config("config/config.yaml"))
    assert [(w, k.split(" ")[0]) for w, k, _ in full] == [
        ("vLLM", "generate.backend:"), ("vLLM", "export.vllm_check"), ("vLLM", "evaluate.vllm.enabled"),
        ("SGLang", "export")]
    accepted = _config(**{"export.accept_not_run": [*_config()["export"]["accept_not_run"], "loader.sglang"]})
    assert environments.needed(accepted) == []
    # generate's backend counts only where a generation stage runs
    off = _config(**{"generate.backend": "vllm", "generate.enabled": False, "data.mix": 1.0,
                     "evaluate.regenerate.enabled": False})
    assert [w for w, _, _ in environments.needed(off)] == ["SGLang"]


def test_a_missing_or_half_installed_environment_is_refused_naming_its_install_command(tmp_path, monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    config = _config(**{"evaluate.vllm.enabled": True})
    with pytest.raises(ValueError) as e:
        environments.check(config, root=tmp_path)
    text = str(e.value)
    assert "evaluate.vllm.enabled: " in text and "`make vllm-env`" in text
    assert "loader.sglang, not in export.accept_not_run" in text and "`make sglang-env`" in text
    # an install that never finished (no setup stamp) is no environment either
    (tmp_path / "envs/sglang/.venv/bin").mkdir(parents=True)
    (tmp_path / "envs/sglang/.venv/bin/python").symlink_to(sys.executable)
    with pytest.raises(ValueError, match=r"SGLang environment incomplete .*rerun `make sglang-env`"):
        environments.check(_config(), root=tmp_path)
    (tmp_path / "envs/sglang/.venv" / vllm_env.SETUP_STAMP).write_text("")
    assert environments.check(_config(), root=tmp_path) == [
        f"SGLang environment for export (its contract's loader.sglang, not in export.accept_not_run): "
        f"{tmp_path / 'envs/sglang/.venv'}"]


def _snakemake(wf: Path, *args, path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(PYTHONPATH=str(wf / "src"), SNAKEMAKE_OUTPUT_CACHE=str(wf / "cache"),
               PATH=path or f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([sys.executable, "-m", "snakemake", *args, "--cores", "2"], cwd=wf, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A run folder without envs/sglang/.venv or envs/vllm/.venv, its jobs importing its own eaglet."""
    wf = clone(tmp_path_factory.mktemp("bare") / "wf")
    (wf / "cache").mkdir()
    assert not (wf / "envs/sglang/.venv").exists() and not (wf / "envs/vllm/.venv").exists()
    return wf


def test_snakemake_n_stops_before_any_job_without_sglang(bare):
    for args in (["-n"], []):  # the preview and the run
        p = _snakemake(bare, *args, "--configfile", "config/smoke.yaml")
        out = p.stdout + p.stderr
        assert p.returncode != 0, out[-3000:]
        assert "environments this run needs are missing, found before any job" in out, out[-3000:]
        assert "`make sglang-env`" in out and "name loader.sglang in export.accept_not_run" in out, out[-3000:]
        assert not (bare / "results").exists() and not (bare / "resources").exists()


def test_snakemake_n_names_vllm_where_the_config_serves_with_it(bare):
    conf = yaml.safe_load((bare / "config/smoke.yaml").read_text())
    conf["export"]["accept_not_run"].append("loader.sglang")  # SGLang's loader left out, by name
    (bare / "config/no_sglang.yaml").write_text(yaml.safe_dump(conf))
    p = _snakemake(bare, "-n", "--configfile", "config/no_sglang.yaml")
    assert p.returncode == 0 and "This was a dry-run" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    conf["evaluate"]["vllm"]["enabled"] = True
    (bare / "config/vllm.yaml").write_text(yaml.safe_dump(conf))
    p = _snakemake(bare, "-n", "--configfile", "config/vllm.yaml")
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "evaluate.vllm.enabled: " in out and "`make vllm-env`" in out, out[-3000:]
    assert "make sglang-env" not in out


def test_the_slurm_executor_without_slurms_commands_stops_before_any_job(bare, tmp_path):
    """With --executor slurm and no sbatch/squeue on PATH the run stops when it starts (onstart),
    naming the commands, instead of failing every submission."""
    conf = yaml.safe_load((bare / "config/smoke.yaml").read_text())
    conf["export"]["accept_not_run"].append("loader.sglang")
    (bare / "config/slurm.yaml").write_text(yaml.safe_dump(conf))
    tools = tmp_path / "bin"  # the usual commands, less SLURM's (installed on this machine by test_slurm)
    tools.mkdir()
    for d in ("/usr/local/bin", "/usr/bin", "/bin"):
        for f in Path(d).glob("*") if Path(d).is_dir() else ():
            if f.name not in ("sbatch", "squeue", "sacct", "sinfo", "srun", "scontrol") and \
                    not (tools / f.name).exists():
                (tools / f.name).symlink_to(f)
    p = _snakemake(bare, "results/smoke/prompts/train.parquet", "--executor", "slurm", "--jobs", "1",
                   "--configfile", "config/slurm.yaml", path=f"{VENV_BIN}{os.pathsep}{tools}")
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "--executor slurm" in out and "sbatch, squeue (or sacct) not on PATH" in out, \
        out[-3000:]
    assert not (bare / "results").exists() and not (bare / "resources").exists()
