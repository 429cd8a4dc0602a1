"""P-EAGLE parity with vLLM's own module (eaglet.export.contract.p_eagle_parity): a small random P-EAGLE
drafter for the tiny target (a draft vocabulary of 256 with its d2t, a nonzero random mask_hidden,
EAGLE-3's default norm_before_fc and norm_output, and once without them), exported with p_eagle_format
and loaded by vLLM's Eagle3LlamaForCausalLM with parallel drafting, computes eaglet's parallel round
piece by piece; each broken copy fails it naming the piece (one vLLM interpreter for all cases):
mask_hidden zeroed (mask_fc: what vLLM's counters could not show on the tiny target,
tests/export/test_p_eagle_served.py), another mask token inside the vocabulary (mask_token_id, embed),
the aux layer ids one lower (aux_layers only), fc's rows permuted (fc, mask_fc), gate/up swapped
(layer_out, not the inputs)."""

import dataclasses
import json
import math
import shutil

import torch

from conftest import vllm_env_or_skip
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.drafter.p_eagle import PEagleConfig, PEagleDrafter, save_p_eagle
from eaglet.engines import vllm_env
from eaglet.export.contract.p_eagle_parity import p_eagle_parity_checks
from eaglet.export.p_eagle_format import export_p_eagle, p_eagle_static_problems
from eaglet.target.load import load_target_embedding

LAYER_IDS, K, V_D = [2, 4, 5], 3, 256


def trained(identity: dict, seed: int = 0, norms: bool = True):
    """A random P-EAGLE drafter (weights large enough that every piece moves the drafts, a nonzero
    mask_hidden), a draft vocabulary of V_D target ids; (model, cfg, d2t, t2d)."""
    V = int(identity["vocab_size"])
    cfg = PEagleConfig.from_identity(identity, draft_vocab_size=V_D, layer_ids=LAYER_IDS, mask_token_id=V - 1,
                                     parallel_k=K, norm_before_fc=norms, norm_output=norms)
    torch.manual_seed(seed)
    m = PEagleDrafter(cfg, load_target_embedding(identity["path"]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name == "embed_tokens.weight":
                continue
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1 + 0.3 * torch.randn_like(p))
        m.mask_hidden.copy_(torch.randn_like(m.mask_hidden))
    used = torch.randperm(V)[:V_D].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return m.eval(), cfg, used - torch.arange(V_D), t2d


def broken(d, case: str):
    """The export at ``d`` broken in place as ``case`` names."""
    conf = json.loads((d / "config.json").read_text())
    t = load_tensors(d / "model.safetensors")
    if case == "mask_hidden_zeroed":
        t["mask_hidden"] = torch.zeros_like(t["mask_hidden"])
    elif case == "wrong_mask_token":
        conf["mask_token_id"] = 5  # inside the vocabulary: p_eagle.static cannot refuse it
    elif case == "layer_ids_minus_one":
        conf["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in LAYER_IDS]
    elif case == "fc_rows_permuted":
        t["fc.weight"] = t["fc.weight"].roll(1, 0).contiguous()
    elif case == "gate_up_swapped":  # same shape [I, H]
        g, u = "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"
        t[g], t[u] = t[u], t[g]
    (d / "config.json").write_text(json.dumps(conf))
    save_tensors(d / "model.safetensors", t, metadata={"format": "pt"})
    return d


def test_parity_with_vllm_and_broken_exports_fail(tiny_target, tmp_path):
    """vLLM's own Eagle3LlamaForCausalLM with parallel drafting computes eaglet's parallel round on the
    export (with and without EAGLE-3's default norms), and each broken export fails naming the piece."""
    env = vllm_env_or_skip()
    m, cfg, d2t, t2d = trained(tiny_target)
    m_plain, cfg_plain, d2t_plain, t2d_plain = trained(tiny_target, seed=1, norms=False)
    save_p_eagle(tmp_path / "drafter.safetensors", m, cfg, d2t, t2d)
    save_p_eagle(tmp_path / "plain.safetensors", m_plain, cfg_plain, d2t_plain, t2d_plain)
    good = export_p_eagle(tmp_path / "good", load_tensors(tmp_path / "drafter.safetensors"), cfg, tiny_target)
    plain = export_p_eagle(tmp_path / "plain", load_tensors(tmp_path / "plain.safetensors"), cfg_plain, tiny_target)
    assert torch.equal(load_tensors(good / "model.safetensors")["mask_hidden"], m.mask_hidden.detach())
    assert "d2t" in load_tensors(good / "model.safetensors")  # a draft vocabulary: vLLM maps through it
    cases = ["mask_hidden_zeroed", "wrong_mask_token", "layer_ids_minus_one", "fc_rows_permuted", "gate_up_swapped"]
    dirs = {c: broken(shutil.copytree(good, tmp_path / c), c) for c in cases}
    trained_cfg = dataclasses.asdict(cfg)
    for c in ("mask_hidden_zeroed", "wrong_mask_token", "fc_rows_permuted", "gate_up_swapped"):
        assert p_eagle_static_problems(dirs[c], tiny_target, trained_cfg) == [], c  # only the numbers can tell
    pairs = [(good, m, d2t), (plain, m_plain, d2t_plain)] + [(d, m, d2t) for d in dirs.values()]
    recs = dict(zip(["good", "plain", *cases],
                    p_eagle_parity_checks(pairs, target_layers=tiny_target["num_layers"],
                                          python=vllm_env.vllm_python(env), work_dir=tmp_path / "probe")))
    for name, vocab in (("good", t2d), ("plain", t2d_plain)):
        rec = recs.pop(name)
        det = rec["details"]
        assert rec["ok"] is True, (name, json.dumps(det))
        assert det["aux_layers_vllm"] == LAYER_IDS and det["mask_token_id_vllm"] == tiny_target["vocab_size"] - 1
        assert det["parallel_drafting_vllm"] is True and len(det["drafts"]["vllm"]) == K
        assert max(det[p] for p in ("fc", "mask_fc", "embed", "layer_out", "normed", "aux_out", "logits")) <= 1e-4
        # the drafts are target ids of the draft vocabulary (d2t applied on both sides)
        assert all(vocab[i] for i in det["drafts"]["vllm"]), (name, det["drafts"])
    for case, rec in recs.items():
        assert rec["ok"] is False, (case, rec)
        print(f"[p_eagle parity, {case}] failed {rec['details']['failed']}")
    failed = {c: set(r["details"]["failed"]) for c, r in recs.items()}
    assert "mask_fc" in failed["mask_hidden_zeroed"], failed
    assert not {"fc", "embed", "aux_layers", "mask_token_id"} & failed["mask_hidden_zeroed"], failed
    assert {"mask_token_id", "embed"} <= failed["wrong_mask_token"], failed
    assert not {"fc", "mask_fc"} & failed["wrong_mask_token"], failed
    assert recs["wrong_mask_token"]["details"]["mask_token_id_vllm"] == 5
    assert failed["layer_ids_minus_one"] == {"aux_layers"}
    assert recs["layer_ids_minus_one"]["details"]["aux_layers_vllm"] == [i - 1 for i in LAYER_IDS]
    assert {"fc", "mask_fc"} <= failed["fc_rows_permuted"]
    assert "layer_out" in failed["gate_up_swapped"] and not {"fc", "mask_fc", "embed"} & failed["gate_up_swapped"]


def test_eaglet_round_leaves_the_callers_model_as_it_was(tiny_target):
    """eaglet's side of the check leaves the caller's drafter as it was (its dtype, mode, weights,
    forward and hooks), and its pieces have the probe's shapes (P real entries, K − 1 masked slots,
    logits over the target vocabulary with the draft vocabulary's image finite)."""
    from eaglet.export.contract.p_eagle_parity import eaglet_round, engine_inputs, probe_inputs

    m, cfg, d2t, t2d = trained(tiny_target)
    m = m.to(torch.bfloat16).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    inp = probe_inputs(cfg, m.embed_tokens.weight, context=6)
    ours = eaglet_round(m, inp, d2t)
    assert m.training and m.fc.weight.dtype == torch.bfloat16 and "forward_step" not in vars(m)
    assert not m.norm._forward_hooks and not m.embed_tokens._forward_hooks
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    H, V, T = cfg.hidden_size, cfg.vocab_size, 6 + K - 1
    assert ours["fc"].shape == (6, H) and ours["mask_fc"].shape == (H,) and ours["embed"].shape == (T, H)
    assert ours["layer_out"].shape == ours["normed"].shape == ours["aux_out"].shape == (T, H)
    assert ours["logits"].shape == (K, V) and torch.equal(torch.isfinite(ours["logits"][0]), t2d)
    assert ours["ids"].tolist() == inp["x"][1:].tolist() + [cfg.mask_token_id] * (K - 1)
    assert engine_inputs(inp)["ids"].tolist() == inp["x"][1:].tolist()
