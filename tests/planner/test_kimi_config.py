"""config/kimi-k2.5.yaml dry-runs to the jobs an 8-GPU machine needs, with no model: the target
is a config-only checkpoint folder made here (a Kimi-like config.json: 61 layers, hidden 7168,
vocab 163,840, and small tokenizer files carrying Kimi's chat markers). Prints the hidden-state
storage estimate. A rule missing from the workflow fails the test that needs it, naming the rule."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import snakemake_cmd
from eaglet.hidden.dtypes import bytes_per_token
from eaglet.target.load import default_layer_ids, validate_layer_ids
from kimi_common import HIDDEN, KIMI_MARKERS, NUM_LAYERS, make_config_only_checkpoint
from workflow_common import flag_json, planned

REPO = Path(__file__).resolve().parents[2]
COPY = ["Snakefile", "workflow", "config", "src", "envs", "pyproject.toml"]
KIMI = yaml.safe_load((REPO / "config/kimi-k2.5.yaml").read_text())




@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    wd = root / "repo"
    wd.mkdir()
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, wd / name, ignore=shutil.ignore_patterns("__pycache__", ".venv"))
        else:
            shutil.copy2(src, wd / name)
    ckpt = make_config_only_checkpoint(root / "Kimi-K2.5")
    p = subprocess.run([*snakemake_cmd(), "--list-rules", "--configfile",
                        "config/smoke.yaml"], cwd=wd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rules = {line.strip() for line in p.stdout.splitlines() if line.strip()}
    (root / "cache").mkdir()
    return {"wd": wd, "ckpt": ckpt, "rules": rules, "cache": root / "cache"}


def dry_run(repo, name: str, gpus: int = 8, **overrides) -> tuple[str, list[dict]]:
    """`snakemake -n` on the Kimi config with the test checkpoint (and section overrides), the
    way an 8-GPU machine runs it (`gpus`: the --resources gpu=N the run is given)."""
    conf = json.loads(json.dumps(KIMI))
    conf["target"]["path"] = str(repo["ckpt"])
    assert "generate" in repo["rules"], "rule generate is missing from the workflow"
    for section, values in overrides.items():
        conf[section].update(values)
    (repo["wd"] / f"config/{name}.yaml").write_text(yaml.safe_dump(conf))
    preview = repo["wd"] / f"preview-{name}"  # generate's settings file, written only where asked
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(repo["cache"]), "EAGLET_PREVIEW_SETTINGS": str(preview),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    p = subprocess.run([*snakemake_cmd(), "-n", "-p", "--cores", "32", "--resources",
                        f"gpu={gpus}", "--cache", "--configfile", f"config/{name}.yaml"],
                       cwd=repo["wd"], env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"dry run of {name} failed:\n{out[-6000:]}"
    # The settings the stages are handed: generate's file (a preview writes it only under
    # EAGLET_PREVIEW_SETTINGS, never where a run reads), export's inline on its command line.
    assert not (repo["wd"] / "logs" / conf["run"] / "config").exists(), "a preview wrote a run's settings"
    jobs = {j["rule"]: j for j in planned(out)}
    STAGE_CONFIGS[name] = {
        "generate": json.loads((preview / "logs" / conf["run"] / "config/generate.json").read_text()),
        "extract_load": json.loads((preview / "logs" / conf["run"] / "config/extract_load.json").read_text()),
        "export": flag_json(jobs["export"]["shell"], "--config"),
        "target_model": json.loads(next((preview / "logs/target_model").glob("*.config.json")).read_text())}
    return out, planned(out)


STAGE_CONFIGS: dict[str, dict[str, dict]] = {}


@pytest.fixture(scope="module")
def kimi_plan(repo):
    return dry_run(repo, "kimi")


def test_config_values():
    assert KIMI["vocab"]["draft_vocab_size"] == 32000
    assert set(KIMI_MARKERS) <= set(KIMI["vocab"]["pinned"])
    assert KIMI["prompts"]["n"] == 10000
    v = KIMI["generate"]["vllm"]
    assert KIMI["generate"]["enabled"] and KIMI["generate"]["backend"] == "vllm"
    assert v["package"] == "vllm" and v["reasoning_parser"] == "kimi_k2"
    # how vLLM serves the target: one place (target.vllm), read by generate, export and evaluate_vllm
    t = KIMI["target"]
    assert t["vllm"] == {"tensor_parallel_size": 8, "enable_expert_parallel": True, "dtype": "bfloat16"}
    assert t["trust_remote_code"] is True and t["dtype"] == "bfloat16"
    # every gate on at scale: the in-process evaluation spread over the GPUs, the contract's real vLLM
    # checks on, only the known answer (no twin for this family) waived, by name
    assert KIMI["evaluate"]["hf_loop"] == "auto"
    assert KIMI["export"]["vllm_check"] is True and KIMI["export"]["accept_not_run"] == ["vllm.known_answer"]
    # (2, 30, 58) is vLLM's default for a 61-layer target; the final hidden state is layer 61
    assert KIMI["extract"]["layer_ids"] == default_layer_ids(NUM_LAYERS) == [2, 30, 58]
    assert validate_layer_ids(KIMI["extract"]["layer_ids"], NUM_LAYERS) == [2, 30, 58]
    assert KIMI["extract"]["shards"] * KIMI["extract"]["gpus_per_shard"] == 8
    assert KIMI["train"]["gpus"] == 8


def test_pinned_markers_are_single_tokens_of_the_checkpoint_tokenizer(repo):
    from eaglet.target.load import load_tokenizer

    tok = load_tokenizer(repo["ckpt"])
    for marker in KIMI["vocab"]["pinned"]:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|><think>"


def test_hidden_state_storage_estimate_printed_and_matches_the_config_comment():
    n, max_len = KIMI["prompts"]["n"], KIMI["tokenize"]["max_length"]
    per_tok = bytes_per_token(KIMI["extract"]["dtype"], HIDDEN)
    upper_tb = n * max_len * per_tok / 1e12
    typical_tb = n * 1500 * per_tok / 1e12
    print(f"\n[kimi-k2.5] hidden-state storage ({KIMI['extract']['dtype']}, {per_tok:,} B/token): "
          f"<= {upper_tb:.2f} TB for {n:,} x {max_len:,} tokens; ~{typical_tb:.2f} TB at 1,500 "
          f"tokens per conversation; fp8 halves it ({bytes_per_token('fp8', HIDDEN):,} B/token)")
    text = (REPO / "config/kimi-k2.5.yaml").read_text()
    assert f"{per_tok:,} B/token" in text and f"{upper_tb:.2f} TB" in text and f"{typical_tb:.2f} TB" in text


def test_dry_run_plans_one_job_per_stage(repo, kimi_plan):
    _, jobs = kimi_plan
    counts = {}
    for j in jobs:
        counts[j["rule"]] = counts.get(j["rule"], 0) + 1
    for rule in ("target_model", "prompts", "tokenize", "token_freq", "vocab_map"):
        assert counts.get(rule) == 1, (rule, counts)
    target = next(j for j in jobs if j["rule"] == "target_model")
    assert "--config @logs/target_model/kimi-k2.5.config.json" in target["shell"]
    assert STAGE_CONFIGS["kimi"]["target_model"]["path"] == str(repo["ckpt"])
    vocab = next(j for j in jobs if j["rule"] == "vocab_map")
    assert "--draft-vocab-size 32000" in vocab["shell"] and "<|im_assistant|>" in vocab["shell"]


def test_extraction_is_one_job_over_the_eight_gpus(repo, kimi_plan):
    assert "extract_hidden_states" in repo["rules"], "rule extract_hidden_states is missing from the workflow"
    shards = [j for j in kimi_plan[1] if j["rule"] == "extract_hidden_states"]
    assert len(shards) == KIMI["extract"]["shards"] == 1
    assert shards[0]["resources"].get("gpu") == "8"
    assert "--layer-ids '[2, 30, 58]'" in shards[0]["shell"]


def test_eight_one_gpu_shards_have_distinct_cache_keys(repo):
    """The same config as 8 one-GPU shards: 8 jobs, each gpu=1, each with its own shard index in
    params (the between-workflow cache keys on params, not on wildcards or output paths)."""
    assert "extract_hidden_states" in repo["rules"], "rule extract_hidden_states is missing from the workflow"
    _, jobs = dry_run(repo, "kimi_8shards", extract={"shards": 8, "gpus_per_shard": 1})
    shards = sorted((j for j in jobs if j["rule"] == "extract_hidden_states"), key=lambda j: j["wildcards"])
    assert [j["wildcards"] for j in shards] == [f"shard={i}" for i in range(8)]
    assert all(j["resources"].get("gpu") == "1" for j in shards)
    for i, j in enumerate(sorted(shards, key=lambda j: int(j["wildcards"].split("=")[1]))):
        assert f"--shard {i} --num-shards 8" in j["shell"], j["shell"]
    # with the output paths taken out, what remains (params) still differs per shard
    keys = {re.sub(r"shard_\d+", "shard_X", j["shell"]) for j in shards}
    assert len(keys) == 8


def test_training_is_one_job_on_eight_gpus(repo, kimi_plan):
    assert "train" in repo["rules"], "rule train is missing from the workflow"
    train = [j for j in kimi_plan[1] if j["rule"] == "train"]
    assert len(train) == 1 and train[0]["resources"].get("gpu") == "8"
    shell = train[0]["shell"].replace("=", " ")
    # torchrun, or its module form python -m torch.distributed.run
    assert re.search(r"torchrun|torch\.distributed\.run", shell) and "--nproc_per_node 8" in shell, shell


def test_generation_serves_kimi_with_tensor_parallelism_8(repo, kimi_plan):
    assert "generate" in repo["rules"], "rule generate is missing from the workflow"
    gen = [j for j in kimi_plan[1] if j["rule"] == "generate"]
    assert len(gen) == 1
    assert "--config @logs/kimi-k2.5/config/generate.json" in gen[0]["shell"]
    g = STAGE_CONFIGS["kimi"]["generate"]
    assert g["vllm"]["tensor_parallel_size"] == 8 and g["vllm"]["reasoning_parser"] == "kimi_k2", g["vllm"]
    # The server's tensor-parallel GPUs are the job's: a scheduler must hand them over.
    assert gen[0]["resources"].get("gpu") == "8"


def test_every_gpu_job_takes_its_gpus_through_gpu_slots(repo, kimi_plan):
    """Issue 14: generate declared 8 GPUs but its vLLM server took whatever CUDA showed it, so it
    could land on GPUs an extraction shard held. Every job with a gpu resource starts with the
    slot launcher, asking for that many GPUs (the launcher exports them as CUDA_VISIBLE_DEVICES,
    which the server inherits)."""
    gpu_jobs = [j for j in kimi_plan[1] if int(j["resources"].get("gpu", 0)) > 0]
    assert {j["rule"] for j in gpu_jobs} >= {"generate", "extract_hidden_states", "train", "export",
                                             "evaluate_offline", "evaluate_vllm"}
    for j in gpu_jobs:
        want = f"python -m eaglet.planner.gpu_slots --gpus {j['resources']['gpu']} -- "
        assert j["shell"].startswith(want), (j["rule"], j["shell"][:200])


# What the SLURM job of 2 nodes x 8 GPUs runs: one srun task per node, each a torchrun of 8 ranks
# meeting on the allocation's first node (SLURM_JOB_NODELIST, or squeue's when the executor
# plugin's job step has dropped it). The slot launcher in front defers to SLURM's
# CUDA_VISIBLE_DEVICES, as in every GPU job.
TWO_NODE_LAUNCH = (
    "python -m eaglet.planner.gpu_slots --gpus 16 -- srun --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1"
    " torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint"
    ' "$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(squeue -h -o %N -j "$SLURM_JOB_ID")}"'
    ' | head -n1):29500" -m eaglet.train.train '
)


def test_two_nodes_of_eight_gpus_launch_one_srun_of_torchrun_per_node(repo, kimi_plan):
    """Issue 14: multi-node training is torchrun's, under the scheduler's rendezvous. The dry-run
    shell line of train.nodes = 2 is exactly the launch above, followed by the same eaglet.train.train
    arguments as on one node (nodes is not a training param: the launch carries it); the job
    asks for all 16 GPUs, 2 nodes and the plugin's MPI mode (the rule's own srun starts the
    tasks) with one task per node."""
    assert "train" in repo["rules"], "rule train is missing from the workflow"
    out, jobs = dry_run(repo, "kimi_2nodes", gpus=16, train={"nodes": 2})
    train = [j for j in jobs if j["rule"] == "train"]
    assert len(train) == 1, out[-3000:]
    shell = train[0]["shell"]
    assert shell.startswith(TWO_NODE_LAUNCH), shell[:600]
    one_node = [j for j in kimi_plan[1] if j["rule"] == "train"][0]
    assert shell[len(TWO_NODE_LAUNCH):] == one_node["shell"].split(" -m eaglet.train.train ", 1)[1]
    res = train[0]["resources"]
    assert (res["gpu"], res["nodes"], res["tasks"], res["tasks_per_gpu"], res["mpi"]) == ("16", "2", "2", "0", "srun")
    # one node asks for none of that (the plugin's srun -n1 job step runs it)
    assert not {"nodes", "tasks", "mpi"} & set(one_node["resources"])


def test_evaluation_and_contract_serve_kimi_as_configured(repo, kimi_plan):
    """Issue 14: evaluate_vllm hard-coded float32, no tensor parallelism and no remote code, and the
    HF loop loaded the 1T target in fp32 on the CPU. Now every vLLM engine takes target.vllm and
    target.trust_remote_code (evaluate_vllm on the job's 8 GPUs, the contract's check likewise),
    extraction loads bf16 with remote code. Issue 45, every gate on at scale: the export job holds the
    engine's 8 GPUs for the contract's real-vLLM checks; the untimed in-process stages (the exact chain
    behind vLLM's served-vs-simulated gate, the modes, the regenerated scoring) are planned on the same 8
    GPUs, the target spread over them; the timed HF loop is planned as not run, with the reason."""
    out, jobs = kimi_plan
    by = {j["rule"]: j for j in jobs}
    serving = '"serving": {"dtype": "bfloat16", "enable_expert_parallel": true, "tensor_parallel_size": 8, ' \
              '"trust_remote_code": true}'
    want = {"dtype": "bfloat16", "enable_expert_parallel": True, "tensor_parallel_size": 8, "trust_remote_code": True}
    ev = by["evaluate_vllm"]
    assert serving in ev["shell"], ev["shell"][:600]
    assert ev["resources"].get("gpu") == "8"
    assert ev["shell"].startswith("python -m eaglet.planner.gpu_slots --gpus 8 -- ")
    # export is handed its settings on its command line (--config JSON)
    assert STAGE_CONFIGS["kimi"]["export"]["serving"] == want
    # extract.target_dtype auto on a GPU job: bf16, with the reason (eaglet.base.capability, issue 15),
    # handed in a settings file (the reason is in no key)
    assert STAGE_CONFIGS["kimi"]["extract_load"] == {"device": "auto", "dtype": "bfloat16", "dtype_reason": "GPU job",
                                                     "trust_remote_code": True}
    assert "--target-load @logs/kimi-k2.5/config/extract_load.json" in by["extract_hidden_states"]["shell"]
    ex = by["export"]
    slots8 = "python -m eaglet.planner.gpu_slots --gpus 8 -- "
    assert ex["resources"].get("gpu") == "8" and ex["shell"].startswith(slots8)
    assert STAGE_CONFIGS["kimi"]["export"]["vllm_check"] is True
    assert STAGE_CONFIGS["kimi"]["export"]["accept_not_run"] == ["vllm.known_answer"]
    untimed = ["evaluate_offline"] + [r for r in ("evaluate_regenerated", "evaluate_modes") if r in by]
    for rule in untimed:
        shell = by[rule]["shell"]
        assert '"hf_loop": true' in shell and "spread over the 8 GPUs" in shell, shell[:600]
        assert by[rule]["resources"].get("gpu") == "8" and shell.startswith(slots8)
        assert '"dtype": "bfloat16"' in shell and '"trust_remote_code": true' in shell
    spec = by["evaluate_speculative"]
    assert '"hf_loop": false' in spec["shell"] and "times nothing a server serves" in spec["shell"], spec["shell"][:600]
    assert spec["resources"].get("gpu", "0") == "0"
    assert "evaluation HF loop: runs (evaluate.hf_loop auto: the target spread over the 8 GPUs its vLLM engine" in out
    assert "evaluation HF loop, timed: NOT RUN (evaluate.hf_loop auto: target.vllm.tensor_parallel_size is 8" in out
    gen = STAGE_CONFIGS["kimi"]["generate"]
    assert gen["vllm"]["enable_expert_parallel"] is True and gen["vllm"]["trust_remote_code"] is True, gen["vllm"]
    assert gen["vllm"]["dtype"] == "bfloat16"


def test_hf_loop_false_runs_no_in_process_target_and_says_why(repo):
    out, jobs = dry_run(repo, "kimi_no_hf", evaluate={"hf_loop": False})
    assert "evaluation HF loop: NOT RUN (evaluate.hf_loop: false" in out
    for rule in ("evaluate_offline", "evaluate_speculative"):
        j = next(j for j in jobs if j["rule"] == rule)
        assert '"hf_loop": false' in j["shell"] and '"hf_loop_reason": "evaluate.hf_loop: false' in j["shell"]
        assert j["resources"].get("gpu", "0") == "0"


def test_tokenize_and_evaluation_render_with_the_served_template_kwargs(repo, kimi_plan):
    """generate serves Kimi with chat_template_kwargs {thinking: true}; tokenize and every
    evaluation stage render the template with the same kwargs (the served text), not the
    template's defaults."""
    by = {j["rule"]: j for j in kimi_plan[1]}
    assert KIMI["generate"]["chat_template_kwargs"] == {"thinking": True}
    assert "--chat-template-kwargs='{\"thinking\": true}'" in by["tokenize"]["shell"], by["tokenize"]["shell"]
    for rule in ("evaluate_offline", "evaluate_speculative", "evaluate_vllm"):
        assert '"chat_template_kwargs": {"thinking": true}' in by[rule]["shell"], (rule, by[rule]["shell"][:600])
