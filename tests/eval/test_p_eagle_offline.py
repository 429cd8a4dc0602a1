"""evaluate_offline for a P-EAGLE drafter (drafter.kind p_eagle, eaglet.eval.p_eagle_offline): on the tiny
target, a drafter overfitted on the greedy answers to some prompts; the T = 0 figures are the exact
parallel chain (PEagleDrafter.parallel_chain_along, the chain the export's served check proved equal to
vLLM's counters), at the one k vLLM serves the kind with (parallel_k); the T > 0 figures are the
expectation under each draft sample method, each slot's q equal to the round rebuilt slot by slot
through a KV cache (parallel_logits_slow); matrix rows per domain. Then evaluate_speculative for the
same drafter (the timed HF loop with eaglet.engines.p_eagle_loop) at the k_values up to parallel_k,
and the summary of the kind: its headline at k = parallel_k, the HF loop lossless, its rounds eaglet's
parallel chain's at every k, paired speedups at T = 0 and T = 1; without its speculative.json the HF
loop named not run with why (no pass)."""

from pathlib import Path

import pytest
import torch

from eaglet.base import datasets
from eaglet.base.conversations import write_conversations
from eaglet.base.files import read_json
from eaglet.drafter.chain import ACCEPT
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter, PEagleObjective, save_p_eagle
from eaglet.engines import hf_loop
from eaglet.eval import p_eagle_offline
from eaglet.eval.evaluate_offline import evaluate_offline
from eaglet.target.load import load_model, load_target_embedding, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
K, MAX_NEW, LAYERS = 3, 12, [2, 4, 5]
QUESTIONS = ["Name three rivers in Europe.", "Why is the sky blue?", "Count to five."]


@pytest.fixture(scope="module")
def p_eagle_eval(tiny_target, tmp_path_factory):
    """The drafter, its evaluate_offline run and what checks it: {"dir", "res", "prompts", "target",
    "drafter", "d2t", "side"}."""
    tmp_path = tmp_path_factory.mktemp("p_eagle_eval")
    ident = Path(tiny_target["path"]).parent / "identity.json"
    write_conversations(tmp_path / "heldout.parquet", [
        {"id": f"h{i}", "source": "heldout", "messages": [{"role": "user", "content": q}]}
        for i, q in enumerate(QUESTIONS)])
    sets = ["mtbench", str(tmp_path / "heldout.parquet")]
    o = {"num_prompts": {"mtbench": 2, "heldout": 3}, "max_new_tokens": MAX_NEW, "k_values": [1, 2, 5],
         "temperatures": [0.0, 1.0], "stop_at_eos": False}
    tok = load_tokenizer(tiny_target["path"], need_template=True)
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], 10_000, None)
    target = hf_loop.Target(load_model(tiny_target["path"]), LAYERS, set())

    # the draft vocabulary: every token of the prompts and their greedy answers, and the first ids
    seqs = [p["prompt_ids"] + hf_loop.greedy(target, p["prompt_ids"], MAX_NEW + K)["tokens"] for p in prompts]
    V = tiny_target["vocab_size"]
    ids = torch.tensor(sorted(set(range(64)) | {t for s in seqs for t in s}))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(len(ids))
    cfg = PEagleConfig.from_identity(tiny_target, len(ids), LAYERS, mask_token_id=V - 1, parallel_k=K)
    torch.manual_seed(0)
    drafter = PEagleDrafter(cfg, load_target_embedding(tiny_target["path"]))

    # overfitted on the held-out prompts' greedy answers (some rounds accepted)
    held = [s for s, p in zip(seqs, prompts) if p["set"] == "heldout"]
    plen = [len(p["prompt_ids"]) for p in prompts if p["set"] == "heldout"]
    S = min(len(s) for s in held)
    x = torch.tensor([s[:S] for s in held])
    with torch.no_grad():
        aux = torch.stack([target.forward(s[:S], target.new_cache())[1].reshape(S, 3, -1) for s in held])
    labels = torch.roll(x, -1, 1)
    valid = torch.zeros_like(x, dtype=torch.bool)
    for i, n in enumerate(plen):
        valid[i, n - 1:S - 1] = True
    obj = PEagleObjective(drafter)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):
        loss, _ = obj(x, aux.float(), labels, valid, t2d)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    save_p_eagle(tmp_path / "drafter.safetensors", drafter, cfg, d2t, t2d)

    res = evaluate_offline(tmp_path / "drafter.safetensors", ident, sets, tmp_path, threads=1, **o)
    return {"dir": tmp_path, "res": res, "prompts": prompts, "target": target, "drafter": drafter, "d2t": d2t,
            "side": p_eagle_offline.PEagleSide(drafter, cfg, d2t), "ident": ident, "sets": sets, "o": o}


def test_offline_for_a_p_eagle_drafter_is_its_exact_parallel_chain(p_eagle_eval):
    e = p_eagle_eval
    res, prompts, target, drafter, d2t = (e[x] for x in ("res", "prompts", "target", "drafter", "d2t"))
    assert res["kind"] == "p_eagle" and res["parallel_k"] == K and res["options"]["k_values"] == [K]
    assert res["layer_ids"] == LAYERS and read_json(e["dir"] / "offline.json")["kind"] == "p_eagle"

    # T = 0: every set's counters are parallel_chain_along's along the same greedy continuation
    for name in ("mtbench", "heldout"):
        want = {"drafts": 0, "drafted_per_pos": [0] * K, "accepted_per_pos": [0] * K}
        for p in [p for p in prompts if p["set"] == name]:
            x = p["prompt_ids"] + hf_loop.greedy(target, p["prompt_ids"], MAX_NEW + K - 1)["tokens"]
            _, aux = target.forward(x[:-1], target.new_cache())
            c = drafter.parallel_chain_along(aux.reshape(len(x) - 1, -1), x, len(p["prompt_ids"]), MAX_NEW,
                                             d2t)["counts"]
            want = {key: want[key] + c[key] if key == "drafts" else [a + b for a, b in zip(want[key], c[key])]
                    for key in want}
        got = res["sets"][name]["chain_per_pos"][K]
        assert got == want, (name, got, want)
        assert res["sets"][name]["tau_chain"][K] == pytest.approx(1 + sum(want["accepted_per_pos"]) / want["drafts"])
    assert res["sets"]["heldout"]["tau_chain"][K] > 1.3  # the overfitted answers are accepted

    # matrix rows: the chain at T = 0 and each rule's expectation at T = 1, per domain, only at k = K
    rows = res["matrix"]
    assert {r["k"] for r in rows} == {K}
    doms = {r["domain"] for r in rows if r["engine"] == "chain"}
    assert "heldout" in doms and len(doms) >= 3  # two MT-Bench categories and the held-out set
    for rule in ACCEPT:
        assert {r["domain"] for r in rows if r["engine"] == "expected" and r["rule"] == rule
                and r["temperature"] == 1.0} == doms
        assert 1.0 <= res["sampling"][0]["rules"][rule]["overall"]["tau"][K] <= 1.0 + K


def test_the_expectation_at_t1_reads_each_slot_of_the_round_built_slot_by_slot(p_eagle_eval):
    """Along the target's sampled text of a held-out prompt (as the stage drew it), each start's α per
    slot under each rule is p and q of the round vLLM runs, q rebuilt through a KV cache slot by slot."""
    e = p_eagle_eval
    target, drafter, side = e["target"], e["drafter"], e["side"]
    i = next(j for j, p in enumerate(e["prompts"]) if p["set"] == "heldout")
    prompt, row = e["prompts"][i]["prompt_ids"], e["res"]["per_prompt"][i]
    text = row["sampling"]["1.0"]["tokens"]
    got = p_eagle_offline.parallel_expected(target, side, prompt, K, 1.0, tokens=text)
    assert got["tokens"] == text and len(got["starts"]) == len(text) - 1
    x, P, N = prompt + text, len(prompt), len(text)
    logits, aux = target.forward(x[:-1], target.new_cache())
    aux = aux.reshape(len(x) - 1, -1)
    for s in got["starts"]:
        g = s["g"]
        t = P + g - 2
        n = min(K, N - g)
        with torch.no_grad():
            q = torch.softmax(drafter.parallel_logits_slow(x[:t + 2], drafter.project(aux[None, :t + 1])[0])[:n], -1)
        p = torch.softmax(logits[P + g - 1:P + g - 1 + n], -1)[:, side.ids]
        for rule, f in ACCEPT.items():
            assert s["alpha_by_rule"][rule] == pytest.approx(f(p, q).tolist(), abs=1e-5), (g, rule)
    # the stage's per-prompt expectation is these starts' (expected accepted at k = K, summed)
    from eaglet.drafter.chain import expected_counts

    valid = [s["valid"] for s in got["starts"]]
    for rule in ACCEPT:
        want = list(expected_counts([s["alpha_by_rule"][rule] for s in got["starts"]], valid, K))
        assert row["sampling"]["1.0"]["expected_by_rule"][rule][K] == pytest.approx(want)


def test_the_summary_of_a_p_eagle_evaluation(p_eagle_eval, tmp_path):
    """The summary of a P-EAGLE evaluation with its timed HF loop, which evaluate_speculative runs first
    (it reads the kind from the drafter's file): k_values [1, 2, 5] run at 1, 2, 3 (5 is past
    parallel_k; parallel_k always in) with eaglet.engines.p_eagle_loop's proposer, lossless at every k,
    speedups paired at T = 0 and T = 1; the summary reads the kind from offline.json: the headline at
    k = parallel_k with the chain's τ per set and domain and the HF loop's figures, whose rounds equal
    eaglet's parallel chain at every k; no draft-length recommendation. Without speculative.json, or
    with another drafter's left in the folder, the HF loop is named not run with why, its figures null
    (no pass)."""
    import shutil

    from eaglet.eval.eval_summary import summarise
    from eaglet.eval.evaluate_speculative import evaluate_speculative

    e = p_eagle_eval
    out = e["dir"]
    spec = evaluate_speculative(out / "drafter.safetensors", e["ident"], e["sets"], out, threads=1,
                                **{**e["o"], "repeats": 1})
    assert spec["kind"] == "p_eagle" and spec["parallel_k"] == K and spec["options"]["k_values"] == [1, 2, K]
    assert spec["layer_ids"] == LAYERS and read_json(out / "speculative.json")["kind"] == "p_eagle"
    assert spec["lossless"]["pass"] and spec["lossless"]["compared"] == 5 * 3 and not spec["lossless"]["mismatches"]
    assert spec["sets"]["heldout"]["k"][K]["tau"] > 1.3  # the overfitted answers are accepted
    assert [x["temperature"] for x in spec["sampling"]] == [1.0]
    assert {(r["temperature"], r["k"], r.get("rule")) for r in spec["matrix"] if r["domain"] == "all"} == \
        {(0.0, kk, "greedy") for kk in (1, 2, K)} | {(1.0, kk, "probabilistic") for kk in (1, 2, K)}

    s = summarise(out, tie_eps=1e-5)
    h = s["headline"]
    assert s["kind"] == "p_eagle" and h["kind"] == "p_eagle" and h["parallel_k"] == K and h["k"] == K
    assert h["tau_offline_chain"] == {name: v["tau_chain"][K] for name, v in e["res"]["sets"].items()}
    assert "hf_loop" not in h and h["lossless_hf_loop"] and h["offline_matches_real_loop"]
    assert s["agreement"]["compared"] == 5 * 3 and not s["agreement"]["differing"]
    assert h["hf_loop_k_values"] == [1, 2, K] and h["tau_hf_loop"] == {
        name: v["k"][K]["tau"] for name, v in spec["sets"].items()}
    assert h["speedup_hf_loop"] == spec["overall"]["k"][K]["speedup"] and len(h["speedup_hf_loop_ci"]) == 2
    by_t = {x["temperature"]: x for x in h["speedup_hf_loop_by_temperature"]}
    assert set(by_t) == {0.0, 1.0} and by_t[1.0]["rule"] == "probabilistic" and by_t[0.0]["rule"] is None
    assert h["recommended_k"] is None and "parallel_k only" in h["recommendation"]
    assert {r["k"] for r in s["matrix"] if r["engine"] == "hf_loop"} == {1, 2, K}
    assert {r["k"] for r in s["matrix"] if r["engine"] != "hf_loop"} == {K}
    assert read_json(out / "summary.json")["kind"] == "p_eagle"

    # an evaluation without the HF loop's record, then with another drafter's: its figures null, with why
    for name in ("offline.json", "offline_positions.parquet", "offline_rounds.parquet"):
        shutil.copy(out / name, tmp_path / name)
    for why in ("no speculative.json", "another drafter's (kind eagle3, not p_eagle)"):
        res = summarise(tmp_path)
        h = res["headline"]
        assert h["hf_loop"] == "not run" and why in h["hf_loop_reason"], h["hf_loop_reason"]
        assert h["speedup_hf_loop"] is None and h["lossless_hf_loop"] is None and res["agreement"] is None
        assert h["recommended_k"] is None and h["recommendation"].startswith("no recommendation")
        assert {r["k"] for r in res["matrix"]} == {K} and h["tau_offline_chain"] == {
            name: v["tau_chain"][K] for name, v in e["res"]["sets"].items()}
        (tmp_path / "speculative.json").write_text('{"stage": "evaluate_speculative"}')  # an EAGLE-3 run's
