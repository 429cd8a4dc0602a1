# Config validation and small pure helpers shared by every rule file. Nothing else lives here.
import json
from pathlib import Path

from snakemake.utils import min_version, validate

min_version("9.0")

validate(config, schema="../schemas/config.schema.yaml", set_default=True)

RUN = f"results/{config['run']}"
LOGS = f"logs/{config['run']}"
TARGET_DIR = f"resources/targets/{config['target']['name']}"
TARGET_ID = f"{TARGET_DIR}/identity.json"
# Final outputs; each rule file appends what `rule all` must build.
FINAL_OUTPUTS = []


def src(*modules):
    """Module files behind a stage: listed as inputs so that editing the code reruns the stage
    (the cache key never sees code imported by `python -m`)."""
    return [f"src/eaglet/{m}.py" for m in modules]


def as_json(value):
    """A params value as a JSON string for a CLI flag (quoted with :q in the shell line)."""
    return json.dumps(value, sort_keys=True)


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
