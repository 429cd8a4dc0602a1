"""The known-answer DFlash drafter (eaglet.export.dflash_known_answer), offline: on a twin of the
tiny target with its mask token off the cycle, a DFlash drafter built so that the first draft of
every block is the twin's greedy token; eaglet's own block drafting (the rounds vLLM's proposer runs)
along the twin's chain accepts every first draft, from the model and from the exported directory read
back; each deliberate breakage of the directory (taps one layer lower, another mask token, fc's tap
blocks permuted or transposed, a final norm of ones) passes the static check and drops first-draft
acceptance to ~0. Served by real vLLM: tests/export/test_dflash_served.py."""

import dataclasses
from pathlib import Path

import pytest
import torch

from eaglet.base.files import read_json
from eaglet.drafter.dflash import DFlashConfig
from eaglet.export import dflash_known_answer
from eaglet.export.contract import record, twin, vllm_checks
from eaglet.export.dflash_format import dflash_static_problems

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = vllm_checks.check_prompts(2)
MAX_TOKENS = 16
MASK = 16  # SmolLM2's <empty_output> (the tiny target's tokenizer): a token on the twin's cycle


@pytest.fixture(scope="module")
def known(tiny_target, tmp_path_factory):
    """The twin, the trained-like config (2 layers, block 4, taps [2, 4, 7]), the known-answer export
    and one broken copy per breakage."""
    work = tmp_path_factory.mktemp("dflash_known_answer")
    cfg = DFlashConfig.from_identity(tiny_target, num_layers=2, block_size=4, mask_token_id=MASK,
                                     target_layer_ids=[2, 4, 7])
    known_twin, good = dflash_known_answer.prepare(tiny_target, cfg, work, PROMPTS)
    bad = {how: dflash_known_answer.break_export(good, how, work / f"bad_{how}")
           for how in dflash_known_answer.BREAKAGES}
    return {"twin": known_twin, "cfg": cfg, "good": good, "bad": bad}


def test_twin_greedy_is_the_chain_and_the_mask_is_off_the_cycle(known):
    """The twin's own greedy decoding (transformers) is the known chain; the mask token's predecessor
    on the original cycle is followed by its successor, and the mask embeds no answer and is never greedy."""
    from eaglet.target.load import load_model

    t = known["twin"]
    model = load_model(t["path"])
    for ids in twin.prompt_ids(t, PROMPTS):
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert out == twin.chain(t, ids[-1], 8) and MASK not in out
    pi = twin.successor(t)
    assert int(pi[MASK]) == MASK and int((pi == MASK).sum()) == 1  # nothing leads to the mask
    known_json = read_json(Path(t["path"]) / twin.KNOWN)
    m, spliced = known_json["layout"]["m"], known_json["dflash_mask_spliced"]
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb[MASK, :m].abs().max() == 0 and head[MASK].abs().max() == 0
    # the mask's old predecessor is followed by the mask's old successor, and other tokens by pi's
    assert int(pi[spliced["predecessor"]]) == spliced["successor"]
    some = torch.randperm(len(pi), generator=torch.Generator().manual_seed(0))[:16].tolist()
    with torch.no_grad():
        for v in [spliced["predecessor"], *(v for v in some if v != MASK)]:
            assert int(model(torch.tensor([[v]])).logits[0, -1].argmax()) == int(pi[v])


def test_known_answer_first_draft_is_accepted_offline(known):
    """eaglet's DFlash block drafting along the twin's chain accepts every first draft: the model as
    built and the exported directory as read back (which passes the static check)."""
    model = dflash_known_answer.build_drafter(known["twin"], known["cfg"])
    built = dflash_known_answer.offline_first_draft(known["twin"], model, PROMPTS, max_tokens=MAX_TOKENS)
    assert built["drafts"] > 0 and built["first_rate"] == 1.0, built
    assert model.known_answer["margin_nats"] >= dflash_known_answer.MIN_MARGIN - 1e-6
    assert dflash_static_problems(known["good"]) == []
    read = dflash_known_answer.offline_first_draft(known["twin"], known["good"], PROMPTS, max_tokens=MAX_TOKENS)
    assert read == built


@pytest.mark.parametrize("how", dflash_known_answer.BREAKAGES)
def test_each_breakage_drops_first_draft_acceptance_offline(known, how):
    """A broken copy of the directory passes the static check, and eaglet's forward on it accepts ~no first draft."""
    bad = known["bad"][how]
    assert dflash_static_problems(bad) == []
    r = dflash_known_answer.offline_first_draft(known["twin"], bad, PROMPTS, max_tokens=MAX_TOKENS)
    assert r["drafts"] > 0 and r["first_rate"] <= 0.1, (how, r)


def test_the_check_is_not_run_where_no_known_answer_fits(tiny_target, tiny_family, tmp_path):
    """A family with no twin, or a drafter with one head, is not run with the reason (no pass); a
    missing vLLM interpreter fails the check."""
    from eaglet.target.load import load_identity

    gemma = load_identity(tiny_family("gemma3_text"))
    gcfg = DFlashConfig.from_identity(gemma, num_layers=1, block_size=4, mask_token_id=5, target_layer_ids=[1])
    ch = dflash_known_answer.pending_check(gemma, gcfg, work_dir=tmp_path / "g")
    assert ch["ok"] is None and ch["name"] == "vllm.known_answer" and "gemma3_text" in ch["reason"]
    cfg = DFlashConfig.from_identity(tiny_target, num_layers=1, block_size=4, mask_token_id=MASK,
                                     target_layer_ids=[2, 4, 5])
    one_head = dataclasses.replace(cfg, num_heads=1, num_kv_heads=1)
    ch = dflash_known_answer.pending_check(tiny_target, one_head, work_dir=tmp_path / "h")
    assert ch["ok"] is None and "one attention head" in ch["reason"]
    assert record.verdict([ch])["ok"] is False
    ch = dflash_known_answer.pending_check(tiny_target, cfg, work_dir=tmp_path / "n",
                                           python=str(tmp_path / "none" / "bin" / "python"))
    assert ch["ok"] is False and "vLLM environment not found" in ch["details"]["error"]


def test_pending_check_runs_the_known_answer_and_judges_vllm_counters(tiny_target, tmp_path):
    """The contract's pending check (no engine started here): its vLLM run serves the known-answer
    export on the twin at k = block_size − 1 on the contract's prompts, eaglet's own first-draft rate
    on the directory is recorded (1.0), and its finish passes vLLM counters with every first draft
    accepted along the twin's chain and fails counters with none."""
    from conftest import vllm_env_or_skip
    from eaglet.target.load import load_identity

    env = vllm_env_or_skip()
    cfg = DFlashConfig.from_identity(tiny_target, num_layers=1, block_size=3, mask_token_id=MASK,
                                     target_layer_ids=[2, 4, 5])
    p = dflash_known_answer.pending_check(tiny_target, cfg, work_dir=tmp_path, python=env, n_prompts=2,
                                          max_tokens=8)
    assert isinstance(p, dflash_known_answer.Pending) and p.prompts == PROMPTS
    assert {k: p.run[k] for k in ("tag", "k", "max_tokens")} == {"tag": "known_answer", "k": 2, "max_tokens": 8}
    assert dflash_static_problems(p.run["drafter"]) == [] and Path(p.run["target"]).is_dir()
    known_twin = load_identity(tmp_path / "twin" / "identity.json")
    chains = [twin.chain(known_twin, ids[-1], 8) for ids in twin.prompt_ids(known_twin, PROMPTS)]

    def spec(first):
        return {"rc": 0, "token_ids": chains,
                "spec_decode": {"num_drafts": 6, "num_accepted_tokens_per_pos": [first, 0]}}

    ok = p.finish(spec(6))
    assert ok["ok"] is True and ok["details"]["first_draft_rate"] == 1.0, ok
    assert ok["details"]["offline_first_draft_rate"] == 1.0 and ok["details"]["kind"] == "dflash"
    assert not list(Path(p.run["target"]).glob("*.safetensors"))  # the twin's weights go after the run
    bad = p.finish(spec(0))
    assert bad["ok"] is False and bad["details"]["first_draft_rate"] == 0.0
