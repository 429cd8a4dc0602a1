"""The shapes every plan starts from: the target's, read from its config.json (and the bytes of its
weights), and the drafter's parameter counts for them. Read by the memory plan (eaglet.planner.plan)
and the storage decision (eaglet.planner.storage)."""

from __future__ import annotations

import json
import os
from pathlib import Path

GIB = 1 << 30
TYPICAL_TOKENS = 1500   # tokens per regenerated conversation (the Kimi config's storage comment)


def target_shapes(config: dict, target_config: str | Path | None = None,
                  target_bytes: float | None = None) -> dict:
    """Shapes of the target from its config.json (``target.path`` or ``target_config``), and the
    bytes of its weights: the *.safetensors files on disk (what is loaded, quantised or not) unless
    given; None when neither is known (a config-only checkpoint)."""
    from eaglet.target.load import shape_facts

    path = Path(target_config) if target_config else Path(str(config["target"].get("path"))) / "config.json"
    if not path.is_file():
        raise ValueError(f"target.path: no config.json at {path} to plan from")
    conf = json.loads(path.read_text())
    text = conf.get("text_config") or conf
    s = shape_facts(conf)
    s["moe_intermediate_size"] = int(text.get("moe_intermediate_size") or 0)
    s["experts_per_token"] = int(text.get("num_experts_per_tok") or 0)
    if target_bytes is None:
        files = list(path.parent.glob("*.safetensors"))
        target_bytes = sum(os.path.getsize(f) for f in files) if files else None
    s["weight_bytes"] = None if target_bytes is None else int(target_bytes)
    return s


def drafter_params(s: dict, draft_vocab_size: int) -> dict:
    """Parameter counts of Eagle3Drafter for the target shapes (draft hidden = target hidden):
    ``frozen`` (the shared embedding), ``trainable``, ``cast`` (the linears autocast copies to bf16
    and keeps for backward: all but fc, whose input needs no gradient)."""
    H, V, Vd, Im = s["hidden_size"], s["vocab_size"], draft_vocab_size, s["intermediate_size"]
    qd, kvd = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    attn = 2 * H * (qd + 2 * kvd) + qd * H
    cast = attn + 3 * H * Im + Vd * H
    return {"frozen": V * H, "trainable": 3 * H * H + cast + 4 * H, "cast": cast}
