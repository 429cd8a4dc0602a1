"""Every separate environment and service the configured DAG will use, checked before the first job
(issue 46): at parse time, so `snakemake -n` refuses already, for the environments; when the run
starts (the Snakefile's onstart), for the SLURM executor's commands. A missing one is named with
the config key that asks for it and the command that installs it, instead of failing its stage
after hours of training.

- vLLM (``make vllm-env``): generate and generate_eval with ``generate.backend: vllm`` (its
  ``generate.vllm.env``), the export's real-vLLM checks (``export.vllm_check``: ``$EAGLET_VLLM_PYTHON``
  or envs/vllm/.venv), evaluate_vllm (``evaluate.vllm.enabled``: its ``evaluate.vllm.env``);
- SGLang (``make sglang-env``): the export contract runs SGLang's own loader (``loader.sglang``) on
  every export unless ``export.accept_not_run`` names it (``$EAGLET_SGLANG_PYTHON`` or envs/sglang/.venv);
- SLURM: with ``--executor slurm`` (workflow/profiles/slurm), ``sbatch`` and ``squeue`` or
  ``sacct`` on PATH;
- the anchor environment (``make anchor-env``) serves benchmarks/bench_anchor.py only: no rule and
  no config key uses it, so a run never needs it.

An environment is found as the job will find it (eaglet.engines.vllm_env.venv_python): the path from
the workflow folder, else from the repository of the eaglet the jobs import (``root``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eaglet.base import schema
from eaglet.engines import vllm_env
from eaglet.export.contract import sglang_check


def job_root(spec, workflow_src: str | Path) -> Path:
    """The repository of the eaglet a job's ``python -m eaglet...`` imports: ``spec`` is
    ``importlib.util.find_spec("eaglet")`` as workflow/rules/common.smk takes it before it puts the
    workflow's own ``src`` first on sys.path (an editable install, or $PYTHONPATH); without one, the
    workflow's ``src``."""
    init = Path(spec.origin) if spec is not None and spec.origin else Path(workflow_src) / "eaglet" / "__init__.py"
    return init.resolve().parents[2]


def needed(config: dict) -> list[tuple[str, str, str | None]]:
    """``(what, the config key that asks for it, the env as configured or None for the default)``
    for each separate environment the configured DAG runs."""
    g, ev, ex = config["generate"], config["evaluate"], config["export"]
    out = []
    if g["backend"] == "vllm" and (g["enabled"] or ev["regenerate"]["enabled"]):
        key = "generate.backend: vllm" + (" (generate.enabled)" if g["enabled"] else
                                          " (evaluate.regenerate.enabled)")
        out.append(("vLLM", key, g["vllm"]["env"]))
    if ex.get("vllm_check", schema.default("export.vllm_check")):
        out.append(("vLLM", "export.vllm_check", None))
    if ev["vllm"]["enabled"]:
        out.append(("vLLM", "evaluate.vllm.enabled", ev["vllm"]["env"]))
    if sglang_check.NAME not in (ex.get("accept_not_run") or ()):
        out.append(("SGLang", f"export (its contract's {sglang_check.NAME}, not in export.accept_not_run)", None))
    return out


def check(config: dict, root: str | Path | None = None) -> list[str]:
    """Refuse (ValueError) a config whose DAG needs an environment that is absent or half-installed,
    naming the key, the install command and how to do without it; the lines to log otherwise."""
    lines, missing = [], []
    for what, key, env in needed(config):
        if what == "vLLM":
            setup, err, var, default = vllm_env.SETUP, vllm_env.VllmEnvMissing, vllm_env.ENV_VAR, vllm_env.DEFAULT_ENV
        else:
            setup, err, var, default = (sglang_check.SETUP, sglang_check.SglangEnvMissing, sglang_check.ENV_VAR,
                                        sglang_check.DEFAULT_ENV)
        try:
            py = vllm_env.venv_python(env, var, default, what, setup, err, root=root)
            lines.append(f"{what} environment for {key}: {py.parent.parent}")
        except err as e:
            missing.append(f"{key}: {e}. {WITHOUT[what]}")
    if missing:
        raise ValueError("environments this run needs are missing, found before any job:\n  " + "\n  ".join(missing))
    return lines


# How to run without each environment (what each refusal offers besides the install command)
WITHOUT = {
    "vLLM": ("Or run without vLLM: generate.backend local or openai, export.vllm_check: false (naming the "
             "vllm.* checks in export.accept_not_run), evaluate.vllm.enabled: false"),
    "SGLang": f"Or export without SGLang's loader: name {sglang_check.NAME} in export.accept_not_run",
}


def slurm_commands(executor: str | None) -> None:
    """Refuse a run with the SLURM executor where SLURM's client commands are not on PATH (the
    Snakefile's onstart, before any job is submitted: the plugin would fail each submission)."""
    if executor != "slurm":
        return
    gone = [c for c in ("sbatch",) if shutil.which(c) is None]
    if shutil.which("squeue") is None and shutil.which("sacct") is None:
        gone.append("squeue (or sacct)")
    if gone:
        raise RuntimeError(f"--executor slurm (workflow/profiles/slurm): {', '.join(gone)} not on PATH. Run "
                           "snakemake on a node of the cluster that has SLURM's client commands, or run "
                           "locally without --workflow-profile workflow/profiles/slurm (docs/clusters.md)")
