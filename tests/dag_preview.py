"""Snakemake's dry-run preview, in this process: which jobs would run and why, for a workflow
folder and a config, read from what Snakemake prints (`rule X:` ... `reason: ...`). One preview
costs ~0.5 s here instead of a new interpreter's ~2 s, so a table of every config key can be
previewed within the test budget; and the between-workflow cache's key of a job, as Snakemake computes
it (``cache_keys``) and its params (``job_params``)."""

import contextlib
import io
import os
import re
from pathlib import Path

UPSTREAM_ONLY = "Input files updated by another job"


@contextlib.contextmanager
def _dry_run(workdir: Path, configfile: Path, cache: Path, targets: list[str] | None = None,
             pseudo: str = "dryrun"):
    """A dry run of ``workdir`` with ``configfile`` and the output cache ``cache``, in this process:
    yields ``(what Snakemake printed, its DAG)``. Raises on a parse or DAG error. ``pseudo``: the
    executor (``touch`` records the jobs as finished instead: ``record_finished``)."""
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
                out = text.getvalue()
                if pseudo == "dryrun" and "This was a dry-run" not in out and "Nothing to be done" not in out:
                    raise RuntimeError(f"the dry run of {configfile} did not finish:\n{out[-3000:]}")
                yield out, wf._workflow.dag
    finally:
        os.chdir(cwd)
        if old_cache is None:
            os.environ.pop("SNAKEMAKE_OUTPUT_CACHE", None)
        else:
            os.environ["SNAKEMAKE_OUTPUT_CACHE"] = old_cache


def preview(workdir: Path, configfile: Path, cache: Path, targets: list[str] | None = None) -> dict[str, str]:
    """``{rule: reason}`` of every job a dry run of ``workdir`` with ``configfile`` plans (with
    --cache and the output cache ``cache``, as the project runs). Raises on a parse or DAG error."""
    with _dry_run(workdir, configfile, cache, targets) as (out, _):
        pass
    jobs = dict(re.findall(r"^(?:local)?rule (\w+):\n(?:    (?!reason:).*\n)*    reason: (.*)$", out, re.M))
    return {r: why for r, why in jobs.items() if r != "all"}


def record_finished(workdir: Path, configfile: Path, cache: Path) -> None:
    """Record every job that ``configfile`` would rerun as finished, without running it: Snakemake's
    touch executor (``--touch``) touches the outputs and stores each job's metadata (its params, the
    rerun trigger's record), as a run of the config would. For a preview of a changed config's
    finished state at the cost of a dry run; the outputs keep what the earlier config computed."""
    with _dry_run(workdir, configfile, cache, None, "touch"):
        pass


def job_params(workdir: Path, configfile: Path, cache: Path, rules: list[str]) -> dict[str, dict]:
    """``{rule: {param: value}}`` of the first job of each of ``rules`` in the DAG of ``workdir``
    with ``configfile``: every param as Snakemake expands it for the job (what its cache key hashes)."""
    found: dict[str, dict] = {}
    with _dry_run(workdir, configfile, cache) as (_, dag):
        for job in sorted(dag.jobs, key=str):
            if job.rule.name in rules and job.rule.name not in found:
                found[job.rule.name] = dict(job.params.items())
    missing = set(rules) - set(found)
    if missing:
        raise RuntimeError(f"no job of {sorted(missing)} in the DAG of {configfile}")
    return found


def cache_keys(workdir: Path, configfile: Path, cache: Path, rules: list[str]) -> dict[str, dict]:
    """``{rule: {"key": its cache key, "cached": bool}}`` for the first job of each of ``rules`` in the
    DAG of ``workdir`` with ``configfile``: the key under which the between-workflow cache stores and
    looks up the job's outputs (Snakemake's own provenance hash: the shell command, every param, the
    input files no job makes, and the keys of the jobs before it), and whether ``cache`` holds an
    entry for every output under that key (Snakemake's own lookup: ``<key>`` and the output's name)."""
    import asyncio

    from snakemake.caching.hash import ProvenanceHashMap

    hashes = ProvenanceHashMap()
    found: dict[str, dict] = {}
    with _dry_run(workdir, configfile, cache) as (_, dag):
        for job in sorted(dag.jobs, key=str):
            name = job.rule.name
            if name in rules and name not in found:
                key = asyncio.run(hashes.get_provenance_hash(job))
                outs = list(job.output._allitems())
                names = [f"{key}_{n}{Path(f).suffix}" for n, f in outs] if len(outs) > 1 else \
                    [f"{key}{Path(outs[0][1]).suffix}"]
                found[name] = {"key": key, "cached": all((Path(cache) / n).exists() for n in names)}
    missing = set(rules) - set(found)
    if missing:
        raise RuntimeError(f"no job of {sorted(missing)} in the DAG of {configfile}")
    return found


def own_reasons(jobs: dict[str, str]) -> set[str]:
    """The jobs planned for a reason of their own (a param, an input file, code, a missing
    output), not only because a job before them runs again."""
    return {r for r, why in jobs.items() if any(not part.strip().startswith(UPSTREAM_ONLY)
                                                for part in why.split(";") if part.strip())}
