"""A DFlash drafter served by real vLLM (CPU build) on the tiny target, one runner process for both
runs: method dflash with num_speculative_tokens = block_size − 1 at T = 0 gives exactly the plain
greedy output, and vLLM's acceptance counters (drafts, draft tokens, accepted per position) equal
eaglet's exact offline block chain (eaglet.drafter.dflash.block_chain_along) along vLLM's own plain
output. The drafter is first overfitted on the target's greedy answers to two of the three prompts,
so that some rounds are accepted and others rejected."""

import torch

from conftest import vllm_env_or_skip
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, block_chain_along, train_dflash_step
from eaglet.engines import hf_loop, vllm_env
from eaglet.export.contract.vllm_checks import run_vllm_batch
from eaglet.export.dflash_format import dflash_static_problems, export_dflash
from eaglet.target.load import load_model, load_tokenizer

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
TRAINED_ON = 2  # the drafter learns the first two answers; the third's rounds are rejected
MAX_TOKENS, BLOCK = 16, 4


def test_dflash_served_lossless_and_counters_equal_the_offline_chain(tiny_target, tmp_path, one_thread):
    """Served by real vLLM with method dflash at T = 0, the output is plain greedy's and the acceptance
    counters are eaglet's offline block chain's."""
    env = vllm_env_or_skip()
    k = BLOCK - 1
    model = load_model(tiny_target["path"])
    tok = load_tokenizer(tiny_target["path"])
    layer_ids = [2, 4, 5]
    target = hf_loop.Target(model, layer_ids, set())
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]

    def taps_of(x):
        _, aux = target.forward(x, target.new_cache())
        return aux.reshape(len(x), -1)

    # the drafter: overfitted on the HF target's greedy answers to the first prompts
    cfg = DFlashConfig.from_identity(tiny_target, num_layers=2, block_size=BLOCK,
                                     mask_token_id=tiny_target["vocab_size"] - 1, target_layer_ids=layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    seqs = [p + hf_loop.greedy(target, p, MAX_TOKENS + k)["tokens"] for p in prompts[:TRAINED_ON]]
    S = min(len(s) for s in seqs)
    ids = torch.tensor([s[:S] for s in seqs])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, p in enumerate(prompts[:TRAINED_ON]):
        mask[i, len(p) - 1:] = True
    with torch.no_grad():
        batch = {"taps": torch.stack([taps_of(s[:S]) for s in seqs]), "input_ids": ids, "loss_mask": mask}
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        train_dflash_step(drafter, batch, embed, head, opt, g, num_anchors=32)
    drafter.eval()
    d = export_dflash(tmp_path / "dflash", drafter.state_dict(), cfg)
    assert dflash_static_problems(d) == []

    res = run_vllm_batch(
        [{"tag": "plain", "target": tiny_target["path"], "drafter": None, "k": k, "max_tokens": MAX_TOKENS + k - 1},
         {"tag": "dflash", "target": tiny_target["path"], "drafter": d, "k": k, "max_tokens": MAX_TOKENS}],
        PROMPTS, work_dir=tmp_path / "vllm", python=vllm_env.vllm_python(env))
    plain, spec = res["plain"], res["dflash"]
    assert plain["rc"] == 0 and spec["rc"] == 0, (plain.get("log_tail"), spec.get("log_tail"))
    assert spec["prompt_token_ids"] == prompts
    assert spec["token_ids"] == [t[:MAX_TOKENS] for t in plain["token_ids"]]  # lossless

    want = {"drafts": 0, "drafted_per_pos": [0] * k, "accepted_per_pos": [0] * k}
    for p, cont in zip(prompts, plain["token_ids"]):
        x = p + cont
        c = block_chain_along(drafter, taps_of(x[:-1]), x, len(p), MAX_TOKENS, embed, head)["counts"]
        want = {key: (want[key] + c[key]) if key == "drafts" else [a + b for a, b in zip(want[key], c[key])]
                for key in want}
    sd = spec["spec_decode"]
    got = {"drafts": int(sd["num_drafts"]), "draft_tokens": int(sd["num_draft_tokens"]),
           "accepted_per_pos": [int(v) for v in sd["num_accepted_tokens_per_pos"]]}
    assert got == {"drafts": want["drafts"], "draft_tokens": want["drafts"] * k,
                   "accepted_per_pos": want["accepted_per_pos"]}, (got, want)
    assert int(sd["num_accepted_tokens"]) == sum(want["accepted_per_pos"])
    # rounds accepted in full and rounds rejected: the counters follow the chain's jumps both ways
    assert 0 < want["accepted_per_pos"][0] < want["drafts"]
