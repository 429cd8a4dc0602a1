"""The drafter's rotary embedding: one flat RoPE config, trained with and exported as the same thing.

The drafter is a one-layer Llama for every target (docs/eagle3.md §10). Its RoPE is derived from the
target's config once (:func:`drafter_rope`), stored in the drafter's config, written into the
exported ``config.json`` (``rope_parameters`` plus the legacy ``rope_theta``/``rope_scaling`` that
SGLang reads), and applied in training through transformers' own Llama rotary class
(:class:`Rotary`), i.e. exactly what that config means to transformers, which is also the config
object vLLM builds its ``get_rope`` from. ``tests/drafter/test_rope.py`` checks eaglet's cos/sin against
vLLM's ``get_rope`` for every rope type.

Choices, each because an engine reads the target's own value differently or not at all:
- per-layer-type dicts (Gemma 3: ``full_attention``/``sliding_attention``) → the
  ``full_attention`` entry: vLLM's ``get_rope`` takes one flat dict (a nested one crashes it with
  ``unhashable type: 'dict'``), and the drafter's one layer attends over the whole context;
- ``dynamic`` → ``default`` with the same theta: transformers rescales the base only past the
  original length, vLLM rescales it for every position, so the two engines disagree on what
  "dynamic" means; below the original length transformers' dynamic *is* default;
- ``longrope`` → both factor lists set to the target's ``short_factor`` and the attention scaling
  written out (``attention_factor`` for transformers, ``short_mscale``/``long_mscale`` for vLLM):
  transformers switches lists by the current sequence length, vLLM by the server's
  ``max_model_len``, so only one list makes both engines rotate alike; the drafter is trained
  inside the original length, where the short list applies;
- ``partial_rotary_factor``, ``mrope_*`` → dropped: the drafter rotates its whole head.
"""

from __future__ import annotations

import math

import torch

KNOWN = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Keys each rope type reads (transformers' RopeParameters docs; vLLM's get_rope reads the same).
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor",
                 "factor"),
}


class RopeError(ValueError):
    """The target's RoPE cannot be expressed as one flat config both engines read the same way."""


def target_rope(target_conf: dict) -> dict:
    """The target's RoPE as one dict with ``rope_type`` and ``rope_theta`` (legacy or v5 config,
    top level or ``text_config``); per-layer-type dicts are returned as they are."""
    text = target_conf.get("text_config") or target_conf
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope = {k: v for k, v in dict(rope).items()}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return rope  # per layer type
    kind = rope.pop("type", None)
    rope["rope_type"] = rope.get("rope_type") or kind or "default"
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = float(text.get("rope_theta") or 10000.0)
    return rope


def drafter_rope(target_conf: dict) -> dict:
    """The flat RoPE config of the drafter for this target (see the module docstring)."""
    rope = target_rope(target_conf)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        pick = rope.get("full_attention") or rope[sorted(rope)[0]]
        rope = target_rope({"rope_parameters": pick, "rope_theta": pick.get("rope_theta")})
    kind = rope["rope_type"]
    if kind == "dynamic":
        kind = "default"
    if kind not in _KEYS:
        raise RopeError(f"target rope_type {rope['rope_type']!r} is not one the drafter supports "
                        f"({', '.join(KNOWN)})")
    out = {"rope_type": kind, "rope_theta": float(rope["rope_theta"])}
    for k in _KEYS[kind]:
        if rope.get(k) is not None:
            out[k] = rope[k]
    if kind == "longrope":
        text = target_conf.get("text_config") or target_conf
        orig = int(out["original_max_position_embeddings"])
        factor = float(out.get("factor") or (text.get("max_position_embeddings") or orig) / orig)
        scale = out.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        out.update(long_factor=list(out["short_factor"]), attention_factor=float(scale),
                   short_mscale=float(scale), long_mscale=float(scale))
    return out


def legacy_fields(rope: dict) -> dict:
    """``rope_theta`` + ``rope_scaling`` (null for default) as pre-v5 transformers and SGLang read
    them, and ``rope_parameters`` as transformers >= 5 (and so vLLM) read it: the same content."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"],
            "rope_scaling": None if rope["rope_type"] == "default" else {**scaling, "type": rope["rope_type"]},
            "rope_parameters": dict(rope)}


def llama_config(rope: dict, head_dim: int, num_heads: int, max_position_embeddings: int):
    """A transformers LlamaConfig holding just what its rotary class reads."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=head_dim * num_heads, num_attention_heads=num_heads, head_dim=head_dim,
                       num_key_value_heads=num_heads, max_position_embeddings=int(max_position_embeddings),
                       rope_parameters=dict(rope), num_hidden_layers=1, vocab_size=8, intermediate_size=8)


class Rotary(torch.nn.Module):
    """cos/sin for positions, computed by transformers' ``LlamaRotaryEmbedding`` from ``rope``."""

    def __init__(self, rope: dict, head_dim: int, num_heads: int, max_position_embeddings: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rope = dict(rope)
        self.impl = LlamaRotaryEmbedding(llama_config(rope, head_dim, num_heads, max_position_embeddings))

    def forward(self, pos_BT: torch.Tensor, dtype: torch.dtype):
        """-> (cos_BTd, sin_BTd) in ``dtype`` (attention scaling applied, as transformers does)."""
        probe = torch.empty(0, dtype=torch.float32, device=pos_BT.device)
        cos, sin = self.impl(probe, pos_BT.long())
        return cos.to(dtype), sin.to(dtype)

