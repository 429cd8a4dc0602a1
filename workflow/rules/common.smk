# Config validation and small pure helpers shared by every rule file. Nothing else lives here.
import json
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
from eaglet import target_check

for _line in target_check.parse_time(config):
    logger.info(_line)
# The template's text (not its path) is a param of every stage that renders conversations, so it
# is in their cache keys; "" = the checkpoint's own.
CHAT_TEMPLATE = target_check.chat_template_text(config["target"]["chat_template"]) or ""

RUN = f"results/{config['run']}"
LOGS = f"logs/{config['run']}"
TARGET_DIR = f"resources/targets/{config['target']['name']}"
TARGET_ID = f"{TARGET_DIR}/identity.json"
EXTRACT_SHARDS = list(range(config["extract"]["shards"]))
# The evaluation summary once workflow/rules/eval.smk is included (an empty list before).
EVAL_SUMMARY = []
# Final outputs; each rule file appends what `rule all` must build.
FINAL_OUTPUTS = []


def src(*modules):
    """Module files behind a stage: listed as inputs so that editing the code reruns the stage
    (the cache key never sees code imported by `python -m`)."""
    return [f"src/eaglet/{m}.py" for m in modules]


def verbatim(value):
    """A params value passed exactly as written. Snakemake formats params *strings* with the job's
    wildcards: user text holding `{name}` (Jinja's `{{ bos_token }}` in Gemma's chat template) stopped
    the DAG with a WildcardError, or would be substituted. A function's value is used as is, and still
    enters the cache key and the rerun triggers."""
    return lambda wildcards: value


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


def conversations_for_tokenize():
    """Regenerated conversations when generation is on, the source ones otherwise."""
    if config["generate"]["enabled"]:
        return f"{RUN}/generate/conversations.parquet"
    return f"{RUN}/prompts/train.parquet"


def extract_layer_ids(wildcards, input):
    """Aux layer ids in vLLM convention: configured, or (2, N//2, N-3) of the target."""
    if config["extract"]["layer_ids"]:
        return json.dumps(config["extract"]["layer_ids"], sort_keys=True)
    n = json.loads(Path(input.identity).read_text())["num_layers"]
    return json.dumps([2, n // 2, n - 3], sort_keys=True)


def train_launcher(wildcards, resources):
    """torchrun with one process per GPU (DDP) when train.gpus > 1, else plain python."""
    n = int(resources.gpu)
    if n > 1:
        return f"python -m torch.distributed.run --standalone --nproc_per_node {n}"
    return "python"
