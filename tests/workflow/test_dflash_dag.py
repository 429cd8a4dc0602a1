"""drafter.kind dflash through the DAG (issue 44): the tiny random target of config/smoke.yaml, as a user
runs config/dflash.yaml beside the default: a run of its own name on the finished EAGLE-3 smoke run's
output cache (the session's shared run), served the target, prompts, generation, tokens, vocabulary map
and hidden-state store from it (none of those stages runs: eaglet.workflow.cache_key), then a DFlash
drafter trained on that store (eaglet.train.dflash_train) and
exported with its contract run in real vLLM (eaglet.export.dflash_export): the static check, parity
with vLLM's own module, and the served check (method dflash at k = block_size − 1: lossless, vLLM's
counters equal to eaglet's block chain), then evaluated: offline (the exact block chain at T = 0 with the
HF target, the expectation at T = 1, eaglet.eval.dflash_offline), the timed HF loop (eaglet.engines.dflash_loop
at the run's k_values up to block_size − 1, lossless at T = 0, paired speedups over plain decoding at T = 0
and 1) and served by vLLM with method dflash at k = block_size − 1 at T = 0 and 1, timed in pairs with plain
decoding; the summary (the HF loop's speedups and rounds equal to the block chain's, vLLM's counters at T = 0
equal to the offline chain's, the matrix per domain), the drafter card naming the kind, the report's plots
(the DFlash trainer's curves) and the provenance.
vllm.known_answer runs for the kind (a known-answer DFlash drafter on a twin, every first draft accepted);
SGLang's loader does not apply to it, is not run and named in export.accept_not_run; the stages
not wired for it (the modes, the regenerated sets, the learning curve) are not in the DAG and the parse
says so."""

import json

import pytest
import yaml

from conftest import REPO, clone, vllm_env_or_skip
from workflow_common import planned_jobs, smk

DFLASH = {"kind": "dflash", "dflash": {"block_size": 4, "num_layers": 1, "num_anchors": 64}}
EXPORT = {"vllm_check": True, "vllm_check_prompts": 2, "vllm_check_max_tokens": 12,
          "accept_not_run": ["loader.sglang"]}
# small: three prompts in two sets, 12 tokens, one repeat, vLLM's default (greedy) drafting only; the HF loop
# at k 2 and 3 (k_values [2, 5] clipped to the block, block_size - 1 always in)
EVALUATE = {"sets": ["mtbench", "heldout"], "num_prompts": {"mtbench": 1, "heldout": 2}, "max_new_tokens": 12,
            "k_values": [2, 5], "repeats": 1, "temperatures": [0.0, 1.0], "stop_at_eos": False,
            "vllm": {"enabled": True, "k_values": [1, 2], "draft_sample_methods": ["greedy"]}}


# the stages whose outputs the EAGLE-3 run cached, and where each one's log would be
DATA_LOGS = ["prompts.log", "generate.log", "tokenize.log", "token_freq.log", "vocab_map.log",
             "extract_hidden_states/shard_0.log"]


# the shared smoke run's build is charged to whichever of its tests comes first (~130 s here)
@pytest.mark.timeout(1200)
def test_dflash_run_trains_exports_and_evaluates_a_drafter_vllm_serves(finished_run, tmp_path):
    vllm_env_or_skip()
    _, cache = finished_run  # the EAGLE-3 smoke run's output cache, shared (the run itself is not touched)
    wf = clone(tmp_path / "wf")
    conf = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    conf["run"] = "smoke-dflash"
    conf["drafter"] = DFLASH
    conf["export"] = EXPORT
    conf["train"] |= {"max_steps": 6, "val_every": 3, "checkpoint_every": 3}
    conf["evaluate"] |= EVALUATE  # evaluate.vllm.k_values does not apply: DFlash is served at k = 3
    (wf / "config/dflash.yaml").write_text(yaml.safe_dump(conf))

    _, out = smk(wf, cache, "-n", configfile="config/dflash.yaml")
    assert planned_jobs(out) == {"target_model", "prompts", "generate", "tokenize", "token_freq", "vocab_map",
                                 "extract_hidden_states", "train", "export", "evaluate_offline",
                                 "evaluate_speculative", "evaluate_vllm", "eval_summary", "drafter_card", "plots",
                                 "provenance"}
    not_run = next(line for line in out.splitlines() if "drafter kind dflash: NOT RUN" in line)
    assert "evaluate_modes: per chat-template" in not_run and "evaluate_speculative" not in not_run
    assert "plots:" not in not_run and "provenance:" not in not_run and "the plots and the provenance" in not_run
    smk(wf, cache, configfile="config/dflash.yaml")

    run = wf / "results/smoke-dflash"
    # the data stages and the extraction were the EAGLE-3 run's cache entries: none of them ran here
    ran = [name for name in DATA_LOGS if (wf / "logs/smoke-dflash" / name).exists()
           and (wf / "logs/smoke-dflash" / name).stat().st_size]
    assert not ran, ran
    chunks = list((run / "extract/shard_0").glob("chunk_*"))  # a restored folder: its files are links
    assert chunks and all(c.is_symlink() for c in chunks) and (run / "tokenize/tokens.parquet").is_symlink()
    summary = json.loads((run / "train/train_summary.json").read_text())
    assert summary["kind"] == "dflash" and summary["steps"] == 6 and summary["layer_ids"] == [2, 4, 5]
    rep = json.loads((run / "drafter/contract.json").read_text())
    status = {c["name"]: c["status"] for c in rep["checks"]}
    assert status == {"dflash.static": "pass", "dflash.parity": "pass", "vllm.known_answer": "pass",
                      "vllm.lossless": "pass", "vllm.acceptance": "pass", "loader.sglang": "not run"}, rep
    assert rep["ok"] and rep["method"] == "dflash" and rep["num_speculative_tokens"] == 3
    assert [r["name"] for r in rep["not_run"]] == ["loader.sglang"]
    known = next(c for c in rep["checks"] if c["name"] == "vllm.known_answer")["details"]
    assert known["first_draft_rate"] == 1.0 and known["output_is_known_chain"] and known["kind"] == "dflash"
    assert known["layer_ids"] == [2, 4, 5] and known["mask_token_id"] == summary["mask_token_id"] and known["k"] == 3
    acc = next(c for c in rep["checks"] if c["name"] == "vllm.acceptance")["details"]
    assert acc["vllm"] == acc["chain"] and acc["vllm"]["drafts"] > 0
    cfg = json.loads((run / "drafter/config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": summary["mask_token_id"], "target_layer_ids": [1, 3, 4]}
    assert cfg["eaglet"]["num_speculative_tokens"] == 3 and cfg["num_hidden_layers"] == 1

    # offline: the block chain at k = block_size - 1 only; vLLM: method dflash at that k, lossless at T = 0
    ev = run / "eval"
    off = json.loads((ev / "offline.json").read_text())
    assert off["kind"] == "dflash" and off["options"]["k_values"] == [3] and off["prompts"] == 3
    vl = json.loads((ev / "vllm.json").read_text())
    assert vl["kind"] == "dflash" and vl["options"]["k_values"] == [3] and vl["lossless"] is True
    # the T = 0 gate (vLLM's per-position acceptance against the offline chain) passes, and at T = 1 the
    # test against the served rule's expectation
    assert vl["offline_agreement"]["pass"] and vl["offline_agreement"]["tests"] and not vl["disagreements"]
    assert {t["temperature"] for t in vl["sampled_agreement"]["tests"]} == {1.0}
    # a gate for DFlash too since eaglet mends vLLM-CPU's verifier (evaluate_vllm's docstring)
    assert vl["sampled_agreement"]["pass"] and "dflash_t_gt0_disagreements" not in vl
    # T = 1 drafts were verified with eaglet's mend of vLLM-CPU's verifier in the engine's own process
    # (eaglet.engines.vllm_verifier_fix); the card says so where the installed vLLM needed it
    fix = vl["verifier_fix"]
    assert fix["processes"] >= 1 and fix["mended_expand"] is not None and isinstance(fix["defect"], bool), fix
    assert {(x["k"], x["temperature"]) for x in vl["speedup"]} == {(3, 0.0), (3, 1.0)}
    # the timed HF loop: the run's k_values [2, 5] within the block and 3, lossless, paired at T = 0 and 1
    sp = json.loads((ev / "speculative.json").read_text())
    assert sp["kind"] == "dflash" and sp["options"]["k_values"] == [2, 3] and sp["prompts"] == 3
    assert sp["lossless"]["pass"] and sp["lossless"]["compared"] == 6 and sp["layer_ids"] == [2, 4, 5]
    assert [x["temperature"] for x in sp["sampling"]] == [1.0]
    # the served counters at T = 0 are exactly the offline block chain's, per set
    s = json.loads((ev / "summary.json").read_text())
    eq = s["served_vs_offline_chain"]
    assert eq["equal"] and set(eq["sets"]) == {"mtbench", "heldout"}, eq
    assert all(v["vllm"]["drafts"] > 0 and v["tau_vllm"] == v["tau_offline_chain"] for v in eq["sets"].values())
    h = s["headline"]
    assert h["kind"] == "dflash" and h["k"] == 3 and h["lossless_vllm"] and h["vllm_counters_equal_offline_chain"]
    # the HF loop's figures at k = 3: its rounds at every k are the block chain's, speedups per temperature
    assert "hf_loop" not in h and h["lossless_hf_loop"] and h["offline_matches_real_loop"]
    assert s["agreement"]["compared"] == 6 and h["speedup_hf_loop"] == sp["overall"]["k"]["3"]["speedup"]
    assert [(x["temperature"], x["rule"]) for x in h["speedup_hf_loop_by_temperature"]] == [
        (0.0, None), (1.0, "probabilistic")]
    assert all(x["estimate"] and x["lo"] is not None for x in h["speedup_hf_loop_by_temperature"])
    # matrix rows per domain: the chain and vLLM at T = 0, each served rule's expectation and vLLM at T = 1
    domains = {r["domain"] for r in s["matrix"] if r["domain"] != "all"}
    assert len(domains) >= 2 and {r["k"] for r in s["matrix"]} == {2, 3}
    assert {r["k"] for r in s["matrix"] if r["engine"] != "hf_loop"} == {3}
    for engine, T in (("chain", 0.0), ("hf_loop", 0.0), ("vllm", 0.0), ("expected", 1.0), ("hf_loop", 1.0),
                      ("vllm", 1.0)):
        assert {r["domain"] for r in s["matrix"] if r["engine"] == engine and r["temperature"] == T} >= domains
    card = (run / "drafter/README.md").read_text()
    assert ("measured with eaglet's mend of vLLM-CPU's verifier" in card) == fix["defect"]
    assert "# DFlash drafter for" in card and "block size 4" in card and "- dflash" in card
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 3' in card and "EAGLE3" not in card
    assert "- HF loop (eaglet's timed loop on the HF target) paired speedup over plain decoding at T = 0: " in card
    assert "at T = 1 (sampled drafts): " in card and "not measured" not in card
    assert "- lossless at T = 0 in the HF loop (k = 2, 3): yes; its rounds equal eaglet's block chain's" in card
    # the report's plots draw the DFlash trainer's curves (block loss, per-position accuracy, block τ) and
    # its tables the kind's contract and summary; provenance records every stage's wall time
    import pyarrow.parquet as pq

    assert (run / "plots/training.png").stat().st_size > 10_000 and (run / "plots/coverage.png").exists()
    tables = (run / "plots/tables.html").read_text()
    assert "dflash.parity" in tables and "vllm.known_answer" in tables and "Results matrix" in tables
    assert pq.read_table(run / "train/metrics.parquet").column_names.count("block_tau") == 1
    prov = json.loads((run / "provenance.json").read_text())
    assert {"train", "export", "eval_summary", "drafter_card"} <= {r["rule"] for r in prov["stage_wall_times"]}
    assert prov["config"]["drafter"]["kind"] == "dflash"
    # the run's table (what `make run` prints at the end) speaks of the kind
    from eaglet.workflow.summary import table

    rows = {r.split("|")[1].strip(): r for r in table(run) if r.startswith("| ")}
    assert "DFlash, block 4: 6 steps" in rows["train"] and "validation block tau" in rows["train"], rows["train"]
    assert "NOT proven" not in rows["train"] and "vLLM's counters equal eaglet's block chain" in rows["export"]
    assert "HF loop τ equals the offline chain" in rows["evaluate"] and "lossless: HF loop yes, vLLM yes" in \
        rows["evaluate"] and "NOT RUN" not in rows["evaluate"], rows["evaluate"]
    _, out = smk(wf, cache, "-n", configfile="config/dflash.yaml")
    assert "Nothing to be done" in out


def test_dflash_parse_refuses_what_the_kind_cannot_do_naming_the_key(tiny_target, tmp_path):
    """What the DFlash trainer and export cannot do stops the parse naming the key; an accepted
    config says which stages do not run for the kind; kind eagle3 adds no line."""

    from eaglet.export.contract.dflash_parity import DFLASH_NOT_APPLICABLE, DFLASH_VLLM_CHECKS
    from eaglet.export.contract.record import VLLM_CHECKS
    from eaglet.planner import plan
    from eaglet.workflow.resolve import DFLASH_NOT_RUN, resolve

    def config(**sections):
        c = plan.load_config(REPO / "config/smoke.yaml")
        c["target"].update({"path": str(tiny_target["path"]), "tiny": None})
        c["drafter"] = {"kind": "dflash", "dflash": dict(c["drafter"]["dflash"])}
        c["export"]["accept_not_run"] = [*DFLASH_VLLM_CHECKS, *DFLASH_NOT_APPLICABLE]  # vllm_check false
        for name, values in sections.items():
            c[name].update(values)
        return c

    R = resolve(config(), tmp_path)
    assert R.drafter_kind == "dflash" and any(", ".join(DFLASH_NOT_RUN) in line for line in R.lines())
    # the lines speak of the kind: vLLM's verdict for a DFlash drafter, the DFlash trainer's memory
    lines = R.lines()
    assert any("vLLM serving of a DFlash drafter" in line for line in lines), lines  # (no vLLM in tmp_path)
    assert not any("EAGLE-3 drafter" in line for line in lines), lines
    assert any(line.startswith("memory plan:") and "DFlash" in line for line in lines), lines
    assert "training TTT attention: not used (drafter.kind dflash trains blocks, no TTT unroll)" in lines
    # several ranks: the DFlash trainer's DDP, launched as EAGLE-3's (tests/train/test_dflash_train.py)
    assert resolve(config(train={"gpus": 2}), tmp_path).train["gpus"] == 2
    for sections, key in [({"train": {"hidden_states": "online"}}, "train.hidden_states"),
                          ({"export": {"speculators": True}}, "export.speculators"),
                          ({"plan": {"learning_curve": True}}, "plan.learning_curve")]:
        with pytest.raises(ValueError, match=f"drafter.kind dflash: .*{key}"):
            resolve(config(**sections), tmp_path)
    # the kind's own checks that will not run must be named (EAGLE-3's names do not cover them)
    with pytest.raises(ValueError, match=r"export.accept_not_run: .*\['dflash.parity', 'loader.sglang'\]"):
        resolve(config(export={"accept_not_run": ["vllm.lossless", "vllm.acceptance", "vllm.known_answer"]}),
                tmp_path)
    c = config()
    c["drafter"]["kind"] = "eagle3"
    c["export"]["accept_not_run"] = list(VLLM_CHECKS)
    assert resolve(c, tmp_path).drafter_lines == ()
