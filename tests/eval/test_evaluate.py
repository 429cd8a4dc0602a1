"""The evaluation stages: eval set loaders, the exact offline simulator, the real speculative loop
(lossless, and token-for-token the same accepted counts as the simulator), hand-computed τ."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from eaglet.base import datasets
from eaglet.base.conversations import write_conversations
from eaglet.base.files import read_json, read_parquet, write_parquet
from eaglet.drafter import chain
from eaglet.engines.hf_loop import speculative
from eaglet.eval.evaluate_modes import evaluate_modes
from eaglet.eval.evaluate_offline import evaluate_offline, offline_sampling
from eaglet.eval.evaluate_speculative import LosslessError, evaluate_speculative, timing_order
from eaglet.eval.options import hf_options

pytestmark = pytest.mark.usefixtures("one_thread")




# --------------------------------------------------------------------------- eval sets
def test_eval_sets_hold_80_mtbench_first_turns_and_164_humaneval_prompts():
    mt, he = datasets.load_set("mtbench"), datasets.load_set("humaneval")
    assert len(mt) == 80 and len(he) == 164
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in mt + he)
    assert len({r["id"] for r in mt}) == 80 and mt[0]["id"] == "mtbench/81"
    assert "def has_close_elements" in he[0]["messages"][0]["content"]
    # a subset spans the categories instead of taking the first ten (all "writing")
    cats = {r["source"] for r in datasets.load_set("mtbench", 10)}
    assert len(cats) >= 7


def test_parquet_set_is_the_prompt_up_to_the_last_user_turn(tmp_path):
    rows = [{"id": "a", "source": "s", "messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"}]},
        {"id": "b", "source": "s", "messages": [{"role": "assistant", "content": "orphan"}]}]
    write_conversations(tmp_path / "c.parquet", rows)
    got = datasets.load_set(str(tmp_path / "c.parquet"))
    assert [r["id"] for r in got] == ["a"]  # no user turn: nothing to answer
    assert [m["content"] for m in got[0]["messages"]] == ["sys", "u1", "a1", "u2"]
    with pytest.raises(ValueError, match="unknown set"):
        datasets.load_set("gsm9k")


# --------------------------------------------------------------------------- counting (hand-computed)
def test_chain_replay_and_tau_match_a_hand_computed_example():
    # accepted prefix of K=3 drafts from each round start g (index 0 unused); 10 tokens, max 10
    acc = [0, 2, 0, 1, 3, 0, 1, 0, 1, 0]
    # k=2: g=1 a=2 -> g=4 a=min(3,2)=2 -> g=7 a=0 -> g=8 k_eff=min(2,10-8-1)=1 a=1 -> g=10 stop
    assert chain.chain_replay(acc, 10, 10, 2) == [(1, 2, 2), (4, 2, 2), (7, 2, 0), (8, 1, 1)]
    assert chain.rounds_tau(chain.chain_replay(acc, 10, 10, 2)) == pytest.approx(1 + 5 / 4)
    # k=1: every round drafts 1 (the last possible start g=8 drafts min(1, 1))
    r1 = chain.chain_replay(acc, 10, 10, 1)
    assert r1 == [(1, 1, 1), (3, 1, 1), (5, 1, 0), (6, 1, 1), (8, 1, 1)]
    # a continuation that ended at EOS (6 tokens of max 10): the last round can't pass the end
    assert chain.chain_replay([0, 4, 0, 0, 0, 1], 6, 10, 4) == [(1, 4, 4)]
    # rounds without drafts (k_eff 0) do not count in τ
    assert chain.rounds_tau([(1, 0, 0)]) is None


def test_position_rates_and_all_position_tau_by_hand():
    acc, valid = [3, 0, 1, 2], [5, 5, 2, 1]
    pr = chain.position_rates(acc, valid, 3)
    assert pr["starts_per_pos"] == [4, 3, 2]
    assert pr["accept_rate_per_pos"] == [3 / 4, 1 / 3, 1 / 2]  # pos 2: starts 0, 1, 2 reach it
    assert pr["conditional_accept_per_pos"][1] == pytest.approx((1 / 3) / (3 / 4))
    # k=2 uses the starts with >= 2 positions left: accepted 3, 0, 1 capped at 2
    assert chain.tau_all_positions(acc, valid, 2) == pytest.approx(1 + (2 + 0 + 1) / 3)
    assert chain.accepted_prefix([5, 6, 7], [5, 6, 8]) == 2 and chain.accepted_prefix([5, 6], [5]) == 1


# --------------------------------------------------------------------------- the stages
# Four domains: MT-Bench (two categories), HumanEval, the math set, a held-out conversation file
NUM = {"mtbench": 2, "humaneval": 1, "math": 1, "heldout": 2}
OPTS = dict(num_prompts=NUM, max_new_tokens=16, k_values=[1, 2, 3], repeats=2)
N_PROMPTS = sum(NUM.values())


def heldout_parquet(folder: Path) -> str:
    rows = [{"id": f"h{i}", "source": "heldout", "messages": [{"role": "user", "content": q}]}
            for i, q in enumerate(["Name three rivers in Europe.", "Why is the sky blue?"])]
    write_conversations(folder / "heldout.parquet", rows)
    return str(folder / "heldout.parquet")


@pytest.fixture(scope="module")
def stages(tiny_target, tiny_drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    ident = Path(tiny_target["path"]).parent / "identity.json"
    sets = ["mtbench", "humaneval", "math", heldout_parquet(tmp_path_factory.mktemp("heldout"))]
    off = evaluate_offline(tiny_drafter, ident, sets, out, threads=1, **OPTS)
    spec = evaluate_speculative(tiny_drafter, ident, sets, out, threads=1, **OPTS)
    return out, off, spec, sets


def test_stages_write_their_artifacts_and_agree(stages):
    out, off, spec, _ = stages
    # τ(k=3) is the mean accepted prefix (capped at 3) over the starts with 3 tokens left, from the
    # per-position rows it was computed from: a count that drifts from its rows fails here
    pos_rows = pd.read_parquet(out / "offline_positions.parquet")
    full = pos_rows[pos_rows["valid"] >= 3]
    assert len(full) > 0
    assert json.loads((out / "offline.json").read_text())["overall"]["tau"]["3"] == pytest.approx(
        1 + full["accepted"].clip(upper=3).mean())
    assert set(off["sets"]) == set(spec["sets"]) == {"mtbench", "humaneval", "math", "heldout"}
    assert off["prompts"] == spec["prompts"] == N_PROMPTS
    assert spec["lossless"]["pass"] and spec["lossless"]["compared"] == 3 * N_PROMPTS
    a = pd.read_parquet(out / "offline_rounds.parquet").sort_values(["id", "k", "g"]).reset_index(drop=True)
    b = pd.read_parquet(out / "speculative_rounds.parquet").sort_values(["id", "k", "g"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    pos = pd.read_parquet(out / "offline_positions.parquet")
    assert {"set", "id", "g", "accepted", "valid", "drafter_margin", "target_margin"} <= set(pos.columns)
    costs = spec["step_costs"]
    assert costs["target_step_s"] > 0 and costs["draft_step_s"] > 0 and 4 in costs["target_forward_s"]
    for k in ("1", "2", "3"):
        assert spec["overall"]["k"][int(k)]["speedup"] > 0
        assert off["overall"]["tau_chain"][int(k)] == spec["overall"]["k"][int(k)]["tau"]


def test_speculative_stage_records_paired_interleaved_repeats(stages):
    """The speedup is not one unpaired timing: every prompt has `repeats` blocks, each timing
    greedy and every k back to back in a rotating order, and the figures are paired ratios."""
    out, _, spec, _ = stages
    rows = json.loads((out / "speculative.json").read_text())["per_prompt"]
    assert len(rows) == N_PROMPTS and spec["timing"]["repeats"] == 2
    # how busy the machine was meanwhile is recorded; when busy, no speedup claims a conclusion
    load = spec["timing"]["load"]
    assert load["cpus"] >= 1 and 0 <= load["other_cpu_share"] <= 1 and isinstance(load["busy"], bool)
    if load["busy"]:
        assert not any(v["speedup_ci"]["conclusive"] for v in spec["overall"]["k"].values())
    for i, row in enumerate(rows):
        blocks = row["samples"]
        assert [b["repeat"] for b in blocks] == [0, 1]
        for b in blocks:
            assert sorted(map(str, b["order"])) == ["1", "2", "3", "greedy"]  # one block: all of them
            assert b["greedy_s"] > 0 and set(map(int, b["spec_s"])) == {1, 2, 3}
        assert blocks[0]["order"] != blocks[1]["order"]  # the order rotates between repeats
        assert blocks[0]["order"] == timing_order(["greedy", 1, 2, 3], i, 0)
        for k in ("1", "2", "3"):
            pairs = [b["greedy_s"] / b["spec_s"][k] for b in blocks]
            assert row["k"][k]["speedup_samples"] == pytest.approx(pairs)
            assert row["k"][k]["speedup"] == pytest.approx(sorted(pairs)[0] / 2 + sorted(pairs)[1] / 2)
    for k, v in json.loads((out / "speculative.json").read_text())["overall"]["k"].items():
        ci = v["speedup_ci"]
        assert ci["estimate"] == pytest.approx(float(pd.Series([r["k"][k]["speedup"] for r in rows]).median()))
        assert ci["n"] == N_PROMPTS and ci["lo"] <= ci["estimate"] <= ci["hi"]
        assert isinstance(ci["conclusive"], bool) and ci["note"]
        assert v["tau_ci"]["estimate"] == pytest.approx(v["tau"])


def test_timing_order_rotates_every_configuration_through_every_slot():
    cfgs = ["greedy", 1, 2, 3]
    orders = [timing_order(cfgs, 0, r) for r in range(4)]
    assert orders[0] == cfgs and orders[1] == [1, 2, 3, "greedy"]
    for slot in range(4):
        assert {o[slot] for o in orders} == set(cfgs)
    assert timing_order(cfgs, 1, 0) == timing_order(cfgs, 0, 1)  # the next prompt starts one on


def test_tau_per_domain_with_intervals_in_the_stages_the_summary_and_the_report(stages, tmp_path):
    from eaglet.eval.eval_summary import summarise
    from eaglet.report import plots

    out, off, spec, _ = stages
    got = json.loads((out / "offline.json").read_text())["domains"]
    cats = {p["source"] for p in datasets.load_set("mtbench", 2)}
    assert set(got) == cats | {"humaneval", "math", "heldout"} and len(cats) == 2
    assert got["heldout"]["prompts"] == 2 and got["math"]["set"] == "math"
    for v in got.values():
        t = v["tau"]["3"]
        assert {"estimate", "lo", "hi", "level", "n", "conclusive", "note"} <= set(t)
        if v["prompts"] == 1:  # one prompt: no interval, and it says so
            assert t["lo"] is None and t["conclusive"] is False and "no interval" in t["note"]
        else:
            assert t["lo"] <= t["estimate"] <= t["hi"]
    assert set(spec["domains"]) == set(got)
    summarise(out)
    h = json.loads((out / "summary.json").read_text())["headline"]
    assert set(h["tau_by_domain"]) == set(got)
    assert h["tau_by_domain"]["heldout"]["ci"] == [got["heldout"]["tau"]["3"]["lo"], got["heldout"]["tau"]["3"]["hi"]]
    plots.tables_html(tmp_path / "tables.html", evaluation=out / "summary.json")
    page = (tmp_path / "tables.html").read_text()
    assert "τ per domain" in page and "mtbench/" in page and ">math<" in page and ">heldout<" in page


def test_both_temperatures_in_the_matrix_the_sampling_figures_and_the_summary(stages):
    """T = 0 keeps today's figures; T = 1 adds the expected chain offline and the measured sampling
    loop, and every stage's matrix rows reach summary.json, per set, per domain, per k."""
    from eaglet.eval import stats
    from eaglet.eval.eval_summary import summarise

    out, off, spec, _ = stages
    assert off["options"]["temperatures"] == [0.0, 1.0] and [s["temperature"] for s in off["sampling"]] == [1.0]
    rows = json.loads((out / "offline.json").read_text())["matrix"] + \
        json.loads((out / "speculative.json").read_text())["matrix"]
    assert all(tuple(r) == stats.MATRIX_KEYS for r in rows)
    cells = {(r["engine"], r["temperature"]) for r in rows}
    assert cells == {("chain", 0.0), ("expected", 1.0), ("hf_loop", 0.0), ("hf_loop", 1.0)}
    domains = set(off["domains"]) | {"all"}
    for cell in cells:
        mine = [r for r in rows if (r["engine"], r["temperature"]) == cell]
        assert {r["domain"] for r in mine} == domains and {r["k"] for r in mine} == {1, 2, 3}
        assert {r["set"] for r in mine if r["domain"] == "all"} == set(off["sets"]) | {"all"}
    by = {(r["engine"], r["temperature"], r["set"], r["domain"], r["k"], r["rule"]): r for r in rows}
    assert len(by) == len(rows)  # the rule tells the two expected rows of a cell apart
    assert {r["rule"] for r in rows if r["temperature"] == 0} == {"greedy"}
    assert {(r["engine"], r["rule"]) for r in rows if r["temperature"] == 1} == {
        ("expected", "greedy"), ("expected", "probabilistic"), ("hf_loop", "probabilistic")}
    smp_off, smp_spec = off["sampling"][0], spec["sampling"][0]
    for k in (1, 2, 3):
        # the T = 0 rows are today's figures, where they always were
        assert by["chain", 0.0, "all", "all", k, "greedy"]["tau"] == pytest.approx(off["overall"]["tau_chain"][k])
        assert by["hf_loop", 0.0, "all", "all", k, "greedy"]["tau"] == pytest.approx(spec["overall"]["k"][k]["tau"])
        # expected τ pooled from the per-prompt (Σ expected accepted, starts) written beside the texts
        pairs = [p["sampling"]["1.0"]["expected"][k] for p in off["per_prompt"]]
        pooled = 1 + sum(a for a, _ in pairs) / sum(n for _, n in pairs)
        assert by["expected", 1.0, "all", "all", k, "probabilistic"]["tau"] == pytest.approx(pooled)
        assert smp_off["overall"]["tau"][k] == pytest.approx(pooled)
        assert smp_off["rules"]["probabilistic"]["overall"]["tau"][k] == pytest.approx(pooled)
        assert 1 <= pooled <= 1 + k
        # the greedy rule (vLLM's default: argmax q accepted with p(argmax q)) from the same unroll
        pairs = [p["sampling"]["1.0"]["expected_by_rule"]["greedy"][k] for p in off["per_prompt"]]
        greedy = 1 + sum(a for a, _ in pairs) / sum(n for _, n in pairs)
        assert by["expected", 1.0, "all", "all", k, "greedy"]["tau"] == pytest.approx(greedy)
        assert smp_off["rules"]["greedy"]["overall"]["tau"][k] == pytest.approx(greedy) and 1 <= greedy <= 1 + k
        # the moments of a round that evaluate_vllm's T > 0 gate reads, per rule and set
        for rule in ("greedy", "probabilistic"):
            rd = smp_off["rules"][rule]["overall"]["rounds"][k]
            assert rd["mean"] == pytest.approx(smp_off["rules"][rule]["overall"]["tau"][k] - 1)
            assert rd["second"] >= rd["mean"] ** 2 - 1e-12 and rd["spread"] >= 0
            assert sum(v["rounds"][k]["starts"] for v in smp_off["rules"][rule]["sets"].values()) == rd["starts"]
        by_hf = by["hf_loop", 1.0, "all", "all", k, "probabilistic"]
        # measured: τ = 1 + accepted / rounds of the sampling runs, with its interval over prompts
        chains = [p["sampling"]["1.0"]["chain"][k] for p in spec["per_prompt"]]
        measured = by_hf
        assert measured["tau"] == pytest.approx(1 + sum(a for a, _ in chains) / sum(n for _, n in chains))
        assert measured["ci"][0] <= measured["tau"] <= measured["ci"][1] and measured["prompts"] == N_PROMPTS
        assert smp_spec["overall"]["k"][k]["speedup"] > 0
    # the sampled runs were timed in the greedy design: per prompt `repeats` rotated blocks
    view = spec["per_prompt"][1]["sampling"]["1.0"]
    assert [b["order"] for b in view["samples"]] == [["plain", 1, 2, 3][1:] + ["plain"], [2, 3, "plain", 1]]
    assert len(off["per_prompt"][0]["sampling"]["1.0"]["tokens"]) >= 2
    summary = summarise(out)
    assert summary["matrix"] == rows and json.loads((out / "summary.json").read_text())["matrix"] == rows
    from eaglet.report import plots

    plots.tables_html(out / "tables.html", evaluation=out / "summary.json")
    page = (out / "tables.html").read_text()
    assert "Results matrix" in page and page.count("<td>hf_loop</td>") == sum(r["engine"] == "hf_loop" for r in rows)


def test_expected_acceptance_of_a_given_text_is_that_of_the_stage_s_own_sample(stages, tiny_target, tiny_drafter):
    """The offline T > 0 figures depend on the text only: handed the texts the stage sampled (as a
    caller hands vLLM's), offline_sampling gives the same per-prompt counts; handed other texts, others."""
    from eaglet.engines.hf_loop import setup

    out, off, _, sets = stages
    ident = Path(tiny_target["path"]).parent / "identity.json"
    o = hf_options(OPTS)
    _, target, proposer, _, tok = setup(tiny_drafter, ident, 1)
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], o["max_prompt_tokens"], {})[:2]
    mine = [p["sampling"]["1.0"] for p in off["per_prompt"][:2]]
    rows = [{} for _ in prompts]
    got = offline_sampling(target, proposer, prompts, rows, 3, 16, 1.0, o, texts=[m["tokens"] for m in mine])
    for r, m in zip(rows, mine):
        assert r["sampling"]["1.0"]["tokens"] == m["tokens"]
        for k in (1, 2, 3):
            (a, n), (a0, n0) = r["sampling"]["1.0"]["expected"][k], m["expected"][k]
            assert n == n0 and a == pytest.approx(a0, rel=1e-4)
    assert got["temperature"] == 1.0 and got["overall"]["prompts"] == 2
    other = [m["tokens"][::-1] for m in mine]
    offline_sampling(target, proposer, prompts, rows, 3, 16, 1.0, o, texts=other)
    assert rows[0]["sampling"]["1.0"]["tokens"] == other[0]
    assert rows[0]["sampling"]["1.0"]["expected"][1][0] != pytest.approx(mine[0]["expected"][1][0], rel=1e-4)


def test_a_lossy_loop_fails_the_stage(tiny_target, tiny_drafter, tmp_path, monkeypatch):

    def lossy(target, proposer, prompt, k, max_new):
        r = speculative(target, proposer, prompt, k, max_new)
        r["tokens"][3] = (r["tokens"][3] + 1) % 1000  # a rollback bug would look like this
        return r

    monkeypatch.setattr("eaglet.eval.evaluate_speculative.speculative", lossy)
    ident = Path(tiny_target["path"]).parent / "identity.json"
    with pytest.raises(LosslessError, match="not lossless"):
        evaluate_speculative(tiny_drafter, ident, ["mtbench"], tmp_path, threads=1,
                             num_prompts=1, max_new_tokens=8, k_values=[2])
    rep = json.loads((tmp_path / "speculative.failed.json").read_text())
    assert rep["lossless"]["mismatches"][0]["index"] == 3 and not (tmp_path / "speculative.json").exists()


def test_cli_help():
    for stage in ("evaluate_offline", "evaluate_speculative", "evaluate_modes"):
        r = subprocess.run([sys.executable, "-m", f"eaglet.eval.{stage}", "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "--drafter" in r.stdout and "num_prompts" in r.stdout, (stage, r.stderr)


def test_summary_writes_headline_agreement_and_plots(stages):
    from eaglet.eval.eval_summary import PLOTS, summarise

    out, off, spec, _ = stages
    res = summarise(out)
    h = json.loads((out / "summary.json").read_text())["headline"]
    assert set(h["tau_offline"]) == {"mtbench", "humaneval", "math", "heldout"} and h["k"] == 3
    assert h["lossless_hf_loop"] is True and h["offline_matches_real_loop"] is True
    assert h["speedup_hf_loop"] > 0 and h["recommendation"] == res["recommendation"]["sentence"]
    # the random tiny drafter: a k is recommended only where its measured speedup is above 1
    rec = res["recommendation"]
    assert rec["recommended_k"] is None or rec["table"][rec["recommended_k"] - 1]["measured_speedup"] > 1
    assert res["agreement"]["compared"] == 3 * N_PROMPTS and not res["agreement"]["differing"]
    for p in PLOTS:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(pd.read_parquet(out / "recommendation.parquet")) == 3


def test_summary_plots_are_never_half_written(stages, tmp_path, monkeypatch):
    """A crash while a plot is rendered leaves no truncated PNG at the declared output (Snakemake
    would otherwise see a finished file): plots go to a temporary file that is renamed."""
    import matplotlib.figure

    from eaglet.eval.eval_summary import PLOTS, summarise

    out, _, _, _ = stages
    for f in out.iterdir():
        if f.suffix in (".json", ".parquet"):
            (tmp_path / f.name).write_bytes(f.read_bytes())

    def crash(self, fname, **kw):  # write part of the file, then die (a full disk, a kill)
        with open(fname, "wb") as fh:
            fh.write(b"\x89PNG\r\n\x1a\n half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", crash)
    with pytest.raises(OSError, match="disk full"):
        summarise(tmp_path)
    assert not [p for p in PLOTS if (tmp_path / p).exists()]
    assert not list(tmp_path.glob(".*.tmp"))  # nor a temporary file left behind


def test_summary_reports_a_replay_mismatch(stages, tmp_path):
    from eaglet.eval.eval_summary import agreement

    out, _, _, _ = stages
    for f in ("offline_rounds.parquet", "offline_positions.parquet"):
        (tmp_path / f).write_bytes((out / f).read_bytes())
    b = pd.read_parquet(out / "speculative_rounds.parquet")
    b.loc[0, "accepted"] += 1  # the real loop accepted a token the simulator did not
    write_parquet(tmp_path / "speculative_rounds.parquet", b)
    ag = agreement(tmp_path, 1e-5)
    assert not ag["pass"] and len(ag["differing"]) == 1 and ag["differing"][0]["round"] == 0


# --------------------------------------------------------------------------- the HF loop, not run
def test_hf_loop_auto_skips_a_target_too_big_and_the_summary_says_not_run(tmp_path, caplog):
    """Issue 14: evaluation always loaded the target in fp32 in one process, a 1T target included.
    With evaluate.hf_loop auto, a target whose weights exceed one GPU (or that vLLM serves over
    several) is not loaded: both HF stages write their outputs as "not run" with the reason (the
    first thing they log), and the summary reports the HF-loop figures as not run, not as a pass."""
    import logging

    from eaglet.eval import eval_summary
    from eaglet.planner import plan
    from eaglet.workflow import summary

    big = tmp_path / "big"
    big.mkdir()
    (big / "model-00001.safetensors").write_bytes(b"\0" * (3 << 20))  # 3 MiB "weights"
    config = {"target": {"name": "big", "path": str(big)}, "resources": {"gpu_memory_gb": 0.002},
              "evaluate": {"hf_loop": "auto"}}
    hf = plan.hf_loop(config)
    run, why = hf.chain, hf.chain_why
    assert not run and not hf.timed and "exceed one GPU" in why and "resources.gpu_memory_gb" in why
    fits = "evaluate.hf_loop auto: the target fits one process"
    assert plan.hf_loop({**config, "resources": {"gpu_memory_gb": 1}}) == (True, fits, True, fits, 0)
    # several GPUs on the CPU build: nothing in-process, with the reason
    tp = {"target": {"name": "t", "vllm": {"tensor_parallel_size": 8}}, "evaluate": {"hf_loop": "auto"}}
    assert plan.hf_loop(tp)[:3:2] == (False, False) and "tensor_parallel_size is 8" in plan.hf_loop(tp).chain_why
    # several GPUs on the CUDA build: the untimed stages spread over the engine's 8 GPUs, the timed loop not run
    gpu = plan.hf_loop({**tp, "generate": {"vllm": {"package": "vllm"}}})
    assert (gpu.chain, gpu.timed, gpu.gpus) == (True, False, 8), gpu
    assert "spread over the 8 GPUs" in gpu.chain_why and "times nothing a server serves" in gpu.timed_why
    # one GPU of the CUDA build runs everything on it; false runs nothing
    assert plan.hf_loop({**config, "resources": {"gpu_memory_gb": 1}, "generate": {"vllm": {"package": "vllm"}}})\
        .gpus == 1
    assert plan.hf_loop({**tp, "evaluate": {"hf_loop": False}})[:3:2] == (False, False)

    out = tmp_path / "eval"
    out.mkdir()
    with caplog.at_level(logging.INFO, logger="eaglet.eval.evaluate_offline"):
        # no drafter or identity is read: the paths do not exist
        off = evaluate_offline(tmp_path / "none.safetensors", tmp_path / "none.json", ["mtbench"], out,
                               hf_loop=run, hf_loop_reason=why)
        spec = evaluate_speculative(tmp_path / "none.safetensors", tmp_path / "none.json", ["mtbench"], out,
                                    hf_loop=run, hf_loop_reason=why)
    assert caplog.records[0].getMessage() == f"HF loop not run (evaluate_offline): {why}"
    for res, name in ((off, "offline.json"), (spec, "speculative.json")):
        assert res["status"] == "not run" and read_json(out / name)["hf_loop_reason"] == why
    for name in ("offline_positions.parquet", "offline_rounds.parquet", "speculative_rounds.parquet"):
        assert read_parquet(out / name).num_rows == 0
    res = eval_summary.summarise(out)
    h = res["headline"]
    assert h["hf_loop"] == "not run" and h["hf_loop_reason"] == why
    assert h["lossless_hf_loop"] is None and h["offline_matches_real_loop"] is None and h["recommended_k"] is None
    assert all(Path(p).stat().st_size > 0 for p in res["plots"])
    line = summary._evaluate(read_json(out / "summary.json"))
    assert "HF loop NOT RUN" in line and "lossless: HF loop not run" in line and "yes" not in line


# --------------------------------------------------------------------------- chat-template modes
def test_each_mode_is_the_offline_stage_rendered_its_way_and_a_switch_the_template_ignores_is_refused(
        tiny_target, tiny_drafter, tmp_path):
    from eaglet.target.family_templates import QWEN3_TEMPLATE

    ident = Path(tiny_target["path"]).parent / "identity.json"
    sets = [heldout_parquet(tmp_path)]
    opts = {**OPTS, "chat_template": QWEN3_TEMPLATE, "k_values": [1, 2], "temperatures": [0.0, 1.0]}
    modes = {"thinking": {"enable_thinking": True}, "no_thinking": {"enable_thinking": False}}
    res = evaluate_modes(tiny_drafter, ident, sets, tmp_path / "m", modes=modes, threads=1, **opts)
    assert json.loads((tmp_path / "m" / "modes.json").read_text())["modes"].keys() == modes.keys()
    on, off = res["modes"]["thinking"], res["modes"]["no_thinking"]
    assert off["prompt_tail"].endswith("<think>\n\n</think>\n\n") and "</think>" not in on["prompt_tail"]
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert {(r["mode"], r["engine"], r["temperature"]) for r in res["matrix"] if r["k"] == 2 and r["set"] == "all"} \
        == {(m, e, t) for m in modes for e, t in (("chain", 0.0), ("expected", 1.0))}
    # a mode is exactly the offline stage with that mode's keyword arguments
    alone = evaluate_offline(tiny_drafter, ident, sets, tmp_path / "o", threads=1,
                             **{**opts, "chat_template_kwargs": {"enable_thinking": False}})
    assert off["tau_chain"] == alone["overall"]["tau_chain"]
    assert off["expected"]["1.0"] == alone["sampling"][0]["overall"]["tau"]
    # the default tiny template has no thinking switch: two modes rendering alike are refused
    with pytest.raises(ValueError, match="render every prompt identically.*enable_thinking"):
        evaluate_modes(tiny_drafter, ident, sets, tmp_path / "x", modes=modes, threads=1,
                       **{**opts, "chat_template": None})
    assert not (tmp_path / "x" / "modes.json").exists()
