"""The drafter's RoPE: derived from every kind of target config, exported flat, and equal to what
vLLM's own get_rope computes from the exported config.json (the engine is the reference)."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, vllm_env_or_skip
from eaglet.drafter import eagle3
from eaglet.drafter.rope import RopeError, Rotary, drafter_rope, legacy_fields

HEAD_DIM, HEADS = 64, 2
# Target configs as checkpoints write them (transformers 5 rope_parameters or legacy rope_scaling).
TARGETS = {
    "default": {"rope_theta": 10000.0},
    "linear": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 10000.0},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 1024}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
             "rope_theta": 1000000.0},
    # DeepSeek-V3 / Kimi: YaRN with mscale == mscale_all_dim (attention scaling 1)
    "yarn_deepseek": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                          "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                          "original_max_position_embeddings": 1024}},
    "longrope": {"rope_scaling": {"type": "longrope", "original_max_position_embeddings": 1024,
                                  "short_factor": [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)],
                                  "long_factor": [1.5 + 0.1 * i for i in range(HEAD_DIM // 2)]},
                 "rope_theta": 10000.0},
    # Gemma 3: one dict per layer type; the drafter takes full_attention's
    "gemma3": {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # transformers' and vLLM's "dynamic" differ (module docstring): the drafter uses default
    "dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 10000.0},
}
MAX_POS = 4096
POSITIONS = list(range(0, 24)) + list(range(1000, 1012)) + list(range(3000, 3012))


def test_drafter_rope_is_flat_and_keeps_what_the_type_reads():
    got = {k: drafter_rope({**v, "max_position_embeddings": MAX_POS}) for k, v in TARGETS.items()}
    for name, r in got.items():
        assert not any(isinstance(v, dict) for v in r.values()), name
        assert set(r) >= {"rope_type", "rope_theta"}
    assert got["default"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert got["linear"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert got["gemma3"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert got["dynamic"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert got["yarn_deepseek"]["mscale_all_dim"] == 1.0
    # text_config (multimodal checkpoints) is read the same way
    assert drafter_rope({"text_config": TARGETS["llama3"]}) == got["llama3"]
    with pytest.raises(RopeError, match="rope_type"):
        drafter_rope({"rope_parameters": {"rope_type": "mrope_weird", "rope_theta": 1.0}})


def test_scaled_rope_changes_the_rotation():
    """The drafter really applies the scaling (the old drafter applied plain RoPE whatever the
    config said): llama3 / yarn differ from default at the same theta."""
    pos = torch.tensor([POSITIONS])
    cos_d, _ = Rotary({"rope_type": "default", "rope_theta": 500000.0}, HEAD_DIM, HEADS, MAX_POS)(pos, torch.float32)
    r3 = drafter_rope(TARGETS["llama3"])
    cos_3, _ = Rotary(r3, HEAD_DIM, HEADS, MAX_POS)(pos, torch.float32)
    assert (cos_d - cos_3).abs().max() > 1e-2


def _export_config(rope: dict) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HEAD_DIM * HEADS,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
            "max_position_embeddings": MAX_POS, "num_hidden_layers": 1, "vocab_size": 16, "intermediate_size": 8,
            **legacy_fields(rope)}


@pytest.mark.vllm
def test_eaglet_rope_equals_vllm_get_rope_for_every_type(tmp_path):
    """For every rope type: eaglet's rotation of q (what training applies) == vLLM's rotation of
    the same q built from the exported config.json, at positions inside and past the original
    length."""
    env = vllm_env_or_skip()
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor(POSITIONS)
    cases, mine = [], {}
    for name, target in TARGETS.items():
        rope = drafter_rope({**target, "max_position_embeddings": MAX_POS})
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(_export_config(rope)))
        q = torch.randn(len(pos), HEADS * HEAD_DIM, generator=g)
        save_file({"q": q, "pos": pos}, str(d / "in.safetensors"))
        # eaglet's side, as Eagle3Drafter._qkv applies it
        cos, sin = Rotary(rope, HEAD_DIM, HEADS, MAX_POS)(pos[None], torch.float32)
        q_BhTd = q.view(1, len(pos), HEADS, HEAD_DIM).transpose(1, 2)
        mine[name] = eagle3.rope(q_BhTd, cos, sin).transpose(1, 2).reshape(len(pos), -1)
        cases.append(str(d))
    r = subprocess.run([str(env / "bin" / "python"), str(REPO / "tests" / "vllm_rope_probe.py"), *cases],
                       capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    bad = {}
    for name in TARGETS:
        theirs = load_file(str(tmp_path / name / "out.safetensors"))["q_rot"]
        err = float((theirs - mine[name]).abs().max())
        if not err < 1e-3:
            bad[name] = err
    assert not bad, f"eaglet vs vLLM rotation differs (max abs): {bad}\n{r.stdout}"
