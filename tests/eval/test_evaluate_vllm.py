"""The vLLM evaluation stage (eaglet.eval.evaluate_vllm) on synthetic counts: vLLM's acceptance against the
offline chain's; an offline.json of other prompts is refused. (Its real-vLLM run: test_evaluate.py.)"""

import pytest


# --------------------------------------------------------------------------- vLLM vs offline (synthetic counts)
def _vllm_runs(accepted_per_pos: list[int], drafts: int) -> list[dict]:
    """The runner's output for a plain run and one at k=2 on one set (what summarise reads)."""
    toks = [[1, 2, 3]]
    plain = {"tag": "plain", "k": None, "iomp": False, "startup_s": 1.0,
             "sets": {"mtbench": {"seconds": 2.0, "output_tokens": 3, "token_ids": toks}}}
    spec = {"tag": "k2", "k": 2, "iomp": False, "startup_s": 1.0,
            "sets": {"mtbench": {"seconds": 1.0, "output_tokens": 3, "token_ids": toks, "spec_decode": {
                "num_drafts": drafts, "num_draft_tokens": 2 * drafts, "num_accepted_tokens": sum(accepted_per_pos),
                "num_accepted_tokens_per_pos": accepted_per_pos}}}}
    return [plain, spec]


OFFLINE_K2 = {"sets": {"mtbench": {"tau_chain": {"2": 1.9},
                                   "chain_per_pos": {"2": {"drafts": 100, "drafted_per_pos": [100, 98],
                                                           "accepted_per_pos": [60, 30]}}}},
              "per_prompt": [{"set": "mtbench", "id": "mtbench/81", "tokens": [1, 2, 3]}]}


def test_vllm_acceptance_beyond_sampling_error_fails_the_stage(tmp_path):
    """It used to log a warning and write vllm.json; now the stage fails with both numbers."""
    from eaglet.eval.evaluate_vllm import AgreementError, finish, summarise

    o = {"agreement_alpha": 0.001}
    # within sampling error: 55/100 vs 60/100 and 27/100 vs 30/98 pass
    ok = summarise(_vllm_runs([55, 27], 100), OFFLINE_K2, o)
    assert ok["offline_agreement"]["pass"] and len(ok["offline_agreement"]["tests"]) == 2
    finish(ok, tmp_path)
    assert (tmp_path / "vllm.json").exists()
    # a shifted d2t or a wrong layer: ~nothing accepted where the offline simulator accepts 60 %
    bad = summarise(_vllm_runs([2, 0], 100), OFFLINE_K2, o)
    assert not bad["offline_agreement"]["pass"]
    with pytest.raises(AgreementError, match=r"vLLM accepted 2/100 \(0.020\), offline chain 60/100 \(0.600\)") as e:
        finish(bad, tmp_path)
    assert "tau vLLM 1.020 vs offline chain 1.900" in str(e.value) and "Bonferroni" in str(e.value)
    assert (tmp_path / "vllm.failed.json").exists() and not (tmp_path / "vllm.json").exists()


def test_vllm_stage_refuses_an_offline_json_of_other_prompts():
    from eaglet.eval.evaluate_vllm import VllmError, same_prompts

    same_prompts([{"set": "mtbench", "id": "mtbench/81"}], OFFLINE_K2)
    with pytest.raises(VllmError, match="other prompts"):
        same_prompts([{"set": "mtbench", "id": "mtbench/91"}], OFFLINE_K2)
