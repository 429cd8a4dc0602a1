"""The DFlash export (eaglet.export.dflash_format): config.json and model.safetensors exactly as
docs/block-drafters.md §2, the tensors the trainer's, and the static check refusing what vLLM would
mis-serve (an eagle_config carried along, DFlash ids off the target, a head shipped)."""

import json

import pytest
import torch
from safetensors import safe_open

from eaglet.base.files import write_json
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter
from eaglet.export.dflash_format import dflash_static_check, dflash_static_problems, export_dflash

V, H = 101, 64


def tiny_cfg() -> DFlashConfig:
    return DFlashConfig(hidden_size=H, target_hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=32,
                        intermediate_size=128, num_layers=2, vocab_size=V, target_layer_ids=[2, 4],
                        num_target_layers=5, mask_token_id=7, block_size=4, rope_theta=10000.0,
                        target_digest="abc")


def exported(tmp_path):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    state = m.state_dict()
    state["fc.weight"] = state["fc.weight"].T.contiguous().T  # a Fortran-ordered tensor is written right
    return cfg, m, export_dflash(tmp_path / "d", state, cfg, {"bos_token_id": 1, "eos_token_id": 2})


def test_config_and_tensors(tmp_path):
    """The export's config.json and tensors are docs/block-drafters.md section 2's, fp32, equal to the trained
    ones, and pass the static check."""
    cfg, m, d = exported(tmp_path)
    conf = json.loads((d / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3]}  # eaglet ids − 1
    assert (conf["block_size"], conf["num_target_layers"], conf["num_hidden_layers"]) == (4, 5, 2)
    assert (conf["num_attention_heads"], conf["num_key_value_heads"], conf["head_dim"]) == (2, 1, 32)
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert conf["rope_theta"] == 10000.0 and conf["eaglet"]["num_speculative_tokens"] == 3
    assert not {"eagle_config", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size"} & set(conf)
    t = load_tensors(d / "model.safetensors")
    assert set(t) == set(m.state_dict())
    assert not any(k.startswith(("embed_tokens", "lm_head", "d2t", "t2d", "mask_hidden")) for k in t)
    for k, v in m.state_dict().items():
        assert torch.equal(t[k], v.float()), k
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert dflash_static_problems(d) == [] and dflash_static_check(d)["ok"] is True
    assert torch.equal(t["layers.0.self_attn.k_norm.weight"], t["layers.1.self_attn.k_norm.weight"])
    with pytest.raises(ValueError, match="missing"):
        export_dflash(tmp_path / "e", {k: v for k, v in m.state_dict().items() if k != "norm.weight"}, cfg)


@pytest.mark.parametrize("case", ["eagle_config", "top_level_ids", "ids_past_target", "mask_out_of_vocab",
                                  "lm_head_shipped", "layer_missing", "wrong_fc_width", "k_norm_differs"])
def test_static_check_refuses(tmp_path, case):
    """The static check refuses each export vLLM would mis-serve."""
    _, _, d = exported(tmp_path)
    conf = json.loads((d / "config.json").read_text())
    t = load_tensors(d / "model.safetensors")
    if case == "eagle_config":
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3]}
    elif case == "top_level_ids":
        conf["eagle_aux_hidden_state_layer_ids"] = [2, 4]
    elif case == "ids_past_target":
        conf["dflash_config"]["target_layer_ids"] = [2, 5]  # eaglet ids written as DFlash ids: 5 > L − 1
    elif case == "mask_out_of_vocab":
        conf["dflash_config"]["mask_token_id"] = V
    elif case == "lm_head_shipped":
        t["lm_head.weight"] = torch.zeros(V, H)
    elif case == "layer_missing":
        t = {k: v for k, v in t.items() if not k.startswith("layers.1.")}
    elif case == "k_norm_differs":
        t["layers.1.self_attn.k_norm.weight"] = t["layers.1.self_attn.k_norm.weight"] + 0.5
    elif case == "wrong_fc_width":
        t["fc.weight"] = torch.zeros(H, 3 * H)
    write_json(d / "config.json", conf)
    save_tensors(d / "model.safetensors", t, metadata={"format": "pt"})
    problems = dflash_static_problems(d)
    assert problems, case
    assert dflash_static_check(d)["ok"] is False
