"""R5: bad config values fail before any data is read, naming the key.

Part of the fault-injection suite (marker `faults`; docs/guarantees.md, "Fault-injection suite").

One file per kind of fault (R2-R8); shared helpers in tests/faults_common.py.

    .venv/bin/pytest -m faults
"""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import REPO
from faults_common import identity_path

pytestmark = pytest.mark.faults


# =========================================================================== R5: bad config values
BAD_CONFIG = [  # (dotted key, bad value): wrong type, out of range, unknown key, bad choice
    ("run", 7), ("run", ""), ("target.name", None), ("target.dtype", "float8"),
    ("prompts.n", "48"), ("prompts.n", 0), ("prompts.source", "web"), ("prompts.max_turns", 1),
    ("tokenize.max_length", 8), ("tokenize.overlong", "cut"), ("vocab.draft_vocab_size", 1.5),
    ("vocab.pinned", "<think>"), ("extract.layer_ids", [2, 4]), ("extract.layer_ids", [2, 4, 0]),
    ("extract.layer_ids", [2, "4", 6]), ("extract.shards", 0), ("extract.dtype", "int8"),
    ("extract.chunk_mb", 0), ("generate.backend", "sglang"), ("generate.top_p", 1.5),
    ("generate.temperature", -0.1), ("generate.turns", "first"), ("generate.base_urls", "http://x/v1"),
    ("target.vllm.tensor_parallel_size", 0),
    ("target.vllm.dtype", "fp4"), ("target.trust_remote_code", "yes"), ("target.device", "tpu"),
    ("evaluate.hf_loop", "maybe"), ("generate.vllm.package", "vllm-gpu"),
    ("train.ttt_steps", 99), ("train.gamma", 0), ("train.lr", "1e-4"), ("train.oov_rule", "any"),
    ("train.val_fraction", 0.9), ("train.epochs", -1), ("export.num_speculative_tokens", 0),
    ("evaluate.k_values", []), ("evaluate.sets", "mtbench"), ("evaluate.vllm.enabled", "yes"),
    ("vocab.no_such_key", 1), ("generate.vllm.no_such_key", 1), ("no_such_section", {}),
    ("seed", 0),  # read by nothing: each stage has its own seed (prompts.seed, generate.seed, train.seed)
]


@pytest.mark.parametrize("key,value", BAD_CONFIG, ids=[f"{k}={v!r}" for k, v in BAD_CONFIG])
def test_schema_refuses_bad_values_naming_the_key(key, value):
    """The validation Snakemake runs at parse time (common.smk), on a table of bad values: each
    is refused and the message names the key (the config-level test in test_workflow.py runs the
    same through `snakemake -n`)."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    conf = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    node = conf
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    validate(yaml.safe_load((REPO / "config" / "smoke.yaml").read_text()),
             str(REPO / "workflow/schemas/config.schema.yaml"), set_default=True)  # the base is valid
    with pytest.raises(WorkflowError) as e:
        validate(conf, str(REPO / "workflow/schemas/config.schema.yaml"), set_default=True)
    # the key's whole path: the value's own (On instance['prompts']['n']), or an unknown key's
    # parent and name (its last part alone, `n`, is in every message)
    msg = str(e.value)
    where, parent = "".join(f"['{p}']" for p in parts), "".join(f"['{p}']" for p in parts[:-1])
    unknown = f"On instance{parent}:" in msg and f"'{parts[-1]}' was unexpected" in msg
    assert f"On instance{where}" in msg or unknown, msg


def test_layer_id_beyond_the_model_names_the_key(tiny_target, tmp_path):
    """The schema cannot know the target's depth: extraction (the first stage that does) refuses
    layer ids outside [1, N] before reading any data, naming the key."""
    from eaglet.features.extract import extract

    N = tiny_target["num_layers"]
    for bad in ([2, 4, N + 1], [0, 2, 4], [4, 2, 5], [2, 2, 5]):
        with pytest.raises(ValueError, match=r"extract\.layer_ids"):
            extract(tmp_path / "no-tokens-needed.parquet", identity_path(tiny_target), tmp_path / "s", layer_ids=bad)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("stage,config,key", [
    ("generate", {"temperatur": 0.0}, "temperatur"),
    ("generate", {"turns": "first"}, "generate.turns"),
    ("train", {"learning_rate": 1e-3}, "learning_rate"),
    ("train", {"oov_rule": "any"}, "train.oov_rule"),
    ("export", {"vllm_chek": False}, "vllm_chek"),
])
def test_module_level_bad_config_names_the_key(stage, config, key, tiny_target, tmp_path):
    """Each stage checks the config section it receives as JSON (the CLI path, without the
    workflow's schema), naming the key."""
    if stage == "generate":
        from eaglet.generate.generate import resolve_config as check
    elif stage == "train":
        from eaglet.train.train import resolve_params as check
    else:
        from eaglet.export.export import export

        def check(c):
            export(tmp_path / "none.safetensors", tmp_path / "out", identity_path(tiny_target), **c)
    with pytest.raises(ValueError, match=re.escape(key)):
        check(config)
