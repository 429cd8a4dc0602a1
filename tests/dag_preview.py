"""Snakemake's dry-run preview, in this process: which jobs would run and why, for a workflow
folder and a config, read from what Snakemake prints (`rule X:` ... `reason: ...`). One preview
costs ~0.5 s here instead of a new interpreter's ~2 s, so a table of every config key can be
previewed within the test budget."""

import contextlib
import io
import os
import re
from pathlib import Path

UPSTREAM_ONLY = "Input files updated by another job"


def preview(workdir: Path, configfile: Path, cache: Path, targets: list[str] | None = None) -> dict[str, str]:
    """``{rule: reason}`` of every job a dry run of ``workdir`` with ``configfile`` plans (with
    --cache and the output cache ``cache``, as the project runs). Raises on a parse or DAG error."""
    out = _api(workdir, configfile, cache, targets, "dryrun")
    if "This was a dry-run" not in out and "Nothing to be done" not in out:
        raise RuntimeError(f"the dry run of {configfile} did not finish:\n{out[-3000:]}")
    jobs = dict(re.findall(r"^(?:local)?rule (\w+):\n(?:    (?!reason:).*\n)*    reason: (.*)$", out, re.M))
    return {r: why for r, why in jobs.items() if r != "all"}


def _api(workdir: Path, configfile: Path, cache: Path, targets: list[str] | None, pseudo: str) -> str:
    """Snakemake in this process with ``pseudo`` (dryrun or touch) as the executor; what it printed."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
        StorageSettings,
        WorkflowSettings,
    )

    text = io.StringIO()
    old_cache = os.environ.get("SNAKEMAKE_OUTPUT_CACHE")
    os.environ["SNAKEMAKE_OUTPUT_CACHE"] = str(cache)
    cwd = os.getcwd()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            with SnakemakeApi(OutputSettings(quiet={Quietness.PROGRESS})) as api:
                wf = api.workflow(
                    resource_settings=ResourceSettings(cores=2),
                    config_settings=ConfigSettings(configfiles=[Path(configfile).resolve()]),
                    storage_settings=StorageSettings(),
                    workflow_settings=WorkflowSettings(cache=[]),
                    workdir=Path(workdir),
                    snakefile=Path(workdir) / "Snakefile",
                )
                dag = wf.dag(DAGSettings(targets=set(targets or [])))
                dag.execute_workflow(executor=pseudo)
    finally:
        os.chdir(cwd)
        if old_cache is None:
            os.environ.pop("SNAKEMAKE_OUTPUT_CACHE", None)
        else:
            os.environ["SNAKEMAKE_OUTPUT_CACHE"] = old_cache
    return text.getvalue()


def record_finished(workdir: Path, configfile: Path, cache: Path) -> None:
    """Record every job that ``configfile`` would rerun as finished, without running it: Snakemake's
    touch executor (``--touch``) touches the outputs and stores each job's metadata (its params, the
    rerun trigger's record), as a run of the config would. For a preview of a changed config's
    finished state at the cost of a dry run; the outputs keep what the earlier config computed."""
    _api(workdir, configfile, cache, None, "touch")


def own_reasons(jobs: dict[str, str]) -> set[str]:
    """The jobs planned for a reason of their own (a param, an input file, code, a missing
    output), not only because a job before them runs again."""
    return {r for r, why in jobs.items() if any(not part.strip().startswith(UPSTREAM_ONLY)
                                                for part in why.split(";") if part.strip())}
