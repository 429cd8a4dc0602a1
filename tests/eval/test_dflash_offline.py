"""evaluate_offline for a DFlash drafter (drafter.kind dflash, eaglet.eval.dflash_offline): on the tiny
target, a drafter overfitted on the greedy answers to some prompts; the T = 0 figures are the exact
block chain (eaglet.drafter.dflash.block_chain_along, the chain the export's served check proved
equal to vLLM's counters), the T > 0 figures the expectation under each draft sample method, with
matrix rows per domain, at the one k vLLM serves DFlash with (block_size − 1)."""

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


def test_offline_for_a_dflash_drafter_is_its_exact_block_chain(tiny_target, tmp_path):
    from pathlib import Path

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
