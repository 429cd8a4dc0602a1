"""The HF evaluation loop (eaglet.engines.hf_loop): the real speculative loop is lossless and accepts, token
for token, what the offline simulator counts from every position; KV rollback of rejected drafts on
every cache kind (full attention, sliding windows, recurrent layers); the target's dtype."""

import pytest
import torch

from eaglet.base import datasets
from eaglet.drafter import chain
from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter
from eaglet.engines import hf_loop
from eaglet.target.load import load_model, load_target_embedding, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the real loop
@pytest.fixture(scope="module")
def tiny(tiny_target):
    tok = load_tokenizer(tiny_target["path"])
    model = load_model(tiny_target["path"])
    prompts = [datasets.encode(tok, r["messages"]) for r in datasets.load_set("mtbench", 3)]
    return tiny_target, model, prompts


class Oracle:
    """A proposer that knows the greedy continuation and is wrong exactly at the listed indices."""

    def __init__(self, prompt_len: int, truth: list[int], wrong=()):
        self.P, self.truth, self.wrong = prompt_len, truth, set(wrong)
        self.reset()

    def reset(self):
        self.n = 0

    def extend(self, aux_T3H, next_ids):
        assert aux_T3H.shape[0] == len(next_ids) and aux_T3H.shape[1] == 3
        self.n += len(next_ids)

    def draft(self, k):
        g = self.n + 1 - self.P  # tokens emitted so far
        return [(self.truth[i] + 1 if i in self.wrong else self.truth[i]) if i < len(self.truth) else 0
                for i in range(g, g + k)]


def test_loop_with_an_always_right_drafter_gives_the_hand_computed_tau(tiny):
    ident, model, prompts = tiny
    target = hf_loop.Target(model, [2, 4, 5], eos_ids=set())
    gr = hf_loop.greedy(target, prompts[0], 20)
    sp = hf_loop.speculative(target, Oracle(len(prompts[0]), gr["tokens"]), prompts[0], 3, 20)
    assert sp["tokens"] == gr["tokens"]
    # g = 1 -> 5 -> 9 -> 13 -> 17 (3 accepted + bonus each), then k_eff = min(3, 20-17-1) = 2
    assert sp["rounds"] == [(1, 3, 3), (5, 3, 3), (9, 3, 3), (13, 3, 3), (17, 2, 2)]
    assert chain.rounds_tau(sp["rounds"]) == pytest.approx(1 + 14 / 5)


def test_offline_counting_replays_the_real_loop_with_rejections(tiny):
    ident, model, prompts = tiny
    target = hf_loop.Target(model, [2, 4, 5], eos_ids=set())
    for prompt, wrong in zip(prompts, ([2, 3, 9], [1, 5, 6, 7, 15], [])):
        gr = hf_loop.greedy(target, prompt, 24)
        truth = gr["tokens"]
        K = 4
        oracle = Oracle(len(prompt), truth, wrong)
        # offline: K drafts from every start, accepted prefix against the continuation
        acc = [0]
        for g in range(1, len(truth)):
            oracle.n = len(prompt) + g - 1
            acc.append(chain.accepted_prefix(oracle.draft(K), truth[g:]))
        for k in range(1, K + 1):
            sp = hf_loop.speculative(target, Oracle(len(prompt), truth, wrong), prompt, k, 24)
            assert sp["tokens"] == truth  # lossless also when drafts are rejected mid-way
            assert sp["rounds"] == chain.chain_replay(acc, len(truth), 24, k), (wrong, k)


def test_eos_ends_the_loop_and_the_replay_alike(tiny):
    ident, model, prompts = tiny
    free = hf_loop.Target(model, [2, 4, 5], eos_ids=set())
    truth = hf_loop.greedy(free, prompts[1], 16)["tokens"]
    eos = truth[6]  # pretend the 7th generated token is EOS
    target = hf_loop.Target(model, [2, 4, 5], eos_ids={eos})
    gr = hf_loop.greedy(target, prompts[1], 16)
    stop = truth.index(eos)
    assert gr["tokens"] == truth[:stop + 1]
    acc = [0] + [chain.accepted_prefix(truth[g:g + 4], gr["tokens"][g:]) for g in range(1, len(gr["tokens"]))]
    sp = hf_loop.speculative(target, Oracle(len(prompts[1]), truth), prompts[1], 4, 16)
    assert sp["tokens"] == gr["tokens"]
    assert sp["rounds"] == chain.chain_replay(acc, len(gr["tokens"]), 16, 4)


# --------------------------------------------------------------------------- with a real drafter
def _memorising_drafter(ident, target, prompt, steps=30, n_new=40):
    """A drafter trained in-process (ttt_unroll, hard labels) on one greedy continuation, so the
    real drafter has non-trivial acceptance on that prompt: 30 steps leave it right at most
    positions and wrong at some, so both acceptance and rejection paths run."""
    gr = hf_loop.greedy(target, prompt, n_new, capture=True)
    x = torch.tensor(prompt + gr["tokens"])
    used = torch.unique(torch.cat([x, torch.arange(256)]))  # sorted; the continuation is in the vocab
    t2d = torch.zeros(ident["vocab_size"], dtype=torch.bool)
    t2d[used] = True
    d2t = used - torch.arange(len(used))
    to_draft = torch.full((ident["vocab_size"],), -100, dtype=torch.long)
    to_draft[used] = torch.arange(len(used))
    torch.manual_seed(0)
    cfg = DrafterConfig.from_identity(ident, draft_vocab_size=len(used), layer_ids=[2, 4, 5])
    m = Eagle3Drafter(cfg, load_target_embedding(ident["path"]))
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    xs, g = x[None, :-1], gr["aux"][None]  # aux rows 0..S-2 pair with tokens x_1..x_{S-1}
    S = x.numel()
    for _ in range(steps):
        loss = 0
        for k, logits, _h in m.ttt_unroll(xs, m.project(g), 3):
            n = S - 2 - k  # index t predicts x[t + 2 + k]
            loss = loss + torch.nn.functional.cross_entropy(logits[0, :n], to_draft[x[2 + k:2 + k + n]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval(), d2t


def test_trained_drafter_offline_simulator_equals_the_real_loop(tiny):
    ident, model, prompts = tiny
    target = hf_loop.Target(model, [2, 4, 5], eos_ids=set())
    drafter, d2t = _memorising_drafter(ident, target, prompts[2])
    prop = hf_loop.EagleProposer(drafter, d2t)
    off = hf_loop.offline_prompt(target, prop, prompts[2], 4, 40)
    acc = [0] + [s["accepted"] for s in off["starts"]]
    assert chain.tau_all_positions(acc[1:], [s["valid"] for s in off["starts"]], 3) > 2.0  # it did learn
    assert 0 in acc[1:]  # ... and is wrong somewhere
    for k in (1, 2, 3, 4):
        sp = hf_loop.speculative(target, prop, prompts[2], k, 40)
        assert sp["tokens"] == off["tokens"]  # lossless
        replay = chain.chain_replay(acc, len(off["tokens"]), 40, k)
        if sp["rounds"] != replay:  # allowed only at a logged numerical tie
            assert min(s["drafter_margin"] for s in off["starts"]) < 1e-5, (k, sp["rounds"], replay)
        assert chain.rounds_tau(sp["rounds"]) > 1.4


# --------------------------------------------------------------------------- KV rollback on every cache kind
def tiny_gemma3(sliding_window: int = 8):
    """A tiny random Gemma 3 text model (tied and scaled embeddings, (1+w) norms, a mix of sliding
    and full attention layers) with a window far shorter than the sequences the tests decode.
    (To be unified with eaglet.target.families.build_tiny("gemma3_text").)"""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, sliding_window=sliding_window, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    return transformers.Gemma3ForCausalLM(cfg).eval()


def tiny_qwen3_next():
    """A tiny random Qwen3-Next: linear-attention (recurrent) layers whose cache can never crop."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=256,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def random_proposer(model, layer_ids=(0, 1, 2), seed=0):
    """A random EAGLE-3 drafter on ``model``'s embedding: it is rejected nearly every round, so
    each verify drops k keys from the target cache."""
    c = model.config
    ident = dict(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                 head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size)
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_identity(ident, draft_vocab_size=c.vocab_size, layer_ids=list(layer_ids))
    drafter = Eagle3Drafter(cfg, model.get_input_embeddings().weight.detach()).eval()
    return hf_loop.EagleProposer(drafter, torch.zeros(c.vocab_size, dtype=torch.long))


def _check_lossless_loop(model, rollback, max_new, wrong=(2, 5, 9, 14, 20, 21)):
    """Speculative == greedy token for token with an oracle wrong at ``wrong`` (partial acceptance,
    rounds as the replay says) and with a random drafter (rejections every round), for k 1..4."""
    target = hf_loop.Target(model, [0, 1, 2], eos_ids=set(), rollback=rollback)
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    truth = hf_loop.greedy(target, prompt, max_new)["tokens"]
    oracle = Oracle(len(prompt), truth, wrong)
    acc = [0]
    for g in range(1, len(truth)):
        oracle.n = len(prompt) + g - 1
        acc.append(chain.accepted_prefix(oracle.draft(4), truth[g:]))
    for k in (1, 2, 4):
        sp = hf_loop.speculative(target, Oracle(len(prompt), truth, wrong), prompt, k, max_new)
        assert sp["tokens"] == truth, (rollback, k)
        assert sp["rounds"] == chain.chain_replay(acc, len(truth), max_new, k), (rollback, k)
    sp = hf_loop.speculative(target, random_proposer(model), prompt, 3, max_new)
    assert sp["tokens"] == truth
    assert sum(a for _, _, a in sp["rounds"]) < len(sp["rounds"])  # it was rejected: rollback ran
    return target, prompt


@pytest.mark.parametrize("rollback", ["auto", "refeed"])
def test_loop_is_lossless_past_a_sliding_window(rollback):
    # Gemma 3's sliding layers keep only window - 1 keys: past the window, dropping rejected drafts
    # used to raise in transformers' DynamicSlidingWindowLayer.crop
    model = tiny_gemma3(sliding_window=8)
    target, prompt = _check_lossless_loop(model, rollback, max_new=40)
    cache = target.new_cache()
    target.forward(prompt, cache)
    assert sum(cache.is_sliding) == 3 and len(prompt) + 40 > 4 * model.config.sliding_window
    assert target.arm_rollback(cache) is (rollback == "auto")  # auto: crop, with past recording


def test_a_sliding_cache_rolled_back_wrong_is_caught(monkeypatch):
    """The Gemma 3 check above can fail: a crop that leaves rejected keys in the sliding layers
    changes the output."""
    model = tiny_gemma3(sliding_window=8)

    def stale(cache, n):
        extra = cache.get_seq_length() - n
        for layer in cache.layers:
            if extra > 0 and not layer.is_sliding:
                layer.crop(-extra)
            elif layer.is_sliding:
                layer.cumulative_length = n

    monkeypatch.setattr(hf_loop.Target, "crop", staticmethod(stale))
    with pytest.raises(AssertionError):
        _check_lossless_loop(model, "auto", max_new=40)


@pytest.mark.parametrize("rollback", ["auto", "refeed"])
def test_loop_is_lossless_on_the_tiny_llama_by_crop_and_by_refeed(tiny, rollback):
    _, model, _ = tiny
    target, prompt = _check_lossless_loop(model, rollback, max_new=24)
    cache = target.new_cache()
    target.forward(prompt, cache)
    assert target.arm_rollback(cache) is (rollback == "auto")


def test_a_recurrent_cache_falls_back_to_snapshot_and_refeed():
    # linear attention folds every fed token into its state: crop can never undo a rejected draft
    model = tiny_qwen3_next()
    target, prompt = _check_lossless_loop(model, "auto", max_new=20, wrong=(2, 5, 9, 14))
    cache = target.new_cache()
    target.forward(prompt, cache)
    assert target.arm_rollback(cache) is False
    with pytest.raises(ValueError, match="LinearAttentionLayer"):
        hf_loop.Target(model, [0, 1, 2], set(), rollback="crop").arm_rollback(cache)


def test_target_in_another_dtype_hands_the_drafter_fp32_cpu_tensors(tiny_target):
    """target.dtype reaches the HF loop (bf16 here, on a GPU there): the drafter (fp32, CPU) still
    reads fp32 CPU aux states and the loop fp32 CPU logits."""
    model = load_model(tiny_target["path"], dtype="bfloat16", device="cpu")
    t = hf_loop.Target(model, default_layer_ids_for(model), set())
    logits, aux = t.forward([1, 2, 3], t.new_cache())
    assert logits.dtype == aux.dtype == torch.float32 and logits.device.type == aux.device.type == "cpu"
    assert aux.shape == (3, 3, model.config.hidden_size)


def default_layer_ids_for(model) -> list[int]:
    from eaglet.target.load import default_layer_ids

    return default_layer_ids(model.config.num_hidden_layers)
