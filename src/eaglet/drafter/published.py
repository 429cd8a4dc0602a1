"""A drafter directory as vLLM loads it, read back into eaglet's drafter: format A of docs/eagle3.md §6
(``config.json`` + ``model.safetensors``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``
offsets and ``t2d``), the format eaglet's export writes (eaglet.export.vllm_format) and peers publish.
Its readers: the export contract reading an export back (eaglet.export.contract.reference.load_exported)
and the trainer continuing a published drafter (``train.init_from``, eaglet.train.init_from).

Only what the format defines is read: the config fields vLLM's ``llama_eagle3`` reads and the tensor
set of §6, each tensor's shape checked against the config (a missing, unexpected or misshapen tensor
is refused by name); ``embed_tokens.weight``, which some drafters ship (vLLM then uses that copy), is
handed back apart for the caller to judge. Format B (speculators) is refused. The aux layer ids are
vLLM's reading: the top-level ``eagle_aux_hidden_state_layer_ids``, else ``eagle_config``'s, else none
(vLLM's default for the target; the caller decides).

``digest`` (the directory's content, for a cache key) needs no torch: the workflow computes it at
parse time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eaglet.base.artifacts import ArtifactError
from eaglet.base.digests import digest_of, file_digest
from eaglet.base.files import read_json

FILES = ("config.json", "model.safetensors")
EMBED = "embed_tokens.weight"
# the config fields a drafter's weights are read by (vLLM's llama_eagle3 reads the same)
NEEDED = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps")


def digest(drafter_dir: str | Path) -> str:
    """The directory's content: the sha256 of config.json's content (keys sorted: a re-indented file
    is the same config) and of model.safetensors' bytes, as one digest (other files, a README or the
    export's contract.json, are not the drafter)."""
    d = Path(drafter_dir)
    missing = [n for n in FILES if not (d / n).is_file()]
    if missing:
        raise ArtifactError(f"{d}: not an EAGLE-3 drafter directory as vLLM loads it (no {' or '.join(missing)})")
    conf = hashlib.sha256(json.dumps(read_json(d / "config.json"), sort_keys=True).encode()).hexdigest()
    return digest_of({"config.json": conf, "model.safetensors": file_digest(d / "model.safetensors")})


def read_config(drafter_dir: str | Path) -> dict:
    """config.json of a format-A directory (format B is refused)."""
    d = Path(drafter_dir)
    if not (d / "config.json").is_file():
        raise ArtifactError(f"{d}: no config.json (not an EAGLE-3 drafter directory as vLLM loads it)")
    conf = read_json(d / "config.json")
    if "speculators_model_type" in conf:
        raise ArtifactError(f"{d}: format B (speculators, {conf.get('architectures')}); eaglet reads format A "
                            "(docs/eagle3.md §6: midlayer.* names, d2t/t2d)")
    missing = [f for f in NEEDED if conf.get(f) is None]
    if missing:
        raise ArtifactError(f"{d}/config.json: no {missing}")
    return conf


def layer_ids(conf: dict) -> list[int] | None:
    """The aux layer ids as vLLM reads them (top level, else eagle_config's); None = absent."""
    ids = conf.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def drafter_config(conf: dict, where: str | Path, ids: list[int] | None = None):
    """eaglet's DrafterConfig of a format-A config.json; ``ids``: the aux layer ids when the config
    holds none (else refused). The RoPE is read as transformers reads a config (rope_parameters, or
    the legacy rope_scaling + rope_theta; eaglet.drafter.rope.drafter_rope)."""
    from eaglet.drafter.eagle3 import DrafterConfig
    from eaglet.drafter.rope import RopeError, drafter_rope

    c = conf
    got = layer_ids(c)
    if got is None and ids is None:
        raise ArtifactError(f"{where}: config.json has no eagle_aux_hidden_state_layer_ids")
    try:
        rope = drafter_rope(c)
    except RopeError as e:
        raise ArtifactError(f"{where}: {e}") from None
    meta, ec = c.get("eaglet") or {}, c.get("eagle_config") or {}  # vLLM reads norm_before_fc in either
    return DrafterConfig(
        hidden_size=c["hidden_size"], target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        num_heads=c["num_attention_heads"], num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
        draft_vocab_size=c.get("draft_vocab_size") or c["vocab_size"],
        layer_ids=got if got is not None else list(ids), rms_norm_eps=c["rms_norm_eps"],
        rope_theta=float(rope["rope_theta"]), rope_parameters=rope,
        hidden_act=c.get("hidden_act", "silu"), max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
        target_digest=str(meta.get("target_digest") or ""), ttt_steps=int(meta.get("ttt_steps") or 1),
        norm_before_fc=bool(ec["norm_before_fc"] if "norm_before_fc" in ec else c.get("norm_before_fc")),
        norm_before_residual=bool(c.get("norm_before_residual")), norm_output=bool(c.get("norm_output")))


def expected_shapes(cfg) -> dict[str, tuple]:
    """The tensors of §6 for a DrafterConfig, with their shapes: eaglet's drafter built on the meta
    device (no memory), less its embedding, plus d2t (a reduced draft vocab) and t2d."""
    import torch

    from eaglet.drafter.eagle3 import Eagle3Drafter

    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    out = {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()}
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"] = (cfg.draft_vocab_size,)
    out["t2d"] = (cfg.vocab_size,)
    return out


def read_tensors(drafter_dir: str | Path, cfg) -> tuple[dict, object, object | None, object | None]:
    """(weights {name: fp32 tensor} exactly the drafter's trainable set, d2t int64, t2d bool or None,
    the directory's own embed_tokens.weight or None), every tensor checked against ``cfg``: a missing,
    unexpected or misshapen one is refused by name, and so is a vocabulary map that is not one
    (target id = i + d2t[i] unique and in range; t2d marks exactly those ids)."""
    import torch

    from eaglet.base.tensors import load_tensors

    path = Path(drafter_dir) / "model.safetensors"
    if not path.is_file():
        raise ArtifactError(f"{path}: missing")
    tensors = load_tensors(path)
    embed = tensors.pop(EMBED, None)
    want = expected_shapes(cfg)
    optional = {"t2d"} | ({"d2t"} if cfg.draft_vocab_size == cfg.vocab_size else set())
    missing = sorted(set(want) - set(tensors) - optional)
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ArtifactError(f"{path}: tensors missing {missing}, unexpected {extra} (for its config.json)")
    bad = {k: (tuple(t.shape), want[k]) for k, t in tensors.items() if tuple(t.shape) != want[k]}
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        bad[EMBED] = (tuple(embed.shape), (cfg.vocab_size, cfg.hidden_size))
    if bad:
        raise ArtifactError(f"{path}: " + "; ".join(f"tensor {k} has shape {list(h)}, its config.json says {list(w)}"
                                                    for k, (h, w) in sorted(bad.items())))
    d2t = tensors.pop("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)).long()
    t2d = tensors.pop("t2d", None)
    ids = torch.arange(cfg.draft_vocab_size) + d2t
    problems = []
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        problems.append(f"d2t maps outside the target vocabulary [0, {cfg.vocab_size})")
    elif ids.unique().numel() != ids.numel():
        problems.append(f"d2t maps {ids.numel() - ids.unique().numel()} draft tokens onto a target token taken")
    elif t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), ids.sort().values):
        problems.append("t2d does not mark exactly the target ids arange(draft_vocab_size) + d2t")
    if problems:
        raise ArtifactError(f"{path}: {'; '.join(problems)}")
    weights = {k: v.float() for k, v in tensors.items()}
    return weights, d2t, None if t2d is None else t2d.bool(), embed
