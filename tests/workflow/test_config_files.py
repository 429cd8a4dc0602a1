"""The files in config/: each one validates as Snakemake reads it (over config/config.yaml, the
Snakefile's own config file), the data choice of each is its own, and config/long.yaml is the
default with more data and nothing else changed."""

from pathlib import Path

import pytest

from eaglet.planner import plan

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (REPO / "config").glob("*.yaml"))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_validates_over_the_default(name):
    config = plan.load_config(REPO / "config" / name)
    assert config["run"] and 0 <= config["data"]["mix"] <= 1


def test_the_default_trains_on_the_dataset_answers_and_the_others_say_their_own():
    """config.yaml's data.mix 0.0 would reach every config that leaves the key out: each one that
    was written for regenerated data states it."""
    assert plan.load_config(REPO / "config/config.yaml")["data"]["mix"] == 0.0
    for name in ("smoke.yaml", "kimi-k2.5.yaml", "gemma3-270m.yaml", "gpu-check.yaml"):
        assert plan.load_config(REPO / "config" / name)["data"]["mix"] == 1.0, name


def test_long_is_the_default_with_more_data_and_fewer_epochs():
    default = _flat(plan.load_config(REPO / "config/config.yaml"))
    long = _flat(plan.load_config(REPO / "config/long.yaml"))
    changed = {k for k in default.keys() | long.keys() if default.get(k) != long.get(k)}
    assert changed == {"run", "prompts.n", "train.epochs", "train.checkpoint_every", "train.val_every"}, changed
    assert long["prompts.n"] >= 5 * default["prompts.n"] and long["train.epochs"] < default["train.epochs"]
