"""A DFlash drafter as the HF loop's proposer (eaglet.engines.dflash_loop.DFlashProposer), at T = 0 on the
tiny target with a drafter overfitted on the greedy answers to two of three prompts: the real loop
(eaglet.engines.hf_loop.speculative) emits plain greedy's text and runs exactly the rounds of eaglet's
block chain, at every k <= block_size - 1 (the block's first k drafts) and with an EOS: the accepted
prefix from every start (eaglet.eval.dflash_offline.block_prompt) walked as the loop walks it, and at
k = block_size - 1 the rounds and drafts of eaglet.drafter.dflash.block_chain_along (the chain vLLM's
counters equal), the last round capped at max_new_tokens as the loop caps it. The verified context's
K/V are computed once per position (cached across rounds, as vLLM does), and what the proposer cannot
draft is refused. Lossless in distribution at T > 0: tests/engines/test_speculative_sampling.py."""

import pytest
import torch

from eaglet.base import datasets
from eaglet.drafter import chain
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, block_chain_along, train_dflash_step
from eaglet.engines import hf_loop
from eaglet.engines.dflash_loop import DFlashProposer
from eaglet.eval.dflash_offline import DFlashSide, block_prompt
from eaglet.target.load import load_model, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK, MAX_NEW, LAYERS = 4, 24, [2, 4, 5]
K = BLOCK - 1


@pytest.fixture(scope="module")
def tiny(tiny_target):
    """(target, drafter, embed, head, prompts): three MT-Bench prompts, the drafter trained on the
    target's greedy answers to the first two (the third is held out: mostly rejected)."""
    tok = load_tokenizer(tiny_target["path"])
    model = load_model(tiny_target["path"])
    prompts = [datasets.encode(tok, r["messages"]) for r in datasets.load_set("mtbench", 3)]
    target = hf_loop.Target(model, LAYERS, eos_ids=set())
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    cfg = DFlashConfig.from_identity(tiny_target, num_layers=1, block_size=BLOCK,
                                     mask_token_id=tiny_target["vocab_size"] - 1, target_layer_ids=LAYERS)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    seqs = [p + hf_loop.greedy(target, p, MAX_NEW + K)["tokens"] for p in prompts[:2]]
    S = min(len(s) for s in seqs)
    with torch.no_grad():
        taps = torch.stack([target.forward(s[:S], target.new_cache())[1].reshape(S, -1) for s in seqs])
    mask = torch.zeros(2, S, dtype=torch.bool)
    for i, p in enumerate(prompts[:2]):
        mask[i, len(p) - 1:] = True
    batch = {"taps": taps, "input_ids": torch.tensor([s[:S] for s in seqs]), "loss_mask": mask}
    opt, gen = torch.optim.Adam(drafter.parameters(), lr=3e-3), torch.Generator().manual_seed(0)
    for _ in range(40):
        train_dflash_step(drafter, batch, embed, head, opt, gen, num_anchors=32)
    return target, drafter.eval(), embed, head, prompts


class Recorder(DFlashProposer):
    """The proposer, keeping every round's drafts and block logits."""

    def reset(self):
        super().reset()
        self.drafted, self.logits = [], []

    def block_logits(self, k):
        out = super().block_logits(k)
        self.logits.append(out)
        return out

    def draft(self, k):
        out = super().draft(k)
        self.drafted.append(out)
        return out


def test_the_loop_at_t0_is_plain_greedy_and_eaglet_s_exact_block_chain(tiny):
    """At T = 0 the loop's text is plain greedy's and its rounds are eaglet's block chain's at every k <=
    block_size - 1; at k = block_size - 1 round for round, draft for draft and logit for logit."""
    target, drafter, embed, head, prompts = tiny
    side, proposer = DFlashSide(drafter, drafter.cfg, embed, head), Recorder(drafter, embed, head)
    accepted = 0
    for prompt in prompts:
        greedy = hf_loop.greedy(target, prompt, MAX_NEW)["tokens"]
        off = block_prompt(target, side, prompt, K, MAX_NEW)
        at = [0] + [s["accepted"] for s in off["starts"]]
        for k in range(1, K + 1):
            r = hf_loop.speculative(target, proposer, prompt, k, MAX_NEW)
            assert r["tokens"] == greedy == off["tokens"]
            assert r["rounds"] == chain.chain_replay(at, len(greedy), MAX_NEW, k), k
        # k = K: vLLM's chain (block_chain_along along the greedy text), round for round and draft for draft
        x = prompt + hf_loop.greedy(target, prompt, MAX_NEW + K - 1)["tokens"]
        _, aux = target.forward(x[:-1], target.new_cache())
        ref = block_chain_along(drafter, aux.reshape(len(x) - 1, -1), x, len(prompt), MAX_NEW, embed, head)["rounds"]
        assert [g for g, _, _ in r["rounds"]] == [c["g"] for c in ref]
        drafted = proposer.drafted + [[]] * (len(ref) - len(proposer.drafted))  # a last round may draft nothing
        for (g, k_eff, a), c, d in zip(r["rounds"], ref, drafted, strict=True):
            assert k_eff == min(K, MAX_NEW - g - 1) and a == min(c["accepted"], k_eff) and d == c["drafts"][:k_eff]
        # and the logits themselves: each round's block is the training forward's block at its bonus position
        P, gs = len(prompt), [g for g, k_eff, _ in r["rounds"] if k_eff]
        with torch.inference_mode():
            want = drafter.block_logits(aux.reshape(1, len(x) - 1, -1), torch.tensor([x[:-1]]),
                                        torch.tensor([[P + g - 1 for g in gs]]), embed, head)[0, :, 1:]
        for got, w in zip(proposer.logits, want, strict=True):
            torch.testing.assert_close(got, w[:len(got)], rtol=1e-4, atol=1e-4)
        accepted += sum(a for _, _, a in r["rounds"])
    assert accepted > 20  # the overfitted answers are accepted: the rounds' walk is tested, not only rejections


def test_an_eos_ends_the_loop_as_it_ends_the_block_chain(tiny):
    """An EOS ends the loop where it ends plain greedy, with the block chain's rounds up to it."""
    target, drafter, embed, head, prompts = tiny
    free = hf_loop.greedy(target, prompts[0], MAX_NEW)["tokens"]
    stopper = hf_loop.Target(target.model, LAYERS, eos_ids={free[10]})
    greedy = hf_loop.greedy(stopper, prompts[0], MAX_NEW)["tokens"]
    assert greedy[-1] == free[10] and len(greedy) < MAX_NEW
    off = block_prompt(stopper, DFlashSide(drafter, drafter.cfg, embed, head), prompts[0], K, MAX_NEW)
    r = hf_loop.speculative(stopper, DFlashProposer(drafter, embed, head), prompts[0], K, MAX_NEW)
    assert r["tokens"] == greedy
    assert r["rounds"] == chain.chain_replay([0] + [s["accepted"] for s in off["starts"]], len(greedy), MAX_NEW, K)


def test_the_context_is_projected_once_per_verified_position(tiny):
    """Each round computes the K/V of the newly verified positions only (vLLM's cache), never the
    drafts': over a run, fc sees every position before the last emitted token exactly once."""
    target, drafter, embed, head, prompts = tiny
    proposer = DFlashProposer(drafter, embed, head)
    rows = []
    hook = drafter.fc.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[1]))
    try:
        r = hf_loop.speculative(target, proposer, prompts[0], K, MAX_NEW)
    finally:
        hook.remove()
    n = len(prompts[0]) + len(r["tokens"]) - 1
    assert sum(rows) == proposer.n == n and len(rows) == len(r["rounds"]) + 1
    assert all(k.shape[2] == v.shape[2] == n for k, v in proposer.kv)
    # timed: one extend per round (the prefill's is not a step) and one block forward per round with drafts
    assert len(proposer.step_times) == len(r["rounds"]) + sum(k_eff > 0 for _, k_eff, _ in r["rounds"])


def test_what_a_dflash_proposer_cannot_draft_is_refused(tiny):
    """An unknown draft sample method, a draft before any context, k past the block, T = 0 sampling: refused."""
    target, drafter, embed, head, prompts = tiny
    with pytest.raises(ValueError, match="draft sample method 'sampled'"):
        DFlashProposer(drafter, embed, head, "sampled")
    proposer = DFlashProposer(drafter, embed, head)
    with pytest.raises(RuntimeError, match="before extend"):
        proposer.draft(1)
    _, aux = target.forward(prompts[0], target.new_cache())
    proposer.extend(aux, prompts[0][1:] + [5])
    with pytest.raises(ValueError, match=f"k={K + 1}: a DFlash drafter of block size {BLOCK} drafts 1 .. {K}"):
        proposer.draft(K + 1)
    with pytest.raises(ValueError, match="T > 0"):
        proposer.draft_sampled(1, 0.0, hf_loop.generator(0))
