"""The known-answer drafter (eaglet.export.contract.known_answer): built so that its first draft is the target's
greedy token, on a twin of the target. Offline (eaglet's own speculative loop) and in real vLLM-CPU
its first draft is accepted every time; each deliberate breakage (shifted d2t, layer ids in the
other convention, a final norm of ones, fc blocks transposed) drops that to ~0 and fails the check."""

import json
from pathlib import Path

import pytest
import torch

from eaglet.engines import vllm_env
from eaglet.export.contract import contract, known_answer, record, twin, vllm_checks

PROMPTS = vllm_checks.PROMPTS[:2]
MAX_TOKENS, K = 16, 3
IDS = [2, 4, 7]  # the last aux layer at N-1 of the 8-layer tiny target; vLLM's default would be (2, 4, 5)


@pytest.fixture(scope="module")
def known(tiny_target, tmp_path_factory):
    """Twin of the tiny target, the known-answer drafter, its export and the four broken exports."""
    work = tmp_path_factory.mktemp("known_answer")
    known_twin, good = known_answer.prepare(tiny_target, IDS, work, PROMPTS, k=K, max_tokens=MAX_TOKENS)
    bad = {how: twin.break_export(good, how, work / f"bad_{how}") for how in twin.BREAKAGES}
    return {"twin": known_twin, "good": good, "bad": bad, "trained": work / "drafter.safetensors", "work": work}


def test_twin_greedy_is_the_known_chain(known):
    """The twin's own greedy decoding (transformers) is pi applied again and again."""
    from eaglet.target.load import load_model

    known_twin = known["twin"]
    model = load_model(known_twin["path"])
    for ids in twin.prompt_ids(known_twin, PROMPTS):
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert out == twin.chain(known_twin, ids[-1], 8)
        assert len(set(out)) == 8 and ids[-1] not in out  # no fixed point, no short cycle


def test_known_answer_is_accepted_offline(known):
    """eaglet's forward (hf_loop.speculative with the drafter's KV cache): every first draft."""
    r = known_answer.offline_first_draft(known["twin"], known["trained"], PROMPTS, k=K, max_tokens=MAX_TOKENS)
    assert r["lossless"] and r["rounds"] > 0 and r["first_rate"] == 1.0, r
    # the export as written (export writer, read back) is the same drafter
    e = known_answer.offline_export_first_draft(known["twin"], known["good"], known["trained"], PROMPTS, k=K,
                                      max_tokens=MAX_TOKENS)
    assert e["first_rate"] == 1.0, e


@pytest.mark.parametrize("how", twin.BREAKAGES)
def test_each_breakage_drops_first_draft_acceptance_offline(known, how):
    r = known_answer.offline_export_first_draft(known["twin"], known["bad"][how], known["trained"], PROMPTS, k=K,
                                      max_tokens=MAX_TOKENS)
    assert r["lossless"] and r["rounds"] > 0 and r["first_rate"] <= 0.1, (how, r)


def test_broken_exports_differ_only_where_named(known):
    good = json.loads((known["good"] / "config.json").read_text())
    bad = json.loads((known["bad"]["layer_ids_minus_one"] / "config.json").read_text())
    assert good["eagle_aux_hidden_state_layer_ids"] == IDS
    assert bad["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in IDS]


def test_no_twin_for_other_families_is_not_run_not_a_pass(tmp_path):
    """A target eaglet cannot build a twin for: the check is not run with the reason, and an export
    whose contract has it unaccepted is not ok."""
    from eaglet.data.target_model import materialise

    ident = materialise({"name": "g", "tiny": {"family": "gemma3_text", "num_hidden_layers": 2}}, tmp_path / "g")
    ident["path"] = str(tmp_path / "g" / "model")
    ch = contract.known_answer_check(ident, [1, 2, 3], {"work_dir": tmp_path / "w"})
    assert ch["ok"] is None and ch["name"] == "vllm.known_answer"
    assert "gemma3_text" in ch["reason"] and "model_type" in ch["reason"]
    assert contract.verdict([ch])["ok"] is False
    assert contract.verdict([dict(ch)], accept_not_run=["vllm.known_answer"])["ok"] is True


def test_known_answer_is_listed_not_run_when_vllm_is_off(tiny_target, tiny_drafter, tmp_path):
    """vllm_check off: vllm.known_answer is one more check that did not run, accepted only by name."""
    from eaglet.export.export import ContractError, export

    ident = Path(tiny_target["path"]).parent / "identity.json"
    with pytest.raises(ContractError, match=r"not run \['vllm.known_answer'\]"):
        export(tiny_drafter, tmp_path / "d", ident, vllm_check=False,
               accept_not_run=list(record.TRAINED_VLLM_CHECKS))
    rep = export(tiny_drafter, tmp_path / "d", ident, vllm_check=False, accept_not_run=list(contract.VLLM_CHECKS))
    assert rep["ok"] and "vllm.known_answer" in [r["name"] for r in rep["not_run"]]


@pytest.mark.vllm
def test_real_vllm_accepts_the_known_answer_and_rejects_each_breakage(known):
    """Real vLLM-CPU, one runner process for the five exports: the good one has its output equal
    to the twin's known chain and every first draft accepted; each broken one ~none, and fails the
    contract's rule (eaglet.export.contract.known_answer.judge, what vllm.known_answer applies)."""
    py = vllm_env.vllm_python()  # VllmEnvMissing fails the test: it needs envs/vllm/setup.sh
    names = ["good", *twin.BREAKAGES]
    dirs = [known["good"], *(known["bad"][h] for h in twin.BREAKAGES)]
    res = known_answer.run_batch(known["twin"]["path"], dirs, PROMPTS, work_dir=known["work"] / "vllm", python=py,
                       k=K, max_tokens=MAX_TOKENS)
    got = {n: known_answer.judge(known["twin"], PROMPTS, r, MAX_TOKENS) for n, r in zip(names, res, strict=True)}
    rates = {n: det.get("first_draft_rate") for n, (_, det) in got.items()}
    print("\n[known answer] first-draft acceptance in vLLM:", rates)
    ok, det = got["good"]
    assert ok and det["first_draft_rate"] == 1.0 and det["output_is_known_chain"], det
    assert res[0]["aux_layers"] == IDS
    for how in twin.BREAKAGES:
        ok, det = got[how]
        assert det["output_is_known_chain"], (how, det)  # lossless: vLLM's verifier, whatever the drafter
        assert det["num_drafts"] > 0 and det["first_draft_rate"] <= 0.1, (how, det)
        assert not ok
        failed = contract.verdict([record.check("vllm.known_answer", ok, det)])["failed"]
        assert failed == ["vllm.known_answer"]
    assert res[twin.BREAKAGES.index("layer_ids_minus_one") + 1]["aux_layers"] == [i - 1 for i in IDS]


def test_known_answer_is_checked_before_the_trained_drafter(tiny_target, tiny_drafter, tmp_path):
    """With the vLLM run on, vllm.known_answer comes first and is a check that can fail (here: no
    vLLM interpreter at the given path, so it fails; it does not pass or vanish)."""
    from eaglet.export.export import export

    ident = Path(tiny_target["path"]).parent / "identity.json"
    export(tiny_drafter, tmp_path / "d", ident, vllm_check=False, accept_not_run=list(contract.VLLM_CHECKS))
    rep = contract.check_export(tmp_path / "d", tiny_target, trained_path=tiny_drafter,
                                vllm={"work_dir": tmp_path / "w", "python": str(tmp_path / "none" / "bin" / "python")})
    names = [c["name"] for c in rep["checks"]]
    assert names.index("vllm.known_answer") == names.index("vllm.load_run") - 1
    known = next(c for c in rep["checks"] if c["name"] == "vllm.known_answer")
    assert known["ok"] is False and "vLLM environment not found" in known["details"]["error"]
    assert "vllm.known_answer" in rep["failed"] and not rep["ok"]
