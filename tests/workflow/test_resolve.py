"""The parse in one place (eaglet.workflow.resolve): the config resolved once into a frozen object,
the config as written left alone, what was resolved recorded with the reasons; and the helpers the
rule files wire with (eaglet.workflow.params, inputs, train_job). The DAG-level halves: the storage
choice reaching the jobs while provenance records the config as written (tests/train/test_online.py),
and a run writing logs/<run>/resolved.json (tests/workflow/test_workflow.py)."""

import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from eaglet.base.capability import resolve_autocast, resolve_target_dtype
from eaglet.base.content_digests import DigestCache, content_digest
from eaglet.planner import plan, storage
from eaglet.workflow import train_job
from eaglet.workflow.inputs import target_files, target_source, user_digest, user_sets
from eaglet.workflow.params import SettingsFiles, as_json, key_params, settings, verbatim
from eaglet.workflow.resolve import freeze, resolve, thaw

REPO = Path(__file__).resolve().parents[2]


def _smoke_on(target_path, **sections) -> dict:
    """config/smoke.yaml as the workflow holds it (validated, defaults filled), on a local target."""
    config = plan.load_config(REPO / "config/smoke.yaml")
    config["target"].update({"path": str(target_path), "tiny": None})
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def _disk(config) -> dict:
    return storage.figures(config, plan.parse_time_shapes(config))["disk"]


@pytest.mark.parametrize("choice", ["fp8", "online"])
def test_the_storage_choice_is_resolved_and_the_config_stays_as_written(tiny_target, tmp_path, choice):
    """storage.budget_gb picks fp8 offline or online: the jobs' values (R.storage, R.train, the
    trainer's note, the online settings) follow the choice; the config the workflow holds does not."""
    config = _smoke_on(tiny_target["path"])
    need = _disk(config)["offline/fp8" if choice == "fp8" else "online"]
    config["storage"] = {"budget_gb": need * 1.01e-9}
    written = copy.deepcopy(config)
    R = resolve(config, tmp_path)
    assert config == written  # never rewritten
    assert config["train"]["hidden_states"] == "offline" and config["extract"]["dtype"] == "bfloat16"
    mode, dtype = ("offline", "fp8") if choice == "fp8" else ("online", "bfloat16")
    assert (R.storage.mode, R.storage.dtype, R.storage.online) == (mode, dtype, choice == "online")
    assert R.storage.why == R.storage.lines[-1] and R.storage.why.startswith(f"storage: chose {mode}")
    assert "fits storage.budget_gb" in R.storage.why
    assert R.train["hidden_states"] == mode and R.online["dtype"] == dtype
    note = thaw(R.train_note)
    assert note["config"]["train"]["hidden_states"] == mode and note["config"]["extract"]["dtype"] == dtype
    assert note["lines"] == list(R.storage.lines)
    # the memory plan follows the choice (online: no hidden states stored)
    assert ("none stored" in R.plan_lines[0]) == (choice == "online")
    # the trainer's data flags: the online settings inline, or the shards
    if choice == "online":
        flags = train_job.data_args(R)(None, None)
        assert json.loads(flags.split(" ", 1)[1].strip("'")) == thaw(R.online)
        assert train_job.hidden_input(R)(None) == "results/smoke/tokenize/tokens.parquet"
    else:
        assert train_job.hidden_input(R)(None) == ["results/smoke/extract/shard_0"]


def test_the_record_holds_what_was_resolved_with_the_reasons(tiny_target, tmp_path):
    """resolved.json (written when a run starts) for a config: the storage choice and its reason,
    the layer ids and where they come from, the training autocast and the extraction dtype and why,
    and exactly the values the rule files read."""
    config = _smoke_on(tiny_target["path"], extract={"layer_ids": [1, 3, 6]})
    config["storage"] = {"budget_gb": _disk(config)["offline/bfloat16"] * 1.01e-9}
    R = resolve(config, tmp_path)
    R.write_record(tmp_path / "logs/smoke/resolved.json")
    rec = json.loads((tmp_path / "logs/smoke/resolved.json").read_text())
    assert rec == R.record()
    assert rec["storage"]["hidden_states"] == "offline" and rec["storage"]["dtype"] == "bfloat16"
    assert rec["storage"]["why"].startswith("storage: chose offline (bfloat16): ")
    assert "fits storage.budget_gb" in rec["storage"]["why"] and rec["storage"]["lines"][0].startswith("storage: ")
    assert rec["layer_ids"] == [1, 3, 6] and rec["layer_ids_why"] == "extract.layer_ids"
    autocast, why = resolve_autocast("auto", on_gpu=False)
    assert (rec["train_autocast"], rec["train_autocast_why"]) == (autocast, why)
    assert rec["train"]["autocast"] == autocast and rec["train"]["hidden_states"] == "offline"
    assert "nodes" not in rec["train"] and "rdzv_port" not in rec["train"]  # the launcher's instead
    assert "checkpoint_every" in rec["train"] and "checkpoint_every" not in rec["train_keys"]
    # the TTT attention's memory path: the plan's choice (a tiny target fits this machine: saved), the
    # trainer's setting, not a cache key; `snakemake -n` says it with the plan's figures
    assert rec["train"]["ttt_attention"] == "saved" and "ttt_attention" not in rec["train_keys"]
    assert rec["train_ttt_attention_why"].startswith("auto: a training rank ") and "saved fits this machine's" in \
        rec["train_ttt_attention_why"]
    assert "TTT attention saved)" in R.plan_lines[0]
    assert f"training TTT attention: saved ({rec['train_ttt_attention_why']})" in R.lines()
    dtype, dtype_why = resolve_target_dtype("auto", on_gpu=False)
    assert (rec["extract_target_dtype"], rec["extract_target_dtype_why"]) == (dtype, dtype_why)
    assert rec["extract_on_gpu"] is False
    assert rec["extract_load"] == {"dtype": dtype, "dtype_reason": dtype_why, "device": "auto",
                                   "trust_remote_code": False}
    assert rec["target_load"] == {"dtype": "float32", "device": "auto", "trust_remote_code": False}
    assert rec["paths"] == {"run": "results/smoke", "logs": "logs/smoke", "target_dir": "resources/targets/tiny-llama",
                            "target_id": "resources/targets/tiny-llama/identity.json"}
    assert rec["target_source"] == target_source(config["target"])
    assert rec["hf_loop"] is True and rec["hf_loop_why"].startswith("evaluate.hf_loop auto")
    assert rec["tokenize_conversations"] == "results/smoke/generate/conversations.parquet"  # generate.enabled
    assert rec["extract_shards"] == [0] and rec["vllm_gpus"] == 0
    # the lines `snakemake -n` logs
    lines = R.lines()
    assert "aux layer ids: [1, 3, 6]" in lines and f"training autocast: {autocast} ({why})" in lines
    assert f"extraction target forward: {dtype} ({dtype_why})" in lines
    assert lines[:len(R.check_lines) + len(R.storage.lines)] == [*R.check_lines, *R.storage.lines]


def test_a_built_target_before_its_first_job_is_as_configured(tmp_path):
    """The smoke config's built target has no shape before target_model has run: no storage figures,
    the keys as configured, and the record says so; the layer ids are vLLM's default for its depth."""
    config = plan.load_config(REPO / "config/smoke.yaml")
    R = resolve(config, tmp_path)
    assert R.storage.lines == () and (R.storage.mode, R.storage.dtype) == ("offline", "bfloat16")
    assert "as configured" in R.storage.why and "target_model" in R.storage.why
    assert R.layer_ids == (2, 4, 5) and R.layer_ids_why == "vLLM's default for the target"
    assert R.train["ttt_attention"] == "recompute" and "target_model" in R.train_ttt_attention_why
    assert "aux layer ids: [2, 4, 5] (vLLM's default for the target)" in R.lines()
    assert "built by the first job (target_model)" in R.check_lines[0]


def test_resolved_is_frozen_all_the_way_down(tmp_path):
    R = resolve(plan.load_config(REPO / "config/smoke.yaml"), tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        R.layer_ids = (1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        R.storage.mode = "online"
    with pytest.raises(TypeError):
        R.target_load["dtype"] = "bfloat16"
    with pytest.raises(TypeError):
        R.online["target_load"]["device"] = "cuda"
    assert isinstance(R.online["layer_ids"], tuple)
    assert json.loads(json.dumps(R.record())) == R.record()


def test_contradicting_keys_are_refused_naming_them(tmp_path):
    config = plan.load_config(REPO / "config/smoke.yaml")
    config["data"]["mix"], config["generate"]["enabled"] = 0.5, False
    with pytest.raises(ValueError, match=r"data\.mix: 0\.5 asks for a share of regenerated responses"):
        resolve(config, tmp_path)
    config = plan.load_config(REPO / "config/smoke.yaml")
    config["train"]["hidden_states"], config["extract"]["gpus_per_shard"] = "online", 1
    with pytest.raises(ValueError, match="extract.gpus_per_shard: 1 has no effect with train.hidden_states: online"):
        resolve(config, tmp_path)


# --------------------------------------------------------------------------- params
PLAIN = {"lr": 0.001, "vllm": {"dtype": "bfloat16", "extra_args": ["--x", "{y}"]}, "ids": [2, 4, 5], "empty": {}}


def test_key_params_one_entry_per_key_frozen_or_not():
    got = {k: f(None) for k, f in key_params("train", PLAIN).items()}
    assert got == {"train_lr": "lr=0.001", "train_vllm_dtype": 'vllm.dtype="bfloat16"',
                   "train_vllm_extra_args": 'vllm.extra_args=["--x", "{y}"]', "train_ids": "ids=[2, 4, 5]",
                   "train_empty": "empty={}"}
    assert {k: f(None) for k, f in key_params("train", freeze(PLAIN)).items()} == got
    some = {k: f(None) for k, f in key_params("t", PLAIN, ["vllm.dtype"]).items()}
    assert some == {"t_vllm_dtype": 'vllm.dtype="bfloat16"'}


def test_frozen_values_give_the_params_of_their_plain_copy():
    """Snakemake hashes params as JSON (the cache key) and compares them by repr (the rerun trigger,
    which silently drops a value it cannot represent): a frozen value is passed as its plain copy."""
    for make in (as_json, verbatim):
        plain, frozen = make(PLAIN)(None), make(freeze(PLAIN))(None)
        assert plain == frozen and repr(plain) == repr(frozen)
    assert verbatim(freeze(PLAIN))(None) == PLAIN and verbatim("{name}")(None) == "{name}"
    assert settings(freeze(PLAIN))(None, None) == settings(PLAIN)(None, None) == json.dumps(PLAIN, sort_keys=True)
    assert thaw(freeze(PLAIN)) == PLAIN


def test_settings_files_are_written_when_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EAGLET_PREVIEW_SETTINGS", raising=False)
    files = SettingsFiles()
    assert files.file("logs/r/config/a.json", freeze({"b": [1], "a": {"x": 1}})) == "logs/r/config/a.json"
    assert not (tmp_path / "logs").exists()  # a preview writes nothing a run reads
    monkeypatch.setenv("EAGLET_PREVIEW_SETTINGS", str(tmp_path / "preview"))
    files.file("logs/r/config/c.json", {"c": 1})
    assert json.loads((tmp_path / "preview/logs/r/config/c.json").read_text()) == {"c": 1}
    assert not (tmp_path / "logs").exists()
    files.write()  # onstart
    assert (tmp_path / "logs/r/config/a.json").read_text() == '{\n  "a": {\n    "x": 1\n  },\n  "b": [\n    1\n  ]\n}\n'
    files.file("logs/r/config/d.json", {"d": 1})  # evaluated after the run started: written at once
    assert json.loads((tmp_path / "logs/r/config/d.json").read_text()) == {"d": 1}


# --------------------------------------------------------------------------- inputs
def test_target_files_follow_a_local_folders_content(tmp_path):
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text("{}")
    (root / ".cache").mkdir()
    target = {"path": str(root), "tiny": None}
    cache = DigestCache(tmp_path / "digests.json")
    first = target_files(target, cache)
    assert re.fullmatch(r"1 files, 2 bytes, sha256:[0-9a-f]{64}", first), first
    (root / ".cache" / "x").write_text("download state")  # dot-names are not the model
    assert target_files(target, cache) == first
    (root / "chat_template.jinja").write_text("{{ x }}")
    second = target_files(target, cache)
    assert second.startswith("2 files, 9 bytes") and second != first
    os.utime(root / "config.json", ns=(1, 1))  # the same bytes, another mtime: the same content
    assert target_files(target, cache) == second
    (root / "config.json").write_text("[]")  # replaced in place, same size, its mtime set back
    os.utime(root / "config.json", ns=(1, 1))
    assert target_files(target, cache).startswith("2 files, 9 bytes") and target_files(target, cache) != second
    assert target_files({"path": str(tmp_path / "nope"), "tiny": None}) == f"not a local folder: {tmp_path / 'nope'}"
    missing = {"gguf_package": "no_such_package", "gguf_file": "x.gguf"}
    assert target_files(missing) == "not installed: no_such_package/x.gguf"


def test_user_files_are_in_the_params_by_content(tmp_path):
    (tmp_path / "d" / ".git").mkdir(parents=True)
    (tmp_path / "d" / "a.jsonl").write_text("{}")
    (tmp_path / "d" / ".git" / "x").write_text("")
    cache = DigestCache(None)
    folder = user_digest(str(tmp_path / "d"), "prompts.path", cache)
    assert folder == content_digest(tmp_path / "d", cache) and folder.startswith("sha256:")
    relative = user_digest("d/a.jsonl", "prompts.path", cache, base=tmp_path)
    assert relative == content_digest(tmp_path / "d/a.jsonl", cache)
    assert user_digest("org/dataset", "prompts.path", cache) == "" and user_digest(None, "prompts.path", cache) == ""
    with pytest.raises(ValueError, match="prompts.path: 'org/dataset' does not exist"):
        user_digest("org/dataset", "prompts.path", cache, required=True)
    (tmp_path / "s.parquet").write_bytes(b"PAR1")
    sets = user_sets(["mtbench", "heldout", "s.parquet"], "evaluate.sets", cache, base=tmp_path)
    assert sets == (("s.parquet", content_digest(tmp_path / "s.parquet", cache)),)
    with pytest.raises(ValueError, match="evaluate.sets: 'gone.parquet' does not exist"):
        user_sets(["gone.parquet"], "evaluate.sets", cache, base=tmp_path)


def test_train_job_launch_and_resources():
    one = {"gpus": 0, "nodes": 1, "rdzv_port": 29500}
    assert train_job.launcher(one)(None, None) == "python" and train_job.resources(one) == {}
    two = {"gpus": 8, "nodes": 2, "rdzv_port": 29600}
    assert "srun --nodes 2" in train_job.launcher(two)(None, None) and ":29600" in train_job.launcher(two)(None, None)
    assert train_job.resources(two) == {"nodes": 2, "mpi": "srun", "tasks": 2, "tasks_per_gpu": 0}


# --------------------------------------------------------------------------- common.smk
def test_common_smk_only_wires_and_no_rule_file_rewrites_the_config():
    """common.smk holds no function (a setting is computed in eaglet.workflow), and no rule file
    or the Snakefile assigns into the config."""
    common = (REPO / "workflow/rules/common.smk").read_text()
    assert not re.search(r"^\s*def ", common, re.M), "a function in common.smk"
    assert "R = resolve(config, " in common
    for f in [*sorted((REPO / "workflow/rules").glob("*.smk")), REPO / "Snakefile"]:
        text = f.read_text()
        assert not re.search(r"config(\[[^\]]+\])+\s*(=[^=]|\|=|\+=)", text), f"{f.name} writes into the config"
        assert not re.search(r"config(\[[^\]]+\])*\.(update|setdefault|pop)\(", text), f"{f.name} changes the config"
