"""The DFlash export stage (eaglet.export.dflash_export) without an engine: with export.vllm_check
false its vLLM checks and EAGLE-3's without a DFlash counterpart are recorded not run with the
reason; named in accept_not_run the export passes (the directory, reference.json, contract.json
with method dflash), unnamed it fails leaving only contract.failed.json. The real-vLLM contract
runs in tests/workflow/test_dflash_dag.py."""

import json
from pathlib import Path

import pytest

from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, save_dflash
from eaglet.export.contract.dflash_parity import DFLASH_NOT_APPLICABLE, DFLASH_VLLM_CHECKS
from eaglet.export.dflash_export import ContractError, export


@pytest.fixture()
def trained(tiny_target, tmp_path):
    cfg = DFlashConfig.from_identity(tiny_target, num_layers=1, block_size=3, mask_token_id=5,
                                     target_layer_ids=[2, 4, 5])
    path = tmp_path / "drafter.safetensors"
    save_dflash(path, DFlashDrafter(cfg), cfg)
    return path, Path(tiny_target["path"]).parent / "identity.json"


def test_not_run_checks_are_named_or_fail(trained, tmp_path):
    drafter, identity = trained
    names = [*DFLASH_VLLM_CHECKS, *DFLASH_NOT_APPLICABLE]
    rep = export(drafter, tmp_path / "ok", identity, vllm_check=False, accept_not_run=names)
    assert rep["ok"] and rep["method"] == "dflash" and rep["num_speculative_tokens"] == 2
    assert {c["name"]: c["status"] for c in rep["checks"]} == {"dflash.static": "pass",
                                                               **{n: "not run" for n in names}}
    assert all(r["reason"] for r in rep["not_run"])
    out = tmp_path / "ok"
    assert json.loads((out / "contract.json").read_text())["kind"] == "dflash"
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3, 4]
    assert json.loads((out / "reference.json").read_text())["chain"] is None
    with pytest.raises(ContractError, match="loader.sglang"):
        export(drafter, tmp_path / "bad", identity, vllm_check=False, accept_not_run=list(DFLASH_VLLM_CHECKS))
    bad = tmp_path / "bad"
    assert (bad / "contract.failed.json").is_file() and not (bad / "contract.json").exists()
    assert not (bad / "model.safetensors").exists()
