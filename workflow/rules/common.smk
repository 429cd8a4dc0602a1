# Wiring shared by every rule file, and nothing else: the config validated (defaults filled in),
# resolved once into R (eaglet.workflow.resolve: the parse-time checks, the storage choice, the layer
# ids, the dtypes, how the target is run, each with its reason; the config stays as written), R's
# lines logged, and the names the rule files use.
import importlib.util
import sys
from pathlib import Path

from snakemake.logging import logger
from snakemake.utils import min_version

min_version("9.0")

# This workflow's own library (not whichever eaglet is installed) checks the config and the target at
# parse time: a bad value, an unknown key (target.tiny's included), a wrong target.path, layer ids, a
# missing chat template or an engine that cannot serve the drafter stop `snakemake -n` already, naming
# the key.
# The eaglet the jobs import (an editable install, or $PYTHONPATH), found before this workflow's own
# src is put first: the separate environments (envs/vllm, envs/sglang) are checked where those jobs
# will look for them (eaglet.workflow.environments).
JOB_EAGLET = importlib.util.find_spec("eaglet")
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from eaglet.base import schema

# workflow/schemas/config.schema.yaml, and what JSON Schema lets through (a float where an integer is
# meant, a non-finite number); defaults filled as snakemake.utils.validate(set_default=True) fills them
schema.validate(config)
from eaglet.workflow import cache_key, code_inputs, environments, shared_cache
from eaglet.workflow.params import (
    SettingsFiles,
    as_json,
    key_params,
    library_params,
    out_dir,
    settings,
    target_digest,
    verbatim,
)
from eaglet.workflow.resolve import resolve

# Runs that share one output cache at the same moment store each entry once, whole, and read no
# half-stored one (eaglet.workflow.shared_cache wraps Snakemake's local cache).
shared_cache.install()

R = resolve(config, job_root=environments.job_root(JOB_EAGLET, Path(workflow.basedir) / "src"))
for _line in R.lines():
    logger.info(_line)

RUN = R.paths.run
LOGS = R.paths.logs
# The cache key holds what defines an output, not the run that made it: the run's own folders in a
# cached job's params (its output folder, its settings file's path) are keyed as {run} and {logs}, so a
# run of another name on the same data is served what this one cached (eaglet.workflow.cache_key).
cache_key.install(RUN, LOGS)
TARGET_DIR = R.paths.target_dir
TARGET_ID = R.paths.target_id
# The module files a stage runs (its whole import closure, with the GPU-slot launcher's when it runs
# in front of the stage), listed as the rule's code inputs, so editing a module reruns exactly the
# stages whose code imports it (the cache key never sees code imported by `python -m`).
stage_code = code_inputs.files
# The cached rules' settings files: written when a run starts (the Snakefile's onstart), never by a
# preview, so `snakemake -n` changes no file a run reads (eaglet.workflow.params.SettingsFiles).
SETTINGS_FILES = SettingsFiles()
settings_file = SETTINGS_FILES.file
# The evaluation summary once workflow/rules/eval.smk is included (an empty list before).
EVAL_SUMMARY = []
# Final outputs; each rule file appends what `rule all` must build.
FINAL_OUTPUTS = []
