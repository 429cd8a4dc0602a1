"""The contract check catches each fault a drafter export has shipped with in the wild, and passes
a good export. Faults are injected into a copy of a real export of a random tiny drafter."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, sglang_env_or_skip
from eaglet.export.contract import contract, parity, record, sglang_check, vllm_checks
from eaglet.export.export import export

# Without the real vLLM run its checks did not run: said by name, as the smoke config does
NO_VLLM = list(contract.VLLM_CHECKS)
# A test whose claim is another check's leaves SGLang's own loader out (sglang=False: ~10 s a distinct
# export, most of it importing SGLang), and says so by name; the tests that read loader.sglang keep it.
NO_SGLANG = ["loader.sglang"]


@pytest.fixture(scope="module")
def good(tiny_target, tiny_drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("contract") / "drafter"
    export(tiny_drafter, out, Path(tiny_target["path"]).parent / "identity.json", vllm_check=False,
           speculators=True, accept_not_run=NO_VLLM + [f"speculators.{n}" for n in NO_VLLM])
    return out


def _faulty(good, tmp_path, tensors=None, config=None):
    """A copy of the good export with tensors/config edited by the given functions."""
    d = tmp_path / "faulty"
    shutil.copytree(good, d)
    if tensors:
        t = load_file(d / "model.safetensors")
        tensors(t)
        save_file(t, d / "model.safetensors")
    if config:
        c = json.loads((d / "config.json").read_text())
        config(c)
        (d / "config.json").write_text(json.dumps(c))
    return d


def _check(tiny_target, tiny_drafter, d, sglang=True):
    rep = contract.check_export(d, tiny_target, trained_path=tiny_drafter, sglang=sglang,
                                accept_not_run=NO_VLLM + ([] if sglang else NO_SGLANG))
    if not sglang:  # left out, said by name, never a pass
        sg = next(c for c in rep["checks"] if c["name"] == "loader.sglang")
        assert sg["ok"] is None and sg["accepted"] and "left out" in sg["reason"], sg
    return rep, {c["name"]: c for c in rep["checks"]}


def test_good_export_passes_every_check(good, tiny_target, tiny_drafter):
    rep, by = _check(tiny_target, tiny_drafter, good)
    assert rep["ok"], rep["failed"]
    ran = [c for c in rep["checks"] if c["name"] not in NO_VLLM]
    assert all(c["ok"] is True for c in ran), [(c["name"], c["details"]) for c in ran]
    assert [(r["name"], r["accepted"]) for r in rep["not_run"]] == [(n, True) for n in NO_VLLM]
    assert by["parity.step0"]["details"]["max_abs_logits"] <= 1e-4
    assert by["loader.vllm"]["details"]["ignored"] == ["t2d"]
    # the contract.json the export wrote says the same
    written = json.loads((good / "contract.json").read_text())
    assert written["ok"] and written["speculators"]["ok"]


def test_missing_d2t_is_caught(good, tmp_path, tiny_target, tiny_drafter):
    d = _faulty(good, tmp_path, tensors=lambda t: t.pop("d2t"))
    rep, by = _check(tiny_target, tiny_drafter, d)
    assert not rep["ok"]
    assert by["static.key_set"]["details"]["missing"] == ["d2t"]
    assert not by["static.vocab_map"]["ok"]
    # vLLM itself says nothing: the map silently stays zero; the emulation reports it
    unwritten = by["loader.vllm"]["details"]["unwritten"]
    assert any("draft_id_to_target_id" in u and "identity" in u for u in unwritten)
    # SGLang's own loader leaves hot_token_id None without a word: the check reports it
    assert any(u.startswith("hot_token_id: never set") for u in by["loader.sglang"]["details"]["unset"])


def test_shipped_embed_tokens_is_caught(good, tmp_path, tiny_target, tiny_drafter):
    emb = parity.target_embedding(tiny_target["path"])
    d = _faulty(good, tmp_path, tensors=lambda t: t.update({"embed_tokens.weight": emb.clone()}))
    rep, by = _check(tiny_target, tiny_drafter, d)
    assert not rep["ok"]
    assert by["static.key_set"]["details"]["unexpected"] == ["embed_tokens.weight"]
    assert "embed_tokens" in by["loader.vllm"]["details"]
    assert not by["loader.vllm"]["ok"]
    # SGLang loads it, and its EAGLE-3 worker then gives the drafter the target's: no loader fault there
    sg = by["loader.sglang"]
    assert sg["ok"] and "replaces it with the target's" in sg["details"]["embed_tokens"], sg["details"]


@pytest.mark.parametrize("ids, sglang_ids, why", [
    ([3, 5, 6], [2, 4, 5], "!= trained"),             # off by one, consistently in both places
    ([2, 4, 9], [1, 3, 8], "outside [1, 7]"),         # past the last layer of an 8-layer target
    ([2, 4, 8], [1, 3, 7], "outside [1, 7]"),         # id N: vLLM taps only the inputs of layers 0..N-1
    ([0, 4, 5], [-1, 3, 4], "outside [1, 7]"),        # 0 is the embeddings, not a layer output
    ([2, 4, 5], [2, 4, 5], "SGLang would tap [3, 5, 6]"),  # vLLM convention inside eagle_config
    ([5, 4, 2], [4, 3, 1], "not strictly ascending"),
])
def test_wrong_layer_ids_are_caught(good, tmp_path, tiny_target, tiny_drafter, ids, sglang_ids, why):
    def edit(c):
        c["eagle_aux_hidden_state_layer_ids"] = ids
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sglang_ids

    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, config=edit), sglang=False)
    assert not rep["ok"]
    assert rep["failed"] == ["static.layer_ids"]
    assert any(why in p for p in by["static.layer_ids"]["details"]["problems"]), by["static.layer_ids"]


def test_off_by_one_ids_caught_without_the_trained_file(good, tmp_path, tiny_target):
    # Without the trainer's file the range is checked statically, and an in-range shift is caught by
    # the directory's own reference.json: its config digest, and drafts that are no longer the recorded ones.
    d = _faulty(good, tmp_path, config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 9]))
    rep = contract.check_export(d, tiny_target, sglang=False)
    assert {"static.layer_ids", "reference.weights", "reference.chain"} <= set(rep["failed"]), rep["failed"]
    shutil.rmtree(d)
    def shift(c):  # both engines' ids, consistently: nothing static is wrong
        c["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]

    d = _faulty(good, tmp_path, config=shift)
    rep = contract.check_export(d, tiny_target, sglang=False, accept_not_run=NO_VLLM + NO_SGLANG)
    by = {c["name"]: c for c in rep["checks"]}
    assert sorted(rep["failed"]) == ["reference.chain", "reference.weights"], rep["failed"]
    assert by["reference.weights"]["details"]["changed"] == ["config.json"]


def _permute_lm_head(t):
    t["lm_head.weight"] = t["lm_head.weight"].flip(0).contiguous()


def _permute_fc(t):
    a, b, c = t["fc.weight"].chunk(3, dim=1)  # the three aux layers' blocks, in another order
    t["fc.weight"] = torch.cat([c, a, b], dim=1).contiguous()


def test_the_directory_alone_proves_itself_by_its_reference(good, tiny_target):
    """A user who downloads the directory has no trainer's file: its reference.json (written by the
    export) lets every non-vLLM check run, and the good export passes them all."""
    ref = json.loads((good / "reference.json").read_text())
    assert ref["chain"]["continuation_source"] == "the HF target's greedy output"
    assert ref["chain"]["rounds"] > 0 and len(ref["chain"]["prompt_token_ids"]) == 4
    rep = contract.check_export(good, tiny_target, accept_not_run=NO_VLLM)
    by = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"], rep["failed"]
    assert [c["name"] for c in rep["checks"] if c["ok"] is None] == NO_VLLM  # nothing else left unproven
    assert by["reference.chain"]["details"]["rounds_differing"] == 0
    assert by["parity.step0"]["details"]["against"] == "the directory's own weights"


@pytest.mark.parametrize("edit,tensor", [(_permute_lm_head, "lm_head.weight"), (_permute_fc, "fc.weight")])
def test_the_directory_alone_fails_permuted_lm_head_rows_and_fc_blocks(good, tmp_path, tiny_target, edit, tensor):
    """Copies whose lm_head rows or fc blocks were permuted after training load in every engine (same
    names, shapes, dtypes): the static, loader and parity checks pass them. The directory alone fails
    them by its reference: the tensor's digest, and drafts that are not the recorded ones."""
    rep = contract.check_export(_faulty(good, tmp_path, tensors=edit), tiny_target, sglang=False,
                                accept_not_run=NO_VLLM + NO_SGLANG)
    by = {c["name"]: c for c in rep["checks"]}
    assert sorted(rep["failed"]) == ["reference.chain", "reference.weights"], rep["failed"]
    assert by["reference.weights"]["details"]["changed"] == [tensor]
    assert by["reference.chain"]["details"]["untied_differences"], by["reference.chain"]["details"]


def test_missing_top_level_ids_are_caught(good, tmp_path, tiny_target, tiny_drafter):
    rep, by = _check(tiny_target, tiny_drafter,
                     _faulty(good, tmp_path, config=lambda c: c.pop("eagle_aux_hidden_state_layer_ids")), sglang=False)
    assert rep["failed"] == ["static.layer_ids"]
    assert "falls back" in by["static.layer_ids"]["details"]["problems"][0]


def test_layers0_names_load_in_vllm_and_in_sglangs_own_loader(good, tmp_path, tiny_target, tiny_drafter):
    """speculators' ``layers.0.`` spelling: the emulation once said SGLang drops it; SGLang 0.5.23's own
    loader (it tries a name as-is, then with ``model.``) sets every parameter from it. The key set
    still refuses it: eaglet writes ``midlayer.``, which every version reads."""
    def rename(t):
        for k in [k for k in t if k.startswith("midlayer.")]:
            t["layers.0." + k[len("midlayer."):]] = t.pop(k)

    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, tensors=rename))
    assert not rep["ok"]
    assert by["loader.vllm"]["ok"]  # vLLM reads both spellings
    assert by["loader.sglang"]["ok"], by["loader.sglang"]["details"]
    assert not by["static.key_set"]["ok"]


@pytest.mark.parametrize("name, consequence", [
    ("fc.weight", "uninitialised memory"),
    ("lm_head.weight", "borrows the first V_d rows"),
    ("midlayer.hidden_norm.weight", "left at its initial value"),
])
def test_missing_weight_vllm_would_not_report_is_caught(good, tmp_path, tiny_target, tiny_drafter,
                                                        name, consequence):
    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, tensors=lambda t: t.pop(name)), sglang=False)
    assert not rep["ok"]
    assert by["static.key_set"]["details"]["missing"] == [name]
    v = by["loader.vllm"]
    assert not v["ok"] and not v["details"]["errors"]  # no error: vLLM would load it silently
    assert any(consequence in u for u in v["details"]["unwritten"]), v["details"]


def test_misspelled_or_misshapen_weights_are_loader_errors(good, tmp_path, tiny_target, tiny_drafter):
    def edit(t):
        t["midlayer.mlp.gate_projj.weight"] = t.pop("midlayer.mlp.gate_proj.weight")
        t["norm.weight"] = torch.ones(64)

    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, tensors=edit))
    errs = by["loader.vllm"]["details"]["errors"]
    assert any("gate_projj" in e and "no parameter" in e for e in errs)
    assert any(e.startswith("norm.weight: shape [64]") for e in errs)
    # SGLang's own loader stops on the shape, and its error is the record's
    assert "Attempted to load weight (torch.Size([64]))" in by["loader.sglang"]["details"]["error"]
    assert "norm.weight" in by["static.shapes_dtypes"]["details"]["shapes"]


def test_swapped_tensors_pass_static_but_fail_numeric_parity(good, tmp_path, tiny_target, tiny_drafter):
    def swap(t):
        a, b = "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"
        t[a], t[b] = t[b], t[a]

    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, tensors=swap), sglang=False)
    assert rep["failed"] == ["parity.step0"]
    assert by["parity.step0"]["details"]["max_abs_prenorm_hidden"] > 1e-4


def test_bad_vocab_map_is_caught(good, tmp_path, tiny_target, tiny_drafter):
    def dup(t):
        t["d2t"][1] = t["d2t"][0] - 1  # draft id 1 maps to the same target id as draft id 0

    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, tensors=dup), sglang=False)
    probs = by["static.vocab_map"]["details"]["problems"]
    assert any("not unique" in p for p in probs) and any("nonzero(t2d)" in p for p in probs)


@pytest.mark.parametrize("edit, why", [
    (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda c: c.update(vocab_size=1024), "vocab_size"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), "use_aux_hidden_state"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc"),
])
def test_config_faults_are_caught(good, tmp_path, tiny_target, tiny_drafter, edit, why):
    rep, by = _check(tiny_target, tiny_drafter, _faulty(good, tmp_path, config=edit), sglang=False)
    assert not rep["ok"]
    assert any(why in p for p in by["static.config_fields"]["details"]["problems"])


def test_speculators_export_and_its_norm_before_residual(good, tmp_path, tiny_target, tiny_drafter):
    spec = good.parent / "drafter_speculators"
    rep, by = _check(tiny_target, tiny_drafter, spec)
    assert rep["ok"] and rep["format"] == "B", rep["failed"]
    assert by["parity.step0"]["ok"] and by["loader.vllm"]["ok"]
    assert "loader.sglang" not in by  # SGLang is given format A only: nothing to check here
    # absent, vLLM's speculators conversion turns norm_before_residual on: a silent mismatch
    d = _faulty(spec, tmp_path, config=lambda c: c.pop("norm_before_residual"))
    rep, by = _check(tiny_target, tiny_drafter, d)
    # the parity reference computes what vLLM would (norm before the residual): it differs too
    assert rep["failed"] == ["static.config_fields", "parity.step0"]
    assert any("norm_before_residual" in p for p in by["static.config_fields"]["details"]["problems"])


def test_reference_forward_matches_the_trainer_on_a_second_position_batch(tiny_target, tiny_drafter, good):
    """The reference forward is independent of eaglet.drafter.eagle3; check a different seed/positions too."""
    rep = contract.parity_check(good, tiny_drafter, tiny_target, seed=7)
    assert rep["ok"], rep


def test_train_tau_is_the_validation_chain_tau_of_the_kept_weights():
    """vllm.acceptance is gated on the exact chain τ, never on the optimistic teacher-forced one."""
    row = {"tf_tau": 1.9, "chain_tau": 1.3, "chain_tau_3": 1.4}
    s = {"final_train": {"tf_tau": 2.2}, "final_val": {**row, "chain_tau": 1.1, "chain_tau_3": 1.2}, "best_val": row}
    assert contract.train_tau(s, k=3) == 1.4  # best_val (the kept weights), at the k vLLM runs
    assert contract.train_tau(s, k=5) == 1.3 and contract.train_tau(s) == 1.3  # no such k: chain_tau (k = K)
    assert contract.train_tau({"final_val": {"chain_tau_3": 1.2}}, k=3) == 1.2
    # teacher-forced figures alone (or a summary from before the chain τ) gate nothing
    assert contract.train_tau({"final_train": {"tau": 1.5}, "final_val": {"tau": 1.7, "tf_tau": 1.7}}) is None
    assert contract.train_tau({"final_val": None, "best_val": None}) is None and contract.train_tau({}) is None


# --------------------------------------------------------------------------- SGLang's own loader
@pytest.fixture(scope="session")
def sglang_python():
    """SGLang's environment (envs/sglang), before any export is built: without it the test skips at
    once (and fails under CI)."""
    return sglang_env_or_skip()


def test_sglangs_own_loader_sets_every_parameter_of_the_honest_export(sglang_python, good, monkeypatch):
    """SGLang's LlamaForCausalLMEagle3 and load_weights, run in SGLang's environment on the export's
    file: every parameter and hot_token_id set once and bit-equal to the export's tensors. The runner
    forked from the suite's server of SGLang's venv (its imports done once) reports what a fresh
    interpreter reports."""
    res = sglang_check.run_sglang_loader(good, sglang_python)
    where = Path(os.environ["EAGLET_FORKSERVER_DIR"])
    assert any(str(sglang_python.parent.parent.resolve()) in f.read_text() for f in where.glob("*.log"))
    monkeypatch.delenv("EAGLET_FORKSERVER_DIR")
    fresh = sglang_check.run_sglang_loader(good, sglang_python)
    assert {k: v for k, v in fresh.items() if k != "seconds"} == {k: v for k, v in res.items() if k != "seconds"}
    params = res["params"]
    assert params["model.layers.0.self_attn.qkv_proj.weight"]["expected_from"] == [
        f"midlayer.self_attn.{x}_proj.weight" for x in "qkv"]
    assert params["model.layers.0.mlp.gate_up_proj.weight"]["expected_from"] == [
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"]
    assert params["hot_token_id"]["from"] == ["d2t"]  # hot_token_id = d2t + arange(V_d)
    for name, p in params.items():
        if p["kind"] == "buffer" or name == "model.embed_tokens.weight":  # computed / the target's
            assert not p["from"], (name, p)
            continue
        assert p["equal"] is True and p["unset"] == 0 and p["rewritten"] == 0, (name, p)
    assert list(res["skipped_by_sglang"]) == ["t2d"]  # on purpose: SGLang reads d2t only
    assert all(set_ for n, set_ in res["names"].items() if n != "t2d")
    conf = json.loads((good / "config.json").read_text())
    ch = sglang_check.judge(res, conf)
    assert ch["ok"] and not ch["details"]["silently_dropped"], ch["details"]
    # an SGLang whose drafter read a variant the export does not turn on would run another drafter
    res["reads"]["norm_output"] = True
    assert sglang_check.judge(res, conf)["details"]["problems"] == [
        "SGLang 0.5.23 reads ['norm_output'] as on, which the drafter was not trained with"]


def test_a_weight_sglang_drops_silently_fails_loader_sglang_naming_it(sglang_python, good, tmp_path):
    """A renamed weight: SGLang's load_weights skips a name it does not know without a word, and the
    parameter keeps whatever it held. The check names both."""
    def rename(t):
        t["midlayer.hidden_layernorm.weight"] = t.pop("midlayer.hidden_norm.weight")

    conf = json.loads((good / "config.json").read_text())
    ch = sglang_check.sglang_check(_faulty(good, tmp_path, tensors=rename), conf)
    assert ch["ok"] is False
    assert ch["details"]["silently_dropped"] == ["midlayer.hidden_layernorm.weight"]
    assert [u.split(":")[0] for u in ch["details"]["unset"]] == ["model.layers.0.hidden_norm.weight"]


def test_sglangs_report_is_kept_by_the_bytes_it_read(sglang_python, good, tmp_path, monkeypatch):
    """The same bytes with the same SGLang are judged on the kept report without starting SGLang; one
    changed byte of the file runs SGLang's loader again, and a broken export still fails."""
    monkeypatch.setenv(sglang_check.CACHE_VAR, str(tmp_path / "reports"))
    conf = json.loads((good / "config.json").read_text())
    first = sglang_check.sglang_check(good, conf)
    assert first["ok"] and first["details"]["report"] == "this run"
    assert len(list((tmp_path / "reports").glob("*.json"))) == 1
    again = sglang_check.sglang_check(good, conf)
    assert again["details"]["report"].startswith("cached: SGLang's loader ran on identical bytes at ")
    assert {k: v for k, v in again["details"].items() if k != "report"} == \
        {k: v for k, v in first["details"].items() if k != "report"}

    def scale(t):  # one weight changed: another file, another report
        t["midlayer.hidden_norm.weight"] = t["midlayer.hidden_norm.weight"] * 2

    changed = sglang_check.sglang_check(_faulty(good, tmp_path, tensors=scale), conf)
    assert changed["details"]["report"] == "this run" and changed["ok"]
    assert len(list((tmp_path / "reports").glob("*.json"))) == 2
    for kept in (tmp_path / "reports").glob("*.json"):  # a torn report is not trusted: SGLang runs again
        kept.write_text(kept.read_text()[:100])
    torn = sglang_check.sglang_check(good, conf)
    assert torn["details"]["report"] == "this run" and torn["ok"]
    monkeypatch.setenv(sglang_check.CACHE_VAR, "off")
    assert sglang_check.sglang_check(good, conf)["details"]["report"] == "this run"
    assert len(list((tmp_path / "reports").glob("*.json"))) == 2


def test_without_sglangs_environment_loader_sglang_is_not_run_and_fails_the_contract(
        good, tiny_target, tiny_drafter, tmp_path, monkeypatch):
    monkeypatch.setenv(sglang_check.ENV_VAR, str(tmp_path / "no-sglang"))
    rep, by = _check(tiny_target, tiny_drafter, good)
    sg = by["loader.sglang"]
    assert sg["ok"] is None and "make sglang-env" in sg["reason"] and "no-sglang" in sg["reason"]
    assert not rep["ok"] and not rep["failed"] and rep["not_run_unaccepted"] == ["loader.sglang"]
    assert contract.verdict(rep["checks"], NO_VLLM + ["loader.sglang"])["ok"]  # only when named


def test_under_ci_a_missing_sglang_environment_fails_rather_than_skips(tmp_path):
    test = f"{Path(__file__).relative_to(REPO)}::test_sglangs_own_loader_sets_every_parameter_of_the_honest_export"
    env = {**os.environ, "CI": "1", sglang_check.ENV_VAR: str(tmp_path / "no-sglang")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "skipped" not in p.stdout, p.stdout[-2000:]  # a failed setup: "1 error"
    assert "not run under CI, so failed" in p.stdout and "make sglang-env" in p.stdout, p.stdout[-2000:]


# --------------------------------------------------------------------------- a check that did not run
def test_a_check_that_did_not_run_is_not_a_pass(good, tiny_target, tmp_path):
    """Before, ``ok: None`` ("skipped") counted as a pass: the contract of an export whose numeric
    parity never ran was ``ok``. Now it is listed as not run with its reason, and fails unless
    accepted by name: here a directory alone with no reference.json (another tool's export)."""
    d = _faulty(good, tmp_path)
    (d / "reference.json").unlink()
    rep = contract.check_export(d, tiny_target, accept_not_run=NO_VLLM)
    by = {c["name"]: c for c in rep["checks"]}
    assert not rep["ok"] and not rep["failed"]
    assert rep["not_run_unaccepted"] == ["reference.weights", "reference.chain"]
    p = by["reference.chain"]
    assert p["ok"] is None and p["status"] == "not run" and not p["accepted"]
    assert "no reference.json" in p["reason"]
    rep = contract.check_export(d, tiny_target, accept_not_run=NO_VLLM + list(contract.REFERENCE_CHECKS))
    assert rep["ok"] and {"name": "reference.chain", "reason": p["reason"], "accepted": True} in rep["not_run"]
    assert contract.status_line(p).split()[1:3] == ["NOT", "RUN"]


def test_vllm_check_off_lists_every_real_vllm_check_as_not_run(good, tiny_target, tiny_drafter):
    rep = contract.check_export(good, tiny_target, trained_path=tiny_drafter)
    assert not rep["ok"] and not rep["failed"] and rep["not_run_unaccepted"] == NO_VLLM
    assert all("vllm_check: false" in r["reason"] for r in rep["not_run"])


def test_accepting_never_passes_a_failed_check():
    checks = [record.check("a.x", False), record.not_run("a.y", "why")]
    v = contract.verdict(checks, ["a.x", "a.y"])
    assert not v["ok"] and v["failed"] == ["a.x"] and v["not_run_unaccepted"] == []


# A vLLM 0.x failure log as its runner writes it (worker, engine core, runner: three tracebacks).
VLLM_FAILURE_LOG = """\
(EngineCore pid=7) INFO 11-30 11:08:50 [core.py:99] starting
(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953] WorkerProc failed to start.
(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953] Traceback (most recent call last):
(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953]   File "vllm/rotary.py", line 1, in get_rope
(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953]     rope = get_rope(x, is_neox_style=True)
(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953]            ^^^^^^^^^^^^^^
(Worker pid=9) ERROR 11-30 11:08:54 [mp.py:953] TypeError: get_rope() got an unexpected keyword argument 'is_neox_style'
(EngineCore pid=7) ERROR 11-30 11:08:58 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=7) ERROR 11-30 11:08:58 [core.py:1510]   File "vllm/core.py", line 2, in run
(EngineCore pid=7) ERROR 11-30 11:08:58 [core.py:1510]     raise e from None
(EngineCore pid=7) ERROR 11-30 11:08:58 [core.py:1510] Exception: WorkerProc failed. See stack trace for root cause.
Traceback (most recent call last):
  File "vllm_check_runner.py", line 48, in main
    llm = LLM(**kw)
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_engine_error_puts_the_root_cause_first():
    assert vllm_checks.engine_error(VLLM_FAILURE_LOG) == [
        "TypeError: get_rope() got an unexpected keyword argument 'is_neox_style'",
        "Exception: WorkerProc failed. See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    # no traceback: the last lines that name an error
    assert vllm_checks.engine_error("INFO ok\nValueError: Model does not support EAGLE3 interface\n") == [
        "ValueError: Model does not support EAGLE3 interface"]
    assert vllm_checks.engine_error("all fine\n") == []
    # the engine core in the runner's process (one device): torch.distributed prefixes each line
    assert vllm_checks.engine_error("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", "
                                      "line 1, in f\n[rank0]: RuntimeError: start (0) + length (512) exceeds "
                                      "dimension size (256).\n") == [
        "RuntimeError: start (0) + length (512) exceeds dimension size (256)."]
    # ... twice in an engine started after another in the same process (the contract's one runner)
    assert vllm_checks.engine_error("[rank0]: [rank0]: Traceback (most recent call last):\n[rank0]: [rank0]:   "
                                      "File \"x.py\", line 1, in f\n[rank0]: [rank0]: RuntimeError: bad\n") == [
        "RuntimeError: bad"]


def test_failure_errors_collects_the_error_of_each_failed_check():
    checks = [{"name": "a", "ok": False, "details": {"error": "TypeError: x"}},
              {"name": "b", "ok": True, "details": {"error": "ignored: it passed"}},
              {"name": "c", "ok": False, "details": {"max_abs_logits": 1.0}}]
    assert contract.failure_errors(checks) == {"a": "TypeError: x"}


# The runner's side of run_vllm_batch's protocol without vLLM (what is tested is eaglet's handing out of
# runs to processes, not the engine: every real engine run of the contract is in test_export and
# test_known_answer): each run's marker line, its JSON, and a crash on a drafter named "broken".
_STAND_IN_RUNNER = '''
import argparse, json, os, sys
p = argparse.ArgumentParser()
for f in ("--target", "--drafter", "--prompts", "--out", "--more", "--dtype"):
    p.add_argument(f)
for f in ("--k", "--max-tokens", "--tensor-parallel-size"):
    p.add_argument(f, type=int)
a = p.parse_args(sys.argv[2:])
with open(os.path.join(os.path.dirname(a.out), "processes.txt"), "a") as fh:
    fh.write(str(os.getpid()) + "\\n")
print("importing", flush=True)
for more in [{}] + json.loads(a.more or "[]"):
    r = {**vars(a), **more}
    print("eaglet-runner: start " + r["out"], flush=True)
    print("Using auxiliary layers from speculative config: (1, 2, 3)" if r["drafter"] else "plain", flush=True)
    if r["drafter"] and "broken" in r["drafter"]:
        print("[rank0]: [rank0]: Traceback (most recent call last):", flush=True)
        print("[rank0]: [rank0]: RuntimeError: cannot load", flush=True)
        sys.exit(1)
    json.dump({"token_ids": [[r["max_tokens"]]], "target": r["target"], "drafter": r["drafter"]}, open(r["out"], "w"))
'''


def test_batch_runs_in_one_process_and_starts_afresh_after_a_failure(tmp_path, monkeypatch):
    """run_vllm_batch: runs share one process until one fails; the runs after a failed one go to a
    new process, except one that ``needs`` it (skipped, with the reason); each result has its own
    log section (the engine's error of its own run, the aux layers of its own run)."""
    # the stand-in "python" below is a script, not an interpreter a fork server could run in
    monkeypatch.delenv("EAGLET_FORKSERVER_DIR", raising=False)
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f"#!{sys.executable}\n" + _STAND_IN_RUNNER)
    py.chmod(0o755)
    for name in ("t", "good", "broken"):
        (tmp_path / name).mkdir()

    def run(tag, drafter, needs=None, target="t"):
        return {"tag": tag, "target": tmp_path / target, "drafter": tmp_path / drafter if drafter else None,
                "k": 3, "max_tokens": 7 if drafter else 9, "needs": needs}

    work = tmp_path / "w"
    res = vllm_checks.run_vllm_batch([run("known_answer", "good", target="good"), run("spec", "good"),
                                      run("plain", None, needs="spec")], ["p"], work_dir=work, python=py)
    assert [res[t]["rc"] for t in ("known_answer", "spec", "plain")] == [0, 0, 0]
    assert len((work / "processes.txt").read_text().split()) == 1  # one process for the three
    assert res["known_answer"]["target"] == str(tmp_path / "good") and res["plain"]["drafter"] is None
    assert res["plain"]["token_ids"] == [[9]] and res["spec"]["aux_layers"] == [1, 2, 3]
    assert "aux_layers" not in res["plain"] and "importing" in Path(res["known_answer"]["log"]).read_text()

    work = tmp_path / "w2"
    res = vllm_checks.run_vllm_batch([run("known_answer", "broken", target="good"), run("spec", "good"),
                                      run("plain", None, needs="spec")], ["p"], work_dir=work, python=py)
    assert res["known_answer"]["rc"] == 1 and res["known_answer"]["engine_error"] == ["RuntimeError: cannot load"]
    assert res["spec"]["rc"] == res["plain"]["rc"] == 0  # afresh, in a second process
    assert len((work / "processes.txt").read_text().split()) == 2
    assert "cannot load" not in Path(res["spec"]["log"]).read_text()

    work = tmp_path / "w3"
    res = vllm_checks.run_vllm_batch([run("spec", "broken"), run("plain", None, needs="spec"), run("other", "good")],
                                     ["p"], work_dir=work, python=py)
    assert res["spec"]["rc"] == 1 and res["plain"] == {"rc": None, "skipped": "the spec run failed"}
    assert res["other"]["rc"] == 0 and len((work / "processes.txt").read_text().split()) == 2


def test_the_command_leaves_no_temporary_files_when_it_is_stopped(good, tiny_target, tmp_path):
    """``python -m eaglet.export.contract`` removes its temporary folders (its own and SGLang's loader's)
    when it is stopped (SIGTERM, exit 143) while its checks run (issue 46: it left eaglet-contract-*
    behind every run; a run that ends: test_export's CLI run with vLLM); ``--work-dir`` keeps the files
    where the user asks, and then no temporary folder is made."""
    import signal
    import time

    ident = str(Path(tiny_target["path"]).parent / "identity.json")
    cmd = [sys.executable, "-m", "eaglet.export.contract", str(good), "--identity", ident,
           "--out", str(tmp_path / "rep.json")]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(x.name.startswith("eaglet-contract-") for x in tmp.iterdir()):
        assert proc.poll() is None and time.time() < deadline, "the command ended before its folder was made"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, proc.stderr.read()[-2000:]
    assert list(tmp.iterdir()) == []
    kept = tmp_path / "kept"
    p = subprocess.run(cmd + ["--work-dir", str(kept), "--no-sglang"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1 and kept.is_dir() and list(tmp.iterdir()) == []
