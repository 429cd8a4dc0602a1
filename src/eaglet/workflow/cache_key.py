"""The output cache's key without the run's own folders.

Snakemake's between-workflow cache keys a job's outputs by a hash of its shell text, its params, its
inputs' content and its cached dependencies' keys (snakemake.caching.hash.ProvenanceHashMap, 9.27).
The params of eaglet's cached stages hold *where* the job writes: its output folder
(``results/<run>/prompts``, eaglet.workflow.params.out_dir) and the path of its settings file
(``logs/<run>/config/generate.json``, eaglet.workflow.params.SettingsFiles). So every run name had its
own keys: a second config on the same data (config/dflash.yaml beside config/config.yaml) computed the
generation and the extraction again, hours at scale, where the cache held them.

Installed by workflow/rules/common.smk once the run's folders are known, this wraps the hash so that
it reads each string param with the run's results and logs folders written as ``{run}`` and
``{logs}``: the key holds what defines the output, not the run that made it. The job itself runs with
its real params (they are given back before the job is formatted); the rerun triggers, which compare
the params Snakemake stores per output, are not touched, so no existing run reruns. Entries stored
before this keyed by the old hash are not found again (each is computed once more by a new run).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from snakemake.caching.hash import ProvenanceHashMap

WRAPPED = "_get_provenance_hash"
# The run's folders, by placeholder: set by ``install`` (the Snakefile is parsed once per process)
_FOLDERS: dict[str, str] = {}


def without_run_folders(value: Any, folders: dict[str, str]) -> Any:
    """``value`` with every occurrence of a run folder (a whole path component prefix) in its strings
    written as the folder's placeholder; lists, tuples and dicts followed down."""
    if isinstance(value, str):
        for placeholder, folder in folders.items():
            value = re.sub(rf"(?<![^/\s=@'\"]){re.escape(folder.rstrip('/'))}(?=/|$|[\s'\"])", placeholder, value)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(without_run_folders(v, folders) for v in value)
    if isinstance(value, dict):
        return {k: without_run_folders(v, folders) for k, v in value.items()}
    return value


def _keyed_params(params, folders: dict[str, str]):
    """A copy of a job's params (a snakemake Namedlist) with the run folders replaced."""
    return params.__class__(toclone=params, custom_map=lambda v: without_run_folders(v, folders))


def install(run: str, logs: str, cls: type = ProvenanceHashMap) -> None:
    """Key the cache without the run's results folder ``run`` and logs folder ``logs``."""
    _FOLDERS.clear()
    _FOLDERS.update({"{run}": str(run), "{logs}": str(logs)})
    if getattr(cls, "_eaglet_without_run", False):
        return
    if not hasattr(cls, WRAPPED):
        raise RuntimeError(f"{cls.__module__}.{cls.__name__} has no {WRAPPED}: Snakemake's cache key changed "
                           "(pyproject.toml pins the version eaglet.workflow.cache_key was written for)")
    original = getattr(cls, WRAPPED)
    # how many hash computations of a job are in flight: the dependencies of two jobs are hashed side
    # by side (asyncio.gather), so one job can be entered twice before either gives its params back
    entered: Counter = Counter()
    real: dict = {}

    async def keyed(self, job):
        if job in self._hashes:
            return self._hashes[job]
        if entered[job] == 0:
            real[job] = job.params
            job._params = _keyed_params(real[job], _FOLDERS)  # noqa: SLF001
        entered[job] += 1
        try:
            return await original(self, job)
        finally:
            entered[job] -= 1
            if entered[job] == 0:
                job._params = real.pop(job)  # noqa: SLF001
                del entered[job]

    setattr(cls, WRAPPED, keyed)
    cls._eaglet_without_run = True
