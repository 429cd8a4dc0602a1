"""drafter.kind p_eagle through the DAG: the tiny random target of config/smoke.yaml; on a copy of the
finished EAGLE-3 smoke run (its prompts, hidden-state store and vocab map), a P-EAGLE drafter trained
on that store (eaglet.train.p_eagle_train) and
exported with its contract run in real vLLM (eaglet.export.p_eagle_export): EAGLE-3's static checks over
the P-EAGLE tensor set and p_eagle.static, p_eagle.parity (vLLM's own module computes the trained
drafter's parallel round piece by piece), then served with method eagle3 and parallel_drafting at
num_speculative_tokens = parallel_k: the known-answer drafter (for a twin of the target, with parallel
drafting) has every first draft accepted, lossless at T = 0, vLLM's counters equal to eaglet's parallel chain
along vLLM's own output, the trained aux layers tapped. SGLang's loader, not built for the kind, is not run
and named in export.accept_not_run; then evaluated offline (the parallel chain) and timed in real vLLM with
parallel drafting (its counters equal to the chain's); the stages not wired for it are not in the DAG and
the parse says so."""

import json
import shutil

import pytest
import yaml

from conftest import REPO, vllm_env_or_skip
from workflow_common import planned_jobs, smk

P_EAGLE = {"kind": "p_eagle", "p_eagle": {"parallel_k": 3}}
NOT_BUILT = ["loader.sglang"]
EXPORT = {"vllm_check": True, "vllm_check_prompts": 2, "vllm_check_max_tokens": 12, "accept_not_run": NOT_BUILT}
# small, as the DFlash DAG test's: three prompts in two sets, 12 tokens, one repeat, vLLM's default (greedy)
# drafting; the HF loop at k 2 and 3 (k_values [2, 5] clipped to K, K always in), vLLM's timed evaluation
# at T = 0 and 1 (evaluate.vllm.k_values does not apply: served at K)
EVALUATE = {"sets": ["mtbench", "heldout"], "num_prompts": {"mtbench": 1, "heldout": 2}, "max_new_tokens": 12,
            "k_values": [2, 5], "repeats": 1, "temperatures": [0.0, 1.0], "stop_at_eos": False,
            "vllm": {"enabled": True, "k_values": [1], "draft_sample_methods": ["greedy"]}}


def test_p_eagle_run_trains_and_exports_a_drafter_vllm_serves_with_parallel_drafting(finished_run, tmp_path):
    """On a copy of the finished EAGLE-3 smoke run (the session's shared run): switching drafter.kind to
    p_eagle reruns train and export only (one store and vocab map serve both kinds), and the export's
    contract passes in real vLLM with parallel drafting, with EAGLE-3's default norms (norm_before_fc,
    norm_output) in the served drafter."""
    vllm_env_or_skip()
    a, cache = finished_run
    wf = tmp_path / "wf"
    shutil.copytree(a, wf, symlinks=True)  # results are links into the shared cache, kept as links
    conf = yaml.safe_load((wf / "config/smoke.yaml").read_text())
    conf["drafter"] = P_EAGLE
    conf["export"] = EXPORT
    conf["train"] = {**conf.get("train", {}), "max_steps": 6, "val_every": 3}
    conf["evaluate"] |= EVALUATE
    (wf / "config/p_eagle.yaml").write_text(yaml.safe_dump(conf))

    _, out = smk(wf, cache, "-n", configfile="config/p_eagle.yaml")
    # the EAGLE-3 run's store, vocab map, data; the offline evaluation of the kind and its summary
    assert planned_jobs(out) == {"train", "export", "evaluate_offline", "evaluate_speculative", "evaluate_vllm",
                                 "eval_summary", "drafter_card", "plots", "provenance"}, out[-3000:]
    not_run = next(line for line in out.splitlines() if "drafter kind p_eagle: NOT RUN" in line)
    names = set(not_run.split("): ", 1)[1].split(" (", 1)[0].split(", "))  # the stages it names NOT RUN
    assert names == {"evaluate_modes", "evaluate_regenerated", "learning_curve"}, not_run
    smk(wf, cache, configfile="config/p_eagle.yaml")

    run = wf / "results/smoke"
    summary = json.loads((run / "train/train_summary.json").read_text())
    assert summary["kind"] == "p_eagle" and summary["steps"] == 6 and summary["layer_ids"] == [2, 4, 5]
    assert summary["parallel_k"] == 3 and summary["selected"]["val_parallel_tau"] is not None
    rep = json.loads((run / "drafter/contract.json").read_text())
    status = {c["name"]: c["status"] for c in rep["checks"]}
    assert status == {
        "static.config_fields": "pass",
        "static.key_set": "pass",
        "static.shapes_dtypes": "pass",
        "static.vocab_map": "pass",
        "static.layer_ids": "pass",
        "p_eagle.static": "pass",
        "p_eagle.parity": "pass",
        "vllm.known_answer": "pass",
        "vllm.lossless": "pass",
        "vllm.acceptance": "pass",
        "vllm.aux_layers": "pass",
        **{n: "not run" for n in NOT_BUILT},
    }, rep
    assert rep["ok"] and rep["parallel_drafting"] and rep["num_speculative_tokens"] == 3
    ka = next(c for c in rep["checks"] if c["name"] == "vllm.known_answer")["details"]
    assert ka["parallel_drafting"] and ka["first_draft_rate"] >= 0.9 and len(ka["accepted_per_pos"]) == 3, ka
    acc = next(c for c in rep["checks"] if c["name"] == "vllm.acceptance")["details"]
    assert acc["vllm"] == acc["chain"] and acc["vllm"]["drafts"] > 0
    cfg = json.loads((run / "drafter/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["parallel_drafting"] is True
    assert cfg["mask_token_id"] == summary["mask_token_id"] and cfg["eaglet"]["num_speculative_tokens"] == 3
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    from eaglet.export.contract.static_checks import variants

    assert variants(cfg) == {"norm_before_fc": True, "norm_before_residual": False, "norm_output": True}, cfg
    # the run's table (what `make run` prints at the end) speaks of the kind
    from eaglet.workflow.summary import table

    rows = {r.split("|")[1].strip(): r for r in table(run) if r.startswith("| ")}
    assert "P-EAGLE, K 3: 6 steps" in rows["train"] and "validation parallel tau" in rows["train"], rows["train"]
    assert "vLLM's counters equal eaglet's parallel chain" in rows["export"], rows["export"]
    # the offline evaluation: the parallel chain at k = K per set, whose counters on the contract's prompts
    # vLLM's equal (above); the summary of the kind with the HF loop named not run
    off = json.loads((run / "eval/offline.json").read_text())
    assert off["kind"] == "p_eagle" and off["parallel_k"] == 3 and off["options"]["k_values"] == [3]
    assert all(v["chain_per_pos"]["3"]["drafts"] > 0 for v in off["sets"].values()), off["sets"]
    # vLLM's timed evaluation serves it with parallel drafting at K: lossless at T = 0, its counters per set
    # equal to the offline parallel chain's (EAGLE-3's sequential drafting from the same weights would
    # accept otherwise), the T = 1 gate against the rule's expectation, paired speedups at both temperatures
    vl = json.loads((run / "eval/vllm.json").read_text())
    assert vl["kind"] == "p_eagle" and vl["parallel_k"] == 3 and vl["options"]["k_values"] == [3], vl["options"]
    assert vl["speculative_extra"] == {"parallel_drafting": True} and vl["lossless"] is True
    assert vl["offline_agreement"]["pass"] and vl["offline_agreement"]["tests"] and not vl["disagreements"]
    assert {t["temperature"] for t in vl["sampled_agreement"]["tests"]} == {1.0} and vl["sampled_agreement"]["pass"]
    assert {(x["k"], x["temperature"]) for x in vl["speedup"]} == {(3, 0.0), (3, 1.0)}
    # the timed HF loop with the parallel proposer: k 2 and 3, lossless, paired at T = 0 and 1
    sp = json.loads((run / "eval/speculative.json").read_text())
    assert sp["kind"] == "p_eagle" and sp["parallel_k"] == 3 and sp["options"]["k_values"] == [2, 3]
    assert sp["prompts"] == 3 and sp["lossless"]["pass"] and sp["lossless"]["compared"] == 6
    assert [x["temperature"] for x in sp["sampling"]] == [1.0]
    ev = json.loads((run / "eval/summary.json").read_text())
    h = ev["headline"]
    assert ev["kind"] == "p_eagle" and "hf_loop" not in h and h["k"] == 3
    # its rounds at every k are the offline parallel chain's walked as the loop walks it
    assert h["lossless_hf_loop"] and h["offline_matches_real_loop"] and ev["agreement"]["compared"] == 6
    assert set(h["tau_offline_chain"]) == set(off["sets"]) and "evaluate" in rows, rows
    eq = ev["served_vs_offline_chain"]
    assert eq["equal"] and set(eq["sets"]) == {"mtbench", "heldout"}, eq
    assert all(v["vllm"]["drafts"] > 0 and v["tau_vllm"] == v["tau_offline_chain"] for v in eq["sets"].values())
    assert h["lossless_vllm"] and h["vllm_counters_equal_offline_chain"] and h["vllm_t_gt0_agrees_with_rule"]
    # the card names the kind and serves it as vLLM takes it (parallel_drafting in the speculative config)
    card = (run / "drafter/README.md").read_text()
    assert "# P-EAGLE drafter for" in card and "- p-eagle" in card and "parallel drafting" in card
    assert '"method": "eagle3"' in card and '"parallel_drafting": True' in card, card  # the Python snippet
    assert '"parallel_drafting": true' in card and '"num_speculative_tokens": 3' in card  # vllm serve's JSON
    assert "vLLM's counters at T = 0 equal the offline parallel chain's" in card and "SGLang: not checked" in card
    assert "- HF loop (eaglet's timed loop on the HF target) paired speedup over plain decoding at T = 0: " in card
    assert "- lossless at T = 0 in the HF loop (k = 2, 3): yes; its rounds equal eaglet's parallel chain's" in card
    assert "- vLLM paired speedup at T = 0" in card and "not measured" not in card
    # the report's plots draw the P-EAGLE trainer's curves, its tables the kind's contract and summary;
    # provenance records every stage's wall time
    assert (run / "plots/training.png").stat().st_size > 10_000
    tables = (run / "plots/tables.html").read_text()
    assert "p_eagle.static" in tables and "vllm.known_answer" in tables and "Results matrix" in tables
    prov = json.loads((run / "provenance.json").read_text())
    assert {"train", "export", "evaluate_vllm", "drafter_card"} <= {r["rule"] for r in prov["stage_wall_times"]}
    assert prov["config"]["drafter"]["kind"] == "p_eagle"
    _, out = smk(wf, cache, "-n", configfile="config/p_eagle.yaml")
    assert "Nothing to be done" in out


def test_p_eagle_parse_refuses_what_the_kind_cannot_do_naming_the_key(tiny_target, tmp_path):
    """What the P-EAGLE trainer and export cannot do stops the parse naming the key; the kind's checks
    that are not built must be named in export.accept_not_run; an accepted config says which stages do
    not run; config/p_eagle.yaml's settings are the kind's."""
    from eaglet.export.p_eagle_format import P_EAGLE_NOT_BUILT, P_EAGLE_VLLM_CHECKS
    from eaglet.planner import plan
    from eaglet.workflow.resolve import P_EAGLE_NOT_RUN, resolve

    def config(**sections):
        c = plan.load_config(REPO / "config/smoke.yaml")
        c["target"].update({"path": str(tiny_target["path"]), "tiny": None})
        c["drafter"] = {"kind": "p_eagle", "p_eagle": dict(c["drafter"]["p_eagle"])}
        c["export"]["accept_not_run"] = [*P_EAGLE_VLLM_CHECKS, *P_EAGLE_NOT_BUILT]  # vllm_check false
        for name, values in sections.items():
            c[name].update(values)
        return c

    R = resolve(config(), tmp_path)
    lines = R.lines()
    assert R.drafter_kind == "p_eagle" and any(", ".join(P_EAGLE_NOT_RUN) in line for line in lines), lines
    assert any("num_speculative_tokens 3" in line and line.startswith("drafter: p_eagle") for line in lines)
    assert any(line.startswith("training TTT attention: recompute (the P-EAGLE") for line in lines), lines
    for sections, key in [
        ({"train": {"hidden_states": "online"}}, "train.hidden_states"),
        ({"export": {"speculators": True}}, "export.speculators"),
        ({"plan": {"learning_curve": True}}, "plan.learning_curve"),
        ({"train": {"gpus": 2}}, "train.gpus"),
    ]:
        with pytest.raises(ValueError, match=f"drafter.kind p_eagle: .*{key}"):
            resolve(config(**sections), tmp_path)
    with pytest.raises(ValueError, match=r"export.accept_not_run: .*'loader.sglang'"):
        resolve(config(export={"accept_not_run": list(P_EAGLE_VLLM_CHECKS)}), tmp_path)
    shipped = plan.load_config(REPO / "config/p_eagle.yaml")
    assert shipped["drafter"]["kind"] == "p_eagle" and shipped["run"] == "smollm2-p_eagle"
    assert sorted(shipped["export"]["accept_not_run"]) == sorted(P_EAGLE_NOT_BUILT)
