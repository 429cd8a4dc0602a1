"""A P-EAGLE drafter as the HF loop's proposer (eaglet.engines.p_eagle_loop.PEagleProposer), on the tiny
target with a drafter overfitted on the greedy answers to two of three prompts. At T = 0 the real loop
(eaglet.engines.hf_loop.speculative) emits plain greedy's text and runs exactly the rounds of eaglet's
parallel chain at every k <= parallel_k: the accepted prefix from every start
(eaglet.eval.p_eagle_offline.parallel_prompt) walked as the loop walks it, and at k = K the rounds and
drafts of PEagleDrafter.parallel_chain_along (the chain vLLM's counters equal), the last round capped at
max_new_tokens as the loop caps it; every round's slot logits, computed through the drafter's KV cache
in one forward, are the round rebuilt from scratch (parallel_logits, the first k of its K slots), with
an EOS too. One drafter forward per round; the cache keeps every verified position's real entry, once,
and no masked slot. At T > 0 a seeded run completes and repeats; greedy drafts hand the verification a
one-hot q at the argmax draft, sampled drafts the slots' own q; what the proposer cannot draft is refused."""

import pytest
import torch

from eaglet.base import datasets
from eaglet.drafter import chain
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter, PEagleObjective
from eaglet.engines import hf_loop
from eaglet.engines.p_eagle_loop import PEagleProposer
from eaglet.eval.p_eagle_offline import PEagleSide, parallel_prompt
from eaglet.target.load import load_model, load_target_embedding, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
K, MAX_NEW, LAYERS = 3, 24, [2, 4, 5]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    """(target, drafter, d2t, prompts, fresh): three MT-Bench prompts, the drafter (draft vocabulary: the
    ids the prompts and answers use, and the first 64) trained on the target's greedy answers to the
    first two, and an untrained drafter of the same shape (its q spread over the draft vocabulary). The
    tiny random target mostly repeats one token; the first two prompts are two whose greedy answers do
    not (a cycle of four, a cycle of two, each ending otherwise: rounds accept all, some or none of
    their drafts, and a round's drafts differ), the third one that does (held out)."""
    tok = load_tokenizer(tiny_target["path"])
    target = hf_loop.Target(load_model(tiny_target["path"]), LAYERS, eos_ids=set())
    mtbench = datasets.load_set("mtbench", 10)
    prompts = [datasets.encode(tok, mtbench[i]["messages"]) for i in (3, 1, 0)]
    seqs = [p + hf_loop.greedy(target, p, MAX_NEW + K)["tokens"] for p in prompts]
    assert [len(set(s[len(p):])) for p, s in zip(prompts, seqs)] == [6, 2, 1]
    V = tiny_target["vocab_size"]
    ids = torch.tensor(sorted(set(range(64)) | {t for s in seqs for t in s}))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(len(ids))
    cfg = PEagleConfig.from_identity(tiny_target, len(ids), LAYERS, mask_token_id=V - 1, parallel_k=K)
    torch.manual_seed(0)
    embed = load_target_embedding(tiny_target["path"])
    fresh, drafter = PEagleDrafter(cfg, embed).eval(), PEagleDrafter(cfg, embed)
    S = max(len(s) for s in seqs[:2])  # padded; the padding never counts
    x = torch.zeros(2, S, dtype=torch.long)
    aux = torch.zeros(2, S, 3, tiny_target["hidden_size"])
    valid = torch.zeros(2, S, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts[:2], seqs[:2])):
        x[i, :len(s)] = torch.tensor(s)
        with torch.no_grad():
            aux[i, :len(s)] = target.forward(s, target.new_cache())[1]
        valid[i, len(p) - 1:len(s) - 1] = True
    obj = PEagleObjective(drafter)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):
        loss, _ = obj(x, aux, torch.roll(x, -1, 1), valid, t2d)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, drafter.eval(), d2t, prompts, fresh


class Recorder(PEagleProposer):
    """The proposer, keeping every round's slot logits and drafts."""

    def reset(self):
        super().reset()
        self.logits, self.drafted = [], []

    def slot_logits(self, k):
        out = super().slot_logits(k)
        self.logits.append(out)
        return out

    def draft(self, k):
        out = super().draft(k)
        self.drafted.append(out)
        return out


def teacher_forced(target, prompt):
    """prompt + the greedy continuation of MAX_NEW + K − 1 tokens and the aux states of its positions."""
    x = prompt + hf_loop.greedy(target, prompt, MAX_NEW + K - 1)["tokens"]
    _, aux = target.forward(x[:-1], target.new_cache())
    return x, aux.reshape(len(x) - 1, -1)


def test_the_loop_at_t0_is_plain_greedy_and_eaglet_s_exact_parallel_chain(tiny):
    """At T = 0 the loop's text is plain greedy's and its rounds are eaglet's parallel chain's at every k
    <= K; every round's k slots (one cached forward) are the first k of the K-slot round from scratch,
    logit for logit and draft for draft; at k = K round for round parallel_chain_along's."""
    target, drafter, d2t, prompts, _ = tiny
    side, proposer = PEagleSide(drafter, drafter.cfg, d2t), Recorder(drafter, d2t)
    rounds = {k: [] for k in range(1, K + 1)}  # accepted per round
    for prompt in prompts:
        P, (x, aux) = len(prompt), teacher_forced(target, prompt)
        greedy = hf_loop.greedy(target, prompt, MAX_NEW)["tokens"]
        off = parallel_prompt(target, side, prompt, K, MAX_NEW)
        at = [0] + [s["accepted"] for s in off["starts"]]
        scratch = {}  # start g -> the K-slot round from scratch: its logits and drafts
        for k in range(1, K + 1):
            n_steps = len(proposer.step_times)
            r = hf_loop.speculative(target, proposer, prompt, k, MAX_NEW)
            assert r["tokens"] == greedy == off["tokens"] == x[P:P + MAX_NEW]
            assert r["rounds"] == chain.chain_replay(at, len(greedy), MAX_NEW, k), k
            drafting = [(g, k_eff) for g, k_eff, _ in r["rounds"] if k_eff]
            assert len(proposer.step_times) - n_steps == len(proposer.logits) == len(drafting)  # one forward a round
            for (g, k_eff), got, d in zip(drafting, proposer.logits, proposer.drafted, strict=True):
                if g not in scratch:
                    t = P + g - 2  # the round's last verified position: bonus x[t + 1], g_t
                    with torch.inference_mode():
                        g_PH = drafter.project(aux[None, :t + 1])[0]
                        scratch[g] = (drafter.parallel_logits(x[:t + 2], g_PH),
                                      drafter.draft_parallel(x[:t + 2], g_PH, d2t))
                want, want_drafts = scratch[g]
                assert got.shape == (k_eff, len(d2t))
                # float rounding only (≤ 5e-6 seen); a masked slot left in the cache moves them by ~3e-4 here
                torch.testing.assert_close(got, want[:k_eff], rtol=0, atol=3e-5)
                assert d == want_drafts[:k_eff], (k, g)
            rounds[k] += [a for _, _, a in r["rounds"]]
        # k = K: vLLM's chain (parallel_chain_along along the greedy text), round for round and draft for draft
        ref = drafter.parallel_chain_along(aux, x, P, MAX_NEW, d2t)["rounds"]
        assert [g for g, _, _ in r["rounds"]] == [c["g"] for c in ref]
        drafted = proposer.drafted + [[]] * (len(ref) - len(proposer.drafted))  # a last round may draft nothing
        for (g, k_eff, a), c, d in zip(r["rounds"], ref, drafted, strict=True):
            assert k_eff == min(K, MAX_NEW - g - 1) and a == min(c["accepted"], k_eff) and d == c["drafts"][:k_eff]
    # the walk is tested on rounds that accept all, some and none of their drafts
    assert all({0, k} <= set(a) for k, a in rounds.items()) and {1, 2} <= set(rounds[K]), rounds


def test_an_eos_ends_the_loop_as_it_ends_the_parallel_chain(tiny):
    """An EOS ends the loop where it ends plain greedy, with the parallel chain's rounds up to it."""
    target, drafter, d2t, prompts, _ = tiny
    free = hf_loop.greedy(target, prompts[1], MAX_NEW)["tokens"]
    eos = next(t for t in free if t != free[0])  # the answer's first other token: 17 tokens in
    stopper = hf_loop.Target(target.model, LAYERS, eos_ids={eos})
    greedy = hf_loop.greedy(stopper, prompts[1], MAX_NEW)["tokens"]
    assert greedy[-1] == eos and 10 < len(greedy) < MAX_NEW
    off = parallel_prompt(stopper, PEagleSide(drafter, drafter.cfg, d2t), prompts[1], K, MAX_NEW)
    r = hf_loop.speculative(stopper, PEagleProposer(drafter, d2t), prompts[1], K, MAX_NEW)
    assert r["tokens"] == greedy
    assert r["rounds"] == chain.chain_replay([0] + [s["accepted"] for s in off["starts"]], len(greedy), MAX_NEW, K)


def test_the_cache_keeps_each_verified_entry_once_and_no_masked_slot(tiny):
    """fc reads every verified position once (the prompt's prefill, then each round's pending entries),
    the masked slots' hidden is projected at construction only, and after the run the cache holds
    exactly the real entries at positions 0 to n − 1 in order, no masked slot and no entry twice; only
    the round forwards are timed (the prefill is not a step)."""
    target, drafter, d2t, prompts, _ = tiny
    proposer = PEagleProposer(drafter, d2t)
    rows = []
    hook = drafter.fc.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[1]))
    try:
        r = hf_loop.speculative(target, proposer, prompts[2], K, MAX_NEW)
    finally:
        hook.remove()
    drafting = sum(k_eff > 0 for _, k_eff, _ in r["rounds"])
    assert sum(rows) + len(proposer.pending_ids) == len(prompts[2]) + len(r["tokens"]) - 1
    assert len(rows) == 1 + drafting and rows[0] == len(prompts[2]) - 1  # the prefill, then one per round
    assert proposer.n == sum(rows) and len(proposer.cache) == proposer.n
    assert proposer.cache.pos_BL[0].tolist() == list(range(proposer.n))
    assert len(proposer.step_times) == drafting and len(proposer.margins) == sum(k for _, k, _ in r["rounds"])


class SampledRecorder(PEagleProposer):
    """The proposer, keeping every round's sampled drafts and q."""

    def reset(self):
        super().reset()
        self.rounds = []

    def draft_sampled(self, k, temperature, gen):
        drafts, q = super().draft_sampled(k, temperature, gen)
        self.rounds.append((drafts, q))
        return drafts, q


def test_sampling_at_t1_with_either_draft_sample_method(tiny):
    """A seeded run of speculative sampling at T = 1 completes and repeats under each draft sample method,
    one drafter forward a round; with the untrained drafter (q spread), greedy drafts are argmax q with
    q one-hot at them, sampled drafts are drawn from each slot's own q (so not all argmax), q over the
    target vocabulary with no mass outside the draft vocabulary. With the trained drafter, from one
    verified state: greedy drafts are the T = 0 drafts, q is softmax(slot logits / T) of the round
    from scratch, slot j's draft the seeded draw from q_j."""
    target, drafter, d2t, prompts, fresh = tiny
    ids = PEagleProposer(drafter, d2t).ids
    for method in ("probabilistic", "greedy"):
        proposer = SampledRecorder(fresh, d2t, method)
        runs = [hf_loop.speculative_sampling(target, proposer, prompts[0], K, MAX_NEW, 1.0, hf_loop.generator(7))
                for _ in range(2)]
        assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["rounds"] == runs[1]["rounds"]
        assert 1 < len(runs[0]["tokens"]) <= MAX_NEW and len(runs[0]["rounds"]) < MAX_NEW
        drafting = sum(k_eff > 0 for _, k_eff, _ in runs[0]["rounds"])
        assert len(proposer.step_times) == 2 * drafting and len(proposer.rounds) == drafting
        top = []
        for drafts, q in proposer.rounds:
            assert q.shape == (len(drafts), drafter.cfg.vocab_size)
            torch.testing.assert_close(q[:, ids].sum(-1), torch.ones(len(drafts)))  # all mass in the draft vocab
            assert all(q[j, d] > 0 for j, d in enumerate(drafts))
            top += [d == int(q[j].argmax()) for j, d in enumerate(drafts)]
        if method == "greedy":
            assert all(top) and all(torch.equal(q.sum(-1), torch.ones(len(q))) and int((q > 0).sum()) == len(q)
                                    for _, q in proposer.rounds)  # one-hot
        else:
            assert not all(top), top  # drawn, not the argmax
    # one round of the trained drafter from one verified state (a start whose drafts are not all one
    # token), three ways
    x, aux = teacher_forced(target, prompts[0])
    with torch.inference_mode():
        t = next(t for t in range(len(prompts[0]) - 1, len(x) - 2)
                 if len(set(drafter.draft_parallel(x[:t + 2], drafter.project(aux[None, :t + 1])[0]))) > 1)
        soft = torch.softmax(drafter.parallel_logits(x[:t + 2], drafter.project(aux[None, :t + 1])[0]), -1)
    by = {}
    for method in ("probabilistic", "greedy", None):
        by[method] = p = PEagleProposer(drafter, d2t, method or "probabilistic")
        p.extend(aux[:t + 1], x[1:t + 2])
    want = by[None].draft(K)  # T = 0
    drafts, q = by["greedy"].draft_sampled(K, 1.0, hf_loop.generator(0))
    assert drafts == want and torch.equal(q, torch.nn.functional.one_hot(torch.tensor(want), q.shape[-1]).float())
    drafts, q = by["probabilistic"].draft_sampled(K, 1.0, hf_loop.generator(3))
    torch.testing.assert_close(q[:, ids], soft, rtol=1e-4, atol=1e-6)
    assert float(q.sum()) == pytest.approx(K, abs=1e-5)
    gen = hf_loop.generator(3)  # slot j's draft is the seeded draw from its own q_j, in slot order
    assert drafts == [int(ids[hf_loop.draw(q[j, ids], gen)]) for j in range(K)]


def test_what_a_p_eagle_proposer_cannot_draft_is_refused(tiny):
    """An unknown draft sample method, a draft before any verified position, k past parallel_k, T = 0
    sampling: refused."""
    target, drafter, d2t, prompts, _ = tiny
    with pytest.raises(ValueError, match="draft sample method 'sampled'"):
        PEagleProposer(drafter, d2t, "sampled")
    proposer = PEagleProposer(drafter, d2t)
    with pytest.raises(RuntimeError, match="before extend"):
        proposer.draft(1)
    _, aux = target.forward(prompts[0], target.new_cache())
    with pytest.raises(ValueError, match="verified positions for"):
        proposer.extend(aux[:-1], prompts[0][1:] + [5])
    proposer.extend(aux, prompts[0][1:] + [5])
    with pytest.raises(ValueError, match=f"k={K + 1}: a P-EAGLE drafter of parallel_k {K} drafts 1 .. {K}"):
        proposer.draft(K + 1)
    with pytest.raises(ValueError, match="T > 0"):
        proposer.draft_sampled(1, 0.0, hf_loop.generator(0))
    proposer.draft(K)
    with pytest.raises(RuntimeError, match="before extend"):  # a round consumes the verified entries
        proposer.draft(K)
