"""The exported drafter's two formats, written from the trainer's file (a library: the export stage
eaglet.export.export and the known-answer check eaglet.export.contract.known_answer write with it).

Format A (docs/eagle3.md §6, vLLM native and SGLang) → ``config.json`` + ``model.safetensors``:
``midlayer.*`` names, ``d2t`` offsets (int64), ``t2d`` (bool), no ``embed_tokens``, aux layer ids in
vLLM convention at top level. Format B (speculators, ``Eagle3Speculator``, ``layers.0.*`` names,
``norm_before_residual: false`` written explicitly).

The eagle_config layer ids: vLLM 0.32 reads the top-level ``eagle_aux_hidden_state_layer_ids``
(residual stream entering layer j) and looks at ``eagle_config`` only when the top level is absent;
SGLang reads only ``eagle_config`` and adds 1 (its ids count "output of layer i"). So the top level
holds the trained vLLM ids and ``eagle_config`` the same physical layers in SGLang's count (id - 1);
the contract checks that both engines end up tapping the trained layers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.files import write_json
from eaglet.base.tensors import load_tensors, save_tensors
from eaglet.export.contract import static_checks
from eaglet.export.contract.static_checks import VARIANTS, trained_config
from eaglet.target.load import validate_layer_ids

# Weights stay fp32 (the trainer's dtype): engines cast at load time, and the numeric parity
# check compares the exported tensors with the trained ones at 1e-4.
DTYPE = "float32"


# --------------------------------------------------------------------------- configs
def _rope_fields(cfg: dict) -> dict:
    """The drafter's own RoPE (eaglet.drafter.rope: what it was trained with), as rope_parameters and the
    legacy rope_theta/rope_scaling pair: one flat config every engine reads the same way."""
    # imported here: the workflow reads this module's names when it parses, and rope brings torch
    from eaglet.drafter.rope import legacy_fields

    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    return legacy_fields(rope)


def _layer_config(cfg: dict, target_conf: dict, dtype: str) -> dict:
    """The Llama fields shared by both formats."""
    return {"model_type": "llama", "hidden_size": cfg["hidden_size"], "num_hidden_layers": 1,
            "num_attention_heads": cfg["num_heads"], "num_key_value_heads": cfg["num_kv_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
            "hidden_act": cfg["hidden_act"], "rms_norm_eps": cfg["rms_norm_eps"],
            "max_position_embeddings": cfg["max_position_embeddings"],
            **_rope_fields(cfg),
            "vocab_size": cfg["vocab_size"], "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
            "bos_token_id": target_conf.get("bos_token_id"), "eos_token_id": target_conf.get("eos_token_id")}


def vllm_config(cfg: dict, identity: dict, target_conf: dict, dtype: str = DTYPE) -> dict:
    """config.json of format A (docs/eagle3.md §6)."""
    ids = list(cfg["layer_ids"])
    conf = {"architectures": [static_checks.ARCH_A], **_layer_config(cfg, target_conf, dtype),
            "draft_vocab_size": cfg["draft_vocab_size"]}
    if cfg["target_hidden_size"] != cfg["hidden_size"]:
        conf["target_hidden_size"] = cfg["target_hidden_size"]
    conf["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM: residual stream entering layer j
    # trained variants, top level (vLLM's llama_eagle3 reads them there); written only when set, so
    # the default drafter's config.json is what it always was
    conf.update({f: True for f in VARIANTS if cfg.get(f)})
    # SGLang reads only these and taps id + 1 (see the module docstring)
    conf["eagle_config"] = {"use_aux_hidden_state": True,
                            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}
    conf["eaglet"] = {"target_name": identity.get("name"), "target_digest": cfg.get("target_digest"),
                      "layer_ids_vllm": ids, "ttt_steps": cfg.get("ttt_steps")}
    return conf


def speculators_config(cfg: dict, identity: dict, target_conf: dict, k: int, dtype: str = DTYPE) -> dict:
    """config.json of format B (vllm-project/speculators ``Eagle3Speculator``)."""
    return {"architectures": [static_checks.ARCH_B], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": str(identity["path"]),
                             "architectures": [identity.get("architecture", "LlamaForCausalLM")]}},
            "transformer_layer_config": _layer_config(cfg, target_conf, dtype),
            "draft_vocab_size": cfg["draft_vocab_size"],
            "target_hidden_size": cfg["target_hidden_size"] if cfg["target_hidden_size"] != cfg["hidden_size"]
            else None,
            # written explicitly: absent, vLLM's speculators conversion defaults it to True
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
            "norm_output": bool(cfg.get("norm_output", False)),
            "eagle_aux_hidden_state_layer_ids": list(cfg["layer_ids"]),
            "tie_word_embeddings": False, "torch_dtype": dtype}


# --------------------------------------------------------------------------- tensors
def read_trained(drafter_path: str | Path, identity: dict) -> tuple[dict, dict]:
    """The trainer's tensors and DrafterConfig, checked against the target."""
    cfg = trained_config(drafter_path)
    tensors = load_tensors(drafter_path)
    want = set(static_checks.expected_tensors(_flat(cfg))) | {"d2t"}
    have = set(tensors)
    if have != want:
        raise ArtifactError(f"{drafter_path}: tensors missing {sorted(want - have)}, "
                            f"unexpected {sorted(have - want)}")
    if cfg.get("target_digest") and cfg["target_digest"] != identity["digest"]:
        raise ArtifactError(f"{drafter_path}: trained for target digest {cfg['target_digest'][:12]}, "
                            f"but the target is {identity['digest'][:12]}")
    for key, ikey in (("vocab_size", "vocab_size"), ("target_hidden_size", "hidden_size")):
        if cfg[key] != identity[ikey]:
            raise ArtifactError(f"{drafter_path}: {key} {cfg[key]} != target {ikey} {identity[ikey]}")
    validate_layer_ids(cfg["layer_ids"], identity["num_layers"])
    return tensors, cfg


def _flat(cfg: dict) -> dict:
    """A DrafterConfig in HF config field names, for static_checks.expected_tensors."""
    return {"hidden_size": cfg["hidden_size"], "target_hidden_size": cfg["target_hidden_size"],
            "num_attention_heads": cfg["num_heads"], "num_key_value_heads": cfg["num_kv_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
            "vocab_size": cfg["vocab_size"], "draft_vocab_size": cfg["draft_vocab_size"],
            "norm_before_fc": bool(cfg.get("norm_before_fc", False))}


def export_tensors(tensors: dict, cfg: dict, layer_prefix: str = "midlayer", dtype: str = DTYPE) -> dict:
    import torch

    out = {}
    for name, t in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        if name.startswith("midlayer."):
            name = layer_prefix + name[len("midlayer"):]
        out[name] = t.to(getattr(torch, dtype)).contiguous()
    d2t = tensors["d2t"].to(torch.int64)
    if cfg["draft_vocab_size"] != cfg["vocab_size"]:
        out["d2t"] = d2t
    elif bool(d2t.any()):
        raise ValueError("draft vocab = target vocab but d2t is not the identity; vLLM cannot load that")
    out["t2d"] = tensors["t2d"].to(torch.bool)
    return out


def write_dir(d: Path, conf: dict, tensors: dict) -> None:
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    write_json(d / "config.json", conf)
    save_tensors(d / "model.safetensors", tensors, metadata={"format": "pt"})
