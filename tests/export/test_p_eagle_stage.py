"""The P-EAGLE export stage (eaglet.export.p_eagle_export) without an engine: with export.vllm_check
false its vLLM checks and the checks not built for the kind are recorded not run with the reason;
named in accept_not_run the export passes (the directory, reference.json, contract.json with
parallel_drafting), unnamed it fails leaving only contract.failed.json; a drafter trained for another
target is refused. The real-vLLM contract runs in tests/workflow/test_p_eagle_dag.py,
tests/export/test_p_eagle_served.py and (p_eagle.parity) tests/export/test_p_eagle_parity.py."""

import json
from pathlib import Path

import pytest
from test_p_eagle_export import make_p_eagle

from eaglet.base.artifacts import ArtifactError
from eaglet.export.p_eagle_export import ContractError, export
from eaglet.export.p_eagle_format import P_EAGLE_NOT_BUILT, P_EAGLE_VLLM_CHECKS


def test_not_run_checks_are_named_or_fail(tiny_target, tmp_path):
    drafter = tmp_path / "drafter.safetensors"
    make_p_eagle(tiny_target, drafter, k=2, mask_token_id=5)
    identity = Path(tiny_target["path"]).parent / "identity.json"
    names = [*P_EAGLE_VLLM_CHECKS, *P_EAGLE_NOT_BUILT]
    assert "p_eagle.parity" in P_EAGLE_VLLM_CHECKS and "p_eagle.parity" not in P_EAGLE_NOT_BUILT
    rep = export(drafter, tmp_path / "ok", identity, vllm_check=False, accept_not_run=names)
    assert rep["ok"] and rep["parallel_drafting"] and rep["num_speculative_tokens"] == 2 and rep["mask_token_id"] == 5
    status = {c["name"]: c["status"] for c in rep["checks"]}
    assert {n: status.pop(n) for n in names} == {n: "not run" for n in names}
    assert set(status.values()) == {"pass"} and "p_eagle.static" in status and "static.layer_ids" in status
    assert all(r["reason"] for r in rep["not_run"])
    out = tmp_path / "ok"
    conf = json.loads((out / "config.json").read_text())
    assert conf["parallel_drafting"] is True and conf["mask_token_id"] == 5 and conf["eaglet"]["kind"] == "p_eagle"
    assert json.loads((out / "contract.json").read_text())["kind"] == "p_eagle"
    assert json.loads((out / "reference.json").read_text())["chain"] is None
    with pytest.raises(ContractError, match="loader.sglang"):
        export(drafter, tmp_path / "bad", identity, vllm_check=False, accept_not_run=list(P_EAGLE_VLLM_CHECKS))
    bad = tmp_path / "bad"
    assert sorted(p.name for p in bad.iterdir()) == ["contract.failed.json"]


def test_a_drafter_of_another_target_is_refused(tiny_target, tmp_path):
    drafter = tmp_path / "drafter.safetensors"
    other = {**tiny_target, "digest": "0" * 64}
    make_p_eagle(other, drafter)
    with pytest.raises(ArtifactError, match="trained for target"):
        export(drafter, tmp_path / "out", Path(tiny_target["path"]).parent / "identity.json", vllm_check=False)
