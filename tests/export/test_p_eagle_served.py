"""A P-EAGLE drafter served by real vLLM (CPU build) on the tiny target with
``{"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}``, every run in one
runner process: at T = 0 the output is exactly plain greedy's, and vLLM's acceptance counters (drafts,
draft tokens, accepted per position) equal eaglet's exact offline parallel chain
(eaglet.drafter.p_eagle.PEagleDrafter.parallel_chain_along) along vLLM's own plain output. The drafter
is first overfitted on the target's greedy answers to two of the three prompts, so that rounds are
accepted at every slot on those and rejected on the third.

A broken copy, the aux layer ids one lower (the layer-id trap: every slot reads other layers), served
the same way, stays lossless (vLLM's verifier) and vLLM reads the lower taps, but its counters depart
from the trained drafter's chain (static.layer_ids refuses it before serving too). Not here: a zeroed
or permuted mask_hidden served: on this tiny target (whose greedy output soon repeats one token) a
zeroed mask_hidden was served once by hand with counters equal to the trained chain's (23 rounds,
8/8/8 accepted), so the counters cannot tell it apart there (docs/block-drafters.md §8).

The kind's known answer (vllm.known_answer): EAGLE-3's known-answer drafter for a twin of the tiny
target, made a P-EAGLE folder, served with parallel drafting: every first draft accepted; its copy with
the layer ids one lower: none (its own runner process, two engines on the twin)."""

import dataclasses
import json
import shutil

import pytest
import torch

from conftest import vllm_env_or_skip
from eaglet.base.tensors import load_tensors
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter, PEagleObjective, save_p_eagle
from eaglet.engines import hf_loop, vllm_env
from eaglet.export.contract.vllm_checks import run_vllm_batch
from eaglet.export.p_eagle_format import export_p_eagle, p_eagle_static_problems
from eaglet.target.load import load_model, load_tokenizer

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
TRAINED_ON = 2  # the drafter learns the first two answers; the third's rounds are rejected
MAX_TOKENS, K = 16, 3
LAYER_IDS = [2, 4, 5]


def _sum_counts(cs: list[dict]) -> dict:
    return {
        "drafts": sum(c["drafts"] for c in cs),
        "accepted_per_pos": [sum(c["accepted_per_pos"][j] for c in cs) for j in range(K)],
    }


def _served_counts(run: dict) -> dict:
    sd = run["spec_decode"]
    return {
        "drafts": int(sd["num_drafts"]),
        "draft_tokens": int(sd["num_draft_tokens"]),
        "accepted_per_pos": [int(v) for v in sd["num_accepted_tokens_per_pos"]],
    }


# real vLLM, started by the module fixture (the suite marks by the test's own source): not in `make test-fast`
pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory, one_thread):
    env = vllm_env_or_skip()
    tmp = tmp_path_factory.mktemp("p_eagle_served")
    model = load_model(tiny_target["path"])
    tok = load_tokenizer(tiny_target["path"])
    target = hf_loop.Target(model, LAYER_IDS, set())
    embed = model.get_input_embeddings().weight.detach().float()
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]

    def aux_of(x):
        _, aux = target.forward(x, target.new_cache())
        return aux.reshape(len(x), -1)

    V = int(tiny_target["vocab_size"])
    cfg = PEagleConfig.from_identity(
        tiny_target, draft_vocab_size=V, layer_ids=LAYER_IDS, mask_token_id=V - 1, parallel_k=K
    )
    torch.manual_seed(0)
    drafter = PEagleDrafter(cfg, embed)
    seqs = [p + hf_loop.greedy(target, p, MAX_TOKENS + K)["tokens"] for p in prompts[:TRAINED_ON]]
    S = min(len(s) for s in seqs)
    x = torch.tensor([s[:S] for s in seqs])
    labels = torch.roll(x, -1, 1)  # the target's greedy token after each position (its own answer)
    valid = torch.zeros_like(x, dtype=torch.bool)
    for i, p in enumerate(prompts[:TRAINED_ON]):
        valid[i, len(p) - 1 : S - 1] = True
    with torch.no_grad():
        aux = torch.stack([aux_of(s[:S]) for s in seqs])
    obj = PEagleObjective(drafter)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    t2d = torch.ones(V, dtype=torch.bool)
    for _ in range(60):
        loss, _ = obj(x, aux, labels, valid, t2d)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    save_p_eagle(tmp / "drafter.safetensors", drafter, cfg, torch.zeros(V, dtype=torch.long), t2d)
    good = export_p_eagle(tmp / "p_eagle", load_tensors(tmp / "drafter.safetensors"), cfg, tiny_target)
    assert p_eagle_static_problems(good, tiny_target, dataclasses.asdict(cfg)) == []

    lower = shutil.copytree(good, tmp / "layer_ids_minus_one")
    conf = json.loads((lower / "config.json").read_text())
    conf["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in LAYER_IDS]
    (lower / "config.json").write_text(json.dumps(conf))

    runs = [
        {"tag": "plain", "target": tiny_target["path"], "drafter": None, "k": K, "max_tokens": MAX_TOKENS + K - 1},
        {"tag": "p_eagle", "target": tiny_target["path"], "drafter": good, "k": K, "max_tokens": MAX_TOKENS},
        {"tag": "lower", "target": tiny_target["path"], "drafter": lower, "k": K, "max_tokens": MAX_TOKENS},
    ]
    res = run_vllm_batch(runs, PROMPTS, work_dir=tmp / "vllm", python=vllm_env.vllm_python(env))
    print("\n[p_eagle served] seconds per run", {r: res[r].get("seconds") for r in res})
    want = _sum_counts(
        [
            drafter.parallel_chain_along(aux_of(p + c), p + c, len(p), MAX_TOKENS)["counts"]
            for p, c in zip(prompts, res["plain"]["token_ids"])
        ]
    )
    return {**res, "prompts": prompts, "want": want, "cfg": cfg, "lower_dir": lower}


def test_p_eagle_served_lossless_and_counters_equal_the_offline_parallel_chain(served):
    """Served with parallel drafting at T = 0: plain greedy's output, and vLLM's counters = eaglet's
    offline parallel chain's (every slot accepted somewhere, and rounds rejected)."""
    plain, spec, want = served["plain"], served["p_eagle"], served["want"]
    assert plain["rc"] == 0 and spec["rc"] == 0, (plain.get("log_tail"), spec.get("log_tail"))
    assert spec["prompt_token_ids"] == served["prompts"]
    assert spec["token_ids"] == [t[:MAX_TOKENS] for t in plain["token_ids"]]  # lossless
    got = _served_counts(spec)
    print("\n[p_eagle served] vLLM counters", got, "offline chain", want)
    assert got == {
        "drafts": want["drafts"],
        "draft_tokens": want["drafts"] * K,
        "accepted_per_pos": want["accepted_per_pos"],
    }, (got, want)
    assert spec["aux_layers"] == LAYER_IDS
    assert all(a > 0 for a in want["accepted_per_pos"]) and want["accepted_per_pos"][0] < want["drafts"], want


def test_broken_p_eagle_exports_depart_from_the_chain(served, tiny_target):
    """The aux layer ids one lower: still lossless (the verifier), vLLM taps the lower layers, and its
    counters are not the trained drafter's chain."""
    plain, want = served["plain"], served["want"]
    for tag in ("lower",):
        run = served[tag]
        assert run["rc"] == 0, run.get("log_tail")
        assert run["token_ids"] == [t[:MAX_TOKENS] for t in plain["token_ids"]], tag
        got = _served_counts(run)
        print(f"[p_eagle served, {tag}] vLLM counters", got)
        assert {k: got[k] for k in want} != want, (tag, got, want)  # vllm.acceptance's comparison fails
    assert served["lower"]["aux_layers"] == [i - 1 for i in LAYER_IDS]
    assert any(
        p.startswith("static.layer_ids")
        for p in p_eagle_static_problems(served["lower_dir"], tiny_target, dataclasses.asdict(served["cfg"]))
    )


def test_p_eagle_known_answer_is_accepted_in_parallel_and_its_broken_copy_is_not(tiny_target, tmp_path, one_thread):
    """vllm.known_answer for the kind: EAGLE-3's known-answer drafter for a twin of the tiny target,
    made a P-EAGLE folder (as_p_eagle), served with parallel drafting at K: the output is the twin's
    known chain and every first draft is accepted (slot 1 of the round is EAGLE-3's step). The copy
    with the aux layer ids one lower, made a P-EAGLE folder the same way, stays lossless and fails the
    known answer (its first drafts are rejected). Both in one runner process (~2 engine starts)."""
    from eaglet.export.contract import known_answer
    from eaglet.export.contract.twin import break_export
    from eaglet.export.contract.vllm_checks import check_prompts
    from eaglet.export.p_eagle_format import as_p_eagle

    env = vllm_env_or_skip()
    V, max_tokens = int(tiny_target["vocab_size"]), 16
    prompts = check_prompts(2)
    twin, eagle3 = known_answer.prepare(tiny_target, LAYER_IDS, tmp_path / "ka", prompts, k=K, max_tokens=max_tokens)
    lower = break_export(eagle3, "layer_ids_minus_one", tmp_path / "ka" / "lower")
    dirs = {"good": as_p_eagle(eagle3, tmp_path / "good", mask_token_id=V - 1, k=K),
            "lower": as_p_eagle(lower, tmp_path / "lower", mask_token_id=V - 1, k=K)}
    assert json.loads((dirs["good"] / "config.json").read_text())["parallel_drafting"] is True
    assert p_eagle_static_problems(dirs["good"], twin, None) == []
    runs = [{"tag": t, "target": twin["path"], "drafter": str(d), "k": K, "max_tokens": max_tokens}
            for t, d in dirs.items()]
    res = run_vllm_batch(runs, prompts, work_dir=tmp_path / "vllm", python=vllm_env.vllm_python(env),
                         serving=known_answer.twin_serving(None))
    ok, det = known_answer.judge(twin, prompts, res["good"], max_tokens)
    print("\n[p_eagle known answer]", {x: det[x] for x in ("num_drafts", "first_draft_rate", "accepted_per_pos")})
    assert ok and det["first_draft_rate"] == 1.0 and len(det["accepted_per_pos"]) == K, det
    bad, bdet = known_answer.judge(twin, prompts, res["lower"], max_tokens)
    print("[p_eagle known answer, layer ids - 1]", {x: bdet[x] for x in ("num_drafts", "first_draft_rate")})
    assert not bad and bdet["output_is_known_chain"] and bdet["first_draft_rate"] < 0.5, bdet
    assert res["lower"]["aux_layers"] == [i - 1 for i in LAYER_IDS]
