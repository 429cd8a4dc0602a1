"""evaluate_offline for a DFlash drafter (drafter.kind dflash, eaglet.eval.dflash_offline): on the tiny
target, a drafter overfitted on the greedy answers to some prompts; the T = 0 figures are the exact
block chain (eaglet.drafter.dflash.block_chain_along, the chain the export's served check proved
equal to vLLM's counters), the T > 0 figures the expectation under each draft sample method, with
matrix rows per domain, at the one k vLLM serves DFlash with (block_size − 1). Then evaluate_speculative
for the same drafter (the timed HF loop with eaglet.engines.dflash_loop) at the k_values up to
block_size − 1, and the summary with its figures: lossless, its rounds eaglet's block chain's at every k,
paired speedups at T = 0 and T = 1 with intervals, the HF-loop rows in the matrix."""

import pytest
import torch

from eaglet.base.conversations import write_conversations
from eaglet.base.files import read_json
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, block_chain_along, save_dflash, train_dflash_step
from eaglet.engines import hf_loop
from eaglet.eval.dflash_offline import block_replay
from eaglet.eval.evaluate_offline import evaluate_offline
from eaglet.target.load import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK, MAX_NEW = 4, 12
QUESTIONS = ["Name three rivers in Europe.", "Why is the sky blue?", "Count to five."]


def test_block_replay_visits_the_served_rounds_by_hand():
    # accepted at each start g (index 0 unused), k = 3, 8 tokens served: every round drafts 3
    acc = [0, 2, 0, 0, 3, 0, 1, 1]
    assert block_replay(acc, 8, 8, 3) == [(1, 3, 2), (4, 3, 3)]
    assert block_replay(acc, 8, 6, 3) == [(1, 3, 2), (4, 3, 3)]  # served = min(n_tokens, max_new)
    assert block_replay([0, 0, 0, 0], 4, 4, 3) == [(1, 3, 0), (2, 3, 0), (3, 3, 0)]


@pytest.fixture(scope="module")
def dflash_eval(tiny_target, tmp_path_factory):
    """The drafter, its evaluate_offline run and what checks it: {"dir", "ident", "sets", "o", "res",
    "prompts", "target", "drafter", "embed", "head"}."""
    from pathlib import Path

    tmp_path = tmp_path_factory.mktemp("dflash_eval")
    ident = Path(tiny_target["path"]).parent / "identity.json"
    write_conversations(tmp_path / "heldout.parquet", [
        {"id": f"h{i}", "source": "heldout", "messages": [{"role": "user", "content": q}]}
        for i, q in enumerate(QUESTIONS)])
    sets = ["mtbench", str(tmp_path / "heldout.parquet")]
    o = {"num_prompts": {"mtbench": 2, "heldout": 3}, "max_new_tokens": MAX_NEW, "k_values": [1, 2, 5],
         "temperatures": [0.0, 1.0], "stop_at_eos": False}

    # a drafter overfitted on the greedy answers to the held-out prompts (some rounds accepted)
    from eaglet.base import datasets
    from eaglet.target.load import load_tokenizer

    tok = load_tokenizer(tiny_target["path"], need_template=True)
    prompts = datasets.load_prompts(sets, tok, o["num_prompts"], 10_000, None)
    model = load_model(tiny_target["path"])
    layer_ids = [2, 4, 5]
    target = hf_loop.Target(model, layer_ids, set())
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    k = BLOCK - 1

    def taps_of(x):
        _, aux = target.forward(x, target.new_cache())
        return aux.reshape(len(x), -1)

    cfg = DFlashConfig.from_identity(tiny_target, num_layers=1, block_size=BLOCK,
                                     mask_token_id=tiny_target["vocab_size"] - 1, target_layer_ids=layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    held = [p["prompt_ids"] for p in prompts if p["set"] == "heldout"]
    seqs = [p + hf_loop.greedy(target, p, MAX_NEW + k)["tokens"] for p in held]
    S = min(len(s) for s in seqs)
    ids = torch.tensor([s[:S] for s in seqs])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, p in enumerate(held):
        mask[i, len(p) - 1:] = True
    with torch.no_grad():
        batch = {"taps": torch.stack([taps_of(s[:S]) for s in seqs]), "input_ids": ids, "loss_mask": mask}
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        train_dflash_step(drafter, batch, embed, head, opt, g, num_anchors=32)
    drafter.eval()
    save_dflash(tmp_path / "drafter.safetensors", drafter, cfg)

    res = evaluate_offline(tmp_path / "drafter.safetensors", ident, sets, tmp_path, threads=1, **o)
    return {"dir": tmp_path, "ident": ident, "sets": sets, "o": o, "res": res, "prompts": prompts,
            "target": target, "drafter": drafter, "embed": embed, "head": head}


def test_offline_for_a_dflash_drafter_is_its_exact_block_chain(dflash_eval):
    e = dflash_eval
    res, prompts, target, drafter, embed, head = (e[x] for x in ("res", "prompts", "target", "drafter", "embed",
                                                                 "head"))
    k, layer_ids, tmp_path = BLOCK - 1, [2, 4, 5], e["dir"]

    def taps_of(x):
        _, aux = target.forward(x, target.new_cache())
        return aux.reshape(len(x), -1)

    assert res["kind"] == "dflash" and res["block_size"] == BLOCK and res["options"]["k_values"] == [k]
    assert res["layer_ids"] == layer_ids and read_json(tmp_path / "offline.json")["kind"] == "dflash"

    # T = 0: every set's counters are block_chain_along's along the same greedy continuation
    for name in ("mtbench", "heldout"):
        want = {"drafts": 0, "drafted_per_pos": [0] * k, "accepted_per_pos": [0] * k}
        for p in [p for p in prompts if p["set"] == name]:
            x = p["prompt_ids"] + hf_loop.greedy(target, p["prompt_ids"], MAX_NEW + k - 1)["tokens"]
            c = block_chain_along(drafter, taps_of(x[:-1]), x, len(p["prompt_ids"]), MAX_NEW, embed, head)["counts"]
            want = {key: want[key] + c[key] if key == "drafts" else [a + b for a, b in zip(want[key], c[key])]
                    for key in want}
        got = res["sets"][name]["chain_per_pos"][k]
        assert got == want, (name, got, want)
        assert res["sets"][name]["tau_chain"][k] == pytest.approx(1 + sum(want["accepted_per_pos"]) / want["drafts"])
    assert res["sets"]["heldout"]["tau_chain"][k] > 1.3  # the overfitted answers are accepted

    # matrix rows: the chain at T = 0 and each rule's expectation at T = 1, per domain, only at k
    rows = res["matrix"]
    assert {r["k"] for r in rows} == {k}
    doms = {r["domain"] for r in rows if r["engine"] == "chain"}
    assert "heldout" in doms and len(doms) >= 3  # two MT-Bench categories and the held-out set
    for rule in ("greedy", "probabilistic"):
        assert {r["domain"] for r in rows if r["engine"] == "expected" and r["rule"] == rule
                and r["temperature"] == 1.0} == doms
    smp = res["sampling"][0]
    for rule in ("greedy", "probabilistic"):
        tau = smp["rules"][rule]["overall"]["tau"][k]
        assert 1.0 <= tau <= 1.0 + k


def test_the_timed_hf_loop_for_a_dflash_drafter_and_its_summary(dflash_eval, tmp_path):
    """evaluate_speculative reads the kind from the drafter's file: k_values [1, 2, 5] run at 1, 2, 3
    (5 is past the block; block_size − 1 always in), lossless at every k, speedups paired at T = 0 and
    T = 1; the summary's headline holds the HF loop's figures at k = 3 and its rounds equal eaglet's
    block chain at every k; without speculative.json the summary says the HF loop did not run."""
    import shutil

    from eaglet.eval.eval_summary import summarise
    from eaglet.eval.evaluate_speculative import evaluate_speculative

    e = dflash_eval
    out, k = e["dir"], BLOCK - 1
    spec = evaluate_speculative(out / "drafter.safetensors", e["ident"], e["sets"], out, threads=1,
                                **{**e["o"], "repeats": 1})
    assert spec["kind"] == "dflash" and spec["block_size"] == BLOCK and spec["options"]["k_values"] == [1, 2, k]
    assert spec["layer_ids"] == [2, 4, 5] and read_json(out / "speculative.json")["kind"] == "dflash"
    assert spec["lossless"]["pass"] and spec["lossless"]["compared"] == 5 * 3 and not spec["lossless"]["mismatches"]
    assert spec["overall"]["k"][k]["tau"] > 1.1 and spec["sets"]["heldout"]["k"][k]["tau"] > 1.3
    assert [x["temperature"] for x in spec["sampling"]] == [1.0]
    assert {(r["temperature"], r["k"], r.get("rule")) for r in spec["matrix"] if r["domain"] == "all"} == \
        {(0.0, kk, "greedy") for kk in (1, 2, k)} | {(1.0, kk, "probabilistic") for kk in (1, 2, k)}

    s = summarise(out, tie_eps=1e-5)
    h = s["headline"]
    assert "hf_loop" not in h and h["lossless_hf_loop"] and h["offline_matches_real_loop"]
    assert s["agreement"]["compared"] == 5 * 3 and not s["agreement"]["differing"]
    assert h["hf_loop_k_values"] == [1, 2, k] and h["tau_hf_loop"] == {
        name: v["k"][k]["tau"] for name, v in spec["sets"].items()}
    assert h["speedup_hf_loop"] == spec["overall"]["k"][k]["speedup"] and len(h["speedup_hf_loop_ci"]) == 2
    by_t = {x["temperature"]: x for x in h["speedup_hf_loop_by_temperature"]}
    assert set(by_t) == {0.0, 1.0} and by_t[1.0]["rule"] == "probabilistic" and by_t[0.0]["rule"] is None
    assert by_t[1.0]["estimate"] == spec["sampling"][0]["overall"]["k"][k]["speedup"]
    assert all(x["lo"] is not None and x["hi"] is not None for x in by_t.values())
    assert h["recommended_k"] is None and "block_size - 1 only" in h["recommendation"]
    assert {r["k"] for r in s["matrix"] if r["engine"] == "hf_loop"} == {1, 2, k}

    # an evaluation without the HF loop's record: its figures null, with why (no pass)
    for name in ("offline.json", "offline_positions.parquet", "offline_rounds.parquet"):
        shutil.copy(out / name, tmp_path / name)
    h = summarise(tmp_path, tie_eps=1e-5)["headline"]
    assert h["hf_loop"] == "not run" and "no speculative.json" in h["hf_loop_reason"]
    assert h["lossless_hf_loop"] is None and h["speedup_hf_loop"] is None
