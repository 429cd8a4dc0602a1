"""Run in the vLLM venv: apply vLLM's own rotary embedding (get_rope over the config as vLLM's
Llama reads it) to the q of each case folder; write the rotated q next to it.

    envs/vllm/.venv/bin/python tests/vllm_rope_probe.py CASE_DIR [CASE_DIR ...]

Each CASE_DIR holds config.json (an exported drafter config) and in.safetensors (q [T, h*d],
pos [T]); out.safetensors gets q_rot. No eaglet imports: this is the engine's side.
"""

import sys
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

for case in sys.argv[1:]:
    c = AutoConfig.from_pretrained(case)
    t = load_file(f"{case}/in.safetensors")
    vc = VllmConfig()
    # LongRoPE reads the server's max_model_len (it picks its factor list by it): a long server
    object.__setattr__(vc, "model_config", SimpleNamespace(max_model_len=c.max_position_embeddings))
    with set_current_vllm_config(vc):
        # exactly LlamaAttention._init_rotary_emb of vLLM's llama.py
        rot = get_rope(c.head_dim, max_position=c.max_position_embeddings,
                       rope_parameters=getattr(c, "rope_parameters", None), is_neox_style=True,
                       dtype=torch.float32)
    q = t["q"].clone()
    fwd = getattr(rot, "forward_native", rot.forward)  # CustomOps have forward_native; LongRoPE is a plain module
    q_rot, _ = fwd(t["pos"], q, q.clone())
    save_file({"q_rot": q_rot.contiguous(), "kind": torch.tensor([0])}, f"{case}/out.safetensors",
              metadata={"class": type(rot).__name__})
    print(case, type(rot).__name__)
